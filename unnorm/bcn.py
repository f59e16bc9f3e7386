"""Batch-Channel Normalization (Qiao et al., "Micro-Batch Training with Batch-Channel
Normalization and Weight Standardization", arXiv:1903.10520), as released in
joe-siyuan-qiao/Batch-Channel-Normalization: ``imagenet/models/layers.py``, class ``GN``
(``nn.BatchNorm2d``, then a group normalization of each sample without affine, then a
per-group affine), and the README's ``BCNorm(..., estimate=True)`` with ``EstBN``, micro-batch
BCN, whose batch part normalises by running estimates in training too.
"""
from __future__ import annotations

import math
from typing import Optional

import torch
from torch import nn

from .base import affine, replicas_active, snapshot, upcast
from .sample import GroupStandardize, SampleStatistics, check_layout, resolve_groups
from .simple import BatchNorm, batch_moments


class BatchChannelNorm(SampleStatistics, BatchNorm):
    """BCN: ``BN(x)`` with its per-channel affine (``weight``, ``bias``: the release's
    ``pbn``), then each sample's ``groups`` channel groups standardised (no affine, eps
    ``group_eps``), then a per-group affine (``group_weight``, ``group_bias``: the release's
    ``weight``, ``bias`` of shape (1, G, 1)).

    The batch part is unnorm's ``bn``: statistics over every valid position of the batch
    (``sync_stats``: of every replica; ``causal``: positions ``<= t``, running statistics per
    position), running estimates with ``momentum`` the paper's alpha (torch's 0.1 is 0.9),
    variance unbiased as torch's BatchNorm2d keeps it. ``estimate=True`` is micro-batch BCN
    (``EstBN``): in training too the batch part normalises by the running estimates, first
    moved toward the batch (``mean <- alpha mean + (1 - alpha) batch mean``, ``var <- alpha
    var + (1 - alpha) mean((x - old mean)^2)``, biased, as released), with no gradient through
    them. The channel part pools within a sample: per token by default, per example with
    ``layout="image"`` (``unnorm.sample``). Inference keeps the channel part, which depends on
    each input: BCN is online and does not fold.
    """

    affine_names = ("weight", "bias")  # the per-channel affine; the G-value group affine is not tapped

    def __init__(self, num_features: int, groups: int = 32, eps: float = 1e-5,
                 group_eps: Optional[float] = None, momentum: float = 0.9, estimate: bool = False,
                 layout: str = "token", sync_stats: bool = False, causal: bool = False,
                 positions: Optional[int] = None, device=None, dtype=None):
        super().__init__(num_features, eps=eps, momentum=momentum, sync_stats=sync_stats,
                         causal=causal, positions=positions, device=device, dtype=dtype)
        self.layout = check_layout(layout, self.causal)
        self.groups = resolve_groups(num_features, groups, self.layout)
        group_eps = eps if group_eps is None else group_eps
        if not (isinstance(group_eps, (int, float)) and math.isfinite(group_eps) and group_eps > 0):
            raise ValueError(f"group_eps must be a positive number (None: eps), got {group_eps!r}")
        self.group_eps = float(group_eps)
        self.estimate = bool(estimate)
        factory = {"device": device, "dtype": dtype}
        self.group_weight = nn.Parameter(torch.ones(self.groups, **factory))
        self.group_bias = nn.Parameter(torch.zeros(self.groups, **factory))

    @classmethod
    def offline_for(cls, **options) -> bool:
        """The channel part normalises each sample by its own statistics: never offline."""
        return False

    def inference_affine(self):
        raise RuntimeError("BCN's channel normalization depends on each input: an online norm, "
                           "with no per-channel affine to fold")

    def extra_repr(self) -> str:
        return (f"{super().extra_repr()}, groups={self.groups}, group_eps={self.group_eps}, "
                f"layout={self.layout}" + (", estimate" if self.estimate else ""))

    def _batch_part(self, rows, valid, with_affine):
        if not self.estimate:
            return super()._batch_part(rows, valid, with_affine)
        shift, mean, var, count = (stat.detach() for stat in batch_moments(
            rows, valid, replicas_active(self.sync_stats), self._positions))
        state = self._running_state(shift + mean, var, count)
        # the release normalises by the estimates just moved toward this batch, as constants
        scale = snapshot(torch.rsqrt(state["running_var"] + self.eps))
        shift = snapshot(-state["running_mean"] * scale)
        z = self._inference(rows, scale, shift)
        return ((affine(z, *self._affine_weights()) if with_affine else z), state, var, count,
                lambda plain: self._inference(plain, scale, shift))

    def _running_update(self, old, mean, var, count):
        if not self.estimate:
            return super()._running_update(old, mean, var, count)
        alpha, old_mean = self.momentum, old["running_mean"]
        # EstBN: mean((x - old mean)^2) = var + (mean - old mean)^2, biased
        return {"running_mean": alpha * old_mean + (1 - alpha) * mean,
                "running_var": alpha * old["running_var"]
                + (1 - alpha) * (var + (mean - old_mean).square())}

    def _then(self, out, valid):
        """The channel part: each sample's groups standardised, then the per-group affine;
        per token in channel order and untapped, ``unnorm.sample.GroupStandardize``."""
        if self.layout == "token" and self._grouping is None and not self._tapped:
            weight, bias = (self._per_group(upcast(p), self.groups)
                            for p in (self.group_weight, self.group_bias))
            return GroupStandardize.apply(out, weight, bias, self.groups, self.group_eps)
        mean, var = self._sample_moments(out, self.groups, valid)
        normed = (out - mean) / torch.sqrt(var + self.group_eps)
        return torch.addcmul(self._per_group(upcast(self.group_bias), self.groups), normed,
                             self._per_group(upcast(self.group_weight), self.groups))

