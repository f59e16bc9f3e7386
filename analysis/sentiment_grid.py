"""The course study's convergence grid (docs/text_classification.md#the-study-s-grid) from the
grid's records (``results/sentiment_grid``), beside the study's own table
(``results/paper/course_study.yaml``): the "Sentiment grid:" tables that
``scripts/make_tables.py`` writes into ``results/text_classification.md`` (``analysis.pages``),
and the landscape of a few runs (``analysis.landscape``'s panels):

    python -m analysis.sentiment_grid [--records results/sentiment_grid] [--out results/analysis/sentiment_grid]

Each run is C, S or D by the rule fixed before the runs (``outcome``); the study reports C or N,
and our S and D both count as N. One seed per cell: the tables count agreement, and claim no
difference between norms (a test would need seeds).
"""
from __future__ import annotations

import argparse
import json
import math
import re
import statistics
from pathlib import Path

import yaml
from scipy import stats

from analysis.landscape import LANDSCAPE_FILE, plot_landscape, read_landscape
from analysis.runs import load_runs
from analysis.significance import holm
from analysis.tables import Table

GROUP = "sentiment_grid"  # the records: results/sentiment_grid/<name>
STUDY = Path("paper/course_study.yaml")  # under results/
TRAIN_FRESH, TRAIN_SNIPPETS = 5655, 9908  # the training split at split_seed 0 (its record)
RATES = ["10", "1", "0.5", "0.1", "0.01", "0.001", "0.0001"]
WIDTHS = {16: "narrow", 32: "normal", 64: "wide"}
STUDY_NORMS = {"ln": "layernorm", "bn": "batchnorm", "nonorm": "none"}
NORM_ORDER = ["ln", "bn", "nonorm", "un", "rms", "dyt", "prepbn"]
NAME = re.compile(r"(?P<placement>post|pre)_d(?P<depth>\d+)_w(?P<width>\d+)_(?P<norm>[a-z_0-9]+?)"
                  r"_lr(?P<lr>[0-9.]+)(?:_uniform(?P<uniform>[0-9.]+))?$")


def label_entropy(fresh: int = TRAIN_FRESH, total: int = TRAIN_SNIPPETS) -> float:
    """H of the training labels (nats): the best loss of a predictor that ignores the text."""
    p = fresh / total
    return -(p * math.log(p) + (1 - p) * math.log(1 - p))


def outcome(run: dict, epochs: list[dict], entropy: float) -> str:
    """C: ended (ok or chance), finite losses, the last evaluation interval's mean training loss
    (its last 250 updates) <= 0.9 H; D:
    collapsed, a non-finite loss, or the last interval's loss above the first's (it rose); S:
    neither (a plateau at the text-blind loss is S, not D)."""
    losses = [row["train_loss"] for row in epochs]
    if run["status"] == "FAIL" or not losses or not all(math.isfinite(x) for x in losses):
        return "D"
    if losses[-1] > losses[0]:
        return "D"
    return "C" if losses[-1] <= 0.9 * entropy else "S"


def read_grid(root: Path) -> dict[tuple, dict]:
    """``{(placement, depth, width, norm, lr, uniform): {"outcome", "run"}}`` of the records."""
    entropy, cells = label_entropy(), {}
    for run in load_runs(root):
        match = NAME.match(Path(run["_path"]).name)
        if match is None:
            continue
        metrics = Path(run["_path"]) / "metrics.jsonl"
        epochs = ([json.loads(line) for line in metrics.read_text().splitlines()]
                  if metrics.exists() else [])
        key = (match["placement"], int(match["depth"]), int(match["width"]), match["norm"],
               match["lr"], match["uniform"])
        probes = (read_landscape(Path(run["_path"]))
                  if (Path(run["_path"]) / LANDSCAPE_FILE).exists() else [])
        cells[key] = {"outcome": outcome(run, epochs, entropy), "run": run, "probes": probes}
    return cells


def read_study(path: Path) -> dict[tuple, str]:
    """The study's table (``study_table``) from its transcription."""
    return study_table(yaml.safe_load(Path(path).read_text()))


