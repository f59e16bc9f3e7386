"""Claims in prose, checked against the run records.

A comparison written in ``README.md`` or ``results/README.md`` carries a marker naming what
it compares, and the numbers it prints come right after it::

    UN 85.7 ± 2.5 <!-- claim: swin_t:UN vs swin_t:LN -->(-1.5, n = 5 vs 5, p = 0.27)

The marker is an HTML comment, so the page reads as before. Each side is a *group* of runs:

- ``<model>:<setting>``: the runs of ``<model>`` whose setting is ``<setting>``
  (``t2t_vit_14:UN norm.bwd_ema=false``, ``llama_cpu:Pre-LN``, ``swin_t:LN sam=sam_on``), as
  ``analysis.runs.setting`` names them and the tables group them; the learning-rate ladder's
  raised rates left out;
- ``<model>:<setting>@<k>x``: that setting's runs at ``k`` times the learning rate
  (``t2t_vit_14:BN@3x``; ``@1x`` is the main runs), as the stability tables take them.

After ``;`` a ``claim`` may set ``metric=<name>`` (default: the task's metric,
``TASK_METRIC``) and ``all`` (the test takes every run that recorded the metric, runs at
chance included; by default only runs with status ``ok``, as the tables do). The numbers a
``claim`` checks are in the first parenthesis after it: the signed difference of means first
(``-1.5``, ``+0.80 nats``; never a mean), then ``n = a vs b`` and ``p = x`` (or ``p < x``),
each compared at the precision printed.

The other markers::

    <!-- gap: A vs B against C vs D -->(-0.43, n = 3 vs 5, p = 0.028)
        Welch's test of A's values less B's mean against C's values less D's mean, checked as
        a claim's numbers
    <!-- runs: t2t_vit_14:MABN@30x chance -->2 of 3
        k of the group's n runs ended with that status (ok, chance, FAIL); "k/n" too
    <!-- tests: Stability: llama_cpu -->18 tests
        the number of comparisons in the table whose title starts with the text
    <!-- unchecked: <why> -->(p = 0.098, ...)
        a p the records cannot check (withdrawn runs), said so
    <!-- from: Learning-rate sensitivity: t2t_vit_14 -->(+0.8 [-4.7, +5.3])
        every number in the parenthesis appears in that table (a bootstrap interval, a mean)
    <!-- records: micro_batch -->150 runs
        the number of records in ``results/runs/cpu/<group>`` (``all``: in every group)
    <!-- seeds: main -->five seeds
        every setting of the group's records (its model, setting and learning rate) has that
        many runs; ``<!-- seeds: lm; recipe -->``: its settings with no override;
        ``<!-- seeds: swin_t:UN -->`` counts one setting's runs

A claim's parenthesis may say whether it survives Holm's correction ("survives Holm", "not
after Holm"); the claim then names the table whose comparisons Holm's correction runs over
(``; holm=Table 2``) and the check reads the table's ``**``. In a sentence that holds a
claim, Holm's verdict is said only inside a claim's parenthesis, where it is checked.

Every ``p =`` or ``p <`` of a checked page must sit in the parenthesis of a ``claim``, ``gap``
or ``unchecked`` marker (``unmarked_p_values``; ``p < 0.05``, the threshold, defines a mark
and claims nothing); so must every parenthesis that opens with a signed difference or holds
``n = a vs b`` (``unmarked_comparisons``); every count of tests, comparisons, runs or records
sits right after the marker that checks it, and no measured time is in the prose
(``unmarked_counts``; times live in the generated docs/times.md). A claim may not rest on a
record made under a superseded rule (``analysis.runs.superseded_warmup``). Generated blocks
(``analysis.pages``) and the headline are the records' own output, not prose. The tests are
the tables' own: ``Cell.values`` picks the runs, ``Comparisons`` computes the difference and
Welch's p. Reads run records only.
"""
from __future__ import annotations

import re
import statistics
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from analysis.runs import (STABILITY_KEY, TASK_METRIC, changes, ladder, override_value,
                           setting, superseded_warmup, where)
from analysis.significance import Cell, Comparisons
from analysis.tables import table_markdown

