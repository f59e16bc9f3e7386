"""The baselines that need no custom backward: LN, RMSNorm, BN and NoNorm."""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from .base import (ChannelNorm, GuardedNorm, channel_mean_sq, check_momentum, commit_call,
                   replicas_active, row_count, statistic_ok, sum_over_replicas, upcast,
                   zero_padding)


class LayerNorm(ChannelNorm):
    """LayerNorm over the channel axis of each position (online)."""

    def _normalize(self, rows, valid):
        if self._recording:
            self._tap.record_act(channel_mean_sq(rows, valid))
            return self._affine(self._standardize(rows), valid)
        bias = None if self.bias is None else upcast(self.bias)
        out = F.layer_norm(upcast(rows), (self.num_features,), upcast(self.weight), bias, self.eps)
        rows = rows.detach()  # the fused kernel keeps no z: the GNS tap recomputes it
        return self._watch_affine(out, lambda: {"weight": self._standardize(rows), "bias": None})

    def _standardize(self, rows: torch.Tensor) -> torch.Tensor:
        """z: each row standardised over its channels, in float32, before the affine."""
        return F.layer_norm(upcast(rows), (self.num_features,), eps=self.eps)


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


class CausalStatistics:
    """The ``causal`` option of a batch-statistics norm (BN, PRepBN's BN) in a causal model.

    Pooled over every position, training-mode statistics let the output at position t depend
    on later tokens (``plugins.lm.leak`` measures it). With ``causal=True`` the input must be
    batch-first sequences ``(B, T, C)``, and position t is standardised by the mean and
    variance of every sequence's positions ``<= t``: nothing later reaches it. What it
    changes: early positions are standardised by few rows (position 0 by B), so training
    sees noisier statistics there than evaluation's running ones, which still follow the
    whole batch's statistics as without the option.
    """

    causal: bool = False
    _positions: Optional[int] = None  # T of the input being normalised when causal, else None

    def forward(self, x: torch.Tensor, pad_mask: Optional[torch.Tensor] = None) -> torch.Tensor:
        self._positions = None
        if self.causal:
            if x.dim() != 3:
                raise ValueError(f"{type(self).__name__}(causal=True) needs batch-first sequences "
                                 f"(B, T, C), got shape {tuple(x.shape)}; transpose time-first "
                                 "input (x.transpose(0, 1)) or drop causal for non-sequence input")
            self._positions = x.shape[1]
        return super().forward(x, pad_mask)


class BatchNorm(CausalStatistics, GuardedNorm):
    """BatchNorm over every valid position (batch x tokens) of channels-last input.

    ``momentum`` is the paper's alpha: ``running = alpha * running + (1 - alpha) * batch``
    (torch's BatchNorm momentum is ``1 - alpha``). Running variance is unbiased, as in torch.
    A rejected batch (see ``GuardedNorm``) leaves the running statistics as they were.
    ``causal``: statistics over positions ``<= t`` only (``CausalStatistics``).
    """

    def __init__(self, num_features: int, eps: float = 1e-5, momentum: float = 0.9,
                 sync_stats: bool = False, causal: bool = False, device=None, dtype=None):
        super().__init__(num_features, eps=eps, device=device, dtype=dtype)
        self.momentum = check_momentum("momentum", momentum)
        self.sync_stats = bool(sync_stats)  # statistics over all data-parallel replicas
        self.causal = bool(causal)
        self.register_buffer("running_mean", torch.zeros(num_features, device=device))
        self.register_buffer("running_var", torch.ones(num_features, device=device))

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, momentum={self.momentum}" + (", causal" if self.causal else "")

    def _normalize(self, rows, valid):
        rows = upcast(rows)
        if not self.training:
            scale, shift = self.inference_affine()
            return torch.addcmul(shift, rows, scale)
        z, mean, var, count = batch_standardize(rows, valid, self.eps,
                                                replicas_active(self.sync_stats),
                                                self._positions)
        state = running_statistics(self, mean, var, count)
        if self._recording:
            self._tap.record_act(var)
        return commit_call(self._affine(z, valid), self, valid, state,
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
                      sync: bool = False, positions: Optional[int] = None):
    """``(z, mean, var, count)``: rows standardised by the mean and biased variance of their
    valid rows (over every replica with ``sync``), differentiably.

    Without padding or replicas this is torch's fused batch-norm kernel (which refuses an
    empty batch: that one takes the general path, and the caller rejects it). Padded rows are
    standardised too, but add no gradient to the statistics. With ``positions`` (T), the rows
    are batch-first sequences of T positions, standardised causally (``prefix_standardize``).
    """
    if positions is not None:
        return prefix_standardize(rows, valid, eps, sync, positions)
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


def prefix_standardize(rows: torch.Tensor, valid: Optional[torch.Tensor], eps: float,
                       sync: bool, positions: int):
    """``batch_standardize`` of batch-first sequences ``(B * T, C)``, each position t by the
    mean and biased variance of the valid rows at positions ``<= t`` of every sequence (of
    every replica with ``sync``; every replica's sequences must have the same T). The returned
    ``mean``, ``var`` and ``count`` are the whole batch's (position T-1's), for the running
    statistics.

    Sums are cumulative over positions, taken about a detached shift (the mean of the first
    position that has a valid row, so still causal) so that E[x^2] - E[x]^2 keeps float32's
    precision when the mean is far from zero; the shift cancels exactly in value.
    """
    shape = (-1, positions, rows.shape[1])
    if valid is None:
        weight = torch.ones(1, positions, 1, dtype=rows.dtype, device=rows.device).expand(
            rows.shape[0] // positions, -1, -1)
        seqs = rows.reshape(shape)
    else:
        weight = valid.reshape(-1, positions, 1).to(rows.dtype)
        seqs = zero_padding(rows, valid).reshape(shape)
    position_sum, position_count = seqs.detach().sum(dim=0), weight.sum(dim=0)  # (T, C), (T, 1)
    if sync:
        position_sum, position_count = sum_over_replicas(position_sum, position_count)
    first = (position_count[:, 0] > 0).int().argmax()  # 0 when nothing is valid
    shift = position_sum[first] / position_count[first].clamp_min(1)
    centred = (seqs - shift) * weight
    sums = [centred.sum(dim=0), centred.square().sum(dim=0)]  # (T, C) each
    if sync:
        sums = sum_over_replicas(*sums, differentiable=True)
    total, total_sq = (part.cumsum(dim=0) for part in sums)
    count = position_count.cumsum(dim=0)
    mean = total / count.clamp_min(1)
    var = (total_sq / count.clamp_min(1) - mean.square()).clamp_min(0)
    inv_std = torch.rsqrt(var + eps)
    z = (seqs - shift - mean) * inv_std
    if valid is not None:  # padded rows are standardised, but add no gradient to statistics
        raw = rows.reshape(shape)
        z = torch.where(weight.bool(), z, (raw - shift - mean.detach()) * inv_std.detach())
    return (z.reshape(rows.shape), (shift + mean[-1]).detach(), var[-1].detach(),
            count[-1].detach())
