"""Sharded data parallelism (PyTorch's FSDP2, ``fully_shard``) for the language model:
``distributed=fsdp`` (``configs/distributed``; DDP, ``distributed=ddp``, stays the default).

What a trainer calls, all here (torchtitan's layout, for our norms):

- ``shard(model, blocks, ...)``: rank 0's initial weights and norm state to every rank (as
  DDP does at construction), each block compiled (``compile=true``), each block and then the
  root a ``fully_shard`` unit with a ``MixedPrecisionPolicy``: parameters in ``amp``'s dtype
  for compute (bf16, fp16; none in float32), gradients reduced in float32 into float32
  shards. No autocast: the policy is the mixed precision (``amp_for``). The norms' running
  state is buffers, which FSDP2 neither shards nor casts: each rank keeps its own (per-replica
  statistics as under DDP, or ``norm.sync_stats``), in float32, and the shared loop makes the
  ranks' norm state one before every evaluation and save (``unnorm.distribute_norm_state``).
- ``amp_for``: ``(autocast, scaler)`` as ``plugins.training.amp_context``; fp16 trains with
  ``ShardedGradScaler`` (``unnorm.GradScaler``'s guarded norms, torch's sharded scaler: an
  overflow in any rank's shard skips the update on every rank).
- ``ShardedCheckpointer``: ``last.pt`` keeps what it always did (schedule, RNG states,
  epoch, records, config) and names a ``torch.distributed.checkpoint`` (DCP) directory
  ``sharded/step_<step>/`` holding the model (its norm buffers included) and the optimizer,
  each rank writing its shards. DCP reshards on load: a run resumes on another number of
  ranks, and ``plugins.checkpoints.load_checkpoint`` reads the whole model into one process
  (evaluation, folding, export, ``init_from``) without a process group.
- ``lockstep``: evaluation batches in equal numbers on every rank (each forward of a sharded
  model is a collective); ``unsharded_copy``: the whole model in one process's memory, for
  what must copy the model (the future-leak probe).

Gradient accumulation reduce-scatters each micro-batch's gradients into the float32 shards
(torchtitan's default: memory stays sharded; DDP instead reduces once, at the last).
Refused by name: SAM (``sam=...``), compiled layers with activation checkpointing, and any
task but language modelling.
"""
from __future__ import annotations

import shutil
from contextlib import nullcontext
from pathlib import Path
from typing import Callable, Iterable, Iterator, Optional

import torch
import torch.distributed as dist
from omegaconf import DictConfig
from torch import nn
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler as _TorchShardedScaler

import unnorm
from plugins.runlog import save_atomic
from plugins.training import (
    Checkpointer,
    Distributed,
    autocast_dtype,
    gather_rng,
    read_checkpoint,
    set_rng_state,
)

STRATEGIES = ("ddp", "fsdp")
SHARDED_DIR = "sharded"  # beside last.pt: one DCP directory per kept checkpoint


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


def is_sharded(module: nn.Module) -> bool:
    """Whether ``module`` is an FSDP2 unit (``fully_shard``)."""
    return isinstance(module, FSDPModule)


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


def load_model(model: nn.Module, path: Path) -> None:
    """Load a run's ``last.pt`` (either kind: one file, or a sharded checkpoint of any number
    of ranks) into ``model``, sharded or not. Every rank calls this."""
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        set_model_state_dict,
    )

    state = read_checkpoint(Path(path), "load", unshard=False)
    if not is_sharded(model):
        if state.get("sharded"):
            state = read_checkpoint(Path(path), "load")
        model.load_state_dict(state["model"])
    elif state.get("sharded"):
        _load_dcp(Path(path).parent / state["sharded"]["dir"], model)
    else:
        set_model_state_dict(model, state["model"], options=StateDictOptions(full_state_dict=True))


