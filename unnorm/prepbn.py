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

from .base import (StepCounted, check_momentum, commit_call, replicas_active, snapshot,
                   upcast)
from .estimated import step_count
from .simple import CausalStatistics, batch_standardize


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
        bn_on = step > self.warmup_iters
        state = {name: torch.where(bn_on, value, getattr(self, name))
                 for name, value in self._running_state(mean, var, count).items()}
        return commit_call(out, self, valid, state, self._batch_ok(var, count))

    def _start(self, rows: torch.Tensor, affine: bool = True) -> torch.Tensor:
        """The norm training starts from, on float32 rows, with its affine (``affine=False``:
        the standardised z alone)."""
        weight = upcast(self.weight) if affine else None
        bias = None if self.bias is None or not affine else upcast(self.bias)
        if self.start_norm == "ln":
            return F.layer_norm(rows, (self.num_features,), weight, bias, self.eps)
        normed = F.rms_norm(rows, (self.num_features,), weight, self.eps)
        return normed if bias is None else normed + bias
