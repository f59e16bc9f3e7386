"""PNAC (Eq. 15; Figs. 3 and 7): the Percentage of Normally-distributed Activation/gradient Channels.

For each norm layer and each non-overlapping window of T consecutive training steps, a
channel passes when its T per-step statistics pass the D'Agostino-Pearson normality test
(``scipy.stats.normaltest``) at p > 0.05. Comparing it for activation and gradient
statistics over training is how the paper judges which estimator suits each direction
(UN: geometric mean forward, arithmetic mean backward).
"""
from __future__ import annotations

import csv
import json
import warnings
from pathlib import Path
from typing import Union

import numpy as np
from scipy.stats import normaltest

from .statistics import Statistics

ALPHA = 0.05  # a channel is "normal" when p > ALPHA
MIN_WINDOW = 8  # normaltest's skewness test needs 8 samples
KINDS = ("act", "grad")
FIELDS = ("layer", "kind", "window", "first_step", "last_step", "pnac", "n_channels", "n_nan")
PathLike = Union[str, Path]


def window_pvalues(values, window: int = 20) -> np.ndarray:
    """Normality p-values, shape (floor(T_total / window), C), one per window and channel.

    Steps past the last full window are left out. A window whose statistic is exactly
    constant gets NaN: scipy's moments of such data can be rounding noise rather than 0,
    which would yield an arbitrary p-value instead of its usual NaN.
    """
    if window < MIN_WINDOW:
        raise ValueError(f"PNAC window T={window} is too short: scipy's normaltest needs at least "
                         f"{MIN_WINDOW} steps per window")
    values = np.asarray(values, dtype=np.float64)
    if values.ndim != 2:
        raise ValueError(f"expected per-step statistics of shape (T, C), got {values.shape}")
    count = len(values) // window
    if count == 0:
        return np.empty((0, values.shape[1]))
    windows = values[:count * window].reshape(count, window, values.shape[1])
    with warnings.catch_warnings():  # near-constant channels: their NaN is reported as n_nan
        warnings.filterwarnings("ignore", "Precision loss", RuntimeWarning)
        pvalues = normaltest(windows, axis=1).pvalue
    return np.where(np.ptp(windows, axis=1) == 0, np.nan, pvalues)


def pnac(values, window: int = 20) -> tuple[np.ndarray, np.ndarray]:
    """Per-window PNAC in percent and the number of NaN p-values (counted as not normal)."""
    pvalues = window_pvalues(values, window)
    passed = pvalues > ALPHA  # NaN compares False: not normal
    return 100.0 * passed.mean(axis=1), np.isnan(pvalues).sum(axis=1)


def pnac_rows(stats: Statistics, window: int = 20) -> list[dict]:
    """One row per layer, kind (act/grad) and window, with 1-based training steps (see FIELDS)."""
    rows = []
    for layer, values in stats.items():
        for kind in KINDS:
            if kind not in values:
                continue
            percent, nans = pnac(values[kind], window)
            for index, (value, n_nan) in enumerate(zip(percent, nans)):
                rows.append({"layer": layer, "kind": kind, "window": index,
                             "first_step": index * window + 1, "last_step": (index + 1) * window,
                             "pnac": float(value), "n_channels": int(values[kind].shape[1]),
                             "n_nan": int(n_nan)})
    return rows


def pnac_matrix(rows: list[dict], kind: str) -> tuple[list[str], np.ndarray, np.ndarray]:
    """(layers, last step of each window (W,), PNAC (L, W)) for one kind; NaN where a layer lacks a window."""
    selected = [row for row in rows if row["kind"] == kind]
    layers = list(dict.fromkeys(row["layer"] for row in selected))
    count = max((row["window"] + 1 for row in selected), default=0)
    steps = np.full(count, np.nan)
    matrix = np.full((len(layers), count), np.nan)
    for row in selected:
        steps[row["window"]] = row["last_step"]
        matrix[layers.index(row["layer"]), row["window"]] = row["pnac"]
    return layers, steps, matrix


def write_pnac_csv(rows: list[dict], path: PathLike) -> None:
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=FIELDS, lineterminator="\n")
        writer.writeheader()
        writer.writerows(rows)


def write_pnac_json(rows: list[dict], path: PathLike, info: dict, window: int) -> None:
    """The rows with what produced them, so a saved table still says which run and test it is."""
    Path(path).write_text(json.dumps({
        **{key: info.get(key) for key in ("exp", "norm", "model")},
        "window": window, "alpha": ALPHA, "test": "scipy.stats.normaltest (D'Agostino-Pearson)",
        "rows": rows}, indent=2))