MARKER = re.compile(r"<!--\s*(claim|runs|tests|gap|unchecked|from|records|seeds):\s*(.*?)\s*-->",
                    re.S)
UNSIGNED = r"\d+(?:\.\d+)?(?:e[-+]?\d+)?"
NUMBER = rf"[-+−]?{UNSIGNED}"
P_VALUE = re.compile(rf"\bp\s*(=|<)\s*({NUMBER})")
N_PAIR = re.compile(r"\bn\s*=\s*(\d+)\s*vs\s*(\d+)")
DIFFERENCE = re.compile(rf"^\s*([-+−]{UNSIGNED})")  # signed: a difference, never a mean
PARENTHESIS = re.compile(r"\(([^()]*)\)")


@dataclass
class Comparison:
    difference: float
    p: Optional[float]
    n: tuple[int, int]


def group_runs(runs: list[dict], spec: str) -> Cell:
    """The runs a group names: ``<model>:<setting>`` or ``<model>:<setting>@<k>x``."""
    model, _, label = spec.strip().partition(":")
    label, _, multiple = label.partition("@")
    label = " ".join(label.split())
    if multiple:
        k = float(multiple.rstrip("x"))
        points = {}
        for (_, m, _), settings in ladder(runs).items():
            if m == model:
                points = settings.get(label, {})
        return Cell(points.get(k, []))
    return Cell([r for r in runs if where(r)[1] == model and r.get("scale", "full") != "full"
                 and override_value(r, STABILITY_KEY) is None and setting(r) == label])


class Groups:
    """``group_runs`` over one list of runs, each group selected once (a page names the same
    groups many times)."""

    def __init__(self, runs: list[dict]):
        self.runs, self.cells = runs, {}

    def cell(self, spec: str) -> Cell:
        key = " ".join(spec.split())
        if key not in self.cells:
            self.cells[key] = group_runs(self.runs, key)
        return self.cells[key]


def _cell(runs, spec: str) -> Cell:
    return runs.cell(spec) if isinstance(runs, Groups) else group_runs(runs, spec)


def metric_of(cell: Cell, metric: Optional[str]) -> str:
    if metric:
        return metric
    tasks = {r.get("task", "classification") for r in cell.runs}
    if len(tasks) != 1:
        raise ValueError(f"a group with runs of {sorted(tasks) or 'no task'}")
    return TASK_METRIC[tasks.pop()]


def values(cell: Cell, metric: str, every_run: bool = False) -> list[float]:
    """The runs' metric: of the runs that learned (``Cell.values``, as the tables), or with
    ``every_run`` of every run that recorded it (chance runs too)."""
    if not every_run:
        return cell.values(metric)
    return [r["metrics"][metric] for r in cell.runs if r["metrics"].get(metric) is not None]


def compare(runs, a: str, b: str, metric: Optional[str] = None,
            every_run: bool = False) -> Comparison:
    """Group ``a`` against group ``b``: the difference of means and Welch's p, as a table
    cell's test against its baseline (``Comparisons``)."""
    left, right = _cell(runs, a), _cell(runs, b)
    metric = metric_of(Cell(left.runs + right.runs), metric)
    x, y = values(left, metric, every_run), values(right, metric, every_run)
    return _tested(x, y, f"{a} vs {b}")


def compare_gaps(runs, a: str, b: str, c: str, d: str,
                 metric: Optional[str] = None) -> Comparison:
    """Is ``a - b`` different from ``c - d``? Welch's test of a's values less b's mean against
    c's values less d's mean (``Comparisons`` on the shifted values)."""
    cells = [_cell(runs, spec) for spec in (a, b, c, d)]
    metric = metric_of(Cell([r for cell in cells for r in cell.runs]), metric)
    va, vb, vc, vd = (cell.values(metric) for cell in cells)
    x = [v - statistics.mean(vb) for v in va]
    y = [v - statistics.mean(vd) for v in vc]
    return _tested(x, y, f"gap {a} - {b} vs {c} - {d}")


