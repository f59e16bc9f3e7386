"""Folding the offline norms of the Llama-style decoder (``unnorm.fold_by_plan``).

Where a norm is read only by linear layers, its inference affine folds into them: a layer's
input norm into q, k and v (RoPE rotates q and k after their projection, bias included, so
the attention is unchanged), the MLP's input norm into gate and up, the final norm into
``lm_head``. A norm whose output is the residual stream or is added to it (Post-LN's
add-and-norm, Peri-LN's output norms, Peri-LN's embedding norm) has no linear consumer and
becomes a frozen affine. DyT keeps its ``tanh(alpha x)`` wherever it sits.
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import nn

import unnorm

from .model import PlacedDecoderLayer

_QKV = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj")
_GATE_UP = ("mlp.gate_proj", "mlp.up_proj")
#: per layer placement, the norm sites read only by linear layers (relative to the layer);
#: every other site feeds the residual stream
SITE_READERS = {
    "pre": {"input_layernorm": _QKV, "post_attention_layernorm": _GATE_UP},
    "peri": {"input_layernorm": _QKV, "pre_feedforward_layernorm": _GATE_UP},
    "post": {},
}


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
            readers = SITE_READERS[layer.placement].get(name, ())
            plan[f"{prefix}.{name}"] = [f"{prefix}.{reader}" for reader in readers]
    if isinstance(model.model.norm, unnorm.ChannelNorm):
        plan["model.norm"] = ["lm_head"]
    embedding_norm = getattr(model.model.embed_tokens, "norm", None)
    if isinstance(embedding_norm, unnorm.ChannelNorm):
        plan["model.embed_tokens.norm"] = []
    return plan


def fold_lm(model: nn.Module, *, probe: Optional[torch.Tensor]) -> dict[str, int]:
    """Fold every offline norm (and DyT's affine) of an eval-mode ``build_lm`` model in place,
    proved on ``probe``'s logits (token ids, (B, T); None: unchecked); returns the counts of
    ``unnorm.fold_by_plan``. A tied head is refused: folding the final norm into it would
    change the embedding."""
    if model.config.tie_word_embeddings and isinstance(model.model.norm, unnorm.ChannelNorm):
        raise ValueError("lm_head is tied to the embedding: folding the final norm into it would "
                         "change the embedding too; build the model with tie_word_embeddings=false")
    return unnorm.fold_by_plan(model, fold_plan(model), probe=None if probe is None
                               else lambda copy: copy(input_ids=probe).logits)
