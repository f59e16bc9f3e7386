"""Dynamic Tanh (Zhu, Chen, He, LeCun, Liu, "Transformers without Normalization", CVPR 2025),
as jiachenzhu/DyT's ``DynamicTanh``: ``y = weight * tanh(alpha * x) + bias``, no statistics."""
from __future__ import annotations

import math
from typing import Optional

import torch
from torch import nn

from .base import ChannelNorm, channel_mean_sq, channel_products, upcast


class DynamicTanh(ChannelNorm):
    """DyT: an elementwise squashing with a learnable scalar ``alpha`` (shape (1,), as
    released) and a per-channel affine. Online (``tanh`` is not an affine), but its
    ``weight`` and ``bias`` fold into a following linear layer (``fold_parts``).
    ``bias=False`` is the release's LLaMA DyT: ``weight * tanh(alpha * x)``."""

    def __init__(self, num_features: int, alpha_init: float = 0.5, bias: bool = True,
                 device=None, dtype=None):
        super().__init__(num_features, bias=bias, device=device, dtype=dtype)
        if not (isinstance(alpha_init, (int, float)) and math.isfinite(alpha_init) and alpha_init > 0):
            raise ValueError(f"alpha_init must be a positive number, got {alpha_init!r} "
                             "(DyT's release: 0.5, and smaller for large or deep models)")
        self.alpha = nn.Parameter(torch.full((1,), float(alpha_init), device=device, dtype=dtype))

    def extra_repr(self) -> str:
        return f"{self.num_features}, alpha_init={self.alpha.detach().flatten()[0].item():.3g}"

    def _normalize(self, rows, valid):
        if self._recording:
            self._tap.record_act(channel_mean_sq(rows, valid))
        alpha = upcast(self.alpha)
        if self._tapped:
            return self._affine(torch.tanh(alpha * upcast(rows)), valid)
        plain = upcast(rows).detach()
        return self._watch_affine(_DyTStep.apply(upcast(rows), alpha, *self._affine_weights()),
                                  lambda: {"weight": torch.tanh(alpha.detach() * plain),
                                           "bias": None})

    def fold_parts(self) -> tuple[torch.Tensor, torch.Tensor, nn.Module]:
        """``(scale, shift, core)``: the output is ``core(x) * scale + shift``, and the affine
        moves into the next linear layer, leaving ``core`` in the norm's place."""
        shift = torch.zeros_like(upcast(self.weight)) if self.bias is None else upcast(self.bias)
        return upcast(self.weight), shift, Tanh(self.alpha.detach().clone())


class Tanh(nn.Module):
    """``tanh(alpha * x)``: what stays of a DyT whose affine was folded away."""

    def __init__(self, alpha: torch.Tensor):
        super().__init__()
        self.register_buffer("alpha", alpha)

    def forward(self, x: torch.Tensor, pad_mask: Optional[torch.Tensor] = None) -> torch.Tensor:
        return torch.tanh(self.alpha.to(x.dtype) * x)


class _DyTStep(torch.autograd.Function):
    """``weight * tanh(alpha * x) + bias`` with one (N, C) allocation in the backward (issue 51).

    torch's CPU ``tanh`` costs six times its ``sigmoid`` (12 against 2 ms on ViT tokens, one
    thread), so tanh is taken as ``2 s - 1`` with ``s = sigmoid(2 alpha x)``, and the output as
    ``2 weight s + (bias - weight)``, one ``addcmul``. Exact in value; in float32 its rounding
    is absolute, about one ulp of 1 (1.8e-7, torch's tanh: 3e-8), not relative near
    ``t = 0``. Autograd's graph of the three ops allocated six (N, C) tensors per step. By hand,
    with ``u = dy s (1 - s)`` (``sigmoid_backward``): ``dweight = sum(dy t) = 2 sum(dy s) -
    sum(dy)``, ``dbias = sum(dy)``, ``dalpha = 4 sum_c weight_c sum(u x)`` (reductions that
    allocate no product) and ``dx = 4 u * weight * alpha``, in u's buffer
    (docs/efficiency.md)."""

    @staticmethod
    def forward(ctx, rows, alpha, weight, bias):
        s = torch.mul(rows, 2 * alpha).sigmoid_()
        ctx.save_for_backward(rows, alpha, weight, s)
        return torch.addcmul(-weight if bias is None else bias - weight, s, 2 * weight)

    @staticmethod
    def backward(ctx, dy):
        rows, alpha, weight, s = ctx.saved_tensors
        needs = ctx.needs_input_grad
        dy_s, dbias = channel_products(dy, s)
        u = torch.ops.aten.sigmoid_backward(dy, s)
        dalpha = (4 * torch.dot(weight, channel_products(u, rows)[0])).reshape(1) \
            if needs[1] else None
        return (u.mul_(4 * alpha * weight), dalpha, 2 * dy_s - dbias if needs[2] else None,
                dbias if needs[3] else None)
