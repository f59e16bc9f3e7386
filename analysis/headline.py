"""The headline: UN against LN on each testbed, from the run records.

One row per testbed (the metric, LN's and UN's cells, UN - LN with its 95% Welch interval,
n, Holm's p over the testbeds, the verdict, the best other norm), the sentence that says it,
and a forest plot of the differences. ``scripts/make_tables.py`` writes them beside the
tables and into the README's Results section. Reads run records and the paper's numbers only.
"""
from __future__ import annotations

import statistics
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from matplotlib.figure import Figure
from scipy import stats

from analysis.claims import group_runs
from analysis.plots import save_figure
from analysis.runs import LOWER_IS_BETTER, STABILITY_KEY, override_value, setting, where
from analysis.significance import DIGITS, Cell, holm

LEVEL = 0.05


@dataclass(frozen=True)
class Testbed:
    name: str
    topic: str  # the testbed in a sentence
    data: str  # what ran: the project's small data, not the paper's
    model: str  # the records' model (``analysis.runs.where``)
    metric: str
    unit: str
    prefix: str = ""  # the settings' placement prefix ("Pre-" in the language model)
    paper: Optional[tuple] = None  # (table, *keys) of the paper's LN and UN numbers
    paper_data: str = ""


TESTBEDS = (
    Testbed("Swin-T", "Swin-T", "digits", "swin_t", "top1", "top-1 %",
            paper=("table2_cls_top1", "swin_t_imagenet"), paper_data="ImageNet"),
    Testbed("T2T-ViT-14", "T2T-ViT", "digits", "t2t_vit_14", "top1", "top-1 %",
            paper=("table2_cls_top1", "t2t_vit_14_imagenet"), paper_data="ImageNet"),
    Testbed("Mask R-CNN Swin-T", "detection", "generated shapes", "mask_rcnn_swin_t", "bbox_AP",
            "box AP", paper=("table4_mask_rcnn_swin_t_coco_3x", "box", "AP"), paper_data="COCO"),
    Testbed("Transformer, IWSLT14 recipe", "translation", "synthetic corpus",
            "transformer_iwslt_de_en", "bleu", "BLEU", paper=("table1_nmt_bleu", "iwslt14"),
            paper_data="IWSLT14"),
    Testbed("Llama 0.6M, Pre-norm", "language modelling", "transformers' sources", "llama_cpu",
            "val_loss", "val. loss, nats", prefix="Pre-"),
)


@dataclass
class Row:
    testbed: Testbed
    ln: Cell
    un: Cell
    difference: float
    interval: tuple[float, float]
    p: float
    p_holm: float = 1.0
    rival: Optional[tuple[str, Cell, float, float]] = None  # name, cell, difference, p
    paper: Optional[tuple] = None  # the paper's (LN, UN)

    @property
    def lower_is_better(self) -> bool:
        return self.testbed.metric in LOWER_IS_BETTER

    @property
    def verdict(self) -> str:
        if self.p_holm >= LEVEL:
            return "inconclusive"
        better = (self.difference < 0) == self.lower_is_better
        return "UN above LN" if better else "UN below LN"


def _plain_settings(runs: list[dict], testbed: Testbed) -> list[str]:
    """The testbed's norms at the recipe: settings with no override, at 1x."""
    return sorted({setting(r) for r in runs if where(r)[1] == testbed.model
                   and r.get("scale", "full") != "full" and override_value(r, STABILITY_KEY) is None
                   and " " not in setting(r) and setting(r).startswith(testbed.prefix)})


def _welch(x: list[float], y: list[float]) -> tuple[float, tuple[float, float], float]:
    """Difference of means, its 95% Welch interval, and Welch's p."""
    test = stats.ttest_ind(x, y, equal_var=False)
    interval = test.confidence_interval(1 - LEVEL)
    return (statistics.mean(x) - statistics.mean(y), (float(interval.low), float(interval.high)),
            float(test.pvalue))


def _paper(paper: dict, testbed: Testbed) -> Optional[tuple]:
    if not testbed.paper:
        return None
    table, *keys = testbed.paper
    out = []
    for method in ("LN", "UN"):
        value = paper[table][method]
        for key in keys:
            value = value[key]
        out.append(value)
    return tuple(out)


