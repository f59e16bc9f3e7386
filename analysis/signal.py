"""Signal propagation at initialisation from the records of ``scripts/signal_propagation.py``
(``results/signal/<model>.jsonl``): figures like "Beyond BatchNorm"'s (variance, similarity
and gradient norm against depth, per norm and per group size) and the tests of its findings.

    python -m analysis.signal [results/signal]

Reads records only. The tests, each over the seeds (n stated with each):

- variance growth: per seed, the least-squares exponent ``k`` of ``variance ~ l^k`` over the
  blocks l = 1..L of the deepest model (log-log; linear growth is k = 1, none k = 0), its
  mean with a 95% t-interval over the seeds;
- group size: Welch's t-test of the last block's similarity and of the first block's
  gradient norm (log10 of its ratio to the last block's: the loss's scale cancels) between
  the smallest group and the largest (LN's).
"""
from __future__ import annotations

import json
import statistics
import sys
from collections import defaultdict
from pathlib import Path

import numpy as np
from matplotlib.figure import Figure
from scipy import stats

from analysis.tables import Table

QUANTITIES = ("variance", "similarity", "grad_norm")
LABELS = {"variance": "activation variance", "similarity": "similarity between samples",
          "grad_norm": "gradient norm", "stable_rank": "stable rank",
          "token_similarity": "similarity between tokens"}
LEVEL = 0.95
PLACEMENTS = ["pre", "post", "peri", "mix"]


def load(folder: Path) -> list[dict]:
    return [json.loads(line) for path in sorted(Path(folder).glob("*.jsonl"))
            for line in path.read_text().splitlines() if line.strip()]


def _curves(records, quantity):
    """``{(model, norm, placement, depth): array (seeds, layers)}``."""
    grouped = defaultdict(list)
    for r in records:
        grouped[r["model"], r["norm"], r["placement"], r["depth"]].append(
            [layer[quantity] for layer in r["layers"]])
    return {key: np.asarray(value, dtype=float) for key, value in grouped.items()}


def growth_exponent(variances: np.ndarray) -> float:
    """The least-squares slope of log variance against log block index (1-based)."""
    index = np.log(np.arange(1, len(variances) + 1))
    return float(np.polyfit(index, np.log(variances), 1)[0])


def _interval(values) -> tuple[float, float, float]:
    values = np.asarray(values, dtype=float)
    mean = float(values.mean())
    half = float(stats.t.ppf(0.5 + LEVEL / 2, len(values) - 1) * stats.sem(values))
    return mean, mean - half, mean + half


def growth_table(records) -> list[dict]:
    """Per (model, norm, placement) at its deepest model: the growth exponent over seeds."""
    curves = _curves(records, "variance")
    deepest = defaultdict(int)
    for model, norm, placement, depth in curves:
        deepest[model, norm, placement] = max(deepest[model, norm, placement], depth)
    rows = []
    for (model, norm, placement), depth in sorted(deepest.items()):
        seeds = curves[model, norm, placement, depth]
        exponents = [growth_exponent(seed) for seed in seeds]
        mean, low, high = _interval(exponents)
        rows.append({"model": model, "norm": norm, "placement": placement, "depth": depth,
                     "n": len(exponents), "exponent": mean, "low": low, "high": high,
                     "last_variance": float(seeds[:, -1].mean())})
    return rows


def _welch(x, y) -> dict:
    test = stats.ttest_ind(x, y, equal_var=False)
    interval = test.confidence_interval(LEVEL)
    return {"difference": float(np.mean(x) - np.mean(y)), "low": float(interval.low),
            "high": float(interval.high), "p": float(test.pvalue), "n": (len(x), len(y))}


def group_of(record) -> tuple:
    """``(channels per group, layout)`` of a record's norm: GroupNorm's, LN as one group per
    token (GroupNorm at groups=1, ``tests/test_norms.py``); ``(None, None)`` for the others."""
    if record["norm_cfg"]["name"] == "ln":
        return record["width"], "token"
    return record["group_size"], record["norm_cfg"].get("layout", "token")