def study_table(study: dict) -> dict[tuple, str]:
    """``{(depth, width, norm, lr): "C" | "N"}`` of the study."""
    table = {}
    if [float(r) for r in study["convergence"]["learning_rates"]] != [float(r) for r in RATES]:
        raise ValueError(f"the study's learning rates {study['convergence']['learning_rates']} "
                         f"are not the grid's {RATES}")
    for width, label in WIDTHS.items():
        for depth in (1, 5):
            row = study["convergence"][f"depth_{depth}_{label}"]
            for norm, theirs in STUDY_NORMS.items():
                for rate, mark in zip(RATES, row[theirs]):
                    table[(depth, width, norm, rate)] = mark
    return table


def _cell(cells: dict, placement: str, depth: int, width: int, norm: str, rate: str):
    return cells.get((placement, depth, width, norm, rate, None))


def convergence_table(cells: dict, study: dict, placement: str) -> Table:
    """Ours (the study's, Post only) per rate, a row per (depth, width, norm) with a run."""
    rows = []
    for depth in (1, 5):
        for width, label in WIDTHS.items():
            for norm in NORM_ORDER:
                ran = [_cell(cells, placement, depth, width, norm, rate) for rate in RATES]
                if not any(ran):
                    continue
                marks = []
                for rate, cell in zip(RATES, ran):
                    theirs = study.get((depth, width, norm, rate)) if placement == "post" else None
                    marks.append((cell["outcome"] if cell else "–")
                                 + (f" ({theirs})" if theirs else ""))
                rows.append([str(depth), f"{width} ({label})", norm, *marks])
    return Table(f"Sentiment grid: convergence, {placement.capitalize()}",
                 ["depth", "width", "norm", *(f"lr {rate}" for rate in RATES)], rows,
                 ["Ours, and in brackets the study's (Post only). C: converged, the last "
                  f"interval's mean training loss at most 0.9 H = {0.9 * label_entropy():.4f} "
                  "nats (H: the training labels' entropy, the best text-blind loss); D: "
                  "diverged (collapsed, a non-finite loss, or the last interval's loss above "
                  "the first's); S: slow (neither); –: not run. The study's N is our D or S. "
                  "Plain SGD, no warm-up, 2,000 updates of 32 snippets, one seed per cell "
                  "(docs/text_classification.md#the-study-s-grid)."])


def agreement_table(cells: dict, study: dict) -> Table:
    """Per (depth, norm), Post: the cells run and how many agree with the study on C against
    N, and each side's C count."""
    rows = []
    for depth in (1, 5):
        for norm in NORM_ORDER:
            pairs = [(cell["outcome"], study[(depth, width, norm, rate)])
                     for width in WIDTHS for rate in RATES
                     if (cell := _cell(cells, "post", depth, width, norm, rate))
                     and (depth, width, norm, rate) in study]
            if pairs:
                rows.append([str(depth), norm, str(len(pairs)),
                             str(sum((ours == "C") == (theirs == "C") for ours, theirs in pairs)),
                             str(sum(ours == "C" for ours, _ in pairs)),
                             str(sum(theirs == "C" for _, theirs in pairs)),
                             ", ".join(f"{mark} {sum(ours == mark for ours, _ in pairs)}"
                                       for mark in "DS")])
    return Table("Sentiment grid: agreement with the study",
                 ["depth", "norm", "cells run", "agree (C vs N)", "C ours", "C study",
                  "our N as D, S"], rows,
                 ["Post placement, the widths run. One seed per cell: agreement is counted, "
                  "no test is made."])


def gradient_table(cells: dict) -> Table:
    """Step-0 gradient norms per layer group, Post, width 32, from the rate 0.1 runs (the
    model at initialisation does not depend on the rate)."""
    rows = []
    for depth in (1, 5):
        for norm in NORM_ORDER:
            cell = _cell(cells, "post", depth, 32, norm, "0.1")
            record = cell and cell["run"].get("initial_gradients")
            if record:
                rows.append([str(depth), norm, f"{record['loss']:.3f}",
                             ", ".join(f"{value:.3g}" for value in record["grad_norm"].values())])
    return Table("Sentiment grid: gradient norms at initialisation",
                 ["depth", "norm", "loss at step 0", "gradient norm: embeddings, layers 0.., "
                  "classifier"], rows,
                 ["Training-mode loss and gradient norm per layer group on the first 32 training "
                  "snippets, before any update (`initial_gradients`); Post, width 32, seed 0."])


