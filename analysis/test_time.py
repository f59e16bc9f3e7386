"""The shift benchmark's tables and figure (docs/test_time.md, results/test_time.md).

Reads ``results/test_time/<run>/``: the trained run's ``result.json`` and the evaluations
``scripts/evaluate.py`` wrote beside it (``test_time/<mode>_<shift>_<stream>_b<batch>_s<seed>.json``).
A run's error under a condition is 100 - its top-1 averaged over the condition's shifts (clean:
the test split as it is; severity s: the mean over every corruption at s), so each run gives one
number per mode and stream, and a cell's n counts runs (seeds). Each mode is tested against
``source`` (the model as trained) on the same stream and against LN's ``source`` by Welch's
t-test, with Holm's correction over each table's comparisons.
"""
from __future__ import annotations

import json
import statistics
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import numpy as np
from matplotlib.figure import Figure

from analysis.plots import save_figure
from analysis.significance import Comparisons, with_tests
from analysis.tables import Table

MODES = ("source", "tbn", "alpha", "ema", "unmix")
STREAMS = ("iid", "sorted", "dirichlet")
MODELS = {"swin_t": "Swin-T", "t2t_vit_14": "T2T-ViT-14"}
NORM_NAMES = {"ln": "LN", "bn": "BN", "mabn": "MABN", "pn": "PN", "un": "UN", "prepbn": "PRepBN",
              "bcn": "BCN", "evonorm_b0": "EvoNorm-B0"}
CONDITIONS = {"clean": 0, "severity 3": 3, "severity 5": 5}  # 0: the clean split
BATCH = 64  # the grid's test batch (reproduce_cpu.sh evaluate_shift)
FIGURE = "test_time.png"


@dataclass
class Run:
    """One trained run of the benchmark and its evaluations, keyed by
    ``(mode, corruption, severity, stream)`` at the grid's batch and the run's seed 0 stream."""

    name: str
    model: str
    norm: str
    seed: int
    status: str
    top1: dict

    def error(self, mode: str, stream: str, severity: int, corruptions: list[str]) -> Optional[float]:
        """100 - the mean top-1 over the condition's shifts; None unless every one is recorded.
        ``source`` reads no stream: its i.i.d. evaluation serves every stream."""
        stream = "iid" if mode == "source" else stream
        shifts = [("none", 0)] if severity == 0 else [(c, severity) for c in corruptions]
        scores = [self.top1.get((mode, c, s, stream)) for c, s in shifts]
        return None if None in scores else 100 - statistics.mean(scores)


def load(root: Path) -> list[Run]:
    """Every benchmark run under ``root`` with its evaluations at the grid's batch and stream
    seed 0; a repeated evaluation (``.2.json``) is the same setting again and is not counted."""
    runs = []
    for result in sorted(Path(root).glob("*/result.json")):
        record = json.loads(result.read_text())
        top1 = {}
        for path in sorted((result.parent / "test_time").glob("*_b*_s*.json")):
            if path.suffixes[-2:-1] and path.suffixes[-2][1:].isdigit():
                continue  # stem.2.json: a repeat
            evaluation = json.loads(path.read_text())
            if evaluation["batch"] != BATCH or evaluation["seed"] != 0:
                continue
            key = (evaluation["test_time"], evaluation["corruption"], evaluation["severity"],
                   evaluation["stream"])
            top1[key] = evaluation["top1"]
        runs.append(Run(result.parent.name, record["model"], record["norm"], record["seed"],
                        record["status"], top1))
    return runs


def corruptions_of(runs: list[Run]) -> list[str]:
    """The corruptions the records hold (every run is checked against all of them)."""
    return sorted({c for run in runs for (_, c, _, _) in run.top1 if c != "none"})


def _errors(runs, model, norm, mode, stream, severity, corruptions) -> tuple[list[float], int, int]:
    """The learned runs' errors, and the counts of runs at chance or collapsed and of runs
    whose evaluations are incomplete."""
    cell = [r for r in runs if r.model == model and r.norm == norm]
    learned = [r for r in cell if r.status == "ok"]
    errors = [r.error(mode, stream, severity, corruptions) for r in learned]
    return [e for e in errors if e is not None], len(cell) - len(learned), errors.count(None)


def _summary(values: list[float], not_learned: int, incomplete: int) -> str:
    if not values:
        return "—"
    spread = f" ± {statistics.stdev(values):.1f}" if len(values) > 1 else ""
    parts = [f"{statistics.mean(values):.1f}{spread} (n={len(values)})"]
    if not_learned:
        parts.append(f"chance or FAIL {not_learned}")
    if incomplete:
        parts.append(f"incomplete {incomplete}")
    return "; ".join(parts)