def _load_dcp(directory: Path, model: nn.Module, optimizer=None) -> None:
    """A DCP checkpoint's model (and optimizer) into a sharded ``model`` (resharding)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (
        get_model_state_dict,
        get_state_dict,
        set_model_state_dict,
        set_state_dict,
    )

    if optimizer is None:
        state = {"model": get_model_state_dict(model)}
        dcp.load(state, checkpoint_id=directory)
        set_model_state_dict(model, state["model"])
        return
    model_state, optimizer_state = get_state_dict(model, optimizer)
    state = {"model": model_state, "optimizer": optimizer_state}
    dcp.load(state, checkpoint_id=directory)
    set_state_dict(model, optimizer, model_state_dict=state["model"],
                   optim_state_dict=state["optimizer"])


class ShardedCheckpointer(Checkpointer):
    """``Checkpointer`` for a sharded model: the model (norm buffers included) and the
    optimizer go to a DCP directory ``sharded/step_<step>/`` that every rank writes its
    shards into; ``last.pt`` (written by rank 0 once the directory is complete) keeps the
    rest and names it under ``sharded``. ``previous.pt`` names the previous save's directory,
    which is kept; older ones are deleted. A resume loads onto any number of ranks."""

    SHARDED_PARTS = ("model", "optimizer")

    def resume(self) -> Optional[dict]:
        if not self.path.exists():
            return None
        state = read_checkpoint(self.path, "resume", fallback=self.previous, trusted=self.trusted,
                                unshard=False)
        if not state.get("sharded"):
            raise ValueError(f"resume: {self.path} was saved by distributed=ddp (one file, "
                             "unsharded optimizer state); resume it with distributed=ddp, or "
                             f"start a new run from its weights with init_from={self.path}")
        _load_dcp(self.path.parent / state["sharded"]["dir"], self.parts["model"],
                  self.parts["optimizer"])
        for name, part in self.parts.items():
            if part is not None and name not in self.SHARDED_PARTS:
                part.load_state_dict(state[name])
        set_rng_state(state["rng"], self.world.rank)
        saved_by = state["sharded"]["world_size"]
        if self.world.main:
            print(f"resuming {self.path.parent} at epoch {state['epoch'] + 1}, step {state['step']}"
                  f" (saved by {saved_by} ranks, resumed by {self.world.world})")
            if saved_by != self.world.world:
                print(f"note: the norms' gradient statistics (UN's, PN's, MABN's windows and EMAs) "
                      f"are in the units of the loss each of {saved_by} ranks backpropagated; on "
                      f"{self.world.world} ranks they mix two units until the windows refill")
        return state

    def save(self, **extra) -> None:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_state_dict

        relative = f"{SHARDED_DIR}/step_{extra['step']:08d}"
        directory = self.path.parent / relative
        if self.world.main and directory.exists():  # a save that a kill interrupted
            shutil.rmtree(directory)
        dist.barrier()
        model_state, optimizer_state = get_state_dict(self.parts["model"], self.parts["optimizer"])
        dcp.save({"model": model_state, "optimizer": optimizer_state}, checkpoint_id=directory)
        rng = gather_rng(self.world)  # after dcp.save: every rank's shards are written
        if not self.world.main:
            return
        kept = {relative, self._named(self.path)}
        parts = {name: None if part is None or name in self.SHARDED_PARTS else part.state_dict()
                 for name, part in self.parts.items()}
        sharded = {"dir": relative, "world_size": self.world.world,
                   "format": "torch.distributed.checkpoint"}
        save_atomic({**parts, "sharded": sharded, "rng": rng, **extra}, self.path,
                    keep_previous=self.previous)
        for old in (self.path.parent / SHARDED_DIR).iterdir():
            if f"{SHARDED_DIR}/{old.name}" not in kept:
                shutil.rmtree(old, ignore_errors=True)

    def _named(self, path: Path) -> Optional[str]:
        """The DCP directory the checkpoint at ``path`` names (None: none, or unreadable)."""
        if not path.exists():
            return None
        try:
            return (read_checkpoint(path, "save", trusted=self.trusted, unshard=False)
                    .get("sharded") or {}).get("dir")
        except (ValueError, OSError):
            return None
