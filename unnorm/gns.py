"""Gradient noise scale taps: per-example gradient norms of every norm's affine parameters.

Gray et al. (2024, "Normalization Layer Per-Example Gradients are Sufficient to Predict
Gradient Noise Scale in Transformers") estimate B_simple = tr(Sigma) / |G|^2 (McCandlish et
al. 2018) from the norm layers' affine parameters alone. Their per-example gradients are cheap:
with ``y = weight * z + bias`` applied row by row, example i's share of the batch gradient is
``c_i = (sum over i's rows of dy * z, sum over i's rows of dy)``, where dy is the gradient of
the micro-batch's loss (a weight of one value for every channel, ScaleNorm's gain, sums
``dy * z`` over the channels too). With ``reduction="mean"`` (the default) that is the mean
L = (1/B) sum_i l_i: as dy carries the 1/B, c_i = grad(l_i) / B, the per-example gradient is
g_i = B c_i, and the batch gradient sum_i c_i = mean_i g_i. With ``reduction="sum"`` (fairseq's
criteria backpropagate the sum over tokens, so over sentences, and divide the gradients by the
token count afterwards) it is L = sum_i l_i: g_i = c_i, and mean_i g_i = sum_i c_i / B.

While recording, each norm with affine parameters appends per training step (per micro-batch)
``example_sq`` (B,): |g_i|^2 over its affine parameters, ``batch_sq`` (): |mean_i g_i|^2, and
``examples`` (): B, the examples with at least one valid (unpadded) row. Padded rows add
nothing, and an example with no valid row is no example (its entry is 0). Values are in the
units of the examples' losses l_i, the same under either reduction: the AMP loss scale
(``ChannelNorm.loss_scale``) and the recorder's ``loss_multiplier`` (1/accumulate under
gradient accumulation of mean losses) are divided out.
Everything stays on the device until ``flush()``.

A norm sees its input as rows: it cannot tell which axis holds the examples, so the recorder
is told (``example_dim``: 0 for batch-first (B, T, C) and (B, H, W, C), 1 for fairseq's
time-first (T, B, C)). Norms whose training output mixes examples (BN, MABN, PN, UN, PRepBN
via their batch statistics) get the same decomposition of the gradient the optimizer receives
into the examples' rows; it is grad(l_i) exactly when no layer after the norm mixes examples.
"""
from __future__ import annotations

import math
from typing import Optional, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from .base import ChannelNorm, upcast, zero_padding
from .stats import PendingRecords, Recorder


class Examples:
    """Which of a norm's ``(N, C)`` rows belong to which example: the input's leading shape,
    the axis of the examples in it, and the valid-row mask (None: no padding)."""

    def __init__(self, shape: torch.Size, dim: int, valid: Optional[torch.Tensor]):
        if dim >= len(shape):
            raise ValueError(
                f"the GNS tap was told the examples lie on axis {dim} of the norm's input, but "
                f"the input has shape {(*shape, '<C>')}: record_gns(model, example_dim=...) must "
                "name the batch axis (0 for batch-first (B, T, C) or (B, H, W, C), 1 for "
                "time-first (T, B, C)), and the norm must see the examples unflattened")
        self.shape, self.dim, self.valid = shape, dim, valid
        self.size = shape[dim]
        self.positions = math.prod(shape) // max(self.size, 1)

    def sums(self, rows: torch.Tensor) -> torch.Tensor:
        """Per-example sums ``(B, C)`` of ``(N, C)`` rows."""
        grouped = rows.reshape(*self.shape, rows.shape[-1]).movedim(self.dim, 0)
        return grouped.reshape(self.size, self.positions, rows.shape[-1]).sum(dim=1)

    def count(self, device: torch.device) -> torch.Tensor:
        """The number of examples with a valid row (float32, on the device)."""
        if self.valid is None:
            return torch.full((), float(self.size), device=device)
        per_example = self.valid.reshape(self.shape).movedim(self.dim, 0)
        return per_example.reshape(self.size, self.positions).any(dim=1).sum().float()


#: how the loss backpropagated combines the micro-batch's per-example losses
REDUCTIONS = ("mean", "sum")