def tables(runs: list[Run]) -> list[Table]:
    """Per model and condition: the error of every mode (against source), then every mode
    against LN's source error."""
    corruptions = corruptions_of(runs)
    out = []
    for model, model_name in MODELS.items():
        norms = [n for n in NORM_NAMES if any(r.model == model and r.norm == n for r in runs)]
        if "ln" not in norms:
            continue
        for condition, severity in CONDITIONS.items():
            what = ("the clean test split" if severity == 0 else
                    f"the {len(corruptions)} corruptions at severity {severity}, averaged")
            ln, ln_out, ln_incomplete = _errors(runs, model, "ln", "source", "iid", severity, corruptions)
            own, against_ln = Comparisons(), Comparisons()
            rows, rows_ln = [], []
            for norm in norms:
                for stream in (("any",) if norm == "ln" else STREAMS):
                    source = _errors(runs, model, norm, "source", "iid", severity, corruptions)
                    row = [NORM_NAMES[norm], stream, _summary(*source)]
                    row_ln = [NORM_NAMES[norm], stream,
                              ("—" if norm == "ln" else ("", against_ln.add(source[0], ln)))]
                    for mode in MODES[1:]:
                        if norm == "ln":
                            row.append("—")
                            row_ln.append("—")
                            continue
                        values = _errors(runs, model, norm, mode, stream, severity, corruptions)
                        row.append((_summary(*values), own.add(values[0], source[0])))
                        row_ln.append(("", against_ln.add(values[0], ln)))
                    rows.append(row)
                    rows_ln.append(row_ln)
            header = ["norm", "stream", *MODES]
            title = f"Test-time normalization, {model_name}, {condition}"
            out.append(Table(
                f"{title}: top-1 error (%)", header, with_tests(rows, own, "; vs source "),
                [f"Error: 100 - top-1, on {what}, per run, then mean ± std over runs (n = seeds), "
                 f"test batch {BATCH}. `source` is the model as trained (its evaluation reads no "
                 "stream); each mode's difference and p are against `source` on the same "
                 "stream. LN keeps no statistic: only `source`.", own.note()]))
            out.append(Table(
                f"{title}: against LN", header, with_tests(rows_ln, against_ln),
                [f"Each cell: the row's error ({what}) minus LN's `source` error, "
                 f"{_summary(ln, ln_out, ln_incomplete)}; negative is better than LN.",
                 against_ln.note()]))
        out.append(per_corruption(runs, model, norms, corruptions))
    return out


def per_corruption(runs: list[Run], model: str, norms: list[str], corruptions: list[str],
                   severity: int = 5) -> Table:
    """The models as trained (``source``), error per corruption: which shifts hurt."""
    rows = []
    for norm in norms:
        row = [NORM_NAMES[norm], _summary(*_errors(runs, model, norm, "source", "iid", 0, corruptions))]
        row += [_summary(*_errors(runs, model, norm, "source", "iid", severity, [c])) for c in corruptions]
        rows.append(row)
    return Table(f"Test-time normalization, {MODELS[model]}, each corruption at severity {severity}: "
                 "source error (%)", ["norm", "clean", *corruptions], rows,
                 ["Error: 100 - top-1 of the model as trained, mean ± std over runs (n = seeds); "
                  "no test in this table."])


def figure(runs: list[Run], path: Path, severity: int = 5) -> Optional[Path]:
    """Error at ``severity`` per norm and mode, one panel per model and stream, LN's source
    error as a line; bars are means over seeds with their std."""
    corruptions = corruptions_of(runs)
    models = [m for m in MODELS if any(r.model == m for r in runs)]
    if not models or not corruptions:
        return None
    fig = Figure(figsize=(13, 3.2 * len(models)), layout="constrained")
    axes = fig.subplots(len(models), len(STREAMS), squeeze=False, sharey=True)
    width = 0.8 / len(MODES)
    colours = dict(zip(MODES, ("black", "tab:blue", "tab:orange", "tab:green", "tab:red")))
    for row, model in enumerate(models):
        norms = [n for n in NORM_NAMES if n != "ln" and any(r.model == model and r.norm == n for r in runs)]
        ln, _, _ = _errors(runs, model, "ln", "source", "iid", severity, corruptions)
        for column, stream in enumerate(STREAMS):
            ax = axes[row, column]
            for k, mode in enumerate(MODES):
                cells = [_errors(runs, model, n, mode, stream, severity, corruptions)[0] for n in norms]
                x = np.arange(len(norms)) + (k - (len(MODES) - 1) / 2) * width
                means = [statistics.mean(c) if c else np.nan for c in cells]
                spreads = [statistics.stdev(c) if len(c) > 1 else 0 for c in cells]
                ax.bar(x, means, width, yerr=spreads, color=colours[mode], label=mode,
                       error_kw={"linewidth": 0.8})
            if ln:
                ax.axhline(statistics.mean(ln), color="tab:purple", linestyle="--", linewidth=1,
                           label="LN (source)")
            ax.set_xticks(np.arange(len(norms)), [NORM_NAMES[n] for n in norms], fontsize=8)
            ax.set_title(f"{MODELS[model]}, {stream} stream", fontsize=9)
            if column == 0:
                ax.set_ylabel(f"top-1 error (%), severity {severity}", fontsize=8)
            ax.tick_params(labelsize=8)
    axes[0, 0].legend(fontsize=7, ncol=2)
    fig.suptitle(f"Test-time normalization on the digits: error at severity {severity}, mean "
                 f"over {len(corruptions)} corruptions; bars: mean ± std over seeds", fontsize=10)
    return save_figure(fig, path)
