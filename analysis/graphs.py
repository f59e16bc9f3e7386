"""The graph task's tables (results/graphs.md, written by ``scripts/make_tables.py`` through
``analysis.pages``) from its records, a study kept apart in results/graph/<run>/result.json:
per dataset, each norm's test score (mean ± std over the seeds that learned, chance runs
counted) and its difference from BN (the release's choice) and from LN, with Welch's p and
Holm's correction over the table's comparisons."""
from __future__ import annotations

import json
from pathlib import Path

from analysis.significance import Cell, Comparisons, with_tests
from analysis.tables import Table

#: the datasets as the tables name them, and their test metric
DATA = {"sbm_pattern": ("PATTERN (generated, CPU scale)", "test_acc"),
        "sbm_cluster": ("CLUSTER (generated, CPU scale)", "test_acc"),
        "freesolv": ("FreeSolv", "test_mae")}
NORMS = {"bn": "BN", "ln": "LN", "un": "UN", "mabn": "MABN", "pn": "PN", "prepbn": "PRepBN",
         "dyt": "DyT", "rms": "RMS", "graphnorm": "GraphNorm", "granola": "GRANOLA"}
BASELINES = ("bn", "ln")


def load(records: Path) -> list[dict]:
    """The Graph Transformer's run records under ``records``."""
    runs = [json.loads(path.read_text()) for path in sorted(records.glob("*/result.json"))]
    return [run for run in runs if run.get("model") == "graph_transformer"]


def tables(runs: list[dict]) -> list[Table]:
    """One table per dataset with records: a row per norm, its score and its difference from
    each baseline (BN's row left empty: LN's holds BN against LN)."""
    out = []
    for data, (name, metric) in DATA.items():
        cells = {norm: Cell([r for r in runs if r["data"] == data and r["norm"] == norm])
                 for norm in NORMS}
        if not any(cell.runs for cell in cells.values()):
            continue
        tests = Comparisons()
        rows = []
        for norm, label in NORMS.items():
            cell = cells[norm]
            if not cell.runs:
                continue
            row = [label, cell.text(metric)]
            for baseline in BASELINES:  # BN against LN once, in LN's row
                row.append("" if norm in BASELINES[:BASELINES.index(baseline) + 1] else
                           ("", tests.add(cell.values(metric), cells[baseline].values(metric), metric)))
            rows.append(row)
        what = ("test MAE, kcal/mol (lower is better)" if metric == "test_mae" else
                "test accuracy, class-balanced (%)")
        chance = next(r["chance"]["rule"] for r in runs if r["data"] == data)
        out.append(Table(
            f"Graphs: {name}: {what}", ["norm", "test (n = seeds that learned)", "− BN", "− LN"],
            with_tests(rows, tests),
            [f"† The Graph Transformer at scale=cpu (docs/graphs.md), the score at the last "
             f"epoch. Chance: {chance}; such runs are counted ('chance k/n'), not averaged. "
             "Records: results/graph (bash scripts/reproduce_cpu.sh graph).",
             tests.note()]))
    return out