def _summary(values: list[float]) -> str:
    finite = [value for value in values if math.isfinite(value)]
    if not finite:
        return "not finite"
    text = f"{statistics.median(finite):.3g} / {max(finite):.3g}"
    return text + (f" ({len(values) - len(finite)} not finite)" if len(finite) < len(values) else "")


def landscape_table(cells: dict) -> Table:
    """The study's Lipschitz and smoothness along the update, per Post run with probes."""
    rows = []
    for depth in (1, 5):
        for width in WIDTHS:
            for norm in NORM_ORDER:
                for rate in RATES:
                    cell = _cell(cells, "post", depth, width, norm, rate)
                    if not (cell and cell["probes"]):
                        continue
                    probes = cell["probes"]
                    rows.append([str(depth), str(width), norm, rate, cell["outcome"],
                                 str(len(probes)), f"{probes[0]['lipschitz']:.3g}",
                                 _summary([row["lipschitz"] for row in probes]),
                                 f"{probes[0]['smoothness']:.3g}",
                                 _summary([row["smoothness"] for row in probes])])
    return Table("Sentiment grid: Lipschitz and smoothness along the update",
                 ["depth", "width", "norm", "lr", "outcome", "probes", "Lipschitz at update 0",
                  "Lipschitz median / max", "smoothness at update 0", "smoothness median / max"],
                 rows,
                 ["The study's quantities (docs/analysis.md#loss-landscape-along-the-update): "
                  "Lipschitz, max over eta in (0, lr] of |L(W) - L(W - eta g)|; smoothness, max of "
                  "||g - g(W - eta g)||; 8 step sizes, every 100th update's batch "
                  "(`record_landscape=100`), median and max over the run's probes."])


#: Santurkar et al. (2018)'s claim, per pair: the first norm's landscape is the smoother
SMOOTHER_PAIRS = [("bn", "nonorm"), ("ln", "nonorm"), ("bn", "ln"), ("un", "nonorm"),
                  ("rms", "nonorm"), ("dyt", "nonorm"), ("prepbn", "nonorm")]
#: their three measures along the update (docs/analysis.md#loss-landscape-along-the-update)
SMOOTHNESS = {"loss range": lambda probe: probe["loss_max"] - probe["loss_min"],
              "gradient predictiveness": lambda probe: probe["predictiveness"],
              "beta": lambda probe: probe["beta"]}
MIN_PAIRED = 6  # below it, Wilcoxon's two-sided p cannot fall under 0.05


def paired_log_ratios(cells: dict, placement: str, norm: str, reference: str, measure) -> list:
    """log(norm's / reference's) median of ``measure`` over the probes both runs of a cell
    recorded (the same updates: a run that diverged early is compared where it still ran), one
    value per cell (depth, width, rate) the two share. A non-finite median (the probes left the
    numbers) is the rougher side: its ratio is infinite; a cell where both are, or either is
    zero, is left out."""
    ratios = []
    for (place, depth, width, name, rate, uniform), cell in cells.items():
        other = _cell(cells, place, depth, width, reference, rate)
        if (place, name, uniform) != (placement, norm, None) or not other:
            continue
        steps = {probe["step"] for probe in cell["probes"]} & {
            probe["step"] for probe in other["probes"]}
        values = [statistics.median(measure(probe) for probe in run["probes"]
                                    if probe["step"] in steps) for run in (cell, other)
                  ] if steps else []
        if not values or sum(map(math.isfinite, values)) == 0 or min(values) <= 0:
            continue
        ratios.append(math.log(values[0] / values[1]) if all(map(math.isfinite, values))
                      else (math.inf if math.isfinite(values[1]) else -math.inf))
    return ratios


def signed_rank_p(ratios: list[float]) -> float:
    """Wilcoxon's two-sided signed-rank p; an infinite ratio ranks beyond every finite one."""
    finite = [abs(r) for r in ratios if math.isfinite(r)]
    beyond = 2 * max(finite, default=1.0) + 1
    return stats.wilcoxon([r if math.isfinite(r) else math.copysign(beyond, r)
                           for r in ratios]).pvalue


