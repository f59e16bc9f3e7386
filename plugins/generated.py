"""Data generated on first use (the shapes set, the synthetic corpus), made once even when
several runs start together: a Hydra multirun, a SLURM array, the test suite's workers; and
checked against the manifest of what was generated each time it is opened."""
from __future__ import annotations

import fcntl
import hashlib
import json
import os
from contextlib import contextmanager
from pathlib import Path

MANIFEST = "manifest.json"  # {relative path: {"bytes": n, "sha256": hex}} of generated data


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


def _file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _data_files(root: Path) -> list[Path]:
    return sorted(p for p in root.rglob("*") if p.is_file() and p.name != MANIFEST
                  and p.suffix not in (".tmp", ".lock"))


def write_manifest(root: Path) -> None:
    """Record every file under ``root`` (size and sha256), atomically, as the last step of
    generating it: the manifest's presence means the data is complete."""
    root = Path(root)
    files = {p.relative_to(root).as_posix(): {"bytes": p.stat().st_size, "sha256": _file_sha256(p)}
             for p in _data_files(root)}
    tmp = root / (MANIFEST + ".tmp")
    tmp.write_text(json.dumps(files, indent=1, sort_keys=True) + "\n")
    os.replace(tmp, root / MANIFEST)


def verify_manifest(root: Path, rebuild: str) -> None:
    """Refuse generated data that is not what its manifest records (a file missing, added,
    of another size or content), naming the file, what differs and ``rebuild``. Reads every
    file once (sha256: about 1 s per GB)."""
    root = Path(root)
    try:
        recorded = json.loads((root / MANIFEST).read_text())
    except (OSError, json.JSONDecodeError) as error:
        raise ValueError(f"{root / MANIFEST} is missing or damaged ({error}); rebuild the data: "
                         f"{rebuild}") from None
    present = {p.relative_to(root).as_posix() for p in _data_files(root)}
    for name in sorted(present - set(recorded)):
        raise ValueError(f"{root / name} is not in {MANIFEST} (data added after it was "
                         f"generated); rebuild the data: {rebuild}")
    for name, want in sorted(recorded.items()):
        path = root / name
        size = path.stat().st_size if path.exists() else None
        if size != want["bytes"]:
            raise ValueError(f"{path} holds {size} bytes, {MANIFEST} records {want['bytes']}; "
                             f"rebuild the data: {rebuild}")
        if _file_sha256(path) != want["sha256"]:
            raise ValueError(f"{path} does not hash to the sha256 {MANIFEST} records (its "
                             f"content changed); rebuild the data: {rebuild}")