class GNSTap(PendingRecords):
    """The pending per-step GNS records of one norm layer."""

    fields = ("example_sq", "batch_sq", "examples")

    def __init__(self, example_dim: int, loss_multiplier: float, reduction: str = "mean"):
        super().__init__()
        self.example_dim, self.loss_multiplier, self.reduction = example_dim, loss_multiplier, reduction
        self.current: Optional[Examples] = None  # the layout of the latest training forward

    def begin(self, shape: torch.Size, valid: Optional[torch.Tensor]) -> None:
        """A training forward on input of leading shape ``shape`` starts."""
        self.current = Examples(shape, self.example_dim, valid)

    def record(self, dy: torch.Tensor, examples: Examples,
               factors: Sequence[tuple[Optional[torch.Tensor], bool]],
               loss_scale: Optional[torch.Tensor]) -> None:
        """Record one step from ``dy`` (dL/d(out), rows) and, per parameter, the factor that
        multiplies dy row by row into its gradient (None: 1) and whether the parameter is one
        value for every channel (ScaleNorm's gain: its share sums over the channels)."""
        if not factors:
            return
        rows = upcast(dy.detach().reshape(-1, dy.shape[-1]))
        if examples.valid is not None:
            rows = zero_padding(rows, examples.valid)
        shares = []
        for factor, shared in factors:  # c_i of each entry: (B, C), or (B, 1) for a shared value
            share = examples.sums(rows if factor is None else rows * factor)
            shares.append(share.sum(dim=1, keepdim=True) if shared else share)
        shares = torch.cat(shares, dim=1)  # (B, P): c_i per parameter entry
        unit = self.loss_multiplier if loss_scale is None else self.loss_multiplier * loss_scale
        shares = shares / unit  # of the mean or the sum of the examples' losses
        count = examples.count(rows.device)
        # g_i = example * c_i and mean_i g_i = batch * sum_i c_i (see the module docstring)
        example, batch = (count, 1.0) if self.reduction == "mean" else (1.0, 1 / count.clamp_min(1))
        self.example_sq.append((shares.square().sum(dim=1) * example ** 2).float())
        self.batch_sq.append((shares.sum(dim=0).square().sum() * batch ** 2).float())
        self.examples.append(count)

    def take(self) -> dict[str, torch.Tensor]:
        records = self._taken()
        if not records["batch_sq"]:
            return {}
        return {"example_sq": cat_padded([value[None] for value in records["example_sq"]]).cpu(),
                "batch_sq": torch.stack(records["batch_sq"]).cpu(),
                "examples": torch.stack(records["examples"]).cpu()}


def cat_padded(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """``torch.cat`` along dim 0 of ``(T_k, ...)`` tensors whose last axis may differ (steps
    with other batch sizes), zero-padding each to the widest: a zero adds nothing to a sum of
    per-example squared norms, and ``examples`` keeps each step's true count."""
    if tensors[0].dim() < 2:
        return torch.cat(list(tensors))
    width = max(t.shape[-1] for t in tensors)
    return torch.cat([F.pad(t, (0, width - t.shape[-1])) for t in tensors])


class GNSRecorder(Recorder):
    """Records the per-example gradient norms of every norm with affine parameters.

    ``flush()`` returns ``{layer_name: {"example_sq": (T, B), "batch_sq": (T,),
    "examples": (T,)}}`` for the steps since the last flush (one step per backward through
    the layer, so one per micro-batch). The steps of an update that ``unnorm.GradScaler`` (or
    a ``LossScaleGuard``) skipped are dropped.
    """

    slot = "_gns"
    nothing_to_record = ("the model has no unnorm norm with trainable affine parameters (weight, "
                         "bias) to record the gradient noise scale from; build its norms with "
                         "unnorm.build_norm / swap_norms (nonorm has none) and leave them trainable")

    def __init__(self, model: nn.Module, example_dim: Optional[int] = None,
                 loss_multiplier: float = 1.0, reduction: str = "mean"):
        if isinstance(example_dim, bool) or not isinstance(example_dim, int) or example_dim < 0:
            raise ValueError(
                f"record_gns needs example_dim, the axis of the norms' input that holds the "
                f"examples (0 for batch-first (B, T, C) or (B, H, W, C), 1 for fairseq's "
                f"time-first (T, B, C)); got {example_dim!r}")
        if not (isinstance(loss_multiplier, (int, float)) and math.isfinite(loss_multiplier)
                and loss_multiplier > 0):
            raise ValueError(f"loss_multiplier (what the micro-batch's loss is multiplied by "
                             f"before its backward: 1/accumulate for mean losses accumulated) "
                             f"must be a positive number, "
                             f"got {loss_multiplier!r}")
        if reduction not in REDUCTIONS:
            raise ValueError(f"reduction must be one of {', '.join(map(repr, REDUCTIONS))} (how the "
                             f"loss backpropagated combines the examples' losses: their mean, or "
                             f"their sum as fairseq's criteria), got {reduction!r}")
        self.example_dim, self.loss_multiplier = example_dim, float(loss_multiplier)
        self.reduction = reduction
        super().__init__(model)

    def records(self, norm: ChannelNorm) -> bool:
        return any(param.requires_grad for param in norm.affine_parameters().values())

    def new_tap(self) -> GNSTap:
        return GNSTap(self.example_dim, self.loss_multiplier, self.reduction)


def record_gns(model: nn.Module, example_dim: Optional[int] = None,
               loss_multiplier: float = 1.0, reduction: str = "mean") -> GNSRecorder:
    """Start recording the per-example gradient norms of every norm's affine parameters in
    ``model``, whose norms see the examples on axis ``example_dim`` of their input, trained
    on ``loss_multiplier`` x the ``reduction`` ("mean" or "sum") of the examples' losses."""
    return GNSRecorder(model, example_dim, loss_multiplier, reduction)
