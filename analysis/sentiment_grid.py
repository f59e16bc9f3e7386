"""The course study's convergence grid (docs/text_classification.md#the-study-s-grid) from the
grid's records, beside the study's own table (``results/paper/course_study.yaml``):
``results/text_classification.md``.

Each run is C, S or D by the rule fixed before the runs (``outcome``); the study reports C or N,
and our S and D both count as N. One seed per cell: the page counts agreement, and claims no
difference between norms (a test would need seeds).
"""
from __future__ import annotations

import argparse
import json
import math
import re
from collections import defaultdict
from pathlib import Path

import yaml

from analysis.runs import load_runs

RECORDS = Path("results/sentiment_grid")
STUDY = Path("results/paper/course_study.yaml")
PAGE = Path("results/text_classification.md")
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
    """C: ended (ok or chance), finite losses, the last interval's training loss <= 0.9 H; D:
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
        cells[key] = {"outcome": outcome(run, epochs, entropy), "run": run}
    return cells


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


def grid_table(cells: dict, study: dict, placement: str) -> tuple[list[str], dict]:
    """The markdown rows of one placement: ours (the study's) per rate, and agreement counts."""
    agree = defaultdict(lambda: [0, 0])
    rows = ["| depth | width | norm | " + " | ".join(f"lr {r}" for r in RATES) + " |",
            "|---|---|---|" + "---|" * len(RATES)]
    for depth in (1, 5):
        for width, label in WIDTHS.items():
            for norm in NORM_ORDER:
                marks, seen = [], False
                for rate in RATES:
                    cell = cells.get((placement, depth, width, norm, rate, None))
                    theirs = study.get((depth, width, norm, rate)) if placement == "post" else None
                    ours = cell["outcome"] if cell else "–"
                    seen |= cell is not None
                    marks.append(ours + (f" ({theirs})" if theirs else ""))
                    if cell and theirs:
                        agree[norm][1] += 1
                        agree[norm][0] += (ours == "C") == (theirs == "C")
                if seen:
                    rows.append(f"| {depth} | {width} ({label}) | {norm} | " + " | ".join(marks) + " |")
    return rows, agree


def gradient_rows(cells: dict) -> list[str]:
    """Step-0 gradient norms per layer group, Post, width 32, the rate 0.1 runs (the model at
    initialisation does not depend on the rate)."""
    rows = ["| depth | norm | loss at step 0 | gradient norm: embeddings, layers 0.., classifier |",
            "|---|---|---|---|"]
    for depth in (1, 5):
        for norm in NORM_ORDER:
            cell = cells.get(("post", depth, 32, norm, "0.1", None))
            record = cell and cell["run"].get("initial_gradients")
            if record:
                norms = ", ".join(f"{v:.3g}" for v in record["grad_norm"].values())
                rows.append(f"| {depth} | {norm} | {record['loss']:.3f} | {norms} |")
    return rows


def init_rows(cells: dict) -> list[str]:
    rows = ["| depth | norm | U(-0.1, 0.1) | U(-100, 100) | default (Kaiming/Xavier) |", "|---|---|---|---|---|"]
    for depth in (1, 5):
        for norm in ("ln", "bn", "nonorm"):
            marks = []
            for uniform in ("0.1", "100", None):
                cell = cells.get(("post", depth, 32, norm, "0.1", uniform))
                if cell is None:
                    marks.append("–")
                else:
                    acc = cell["run"]["metrics"].get("val_acc")
                    marks.append(cell["outcome"] + (f", val {acc:.1f}%" if acc is not None else ""))
            rows.append(f"| {depth} | {norm} | " + " | ".join(marks) + " |")
    return rows


def page(cells: dict, study: dict) -> str:
    post, agree = grid_table(cells, study_table(study), "post")
    counts = "; ".join(f"{norm} {a} of {n}" for norm, (a, n) in agree.items())
    runs = len(cells)
    lines = [
        "# Text classification: the course study's convergence grid",
        "",
        "Outcome per learning rate (plain SGD, no warm-up, 200 updates of 32 snippets), ours and "
        "in brackets the study's, at Post placement. C: converged, the last 100 updates' mean "
        f"training loss at most 0.9 H = {0.9 * label_entropy():.4f} nats (H: the training "
        "labels' entropy, the best text-blind loss); D: diverged (collapsed, non-finite, or rising "
        "the first interval's); S: slow (neither). The study's N is our D or S. The rule was fixed before the runs "
        "([docs](../docs/text_classification.md#the-rule-for-converged-fixed-before-the-runs)). "
        f"One seed per cell, n = {runs} runs recorded; – not run yet.",
        "",
        *post,
        "",
        f"Cells where ours and the study's agree on C against N (Post, per norm, of the cells run): "
        f"{counts or 'none run'}. One seed each, so no test: agreement is counted, not claimed.",
        "",
    ]
    pre, _ = grid_table(cells, {}, "pre")
    if len(pre) > 2:
        lines += ["## Pre placement", "", *pre, ""]
    grads = gradient_rows(cells)
    if len(grads) > 2:
        lines += ["## Gradient norms at initialisation", "",
                  "Training-mode loss and gradient norm per layer group on the first 32 training "
                  "snippets, before any update (`initial_gradients`); one initialisation each "
                  "(seed 0).", "", *grads, ""]
    inits = init_rows(cells)
    if any("–" not in row for row in inits[2:]):
        lines += ["## Uniform initialisations", "",
                  "Outcome at lr 0.1, width 32, Post; every weight and bias drawn from U(-a, a). "
                  "The study: U(-0.1, 0.1) works for all models, U(-100, 100) is destructive "
                  "for all.", "", *inits, ""]
    return "\n".join(lines)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--records", type=Path, default=RECORDS)
    parser.add_argument("--study", type=Path, default=STUDY)
    parser.add_argument("--out", type=Path, default=PAGE)
    args = parser.parse_args(argv)
    study = yaml.safe_load(args.study.read_text())
    args.out.write_text(page(read_grid(args.records), study))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
