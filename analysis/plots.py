"""Figs. 3, 4, 5 and 7 of the paper from a run's recorded statistics.

Figures are drawn on bare ``matplotlib.figure.Figure`` objects (Agg canvas, no pyplot state), so
they work on headless machines and never touch a caller's interactive backend.
"""
from __future__ import annotations

from pathlib import Path
from typing import Union

import numpy as np
from matplotlib.figure import Figure
from scipy.stats import gaussian_kde

from .pnac import KINDS, pnac_matrix
from .statistics import sliding_means

PathLike = Union[str, Path]
KIND_LABELS = {"act": "activation statistics", "grad": "gradient statistics"}
KIND_COLOURS = {"act": "tab:blue", "grad": "tab:red"}


def run_title(info: dict) -> str:
    """``exp (norm=..., model=...)`` from a run's result.json, naming what is known."""
    details = ", ".join(f"{key}={info[key]}" for key in ("norm", "model") if info.get(key))
    return f"{info.get('exp', 'run')} ({details})" if details else str(info.get("exp", "run"))


def _window_length(rows: list[dict]) -> int:
    return rows[0]["last_step"] - rows[0]["first_step"] + 1


def save_figure(fig: Figure, path: PathLike) -> Path:
    """Write ``fig`` at 150 dpi, making its folder."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=150)
    return path


def plot_pnac_over_training(rows: list[dict], info: dict, path: PathLike) -> Path:
    """Fig. 3: PNAC averaged over layers, activation vs gradient statistics, per window."""
    fig = Figure(figsize=(6.4, 4.0), layout="constrained")
    ax = fig.subplots()
    for kind in KINDS:
        layers, steps, matrix = pnac_matrix(rows, kind)
        if not layers:
            continue
        ax.plot(steps, np.nanmean(matrix, axis=0), marker="o", color=KIND_COLOURS[kind],
                label=f"{KIND_LABELS[kind]} (mean of {len(layers)} layers)")
        ax.fill_between(steps, np.nanmin(matrix, axis=0), np.nanmax(matrix, axis=0),
                        color=KIND_COLOURS[kind], alpha=0.15, linewidth=0)
    ax.set_ylim(-2, 102)
    ax.set_xlabel(f"iteration (last step of each {_window_length(rows)}-step window)")
    ax.set_ylabel("PNAC (%)")
    ax.set_title(f"PNAC over training (shaded: min-max over layers)\n{run_title(info)}", fontsize=10)
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    return save_figure(fig, path)


def _density(ax, values: np.ndarray, colour: str, label: str) -> None:
    """Histogram, plus a KDE when there is a spread to smooth (gaussian_kde needs >1 distinct value)."""
    values = values[~np.isnan(values)]
    ax.hist(values, bins=np.linspace(0, 100, 21), density=True, color=colour, alpha=0.35, label=label)
    if len(np.unique(values)) > 1:
        grid = np.linspace(0, 100, 201)
        ax.plot(grid, gaussian_kde(values)(grid), color=colour)


def plot_pnac_density(rows: list[dict], info: dict, path: PathLike) -> Path:
    """Fig. 7: density of per-layer PNAC in the first and the last window, act and grad."""
    fig = Figure(figsize=(9.0, 3.8), layout="constrained")
    axes = fig.subplots(1, len(KINDS), sharey=True)
    for ax, kind in zip(axes, KINDS):
        layers, steps, matrix = pnac_matrix(rows, kind)
        if layers:
            for column, colour, when in ((0, "tab:green", "start"), (-1, "tab:purple", "end")):
                last = int(steps[column])
                _density(ax, matrix[:, column], colour,
                         f"{when} (steps {last - _window_length(rows) + 1}-{last})")
            ax.legend(fontsize=8)
        ax.set_xlim(0, 100)
        ax.set_xlabel("PNAC (%) of a layer")
        ax.set_title(f"{KIND_LABELS[kind]} ({len(layers)} layers)", fontsize=9)
    axes[0].set_ylabel("density")
    fig.suptitle(f"PNAC at the start and end of training\n{run_title(info)}", fontsize=10)
    return save_figure(fig, path)


def plot_statistics(act, grad, info: dict, path: PathLike, layer: str, channel: int,
                    window: int = 4) -> Path:
    """Fig. 4: one channel's activation statistic with the geometric and arithmetic means UN's
    window of ``window`` steps would take of it, and its gradient statistic below."""
    act, grad = np.asarray(act, dtype=np.float64), np.asarray(grad, dtype=np.float64)
    steps = np.arange(1, len(act) + 1)
    geometric, arithmetic = sliding_means(act, window)
    fig = Figure(figsize=(7.5, 5.6), layout="constrained")
    top, bottom = fig.subplots(2, 1, sharex=True)
    top.plot(steps, act, color="0.6", linewidth=0.8, label="activation statistic $s_t$")
    top.plot(steps[window - 1:], geometric, color="tab:blue", linewidth=1.6,
             label=f"geometric mean ({window} steps)")
    top.plot(steps[window - 1:], arithmetic, color="tab:orange", linestyle="--", linewidth=1.2,
             label=f"arithmetic mean ({window} steps)")  # dashed: visible where it equals the GM
    if np.all(act > 0) and act.max() > 10 * act.min():  # log only pays off across decades
        top.set_yscale("log")
    top.set_ylabel("activation statistic")
    top.legend(fontsize=8)
    top.grid(alpha=0.3)
    bottom.plot(steps, grad, color="tab:red", linewidth=0.8)
    bottom.axhline(0, color="0.3", linewidth=0.5)
    bottom.set_ylabel("gradient statistic mean(g z)")
    bottom.set_xlabel("iteration")
    bottom.grid(alpha=0.3)
    fig.suptitle(f"{layer}, channel {channel}\n{run_title(info)}", fontsize=10)
    return save_figure(fig, path)


def plot_outliers(counts: dict, info: dict, path: PathLike) -> Path:
    """Fig. 5: skipped (outlier) steps accumulated per layer at several points of training."""
    layers = list(counts["layers"])
    values = np.array([counts["layers"][layer] for layer in layers])  # (L, points)
    points = len(counts["steps"])
    width = 0.8 / points
    fig = Figure(figsize=(max(6.4, 0.35 * len(layers) + 2), 4.8), layout="constrained")
    ax = fig.subplots()
    positions = np.arange(len(layers))
    for j, (fraction, step) in enumerate(zip(counts["fractions"], counts["steps"])):
        ax.bar(positions + (j - (points - 1) / 2) * width, values[:, j], width,
               label=f"{fraction:.0%} (step {step})")
    ax.set_xticks(positions, layers, rotation=90, fontsize=7)
    ax.set_xlabel("layer")
    ax.set_ylabel("accumulated skipped steps")
    ax.set_title(f"Outlier filtration: skipped steps per layer ({counts['total_steps']} steps)\n"
                 f"{run_title(info)}", fontsize=10)
    ax.legend(title="point of training", fontsize=8)
    ax.grid(axis="y", alpha=0.3)
    return save_figure(fig, path)
