"""Statistics taps: per-step activation and gradient statistics of every norm, for analysis.

While recording, each norm appends, per training step, its activation statistic (the
per-channel second moment it computed: s_t for UN/MABN/PN, the batch variance for BN, mean
x^2 for per-position norms), its gradient statistic (per-channel mean of g * z), for UN,
MABN and PN the outlier-skip flag, and for norms with running state whether the step was
rejected (no valid row, a non-finite statistic or gradient statistic: the state was left as
it was). A step is recorded once, also under activation checkpointing; the steps of an
update that ``unnorm.GradScaler`` skipped are dropped, as their state was. They stay on
the device until ``flush()`` hands them over as CPU tensors, so recording adds no host
synchronisation between flushes.
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import nn

from .base import ChannelNorm


class PendingRecords:
    """Per-step record lists (``fields``) of one layer, from which the records of an update
    that a GradScaler skipped are taken out (``unnorm.LossScaleGuard`` calls ``end_update``).
    The skip is a device flag; it is read when the records are taken, once per flush."""

    fields: tuple[str, ...] = ()

    def __init__(self):
        for field in self.fields:
            setattr(self, field, [])
        self._updates: list[tuple[dict[str, int], torch.Tensor]] = []  # (ends, skipped)

    def end_update(self, skipped: torch.Tensor) -> None:
        """The records since the previous update's end are this update's."""
        self._updates.append(({field: len(getattr(self, field)) for field in self.fields},
                              skipped.detach().clone()))

    def _taken(self) -> dict[str, list[torch.Tensor]]:
        """Every field's records without the skipped updates', emptying the lists."""
        skipped = torch.stack([flag for _, flag in self._updates]).tolist() if self._updates else []
        taken = {}
        for field in self.fields:
            values, kept, begin = getattr(self, field), [], 0
            for (ends, _), skip in zip(self._updates, skipped):
                kept += [] if skip else values[begin:ends[field]]
                begin = ends[field]
            taken[field] = kept + values[begin:]
            setattr(self, field, [])
        self._updates = []
        return taken


class LayerTap(PendingRecords):
    """The pending per-step statistics of one norm layer."""

    fields = ("act", "grad", "skip", "rejected")

    def record_act(self, value: torch.Tensor) -> None:
        self.act.append(value.detach().float().clone())

    def record_grad(self, value: torch.Tensor) -> None:
        self.grad.append(value.detach().float().clone())

    def record_skip(self, value: torch.Tensor) -> None:
        self.skip.append(value.detach().clone())

    def record_rejected(self, value: torch.Tensor) -> None:
        self.rejected.append(value.detach().clone())

    def take(self) -> dict[str, torch.Tensor]:
        return {key: torch.stack(values).cpu() for key, values in self._taken().items() if values}


class Recorder:
    """Puts a tap in the ``slot`` attribute of every norm of a model it ``records``; use as a
    context manager or call ``close()``. ``flush()`` hands over each layer's pending records."""

    slot = "_tap"
    nothing_to_record = ("the model has no unnorm norm layer to record; build it with "
                         "unnorm.build_norm / swap_norms first")

    def __init__(self, model: nn.Module):
        self.layers = {name: module for name, module in model.named_modules()
                       if isinstance(module, ChannelNorm) and self.records(module)}
        if not self.layers:
            raise ValueError(self.nothing_to_record)
        if any(getattr(module, self.slot) is not None for module in self.layers.values()):
            raise RuntimeError("this model is already being recorded")
        for module in self.layers.values():
            setattr(module, self.slot, self.new_tap())

    def records(self, norm: ChannelNorm) -> bool:
        return True

    def new_tap(self):
        raise NotImplementedError

    def flush(self) -> dict[str, dict[str, torch.Tensor]]:
        return {name: getattr(module, self.slot).take() for name, module in self.layers.items()
                if getattr(module, self.slot) is not None}

    def close(self) -> None:
        for module in self.layers.values():
            setattr(module, self.slot, None)

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> Optional[bool]:
        self.close()
        return None


class StatisticsRecorder(Recorder):
    """Taps every norm of a model; use as a context manager or call ``close()``.

    ``flush()`` returns ``{layer_name: {"act": (T, C), "grad": (T, C), "skip": (T,),
    "rejected": (T,)}}`` for the steps since the last flush (T may differ between act and
    grad if a backward is pending).
    """

    def new_tap(self) -> LayerTap:
        return LayerTap()


def record_statistics(model: nn.Module) -> StatisticsRecorder:
    """Start recording the statistics of every norm in ``model``."""
    return StatisticsRecorder(model)
