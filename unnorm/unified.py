"""Unified Normalization (Yang et al., ACM MM 2022), as in ``shared/spec/unified_norm.md``.

Defaults follow the authors' release (``UN1d``); the paper's readings that differ are options.
"""
from __future__ import annotations

from typing import Optional, Sequence, Union

import torch

from .base import window_slot
from .estimated import EstimatedNorm, StepPlan, compensation_factor, where_skipped


class UnifiedNorm(EstimatedNorm):
    """UN: geometric-mean window in forward, windowed + EMA gradient statistic in backward,
    outlier filtration by the AM-GM bound, and gradient compensation.

    Args:
        window_size: M, or a pair (M_f, M_b) for the forward and backward windows.
        warmup_iters: steps that normalise by the current batch statistic only.
        momentum: alpha of the running variance and of the gradient EMA.
        outlier_filtration: skip a step whose window breaks the AM-GM bound (released:
            on for vision, off for translation; the release's class default is off).
        outlier_threshold: multiplier of the previous window's variance in the bound
            ``am - gm > threshold * Var(sqrt(window))``; None means M_f (paper Eq. 18).
        outlier_var_per_channel: take that variance per channel (paper Eq. 19) instead of
            the release's one scalar over the whole window.
        fwd_gm / bwd_am / bwd_ema: the ablation switches of Tables 5 and 9.
        grad_compensation: the release's renormalisation factor r in backward.
    """

    def __init__(self, num_features: int, window_size: Union[int, Sequence[int]] = 4,
                 warmup_iters: int = 4000, momentum: float = 0.9, eps: float = 1e-5,
                 outlier_filtration: bool = False, outlier_threshold: Optional[float] = None,
                 outlier_var_per_channel: bool = False, fwd_gm: bool = True,
                 bwd_am: bool = True, bwd_ema: bool = True, grad_compensation: bool = True,
                 sync_stats: bool = False, device=None, dtype=None):
        super().__init__(num_features, eps=eps, momentum=momentum, warmup_iters=warmup_iters,
                         sync_stats=sync_stats, device=device, dtype=dtype)
        fwd_size, bwd_size = _window_pair(window_size)
        self.outlier_filtration = bool(outlier_filtration)
        self.outlier_threshold = float(fwd_size if outlier_threshold is None else outlier_threshold)
        self.outlier_var_per_channel = bool(outlier_var_per_channel)
        self.fwd_gm, self.bwd_am, self.bwd_ema = bool(fwd_gm), bool(bwd_am), bool(bwd_ema)
        self.grad_compensation = bool(grad_compensation)
        self.register_buffer("running_var", torch.ones(num_features, device=device))
        self.register_buffer("fwd_buffer", torch.zeros(fwd_size, num_features, device=device))
        self.register_buffer("bwd_buffer", torch.zeros(bwd_size, num_features, device=device))
        self.register_buffer("ema_grad", torch.zeros(num_features, device=device))
        self.register_buffer("num_skipped", torch.zeros((), dtype=torch.long, device=device))

    def extra_repr(self) -> str:
        return (f"{super().extra_repr()}, window=({self.fwd_buffer.shape[0]}, "
                f"{self.bwd_buffer.shape[0]}), warmup={self.warmup_iters}, "
                f"momentum={self.momentum}, outlier_filtration={self.outlier_filtration}")

    def _plan_step(self, s):
        t, window, eps = self.step, self.fwd_buffer, self.eps
        size = window.shape[0]
        skip_always = size == 1  # the release treats a one-slot window as always skipped
        filtering = self.outlier_filtration and t >= self.warmup_iters and not skip_always
        if filtering:
            roots = window.sqrt()  # the bound uses the window BEFORE s_t is written
            prev_var = roots.var(dim=0) if self.outlier_var_per_channel else roots.var()
        slot = window_slot(t, size)
        window[slot] = s
        geometric = skip = None
        if filtering:
            geometric = window.log().mean(dim=0).exp()
            skip = ((window.mean(dim=0) - geometric) > self.outlier_threshold * prev_var).any()
            window[slot] = torch.where(skip, self.running_var, s)
            self.num_skipped.add_(skip.long())
        v = s
        if self.fwd_gm and t > size and t >= self.warmup_iters and not skip_always:
            if geometric is None:
                geometric = window.log().mean(dim=0).exp()
            v = where_skipped(skip, skip_always, s, geometric)
        r = None
        if self.grad_compensation and not skip_always and t > max(1000, self.warmup_iters):
            r = where_skipped(skip, skip_always, torch.ones_like(v),
                              compensation_factor(v, self.running_var, eps))
        inv_std = torch.rsqrt(v + eps)
        self.running_var.mul_(self.momentum).add_(v, alpha=1 - self.momentum)
        return StepPlan(step=t, inv_std=inv_std, inv_std_bwd=inv_std, r=r, skip=skip,
                        skip_always=skip_always)

    def _gradient_estimate(self, q, plan: StepPlan):
        t, window, alpha = plan.step, self.bwd_buffer, self.momentum
        size = window.shape[0]
        window[window_slot(t, size)] = plan.where_skipped(self.ema_grad, q)
        m = q
        if self.bwd_am and t > size and t >= self.warmup_iters:
            m = plan.where_skipped(q, window.mean(dim=0))
        if self.bwd_ema:
            self.ema_grad.mul_(alpha).add_(m, alpha=1 - alpha)
        else:
            self.ema_grad.copy_(m)
        return plan.where_skipped(m, self.ema_grad)


def _window_pair(window_size) -> tuple[int, int]:
    if isinstance(window_size, int):
        sizes = (window_size, window_size)
    else:
        sizes = tuple(window_size)
        if len(sizes) != 2 or not all(isinstance(n, int) for n in sizes):
            raise ValueError(f"window_size must be an int or a pair of ints, got {window_size!r}")
    if min(sizes) < 1:
        raise ValueError(f"window sizes must be >= 1, got {window_size!r}")
    return sizes


#: The release's buffer names (hikvision-research/Unified-Normalization, UN1d) -> ours.
RELEASED_UN_NAMES = {
    "buffer_x2": "fwd_buffer",
    "buffer_gz": "bwd_buffer",
    "ema_gz": "ema_grad",
    "iters": "num_iters",
    "skip_counter": "num_skipped",
}


def convert_released_state_dict(state_dict: dict) -> dict:
    """Rename the UN layers' buffers of a released checkpoint to ours.

    A layer is recognised by its ``buffer_x2`` entry; its ``(1,)`` counters become scalars.
    Everything else passes through unchanged.
    """
    prefixes = {key[: -len("buffer_x2")] for key in state_dict if key.endswith("buffer_x2")}
    converted = {}
    for key, value in state_dict.items():
        prefix, _, name = key.rpartition(".")
        prefix = prefix + "." if prefix else ""
        if prefix in prefixes and name in RELEASED_UN_NAMES:
            name = RELEASED_UN_NAMES[name]
            if name in ("num_iters", "num_skipped"):
                value = value.reshape(())
            converted[prefix + name] = value
        else:
            converted[key] = value
    return converted
