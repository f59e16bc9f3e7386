"""One norm state for every data-parallel replica, before it is evaluated or saved.

Under DDP each replica's norms keep their own running state (the paper's per-replica
statistics; ``sync_stats`` shares the batch statistics instead). Evaluated or saved as they
are, each replica would score with its own statistics while rank 0 alone writes the
checkpoint: the recorded metric would not be the checkpoint's, and a resume would hand every
replica rank 0's windows. ``distribute_norm_state`` makes the replicas agree first, as timm's
``distribute_bn`` does for BatchNorm.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from .base import GuardedNorm

NORM_SYNC_MODES = ("reduce", "broadcast")


def check_norm_sync(mode: str) -> str:
    """``mode`` if it is one of ``NORM_SYNC_MODES``, else an error naming them."""
    if mode not in NORM_SYNC_MODES:
        raise ValueError(f"norm_sync={mode!r}: choose reduce (average every replica's norm "
                         "statistics, rank 0's step counters) or broadcast (rank 0's whole norm "
                         "state to every replica)")
    return mode


def norm_state(model: nn.Module) -> list[torch.Tensor]:
    """The running state of every norm in ``model``: the buffers of its ``GuardedNorm``s
    (the norms with running state), in module order."""
    return [buffer for module in model.modules() if isinstance(module, GuardedNorm)
            for buffer in module.buffers(recurse=False)]


@torch.no_grad()
def distribute_norm_state(model: nn.Module, mode: str = "reduce") -> None:
    """Make every replica's norm state identical (no-op on one process).

    ``reduce`` averages each floating-point buffer (statistics, windows, EMAs) over the
    replicas and takes rank 0's integer buffers (step and rejection counters); ``broadcast``
    copies rank 0's whole norm state. Either way all replicas continue from the same state.
    One collective per kind of buffer (flattened), whatever the number of norms.
    """
    check_norm_sync(mode)
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return
    groups: dict[tuple, list[torch.Tensor]] = {}
    for buffer in norm_state(model):
        average = mode == "reduce" and buffer.is_floating_point()
        groups.setdefault((average, buffer.dtype, buffer.device), []).append(buffer)
    for (average, _, _), buffers in groups.items():
        flat = torch.cat([buffer.reshape(-1) for buffer in buffers])
        if average:
            dist.all_reduce(flat)
            flat /= dist.get_world_size()
        else:
            dist.broadcast(flat, src=0)
        for buffer, value in zip(buffers, flat.split([b.numel() for b in buffers])):
            buffer.copy_(value.view_as(buffer))