def first_gradient(layers: list[dict]) -> float:
    """log10 of the first block's gradient norm over the last block's: the loss's scale
    cancels, and the logarithm tames the heavy tail across seeds (ratios of 10^0 to 10^10)."""
    return float(np.log10(layers[0]["grad_norm"] / layers[-1]["grad_norm"]))


def group_figure(records, path: Path) -> None:
    """The last block's similarity and the first block's gradient norm (over the last's)
    against the group size, per (model, placement, layout) at the deepest model; mean and
    the seeds' spread."""
    fig = Figure(figsize=(8, 3.4))
    axes = fig.subplots(1, 2)
    series = defaultdict(lambda: defaultdict(list))
    deepest = max(r["depth"] for r in records)
    for r in records:
        size, layout = group_of(r)
        if size is None or r["depth"] != deepest:
            continue
        layers = r["layers"]
        series[f"{r['model']} {r['placement']} {layout}"][size].append(
            (layers[-1]["similarity"], first_gradient(layers)))
    for label, sizes in sorted(series.items()):
        xs = sorted(sizes)
        for ax, part in zip(axes, (0, 1)):
            values = [[v[part] for v in sizes[x]] for x in xs]
            ax.errorbar(xs, [np.mean(v) for v in values], yerr=[np.std(v) for v in values],
                        label=label, marker="o", ms=3, capsize=2, lw=1)
    for ax, title in zip(axes, ("similarity, last block", "log10 gradient norm, first / last block")):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("channels per group (1: instance; the width: LN)")
        ax.set_title(f"{title} (depth {deepest})", fontsize=9)
    axes[1].legend(fontsize=6)
    fig.tight_layout()
    fig.savefig(path, dpi=70)


def group_table(records) -> list[dict]:
    """Per (model, placement, layout, depth): the smallest group against the largest, for the
    last block's similarity and the first block's relative gradient norm (Welch)."""
    by_size = defaultdict(lambda: defaultdict(list))
    for r in records:
        size, layout = group_of(r)
        if size is None:
            continue
        layers = r["layers"]
        by_size[r["model"], r["placement"], layout, r["depth"]][size].append(
            (layers[-1]["similarity"], first_gradient(layers)))
    rows = []
    for (model, placement, layout, depth), sizes in sorted(by_size.items()):
        if len(sizes) < 2:
            continue
        small, large = min(sizes), max(sizes)
        rows.append({"model": model, "placement": placement, "layout": layout, "depth": depth,
                     "small": small, "large": large,
                     "similarity": _welch([s for s, _ in sizes[small]],
                                          [s for s, _ in sizes[large]]),
                     "first_grad": _welch([g for _, g in sizes[small]],
                                          [g for _, g in sizes[large]])})
    return rows


def depth_figure(records, model: str, depth: int, path: Path) -> None:
    """Rows: variance, similarity, gradient norm; columns: the model's placements; one line
    per norm (mean over seeds) against the block index, at ``depth`` blocks."""
    placements = sorted({r["placement"] for r in records if r["model"] == model},
                        key=PLACEMENTS.index)
    fig = Figure(figsize=(3.2 * len(placements), 7.5))
    axes = fig.subplots(len(QUANTITIES), len(placements), squeeze=False)
    for row, quantity in enumerate(QUANTITIES):
        curves = _curves(records, quantity)
        for col, placement in enumerate(placements):
            ax = axes[row][col]
            for (m, norm, p, d), seeds in curves.items():
                if (m, p, d) == (model, placement, depth):
                    ax.plot(np.arange(1, seeds.shape[1] + 1), seeds.mean(0), label=norm, lw=1.2)
            if quantity in ("variance", "grad_norm"):
                ax.set_yscale("log")
            if row == 0:
                ax.set_title(f"{model}, {placement}")
            if col == 0:
                ax.set_ylabel(LABELS[quantity])
            if row == len(QUANTITIES) - 1:
                ax.set_xlabel("block")
    axes[0][-1].legend(fontsize=6)
    fig.tight_layout()
    fig.savefig(path, dpi=70)


