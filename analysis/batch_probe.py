"""The figure of ``scripts/probe_lm_batch.py``, drawn from its probe.json alone.

Top row, one panel per run: the next-token loss at each position in eval mode (running
statistics, solid) and in training mode (batch statistics, dashed), log scale. Bottom row:
each position's share of the pooled centred second moment of the first and the last probed
norm's input (mean over batches), one line per run, against the uniform share 1/T.
"""
from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Union

from matplotlib.figure import Figure

from .plots import save_figure

PathLike = Union[str, Path]


def load_probe(path: PathLike) -> dict:
    """probe.json as written: ``{run key: run entry}``."""
    return json.loads(Path(path).read_text())


def probed_layers(entry: dict) -> list[str]:
    """The run's norms whose inputs were probed, in module order."""
    return [name for name in entry["layer_order"] if entry["layers"][name].get("probed")]


def _positive(values: list) -> list:
    """Values a log axis can draw: non-finite or non-positive ones become NaN (a gap)."""
    return [v if v is not None and math.isfinite(v) and v > 0 else math.nan for v in values]


def plot_batch_probe(report: dict, path: PathLike) -> Path:
    """Per-position loss (eval vs training mode) per run, and per-position shares of the
    first and last probed layer's second moment, every run on one axis."""
    runs = list(report)
    fig = Figure(figsize=(max(8.0, 3.2 * len(runs)), 7.0), layout="constrained")
    top, bottom = fig.subfigures(2, 1)
    loss_axes = top.subplots(1, len(runs), squeeze=False)[0]
    for ax, key in zip(loss_axes, runs):
        loss = report[key]["loss"]
        for mode, colour, style in (("eval", "tab:red", "-"), ("train_mode", "tab:blue", "--")):
            values = loss[mode]["per_position"]
            ax.plot(range(len(values)), _positive(values), color=colour, lw=1, ls=style,
                    label=f"{mode.replace('_', ' ')} (mean {loss[mode]['mean']:.3g})")
        ax.set_yscale("log")
        ax.set_title(key, fontsize=9)
        ax.set_xlabel("position t")
        ax.set_ylabel("next-token loss (nats)")
        ax.legend(fontsize=7)
        ax.grid(alpha=0.3, which="both")
    share_axes = bottom.subplots(1, 2, squeeze=False)[0]
    for ax, which in zip(share_axes, ("first", "last")):
        uniform = None
        for key in runs:
            entry = report[key]
            layers = probed_layers(entry)
            if not layers:
                continue
            name = layers[0] if which == "first" else layers[-1]
            share = entry["layers"][name]["position_share"]
            uniform = share["uniform"]
            ax.plot(range(len(share["per_position"])), share["per_position"], lw=1,
                    label=f"{key}: {name} (max {share['max_over_uniform']:.1f}x uniform "
                          f"at t={share['argmax']})")
        if uniform is not None:
            ax.axhline(uniform, color="k", ls="--", lw=0.8, label="uniform 1/T")
        ax.set_yscale("log")
        ax.set_title(f"{which} probed norm: share of the pooled centred\nsecond moment by "
                     "position (mean over batches)", fontsize=9)
        ax.set_xlabel("position t")
        ax.set_ylabel("share")
        ax.legend(fontsize=6)
        ax.grid(alpha=0.3, which="both")
    return save_figure(fig, path)
