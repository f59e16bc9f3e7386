"""Moving Average Batch Normalization (Yan et al., ICLR 2020), quadratic-mean form.

Follows megvii-model/MABN (``MABN2d``) as the spec describes it: simple moving averages of
the forward and gradient statistics over a window, and a renormalisation factor ``r``
applied in the forward output.
"""
from __future__ import annotations

import torch

from .base import with_slot
from .estimated import (EstimatedNorm, StepPlan, check_window_shapes, compensation_factor,
                        step_count)


class MovingAverageBatchNorm(EstimatedNorm):
    """MABN. Release defaults: window 16, warm-up 100, momentum 0.98 (configs comparing
    with UN use window 4, UN's warm-up and alpha, and say so). ``compensation_start``: r
    stays 1 until step ``max(compensation_start, warmup_iters)`` (the release: 1000)."""

    r_in_forward = True

    def __init__(self, num_features: int, window_size: int = 16, warmup_iters: int = 100,
                 momentum: float = 0.98, eps: float = 1e-5, compensation_start: int = 1000,
                 sync_stats: bool = False, device=None, dtype=None):
        super().__init__(num_features, eps=eps, momentum=momentum, warmup_iters=warmup_iters,
                         sync_stats=sync_stats, device=device, dtype=dtype)
        if not isinstance(window_size, int) or window_size < 1:
            raise ValueError(f"window_size must be a positive int, got {window_size!r}")
        self.compensation_start = step_count("compensation_start", compensation_start)
        self.register_buffer("running_var", torch.ones(num_features, device=device))
        self.register_buffer("fwd_buffer", torch.zeros(window_size, num_features, device=device))
        self.register_buffer("bwd_buffer", torch.zeros(window_size, num_features, device=device))

    def extra_repr(self) -> str:
        return (f"{super().extra_repr()}, window={self.fwd_buffer.shape[0]}, "
                f"warmup={self.warmup_iters}, momentum={self.momentum}")

    def _averaging(self, step: torch.Tensor) -> torch.Tensor:
        return (step > self.fwd_buffer.shape[0]) & (step >= self.warmup_iters)

    def _plan_step(self, s, t):
        written = with_slot(self.fwd_buffer, t, s)
        v = torch.where(self._averaging(t), written.mean(dim=0), s)
        compensating = t > max(self.compensation_start, self.warmup_iters)
        r = torch.where(compensating, compensation_factor(v, self.running_var, self.eps),
                        torch.ones_like(v))
        inv_std = torch.rsqrt(v + self.eps)
        alpha = self.momentum
        state = {"fwd_buffer": written, "running_var": alpha * self.running_var + (1 - alpha) * v}
        return StepPlan(step=t, inv_std=inv_std, inv_std_bwd=inv_std, r=r, state=state)

    def _gradient_estimate(self, q, plan: StepPlan):
        written = with_slot(self.bwd_buffer, plan.step, q)
        return torch.where(self._averaging(plan.step), written.mean(dim=0), q), {"bwd_buffer": written}

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs):
        check_window_shapes(self, state_dict, prefix, ("fwd_buffer", "bwd_buffer"))
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)
