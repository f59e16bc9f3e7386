"""Norms that replace batch statistics by estimates: the shared forward/backward of UN, MABN and PN.

All three normalise by a quadratic mean (no centering) and use the same gradient form
(paper Eq. 6-9): with ``z = x * inv_std``, ``g = dy * weight * r`` and an estimate ``psi`` of
the gradient statistic ``mean(g * z)``,

    dx = (g - z * psi) * inv_std_bwd,   dweight = sum(dy * r * z),   dbias = sum(dy).

Each norm decides the per-step quantities in ``_plan_step`` (forward) and ``psi`` in
``_gradient_estimate`` (backward); every data-dependent choice stays on the device.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from .base import StepCounted, channel_sum_sq, replicas_active, sum_over_replicas, zero_padding


@dataclass
class StepPlan:
    """What one training step of an estimated norm uses.

    ``r`` is None for 1. ``skip`` is the device-side outlier flag (None: no test this step);
    ``skip_always`` is the static case (a window of one).
    """

    step: int
    inv_std: torch.Tensor
    inv_std_bwd: torch.Tensor
    r: Optional[torch.Tensor] = None
    skip: Optional[torch.Tensor] = None
    skip_always: bool = False

    def where_skipped(self, if_skipped: torch.Tensor, otherwise: torch.Tensor) -> torch.Tensor:
        return where_skipped(self.skip, self.skip_always, if_skipped, otherwise)


def where_skipped(skip: Optional[torch.Tensor], skip_always: bool, if_skipped: torch.Tensor,
                  otherwise: torch.Tensor) -> torch.Tensor:
    """Select on the outlier flag without reading it on the host."""
    if skip_always:
        return if_skipped
    if skip is None:
        return otherwise
    return torch.where(skip, if_skipped, otherwise)


class EstimatedNorm(StepCounted):
    """Base of UN, MABN and PN: training runs through ``_EstimatedNormFunction``."""

    r_in_forward = False  # MABN scales the forward output by r; UN applies r in backward only
    inference_stat = "running_var"  # the buffer eval mode divides by

    def __init__(self, num_features: int, eps: float = 1e-5, momentum: float = 0.9,
                 warmup_iters: int = 0, sync_stats: bool = False, device=None, dtype=None):
        super().__init__(num_features, eps=eps, device=device, dtype=dtype)
        self.sync_stats = bool(sync_stats)  # sum statistics over data-parallel replicas
        if not 0.0 <= momentum < 1.0:
            raise ValueError(f"momentum (alpha) must be in [0, 1), got {momentum}")
        if warmup_iters < 0:
            raise ValueError(f"warmup_iters must be >= 0, got {warmup_iters}")
        self.momentum = float(momentum)
        self.warmup_iters = int(warmup_iters)

    def inference_affine(self):
        return self._running_affine()

    def _running_affine(self) -> tuple[torch.Tensor, torch.Tensor]:
        variance = getattr(self, self.inference_stat)
        return self.weight.float() * torch.rsqrt(variance + self.eps), self.bias.float()

    def _normalize(self, rows, valid):
        if not self.training:
            scale, shift = self._running_affine()
            return torch.addcmul(shift, rows.float(), scale)
        self._advance()
        return _EstimatedNormFunction.apply(rows, self.weight, self.bias, self, valid)

    def _plan_step(self, second_moment: torch.Tensor) -> StepPlan:
        """Update the forward state with this step's s_t and say how to normalise."""
        raise NotImplementedError

    def _gradient_estimate(self, grad_stat: torch.Tensor, plan: StepPlan) -> torch.Tensor:
        """Update the backward state with this step's q_t and return psi."""
        raise NotImplementedError

    def _observe_corrected_gradient(self, grad_stat, psi, second_moment, valid_fraction, plan):
        """Hook for PN, whose gradient EMA follows the corrected gradient ``g - z * psi``."""


class _EstimatedNormFunction(torch.autograd.Function):
    """The shared training step; per-channel algebra keeps it to few passes over (N, C).

    With z = x * inv_std: sum(dy * z) = inv_std * sum(dy * x), so z is never materialised.
    """

    @staticmethod
    def forward(ctx, rows, weight, bias, norm: EstimatedNorm, valid):
        total, count = channel_sum_sq(rows, valid, norm.sync_stats)
        second_moment = total / count
        plan = norm._plan_step(second_moment)
        if norm._tap is not None:
            norm._tap.record_act(second_moment)
            norm._tap.record_skip(plan.where_skipped(
                torch.ones((), dtype=torch.bool, device=rows.device),
                torch.zeros((), dtype=torch.bool, device=rows.device)))
        scale = weight.float() * plan.inv_std
        if norm.r_in_forward and plan.r is not None:
            scale = scale * plan.r
        ctx.norm, ctx.plan = norm, plan
        ctx.second_moment, ctx.valid_count = second_moment, count
        ctx.save_for_backward(rows, valid, weight)
        return torch.addcmul(bias.float(), rows.float(), scale)

    @staticmethod
    def backward(ctx, dy):
        rows, valid, weight = ctx.saved_tensors
        norm, plan = ctx.norm, ctx.plan
        x, dy = rows.float(), dy.float()
        inv_std = plan.inv_std
        r = torch.ones_like(inv_std) if plan.r is None else plan.r
        dy_x = dy * x
        sum_dy_z = dy_x.sum(dim=0) * inv_std                       # sum(dy * z)
        valid_dy_z = sum_dy_z if valid is None else zero_padding(dy_x, valid).sum(dim=0) * inv_std
        positions = torch.full((1,), float(x.shape[0]), device=x.device)
        if replicas_active(norm.sync_stats):
            valid_dy_z, positions = sum_over_replicas(valid_dy_z, positions)
        grad_stat = valid_dy_z * (weight.float() * r) / positions  # mean(g * z), g = dy w r
        if norm._tap is not None:
            norm._tap.record_grad(grad_stat)
        psi = norm._gradient_estimate(grad_stat, plan)
        norm._observe_corrected_gradient(grad_stat, psi, ctx.second_moment,
                                         ctx.valid_count / positions, plan)
        # dx = (g - z * psi) * inv_std_bwd
        dx = (dy * (weight.float() * r * plan.inv_std_bwd)
              - x * (inv_std * psi * plan.inv_std_bwd))
        return (dx.to(rows.dtype), (sum_dy_z * r).to(weight.dtype),
                dy.sum(dim=0).to(weight.dtype), None, None)


def compensation_factor(v: torch.Tensor, running_var: torch.Tensor, eps: float) -> torch.Tensor:
    """Renormalisation r = sqrt(v + eps) / sqrt(running_var + eps), clamped to [1/5, 5]."""
    return (torch.sqrt(v + eps) / torch.sqrt(running_var + eps)).clamp(1 / 5, 5)
