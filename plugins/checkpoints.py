"""Checkpoints, all in one place: written atomically (``save_atomic``), loaded without
running their pickle (``load_checkpoint``, ``read_checkpoint``), and what a run saves every
epoch and resumes from (``Checkpointer``; ``ShardedCheckpointer`` for a sharded model, its
model and optimizer in a ``torch.distributed.checkpoint`` directory), the replicas' RNG
states included. It imports nothing from ``plugins`` (torch, numpy and the standard library;
``plugins.distributed``, the layer below, for type hints only): every layer above may use it,
fairseq's environment included.

Every checkpoint, released weight file and statistics file the project reads goes through
``load_checkpoint``: ``torch.load(weights_only=True)``, which rebuilds tensors and plain
containers only, with the few other types our own files hold allowed by name (numpy's RNG
state). A file that needs anything else is refused with an error naming the file and the
explicit, per-file opt-in for files you trust; nothing here, or anywhere in the project,
turns torch's safe default off for the process.
"""
from __future__ import annotations

import os
import pickle
import random
import shutil
import warnings
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterable, Iterator, Optional

import numpy as np
import torch
import torch.distributed as dist
from torch import nn

from plugins.distributed import Distributed, is_sharded  # the one layer below


def _numpy_globals() -> list:
    """The types ``np.random.get_state()`` pickles into (our checkpoints' RNG states)."""
    try:
        from numpy._core.multiarray import _reconstruct, scalar
    except ImportError:  # numpy < 2
        from numpy.core.multiarray import _reconstruct, scalar
    return [_reconstruct, scalar, np.ndarray, np.dtype, type(np.dtype(np.uint32)),
            type(np.dtype(np.int64)), type(np.dtype(np.float64))]


#: Non-tensor types the project's own checkpoints hold, allowed by name.
PROJECT_SAFE_GLOBALS: tuple = tuple(_numpy_globals())


class UnsafeCheckpoint(pickle.UnpicklingError):
    """A file that can only be loaded by running arbitrary pickle code."""


@contextmanager
def allowed_globals(extra: Iterable = ()) -> Iterator[None]:
    """Within the block, ``torch.load(weights_only=True)`` (also a library's own call, e.g.
    mmengine's resume) accepts the project's types and ``extra``, by name."""
    with torch.serialization.safe_globals([*PROJECT_SAFE_GLOBALS, *extra]):
        yield


def load_checkpoint(path, *, trusted: bool = False, opt_in: str = "trusted=True",
                    map_location="cpu", extra_globals: Iterable = (), unshard: bool = True):
    """``torch.load`` of ``path`` with ``weights_only=True`` (our types allowed by name).

    ``trusted=True`` unpickles without limits: only for files you made or trust, since a
    checkpoint's pickle can run any code. ``opt_in`` is how the caller's user says that
    (``trust_checkpoint=true`` on a Hydra command line, ``--trust-checkpoint`` in a script);
    the refusal names it.

    A sharded checkpoint (``distributed=fsdp``: its ``sharded`` entry names a
    ``torch.distributed.checkpoint`` directory beside it) gets its whole model read into
    this process as ``model`` (``unshard=False``: the file as it is).
    """
    state = _load(path, trusted, opt_in, map_location, extra_globals)
    if unshard and isinstance(state, dict) and isinstance(state.get("sharded"), dict):
        state = {**state, "model": read_sharded(Path(path).parent / state["sharded"]["dir"], "model")}
    return state


def read_sharded(directory: Path, key: str) -> dict:
    """The entry ``key`` (a state dict) of a ``torch.distributed.checkpoint`` directory,
    whole, in this process's memory (CPU tensors), however many ranks wrote it; needs no
    process group. DCP reads tensors only (``weights_only``)."""
    import torch.distributed.checkpoint as dcp

    if not (Path(directory) / ".metadata").exists():
        raise FileNotFoundError(f"{directory}: no sharded checkpoint there (no .metadata); the "
                                "checkpoint file names a directory that was moved or deleted")
    metadata = dcp.FileSystemReader(str(directory)).read_metadata()
    template: dict = {}
    for flat, entry in metadata.state_dict_metadata.items():
        path = metadata.planner_data.get(flat, (flat,)) if metadata.planner_data else (flat,)
        if path[0] != key or not hasattr(entry, "size"):
            continue
        template[".".join(str(part) for part in path[1:])] = torch.empty(
            entry.size, dtype=entry.properties.dtype)
    with warnings.catch_warnings():  # what no_dist says: one process reads the whole
        warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable "
                                "or uninitialized, assuming the intent is to load in a single process")
        dcp.load({key: template}, checkpoint_id=str(directory), no_dist=True)
    return template


def _load(path, trusted: bool, opt_in: str, map_location, extra_globals: Iterable):
    if trusted:
        return torch.load(path, map_location=map_location, weights_only=False)
    try:
        with allowed_globals(extra_globals):
            return torch.load(path, map_location=map_location, weights_only=True)
    except pickle.UnpicklingError as error:
        if "GLOBAL " not in str(error):  # not a blocked type: a damaged file, or not a pickle
            raise
        blocked = str(error).split("GLOBAL ", 1)[-1].split(" ", 1)[0]
        raise UnsafeCheckpoint(
            f"{Path(path)} holds {blocked}, which only arbitrary unpickling can rebuild, and "
            f"unpickling can run any code the file carries. If you made this file or trust its "
            f"source, load it with {opt_in}; otherwise re-save its tensors (a state dict) and "
            "load that.") from error


