"""Norms that replace batch statistics by estimates: the shared forward/backward of UN, MABN and PN.

All three normalise by a quadratic mean (no centering) and use the same gradient form
(paper Eq. 6-9): with ``z = x * inv_std``, ``g = dy * weight * r`` and an estimate ``psi`` of
the gradient statistic ``mean(g * z)``,

    dx = (g - z * psi) * inv_std_bwd,   dweight = sum(dy * r * z),   dbias = sum(dy).

Each norm decides the per-step quantities and its new forward state in ``_plan_step`` and
``psi`` and its new backward state in ``_gradient_estimate``. The step count and every choice
that depends on it or on the data stay on the device (``torch.where``), so one compiled graph
serves every step. The forward state is committed by the training call, the backward state
by its backward (see ``GuardedNorm``); a rejected batch is normalised by the inference
statistic.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import torch

from .base import (StepCounted, builds_graph, call_id, channel_products, channel_sum,
                   channel_sum_sq, check_momentum, first_backward, per_channel, recomputing,
                   replicas_active, snapshot, statistic_ok, sum_over_replicas, unscaled, upcast,
                   zero_padding)


@dataclass
class StepPlan:
    """What one training step of an estimated norm uses (all tensors on the device).

    ``step`` is this step's t (the counter plus one); ``r`` is None where the norm never
    compensates; ``skip`` is the outlier flag (None where the norm never filters);
    ``state`` holds the candidate forward state, committed with the backward's;
    ``loss_scale`` the factor the backward's gradient carries (None: unscaled);
    ``statistic`` the v that ``inv_std`` is 1 / sqrt(v + eps) of (set by UN, whose replay
    reports it).
    """

    step: torch.Tensor
    inv_std: torch.Tensor
    inv_std_bwd: torch.Tensor
    r: Optional[torch.Tensor] = None
    skip: Optional[torch.Tensor] = None
    state: dict = field(default_factory=dict)
    loss_scale: Optional[torch.Tensor] = None
    statistic: Optional[torch.Tensor] = None

    def where_skipped(self, if_skipped: torch.Tensor, otherwise: torch.Tensor) -> torch.Tensor:
        return otherwise if self.skip is None else torch.where(self.skip, if_skipped, otherwise)


#: the plan's tensors the backward reads
SAVED_PLAN = ("step", "inv_std", "inv_std_bwd", "r", "skip")


class EstimatedNorm(StepCounted):
    """Base of UN, MABN and PN: training runs through ``_EstimatedNormFunction``."""

    r_in_forward = False  # MABN scales the forward output by r; UN applies r in backward only
    inference_stat = "running_var"  # the buffer eval mode divides by
    grad_stat_over_valid = True  # padded rows stay out of the backward's means
    tracks_corrected_gradient = False  # PN: the gradient EMA follows mean((g - z psi) z)

    def __init__(self, num_features: int, eps: float = 1e-5, momentum: float = 0.9,
                 warmup_iters: int = 0, sync_stats: bool = False, device=None, dtype=None):
        super().__init__(num_features, eps=eps, device=device, dtype=dtype)
        self.sync_stats = bool(sync_stats)  # sum statistics over data-parallel replicas
        self.momentum = check_momentum("momentum", momentum)
        self.warmup_iters = step_count("warmup_iters", warmup_iters)

    statistic_form = "second_moment"

    @property
    def eval_statistics(self) -> tuple[str, ...]:
        return (self.inference_stat,)

    def inference_affine(self):
        return self._running_affine()

    def _inference_inv_std(self) -> torch.Tensor:
        return torch.rsqrt(getattr(self, self.inference_stat) + self.eps)

    def _running_affine(self) -> tuple[torch.Tensor, torch.Tensor]:
        return upcast(self.weight) * self._inference_inv_std(), upcast(self.bias)

    def _evaluate(self, rows, valid, statistics):
        scale = upcast(self.weight) * torch.rsqrt(statistics[self.inference_stat] + self.eps)
        return torch.addcmul(upcast(self.bias), rows, scale)

    def _normalize(self, rows, valid):
        if not self.training:
            return self._evaluate(upcast(rows), valid, self._eval_buffers())
        if builds_graph(rows, self.weight, self.bias):
            return _EstimatedNormFunction.apply(rows, self.weight, self.bias, self, valid,
                                                recomputing())
        out, plan, accepted, _ = _forward_step(self, rows, self.weight, self.bias, valid)
        self._commit_graphless(plan.state, accepted)
        return out

    def _plan_step(self, second_moment: torch.Tensor, step: torch.Tensor) -> StepPlan:
        """Say how to normalise at step ``step`` with this batch's s_t, and the new forward
        state (``plan.state``)."""
        raise NotImplementedError

    def _gradient_estimate(self, grad_stat: torch.Tensor, plan: StepPlan) -> tuple[torch.Tensor, dict]:
        """``(psi, new backward state)`` from this step's q_t."""
        raise NotImplementedError

    def _corrected_gradient_state(self, grad_stat, psi, mean_z_sq) -> dict:
        """PN's new gradient EMA from ``mean((g - z psi) z) = q - psi mean(z^2)``."""
        raise NotImplementedError


