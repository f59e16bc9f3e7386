"""Pre-LN -> Pre-RMSNorm / Pre-CRMSNorm for the Llama-style decoder (``unnorm.convert``).

A ``build_lm`` model with ``norm=ln`` in ``pre`` placement reads its residual stream only
through LayerNorms: each layer's ``input_layernorm`` (read by q, k and v), its
``post_attention_layernorm`` (read by the MLP's gate and up projections) and the final
``model.norm`` (read by ``lm_head``). The token embedding, each attention's ``o_proj`` and
each MLP's ``down_proj`` write the stream; they are centred (and, for Pre-CRMSNorm, lose their
last output coordinate).

Llama's linear layers have no bias, so each LayerNorm's shift gives its readers one
(``unnorm.convert`` adds it where the shift is not zero): q, k, v, gate, up and ``lm_head``.
RoPE rotates q and k after their projection, bias included, so the attention sees the same q
and k as before and the conversion stays exact; so does the KV cache, which holds k and v.

Refused before anything changes, naming the fix: any placement but ``pre`` (Post-LN normalises
the stream itself and Peri-LN's output norms write it, so neither is read only through
norms), a model without its final norm (the head would read the stream), a norm on the
embeddings (a LayerNorm's output cannot be centred through its weights), a head tied to the
embedding (centring the embedding would change the head), and any norm but LayerNorm.

The model changes in place; the outputs are equal in eval mode, and in training too: Llama's
only dropout acts on the attention probabilities, before ``o_proj``, so the stream stays
zero-mean. ``config.hidden_size`` follows the stream's width (one less after
Pre-CRMSNorm; ``config.head_dim`` keeps the attention's own). Inputs given as
``inputs_embeds`` bypass the converted embedding and must be converted by the caller.
"""
from __future__ import annotations

from torch import nn
from transformers import LlamaForCausalLM

import unnorm


def _check_pre_ln_decoder(model: nn.Module) -> None:
    """Refuse a model whose stream is not read only through norms, or whose embedding the
    conversion cannot centre."""
    if not isinstance(model, LlamaForCausalLM):
        raise TypeError(f"no Pre-RMSNorm conversion for {type(model).__name__}: build the "
                        "language model with plugins.lm.build_lm")
    decoder = model.model
    for index, layer in enumerate(decoder.layers):
        placement = getattr(layer, "placement", "pre")  # Hugging Face's own layer is Pre
        if placement != "pre":
            raise ValueError(f"model.layers.{index} is in {placement} placement: the conversion "
                             "is exact only for Pre-LN, whose stream is read only through norms; "
                             "build and train the model with model.norm_position=pre")
    if isinstance(decoder.norm, nn.Identity):
        raise ValueError("the model has no final norm (final_norm=false), so its head reads the "
                         "stream, which centring changes; build it with model.final_norm=null")
    if type(decoder.embed_tokens) is not nn.Embedding:
        raise ValueError(f"model.embed_tokens is a {type(decoder.embed_tokens).__name__}: a norm "
                         "or scale on the embeddings writes the stream through something the "
                         "conversion cannot centre; build with norm=ln and "
                         "model.embedding_norm=false")
    if model.config.tie_word_embeddings or model.lm_head.weight is decoder.embed_tokens.weight:
        raise ValueError("lm_head is tied to the token embedding (tie_word_embeddings=true): "
                         "centring the embedding would change the head; train with "
                         "model.tie_word_embeddings=false, or untie first (give lm_head its own "
                         "copy of the weight and set config.tie_word_embeddings=False)")


def _plan(model: nn.Module) -> tuple[list[str], dict[str, list[str]]]:
    """The stream's writers and each norm's readers, by name."""
    _check_pre_ln_decoder(model)
    writers = ["model.embed_tokens"]
    readers: dict[str, list[str]] = {}
    for index in range(len(model.model.layers)):
        layer = f"model.layers.{index}"
        writers += [f"{layer}.self_attn.o_proj", f"{layer}.mlp.down_proj"]
        readers[f"{layer}.input_layernorm"] = [f"{layer}.self_attn.{name}"
                                               for name in ("q_proj", "k_proj", "v_proj")]
        readers[f"{layer}.post_attention_layernorm"] = [f"{layer}.mlp.gate_proj",
                                                        f"{layer}.mlp.up_proj"]
    readers["model.norm"] = ["lm_head"]
    return writers, readers


def to_pre_rms(model: LlamaForCausalLM) -> LlamaForCausalLM:
    """A Pre-LN ``build_lm`` model (``norm=ln``, ``norm_position=pre``) as Pre-RMSNorm, in
    place: the stream's writers centred, every LayerNorm an RMSNorm whose shift is folded into
    its readers' biases. Eval logits are unchanged; anything else is refused unchanged."""
    unnorm.convert_to_pre_rms(model, *_plan(model))
    return model


def to_pre_crms(model: LlamaForCausalLM) -> LlamaForCausalLM:
    """A Pre-LN ``build_lm`` model as Pre-CRMSNorm, in place: the stream one coordinate
    narrower, every LayerNorm an ``unnorm.CompressedRMSNorm`` whose gain and shift are folded
    into its readers. Eval logits are unchanged; anything else is refused unchanged."""
    unnorm.convert_to_pre_crms(model, *_plan(model))
    model.config.hidden_size -= 1
    return model
