"""A run's recorded norm statistics (``record_statistics=true``) and what Figs. 4-5 derive from them.

The trainer saves one ``stats/epoch_XXXX.pt`` per epoch, each ``{layer: {"act": (T, C),
"grad": (T, C), "skip": (T,)}}`` for that epoch's T training steps; the analyses need them as
one sequence per layer over the whole run.
"""
from __future__ import annotations

import csv
import json
import re
from pathlib import Path
from typing import Sequence, Union

import numpy as np
import torch
from numpy.lib.stride_tricks import sliding_window_view
from scipy.stats import gmean

Statistics = dict[str, dict[str, torch.Tensor]]
PathLike = Union[str, Path]
OUTLIER_FRACTIONS = (0.25, 0.5, 0.75, 1.0)


def epoch_files(run_dir: PathLike, folder: str = "stats",
                option: str = "record_statistics") -> list[Path]:
    """The run's ``<folder>/epoch_*.pt`` in epoch order; fails with the fix (train with
    ``<option>=true``) when there are none."""
    stats_dir = Path(run_dir) / folder
    pattern = re.compile(r"epoch_(\d+)\.pt")
    files = sorted((p for p in stats_dir.glob("epoch_*.pt") if pattern.fullmatch(p.name)),
                   key=lambda p: int(pattern.fullmatch(p.name).group(1)))
    if not files:
        raise FileNotFoundError(
            f"{run_dir} has no recorded statistics ({stats_dir}/epoch_*.pt): rerun with "
            f"{option}=true, e.g. python scripts/train.py +exp=<exp> {option}=true")
    return files


def load_statistics(run_dir: PathLike) -> Statistics:
    """``{layer: {"act": (T_total, C), "grad": (T_total, C), "skip": (T_total,)}}`` over all epochs.

    Row i is training step i + 1. Refuses files whose layers or per-key step counts disagree,
    since concatenating them would silently shift steps.
    """
    chunks: dict[str, dict[str, list[torch.Tensor]]] = {}
    for path in epoch_files(run_dir):
        epoch = torch.load(path, map_location="cpu", weights_only=True)
        if chunks and set(epoch) != set(chunks):
            raise ValueError(f"{path}: its layers differ from the earlier epochs' "
                             f"({sorted(set(epoch) ^ set(chunks))})")
        for layer, values in epoch.items():
            lengths = {key: len(tensor) for key, tensor in values.items()}
            if len(set(lengths.values())) > 1:
                raise ValueError(f"{path}: layer {layer} has {lengths} rows; expected one row "
                                 "per training step for every key (extra act rows come from a "
                                 "norm that also records while evaluating)")
            for key, tensor in values.items():
                chunks.setdefault(layer, {}).setdefault(key, []).append(tensor)
    return {layer: {key: torch.cat(parts) for key, parts in values.items()}
            for layer, values in chunks.items()}


def load_run_info(run_dir: PathLike) -> dict:
    """``result.json`` (exp, norm, model, ...); an unfinished run has none, so fall back to its name."""
    result = Path(run_dir) / "result.json"
    if result.exists():
        return json.loads(result.read_text())
    return {"exp": Path(run_dir).resolve().name}


def sliding_means(values, window: int = 4) -> tuple[np.ndarray, np.ndarray]:
    """Geometric and arithmetic means over each run of ``window`` consecutive steps (Fig. 4).

    Entry j covers steps j .. j + window - 1, i.e. what UN's window holds at step j + window - 1.
    """
    values = np.asarray(values, dtype=np.float64)
    if values.ndim != 1 or not 1 <= window <= len(values):
        raise ValueError(f"need a 1-D sequence of at least window={window} values, got shape "
                         f"{values.shape}")
    windows = sliding_window_view(values, window)
    return gmean(windows, axis=-1), windows.mean(axis=-1)


def outlier_counts(skips: dict[str, torch.Tensor],
                   fractions: Sequence[float] = OUTLIER_FRACTIONS) -> dict:
    """Accumulated skip steps per layer at fractions of training (Fig. 5).

    Returns ``{"total_steps", "fractions", "steps", "layers": {layer: [count at each step]}}``;
    the count at a fraction f is the number of skipped steps among steps 1 .. ceil(f * T).
    """
    if not skips:
        raise ValueError("no layer has skip flags (only UN, MABN and PN record them)")
    totals = {len(flags) for flags in skips.values()}
    if len(totals) != 1:
        raise ValueError(f"layers disagree on the number of steps: {sorted(totals)}")
    total = totals.pop()
    if not all(0 < f <= 1 for f in fractions):
        raise ValueError(f"fractions must lie in (0, 1], got {list(fractions)}")
    steps = [int(np.ceil(f * total)) for f in fractions]
    layers = {}
    for layer, flags in skips.items():
        cumulative = np.cumsum(np.asarray(flags, dtype=np.int64))
        layers[layer] = [int(cumulative[step - 1]) for step in steps]
    return {"total_steps": total, "fractions": list(fractions), "steps": steps, "layers": layers}


def write_outliers(counts: dict, json_path: PathLike, csv_path: PathLike) -> None:
    """``outliers.json`` as returned by ``outlier_counts``; ``outliers.csv`` one row per layer and point."""
    Path(json_path).write_text(json.dumps(counts, indent=2))
    with open(csv_path, "w", newline="") as f:
        writer = csv.writer(f, lineterminator="\n")
        writer.writerow(["layer", "fraction", "step", "skipped_steps"])
        for layer, values in counts["layers"].items():
            for fraction, step, value in zip(counts["fractions"], counts["steps"], values):
                writer.writerow([layer, fraction, step, value])
