"""Progressive re-parameterised BatchNorm (Guo et al., "SLAB", ICML 2024), as the release's
``LinearNorm(norm1=LayerNorm, norm2=RepBN, warm, step, r0)`` (xinghaochen/SLAB,
``classification/models/prepbn.py``).

Training starts as LayerNorm (RMSNorm in SLAB's LLaMA: ``start_norm="rms"``, ``bias=False``)
and hands over to ``RepBN(x) = BN(x) + alpha * x`` linearly:
after ``warmup_iters`` steps of pure LN, ``y = lam * LN(x) + (1 - lam) * RepBN(x)`` with
``lam = r0 * k / decay_iters`` and k counting down from ``decay_iters`` to 0, one per step;
then RepBN alone. Inference is RepBN alone: a per-channel affine, so it folds like BN.

Choose ``decay_iters`` from the run's length: the hand-over must end well before training
does. SLAB's fixed counts (60k steps) gave NaN on other schedules (xinghaochen/SLAB#6); users
report ending the decay at about 0.8 of training works, which is what the Hydra configs
derive (``decay_end: 0.8``; see ``plugins/training.py``).
"""
from __future__ import annotations

import math
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from .base import (StepCounted, channel_products, check_momentum, commit_call,
                   replicas_active, row_count, snapshot, upcast)
from .estimated import step_count
from .simple import CausalStatistics, batch_standardize, native_moments


