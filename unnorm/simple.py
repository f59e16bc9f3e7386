"""The baselines that need no custom backward: LN, RMSNorm, BN and NoNorm."""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

from .base import (ChannelNorm, GuardedNorm, affine, channel_mean_sq, check_momentum, commit_call,
                   replicas_active, row_count, statistic_ok, sum_over_replicas, upcast,
                   zero_padding)


class LayerNorm(ChannelNorm):
    """LayerNorm over the channel axis of each position (online)."""

    def _normalize(self, rows, valid):
        if self._recording:
            self._tap.record_act(channel_mean_sq(rows, valid))
            return self._affine(self._standardize(rows), valid)
        bias = None if self.bias is None else upcast(self.bias)
        out = F.layer_norm(upcast(rows), (self.num_features,), upcast(self.weight), bias, self.eps)
        rows = rows.detach()  # the fused kernel keeps no z: the GNS tap recomputes it
        return self._watch_affine(out, lambda: {"weight": self._standardize(rows), "bias": None})

    def _standardize(self, rows: torch.Tensor) -> torch.Tensor:
        """z: each row standardised over its channels, in float32, before the affine."""
        return F.layer_norm(upcast(rows), (self.num_features,), eps=self.eps)


class RMSNorm(ChannelNorm):
    """RMSNorm (Zhang and Sennrich 2019) per position (online).

    Carries a bias (zeros) like the other norms, so ``swap_norms`` keeps a LayerNorm's shift;
    ``bias=False`` is Llama's RMSNorm (a weight only).
    """

    def _normalize(self, rows, valid):
        if self._recording:
            self._tap.record_act(channel_mean_sq(rows, valid))
        rows = upcast(rows)
        if self._tapped:
            return self._affine(rows * _inv_rms(rows, self.eps), valid)
        plain = rows.detach()
        return self._watch_affine(rms_normalize(rows, self.eps, *self._affine_weights()),
                                  lambda: {"weight": plain * _inv_rms(plain, self.eps),
                                           "bias": None})


def _inv_rms(rows: torch.Tensor, eps: float) -> torch.Tensor:
    """``1 / sqrt(mean(x^2) + eps)`` per row, ``(N, 1)``; the row norm's kernel allocates no
    (N, C) tensor of squares."""
    norms = torch.linalg.vector_norm(rows, dim=-1, keepdim=True)
    return torch.rsqrt(norms.square() / rows.shape[-1] + eps)


#: devices where torch's ``F.rms_norm`` is a fused kernel, forward and backward (on a CPU it
#: is autograd's composite, 4x a LayerNorm: ``_RMSNormStep`` runs there)
FUSED_RMS_DEVICES = ("cuda",)


