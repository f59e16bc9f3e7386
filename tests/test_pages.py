"""The generated parts of the pages: the headline (UN against LN per testbed) in the README and
results/README.md, each results page's opening tables, and docs/times.md, all as the committed
records give them today; the headline's interval and verdict against closed forms."""
from __future__ import annotations

import json
import math
import statistics
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from scipy import stats

from analysis import headline, pages, times
from analysis.runs import load_runs
from analysis.significance import Cell

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def records():
    return load_runs(ROOT / "results" / "runs")


@pytest.fixture(scope="module")
def paper():
    return yaml.safe_load((ROOT / "results" / "paper" / "tables.yaml").read_text())


@pytest.fixture(scope="module")
def rows(records, paper):
    return headline.headline_rows(records, paper)


def test_the_pages_hold_what_the_records_give(records, paper, rows):
    """Every generated block, the README's finding and headline: as make_tables.py writes them
    from the committed records (run it after the records change)."""
    tables = pages.all_tables(paper, records, ROOT / "results" / "benchmarks",
                              ROOT / "results")
    stale = pages.regenerated(ROOT, tables, rows)
    assert not stale, ("stale generated parts in " + ", ".join(str(p.relative_to(ROOT)) for p in stale)
                       + ": run python scripts/make_tables.py")


def test_every_results_page_opens_with_its_generated_table():
    for page in pages.pages(ROOT):
        body = page.read_text().split("\n", 2)[2]  # after the title
        opening = body.lstrip().splitlines()[0]
        assert opening.startswith(("<!-- generated:", headline.FINDING_START)), page.name


def test_the_headline_interval_and_verdict_are_welchs(rows):
    """The 95% interval from the Welch-Satterthwaite closed form; the verdict from Holm's p,
    which for the smallest of k p values is k times it."""
    assert len(rows) == len(headline.TESTBEDS)
    for row in rows:
        x, y = row.un.values(row.testbed.metric), row.ln.values(row.testbed.metric)
        vx, vy = statistics.variance(x) / len(x), statistics.variance(y) / len(y)
        df = (vx + vy) ** 2 / (vx ** 2 / (len(x) - 1) + vy ** 2 / (len(y) - 1))
        half = stats.t.ppf(0.975, df) * math.sqrt(vx + vy)
        difference = statistics.mean(x) - statistics.mean(y)
        assert row.difference == pytest.approx(difference, rel=1e-12)
        assert row.interval == pytest.approx((difference - half, difference + half), rel=1e-9)
        assert (row.verdict == "inconclusive") == (row.p_holm >= headline.LEVEL)
    smallest = min(rows, key=lambda row: row.p)
    assert smallest.p_holm == pytest.approx(min(1.0, len(rows) * smallest.p))


def test_a_lower_is_better_metric_turns_the_verdict():
    testbed = next(t for t in headline.TESTBEDS if t.metric == "val_loss")
    row = headline.Row(testbed, Cell(), Cell(), difference=+1.0, interval=(0.5, 1.5), p=0.001,
                       p_holm=0.004)
    assert row.verdict == "UN below LN"
    row.difference = -1.0
    assert row.verdict == "UN above LN"


def test_a_readme_without_the_headline_is_refused_by_name(rows, tmp_path):
    (tmp_path / "results").mkdir()
    (tmp_path / "README.md").write_text("# a project\n\nno headline here\n")
    with pytest.raises(ValueError, match=r"README.md: the README needs one line starting"):
        pages.regenerated(tmp_path, [], rows)


def test_the_graph_tables_test_by_welch_and_count_chance_runs():
    """analysis.graphs: LN against BN is scipy's Welch test on the runs that learned; a chance
    run is counted, not averaged; BN against LN is printed once (LN's row)."""
    from analysis import graphs

    def run(norm, acc, status="ok"):
        return {"model": "graph_transformer", "data": "sbm_pattern", "norm": norm, "scale": "cpu",
                "status": status, "metrics": {"test_acc": acc},
                "chance": {"rule": "accuracy <= 55"}}
    bn, ln = [80.0, 83.0, 84.5], [70.0, 78.0]
    records = [run("bn", v) for v in bn] + [run("ln", v) for v in ln] + [run("ln", 50.0, "chance")]
    (table,) = graphs.tables(records)
    rows = {row[0]: row for row in table.rows}
    expected = stats.ttest_ind(ln, bn, equal_var=False).pvalue
    assert rows["LN"][1] == f"{statistics.mean(ln):.1f} ± {statistics.stdev(ln):.1f} (n=2); chance 1/3†"
    assert rows["LN"][2].startswith(f"{statistics.mean(ln) - statistics.mean(bn):+.1f} (p={expected:.2g})")
    assert rows["BN"][2:] == ["", ""] and rows["LN"][3] == ""


def test_a_block_naming_no_table_is_refused():
    with pytest.raises(ValueError, match="'Table 99', which starts no table's title"):
        pages.fill("<!-- generated: Table 99 -->\n<!-- end generated -->", [])


def test_your_runs_tabled_elsewhere_leave_the_pages_alone(tmp_path):
    """make_tables.py on one run folder writes where it is told; no headline without two
    learned runs a side; the tracked pages are not touched."""
    runs = tmp_path / "runs"
    run = ROOT / "results" / "runs" / "cpu" / "main" / "swin_t_un-s0"
    (runs / "mine").mkdir(parents=True)
    for name in ("result.json", "config.yaml"):
        (runs / "mine" / name).write_bytes((run / name).read_bytes())
    before = {page: page.read_text() for page in pages.pages(ROOT) + [ROOT / "README.md"]}
    done = subprocess.run([sys.executable, "scripts/make_tables.py", "--runs", str(runs), "--out",
                           str(tmp_path / "out")], cwd=ROOT, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert "no headline" in done.stdout and (tmp_path / "out" / "tables.md").exists()
    assert {page: page.read_text() for page in before} == before


def test_times_page_is_generated_from_the_records_and_measurements():
    """docs/times.md as scripts/measure_times.py writes it from times.json, the grid's listing
    and the records (run it after either changes)."""
    sys.path.insert(0, str(ROOT / "scripts"))
    import measure_times

    measured = json.loads(times.MEASURED.read_text()) if times.MEASURED.exists() else {}
    expected = times.render(measured, measure_times.grid_counts(), ROOT / "results" / "runs" / "cpu")
    assert times.PAGE.read_text() == expected, "run python scripts/measure_times.py"


def test_a_run_time_from_its_time_stamps(tmp_path):
    """Three rows stamped 10 s apart: 20 s of span plus the first row's own epoch time."""
    (tmp_path / "metrics.jsonl").write_text(
        '{"time": 100.0, "epoch_time_s": 9.0}\n{"time": 110.0}\n{"time": 120.0}\n')
    assert times.run_seconds(tmp_path) == 29.0
    (tmp_path / "metrics.jsonl").write_text('{"time": 100.0}\n{"time": 110.0}\n')
    assert times.run_seconds(tmp_path) == 20.0  # the first row's share: the mean gap
    (tmp_path / "metrics.jsonl").write_text('{"time": 100.0}\n')
    assert times.run_seconds(tmp_path) is None