class ProgressiveRepBN(CausalStatistics, StepCounted):
    """PRepBN. ``weight``/``bias`` are the starting norm's affine (what ``swap_norms`` carries
    over; ``bias=False``: a weight only); ``bn_weight``/``bn_bias`` the BatchNorm's; ``alpha``
    RepBN's scalar (shape (1,), as released). ``momentum`` is the paper's alpha (0.9 = torch's
    BatchNorm momentum 0.1); BN's statistics cover every valid position (``causal``: positions
    ``<= t`` only, ``unnorm.simple.CausalStatistics``) and are updated once the warm-up is
    over."""

    START_NORMS = ("ln", "rms")
    affine_names = ("weight", "bias", "bn_weight", "bn_bias")

    def __init__(self, num_features: int, warmup_iters: int = 0, decay_iters: int = 300000,
                 r0: float = 1.0, momentum: float = 0.9, eps: float = 1e-5,
                 sync_stats: bool = False, start_norm: str = "ln", bias: bool = True,
                 causal: bool = False, positions: Optional[int] = None, device=None, dtype=None):
        super().__init__(num_features, eps=eps, device=device, dtype=dtype)
        if not bias:
            self.register_parameter("bias", None)
        if start_norm not in self.START_NORMS:
            raise ValueError(f"start_norm must be one of {', '.join(self.START_NORMS)} (the norm "
                             f"training starts from: SLAB's vision models 'ln', its LLaMA 'rms'), "
                             f"got {start_norm!r}")
        self.start_norm = start_norm
        self.momentum = check_momentum("momentum", momentum)
        if not (isinstance(r0, (int, float)) and math.isfinite(r0) and 0.0 <= r0 <= 1.0):
            raise ValueError(f"r0 (the LayerNorm share when the decay starts) must be in [0, 1], "
                             f"got {r0!r}")
        if decay_iters is None:
            raise ValueError("prepbn needs decay_iters, the hand-over's length in steps (the "
                             "trainers derive it from norm.decay_end and the run's length)")
        self.warmup_iters = step_count("warmup_iters", warmup_iters)
        self.decay_iters = step_count("decay_iters", decay_iters)
        self.r0, self.sync_stats, self.causal = float(r0), bool(sync_stats), bool(causal)
        self.offline = self.offline_for(causal=self.causal)
        shape = self._running_shape(num_features, self.causal, positions)
        factory = {"device": device, "dtype": dtype}
        self.bn_weight = nn.Parameter(torch.ones(num_features, **factory))
        self.bn_bias = nn.Parameter(torch.zeros(num_features, **factory))
        self.alpha = nn.Parameter(torch.ones(1, **factory))
        self.register_buffer("running_mean", torch.zeros(shape, device=device))
        self.register_buffer("running_var", torch.ones(shape, device=device))

    def extra_repr(self) -> str:
        return (f"{super().extra_repr()}, start={self.start_norm}, warmup={self.warmup_iters}, "
                f"decay={self.decay_iters}, r0={self.r0}, momentum={self.momentum}"
                + (f", causal, positions={self.running_mean.shape[0]}" if self.causal else ""))

    def layer_norm_share(self, step: torch.Tensor) -> torch.Tensor:
        """lam at training step ``step`` (1 during warm-up, then r0 * k / decay_iters)."""
        k = (self.decay_iters - (step - self.warmup_iters - 1)).clamp(0, self.decay_iters)
        decaying = self.r0 * k.float() / max(self.decay_iters, 1)
        return torch.where(step <= self.warmup_iters, torch.ones_like(decaying), decaying)

    eval_statistics = ("running_mean", "running_var")

    def _running_affine(self) -> tuple[torch.Tensor, torch.Tensor]:
        return self._affine_for(self.running_mean, self.running_var)

    def _affine_for(self, running_mean, running_var) -> tuple[torch.Tensor, torch.Tensor]:
        """RepBN with these statistics: ``BN(x) + alpha x`` as one affine."""
        scale = upcast(self.bn_weight) * torch.rsqrt(running_var + self.eps)
        return scale + upcast(self.alpha), upcast(self.bn_bias) - scale * running_mean

    def _evaluate(self, rows, valid, statistics):
        return self._inference(rows, *self._affine_for(**statistics))

    def _normalize(self, rows, valid):
        rows = upcast(rows)
        if not self.training:
            return self._evaluate(rows, valid, self._eval_buffers())
        step = snapshot(self.num_iters + 1)  # the backward's share is this call's
        if self._fused_call(rows, valid):
            share = self.layer_norm_share(step)
            out, mean, inv_std = _HandOverStep.apply(
                rows, *self._affine_weights(), upcast(self.bn_weight), upcast(self.bn_bias),
                upcast(self.alpha), share, self.eps)
            plain = rows.detach()
            out = self._watch_affine(out, lambda: {  # as the general path's, recomputed
                "weight": share * self._start(plain, affine=False), "bias": share,
                "bn_weight": (1 - share) * (plain - mean) * inv_std, "bn_bias": 1 - share})
            mean, var = native_moments(mean, inv_std, self.eps)
            count = row_count(rows, valid)
            return commit_call(out, self, valid, self._bn_state(step, mean, var, count),
                               self._batch_ok(var, count))
        start = self._start(rows)
        z, mean, var, count = batch_standardize(rows, valid, self.eps,
                                                replicas_active(self.sync_stats),
                                                self._positions)
        if self._recording:
            self._tap.record_act(self._whole_batch(var))
        z_value, plain = z.detach(), rows.detach()
        z = self._watch_grad(z, valid)
        rep_bn = torch.addcmul(upcast(self.bn_bias), z, upcast(self.bn_weight)) + upcast(self.alpha) * rows
        share = self.layer_norm_share(step)
        mixed = share * start + (1 - share) * rep_bn
        out = torch.where(step <= self.warmup_iters, start, mixed)  # SLAB runs no BN in warm-up
        # the start norm's affine takes share of dy, RepBN's the rest (share is 1 in warm-up)
        out = self._watch_affine(out, lambda: {
            "weight": share * self._start(plain, affine=False), "bias": share,
            "bn_weight": (1 - share) * z_value, "bn_bias": 1 - share})
        return commit_call(out, self, valid, self._bn_state(step, mean, var, count),
                           self._batch_ok(var, count))

    def _bn_state(self, step, mean, var, count) -> dict[str, torch.Tensor]:
        """The candidate running statistics: the batch's once the warm-up is over."""
        bn_on = step > self.warmup_iters
        return {name: torch.where(bn_on, value, getattr(self, name))
                for name, value in self._running_state(mean, var, count).items()}

    def _fused_call(self, rows, valid) -> bool:
        """Whether this training call runs as ``_HandOverStep``: LN start, no padding, no
        replicas, no positions, no tap, and a non-empty batch (torch's batch-norm kernel
        refuses an empty one; the general path lets the guard reject it)."""
        return (self.start_norm == "ln" and valid is None and self._positions is None
                and not replicas_active(self.sync_stats) and not self._tapped
                and rows.shape[0] > 0)

    def _start(self, rows: torch.Tensor, affine: bool = True) -> torch.Tensor:
        """The norm training starts from, on float32 rows, with its affine (``affine=False``:
        the standardised z alone)."""
        weight = upcast(self.weight) if affine else None
        bias = None if self.bias is None or not affine else upcast(self.bias)
        if self.start_norm == "ln":
            return F.layer_norm(rows, (self.num_features,), weight, bias, self.eps)
        normed = F.rms_norm(rows, (self.num_features,), weight, self.eps)
        return normed if bias is None else normed + bias


