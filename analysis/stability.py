"""The stability map as a figure: the final metric against the learning-rate multiple, one line
per setting (its learning-rate sensitivity in the legend, ``analysis.sensitivity``), collapsed
runs and runs that finished at chance marked.

    python -m analysis.stability [--runs results/runs] [--out results/analysis/stability]

Reads the runs of the learning-rate ladder (``+sweep=stability``: ``lr_multiple`` set; the
same settings' runs without it count at 1x) and writes, per model, ``<model>_<data>.png`` and
``.json`` (per setting and multiple: the metric of every run that learned, of every run that
finished at chance, and the step of every collapse).
"""
from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path
from typing import Optional

from matplotlib import colormaps
from matplotlib.figure import Figure

from .plots import save_figure
from .sensitivity import bounded, chance_bound, sensitivity
from .significance import DIGITS, Cell
from .runs import (LOWER_IS_BETTER, STABILITY_KEY, TASK_METRIC, broken_text, figure_args, ladder,
                   load_runs, method_order, runs_read)


def outcomes(runs: list[dict], metric: str) -> dict[str, list]:
    """``{"ok": [metric of each run that learned], "chance": [metric of each run that finished
    no better than chance], "fail": [step of each collapse]}``; a run that learned without
    a number for the metric is left to ``runs_read``'s count (``Cell.values``)."""
    return {"ok": Cell(runs).values(metric),
            "chance": [r["metrics"][metric] for r in runs if r["status"] == "chance"],
            "fail": [r["fail_step"] for r in runs if r["status"] == "FAIL"]}


def plot_stability(settings: dict[str, dict[float, list[dict]]], title: str, metric: str,
                   path: Path, bound: float, legend: Optional[dict[str, str]] = None) -> Path:
    """Mean metric of the runs that learned (line) per multiple; hollow circles mark runs that
    finished at chance, drawn at the chance level ``bound`` (dotted), as the sensitivity counts
    them (an eval loss of 1e14 would otherwise set the axis); an x at the worst edge (the
    bottom, or the top where lower is better) marks each multiple where runs collapsed,
    labelled with the collapsed fraction. ``legend``: each setting's legend text (default: its
    label)."""
    fig = Figure(figsize=(10, 5.2))
    ax = fig.add_subplot()
    colours = [f"C{i}" for i in range(10)] + [colormaps["tab20b"](i / 20) for i in range(0, 20, 2)]
    edge = 1.0 if metric in LOWER_IS_BETTER else 0.0  # axes fraction: where collapses show
    at_edge = ax.get_xaxis_transform()  # x in data, y in axes fraction
    ax.axhline(bound, linestyle=":", linewidth=0.8, color="grey")
    for index, label in enumerate(sorted(settings, key=method_order)):
        colour = colours[index % len(colours)]
        cells = {m: {**outcomes(runs, metric),
                     "chance": [bounded(r, metric, bound) for r in runs if r["status"] == "chance"]}
                 for m, runs in settings[label].items()}
        multiples = sorted(cells)
        finished = [(m, statistics.mean(cells[m]["ok"])) for m in multiples if cells[m]["ok"]]
        if finished:
            ax.plot(*zip(*finished), marker="o", color=colour, label=(legend or {}).get(label, label))
        for m in multiples:
            chance = cells[m]["chance"]
            if chance:
                ax.scatter([m] * len(chance), chance, marker="o", s=40, facecolors="none",
                           edgecolors=colour, zorder=3)
            failed, total = len(cells[m]["fail"]), sum(len(values) for values in cells[m].values())
            if failed:
                ax.scatter([m], [edge], marker="x", s=70, color=colour, zorder=3,
                           transform=at_edge, clip_on=False)
                ax.annotate(f"{failed}/{total}", (m, edge), xycoords=at_edge,
                            textcoords="offset points", fontsize=7, color=colour,
                            xytext=(4, (4 + 9 * index) * (-1 if edge else 1)))
    ax.set_xscale("log")
    ax.set_xlabel("learning rate, multiple of the recipe's")
    ax.set_ylabel(f"{metric} (mean of the runs that learned)")
    where = "top" if edge else "bottom"
    ax.set_title(f"{title}\nhollow: runs at chance, drawn at the chance level (dotted); x at the "
                 f"{where}: collapsed runs (FAIL), with the fraction of seeds", fontsize=9)
    ax.legend(fontsize=7, loc="center left", bbox_to_anchor=(1.0, 0.5))
    fig.tight_layout()
    return save_figure(fig, path)


def main(argv=None) -> None:
    args = figure_args(__doc__.splitlines()[0], "stability", argv)
    runs = load_runs(args.runs)
    print(runs_read(runs))
    if broken_text(runs):
        print(broken_text(runs), file=sys.stderr)
    points = ladder(runs)
    if not points:
        raise SystemExit(f"no runs with {STABILITY_KEY} under {args.runs}: run the ladder first "
                         "(python scripts/train.py +exp=<exp> scale=cpu +sweep=stability)")
    for (task, model, data), settings in sorted(points.items()):
        name, metric = f"{model}_{data}", TASK_METRIC[task]
        bound = chance_bound(settings, metric)
        legend = {}
        for label, cells in settings.items():
            lrs = sensitivity(cells, metric, bound)["sensitivity"]
            legend[label] = label if lrs is None else f"{label} (sensitivity {lrs:.{DIGITS.get(metric, 1)}f})"
        plot_stability(settings, f"Stability: {model} on {data}", metric,
                       args.out / f"{name}.png", bound, legend)
        serialisable = {label: {f"{m:g}": outcomes(settings[label][m], TASK_METRIC[task])
                                for m in sorted(settings[label])}
                        for label in sorted(settings, key=method_order)}
        (args.out / f"{name}.json").write_text(json.dumps(serialisable, indent=2) + "\n")
        print(f"wrote {args.out / name}.png and .json")


if __name__ == "__main__":
    main()