def _rival(runs: list[dict], testbed: Testbed, ln: Cell) -> Optional[tuple]:
    """The best norm other than LN and UN among those whose every run learned (a norm that
    failed in a seed is not the best), with its difference from LN and Welch's p."""
    best = None
    for label in _plain_settings(runs, testbed):
        if label in (f"{testbed.prefix}LN", f"{testbed.prefix}UN"):
            continue
        cell = group_runs(runs, f"{testbed.model}:{label}")
        values = cell.values(testbed.metric)
        if len(values) < 2 or len(values) != len(cell.runs):
            continue
        mean = statistics.mean(values)
        score = -mean if testbed.metric in LOWER_IS_BETTER else mean
        if best is None or score > best[0]:
            difference, _, p = _welch(values, ln.values(testbed.metric))
            best = (score, label[len(testbed.prefix):], cell, difference, p)
    return best[1:] if best else None


def headline_rows(runs: list[dict], paper: dict) -> list[Row]:
    """UN against LN on every testbed with at least two learned runs a side; Holm's correction
    over those testbeds."""
    rows = []
    for testbed in TESTBEDS:
        ln = group_runs(runs, f"{testbed.model}:{testbed.prefix}LN")
        un = group_runs(runs, f"{testbed.model}:{testbed.prefix}UN")
        x, y = un.values(testbed.metric), ln.values(testbed.metric)
        if len(x) < 2 or len(y) < 2:
            continue
        difference, interval, p = _welch(x, y)
        rows.append(Row(testbed, ln, un, difference, interval, p,
                        rival=_rival(runs, testbed, ln), paper=_paper(paper, testbed)))
    for row, adjusted in zip(rows, holm([row.p for row in rows])):
        row.p_holm = adjusted
    return rows


def _p(p: float) -> str:
    return "< 1e-4" if p < 1e-4 else f"{p:.2g}"


def _cell(cell: Cell, metric: str) -> str:
    values = cell.values(metric)
    digits = DIGITS.get(metric, 1)
    text = f"{statistics.mean(values):.{digits}f} ± {statistics.stdev(values):.{digits}f}"
    apart = [f"{sum(r['status'] == status for r in cell.runs)} of {len(cell.runs)} {word}"
             for status, word in (("chance", "at chance"), ("FAIL", "FAIL"))
             if any(r["status"] == status for r in cell.runs)]
    return text + (f" ({', '.join(apart)})" if apart else "")


def _join(names: list[str]) -> str:
    return names[0] if len(names) == 1 else ", ".join(names[:-1]) + " and " + names[-1]


def finding(rows: list[Row]) -> str:
    """The project's finding in one sentence, from the verdicts."""
    by_verdict: dict[str, list[str]] = {}
    for row in rows:
        by_verdict.setdefault(row.verdict, []).append(row.testbed.topic)
    words = {"UN below LN": "below LN", "UN above LN": "above LN",
             "inconclusive": "inconclusive against LN"}
    parts = [f"{words[verdict]} on {_join(by_verdict[verdict])}" for verdict in words
             if verdict in by_verdict]
    return (f"On this project's {len(rows)} CPU testbeds, after Holm's correction over them, UN is "
            + "; ".join(parts) + ".")