def save_atomic(obj: Any, path: Path, keep_previous: Optional[Path] = None) -> None:
    """``torch.save`` through a temporary file so a kill never leaves a torn checkpoint;
    ``keep_previous`` keeps the file being replaced under that name (a hard link: no copy)."""
    path = Path(path)
    tmp = path.with_suffix(".tmp")
    torch.save(obj, tmp)
    if keep_previous is not None and path.exists():
        linked = keep_previous.with_suffix(".tmp")
        linked.unlink(missing_ok=True)
        os.link(path, linked)
        os.replace(linked, keep_previous)
    os.replace(tmp, path)


def read_checkpoint(path: Path, option: str, fallback: Optional[Path] = None,
                    trusted: bool = False, unshard: bool = True) -> dict:
    """One of our checkpoints, loaded without running its pickle (``trusted``: with), or an
    error naming ``option`` and the fix; a sharded one with its whole model (``unshard``,
    ``load_checkpoint``)."""
    try:
        state = load_checkpoint(path, trusted=trusted, opt_in="trust_checkpoint=true",
                                unshard=unshard)
    except UnsafeCheckpoint as error:
        raise UnsafeCheckpoint(f"{option}: {error}") from error
    except Exception as error:  # torch raises several kinds for damaged or foreign files
        fix = (f"the previous epoch's checkpoint is kept as {fallback}: move it to {path} to "
               "resume from the epoch before" if fallback is not None and fallback.exists()
               else f"pass {option}= the last.pt of one of our runs (runs/<exp>/<time>/last.pt)")
        raise ValueError(f"{option}: {path} is not a readable checkpoint ({type(error).__name__}: "
                         f"{error}); {fix}") from error
    if not isinstance(state, dict) or "model" not in state:
        raise ValueError(f"{option}: {path} is not a checkpoint written by scripts/train.py (no "
                         "'model' entry); pass the last.pt of one of our runs")
    return state


# The RNG states a checkpoint keeps, one per replica, so a resumed run draws the same
# augmentations.

def rng_state() -> dict:
    return {"python": random.getstate(), "numpy": np.random.get_state(),
            "torch": torch.get_rng_state()}


def set_rng_state(states: list[dict], rank: int) -> None:
    """Restore this replica's RNG state from ``gather_rng``'s list (rank 0's if it had fewer)."""
    state = states[rank] if rank < len(states) else states[0]
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])


def gather_rng(world: Distributed) -> list:
    """Every replica's RNG state, so a resumed run draws the same augmentations."""
    return world.gather(rng_state())


class Checkpointer:
    """What a run saves every epoch and resumes from: its stateful parts by name (model,
    optimizer, scheduler, ...; None where a run has no such part), plus every replica's RNG
    state and whatever the trainer adds (epoch, step, config). The previous epoch's
    checkpoint is kept beside it (``previous.pt``), to fall back to if the last is damaged.
    ``trusted`` lets a resume unpickle anything (``trust_checkpoint=true``)."""

    def __init__(self, path: Path, world: Distributed, trusted: bool = False, **parts):
        self.path, self.world, self.trusted, self.parts = Path(path), world, trusted, parts

    @property
    def previous(self) -> Path:
        return self.path.with_name("previous" + self.path.suffix)

    def exists(self) -> bool:
        return self.path.exists()

    def resume(self) -> Optional[dict]:
        """Load the saved state into the parts; returns it (None when there is none)."""
        if not self.path.exists():
            return None
        state = read_checkpoint(self.path, "resume", fallback=self.previous, trusted=self.trusted,
                                unshard=False)
        if state.get("sharded"):
            raise ValueError(f"resume: {self.path} was saved by distributed=fsdp (a sharded "
                             "checkpoint); resume it with distributed=fsdp, or start a new run "
                             f"from its weights with init_from={self.path}")
        for name, part in self.parts.items():
            if part is not None:
                part.load_state_dict(state[name])
        set_rng_state(state["rng"], self.world.rank)
        if self.world.main:
            print(f"resuming {self.path.parent} at epoch {state['epoch'] + 1}, step {state['step']}")
        return state

    def save(self, **extra) -> None:
        """Every replica calls this (the RNG states are gathered); rank 0 writes."""
        rng = gather_rng(self.world)
        if self.world.main:
            parts = {name: None if part is None else part.state_dict()
                     for name, part in self.parts.items()}
            save_atomic({**parts, "rng": rng, **extra}, self.path, keep_previous=self.previous)


# Sharded checkpoints (``distributed=fsdp``): ``last.pt`` keeps what it always did (schedule,
# RNG states, epoch, records, config) and names a ``torch.distributed.checkpoint`` (DCP)
# directory ``sharded/step_<step>/`` holding the model (its norm buffers included) and the
# optimizer, each rank writing its shards. DCP reshards on load: a run resumes on another
# number of ranks, and ``load_checkpoint`` reads the whole model into one process
# (evaluation, folding, export, ``init_from``) without a process group.

SHARDED_DIR = "sharded"  # beside last.pt: one DCP directory per kept checkpoint


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
