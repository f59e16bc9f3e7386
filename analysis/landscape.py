"""The loss landscape along each probed update's gradient over training (``record_landscape``),
several runs overlaid, as Santurkar et al. (NeurIPS 2018) draw it in their Fig. 4.

    python -m analysis.landscape [--runs results/runs] [--out results/analysis/landscape]

Reads every run under ``--runs`` with a ``landscape.jsonl`` (``plugins.landscape``); writes,
per testbed (task, model, data), ``<model>_<data>_landscape.png`` with four panels against
the update: the band of losses along the step (min to max over the step sizes), the
gradient's predictiveness (its largest change along the step), the effective
beta-smoothness and the course study's "Lipschitz" (the largest change of the loss); and
``.json`` with the series drawn. A run's label is its setting and seed.
"""
from __future__ import annotations

import json
from pathlib import Path

from matplotlib.figure import Figure

from .plots import save_figure
from .runs import figure_args, load_runs, method_order, setting, where

LANDSCAPE_FILE = "landscape.jsonl"  # what plugins.runlog names it (analysis imports no plugin)
#: the panels: (title, the row's keys drawn, log scale)
PANELS = (("loss along the step (min to max)", ("loss_min", "loss_max"), False),
          ("gradient predictiveness: max ||g - g(eta)||", ("predictiveness",), True),
          ("effective beta-smoothness", ("beta",), True),
          ("Lipschitz (study): max |L - L(eta)|", ("lipschitz",), True))


def read_landscape(run_dir: Path) -> list[dict]:
    """A run's probes in step order; a step probed twice (a resumed fairseq or mmdet run
    trains some updates again) keeps its last row."""
    rows = {}
    for line in (Path(run_dir) / LANDSCAPE_FILE).read_text().splitlines():
        if line.strip():
            row = json.loads(line)
            rows[row["step"]] = row
    return [rows[step] for step in sorted(rows)]


def landscape_series(runs: list[dict]) -> dict[tuple, dict[str, list[dict]]]:
    """``{(task, model, data): {"<setting> s<seed>": rows}}`` of the runs with probes."""
    out: dict = {}
    for run in runs:
        path = Path(run["_path"]) / LANDSCAPE_FILE
        if path.exists():
            label = f"{setting(run)} s{run.get('seed', 0)}"
            out.setdefault(where(run), {})[label] = read_landscape(path.parent)
    return out


def plot_landscape(series: dict[str, list[dict]], title: str, path: Path) -> Path:
    """The four panels (``PANELS``) of ``series``' runs against the update."""
    fig = Figure(figsize=(11, 7.5))
    axes = fig.subplots(2, 2, sharex=True).ravel()
    labels = sorted(series, key=method_order)
    for ax, (name, keys, log) in zip(axes, PANELS):
        for index, label in enumerate(labels):
            rows = [row for row in series[label] if all(row.get(k) is not None for k in keys)]
            steps = [row["step"] for row in rows]
            colour = f"C{index % 10}"
            if len(keys) == 2:
                ax.fill_between(steps, [row[keys[0]] for row in rows], [row[keys[1]] for row in rows],
                                color=colour, alpha=0.35, label=label)
            else:
                ax.plot(steps, [row[keys[0]] for row in rows], color=colour, marker="o",
                        markersize=2, linewidth=1, label=label)
        if log:
            ax.set_yscale("log")
        ax.set_title(name, fontsize=9)
    for ax in axes[2:]:
        ax.set_xlabel("update")
    axes[0].legend(fontsize=7)
    fig.suptitle(f"{title}\nalong each probed update's gradient, step sizes up to its learning "
                 "rate", fontsize=10)
    fig.tight_layout()
    return save_figure(fig, path)


def main(argv=None) -> None:
    args = figure_args(__doc__.splitlines()[0], "landscape", argv)
    found = landscape_series(load_runs(args.runs))
    if not found:
        raise SystemExit(f"no run under {args.runs} has a {LANDSCAPE_FILE}: train one with "
                         "record_landscape=<updates between probes> (python scripts/train.py "
                         "+exp=t2t_vit_14_ln scale=cpu record_landscape=10)")
    for (_, model, data), series in sorted(found.items()):
        name = f"{model}_{data}_landscape"
        plot_landscape(series, f"Loss landscape: {model} on {data}", args.out / f"{name}.png")
        (args.out / f"{name}.json").write_text(json.dumps(series, indent=1) + "\n")
        print(f"wrote {args.out / name}.png and .json")


if __name__ == "__main__":
    main()
