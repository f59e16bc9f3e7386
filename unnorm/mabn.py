"""Moving Average Batch Normalization (Yan et al., ICLR 2020), quadratic-mean form.

Follows megvii-model/MABN (``MABN2d``) as the spec describes it: simple moving averages of
the forward and gradient statistics over a window, and a renormalisation factor ``r``
applied in the forward output.
"""
from __future__ import annotations

import torch

from .base import window_slot
from .estimated import EstimatedNorm, StepPlan, compensation_factor


class MovingAverageBatchNorm(EstimatedNorm):
    """MABN. Release defaults: window 16, warm-up 100, momentum 0.98 (configs comparing
    with UN use window 4, UN's warm-up and alpha, and say so)."""

    r_in_forward = True

    def __init__(self, num_features: int, window_size: int = 16, warmup_iters: int = 100,
                 momentum: float = 0.98, eps: float = 1e-5, sync_stats: bool = False,
                 device=None, dtype=None):
        super().__init__(num_features, eps=eps, momentum=momentum, warmup_iters=warmup_iters,
                         sync_stats=sync_stats, device=device, dtype=dtype)
        if not isinstance(window_size, int) or window_size < 1:
            raise ValueError(f"window_size must be a positive int, got {window_size!r}")
        self.register_buffer("running_var", torch.ones(num_features, device=device))
        self.register_buffer("fwd_buffer", torch.zeros(window_size, num_features, device=device))
        self.register_buffer("bwd_buffer", torch.zeros(window_size, num_features, device=device))

    def extra_repr(self) -> str:
        return (f"{super().extra_repr()}, window={self.fwd_buffer.shape[0]}, "
                f"warmup={self.warmup_iters}, momentum={self.momentum}")

    def _averaging(self, step: int) -> bool:
        return step > self.fwd_buffer.shape[0] and step >= self.warmup_iters

    def _plan_step(self, s):
        t, window, eps = self.step, self.fwd_buffer, self.eps
        window[window_slot(t, window.shape[0])] = s
        v = window.mean(dim=0) if self._averaging(t) else s
        r = compensation_factor(v, self.running_var, eps) if t > max(1000, self.warmup_iters) else None
        inv_std = torch.rsqrt(v + eps)
        self.running_var.mul_(self.momentum).add_(v, alpha=1 - self.momentum)
        return StepPlan(step=t, inv_std=inv_std, inv_std_bwd=inv_std, r=r)

    def _gradient_estimate(self, q, plan: StepPlan):
        window = self.bwd_buffer
        window[window_slot(plan.step, window.shape[0])] = q
        return window.mean(dim=0) if self._averaging(plan.step) else q