def _tested(x: list[float], y: list[float], what: str) -> Comparison:
    """``x`` against ``y`` as a table cell is tested against its baseline (``Comparisons``)."""
    tests = Comparisons()
    tests.add(x, y)
    result = tests.results()[0]
    if result is None:
        raise ValueError(f"{what}: fewer than two runs on a side ({len(x)}, {len(y)})")
    return Comparison(result[0], result[1], (len(x), len(y)))


def status_count(runs, spec: str, status: str) -> tuple[int, int]:
    """How many of a group's runs ended with ``status`` (ok, chance, FAIL), of how many."""
    cell = _cell(runs, spec)
    return sum(r["status"] == status for r in cell.runs), len(cell.runs)


def table_test_count(tables: list, title: str) -> int:
    """The number of comparisons in the table whose title starts with ``title`` (its note)."""
    match = re.search(r"(\d+) comparisons? in this table", " ".join(_table(tables, title).notes))
    return int(match.group(1)) if match else 0


# --- the prose side ---------------------------------------------------------------------------

@dataclass
class Marker:
    kind: str
    body: str
    after: str  # the page's text after the marker
    line: int


def markers(text: str) -> list[Marker]:
    return [Marker(m.group(1), " ".join(m.group(2).split()), text[m.end():],
                   text.count("\n", 0, m.start()) + 1) for m in MARKER.finditer(text)]


def _number(text: str) -> float:
    return float(text.replace("−", "-"))


def same_at_printed_precision(printed: str, value: float) -> bool:
    """``value`` printed as ``printed`` is: rounded to its decimals (or, in e-notation, its
    significant digits)."""
    printed = printed.replace("−", "-")
    if "e" in printed.lower():
        mantissa = printed.lower().split("e")[0]
        digits = len(mantissa.split(".")[1]) if "." in mantissa else 0
        return float(f"{value:.{digits}e}") == float(printed)
    decimals = len(printed.split(".")[1]) if "." in printed else 0
    rounded = f"{value:.{decimals}f}"
    if float(rounded) == 0:  # -0.0 and +0.0 print alike
        rounded = rounded.lstrip("+-")
    return float(rounded) == float(printed)


def printed_numbers(after: str) -> str:
    """The first parenthesis after a marker."""
    match = PARENTHESIS.search(after)
    if not match:
        raise ValueError("no parenthesis after the marker")
    return match.group(1)


def check_comparison(numbers: str, result: Comparison) -> list[str]:
    """What the printed ``(difference, n = a vs b, p = x)`` gets wrong about ``result``."""
    problems = []
    first = DIFFERENCE.match(numbers)
    if first:
        printed = first.group(1)
        if not same_at_printed_precision(printed, result.difference):
            problems.append(f"difference {printed}, records {result.difference:+.4g}")
    else:
        problems.append("the parenthesis does not start with the signed difference")
    n = N_PAIR.search(numbers)
    if not n:
        problems.append("no 'n = a vs b'")
    elif (int(n.group(1)), int(n.group(2))) != result.n:
        problems.append(f"n = {n.group(1)} vs {n.group(2)}, records {result.n[0]} vs {result.n[1]}")
    p = P_VALUE.search(numbers)
    if not p:
        problems.append("no p")
    elif result.p is None:
        problems.append("p printed, but the records have no spread to test")
    elif p.group(1) == "<":
        if not result.p < _number(p.group(2)):
            problems.append(f"p < {p.group(2)}, records {result.p:.3g}")
    elif not same_at_printed_precision(p.group(2), result.p):
        problems.append(f"p = {p.group(2)}, records {result.p:.3g}")
    return problems


def options(body: str) -> tuple[str, Optional[str], bool, Optional[str]]:
    """A marker's body split into its groups and its options (``metric=``, ``all``,
    ``holm=``)."""
    head, *rest = [part.strip() for part in body.split(";")]
    metric = next((o.split("=", 1)[1] for o in rest if o.startswith("metric=")), None)
    holm = next((o.split("=", 1)[1].strip() for o in rest if o.startswith("holm=")), None)
    unknown = [o for o in rest if not o.startswith(("metric=", "holm=")) and o != "all"]
    if unknown:
        raise ValueError(f"unknown option {unknown}")
    return head, metric, "all" in rest, holm