def _forward_step(norm: EstimatedNorm, rows, weight, bias, valid):
    """The training forward: ``(output, plan, accepted, sum of squares)``, committing nothing."""
    rows = upcast(rows)
    total, count = channel_sum_sq(rows, valid, norm.sync_stats)
    second_moment = total / count.clamp_min(1)
    accepted = statistic_ok(total, count)
    plan = norm._plan_step(second_moment, norm.num_iters + 1)
    plan.loss_scale = norm.loss_scale  # read in forward: the backward sees this step's scale
    # a rejected batch is normalised by the inference statistic (its own may be 0 or NaN)
    fallback = norm._inference_inv_std()
    plan.inv_std = torch.where(accepted, plan.inv_std, fallback)
    plan.inv_std_bwd = torch.where(accepted, plan.inv_std_bwd, fallback)
    if norm._tap is not None:
        norm._tap.record_act(second_moment)
        norm._tap.record_skip(plan.where_skipped(torch.ones_like(accepted),
                                                 torch.zeros_like(accepted)))
    scale = upcast(weight) * plan.inv_std
    if norm.r_in_forward and plan.r is not None:
        scale = scale * plan.r
    return torch.addcmul(upcast(bias), rows, per_channel(scale)), plan, accepted, total


class _EstimatedNormFunction(torch.autograd.Function):
    """The shared training step; per-channel algebra keeps it to few passes over (N, C).

    With z = x * inv_std: sum(dy * z) = inv_std * sum(dy * x), so z is never materialised.
    """

    @staticmethod
    def forward(ctx, rows, weight, bias, norm: EstimatedNorm, valid, replay: bool):
        out, plan, accepted, total = _forward_step(norm, rows, weight, bias, valid)
        ctx.replay = replay  # a recomputation: its call recorded its rejection
        start = norm._commit_forward(plan.state, accepted)
        ctx.norm, ctx.loss_scale = norm, plan.loss_scale
        ctx.names, ctx.call = tuple(start), call_id(start)
        ctx.gns = norm._gns  # a GNS tap and this step's examples while recording
        ctx.examples = None if norm._gns is None else norm._gns.current
        ctx.save_for_backward(rows, valid, weight, accepted, total,
                              *(snapshot(getattr(plan, name)) for name in SAVED_PLAN),
                              *start.values())
        return out

    @staticmethod
    def backward(ctx, dy):
        rows, valid, weight, accepted, total, *rest = ctx.saved_tensors
        saved, start = rest[:len(SAVED_PLAN)], rest[len(SAVED_PLAN):]
        norm = ctx.norm
        plan = StepPlan(**dict(zip(SAVED_PLAN, saved)), loss_scale=ctx.loss_scale)
        first = first_backward(ctx)
        x, dy = upcast(rows), upcast(dy)
        inv_std = plan.inv_std
        r = torch.ones_like(inv_std) if plan.r is None else plan.r
        if ctx.gns is not None and first:  # per-row gradients: weight dy * z * r, bias dy
            factors = (x * (inv_std * r), None)
            ctx.gns.record(dy, ctx.examples, [(factor, False) for factor, trained in
                                              zip(factors, ctx.needs_input_grad[1:3]) if trained],
                           plan.loss_scale)
        sum_dy_x, sum_dy = channel_products(dy, x)
        sum_dy_z = sum_dy_x * inv_std                               # sum(dy * z)
        over_valid = valid is not None and norm.grad_stat_over_valid
        stat_dy_z = (channel_sum(zero_padding(dy * x, valid)) * inv_std if over_valid
                     else sum_dy_z)
        positions = torch.ones(1, device=x.device).mul_(x.shape[0])
        sum_sq = total  # of the valid rows (every replica's with sync_stats)
        synced = replicas_active(norm.sync_stats)
        if synced:
            stat_dy_z, positions = sum_over_replicas(stat_dy_z, positions)
        if norm.tracks_corrected_gradient and valid is not None and not over_valid:
            sum_sq = channel_sum(x.square())  # padded rows' z^2 too, as MaskPowerNorm's backward
            if synced:
                (sum_sq,) = sum_over_replicas(sum_sq)
        # mean(g * z), g = dy w r, in the unscaled loss's units: windows and EMAs never mix
        # loss scales, and a GradScaler's growth or back-off leaves psi as it was
        grad_stat = unscaled(stat_dy_z * (upcast(weight) * r) / positions, plan.loss_scale)
        if first:
            psi = _estimate_and_commit(ctx, plan, grad_stat, sum_sq, inv_std, positions, accepted,
                                       dict(zip(ctx.names, start)))
            if not torch.compiler.is_compiling():
                ctx.estimate = psi  # what a second backward of this graph uses
        else:
            psi = ctx.estimate
        if plan.loss_scale is not None:
            psi = psi * plan.loss_scale  # back in the units of this step's (scaled) g
        # dx = (g - z * psi) * inv_std_bwd, in one (N, C) buffer
        dx = (dy * per_channel(upcast(weight) * r * plan.inv_std_bwd)).addcmul_(
            x, per_channel(inv_std * psi * plan.inv_std_bwd), value=-1)
        return (dx.to(rows.dtype), (sum_dy_z * r).to(weight.dtype), sum_dy.to(weight.dtype),
                None, None, None)