def _interval_text(mean, low, high, digits) -> str:
    return f"{mean:+.{digits}f} [{low:+.{digits}f}, {high:+.{digits}f}]"


def _welch_text(test: dict, digits: int) -> str:
    return (f"{_interval_text(test['difference'], test['low'], test['high'], digits)}, "
            f"p = {test['p']:.2g}")


def tables(records: list[dict]) -> list[Table]:
    """The results page's two tables: the variance's growth exponent per (model, placement,
    norm), and the smallest group against one group (LN) per (model, placement, layout)."""
    if not records:
        return []
    growth = [[row["model"], row["placement"], row["norm"], str(row["depth"]), str(row["n"]),
               _interval_text(row["exponent"], row["low"], row["high"], 2),
               f"{row['last_variance']:.3g}"]
              for row in sorted(growth_table(records), key=lambda row: (
                  row["model"], PLACEMENTS.index(row["placement"]), row["norm"]))]
    groups = [[row["model"], row["placement"], row["layout"], str(row["depth"]),
               f"{row['small']} vs {row['large']}", f"{row['similarity']['n'][0]} vs "
               f"{row['similarity']['n'][1]}", _welch_text(row["similarity"], 3),
               _welch_text(row["first_grad"], 2)] for row in group_table(records)]
    return [
        Table("Signal propagation: variance growth at initialisation",
              ["model", "placement", "norm", "blocks", "n", "exponent k [95% CI]",
               "last block's variance"], growth,
              ["k: the least-squares slope of log variance against log block index (variance "
               "~ l^k; 1 linear, 0 flat), per seed, then its mean and 95% t-interval over the "
               "n seeds. Records: results/signal/<model>.jsonl (scripts/signal_propagation.py)."]),
        Table("Signal propagation: group size at initialisation",
              ["model", "placement", "layout", "blocks", "channels per group", "n",
               "last block's similarity, smallest - largest", "log10 first / last block's "
               "gradient norm, smallest - largest"], groups,
              ["Welch's t-test over seeds, the difference with its 95% interval. The largest "
               "group per token is LN (one group); per example (`layout=image`) GroupNorm of "
               "one group."]),
    ]


def main(argv=None) -> None:
    folder = Path((argv or sys.argv[1:] or ["results/signal"])[0])
    records = load(folder)
    if not records:
        raise SystemExit(f"no records in {folder}: run scripts/signal_propagation.py first")
    for model in sorted({r["model"] for r in records}):
        depth = max(r["depth"] for r in records if r["model"] == model)
        depth_figure(records, model, depth, folder / f"{model}_depth{depth}.png")
    group_figure(records, folder / "group_size.png")
    summary = {"growth": growth_table(records), "groups": group_table(records)}
    (folder / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
    for row in summary["growth"]:
        print(f"{row['model']:8} {row['norm']:32} {row['placement']:5} L={row['depth']} "
              f"n={row['n']} exponent {row['exponent']:+.2f} "
              f"[{row['low']:+.2f}, {row['high']:+.2f}] last var {row['last_variance']:.3g}")
    for row in summary["groups"]:
        sim, grad = row["similarity"], row["first_grad"]
        print(f"{row['model']:8} {row['placement']:5} {row['layout']:5} L={row['depth']} "
              f"size {row['small']} vs {row['large']}: similarity {sim['difference']:+.3f} "
              f"[{sim['low']:+.3f}, {sim['high']:+.3f}] p={sim['p']:.2g}; log10 first/last grad "
              f"{grad['difference']:+.3f} [{grad['low']:+.3f}, {grad['high']:+.3f}] "
              f"p={grad['p']:.2g} (n={sim['n'][0]} vs {sim['n'][1]})")


if __name__ == "__main__":
    main()
