"""Language-model validation loss over training, one line per norm and placement.

    python -m analysis.lm_curves [--runs results/runs] [--out results/analysis/lm]

Reads the language-modelling runs as configured (no override but the placement, no
learning-rate multiple) and their ``metrics.jsonl``; writes, per testbed,
``<model>_<data>_curves.png`` and ``.json`` (per setting and training tokens: the validation
loss of each seed). The last point is the whole validation set, earlier ones its first part
(``recipe.interval_eval_tokens``), so the last step of each line mixes two samples.
"""
from __future__ import annotations

import json
import statistics
from pathlib import Path

from matplotlib.figure import Figure

from .plots import save_figure
from .runs import (STABILITY_KEY, figure_args, load_runs, method_order, override_value, setting,
                   where)


def curves(runs: list[dict]) -> dict[tuple, dict[str, dict[int, list[float]]]]:
    """``{(task, model, data): {setting: {tokens: [val_loss of each seed]}}}`` for the
    language-modelling runs as configured that finished (collapsed runs have no curve)."""
    out: dict = {}
    for run in runs:
        label = setting(run)
        if (run.get("task") != "language_modelling" or " " in label or run["status"] != "ok"
                or override_value(run, STABILITY_KEY) is not None):
            continue
        points = out.setdefault(where(run), {}).setdefault(label, {})
        for line in (Path(run["_path"]) / "metrics.jsonl").read_text().splitlines():
            row = json.loads(line)
            if "val_loss" in row:
                points.setdefault(row["tokens"], []).append(row["val_loss"])
    return out


def plot_curves(settings: dict[str, dict[int, list[float]]], title: str, path: Path) -> Path:
    """Mean validation loss over seeds against training tokens, one line per setting. The
    axis ends 1 nat above the worst final loss: an early evaluation far above it (BN's running
    statistics before they settle reach 1e9 nats) leaves the axis instead of flattening it."""
    fig = Figure(figsize=(7.5, 4.8))
    ax = fig.add_subplot()
    finals, lows = [], []
    for index, label in enumerate(sorted(settings, key=method_order)):
        tokens = sorted(settings[label])
        seeds = len(settings[label][tokens[-1]])
        means = [statistics.mean(settings[label][t]) for t in tokens]
        finals.append(means[-1])
        lows.append(min(means))
        ax.plot([t / 1e6 for t in tokens], means, marker="o", markersize=3, color=f"C{index % 10}",
                linestyle="-" if index < 10 else "--", label=f"{label} (n={seeds})")
    ax.set_ylim(min(lows) - 0.2, max(finals) + 1.0)
    ax.set_xlabel("training tokens (millions)")
    ax.set_ylabel("validation loss (nats), mean over seeds")
    ax.set_title(f"{title}\nlast point: the whole validation set; earlier: its first part; "
                 "lines leaving the top are off scale", fontsize=9)
    ax.legend(fontsize=7, loc="center left", bbox_to_anchor=(1.0, 0.5))
    fig.tight_layout()
    return save_figure(fig, path)


def main(argv=None) -> None:
    args = figure_args(__doc__.splitlines()[0], "lm", argv)
    found = curves(load_runs(args.runs))
    if not found:
        raise SystemExit(f"no language-modelling runs under {args.runs}: train one first "
                         "(python scripts/train.py +exp=llama_71m_ln scale=cpu)")
    for (_, model, data), settings in sorted(found.items()):
        name = f"{model}_{data}_curves"
        plot_curves(settings, f"Validation loss: {model} on {data}", args.out / f"{name}.png")
        serialisable = {label: {str(t): settings[label][t] for t in sorted(settings[label])}
                        for label in sorted(settings, key=method_order)}
        (args.out / f"{name}.json").write_text(json.dumps(serialisable, indent=2) + "\n")
        print(f"wrote {args.out / name}.png and .json")


if __name__ == "__main__":
    main()