def _estimate_and_commit(ctx, plan: StepPlan, grad_stat, sum_sq, inv_std, positions, accepted,
                         start) -> torch.Tensor:
    """psi from this call's q_t, and the call's backward state committed (first backward
    only: a graph backpropagated again reuses this psi)."""
    norm = ctx.norm
    if norm._tap is not None:
        norm._tap.record_grad(grad_stat)
    psi, state = norm._gradient_estimate(grad_stat, plan)
    finite = torch.isfinite(grad_stat).all()
    if norm.tracks_corrected_gradient:
        mean_z_sq = sum_sq * inv_std.square() / positions
        state = {**state, **norm._corrected_gradient_state(grad_stat, psi, mean_z_sq)}
        finite = finite & torch.isfinite(mean_z_sq).all()
    norm._forget_call(ctx.call)
    norm._commit_backward(state, accepted, finite, start, record=not ctx.replay)
    return psi


def compensation_factor(v: torch.Tensor, running_var: torch.Tensor, eps: float) -> torch.Tensor:
    """Renormalisation r = sqrt(v + eps) / sqrt(running_var + eps), clamped to [1/5, 5]."""
    return (torch.sqrt(v + eps) / torch.sqrt(running_var + eps)).clamp(1 / 5, 5)


def step_count(name: str, value) -> int:
    """A non-negative int option counted in training steps."""
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise ValueError(f"{name} must be an int >= 0 (training steps), got {value!r}")
    return value


def check_window_shapes(norm: EstimatedNorm, state_dict: dict, prefix: str,
                        names: tuple[str, ...]) -> None:
    """Refuse, naming ``window_size``, a state dict whose windows have another length."""
    theirs = tuple(state_dict[prefix + n].shape[0] if prefix + n in state_dict else None
                   for n in names)
    ours = tuple(getattr(norm, n).shape[0] for n in names)
    if any(t is not None and t != o for t, o in zip(theirs, ours)):
        shown = theirs[0] if len(set(theirs)) == 1 else theirs
        raise ValueError(f"{prefix or 'the norm'}: the state dict holds windows of {theirs} steps "
                         f"({', '.join(names)}), this layer {ours}: build it with "
                         f"window_size={shown} (Hydra: norm.window_size={shown}) to load it")
