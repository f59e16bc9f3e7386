"""The baselines that need no custom backward: LN, RMSNorm, BN and NoNorm."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from .base import (ChannelNorm, OfflineNorm, channel_mean_sq, replicas_active,
                   sum_over_replicas, zero_padding)


class LayerNorm(ChannelNorm):
    """LayerNorm over the channel axis of each position (online)."""

    def _normalize(self, rows, valid):
        if not self._recording:
            return F.layer_norm(rows.float(), (self.num_features,), self.weight.float(),
                                self.bias.float(), self.eps)
        self._tap.record_act(channel_mean_sq(rows, valid))
        return self._affine(F.layer_norm(rows.float(), (self.num_features,), eps=self.eps), valid)


class RMSNorm(ChannelNorm):
    """RMSNorm (Zhang and Sennrich 2019) per position (online).

    Carries a bias (zeros) like the other norms, so ``swap_norms`` keeps a LayerNorm's shift.
    """

    def _normalize(self, rows, valid):
        if self._recording:
            self._tap.record_act(channel_mean_sq(rows, valid))
        rows = rows.float()
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
        return self._watch_grad(rows.float().view_as(rows), valid)  # a new node, not the caller's


class BatchNorm(OfflineNorm):
    """BatchNorm over every valid position (batch x tokens) of channels-last input.

    ``momentum`` is the paper's alpha: ``running = alpha * running + (1 - alpha) * batch``
    (torch's BatchNorm momentum is ``1 - alpha``). Running variance is unbiased, as in torch.
    """

    def __init__(self, num_features: int, eps: float = 1e-5, momentum: float = 0.9,
                 sync_stats: bool = False, device=None, dtype=None):
        super().__init__(num_features, eps=eps, device=device, dtype=dtype)
        self.momentum = float(momentum)
        self.sync_stats = bool(sync_stats)  # statistics over all data-parallel replicas
        self.register_buffer("running_mean", torch.zeros(num_features, device=device))
        self.register_buffer("running_var", torch.ones(num_features, device=device))

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, momentum={self.momentum}"

    def _normalize(self, rows, valid):
        rows = rows.float()
        if not self.training:
            scale, shift = self.inference_affine()
            return torch.addcmul(shift, rows, scale)
        sync = replicas_active(self.sync_stats)
        if valid is None and not sync:
            return self._batch_norm(rows)
        counted = rows if valid is None else zero_padding(rows, valid)
        count = torch.full((1,), float(rows.shape[0]), device=rows.device) if valid is None \
            else valid.to(rows.dtype).sum().reshape(1)
        total = counted.sum(dim=0)
        if sync:  # differentiable: every replica's rows receive the statistics' gradient
            total, count = sum_over_replicas(total, count, differentiable=True)
        count = count.clamp_min(1)
        mean = total / count
        var = (counted - mean).square()
        var = (var if valid is None else zero_padding(var, valid)).sum(dim=0)
        if sync:
            (var,) = sum_over_replicas(var, differentiable=True)
        var = var / count
        with torch.no_grad():
            alpha = self.momentum
            self.running_mean.mul_(alpha).add_(mean, alpha=1 - alpha)
            self.running_var.mul_(alpha).add_(var * count / (count - 1).clamp_min(1),
                                              alpha=1 - alpha)
        if self._recording:
            self._tap.record_act(var.detach())
        inv_std = torch.rsqrt(var + self.eps)
        z = (counted - mean) * inv_std
        if valid is not None:  # padded rows are normalised, but add no gradient to statistics
            z = torch.where(valid[:, None], z, (rows - mean.detach()) * inv_std.detach())
        return self._affine(z, valid)

    def _batch_norm(self, rows):
        """Unpadded input: torch's fused kernel (same statistics and running update)."""
        tapped = self._recording
        if tapped:
            self._tap.record_act(rows.detach().var(dim=0, unbiased=False))
        out = F.batch_norm(rows, self.running_mean, self.running_var,
                           None if tapped else self.weight.float(),
                           None if tapped else self.bias.float(), training=True,
                           momentum=1 - self.momentum, eps=self.eps)
        return self._affine(out, None) if tapped else out

    def inference_affine(self):
        scale = self.weight.float() * torch.rsqrt(self.running_var + self.eps)
        return scale, self.bias.float() - scale * self.running_mean
