"""The paper's Tables 1-10 from recorded runs, beside the paper's numbers.

    python scripts/make_tables.py [--runs results/runs] [--out results/tables]
    python scripts/make_tables.py --runs results/runs multirun/<time> --out my_tables   # yours beside ours

Reads every ``result.json`` under each ``--runs`` folder and the paper's numbers in
``results/paper/tables.yaml``; writes ``tables.md``, ``tables.tex`` and the headline (UN
against LN per testbed: ``headline.md``, its forest plot ``headline.png``), and the shift
benchmark's and the optimizer study's tables (and the former's figure) from the studies kept
apart (``--studies``: ``analysis.test_time``, ``analysis.optimizer``, ``analysis.signal``). From the
committed runs it also rewrites the tables the results pages and the README quote
(``analysis.pages``). A cell of ours is the
mean +- std over seeds of the runs that learned, with their count; runs that finished no
better than chance show as ``chance k/n``, collapsed ones as FAIL with their step; each cell
is tested against its baseline (LN; UN as configured for sweeps and ablations) by Welch's
t-test, marked after Holm's correction over the table's comparisons too (a side of one run:
the difference alone); it prints how many runs it read and skipped, naming each broken
record (``analysis.runs.broken_records``); a dagger marks cells produced at CPU scale on the embedded digits rather than the paper's data.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import project_env  # noqa: F401  (first: the project's Python, whatever `python` ran this)

import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # analysis/ from a plain checkout
COMMITTED_RUNS = ROOT / "results" / "runs"
COMMITTED_TABLES = ROOT / "results" / "tables"

from analysis import headline, pages, test_time  # noqa: E402
from analysis.runs import broken_text, load_runs, runs_read  # noqa: E402
from analysis.tables import to_latex, to_markdown  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=Path, nargs="+", default=[COMMITTED_RUNS],
                        help="run folders, searched for result.json (default: the committed runs)")
    parser.add_argument("--paper", type=Path, default=ROOT / "results" / "paper" / "tables.yaml")
    parser.add_argument("--benchmarks", type=Path, default=ROOT / "results" / "benchmarks")
    parser.add_argument("--studies", type=Path, default=ROOT / "results",
                        help="the folder of the studies kept apart from --runs: optimizer/ (issue "
                             "49), test_time/ (the shift benchmark's runs and evaluations) and "
                             "signal/ (signal propagation at initialisation)")
    parser.add_argument("--out", type=Path, default=COMMITTED_TABLES,
                        help="where tables.md and tables.tex go (default: the committed tables, "
                             "written only from the committed runs)")
    args = parser.parse_args()
    if not args.paper.exists():
        sys.exit(f"paper numbers not found at {args.paper}")
    missing = [str(folder) for folder in args.runs if not folder.is_dir()]
    if missing:
        sys.exit(f"--runs: no such folder: {', '.join(missing)}")
    if args.out.resolve() == COMMITTED_TABLES and [r.resolve() for r in args.runs] != [COMMITTED_RUNS]:
        sys.exit(f"{COMMITTED_TABLES} holds the tables of the committed runs ({COMMITTED_RUNS}) "
                 "alone; give these runs' tables a folder of their own: --out <folder>")
    runs = [run for folder in args.runs for run in load_runs(folder)]
    paper = yaml.safe_load(args.paper.read_text())
    tables = pages.all_tables(paper, runs, args.benchmarks, args.studies)
    rows = headline.headline_rows(runs, paper)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "tables.md").write_text(to_markdown(tables, runs))
    (args.out / "tables.tex").write_text(to_latex(tables))
    print(f"{runs_read(runs)} -> {args.out}: tables.md, tables.tex")
    if broken_text(runs):
        print(broken_text(runs), file=sys.stderr)
    if rows:
        (args.out / "headline.md").write_text(headline.page(rows))
        headline.forest(rows, args.out / headline.FIGURE)
        print(f"UN against LN on {len(rows)} testbeds -> headline.md, {headline.FIGURE}")
    else:
        print("no headline: no testbed has two learned runs of both LN and UN")
    shifted = test_time.load(args.studies / "test_time") if (args.studies / "test_time").is_dir() else []
    if test_time.figure(shifted, args.out / test_time.FIGURE):
        print(f"the shift benchmark's {len(shifted)} runs -> {test_time.FIGURE}")
    if args.out.resolve() == COMMITTED_TABLES:  # the pages that quote them
        for page, text in pages.regenerated(ROOT, tables, rows).items():
            page.write_text(text)
            print(f"updated {page.relative_to(ROOT)}")


if __name__ == "__main__":
    main()
