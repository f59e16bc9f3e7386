"""Loading checkpoints without running their pickle.

Every checkpoint, released weight file and statistics file the project reads goes through
``load_checkpoint``: ``torch.load(weights_only=True)``, which rebuilds tensors and plain
containers only, with the few other types our own files hold allowed by name (numpy's RNG
state). A file that needs anything else is refused with an error naming the file and the
explicit, per-file opt-in for files you trust; nothing here, or anywhere in the project,
turns torch's safe default off for the process.
"""
from __future__ import annotations

import pickle
import warnings
from contextlib import contextmanager
from pathlib import Path
from typing import Iterable, Iterator

import numpy as np
import torch


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
