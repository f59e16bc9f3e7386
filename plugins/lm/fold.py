"""Folding the offline norms of the Llama-style decoder (``unnorm.fold_by_plan``).

Where a norm is read only by linear layers, its inference affine folds into them: a layer's
input norm into q, k and v (RoPE rotates q and k after their projection, bias included, so
the attention is unchanged), the MLP's input norm into gate and up, the final norm into
``lm_head``. A norm whose output is the residual stream or is added to it (Post-LN's
add-and-norm, Peri-LN's output norms, Peri-LN's embedding norm) has no linear consumer and
becomes a frozen affine. DyT keeps its ``tanh(alpha x)`` wherever it sits.
"""
from __future__ import annotations

from torch import nn

import unnorm

from .model import PlacedDecoderLayer

#: a layer site's linear readers, relative to the layer; sites not listed feed the stream
SITE_READERS = {
    "input_layernorm": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
    "pre_feedforward_layernorm": ("mlp.gate_proj", "mlp.up_proj"),
}
#: Pre-LN's post_attention_layernorm is the MLP's input norm; in Peri-LN and Post-LN it
#: normalises the attention's output or the stream
MLP_INPUT_SITE = {"pre": "post_attention_layernorm", "peri": "pre_feedforward_layernorm"}


def fold_plan(model: nn.Module) -> dict[str, list[str]]:
    """Each norm of a ``build_lm`` model -> the linear layers reading its output."""
    plan: dict[str, list[str]] = {}
    for index, layer in enumerate(model.model.layers):
        if not isinstance(layer, PlacedDecoderLayer):
            raise TypeError(f"model.layers.{index} is a {type(layer).__name__}: build the model "
                            "with plugins.lm.build_lm")
        prefix = f"model.layers.{index}"
        for name, module in layer.named_children():
            if not isinstance(module, unnorm.ChannelNorm):
                continue
            site = "pre_feedforward_layernorm" if name == MLP_INPUT_SITE.get(layer.placement) else name
            readers = SITE_READERS.get(site, ()) if layer.placement != "post" else ()
            plan[f"{prefix}.{name}"] = [f"{prefix}.{reader}" for reader in readers]
    if isinstance(model.model.norm, unnorm.ChannelNorm):
        plan["model.norm"] = ["lm_head"]
    embedding_norm = getattr(model.model.embed_tokens, "norm", None)
    if isinstance(embedding_norm, unnorm.ChannelNorm):
        plan["model.embed_tokens.norm"] = []
    return plan


def fold_lm(model: nn.Module) -> dict[str, int]:
    """Fold every offline norm (and DyT's affine) of an eval-mode ``build_lm`` model in place;
    returns the counts of ``unnorm.fold_by_plan``. A tied head is refused: folding the final
    norm into it would change the embedding."""
    if model.config.tie_word_embeddings and isinstance(model.model.norm, unnorm.ChannelNorm):
        raise ValueError("lm_head is tied to the embedding: folding the final norm into it would "
                         "change the embedding too; build the model with tie_word_embeddings=false")
    return unnorm.fold_by_plan(model, fold_plan(model))
