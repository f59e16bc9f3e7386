"""The numbers in the results pages' prose (results/*.md) agree with the committed run records:
every comparison carries a marker naming its two groups of runs, and its printed difference,
n, Welch p and Holm verdict are recomputed from results/runs with the tables' own code; counts
of tests, runs and seeds are checked too, and measured times stay out of the prose
(``analysis.claims``: the convention is in its docstring). The README carries no marker: its
numbers are the generated headline (tests/test_pages.py). Reads records only."""
from __future__ import annotations

import re
from pathlib import Path

import pytest
import yaml

from analysis import claims, pages
from analysis.runs import load_runs

ROOT = Path(__file__).resolve().parents[1]
PAGES = sorted((ROOT / "results").glob("*.md"))
#: sections another change owns and marks itself: their markers are checked, their unmarked
#: p values not yet
UNCHECKED_SECTIONS = None


@pytest.fixture(scope="module")
def records():
    return load_runs(ROOT / "results" / "runs")


def page_ids(page: Path) -> str:
    return str(page.relative_to(ROOT))


@pytest.fixture(scope="module")
def runs(records):
    """The records, each group a marker names selected once for the module."""
    return claims.Groups(records)


@pytest.fixture(scope="module")
def tables(records):
    paper = yaml.safe_load((ROOT / "results" / "paper" / "tables.yaml").read_text())
    return pages.all_tables(paper, records, ROOT / "results" / "benchmarks",
                            ROOT / "results")


@pytest.mark.parametrize("page", PAGES, ids=page_ids)
def test_every_marked_claim_matches_the_records(page, runs, tables):
    problems = claims.check(page.read_text(), runs, tables)
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize("page", PAGES + [ROOT / "README.md"], ids=page_ids)
def test_every_p_value_in_the_prose_is_marked(page):
    unmarked = claims.unmarked_p_values(page.read_text(), UNCHECKED_SECTIONS)
    assert not unmarked, f"{page.name}: p values without a claim marker:\n" + "\n".join(unmarked)


@pytest.mark.parametrize("page", PAGES + [ROOT / "README.md"], ids=page_ids)
def test_every_comparison_count_and_holm_verdict_is_where_the_check_reaches(page):
    """A parenthesis that reads as a comparison has its marker; a count of tests or runs sits
    after the marker that checks it; no measured time in the prose; Holm's verdict on a claim
    inside its parenthesis."""
    text = page.read_text()
    problems = (claims.unmarked_comparisons(text) + claims.unmarked_counts(text)
                + claims.holm_outside_claims(text))
    assert not problems, f"{page.name}:\n" + "\n".join(problems)


def test_the_readme_has_no_marker():
    """The README's numbers are the generated headline; it carries no HTML marker."""
    assert "<!--" not in (ROOT / "README.md").read_text()


def test_the_pages_mark_their_claims_one_by_one():
    """A marker per comparison (a list of comparisons is a list of markers), of every kind."""
    found = [m for page in PAGES for m in claims.markers(page.read_text())]
    kinds = {kind: sum(m.kind == kind for m in found) for kind in ("claim", "gap", "runs", "tests")}
    assert kinds["claim"] >= 100 and all(kinds.values()), kinds


def altered(text: str, marker_kind: str, change) -> str:
    """``text`` with ``change`` applied to the numbers after its first marker of a kind."""
    match = next(m for m in claims.MARKER.finditer(text) if m.group(1) == marker_kind)
    if marker_kind in ("claim", "gap", "from"):
        paren = claims.PARENTHESIS.search(text, match.end())
        return text[:paren.start()] + change(paren.group(0)) + text[paren.end():]
    head = text[match.end():match.end() + 12]
    return text[:match.end()] + change(head) + text[match.end() + 12:]


def bump_last_digit(number: str) -> str:
    return number[:-1] + str((int(number[-1]) + 1) % 10)


@pytest.mark.parametrize("fault", ["difference", "p", "n", "runs", "tests", "records", "seeds",
                                   "from"])
