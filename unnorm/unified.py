"""Unified Normalization (Yang et al., ACM MM 2022), as in ``shared/spec/unified_norm.md``.

Defaults follow the authors' release (``UN1d``); the paper's readings that differ are options.
"""
from __future__ import annotations

from typing import Optional, Sequence, Union

import torch

from .base import with_slot
from .estimated import (EstimatedNorm, StepPlan, check_window_shapes, compensation_factor,
                        step_count)


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
        compensation_start: r stays 1 until step ``max(compensation_start, warmup_iters)``;
            the release fixes it at 1000 (shorter schedules scale it, see configs/scale).
    """

    def __init__(self, num_features: int, window_size: Union[int, Sequence[int]] = 4,
                 warmup_iters: int = 4000, momentum: float = 0.9, eps: float = 1e-5,
                 outlier_filtration: bool = False, outlier_threshold: Optional[float] = None,
                 outlier_var_per_channel: bool = False, fwd_gm: bool = True,
                 bwd_am: bool = True, bwd_ema: bool = True, grad_compensation: bool = True,
                 compensation_start: int = 1000, sync_stats: bool = False, device=None,
                 dtype=None):
        super().__init__(num_features, eps=eps, momentum=momentum, warmup_iters=warmup_iters,
                         sync_stats=sync_stats, device=device, dtype=dtype)
        fwd_size, bwd_size = _window_pair(window_size)
        self.outlier_filtration = bool(outlier_filtration)
        self.outlier_threshold = float(fwd_size if outlier_threshold is None else outlier_threshold)
        self.outlier_var_per_channel = bool(outlier_var_per_channel)
        self.fwd_gm, self.bwd_am, self.bwd_ema = bool(fwd_gm), bool(bwd_am), bool(bwd_ema)
        self.grad_compensation = bool(grad_compensation)
        self.compensation_start = step_count("compensation_start", compensation_start)
        self.register_buffer("running_var", torch.ones(num_features, device=device))
        self.register_buffer("fwd_buffer", torch.zeros(fwd_size, num_features, device=device))
        self.register_buffer("bwd_buffer", torch.zeros(bwd_size, num_features, device=device))
        self.register_buffer("ema_grad", torch.zeros(num_features, device=device))
        self.register_buffer("num_skipped", torch.zeros((), dtype=torch.long, device=device))

    def extra_repr(self) -> str:
        return (f"{super().extra_repr()}, window=({self.fwd_buffer.shape[0]}, "
                f"{self.bwd_buffer.shape[0]}), warmup={self.warmup_iters}, "
                f"momentum={self.momentum}, outlier_filtration={self.outlier_filtration}")

    def _plan_step(self, s, t, skip=None):
        """``skip``: a recorded outlier decision to take instead of testing the bound (a
        replay, whose channels may be a subset of the layer's: the test needs them all)."""
        window, eps = self.fwd_buffer, self.eps
        size = window.shape[0]
        one_slot = size == 1  # the release treats a one-slot window as always skipped
        after_warmup = t >= self.warmup_iters
        written = with_slot(window, t, s)
        geometric = written.log().mean(dim=0).exp()
        plan = StepPlan(step=t, inv_std=s, inv_std_bwd=s)
        if one_slot:
            plan.skip = torch.ones_like(after_warmup)
        elif self.outlier_filtration:
            if skip is None:
                roots = window.sqrt()  # the bound uses the window BEFORE s_t is written
                prev_var = roots.var(dim=0) if self.outlier_var_per_channel else roots.var()
                gap = written.mean(dim=0) - geometric
                skip = after_warmup & (gap > self.outlier_threshold * prev_var).any()
            plan.skip = skip
            written = with_slot(window, t, torch.where(plan.skip, self.running_var, s))
            plan.state["num_skipped"] = self.num_skipped + plan.skip.long()
        v = s
        if self.fwd_gm and not one_slot:
            v = plan.where_skipped(s, torch.where((t > size) & after_warmup, geometric, s))
        if self.grad_compensation and not one_slot:
            compensating = t > max(self.compensation_start, self.warmup_iters)
            factor = compensation_factor(v, self.running_var, eps)
            plan.r = plan.where_skipped(torch.ones_like(v),
                                        torch.where(compensating, factor, torch.ones_like(v)))
        plan.statistic = v
        plan.inv_std = plan.inv_std_bwd = torch.rsqrt(v + eps)
        alpha = self.momentum
        plan.state.update(fwd_buffer=written, running_var=alpha * self.running_var + (1 - alpha) * v)
        return plan

    def _gradient_estimate(self, q, plan: StepPlan):
        t, window, alpha = plan.step, self.bwd_buffer, self.momentum
        written = with_slot(window, t, plan.where_skipped(self.ema_grad, q))
        m = q
        if self.bwd_am:
            averaging = (t > window.shape[0]) & (t >= self.warmup_iters)
            m = plan.where_skipped(q, torch.where(averaging, written.mean(dim=0), q))
        ema = alpha * self.ema_grad + (1 - alpha) * m if self.bwd_ema else m
        return plan.where_skipped(m, ema), {"bwd_buffer": written, "ema_grad": ema}

    @torch.no_grad()
    def replay_step(self, second_moment: torch.Tensor, grad_stat: torch.Tensor,
                    skipped: torch.Tensor, clean: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Advance the state by one recorded training step, by the training step's own update:
        from its s_t, q_t, outlier flag and whether it was committed (``unnorm.record_statistics``
        records all four; the flag counts where the layer filters outliers, elsewhere its rule
        decides). Returns ``(v, psi)``. ``analysis.estimates`` replays runs with it."""
        plan = self._plan_step(second_moment, self.num_iters + 1, skipped)
        psi, state = self._gradient_estimate(grad_stat, plan)
        start = self._commit_forward(plan.state, clean)
        self._commit_backward(state, clean, torch.ones_like(clean), start, record=False)
        return plan.statistic, psi

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs):
        check_window_shapes(self, state_dict, prefix, ("fwd_buffer", "bwd_buffer"))
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)


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
