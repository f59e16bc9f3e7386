"""Data generated on first use (the shapes set, the synthetic corpus), made once even when
several runs start together: a Hydra multirun, a SLURM array, the test suite's workers."""
from __future__ import annotations

import fcntl
from contextlib import contextmanager
from pathlib import Path


@contextmanager
def generating(root: Path):
    """Hold ``<root>.lock`` while checking for and generating ``root``: another process that
    wants the same data waits, then finds it complete."""
    root = Path(root)
    root.parent.mkdir(parents=True, exist_ok=True)
    with open(root.with_name(root.name + ".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield root
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)
