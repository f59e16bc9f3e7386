"""The graph task's table (results/graphs.md) from its records (results/graph/<run>/result.json):
per dataset and norm, the test score's mean and standard deviation over the seeds that
learned, and each norm against BN (the release's choice) and LN with the difference of means
and Welch's p. ``python -m analysis.graphs`` rewrites the page's table."""
from __future__ import annotations

import json
import statistics
from collections import defaultdict
from pathlib import Path

from analysis.significance import welch_p

ROOT = Path(__file__).resolve().parents[1]
RECORDS = ROOT / "results" / "graph"
PAGE = ROOT / "results" / "graphs.md"
DATA = {"sbm_cluster": "CLUSTER (generated, CPU scale)", "sbm_pattern": "PATTERN (generated, CPU scale)",
        "freesolv": "FreeSolv"}
ORDER = ["bn", "ln", "un", "mabn", "pn", "prepbn", "dyt", "rms", "graphnorm", "granola"]
BEGIN, END = "<!-- table: analysis/graphs.py -->", "<!-- end table -->"


def load(records: Path = RECORDS) -> dict[tuple[str, str], list[dict]]:
    """``{(data, norm): [result, ...]}`` of the Graph Transformer's runs."""
    runs = defaultdict(list)
    for path in sorted(records.glob("*/result.json")):
        result = json.loads(path.read_text())
        if result.get("model") == "graph_transformer":
            runs[(result["data"], result["norm"])].append(result)
    return runs


def _metric(data: str) -> tuple[str, bool]:
    """The test metric and whether lower is better."""
    return ("test_mae", True) if data == "freesolv" else ("test_acc", False)


def _comparison(values: list[float], baseline: list[float]) -> str:
    if len(values) < 2 or len(baseline) < 2:
        return "—"
    difference = statistics.mean(values) - statistics.mean(baseline)
    return f"{difference:+.2f} (p = {welch_p(values, baseline):.2g})"


def table(runs: dict[tuple[str, str], list[dict]]) -> str:
    lines = ["| data | metric | norm | test mean ± std | n (learned/runs) | − BN (Welch p) | − LN (Welch p) |",
             "|---|---|---|---|---|---|---|"]
    for data, name in DATA.items():
        metric, lower = _metric(data)
        scores = {norm: [r["metrics"][metric] for r in runs.get((data, norm), [])
                         if r["status"] == "ok"] for norm in ORDER}
        for norm in ORDER:
            done = runs.get((data, norm), [])
            if not done:
                continue
            values = scores[norm]
            cell = (f"{statistics.mean(values):.2f} ± {statistics.stdev(values):.2f}"
                    if len(values) > 1 else f"{values[0]:.2f}" if values else "—")
            lines.append(f"| {name} | {metric.removeprefix('test_')}{' (lower is better)' if lower else ' %'} "
                         f"| {norm} | {cell} | {len(values)}/{len(done)} "
                         f"| {'' if norm == 'bn' else _comparison(values, scores['bn'])} "
                         f"| {'' if norm == 'ln' else _comparison(values, scores['ln'])} |")
    return "\n".join(lines)


def main() -> None:
    text = PAGE.read_text()
    head, rest = text.split(BEGIN)
    _, tail = rest.split(END)
    PAGE.write_text(f"{head}{BEGIN}\n{table(load())}\n{END}{tail}")


if __name__ == "__main__":
    main()
