"""``record_landscape=k``: every k-th optimizer update probes the loss landscape along the
update's gradient (``unnorm.landscape``) and records it in the run folder's
``landscape.jsonl``, one row per probe: ``step`` (the updates the weights have had: the probe
at step 0 is at initialisation), ``epoch``, ``lr`` and the probe's record. Every task writes
it alike (the shared loop, fairseq's trainer, mmdetection's runner); ``python -m
analysis.landscape`` reads it.

The rows of an epoch are written before its checkpoint, so a resume from that checkpoint
keeps them and drops those of later epochs (``RunDirectory.restore_epochs``). Under DDP
every replica probes (the probe's backward all-reduces as the update's does: the landscape
of the global batch, the same on every replica, which keeps them in step); rank 0 writes.
"""
from __future__ import annotations

import json
import random
from typing import Callable, Iterable, Sequence

import numpy as np
import torch
from torch import nn

import unnorm.landscape
from plugins.runlog import LANDSCAPE_FILE, RunDirectory

#: the RNG streams besides torch's that a task's forward may draw from (timm's mixup: numpy)
HOST_STREAMS = ((random.getstate, random.setstate), (np.random.get_state, np.random.set_state))


def landscape_interval(value) -> int:
    """``record_landscape``'s updates between probes (0: off)."""
    if value is None or value is False:
        return 0
    if value is True or not isinstance(value, int) or value < 0:
        raise ValueError(f"record_landscape={value!r}: give the updates between probes, e.g. "
                         "record_landscape=50 (each probe costs "
                         f"{unnorm.landscape.POINTS} forwards and backwards of the update's "
                         "batch), or record_landscape=0 (off)")
    return value


def refuse_landscape(value, backend: str, why: str) -> None:
    """A backend that cannot probe refuses ``record_landscape`` by name."""
    if landscape_interval(value):
        raise ValueError(f"record_landscape={value} is not available in {backend}: {why}. "
                         "Train with record_landscape=0")


class LandscapeRecorder:
    """The probes of one run: ``due(step)`` says whether the update after ``step`` updates
    is probed, ``start()`` is called before that update's first forward, ``add`` keeps its
    record, ``write(run, epoch)`` appends the epoch's rows to ``landscape.jsonl``."""

    def __init__(self, every: int, model: nn.Module, params: Iterable[torch.Tensor],
                 device: torch.device):
        if any(hasattr(p, "to_local") for p in model.parameters()):
            raise ValueError("record_landscape with a sharded model (distributed=fsdp): each "
                             "process holds a shard of the weights and gradients the probe "
                             "steps along; train with distributed=ddp, or record_landscape=0")
        self.every, self.model, self.params = every, model, list(params)
        self.devices = [device.index or 0] if device.type == "cuda" else []
        self.rows: list[dict] = []

    def due(self, step: int) -> bool:
        return step % self.every == 0

    def start(self) -> unnorm.landscape.UpdateProbe:
        return unnorm.landscape.UpdateProbe(self.model, self.params, devices=self.devices,
                                            streams=HOST_STREAMS)

    def add(self, *, step: int, epoch: int, lr: float, record: dict) -> None:
        self.rows.append({"step": step, "epoch": epoch, "lr": lr, **record})

    def write(self, run: RunDirectory) -> None:
        """Append the rows so far to ``landscape.jsonl`` (rank 0), then forget them."""
        if run.writer and self.rows:
            with open(run.path / LANDSCAPE_FILE, "a") as handle:
                handle.writelines(json.dumps(row) + "\n" for row in self.rows)
        self.rows = []


def probe_update(recorder: LandscapeRecorder, probe: unnorm.landscape.UpdateProbe,
                 evaluate: Callable[[], torch.Tensor], loss: torch.Tensor, *, step: int,
                 epoch: int, lr: float, scaler=None, points: int = unnorm.landscape.POINTS) -> None:
    """Measure and keep the update's landscape (``UpdateProbe.measure``); ``scaler``: the
    update's GradScaler (its scale divided out of the gradients)."""
    scale = scaler.get_scale() if scaler is not None and scaler.is_enabled() else 1.0
    recorder.add(step=step, epoch=epoch, lr=lr, record=probe.measure(
        evaluate, loss, lr, points=points, grad_scale=scale))


def trained(optimizer: torch.optim.Optimizer) -> Sequence[torch.Tensor]:
    """The parameters an optimizer steps (the probe's direction is their gradient)."""
    return [p for group in optimizer.param_groups for p in group["params"] if p.requires_grad]