HOLM = re.compile(r"\bHolm\b")
SURVIVES = re.compile(r"\b(surviv\w*|pass\w*)\s+Holm", re.I)
DOES_NOT = re.compile(r"\b(not|neither|none|before|no longer)\b[^()]{0,20}\bHolm", re.I)
TESTED_CELL = re.compile(rf"({NUMBER}) \(p=({UNSIGNED})\)(\*{{0,2}})")


def holm_mark(tables: list, title: str, result: Comparison) -> str:
    """The table's mark of ``result``: ``**`` (survives Holm's correction over the table),
    ``*`` or ``""``; found by its difference and p as the table prints them."""
    table = _table(tables, title)
    marks = {match.group(3) for row in table.rows for cell in row
             for match in TESTED_CELL.finditer(cell)
             if result.p is not None and match.group(2) == f"{result.p:.2g}"
             and same_at_printed_precision(match.group(1), result.difference)}
    if len(marks) != 1:
        raise ValueError(f"the comparison is {'not' if not marks else 'ambiguous'} in {title!r}")
    return marks.pop()


def check_holm(numbers: str, holm: Optional[str], tables: Optional[list],
               result: Comparison) -> list[str]:
    """What the parenthesis says of Holm's correction against the table's ``**``."""
    if not HOLM.search(numbers):
        return []
    if holm is None:
        return ["says Holm: name the table it is corrected over (; holm=<table title>)"]
    if tables is None:
        raise ValueError("no tables given")
    survives = holm_mark(tables, holm, result) == "**"
    if DOES_NOT.search(numbers):
        return [f"'not after Holm', but {holm!r} marks it **"] if survives else []
    if SURVIVES.search(numbers):
        return [] if survives else [f"'survives Holm', but {holm!r} does not mark it **"]
    return ["says Holm without 'survives Holm' or 'not after Holm'"]


def _table(tables: list, title: str):
    found = [t for t in tables if t.title.startswith(title)]
    if len(found) != 1:
        raise ValueError(f"{len(found)} tables titled {title!r}...")
    return found[0]


COUNT_WORDS = {"two": 2, "three": 3, "four": 4, "five": 5, "six": 6, "seven": 7, "eight": 8,
               "nine": 9, "ten": 10}


def _count(text: str) -> Optional[int]:
    match = re.match(rf"\s*(\d+|{'|'.join(COUNT_WORDS)})\b", text, re.I)
    if not match:
        return None
    word = match.group(1).lower()
    return COUNT_WORDS[word] if word in COUNT_WORDS else int(word)


def record_group(run: dict) -> str:
    """The records' folder a run is in: ``results/runs/cpu/<group>/<run>``."""
    return Path(run["_path"]).parent.name


def seed_counts(runs: list[dict], spec: str) -> dict[str, int]:
    """Runs per setting (model, setting, learning-rate multiple) of a records folder, or of
    one ``<model>:<setting>`` group."""
    spec, _, option = (part.strip() for part in spec.partition(";"))
    if option not in ("", "recipe"):
        raise ValueError(f"unknown option {option!r} (recipe: the settings with no override)")
    if ":" in spec:
        return {spec: len(group_runs(runs, spec).runs)}
    counts: dict[str, int] = {}
    for run in runs:
        if record_group(run) == spec and not (option and (changes(run) or " " in setting(run))):
            multiple = override_value(run, STABILITY_KEY)
            key = f"{where(run)[1]}:{setting(run)}" + (f"@{multiple}x" if multiple else "")
            counts[key] = counts.get(key, 0) + 1
    if not counts:
        raise ValueError(f"no records in a group {spec!r}")
    return counts


