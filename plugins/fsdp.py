"""Sharded data parallelism (PyTorch's FSDP2, ``fully_shard``) for the language model:
``distributed=fsdp`` (``configs/distributed``; DDP, ``distributed=ddp``, stays the default).

What the run skeleton (``plugins.training.train``) and the language model's trainer call
(torchtitan's layout, for our norms):

- ``shard(model, blocks, ...)``: rank 0's initial weights and norm state to every rank (as
  DDP does at construction), each block compiled (``compile=true``), each block and then the
  root a ``fully_shard`` unit with a ``MixedPrecisionPolicy``: parameters in ``amp``'s dtype
  for compute (bf16, fp16; none in float32), gradients reduced in float32 into float32
  shards. No autocast: the policy is the mixed precision (``amp_for``). The norms' running
  state is buffers, which FSDP2 neither shards nor casts: each rank keeps its own (per-replica
  statistics as under DDP, or ``norm.sync_stats``), in float32, and the shared loop makes the
  ranks' norm state one before every evaluation and save (``unnorm.distribute_norm_state``).
- ``amp_for``: ``(autocast, scaler)`` as ``plugins.precision.amp_context``; fp16 trains with
  ``ShardedGradScaler`` (``unnorm.GradScaler``'s guarded norms, torch's sharded scaler: an
  overflow in any rank's shard skips the update on every rank).
- its checkpoints are ``plugins.checkpoints``'s (``ShardedCheckpointer``, ``load_model``):
  ``last.pt`` names a ``torch.distributed.checkpoint`` directory of the model and optimizer
  shards, which reshards on load.
- ``lockstep``: evaluation batches in equal numbers on every rank (each forward of a sharded
  model is a collective); ``unsharded_copy``: the whole model in one process's memory, for
  what must copy the model (the future-leak probe).

Gradient accumulation reduce-scatters each micro-batch's gradients into the float32 shards
(torchtitan's default: memory stays sharded; DDP instead reduces once, at the last).
Refused by name: SAM (``sam=...``), compiled layers with activation checkpointing, and any
task but language modelling.

Imports only ``plugins.distributed`` and ``plugins.precision`` from ``plugins``: the run
skeleton (``plugins.training``) builds on it, never the reverse.
"""
from __future__ import annotations

from contextlib import nullcontext
from typing import Callable, Iterable, Iterator

import torch
import torch.distributed as dist
from omegaconf import DictConfig
from torch import nn
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler as _TorchShardedScaler

import unnorm
from plugins.distributed import Distributed, is_sharded
from plugins.precision import autocast_dtype

STRATEGIES = ("ddp", "fsdp")


def check_distributed(cfg: DictConfig, strategies: Iterable[str] = ("ddp",),
                      activation_checkpointing: bool = False) -> str:
    """The run's ``distributed.strategy`` (``ddp`` when the config has none), refused by
    name where the task (which trains with ``strategies``, and has activation checkpointing
    or not) or the run's other options do not support it."""
    options = cfg.get("distributed") or {}
    chosen = options.get("strategy", "ddp")
    if chosen not in STRATEGIES:
        raise ValueError(f"distributed.strategy={chosen!r}: choose ddp (one copy of the model per "
                         "process) or fsdp (sharded, FSDP2; language modelling)")
    if chosen not in strategies:
        raise ValueError(f"distributed.strategy={chosen}: {cfg.task} trains with "
                         f"{' or '.join(strategies)} only (FSDP2 is the language model's: "
                         "+exp=llama_...); use distributed=ddp")
    if options.get("activation_checkpointing"):
        if not activation_checkpointing:
            raise ValueError(f"distributed.activation_checkpointing=true: {cfg.task} does not "
                             "implement it (the language model does); set it false")
        if cfg.compile:
            raise ValueError("compile=true with distributed.activation_checkpointing=true: a "
                             "compiled layer recomputed by the checkpoint would commit its norms' "
                             "running state twice per step; choose one of them")
    sam = cfg.get("sam")
    if chosen == "fsdp" and sam is not None and sam.get("name", "none") != "none":
        raise ValueError(f"sam={sam.name} with distributed=fsdp: SAM's ascent takes whole "
                         "gradients' norms and perturbs whole tensors, which are shards under "
                         "FSDP (not supported); use distributed=ddp, or sam=none")
    return chosen


