"""The numbers in README.md's and results/README.md's prose agree with the committed run
records: every comparison carries a marker naming its two groups of runs, and its printed
difference, n and Welch p are recomputed from results/runs with the tables' own code
(``analysis.claims``: the convention is in its docstring). Reads records only."""
from __future__ import annotations

import re
from pathlib import Path

import pytest
import yaml

from analysis import claims
from analysis.runs import load_runs
from analysis.tables import build_tables

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", ROOT / "results" / "README.md"]
#: sections another change owns and marks itself: their markers are checked, their unmarked
#: p values not yet (training through the norms: SAM, SAM-ON, norm-only training)
UNCHECKED_SECTIONS = None


@pytest.fixture(scope="module")
def records():
    return load_runs(ROOT / "results" / "runs")


@pytest.fixture(scope="module")
def runs(records):
    """The records, each group a marker names selected once for the module."""
    return claims.Groups(records)


@pytest.fixture(scope="module")
def tables(records):
    paper = yaml.safe_load((ROOT / "results" / "paper" / "tables.yaml").read_text())
    return build_tables(paper, records, ROOT / "results" / "benchmarks")


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_marked_claim_matches_the_records(page, runs, tables):
    text = page.read_text()
    assert claims.markers(text), f"{page.name} marks no claim"
    problems = claims.check(text, runs, tables)
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_p_value_in_the_prose_is_marked(page):
    unmarked = claims.unmarked_p_values(page.read_text(), UNCHECKED_SECTIONS)
    assert not unmarked, f"{page.name}: p values without a claim marker:\n" + "\n".join(unmarked)


def test_the_pages_mark_their_claims_one_by_one():
    """A marker per comparison (a list of comparisons is a list of markers), of every kind."""
    found = [m for page in PAGES for m in claims.markers(page.read_text())]
    kinds = {kind: sum(m.kind == kind for m in found) for kind in ("claim", "gap", "runs", "tests")}
    assert kinds["claim"] >= 100 and all(kinds.values()), kinds


def altered(text: str, marker_kind: str, change) -> str:
    """``text`` with ``change`` applied to the numbers after its first marker of a kind."""
    match = next(m for m in claims.MARKER.finditer(text) if m.group(1) == marker_kind)
    if marker_kind in ("claim", "gap"):
        paren = claims.PARENTHESIS.search(text, match.end())
        return text[:paren.start()] + change(paren.group(0)) + text[paren.end():]
    head = text[match.end():match.end() + 12]
    return text[:match.end()] + change(head) + text[match.end() + 12:]


def bump_last_digit(number: str) -> str:
    return number[:-1] + str((int(number[-1]) + 1) % 10)


@pytest.mark.parametrize("fault", ["difference", "p", "n", "runs", "tests"])
def test_a_changed_digit_in_the_prose_fails(fault, runs, tables):
    """One digit off in a difference, p, n or count, and the check names the line."""
    text = (ROOT / "results" / "README.md").read_text()
    assert not claims.check(text, runs, tables)
    if fault == "difference":
        bad = altered(text, "claim", lambda s: re.sub(
            r"^\(([-+−][\d.]+)", lambda m: "(" + bump_last_digit(m.group(1)), s))
    elif fault == "p":
        bad = altered(text, "claim", lambda s: re.sub(
            r"p\s*=\s*([\d.]+)", lambda m: "p = " + bump_last_digit(m.group(1)), s))
    elif fault == "n":
        bad = altered(text, "claim", lambda s: re.sub(
            r"n\s*=\s*(\d+)", lambda m: f"n = {int(m.group(1)) + 1}", s))
    else:
        bad = altered(text, fault, lambda s: re.sub(
            r"\d+", lambda m: str(int(m.group(0)) + 1), s, count=1))
    assert bad != text
    problems = claims.check(bad, runs, tables)
    assert len(problems) == 1 and problems[0].startswith("line "), problems


def test_printed_precision():
    same = claims.same_at_printed_precision
    assert same("0.010", 0.01026) and not same("0.011", 0.01026)
    assert same("0.002", 0.002463) and not same("0.003", 0.002463)
    assert same("-0.32", -0.3218) and same("+0.80", 0.797) and same("-0.0", 0.0004)
    assert same("4.7e-08", 4.71e-8) and not same("4.8e-08", 4.71e-8) and same("5e-08", 4.71e-8)


def test_a_p_above_the_threshold_printed_as_below_fails(runs):
    text = ("DyT against NoNorm <!-- claim: llama_cpu:Pre-DyT vs llama_cpu:Pre-NoNorm -->"
            "(+0.11, n = 5 vs 5, p < 0.05)")
    assert claims.check(text, runs) == [
        "line 1 (claim: llama_cpu:Pre-DyT vs llama_cpu:Pre-NoNorm): p < 0.05, records 0.478"]
    assert claims.check(text.replace("p < 0.05", "p = 0.48"), runs) == []
    assert claims.unmarked_p_values("PRepBN beats NoNorm (p = 0.010).") == ["line 1: p = 0.010"]
    assert claims.unmarked_p_values("marked `*` where p < 0.05") == []  # the threshold
    assert claims.check("<!-- unchecked: -->(p = 0.098)", runs) == [
        "line 1 (unchecked: ): an unchecked p says why"]


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_no_line_starts_with_a_marker(page):
    """A line opening with ``<!--`` starts an HTML block, which cuts the paragraph around it:
    a marker follows a word on its line."""
    starts = [number for number, line in enumerate(page.read_text().splitlines(), start=1)
              if re.match(r"\s*<!--(\s*(claim|runs|tests|gap|unchecked):|\s*$)", line)]
    assert not starts, f"{page.name}: lines {starts} start with a claim marker"