def check(text: str, runs, tables: Optional[list] = None) -> list[str]:
    """Every marker of a page checked against the records (``runs``: a list of run records or
    ``Groups`` of them; ``tables``: ``build_tables``' output, for ``tests`` markers): one line
    per disagreement."""
    problems, runs = [], runs if isinstance(runs, Groups) else Groups(runs)
    text = prose(text)
    for marker in markers(text):
        where_ = f"line {marker.line} ({marker.kind}: {marker.body})"
        try:
            if marker.kind in ("claim", "gap"):
                head, metric, every_run, holm = options(marker.body)
                if marker.kind == "claim":
                    sides = head.split(" vs ")
                    result = compare(runs, *sides, metric, every_run)
                else:
                    left, right = head.split(" against ")
                    sides = left.split(" vs ") + right.split(" vs ")
                    result = compare_gaps(runs, *sides, metric)
                stale = [spec for spec in sides
                         if any(superseded_warmup(r) for r in _cell(runs, spec).runs)]
                if stale:
                    problems.append(f"{where_}: rests on records made under a superseded rule "
                                    f"({', '.join(stale)}): cite the current ones")
                numbers = printed_numbers(marker.after)
                problems += [f"{where_}: {p}" for p in check_comparison(numbers, result)]
                problems += [f"{where_}: {p}" for p in check_holm(numbers, holm, tables, result)]
            elif marker.kind == "runs":
                spec, status = marker.body.rsplit(" ", 1)
                k, n = status_count(runs, spec, status)
                printed = re.match(r"\s*(\d+)\s*(?:/|of)\s*(\d+)", marker.after)
                if not printed:
                    problems.append(f"{where_}: no 'k of n' or 'k/n' right after it")
                elif (int(printed.group(1)), int(printed.group(2))) != (k, n):
                    shown = " ".join(printed.group(0).split())
                    problems.append(f"{where_}: {shown}, records {k} of {n}")
            elif marker.kind == "unchecked":
                if not marker.body:
                    problems.append(f"{where_}: an unchecked p says why")
            elif marker.kind in ("tests", "from") and tables is None:
                raise ValueError("no tables given")
            elif marker.kind == "tests":
                count, printed = table_test_count(tables, marker.body), _count(marker.after)
                if printed is None:
                    problems.append(f"{where_}: no count right after it")
                elif printed != count:
                    problems.append(f"{where_}: {printed}, the table has {count}")
            elif marker.kind == "from":
                table = "\n".join(table_markdown(_table(tables, marker.body), ""))
                table = table.replace("−", "-")
                for number in re.findall(NUMBER, printed_numbers(marker.after)):
                    number = re.escape(number.replace("−", "-"))
                    if not re.search(rf"(?<![\d.]){number}(?![\d])", table):
                        problems.append(f"{where_}: {number} is not in the table")
            elif marker.kind in ("records", "seeds"):
                printed = _count(marker.after)
                if marker.kind == "records":
                    counts = {marker.body: sum(marker.body in ("all", record_group(r))
                                               for r in runs.runs)}
                else:
                    counts = seed_counts(runs.runs, marker.body)
                if printed is None:
                    problems.append(f"{where_}: no count right after it")
                else:
                    other = {k: n for k, n in counts.items() if n != printed}
                    if other:
                        shown = ", ".join(f"{k}: {n}" for k, n in sorted(other.items())[:4])
                        problems.append(f"{where_}: {printed}, records {shown}"
                                        + (f" and {len(other) - 4} more" if len(other) > 4 else ""))
        except ValueError as error:
            problems.append(f"{where_}: {error}")
    return problems


THRESHOLD = 0.05  # "p < 0.05" defines a mark; it claims nothing
GENERATED = re.compile(r"<!-- generated: .*?<!-- end generated -->", re.S)
HEADLINE = re.compile(r"^On this project's [^\n]*$|^\| testbed \(data that ran\) \|.*?^!\[[^\n]*$",
                      re.S | re.M)


def prose(text: str) -> str:
    """The page's own words: generated blocks and the headline blanked, lines kept."""
    def blank(match: re.Match) -> str:
        return "\n" * match.group(0).count("\n")
    return HEADLINE.sub(blank, GENERATED.sub(blank, text))


def _covered(text: str) -> list[tuple[int, int]]:
    """The spans of the parentheses a ``claim``, ``gap``, ``unchecked`` or ``from`` marker
    checks or excuses."""
    spans = []
    for match in MARKER.finditer(text):
        if match.group(1) in ("claim", "gap", "unchecked", "from"):
            paren = PARENTHESIS.search(text, match.end())
            if paren:
                spans.append((paren.start(), paren.end()))
    return spans


