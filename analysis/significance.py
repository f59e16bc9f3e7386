"""Significance of a table's cells: our runs of a cell summarised (mean +- std over the runs
that learned, chance and FAIL counts), Welch's t-test of each cell against its baseline, and
Holm's correction over a table's comparisons. Reads run records only."""
from __future__ import annotations

import statistics
from dataclasses import dataclass, field
from typing import Callable, Optional

from scipy import stats

from analysis.runs import broken_metric, superseded_warmup


@dataclass
class Cell:
    """Our runs of one table cell, summarised."""

    runs: list = field(default_factory=list)

    def learned(self) -> list[dict]:
        """The runs that learned (status ``ok``: not collapsed, not at chance)."""
        return [r for r in self.runs if r["status"] == "ok"]

    def values(self, metric: str) -> list[float]:
        """The metric of every run that learned and records it as a number; ``undefined``
        and ``broken`` hold the others."""
        return [r["metrics"][metric] for r in self.learned()
                if not broken_metric(r, metric) and r["metrics"].get(metric) is not None]

    def undefined(self, metric: str) -> list[dict]:
        """The runs that learned for which ``metric`` is not defined (``broken_metric``)."""
        return [r for r in self.learned()
                if not broken_metric(r, metric) and r["metrics"].get(metric) is None]

    def broken(self, metric: str) -> list[dict]:
        """The runs that learned whose record gives no number for ``metric`` though one is
        expected (``broken_metric``)."""
        return [r for r in self.learned() if broken_metric(r, metric)]

    def text(self, metric: str) -> str:
        if not self.runs:
            return "—"
        ok = self.values(metric)
        digits = DIGITS.get(metric, 1)
        chance = [r for r in self.runs if r["status"] == "chance"]
        failed = [r for r in self.runs if r["status"] == "FAIL"]
        dagger = "†" if any(r.get("scale", "full") != "full" for r in self.runs) else ""
        dagger += "‡" if any(superseded_warmup(r) for r in self.runs) else ""
        parts = []
        if ok:
            spread = f" ± {statistics.stdev(ok):.{digits}f}" if len(ok) > 1 else ""
            parts.append(f"{statistics.mean(ok):.{digits}f}{spread} (n={len(ok)})")
        for name, runs in (("not defined", self.undefined(metric)), ("broken", self.broken(metric))):
            if runs:
                parts.append(f"{name} {len(runs)}/{len(self.runs)}")
        if chance:
            parts.append(f"chance {len(chance)}/{len(self.runs)}")
        if failed:
            steps = ", ".join(str(r["fail_step"]) for r in failed)
            parts.append(f"FAIL {len(failed)}/{len(self.runs)} (step {steps})")
        return "; ".join(parts) + dagger if parts else "—"


#: the notes of a table whose cells count runs without a number (``Cell.text``)
CELL_NOTES = {"not defined": "'not defined k/n': k runs that learned have no such number by design "
                             "(recorded null; COCO evaluation leaves out an area range without "
                             "ground truth, e.g. APl on data without large objects).",
              "broken": "'broken k/n': k runs that learned have a record that gives no number "
                        "for the metric (missing or not a number), each named by make_tables.py."}


def welch_p(values: list[float], baseline: list[float]) -> float:
    """Welch's t-test from the two sides' exact means and standard deviations (``statistics``
    sums exactly: a side of equal values, such as BLEU 100 in every seed, has a spread of
    exactly 0, where scipy's moments of the raw values lose precision and warn)."""
    return float(stats.ttest_ind_from_stats(
        statistics.mean(values), statistics.stdev(values), len(values),
        statistics.mean(baseline), statistics.stdev(baseline), len(baseline),
        equal_var=False).pvalue)


DIGITS = {"val_loss": 3, "test_mae": 2}  # decimals shown; others 1
SIGNIFICANCE_NOTE = ("{n} in this table: the difference of means and Welch's p "
                     "against the row's or column's baseline; * p < 0.05, ** also after Holm's "
                     "correction over the table's comparisons. Means and tests take the runs that "
                     "learned; 'chance k/n' runs finished no better than chance, FAIL runs "
                     "collapsed.")
