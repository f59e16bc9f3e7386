"""ScaleNorm (Nguyen and Salazar, "Transformers without Tears: Improving the Normalization of
Self-Attention", IWSLT 2019), as tnq177/transformers_without_tears' ``layers.ScaleNorm``:
``y = g * x / max(||x||_2, eps)`` per position, with one learned scalar ``g``."""
from __future__ import annotations

import math

import torch
from torch import nn

from .base import ChannelNorm, channel_mean_sq, upcast


class ScaleNorm(ChannelNorm):
    """Each position scaled to the L2 norm ``g``: one learned gain for every channel, no
    per-channel affine, no centring, no running state (online). ``g`` starts at sqrt(C), as
    released, so that at initialisation the output has unit mean square (RMSNorm's, eps
    aside). It is ``weight``, of shape (1,) (the release's is 0-d), because hosts read
    ``norm.weight`` for its device and dtype. ``eps`` bounds the norm from below, the
    release's ``clamp``; it is not added under the square root."""

    def __init__(self, num_features: int, eps: float = 1e-5, device=None, dtype=None):
        super().__init__(num_features, eps=eps, bias=False, device=device, dtype=dtype)
        self.weight = nn.Parameter(torch.full((1,), math.sqrt(num_features), device=device,
                                              dtype=dtype))

    def _normalize(self, rows, valid):
        if self._recording:
            self._tap.record_act(channel_mean_sq(rows, valid))
        rows = upcast(rows)
        if not self._tapped:
            plain = rows.detach()
            return self._watch_affine(_ScaleNormStep.apply(rows, upcast(self.weight), self.eps),
                                      lambda: {"weight": plain / self._length(plain)})
        return self._affine(rows / self._length(rows), valid)

    def _length(self, rows: torch.Tensor) -> torch.Tensor:
        return torch.linalg.vector_norm(rows, dim=-1, keepdim=True).clamp_min(self.eps)


class _ScaleNormStep(torch.autograd.Function):
    """``g x / max(||x||, eps)`` with its backward by hand (issue 51): one (N, C) allocation
    forward and two backward, where autograd's graph of the norm, the division and the gain
    allocated six.
    With ``P = sum(dy x)`` per row, ``dg = sum(P / norm)`` and ``dx = g dy / norm - g P x /
    (norm^2 ||x||)``, the second term only where the clamp passes the gradient (``||x|| >=
    eps``, as ``clamp_min``'s)."""

    @staticmethod
    def forward(ctx, rows, gain, eps):
        length = torch.linalg.vector_norm(rows, dim=-1, keepdim=True)
        norm = length.clamp_min(eps)
        ctx.eps = eps
        ctx.save_for_backward(rows, gain, length, norm)
        return rows * (gain / norm)

    @staticmethod
    def backward(ctx, dy):
        rows, gain, length, norm = ctx.saved_tensors
        along = torch.linalg.vecdot(dy, rows).unsqueeze(-1)  # P
        dgain = (along / norm).sum().reshape(1) if ctx.needs_input_grad[1] else None
        through_norm = torch.where(length >= ctx.eps, -gain * along / (norm.square() * length),
                                   torch.zeros_like(length))
        return (dy * (gain / norm)).addcmul_(rows, through_norm), dgain, None