def to_markdown(rows: list[Row], figure: str) -> str:
    """The table and its caption; ``figure``: the forest plot's path from the page."""
    header = ["testbed (data that ran)", "metric", "LN", "UN", "UN − LN [95% CI]", "n (UN vs LN)",
              "Holm p", "verdict", "best other norm (− LN, p)", "paper: LN, UN"]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for row in rows:
        testbed, digits = row.testbed, DIGITS.get(row.testbed.metric, 2)
        n = f"{len(row.un.values(testbed.metric))} vs {len(row.ln.values(testbed.metric))}"
        rival = "—"
        if row.rival:
            name, cell, difference, p = row.rival
            rival = f"{name} {_cell(cell, testbed.metric)} ({difference:+.{digits}f}, p = {_p(p)})"
        paper = (f"{row.paper[0]}, {row.paper[1]} ({testbed.paper_data})" if row.paper
                 else "not in the paper")
        low, high = row.interval
        lines.append("| " + " | ".join([
            f"{testbed.name} ({testbed.data})", testbed.unit + (", lower is better"
                                                                if row.lower_is_better else ""),
            _cell(row.ln, testbed.metric), _cell(row.un, testbed.metric),
            f"{row.difference:+.{digits}f} [{low:+.{digits}f}, {high:+.{digits}f}]", n,
            _p(row.p_holm), row.verdict, rival, paper]) + " |")
    lines += ["", f"Means ± std over the seeds that learned (runs at chance or FAIL counted apart); "
              f"UN − LN with its 95% Welch interval; Holm p: Welch's p adjusted by Holm over the "
              f"{len(rows)} testbeds; a verdict needs Holm p < {LEVEL}, else inconclusive (the "
              f"seeds resolve no difference, which is not the same as equal). Best other norm: "
              f"the best mean among the testbed's other norms whose every run learned, against "
              f"LN with Welch's p (not corrected). The paper's numbers are on its data and "
              f"schedules; ours on the data named, at CPU scale.", "",
              f"![UN − LN per testbed]({figure})"]
    return "\n".join(lines)


def page(rows: list[Row]) -> str:
    """``headline.md``: the sentence, the table and the figure beside it."""
    return "\n".join(["# UN against LN on each testbed", "",
                      "Generated by `python scripts/make_tables.py`; do not edit.", "",
                      finding(rows), "", to_markdown(rows, FIGURE), ""])


FIGURE = "headline.png"
TABLE_START = "| testbed (data that ran) |"
FINDING_START = "On this project's "


def readme_with(text: str, rows: list[Row], figure: str) -> str:
    """The README with its finding sentence and its Results table (through the figure's line)
    regenerated; everything else as written."""
    lines = text.split("\n")
    finding_at = [i for i, line in enumerate(lines) if line.startswith(FINDING_START)]
    table_at = [i for i, line in enumerate(lines) if line.startswith(TABLE_START)]
    if len(finding_at) != 1 or len(table_at) != 1:
        raise ValueError(f"the README needs one line starting {FINDING_START!r} and one "
                         f"starting {TABLE_START!r} (found {len(finding_at)} and "
                         f"{len(table_at)}): restore them from git, make_tables.py fills them in")
    end = next((i for i in range(table_at[0], len(lines)) if lines[i].startswith("![")), None)
    if end is None:
        raise ValueError("the README's Results table has no figure line ('![...') after it")
    lines[finding_at[0]] = finding(rows)
    lines[table_at[0]:end + 1] = to_markdown(rows, figure).split("\n")
    return "\n".join(lines)


def forest(rows: list[Row], path: Path) -> None:
    """UN − LN per testbed with its 95% interval, one panel per testbed in its own unit, the
    axis turned so that right is better for UN."""
    fig = Figure(figsize=(6.4, 1.0 + 0.9 * len(rows)), layout="constrained")
    axes = fig.subplots(len(rows), 1, squeeze=False)
    for ax, row in zip(axes[:, 0], rows):
        low, high = row.interval
        colour = "tab:gray" if row.verdict == "inconclusive" else (
            "tab:green" if row.verdict == "UN above LN" else "tab:red")
        ax.errorbar([row.difference], [0], xerr=[[row.difference - low], [high - row.difference]],
                    fmt="o", color=colour, capsize=4)
        ax.axvline(0, color="black", linewidth=0.8)
        reach = 1.15 * max(abs(low), abs(high))
        ax.set_xlim((reach, -reach) if row.lower_is_better else (-reach, reach))
        ax.set_yticks([])
        ax.set_ylabel(row.testbed.name, rotation=0, ha="right", va="center", fontsize=9)
        ax.set_xlabel(f"UN − LN, {row.testbed.unit}" + (" (axis reversed)" if row.lower_is_better
                                                        else ""), fontsize=8)
        ax.tick_params(labelsize=8)
        ax.text(0.99, 0.85, f"Holm p = {_p(row.p_holm)}", transform=ax.transAxes, ha="right",
                va="top", fontsize=8)
    fig.suptitle("UN − LN per CPU testbed: 95% Welch intervals (uncorrected), right is better "
                 "for UN;\nafter Holm's correction red: UN below LN, green: above, grey: "
                 "inconclusive", fontsize=9)
    save_figure(fig, path)