def _skipped(text: str, unchecked_sections: Optional[str]) -> list[tuple[int, int]]:
    skipped = []
    for match in re.finditer(r"^#{1,6} (.*)$", text, re.M):
        heading = match.group(1)
        if unchecked_sections and re.search(unchecked_sections, heading, re.I):
            level = len(match.group(0)) - len(match.group(0).lstrip("#"))
            end = re.compile(r"^#{1,%d} " % level, re.M)
            following = end.search(text, match.end())
            skipped.append((match.start(), following.start() if following else len(text)))
    return skipped


def _line(text: str, spot: int) -> int:
    return text.count("\n", 0, spot) + 1


def unmarked_p_values(text: str, unchecked_sections: Optional[str] = None) -> list[str]:
    """Every ``p =``/``p <`` of the page's prose outside the parenthesis a ``claim``, ``gap``
    or ``unchecked`` marker covers, by line; sections whose heading matches the regular
    expression ``unchecked_sections`` (case-insensitive) left out."""
    text = prose(text)
    spans = _covered(text) + _skipped(text, unchecked_sections)
    out = []
    for match in P_VALUE.finditer(text):
        spot = match.start()
        if any(a <= spot < b for a, b in spans):
            continue
        if match.group(1) == "<" and _number(match.group(2)) == THRESHOLD:
            continue
        out.append(f"line {_line(text, spot)}: {' '.join(match.group(0).split())}")
    return out


def unmarked_comparisons(text: str) -> list[str]:
    """Parentheses of the prose that read as a comparison (they open with a signed difference
    or hold ``n = a vs b``) with no marker that checks them."""
    text = prose(text)
    spans = _covered(text)
    out = []
    for paren in PARENTHESIS.finditer(text):
        if (DIFFERENCE.match(paren.group(1)) or N_PAIR.search(paren.group(1))) and not any(
                a <= paren.start() < b for a, b in spans):
            out.append(f"line {_line(text, paren.start())}: {' '.join(paren.group(0).split())[:60]}")
    return out


COUNTED = re.compile(rf"\b(\d+|{'|'.join(COUNT_WORDS)})\s+(?:new\s+|more\s+)?"
                     r"(tests|comparisons|runs|records)\b", re.I)
DURATION = re.compile(r"\b\d+(?:\.\d+)?\s*(?:h|hours?|min|minutes|core-hours)\b|"
                      r"\b(?:an?|one|two|three)\s+hours?\b", re.I)
MARKER_BEFORE = re.compile(r"<!--\s*(tests|records|runs):[^>]*-->\s*(\d+\s*(?:of|/)\s*)?$")


def unmarked_counts(text: str) -> list[str]:
    """Counts of tests, comparisons, runs or records in the prose without the ``tests`` or
    ``records`` marker that checks them, and any measured time (docs/times.md holds them)."""
    text = prose(text)
    out = []
    for match in COUNTED.finditer(text):
        if not MARKER_BEFORE.search(text[max(0, match.start() - 300):match.start()]):
            out.append(f"line {_line(text, match.start())}: '{' '.join(match.group(0).split())}'"
                       " without its marker")
    for match in DURATION.finditer(text):
        out.append(f"line {_line(text, match.start())}: '{match.group(0)}': a measured time "
                   "belongs in docs/times.md")
    return out


SENTENCE_END = re.compile(r"(?<=[.;!?])\s+(?=[A-Z(*`<-])|\n\s*\n|\n\s*- ")


def holm_outside_claims(text: str) -> list[str]:
    """Sentences that hold a claim and speak of Holm's correction outside every claim's
    parenthesis, where the check cannot reach."""
    text = prose(text)
    spans = _covered(text) + [m.span() for m in MARKER.finditer(text)]
    starts = [0] + [m.end() for m in SENTENCE_END.finditer(text)] + [len(text)]
    out = []
    for start, end in zip(starts, starts[1:]):
        if not any(m.group(1) == "claim" for m in MARKER.finditer(text, start, end)):
            continue
        for holm in HOLM.finditer(text, start, end):
            if not any(a <= holm.start() < b for a, b in spans):
                out.append(f"line {_line(text, holm.start())}: Holm's verdict outside a claim's "
                           "parenthesis")
                break
    return out