@torch.no_grad()
def broadcast_state(model: nn.Module) -> None:
    """Rank 0's parameters and buffers to every rank: one initialisation, as DDP makes it."""
    for tensor in [*model.parameters(), *model.buffers()]:
        dist.broadcast(tensor.data, src=0)


def shard(model: nn.Module, blocks: Iterable[nn.Module], world: Distributed, *, amp,
          reshard_after_forward: bool = True, compile: bool = False) -> nn.Module:
    """``model`` sharded in place over every rank (FSDP2): each of ``blocks`` (compiled
    first with ``compile``) a unit, the rest (embedding, final norm, head) the root's. Call
    before the optimizer is built (it must see the sharded parameters)."""
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh(world.device.type, (world.world,))
    broadcast_state(model)
    policy = MixedPrecisionPolicy(param_dtype=autocast_dtype(amp, world.device),
                                  reduce_dtype=torch.float32)
    for block in blocks:
        if compile:
            block.compile()  # in place: state-dict keys stay as they are
        fully_shard(block, mesh=mesh, mp_policy=policy, reshard_after_forward=reshard_after_forward)
    fully_shard(model, mesh=mesh, mp_policy=policy, reshard_after_forward=reshard_after_forward)
    return model


class ShardedGradScaler(unnorm.GradScaler, _TorchShardedScaler):
    """``unnorm.GradScaler`` (the norms keep unscaled statistics; a skipped update leaves
    them as they were) over torch's ``ShardedGradScaler``, whose inf check is all-reduced
    across the ranks: every rank skips an update that overflowed in any shard."""


def amp_for(amp, device: torch.device, model: nn.Module):
    """``(autocast, scaler)`` for a sharded model: no autocast (the ``MixedPrecisionPolicy``
    of ``shard`` casts the parameters), and fp16's scaler (``ShardedGradScaler``)."""
    dtype = autocast_dtype(amp, device)
    scaler = ShardedGradScaler(model, device.type) if dtype == torch.float16 else None
    return nullcontext, scaler


def lockstep(loader, model: nn.Module, world: Distributed) -> Iterator[tuple[object, bool]]:
    """``(batch, counted)`` over ``loader``. For a sharded model every rank runs as many
    forwards as the rank with the most batches: one that has run out repeats a batch, not
    counted (each forward all-gathers the parameters, a collective every rank must join)."""
    if not is_sharded(model):
        for batch in loader:
            yield batch, True
        return
    steps = torch.tensor([len(loader)], device=world.device)
    dist.all_reduce(steps, op=dist.ReduceOp.MAX)
    filler = None
    for batch in loader:
        filler = batch
        yield batch, True
    if filler is None and steps.item() > len(loader):  # an empty shard: any window will do
        dataset = loader.dataset
        while isinstance(dataset, torch.utils.data.Subset):
            dataset = dataset.dataset
        filler = next(iter(torch.utils.data.DataLoader(dataset, batch_size=1)))
    for _ in range(int(steps.item()) - len(loader)):
        yield filler, False


def full_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """The whole state dict of a sharded model on every rank (a collective)."""
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
    )

    return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))


def unsharded_copy(model: nn.Module, build: Callable[[], nn.Module]) -> nn.Module:
    """A plain copy of a sharded model, whole in this process: ``build()`` (a new model of
    the same structure; the RNG is left as it was) with ``model``'s parameters and norm
    state, in ``model``'s mode. FSDP2 refuses ``copy.deepcopy``. Every rank calls this."""
    state = full_state(model)
    with torch.random.fork_rng(devices=[]):
        copy = build()
    copy.load_state_dict(state)
    return copy.to(next(iter(state.values())).device).train(model.training)
