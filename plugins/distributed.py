"""The processes of a run: the process group (``Distributed``) and DDP.

The bottom of the training layers: it imports nothing from ``plugins`` (the sharded model,
``plugins.fsdp``, and the run skeleton, ``plugins.training``, build on it).
"""
from __future__ import annotations

import inspect
import os

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel


class Distributed:
    """Process-group facts for one process (a single process when not under torchrun).
    ``group``: join a process group also when alone (a group of one: FSDP shards over one)."""

    def __init__(self, device_name: str, group: bool = False):
        if "RANK" not in os.environ and int(os.environ.get("SLURM_NTASKS", "1")) > 1:
            import submitit  # a SLURM job array task: export torchrun's variables from SLURM's
            submitit.helpers.TorchDistributedEnvironment().export()
        self.world = int(os.environ.get("WORLD_SIZE", "1"))
        self.rank = int(os.environ.get("RANK", "0"))
        local = int(os.environ.get("LOCAL_RANK", "0"))
        if device_name == "auto":
            device_name = "cuda" if torch.cuda.is_available() else "cpu"
        if device_name == "cuda" and not torch.cuda.is_available():
            raise RuntimeError("device=cuda but no CUDA device is visible; use device=cpu")
        self.device = torch.device(f"cuda:{local}" if device_name == "cuda" else "cpu")
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        self._owns_group = (self.world > 1 or group) and not dist.is_initialized()
        if self._owns_group:
            backend = "nccl" if self.device.type == "cuda" else "gloo"
            if self.world > 1:
                dist.init_process_group(backend)
            else:  # no torchrun: a group of one needs no rendezvous
                dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)

    @property
    def main(self) -> bool:
        return self.rank == 0

    def mean(self, tensor: torch.Tensor) -> torch.Tensor:
        if self.world > 1:
            tensor = tensor.clone()
            dist.all_reduce(tensor)
            tensor /= self.world
        return tensor

    def sum(self, tensor: torch.Tensor) -> torch.Tensor:
        if self.world > 1:
            dist.all_reduce(tensor)
        return tensor

    def shard(self, dataset) -> torch.utils.data.Dataset:
        """This replica's part of ``dataset`` for evaluation: every ``world``-th item, so the
        shards cover it exactly once (no padding with repeated items)."""
        if self.world == 1:
            return dataset
        return torch.utils.data.Subset(dataset, range(self.rank, len(dataset), self.world))

    def gather(self, obj) -> list:
        """Every replica's ``obj`` (picklable), in rank order."""
        if self.world == 1:
            return [obj]
        gathered = [None] * self.world
        dist.all_gather_object(gathered, obj)
        return gathered

    def close(self) -> None:
        if (self.world > 1 or self._owns_group) and dist.is_initialized():
            dist.destroy_process_group()


def is_sharded(module: nn.Module) -> bool:
    """Whether ``module`` is an FSDP2 unit (``fully_shard``)."""
    from torch.distributed.fsdp import FSDPModule  # not at the top: fairseq's torch has none

    return isinstance(module, FSDPModule)


def per_replica_buffers() -> dict:
    """The DDP keyword that leaves the norms' buffers per replica (the paper's statistics;
    ``sync_stats`` shares them, ``norm_sync`` makes them agree before evaluation and saves)."""
    if "forward_sync_buffers" in inspect.signature(DistributedDataParallel).parameters:
        return {"forward_sync_buffers": False}  # torch >= 2.15 name
    return {"broadcast_buffers": False}


def data_parallel(model: nn.Module, device: torch.device) -> DistributedDataParallel:
    """DDP that leaves norm buffers per replica."""
    return DistributedDataParallel(model, device_ids=[device.index] if device.type == "cuda" else None,
                                   **per_replica_buffers())
