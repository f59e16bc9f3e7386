"""EvoNorm-B0 and EvoNorm-S0 (Liu, Brock, Simonyan and Le, "Evolving Normalization-Activation
Layers", NeurIPS 2020), as released in tensorflow/tpu ``models/official/resnet/resnet_model.py``
(``evonorm``, ``_batch_std``, ``_instance_std``, ``_group_std``):

- S0: ``x * sigmoid(v x) / group_std(x) * gamma + beta``;
- B0: ``x / max(batch_std(x), v x + instance_std(x)) * gamma + beta``, the batch variance
  kept as a moving average (decay 0.9, initialised to 1, no mean) for inference.

Nothing is mean-centred, and the norm fuses an activation: ``apply_act=False`` (the release's
``nonlinearity=False``) leaves the affine ``x * gamma + beta`` alone, an offline norm.
What the fused activation does in each placement (docs/core.md): Pre-norm, the branch input is
gated (S0's ``x sigmoid(v x)`` is SiLU at v = 1; B0's ratio saturates at 1/v for large x), the
residual stream is not; Post-norm, the residual stream itself is; Peri, both.

timm's ``EvoNorm2dB0``/``EvoNorm2dS0`` compute the same, except that timm's B0 defaults to
eps 1e-3 (the release and these: 1e-5) and keeps its running variance unbiased (the release:
biased; ``unbiased_running_var=True`` is timm's). Statistics within a sample follow
``layout`` (``unnorm.sample``): per token by default (S0's groups over each token's channels;
B0's instance std over the token's channels), per example with ``layout="image"``.
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import nn

from .base import (ChannelNorm, GuardedNorm, affine, builds_graph, channel_mean_sq,
                   channel_products, channel_sum, check_momentum, commit_call, replicas_active,
                   row_count, upcast)
from .sample import (SampleStatistics, check_layout, group_deviations, group_sums,
                     resolve_groups)
from .simple import CausalStatistics, batch_moments


class FusedActivation:
    """EvoNorm's activation parameter ``v`` (ones, per channel) and ``apply_act``: without
    it the norm is the affine ``x * weight + bias`` alone, offline."""

    apply_act: bool = True

    def _init_activation(self, apply_act: bool, device, dtype) -> None:
        self.apply_act = bool(apply_act)
        self.offline = self.offline_for(apply_act=self.apply_act)
        self.register_parameter("v", nn.Parameter(torch.ones(self.num_features, device=device,
                                                             dtype=dtype))
                                if self.apply_act else None)

    @classmethod
    def offline_for(cls, *, apply_act: bool = True, **options) -> bool:
        """Without its activation the norm is an affine: offline."""
        return not apply_act

    def inference_affine(self) -> tuple[torch.Tensor, torch.Tensor]:
        if self.apply_act:
            raise RuntimeError(f"{type(self).__name__} divides by statistics of each input (and "
                               "fuses an activation): an online norm, with no per-channel affine "
                               "to fold; only apply_act=False (an affine alone) folds")
        return upcast(self.weight), upcast(self.bias)


class EvoNormS0(FusedActivation, SampleStatistics, ChannelNorm):
    """EvoNorm-S0: ``x * sigmoid(v x) / sqrt(group_var(x) + eps) * weight + bias``, the group
    variance over each sample's ``groups`` channel groups (``unnorm.sample``: per token by
    default; a ``groups`` that does not divide the channels falls to the largest divisor
    below it, as in the release). No running state; online."""

    def __init__(self, num_features: int, groups: int = 32, eps: float = 1e-5,
                 apply_act: bool = True, layout: str = "token", device=None, dtype=None):
        super().__init__(num_features, eps=eps, device=device, dtype=dtype)
        self.layout = check_layout(layout)
        self.groups = resolve_groups(num_features, groups, self.layout)
        self._init_activation(apply_act, device, dtype)

    def extra_repr(self) -> str:
        return (f"{super().extra_repr()}, groups={self.groups}, layout={self.layout}"
                + ("" if self.apply_act else ", apply_act=False"))

    def _normalize(self, rows, valid):
        if self._recording:
            self._tap.record_act(channel_mean_sq(rows, valid))
        rows = upcast(rows)
        if self.apply_act and self.layout == "token" and self._grouping is None \
                and not self._tapped:
            plain = rows.detach()
            return self._watch_affine(
                _S0Step.apply(rows, upcast(self.v), *self._affine_weights(), self.groups,
                              self.eps),
                lambda: {"weight": self._activated(plain, valid), "bias": None})
        return self._affine(self._activated(rows, valid) if self.apply_act else rows, valid)

    def _activated(self, rows, valid):
        """``x sigmoid(v x) / sqrt(group_var(x) + eps)``, the output before the affine."""
        _, var = self._sample_moments(rows, self.groups, valid)
        return rows * torch.sigmoid(upcast(self.v) * rows) / torch.sqrt(var + self.eps)


class EvoNormB0(FusedActivation, SampleStatistics, CausalStatistics, GuardedNorm):
    """EvoNorm-B0: ``x / max(sqrt(batch_var + eps), v x + sqrt(instance_var(x) + eps)) *
    weight + bias``.

    The batch variance (biased, not centred in the output) pools every valid position of the
    batch per channel (``sync_stats``: every replica's; ``causal``: positions ``<= t``, kept
    per position), with gradient, as in the release; inference uses ``running_var``, an EMA
    keeping ``momentum`` (the paper's alpha: the release's decay 0.9, timm's momentum 0.1) of
    the old value, biased as released (``unbiased_running_var=True``: timm's). The instance
    variance pools within a sample (``layout``): per token over its channels, or per example
    and channel over its positions (``layout="image"``, the release on images). Guarded as
    every norm with running state: a rejected batch or a skipped update leaves
    ``running_var`` as it was. Online: the instance term depends on each input."""

    _running_names = ("running_var",)
    statistic_form = "variance"

    @property
    def eval_statistics(self) -> tuple[str, ...]:
        """Without its activation B0 computes no statistic."""
        return ("running_var",) if self.apply_act else ()

    def __init__(self, num_features: int, eps: float = 1e-5, momentum: float = 0.9,
                 apply_act: bool = True, layout: str = "token", unbiased_running_var: bool = False,
                 sync_stats: bool = False, causal: bool = False, positions: Optional[int] = None,
                 device=None, dtype=None):
        super().__init__(num_features, eps=eps, device=device, dtype=dtype)
        self.momentum = check_momentum("momentum", momentum)
        self.sync_stats, self.causal = bool(sync_stats), bool(causal)
        self.unbiased_running_var = bool(unbiased_running_var)
        self.layout = check_layout(layout, self.causal)
        # the instance statistic: the token's channels (one group), or each channel over an
        # example's positions (one channel a group); per token it needs two channels
        self._instance_groups = (resolve_groups(num_features, 1, "token")
                                 if self.layout == "token" else num_features)
        shape = self._running_shape(num_features, self.causal, positions)
        self.register_buffer("running_var", torch.ones(shape, device=device))
        self._init_activation(apply_act, device, dtype)

    def extra_repr(self) -> str:
        causal = f", causal, positions={self.running_var.shape[0]}" if self.causal else ""
        return (f"{super().extra_repr()}, momentum={self.momentum}, layout={self.layout}"
                + ("" if self.apply_act else ", apply_act=False") + causal)

    def _running_update(self, old, mean, var, count):
        if self.unbiased_running_var:
            var = var * count / (count - 1).clamp_min(1)
        return {"running_var": self.momentum * old["running_var"] + (1 - self.momentum) * var}

    def _normalize(self, rows, valid):
        rows = upcast(rows)
        if not self.apply_act:  # the release computes no statistic then, and updates none
            out = self._affine(rows, valid)
            accepted = torch.ones((), dtype=torch.bool, device=rows.device)
            return commit_call(out, self, valid, {}, accepted) if self.training else out
        if not self.training:
            return self._evaluate(rows, valid, self._eval_buffers())
        if self._fused_call(rows, valid):
            out, var = _B0Step.apply(rows, upcast(self.v), *self._affine_weights(), self.eps)
            plain = rows.detach()
            out = self._watch_affine(out, lambda: {"weight": plain * _b0_inverse(
                plain, upcast(self.v).detach(), torch.sqrt(var + self.eps), self.eps)[0],
                "bias": None})
            count = row_count(rows, valid)
            return commit_call(out, self, valid, self._running_state(None, var, count),
                               self._batch_ok(var, count))
        _, _, var, count = batch_moments(rows, valid, replicas_active(self.sync_stats),
                                         self._positions)
        batch_var = self._per_row(var, rows)
        if valid is not None:  # a padded row's output sends no gradient to the statistic
            batch_var = torch.where(valid[:, None], batch_var, batch_var.detach())
        var, count = var.detach(), count.detach()
        if self._recording:
            self._tap.record_act(self._whole_batch(var))
        return commit_call(self._divide(rows, valid, batch_var), self, valid,
                           self._running_state(None, var, count), self._batch_ok(var, count))

    def _fused_call(self, rows, valid) -> bool:
        """Whether this training call runs as ``_B0Step``: per token, no padding, replicas,
        positions or tap, and a non-empty batch (the general path lets the guard reject it)."""
        return (self.layout == "token" and valid is None and self._positions is None
                and not replicas_active(self.sync_stats) and not self._tapped
                and rows.shape[0] > 0)

    def _evaluate(self, rows, valid, statistics):
        if (self.layout == "token" and self._positions is None
                and not builds_graph(rows, *self.parameters())):  # the hand-written forward
            batch_std = torch.sqrt(statistics["running_var"] + self.eps)
            inverse = _b0_inverse(rows, upcast(self.v), batch_std, self.eps)[0]
            return affine(inverse.mul_(rows), *self._affine_weights(), inplace=True)
        return self._divide(rows, valid, self._per_row(statistics["running_var"], rows))

    def _divide(self, rows, valid, batch_var):
        """``x / max(sqrt(batch_var + eps), v x + instance_std(x))``, then the affine."""
        _, instance_var = self._sample_moments(rows, self._instance_groups, valid)
        left = torch.sqrt(batch_var + self.eps)
        right = upcast(self.v) * rows + torch.sqrt(instance_var + self.eps)
        return self._affine(rows / torch.maximum(left, right), valid)


class _S0Step(torch.autograd.Function):
    """EvoNorm-S0 per token, ``x sigmoid(v x) / sqrt(group_var(x) + eps) * weight + bias``, with
    its backward by hand (issue 51): two (N, C) allocations forward and three backward, where
    autograd's graph of the composite allocated about twenty. With ``s = sigmoid(v x)``,
    ``h = x s``, ``r`` each group's ``1 / sqrt(var + eps)`` and ``q = h r``: ``dweight =
    sum(dy q)``, ``dbias = sum(dy)``; ``dh = dy weight r``; through r, ``dL/dr = sum over the
    group of dy weight h`` and ``dx += -dL/dr r^3 (x - mean) / group size``; through h,
    ``dx += dh (s + v x s (1 - s))`` and ``dv = sum(dh x^2 s (1 - s))``."""

    @staticmethod
    def forward(ctx, rows, v, weight, bias, groups, eps):
        deviations, mean, rstd, squares = group_deviations(rows, groups, eps)
        s = torch.mul(rows, v, out=deviations.view(rows.shape)).sigmoid_()
        out = torch.mul(rows, s, out=squares.view(rows.shape))
        out.view(squares.shape).mul_(rstd)
        ctx.size = squares.shape[1]
        ctx.save_for_backward(rows, v, weight, s, mean, rstd)
        return affine(out, weight, bias, inplace=True)

    @staticmethod
    def backward(ctx, dy):
        rows, v, weight, s, mean, rstd = ctx.saved_tensors
        shape = (-1, ctx.size)
        q = rows * s
        q.view(shape).mul_(rstd)
        dweight, dbias = channel_products(dy, q)
        dh = dy * weight  # dL/dq, then dL/dh
        by_r = group_sums(q.mul_(dh), ctx.size).div_(rstd)  # dL/dr per group
        dh.view(shape).mul_(rstd)
        through_s = torch.sub(1, s).mul_(s).mul_(rows).mul_(dh)  # dh x s (1 - s)
        dv = channel_products(through_s, rows)[0]
        dx = dh.mul_(s).addcmul_(through_s, v)
        centred = torch.sub(rows.view(shape), mean, out=q.view(shape))
        dx.view(shape).addcmul_(centred, by_r.mul_(rstd.pow(3)).div_(-ctx.size))
        needs = ctx.needs_input_grad
        return (dx, dv, dweight if needs[2] else None, dbias if needs[3] else None, None,
                None)


def _b0_inverse(rows, v, batch_std, eps):
    """``(1 / max(batch_std, v x + instance_std(x)), instance mean, instance std)`` per token,
    in two (N, C) allocations: LayerNorm's kernel gives the token's moments (var_mean's ran 7x
    slower on CPU), and its output buffer, otherwise unused, takes the right side and then the
    inverse."""
    scratch, instance_mean, instance_rstd = torch.native_layer_norm(rows, [rows.shape[-1]],
                                                                    None, None, eps)
    instance_std = instance_rstd.reciprocal()
    right = _b0_right(rows, v, instance_std, out=scratch)
    return torch.maximum(right, batch_std, out=right).reciprocal_(), instance_mean, instance_std


def _b0_right(rows, v, instance_std, out=None):
    """``v x + instance_std``, the right side of B0's max (a product, then the per-token term
    in place: addcmul broadcasting the (N, 1) term ran 3x slower on CPU)."""
    return torch.mul(rows, v, out=out).add_(instance_std)


class _B0Step(torch.autograd.Function):
    """A training call of EvoNorm-B0 per token, ``x / max(L, R) * weight + bias`` with ``L =
    sqrt(batch_var + eps)`` per channel and ``R = v x + sqrt(instance_var + eps)``, with its
    backward by hand (issue 51), as torch's ``maximum`` (a tie sends half the gradient each
    way). With ``d = max(L, R)``, ``q = x / d`` and ``dd = -dy weight q / d``: ``dweight =
    sum(dy q)``, ``dbias = sum(dy)``; ``dx = dy weight / d``, plus through R ``dR v`` (``dv =
    sum(dR x)``) and the instance variance ``sum_c dR / (C instance_std) (x - instance_mean)``,
    plus through L the batch variance ``sum_n dL / (N L) (x - batch_mean)``. The forward
    keeps ``1 / d`` (``_b0_inverse``), the backward R's share of ``dd`` (``(sign(R - L) +
    1) / 2``, recomputed: no third saved (N, C) tensor) and three more (N, C) buffers, each
    written in place from there on. Returns the output and the batch variance (for the running one)."""

    @staticmethod
    def forward(ctx, rows, v, weight, bias, eps):
        batch_mean, batch_var = torch.batch_norm_update_stats(rows, None, None, 0.0)
        batch_std = torch.sqrt(batch_var + eps)
        inverse, instance_mean, instance_std = _b0_inverse(rows, v, batch_std, eps)
        ctx.save_for_backward(rows, v, weight, inverse, batch_mean, batch_std, instance_mean,
                              instance_std)
        ctx.mark_non_differentiable(batch_var)
        return affine(rows * inverse, weight, bias, inplace=True), batch_var

    @staticmethod
    def backward(ctx, dy, _var):
        rows, v, weight, inverse, batch_mean, batch_std, instance_mean, instance_std = \
            ctx.saved_tensors
        normed = rows * inverse
        dweight, dbias = channel_products(dy, normed)
        dx = torch.mul(dy, weight).mul_(inverse)  # dy weight / d, then dx
        minus_dd = normed.mul_(dx)
        # R's share of dd is (sign(R - L) + 1) / 2: 1 where R is the larger, 0 where L is, 1/2
        # at a tie; -2 dR = (sign + 1) (-dd), one addcmul into the sign's buffer
        sign = _b0_right(rows, v, instance_std).sub_(batch_std).sign_()
        minus_2d_right = torch.addcmul(minus_dd, sign, minus_dd, out=sign)
        minus_2dv, minus_2sum_right = channel_products(minus_2d_right, rows)
        d_batch_std = minus_2sum_right / 2 - channel_sum(minus_dd)  # sum_n (dd - dR) = sum_n dL
        d_instance_std = minus_2d_right.sum(dim=-1, keepdim=True).div_(-2)
        dx = dx.addcmul_(minus_2d_right, v, value=-0.5)
        centred = torch.sub(rows, instance_mean, out=minus_2d_right)
        dx = dx.addcmul_(centred, d_instance_std / (instance_std * rows.shape[1]))
        centred = torch.sub(rows, batch_mean, out=centred)
        dx = dx.addcmul_(centred, d_batch_std / (batch_std * rows.shape[0]))
        needs = ctx.needs_input_grad
        return (dx, minus_2dv / -2, dweight if needs[2] else None, dbias if needs[3] else None,
                None)
