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
                    map_location="cpu", extra_globals: Iterable = ()):
    """``torch.load`` of ``path`` with ``weights_only=True`` (our types allowed by name).

    ``trusted=True`` unpickles without limits: only for files you made or trust, since a
    checkpoint's pickle can run any code. ``opt_in`` is how the caller's user says that
    (``trust_checkpoint=true`` on a Hydra command line, ``--trust-checkpoint`` in a script);
    the refusal names it.
    """
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
