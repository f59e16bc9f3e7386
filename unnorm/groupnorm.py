"""GroupNorm (Wu and He, "Group Normalization", ECCV 2018) over channels-last input, so that
"Beyond BatchNorm" (Lubana, Dick and Tanaka, NeurIPS 2021)'s group-size axis exists for
Transformers: ``groups=1`` is LayerNorm, ``groups=C`` instance normalisation.

What a sample is follows ``layout`` (``unnorm.sample``):

- ``"token"`` (the default): each token's channels split into ``groups`` groups, each
  standardised over its C/G channels. ``groups=1`` is exactly LayerNorm. A group needs two
  channels (the variance of one value is 0), so the smallest group per token is two channels,
  whose standardisation is the sign of their difference: per token the instance extreme does
  not exist.
- ``"image"``: each example's group pooled over its C/G channels and every valid position,
  torch's ``nn.GroupNorm`` on ``(B, C, positions)`` as in the CNN papers: ``groups=C`` is
  ``nn.InstanceNorm1d`` (each channel over the positions), ``groups=1`` pools the whole
  example. Non-causal (the language model refuses it).

``groups`` follows the project's rule for grouped norms (BCN, EvoNorm-S0): one that does not
divide the channels falls to the largest divisor below it, and the resolved count is
``norm.groups``.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from .base import ChannelNorm, channel_mean_sq, upcast
from .sample import GroupStandardize, SampleStatistics, check_layout, resolve_groups


class GroupNorm(SampleStatistics, ChannelNorm):
    """``(x - group_mean) / sqrt(group_var + eps) * weight + bias``, per-channel affine, no
    running state (online). Statistics in float32 whatever the input's dtype."""

    def __init__(self, num_features: int, groups: int = 32, eps: float = 1e-5,
                 layout: str = "token", device=None, dtype=None):
        super().__init__(num_features, eps=eps, device=device, dtype=dtype)
        self.layout = check_layout(layout)
        self.groups = resolve_groups(num_features, groups, self.layout)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, groups={self.groups}, layout={self.layout}"

    def _normalize(self, rows, valid):
        if self._recording:
            self._tap.record_act(channel_mean_sq(rows, valid))
        rows = upcast(rows)
        fused = not self._tapped and self._grouping is None and (
            self._examples is None or valid is None)  # a padded image: statistics over valid rows
        if not fused:
            return self._affine(self._standardize(rows, valid), valid)
        plain = rows.detach()
        return self._watch_affine(self._fused(rows),
                                  lambda: {"weight": self._standardize(plain, valid), "bias": None})

    def _fused(self, rows: torch.Tensor) -> torch.Tensor:
        """Standardisation and affine in one fused step. Per token: one group is LayerNorm's
        kernel; more, BCN's group step with its backward by hand (torch's GroupNorm kernel on
        rows without positions, and LayerNorm's on rows of C/G channels, ran 3.5x and 2.5x a
        LayerNorm on a CPU). Per example: torch's GroupNorm kernel on ``(B, C, positions)``."""
        weight, bias = self._affine_weights()
        if self._examples is None and self.groups == 1:
            return F.layer_norm(rows, (self.num_features,), weight, bias, self.eps)
        if self._examples is None:
            return GroupStandardize.apply(rows, weight, bias, self.groups, self.eps)
        maps = rows.reshape(self._examples, -1, self.num_features).transpose(1, 2)
        out = F.group_norm(maps, self.groups, weight, bias, self.eps)
        return out.transpose(1, 2).reshape(rows.shape)

    def _standardize(self, rows: torch.Tensor, valid) -> torch.Tensor:
        """z: each sample's groups standardised over its valid rows, in float32."""
        mean, var = self._sample_moments(rows, self.groups, valid)
        return (rows - mean) * torch.rsqrt(var + self.eps)
