"""The attention's norms and probes: qk-norm (a norm on the queries and keys of each head, before
RoPE, as ViT-22B, OLMo 2, Qwen 3 and Wortsman et al.'s "qk-layernorm" put it) and the maximum
attention logit, the quantity whose growth Wortsman et al. ("Small-scale proxies for large-scale
Transformer training instabilities", 2023) find behind divergence at high learning rates.

Hugging Face's ``LlamaAttention`` is kept as it is: a ``QKNormLinear`` replaces its ``q_proj``
and ``k_proj`` (the same weight and state-dict key, the head norm under ``<proj>.head_norm``), so
the attention's own forward, kernels and cache stay Hugging Face's.
"""
from __future__ import annotations

import torch
from torch import nn
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb, repeat_kv


class QKNormLinear(nn.Linear):
    """A query or key projection whose output is normalised per head: ``norm`` (built for
    ``head_dim`` channels, one weight shared by the heads) sees the projection as
    ``(B * heads, T, head_dim)``, so a statistic that pools over positions pools over a
    sequence's positions (a causal norm stays causal) and over the batch and the heads."""

    def __init__(self, linear: nn.Linear, head_dim: int, norm: nn.Module):
        super().__init__(linear.in_features, linear.out_features, linear.bias is not None,
                         device="meta")
        if linear.out_features % head_dim:
            raise ValueError(f"a projection of {linear.out_features} features has no heads of "
                             f"{head_dim}")
        self.weight, self.bias = linear.weight, linear.bias  # the parameters themselves
        self.head_dim, self.head_norm = head_dim, norm

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = super().forward(x)
        batch, length = y.shape[0], y.shape[1]
        heads = y.view(batch, length, -1, self.head_dim).transpose(1, 2)  # (B, H, T, D)
        normed = self.head_norm(heads.reshape(-1, length, self.head_dim))
        return normed.view(heads.shape).transpose(1, 2).reshape(y.shape)


def add_qk_norm(attention: nn.Module, build_norm) -> None:
    """Put ``build_norm(head_dim)`` on ``attention``'s queries and keys (a norm each), in place."""
    for name in ("q_proj", "k_proj"):
        setattr(attention, name, QKNormLinear(getattr(attention, name), attention.head_dim,
                                              build_norm(attention.head_dim)))


@torch.no_grad()
def max_attention_logits(model: nn.Module, input_ids: torch.Tensor) -> list[float]:
    """The largest pre-softmax attention logit (``q . k * scaling``, after qk-norm and RoPE,
    over the causally visible pairs) of each decoder layer on ``input_ids``, the model in eval
    mode (run eagerly if it is compiled). The logits are recomputed from each attention's inputs in a forward hook (the fused
    attention kernels never materialise them), so a training-mode qk-norm would update its
    running statistics twice: refused."""
    if model.training:
        raise ValueError("max_attention_logits needs the model in eval mode (model.eval()): "
                         "it projects each layer's queries and keys a second time")
    largest: list[float] = []

    def record(attention, args, kwargs):
        hidden = kwargs["hidden_states"] if "hidden_states" in kwargs else args[0]
        cos, sin = kwargs["position_embeddings"]
        shape = (*hidden.shape[:-1], -1, attention.head_dim)
        query = attention.q_proj(hidden).view(shape).transpose(1, 2)
        key = attention.k_proj(hidden).view(shape).transpose(1, 2)
        query, key = apply_rotary_pos_emb(query, key, cos, sin)
        key = repeat_kv(key, attention.num_key_value_groups)
        logits = (query.float() @ key.float().transpose(-1, -2)) * attention.scaling
        length = logits.shape[-1]
        future = torch.ones(length, length, dtype=torch.bool, device=logits.device).triu(1)
        largest.append(logits.masked_fill(future, float("-inf")).max().item())

    hooks = [layer.self_attn.register_forward_pre_hook(record, with_kwargs=True)
             for layer in model.model.layers]
    try:  # eagerly: a compiled model's graph would not call hooks added after it was traced
        with torch.compiler.set_stance("force_eager"):
            model(input_ids=input_ids)
    finally:
        for hook in hooks:
            hook.remove()
    return largest