#: what a difference printed without p means, by the reason there is no test
UNTESTED_NOTES = {"n": "A difference without p ('n=1 vs 3: no test'): the difference of means, "
                       "where a side has a single run that learned, too few for Welch's test.",
                  "spread": "'no spread: no test': every run on both sides ended alike."}


def holm(pvalues: list[float]) -> list[float]:
    """Holm's step-down adjustment: the family-wise error stays under the level over all tests."""
    order = sorted(range(len(pvalues)), key=lambda i: pvalues[i])
    adjusted, running = [0.0] * len(pvalues), 0.0
    for rank, index in enumerate(order):
        running = max(running, min(1.0, (len(pvalues) - rank) * pvalues[index]))
        adjusted[index] = running
    return adjusted


class Comparisons:
    """A table's tests against its baselines: ``add`` one (Welch's t-test on the two sides'
    runs) and get a placeholder; ``texts()`` fills them in with each difference, p, and the
    marks of Holm's correction over every test of the table."""

    def __init__(self, digits: int = 1):
        self.digits, self.tests = digits, []

    def add(self, values: list[float], baseline: list[float], metric: Optional[str] = None) -> int:
        """Test ``values`` against ``baseline``; ``metric`` sets the decimals shown (DIGITS)."""
        self.tests.append((values, baseline, self.digits if metric is None else DIGITS.get(metric, 1)))
        return len(self.tests) - 1

    def results(self) -> list[Optional[tuple[float, Optional[float]]]]:
        """Per test: ``(difference, p)``; p None without spread; None with fewer than two
        runs on a side."""
        out = []
        for values, baseline, _ in self.tests:
            if len(values) < 2 or len(baseline) < 2:
                out.append(None)
                continue
            difference = statistics.mean(values) - statistics.mean(baseline)
            flat = statistics.pstdev(values) == statistics.pstdev(baseline) == 0
            out.append((difference, None if flat else welch_p(values, baseline)))
        return out

    @property
    def count(self) -> int:
        return sum(1 for result in self.results() if result is not None and result[1] is not None)

    def untested(self) -> set[str]:
        """Why some differences have no test: ``n`` (a side with one run), ``spread``."""
        return {"n" if result is None else "spread"
                for (values, baseline, _), result in zip(self.tests, self.results())
                if values and baseline and (result is None or result[1] is None)}

    def texts(self) -> list[str]:
        """Each test's text: the difference of means wherever both sides have a run, with
        Welch's p and its marks where both have two."""
        results = self.results()
        tested = [i for i, r in enumerate(results) if r is not None and r[1] is not None]
        adjusted = dict(zip(tested, holm([results[i][1] for i in tested])))
        texts = []
        for index, result in enumerate(results):
            values, baseline, digits = self.tests[index]
            if not values or not baseline:
                texts.append("—")
                continue
            if result is None:
                difference = statistics.mean(values) - statistics.mean(baseline)
                texts.append(f"{difference:+.{digits}f} (n={len(values)} vs {len(baseline)}: no test)")
                continue
            difference, p = result
            if p is None:
                texts.append(f"{difference:+.{digits}f} (no spread: no test)")
                continue
            mark = "**" if adjusted[index] < 0.05 else "*" if p < 0.05 else ""
            texts.append(f"{difference:+.{digits}f} (p={p:.2g}){mark}")
        return texts

    def note(self) -> str:
        """The table's note on its tests and on its differences without one ("" without any)."""
        count = self.count
        notes = [SIGNIFICANCE_NOTE.format(n=f"{count} comparison{'s' if count > 1 else ''}")] if count else []
        untested = self.untested()
        return " ".join(notes + [text for why, text in UNTESTED_NOTES.items() if why in untested])


def with_tests(rows: list[list], comparisons: Comparisons, prefix: str = "") -> list[list[str]]:
    """``rows`` with every ``Comparisons.add`` placeholder (a ``(text, index)`` pair) replaced
    by ``text``, ``prefix`` (where there is a text) and the test's result."""
    texts = comparisons.texts()
    return [[cell if isinstance(cell, str) else
             (cell[0] or "—" if texts[cell[1]] == "—" else
              f"{cell[0]}{prefix if cell[0] else ''}{texts[cell[1]]}")
             for cell in row] for row in rows]


def select(runs: list[dict], **where: Callable[[dict], bool]) -> Cell:
    return Cell([r for r in runs if all(test(r) for test in where.values())])
