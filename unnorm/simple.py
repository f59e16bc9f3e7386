"""The baselines that need no custom backward: LN, RMSNorm, BN and NoNorm."""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from .base import (ChannelNorm, GuardedNorm, channel_mean_sq, check_momentum, commit_on_backward,
                   replicas_active, row_count, statistic_ok, sum_over_replicas, upcast,
                   zero_padding)


class LayerNorm(ChannelNorm):
    """LayerNorm over the channel axis of each position (online)."""

    def _normalize(self, rows, valid):
        if not self._recording:
            bias = None if self.bias is None else upcast(self.bias)
            return F.layer_norm(upcast(rows), (self.num_features,), upcast(self.weight), bias,
                                self.eps)
        self._tap.record_act(channel_mean_sq(rows, valid))
        return self._affine(F.layer_norm(upcast(rows), (self.num_features,), eps=self.eps), valid)


class RMSNorm(ChannelNorm):
    """RMSNorm (Zhang and Sennrich 2019) per position (online).

    Carries a bias (zeros) like the other norms, so ``swap_norms`` keeps a LayerNorm's shift;
    ``bias=False`` is Llama's RMSNorm (a weight only).
    """

    def _normalize(self, rows, valid):
        if self._recording:
            self._tap.record_act(channel_mean_sq(rows, valid))
        rows = upcast(rows)
        return self._affine(rows * torch.rsqrt(rows.square().mean(-1, keepdim=True) + self.eps),
                            valid)


class NoNorm(ChannelNorm):
    """Identity. Keeps a frozen ``weight`` buffer because hosts (timm) read ``norm.weight``."""

    def __init__(self, num_features: int, eps: float = 1e-5, device=None, dtype=None):
        super().__init__(num_features, eps=eps, device=device, dtype=dtype)
        del self.weight, self.bias
        self.register_buffer("weight", torch.ones(num_features, device=device, dtype=dtype),
                             persistent=False)
        self.register_parameter("bias", None)

    def _normalize(self, rows, valid):
        if not self._recording:
            return rows
        self._tap.record_act(channel_mean_sq(rows, valid))
        return self._watch_grad(upcast(rows).view_as(rows), valid)  # a new node, not the caller's


class BatchNorm(GuardedNorm):
    """BatchNorm over every valid position (batch x tokens) of channels-last input.

    ``momentum`` is the paper's alpha: ``running = alpha * running + (1 - alpha) * batch``
    (torch's BatchNorm momentum is ``1 - alpha``). Running variance is unbiased, as in torch.
    A rejected batch (see ``GuardedNorm``) leaves the running statistics as they were.
    """

    def __init__(self, num_features: int, eps: float = 1e-5, momentum: float = 0.9,
                 sync_stats: bool = False, device=None, dtype=None):
        super().__init__(num_features, eps=eps, device=device, dtype=dtype)
        self.momentum = check_momentum("momentum", momentum)
        self.sync_stats = bool(sync_stats)  # statistics over all data-parallel replicas
        self.register_buffer("running_mean", torch.zeros(num_features, device=device))
        self.register_buffer("running_var", torch.ones(num_features, device=device))

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, momentum={self.momentum}"

    def _normalize(self, rows, valid):
        rows = upcast(rows)
        if not self.training:
            scale, shift = self.inference_affine()
            return torch.addcmul(shift, rows, scale)
        z, mean, var, count = batch_standardize(rows, valid, self.eps,
                                                replicas_active(self.sync_stats))
        state = running_statistics(self, mean, var, count)
        if self._recording:
            self._tap.record_act(var)
        return commit_on_backward(self._affine(z, valid), self, valid, state,
                                  statistic_ok(var, count))

    def inference_affine(self):
        scale = upcast(self.weight) * torch.rsqrt(self.running_var + self.eps)
        return scale, upcast(self.bias) - scale * self.running_mean


def running_statistics(norm: nn.Module, mean: torch.Tensor, var: torch.Tensor,
                       count: torch.Tensor) -> dict[str, torch.Tensor]:
    """The candidate ``running_mean``/``running_var`` of a BN-style ``norm`` after a batch of
    ``count`` rows with ``mean`` and biased ``var``: EMAs keeping ``norm.momentum`` (alpha) of
    the old value, the variance unbiased as torch's BatchNorm keeps it."""
    alpha = norm.momentum
    unbiased = var * count / (count - 1).clamp_min(1)
    return {"running_mean": alpha * norm.running_mean + (1 - alpha) * mean,
            "running_var": alpha * norm.running_var + (1 - alpha) * unbiased}


def batch_standardize(rows: torch.Tensor, valid: Optional[torch.Tensor], eps: float,
                      sync: bool = False):
    """``(z, mean, var, count)``: rows standardised by the mean and biased variance of their
    valid rows (over every replica with ``sync``), differentiably.

    Without padding or replicas this is torch's fused batch-norm kernel (which refuses an
    empty batch: that one takes the general path, and the caller rejects it). Padded rows are
    standardised too, but add no gradient to the statistics.
    """
    count = row_count(rows, valid)
    if valid is None and not sync and rows.shape[0] > 0:
        z, mean, inv_std = torch.native_batch_norm(rows, None, None, None, None, True, 0.0, eps)
        return z, mean.detach(), (inv_std.detach().square().reciprocal() - eps), count
    counted = rows if valid is None else zero_padding(rows, valid)
    total = counted.sum(dim=0)
    if sync:  # differentiable: every replica's rows receive the statistics' gradient
        total, count = sum_over_replicas(total, count, differentiable=True)
    mean = total / count.clamp_min(1)
    var = (counted - mean).square()
    var = (var if valid is None else zero_padding(var, valid)).sum(dim=0)
    if sync:
        (var,) = sum_over_replicas(var, differentiable=True)
    var = var / count.clamp_min(1)
    inv_std = torch.rsqrt(var + eps)
    z = (counted - mean) * inv_std
    if valid is not None:  # padded rows are standardised, but add no gradient to statistics
        z = torch.where(valid[:, None], z, (rows - mean.detach()) * inv_std.detach())
    return z, mean.detach(), var.detach(), count