def test_a_changed_digit_in_the_prose_fails(fault, runs, tables):
    """One digit off in a difference, p, n or count, and the check names the line."""
    page = {"records": "README.md", "seeds": "README.md", "from": "language_modelling.md",
            "runs": "micro_batch.md"}
    text = (ROOT / "results" / page.get(fault, "classification.md")).read_text()
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
    elif fault == "from":
        bad = altered(text, fault, lambda s: re.sub(
            r"\d\]", lambda m: str((int(m.group(0)[0]) + 1) % 10) + "]", s, count=1))
    else:
        bad = altered(text, fault, lambda s: re.sub(
            r"\d+|five", lambda m: "six" if m.group(0) == "five" else str(int(m.group(0)) + 1),
            s, count=1))
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


def test_holm_wording_is_checked_against_the_table(runs, tables):
    """A claim's Holm verdict is read from the table's ``**``: flipped, it fails; said without
    its table, or outside the parenthesis, it is refused."""
    surviving = ("BN 82.6 <!-- claim: t2t_vit_14:BN vs t2t_vit_14:LN; holm=Table 2 -->(+11.1, "
                 "n = 5 vs 5, p = 0.002, survives Holm)")
    assert claims.check(surviving, runs, tables) == []
    flipped = surviving.replace("survives Holm", "not after Holm")
    assert claims.check(flipped, runs, tables) == [
        "line 1 (claim: t2t_vit_14:BN vs t2t_vit_14:LN; holm=Table 2): 'not after Holm', but "
        "'Table 2' marks it **"]
    not_surviving = ("PRepBN <!-- claim: t2t_vit_14:PRepBN vs t2t_vit_14:LN; holm=Table 2 -->"
                     "(+9.9, n = 5 vs 5, p = 0.004, survives Holm)")
    assert "does not mark it **" in claims.check(not_surviving, runs, tables)[0]
    unnamed = surviving.replace("; holm=Table 2", "")
    assert "name the table" in claims.check(unnamed, runs, tables)[0]
    outside = ("BN beats LN <!-- claim: t2t_vit_14:BN vs t2t_vit_14:LN -->(+11.1, n = 5 vs 5, "
               "p = 0.002), none after Holm's correction.")
    assert claims.holm_outside_claims(outside) == [
        "line 1: Holm's verdict outside a claim's parenthesis"]
    assert claims.holm_outside_claims("`**` marks survival of Holm's correction.") == []


def test_a_claim_on_superseded_records_fails(records, tables):
    """Records made under the earlier warm-up rule cannot back a current claim."""
    stale = load_runs(ROOT / "results" / "superseded" / "warmup_before_floor" / "main")
    text = ("UN <!-- claim: swin_t:UN vs swin_t:LN -->(-3.2, n = 5 vs 5, p = 0.025)")
    assert claims.check(text, records, tables) == []
    problems = claims.check(text, records + stale, tables)
    assert any("superseded rule (swin_t:UN)" in p for p in problems), problems


def test_unmarked_comparisons_counts_and_times_are_found():
    assert claims.unmarked_comparisons("UN trails (-3.2, n = 5 vs 5) and BN (n = 3 vs 5).") == [
        "line 1: (-3.2, n = 5 vs 5)", "line 1: (n = 3 vs 5)"]
    assert claims.unmarked_comparisons("a bootstrap interval (+0.8 [-4.7, +5.3])") == [
        "line 1: (+0.8 [-4.7, +5.3])"]
    assert claims.unmarked_comparisons("<!-- from: T -->(+0.8 [-4.7, +5.3])") == []
    assert claims.unmarked_counts("the grid's 503 runs and 24 tests") == [
        "line 1: '503 runs' without its marker", "line 1: '24 tests' without its marker"]
    assert claims.unmarked_counts("<!-- records: main -->100 runs; <!-- tests: T -->24 tests; "
                                  "<!-- runs: swin_t:BN chance -->2 of 3 runs") == []
    assert claims.unmarked_counts("it took 41 min, and the rest about 3 h") == [
        "line 1: '41 min': a measured time belongs in docs/times.md",
        "line 1: '3 h': a measured time belongs in docs/times.md"]