def smoother_table(cells: dict) -> Table:
    """Santurkar et al.'s finding (BN's landscape smoother than without it), paired over the
    grid's cells: per pair of norms and measure, the Wilcoxon signed-rank test of the log
    ratios, Holm's correction over the table's tests."""
    found = []
    for placement in ("post", "pre"):
        for norm, reference in SMOOTHER_PAIRS:
            for label, measure in SMOOTHNESS.items():
                ratios = paired_log_ratios(cells, placement, norm, reference, measure)
                if ratios:
                    p = signed_rank_p(ratios) if len(ratios) >= MIN_PAIRED else None
                    found.append((placement, norm, reference, label, ratios, p))
    tested = [row[-1] for row in found if row[-1] is not None]
    adjusted = iter(holm(tested))
    rows = []
    for placement, norm, reference, label, ratios, p in found:
        smaller = sum(ratio < 0 for ratio in ratios)
        test = "too few cells: no test" if p is None else f"p = {p:.2g}"
        if p is not None and next(adjusted) < 0.05:
            test += " **"
        rows.append([placement, f"{norm} vs {reference}", label, str(len(ratios)),
                     f"{smaller} of {len(ratios)}",
                     f"{math.exp(statistics.median(ratios)):.3g}", test])
    return Table("Sentiment grid: landscape by norm, paired over cells",
                 ["placement", "pair", "measure", "cells", "first smaller", "median ratio",
                  "Wilcoxon"],
                 rows,
                 ["Santurkar et al. (2018): with BN, the loss range along the update, the "
                  "gradient's change along it (predictiveness) and the effective "
                  "beta-smoothness are smaller than without. Each cell (depth, width, rate; "
                  "default initialisation) gives one ratio, the first norm's median over the "
                  "probes both runs recorded over the second's; median ratio below 1: the first "
                  "is the smoother; a side whose probes left the numbers (inf, nan) is the rougher. "
                  "Wilcoxon's signed-rank test of the log ratios, two-sided "
                  f"(no test under {MIN_PAIRED} cells); **: under 0.05 after Holm's correction "
                  "over the table's tests. One seed per cell."])


def init_table(cells: dict) -> Table:
    rows = []
    for depth in (1, 5):
        for norm in ("ln", "bn", "nonorm"):
            marks = []
            for uniform in ("0.1", "100", None):
                cell = cells.get(("post", depth, 32, norm, "0.1", uniform))
                acc = cell and cell["run"]["metrics"].get("val_acc")
                marks.append("–" if cell is None else
                             cell["outcome"] + (f", val {acc:.1f}%" if acc is not None else ""))
            if any(mark != "–" for mark in marks[:2]):
                rows.append([str(depth), norm, *marks])
    return Table("Sentiment grid: uniform initialisations",
                 ["depth", "norm", "U(-0.1, 0.1)", "U(-100, 100)", "default (Kaiming/Xavier)"],
                 rows,
                 ["Outcome at lr 0.1, width 32, Post; every weight and bias drawn from U(-a, a). "
                  "The study: U(-0.1, 0.1) works for all models, U(-100, 100) is destructive "
                  "for all."])


def tables(cells: dict, study: dict) -> list[Table]:
    """The results page's "Sentiment grid:" tables (those with rows) of ``read_grid``'s cells
    beside ``read_study``'s table."""
    if not cells:
        return []
    found = [convergence_table(cells, study, "post"), agreement_table(cells, study),
             convergence_table(cells, study, "pre"), gradient_table(cells),
             landscape_table(cells), smoother_table(cells), init_table(cells)]
    return [table for table in found if table.rows]


#: the runs drawn: Post, width 32, each norm of the study at these (depth, rate)
FIGURES = {"depth5_lr0.01": (5, "0.01"), "depth1_lr0.1": (1, "0.1")}


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description="The landscape along the update of the grid's "
                                                 "LN, BN and NoNorm runs at a few cells")
    parser.add_argument("--records", type=Path, default=Path("results") / GROUP)
    parser.add_argument("--out", type=Path, default=Path("results/analysis/sentiment_grid"))
    args = parser.parse_args(argv)
    cells = read_grid(args.records)
    for name, (depth, rate) in FIGURES.items():
        series = {f"{norm} ({cell['outcome']})": cell["probes"] for norm in STUDY_NORMS
                  if (cell := _cell(cells, "post", depth, 32, norm, rate)) and cell["probes"]}
        if series:
            path = plot_landscape(series, f"Sentiment grid: Post, depth {depth}, width 32, lr "
                                          f"{rate}", args.out / f"{name}.png")
            print(f"wrote {path}")


if __name__ == "__main__":
    main()