def rms_normalize(rows: torch.Tensor, eps: float, weight: Optional[torch.Tensor] = None,
                  bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``x / sqrt(mean(x^2) + eps) * weight + bias`` over the last axis of ``(N, C)`` rows (no
    weight: no affine): torch's fused kernel where it has one, else ``_RMSNormStep``, two
    (N, C) allocations per step."""
    if rows.device.type in FUSED_RMS_DEVICES:
        out = F.rms_norm(rows, rows.shape[-1:], weight, eps)
        return out if bias is None else out + bias
    return _RMSNormStep.apply(rows, weight, bias, eps)


class _RMSNormStep(torch.autograd.Function):
    """RMSNorm with LayerNorm's fused backward (issue 51).

    torch has no CPU kernel for RMSNorm's backward, and autograd's graph of the composite
    allocated five (N, C) tensors per step, 7x LayerNorm's time. RMSNorm's backward is
    LayerNorm's at a mean of 0, less LayerNorm's ``- rstd * mean(dy * weight)`` term:
    ``native_layer_norm_backward`` with ``mean = 0`` gives dweight and dbias exactly and dx up
    to that term, added back from one row reduction. Two (N, C) allocations, as LayerNorm's
    own step."""

    @staticmethod
    def forward(ctx, rows, weight, bias, eps):
        inv = _inv_rms(rows, eps)
        ctx.save_for_backward(rows, weight, bias, inv)
        out = rows * inv
        return out if weight is None else affine(out, weight, bias, inplace=True)

    @staticmethod
    def backward(ctx, dy):
        rows, weight, bias, inv = ctx.saved_tensors
        channels = rows.shape[-1]
        needs = ctx.needs_input_grad
        dx, dweight, dbias = torch.ops.aten.native_layer_norm_backward(
            dy, rows, [channels], torch.zeros_like(inv), inv, weight, bias,
            [True, weight is not None and needs[1], bias is not None and needs[2]])
        mean_g = dy.mean(-1) if weight is None else torch.mv(dy, weight).div_(channels)
        return dx.add_(inv * mean_g.unsqueeze(-1)), dweight, dbias, None


class NoNorm(ChannelNorm):
    """Identity. Keeps a frozen ``weight`` buffer because hosts (timm) read ``norm.weight``."""

    def __init__(self, num_features: int, eps: float = 1e-5, device=None, dtype=None):
        super().__init__(num_features, eps=eps, device=device, dtype=dtype)
        del self.weight, self.bias
        self.register_buffer("weight", torch.ones(num_features, device=device, dtype=dtype),
                             persistent=False)
        self.register_parameter("bias", None)

    def _normalize(self, rows, valid):
        if not self._recording:
            return rows
        self._tap.record_act(channel_mean_sq(rows, valid))
        return self._watch_grad(upcast(rows).view_as(rows), valid)  # a new node, not the caller's


class CausalStatistics:
    """The ``causal`` option of a batch-statistics norm (BN, PRepBN's BN) in a causal model.

    Pooled over every position, training-mode statistics let the output at position t depend
    on later tokens (``plugins.lm.leak`` measures it). With ``causal=True`` the input must be
    batch-first sequences ``(B, T, C)``, and position t is standardised by the mean and
    variance of every sequence's positions ``<= t``: nothing later reaches it.

    Evaluation matches training position by position: the running statistics are kept per
    position, ``(positions, C)``, each an EMA of the prefix statistics its position is trained
    with (a language model's early positions differ: one whole-batch estimate standardised
    position 0 by the wrong statistics, a bias, not noise). What it costs: ``positions`` (the
    longest sequence, a model's context length) x C floats per buffer, and inference is an
    affine per position, which does not fold into a linear layer (``offline`` is False).
    """

    causal: bool = False
    _positions: Optional[int] = None  # T of the input being normalised when causal, else None

    def _running_shape(self, num_features: int, causal: bool, positions: Optional[int]) -> tuple:
        """The running statistics' shape: ``(C,)``, or ``(positions, C)`` when causal."""
        if not causal:
            if positions is not None:
                raise ValueError("positions sizes the per-position running statistics of "
                                 "causal=True; drop it, or set causal=True")
            return (num_features,)
        if isinstance(positions, bool) or not isinstance(positions, int) or positions < 1:
            raise ValueError(f"causal=True keeps running statistics per position: positions "
                             f"must be the longest sequence length (a model's context), got "
                             f"{positions!r} (the LM trainer sets it from model.context)")
        return (positions, num_features)

    @classmethod
    def offline_for(cls, *, causal: bool = False, **options) -> bool:
        """Causal: an affine per position, not one per channel (no fold)."""
        return not causal

    def forward(self, x: torch.Tensor, pad_mask: Optional[torch.Tensor] = None) -> torch.Tensor:
        self._positions = None
        if self.causal:
            if x.dim() != 3:
                raise ValueError(f"{type(self).__name__}(causal=True) needs batch-first sequences "
                                 f"(B, T, C), got shape {tuple(x.shape)}; transpose time-first "
                                 "input (x.transpose(0, 1)) or drop causal for non-sequence input")
            if x.shape[1] > self.running_var.shape[0]:
                raise ValueError(f"{type(self).__name__}(causal=True) keeps statistics for "
                                 f"{self.running_var.shape[0]} positions, got sequences of "
                                 f"{x.shape[1]}: build it with positions={x.shape[1]} or more")
            self._positions = x.shape[1]
        return super().forward(x, pad_mask)

    #: the running statistics ``_running_update`` writes
    _running_names: tuple[str, ...] = ("running_mean", "running_var")

    def _running_update(self, old: dict[str, torch.Tensor], mean, var, count) -> dict[str, torch.Tensor]:
        """The running statistics ``old`` after a batch's ``(mean, var, count)``: BN's EMAs (a
        norm keeping other statistics overrides this)."""
        return running_statistics(self.momentum, old["running_mean"], old["running_var"],
                                  mean, var, count)

    def _running_state(self, mean, var, count) -> dict[str, torch.Tensor]:
        """The candidate running statistics after a batch's ``(mean, var, count)``: per
        position ``(T, C)`` when causal (positions with no valid row yet keep theirs)."""
        old = {name: getattr(self, name) for name in self._running_names}
        if self._positions is None:
            return self._running_update(old, mean, var, count)
        length = self._positions
        new = self._running_update({name: value[:length] for name, value in old.items()},
                                   mean, var, count)
        return {name: torch.cat([torch.where(count > 0, value, old[name][:length]),
                                 old[name][length:]]) for name, value in new.items()}

    def _per_row(self, statistic: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        """A per-channel ``(C,)`` statistic, or when causal a per-position ``(T', C)`` one (its
        first T used), broadcast to the ``(N, C)`` rows."""
        if self._positions is None:
            return statistic.expand_as(rows)
        length = self._positions
        return statistic[:length].expand(rows.shape[0] // length, -1, -1).reshape(rows.shape)

    def _batch_ok(self, var: torch.Tensor, count: torch.Tensor) -> torch.Tensor:
        """The batch has a valid row and finite statistics where it has rows."""
        if self._positions is None:
            return statistic_ok(var, count)
        return statistic_ok(torch.where(count > 0, var, torch.zeros_like(var)), count[-1])

    def _whole_batch(self, var: torch.Tensor) -> torch.Tensor:
        """The statistics tap's per-channel value: the whole batch's (the last prefix's)."""
        return var if self._positions is None else var[-1]

    def _inference(self, rows: torch.Tensor, scale: torch.Tensor, shift: torch.Tensor) -> torch.Tensor:
        """``rows * scale + shift``, per position when causal."""
        if self._positions is None:
            return torch.addcmul(shift, rows, scale)
        length = self._positions
        seqs = rows.reshape(-1, length, rows.shape[-1])
        return torch.addcmul(shift[:length], seqs, scale[:length]).reshape(rows.shape)

    def inference_affine(self) -> tuple[torch.Tensor, torch.Tensor]:
        if self.causal:
            raise RuntimeError(f"causal {type(self).__name__} normalises each position by its own "
                               "running statistics: there is no single per-channel affine to "
                               "fold; build it without causal to fold")
        return self._running_affine()

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs):
        stored = state_dict.get(prefix + "running_var")
        if stored is not None and stored.dim() != self.running_var.dim():
            raise ValueError(f"{prefix or 'the norm'}: the state dict's running statistics are "
                             f"{tuple(stored.shape)}, this layer's {tuple(self.running_var.shape)}: "
                             "causal=True keeps them per position (positions x C) since it "
                             "matched evaluation to training; build the layer as it was saved "
                             "(causal, positions) to load it")
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)


class BatchNorm(CausalStatistics, GuardedNorm):
    """BatchNorm over every valid position (batch x tokens) of channels-last input.

    ``momentum`` is the paper's alpha: ``running = alpha * running + (1 - alpha) * batch``
    (torch's BatchNorm momentum is ``1 - alpha``). Running variance is unbiased, as in torch.
    A rejected batch (see ``GuardedNorm``) leaves the running statistics as they were.
    ``causal``: statistics over positions ``<= t`` only, kept per position for evaluation
    (``CausalStatistics``; ``positions``: the longest sequence).
    """

    def __init__(self, num_features: int, eps: float = 1e-5, momentum: float = 0.9,
                 sync_stats: bool = False, causal: bool = False, positions: Optional[int] = None,
                 device=None, dtype=None):
        super().__init__(num_features, eps=eps, device=device, dtype=dtype)
        self.momentum = check_momentum("momentum", momentum)
        self.sync_stats = bool(sync_stats)  # statistics over all data-parallel replicas
        self.causal = bool(causal)
        self.offline = self.offline_for(causal=self.causal)
        shape = self._running_shape(num_features, self.causal, positions)
        self.register_buffer("running_mean", torch.zeros(shape, device=device))
        self.register_buffer("running_var", torch.ones(shape, device=device))

    def extra_repr(self) -> str:
        causal = f", causal, positions={self.running_mean.shape[0]}" if self.causal else ""
        return f"{super().extra_repr()}, momentum={self.momentum}" + causal

    eval_statistics = ("running_mean", "running_var")

    def _normalize(self, rows, valid):
        rows = upcast(rows)
        if not self.training:
            return self._evaluate(rows, valid, self._eval_buffers())
        fused = not self._tapped
        out, state, var, count, standardized = self._batch_part(rows, valid, fused)
        if self._recording:
            self._tap.record_act(self._whole_batch(var))
        if fused:
            plain = rows.detach()
            out = self._watch_affine(out, lambda: {"weight": standardized(plain), "bias": None})
        else:
            out = self._affine(out, valid)
        return commit_call(self._then(out, valid), self, valid, state, self._batch_ok(var, count))

    def _batch_part(self, rows, valid, with_affine: bool):
        """``(y, state, var, count, standardized)``: the rows standardised by the batch's
        statistics (then the affine ``with_affine``: in the same kernel where torch's fused one
        runs), the candidate running state, the batch's variance and row count, and the
        standardisation as a function of detached rows (the gradient-noise-scale tap's z)."""
        y, mean, var, count = batch_standardize(
            rows, valid, self.eps, replicas_active(self.sync_stats), self._positions,
            *(self._affine_weights() if with_affine else ()))
        return (y, self._running_state(mean, var, count), var, count,
                lambda plain: (plain - self._per_row(mean, plain))
                * torch.rsqrt(self._per_row(var, plain) + self.eps))

    def _then(self, out: torch.Tensor, valid) -> torch.Tensor:
        """What follows the batch normalization and its affine: nothing (BCN: its channel
        normalization)."""
        return out

    def _evaluate(self, rows, valid, statistics):
        return self._then(self._inference(rows, *self._affine_for(**statistics)), valid)

    def _running_affine(self) -> tuple[torch.Tensor, torch.Tensor]:
        return self._affine_for(self.running_mean, self.running_var)

    def _affine_for(self, running_mean, running_var) -> tuple[torch.Tensor, torch.Tensor]:
        scale = upcast(self.weight) * torch.rsqrt(running_var + self.eps)
        return scale, upcast(self.bias) - scale * running_mean


def running_statistics(alpha: float, running_mean: torch.Tensor, running_var: torch.Tensor,
                       mean: torch.Tensor, var: torch.Tensor,
                       count: torch.Tensor) -> dict[str, torch.Tensor]:
    """The candidate ``running_mean``/``running_var`` after a batch of ``count`` rows with
    ``mean`` and biased ``var``: EMAs keeping ``alpha`` of the old value, the variance
    unbiased as torch's BatchNorm keeps it."""
    unbiased = var * count / (count - 1).clamp_min(1)
    return {"running_mean": alpha * running_mean + (1 - alpha) * mean,
            "running_var": alpha * running_var + (1 - alpha) * unbiased}


def batch_standardize(rows: torch.Tensor, valid: Optional[torch.Tensor], eps: float,
                      sync: bool = False, positions: Optional[int] = None,
                      weight: Optional[torch.Tensor] = None, bias: Optional[torch.Tensor] = None):
    """``(z, mean, var, count)``: rows standardised by the mean and biased variance of their
    valid rows (over every replica with ``sync``), differentiably (``batch_moments``), then
    ``weight * z + bias`` where a ``weight`` is given.

    Without padding, replicas or positions this is torch's fused batch-norm kernel, the affine
    included (it refuses an empty batch: that one takes the general path, and the caller
    rejects it).
    Padded rows are standardised too, but add no gradient to the statistics. With
    ``positions`` (T), the rows are batch-first sequences of T positions, each position t
    standardised by the statistics of the positions ``<= t``, and ``mean``, ``var`` and
    ``count`` are per position, ``(T, C)`` and ``(T, 1)``: each prefix's, for the
    per-position running statistics.
    """
    if valid is None and not sync and positions is None and rows.shape[0] > 0:
        y, mean, inv_std = torch.native_batch_norm(rows, weight, bias, None, None, True, 0.0, eps)
        return y, *native_moments(mean, inv_std, eps), row_count(rows, valid)
    shift, mean, var, count = batch_moments(rows, valid, sync, positions)
    shape = rows.shape if positions is None else (-1, positions, rows.shape[1])
    data = rows.reshape(shape)
    counted = data if valid is None else zero_padding(rows, valid).reshape(shape)
    inv_std = torch.rsqrt(var + eps)
    z = (counted - shift - mean) * inv_std
    if valid is not None:  # padded rows are standardised, but add no gradient to statistics
        keep = valid.reshape(*data.shape[:-1], 1)
        z = torch.where(keep, z, (data - shift - mean.detach()) * inv_std.detach())
    z = z.reshape(rows.shape)
    if weight is not None:
        z = affine(z, weight, bias)
    return z, (shift + mean).detach(), var.detach(), count.detach()


def native_moments(mean: torch.Tensor, inv_std: torch.Tensor, eps: float):
    """``(mean, biased var)``, detached, from torch's batch-norm kernel's mean and 1/std."""
    return mean.detach(), inv_std.detach().square().reciprocal() - eps


def batch_moments(rows: torch.Tensor, valid: Optional[torch.Tensor], sync: bool = False,
                  positions: Optional[int] = None):
    """``(shift, mean, var, count)``: the per-channel mean (about ``shift``) and biased
    variance of the valid rows (of every replica's, with ``sync``), differentiable (every
    valid row, on every replica, receives the statistics' gradient), and their count.

    ``shift`` is a detached constant: 0, or with ``positions`` (T: the rows are batch-first
    sequences ``(B * T, C)``, every replica's of the same T) the mean of the first position
    that has a valid row (so still causal), and the statistics are each prefix's, ``(T, C)``
    and count ``(T, 1)``: position t's pool the valid rows at positions ``<= t``. Prefix sums
    are cumulative over positions, taken about the shift so that E[x^2] - E[x]^2 keeps
    float32's precision when the mean is far from zero; the shift cancels exactly in value.
    """
    if positions is not None:
        return _prefix_moments(rows, valid, sync, positions)
    count = row_count(rows, valid)
    counted = rows if valid is None else zero_padding(rows, valid)
    total = counted.sum(dim=0)
    if sync:  # differentiable: every replica's rows receive the statistics' gradient
        total, count = sum_over_replicas(total, count, differentiable=True)
    mean = total / count.clamp_min(1)
    var = (counted - mean).square()
    var = (var if valid is None else zero_padding(var, valid)).sum(dim=0)
    if sync:
        (var,) = sum_over_replicas(var, differentiable=True)
    var = var / count.clamp_min(1)
    return torch.zeros((), dtype=rows.dtype, device=rows.device), mean, var, count


def _prefix_moments(rows: torch.Tensor, valid: Optional[torch.Tensor], sync: bool,
                    positions: int):
    """``batch_moments`` per prefix of batch-first sequences of ``positions`` positions."""
    shape = (-1, positions, rows.shape[1])
    if valid is None:
        weight = torch.ones(1, positions, 1, dtype=rows.dtype, device=rows.device).expand(
            rows.shape[0] // positions, -1, -1)
        seqs = rows.reshape(shape)
    else:
        weight = valid.reshape(-1, positions, 1).to(rows.dtype)
        seqs = zero_padding(rows, valid).reshape(shape)
    position_sum, position_count = seqs.detach().sum(dim=0), weight.sum(dim=0)  # (T, C), (T, 1)
    if sync:
        position_sum, position_count = sum_over_replicas(position_sum, position_count)
    first = (position_count[:, 0] > 0).int().argmax()  # 0 when nothing is valid
    shift = position_sum[first] / position_count[first].clamp_min(1)
    centred = (seqs - shift) * weight
    sums = [centred.sum(dim=0), centred.square().sum(dim=0)]  # (T, C) each
    if sync:
        sums = sum_over_replicas(*sums, differentiable=True)
    total, total_sq = (part.cumsum(dim=0) for part in sums)
    count = position_count.cumsum(dim=0)
    mean = total / count.clamp_min(1)
    var = (total_sq / count.clamp_min(1) - mean.square()).clamp_min(0)
    return shift, mean, var, count