class _HandOverStep(torch.autograd.Function):
    """A training call of PRepBN from a LayerNorm, ``lam (w LN(x) + b) + (1 - lam) (bw BN(x) +
    bb + alpha x)``, as torch's two fused kernels with the shares folded into their affines
    (issue 51): two (N, C) allocations each way, where autograd's graph of the mixture
    allocated about fifteen. In warm-up lam is 1 and the BatchNorm enters with weight 0: the
    output is the LayerNorm's wherever the batch's statistics are finite (where they are not,
    the guard rejects the call). Returns the output and the batch's mean and 1/std."""

    @staticmethod
    def forward(ctx, rows, weight, bias, bn_weight, bn_bias, alpha, share, eps):
        keep = 1 - share
        ln_affine = (weight * share, None if bias is None else bias * share)
        bn_affine = (bn_weight * keep, bn_bias * keep)
        out, ln_mean, ln_rstd = torch.native_layer_norm(rows, [rows.shape[-1]], *ln_affine, eps)
        bn_out, mean, inv_std = torch.native_batch_norm(rows, *bn_affine, None, None, True, 0.0,
                                                        eps)
        out = out.add_(bn_out).addcmul_(rows, alpha * keep)
        ctx.eps = eps
        ctx.save_for_backward(rows, share, alpha, ln_mean, ln_rstd, mean, inv_std, *ln_affine,
                              bn_affine[0])
        ctx.mark_non_differentiable(mean, inv_std)
        return out, mean, inv_std

    @staticmethod
    def backward(ctx, dy, _mean, _inv_std):
        rows, share, alpha, ln_mean, ln_rstd, mean, inv_std, ln_weight, ln_bias, bn_weight = \
            ctx.saved_tensors
        keep = 1 - share
        needs = ctx.needs_input_grad
        dx, dweight, dbias = torch.ops.aten.native_layer_norm_backward(
            dy, rows, [rows.shape[-1]], ln_mean, ln_rstd, ln_weight, ln_bias,
            [True, needs[1], needs[2]])
        bn_dx, dbn_weight, dbn_bias = torch.ops.aten.native_batch_norm_backward(
            dy, rows, bn_weight, None, None, mean, inv_std, True, ctx.eps,
            [True, needs[3], needs[4]])
        dx = dx.add_(bn_dx).addcmul_(dy, alpha * keep)
        dalpha = (channel_products(dy, rows)[0].sum() * keep).reshape(1) if needs[5] else None
        scaled = [None if grad is None else grad * factor for grad, factor in
                  ((dweight, share), (dbias, share), (dbn_weight, keep), (dbn_bias, keep))]
        return (dx, *scaled, dalpha, None, None)
