"""The results pages' generated parts, so that no table on a page is typed by hand.

A page names the tables it opens with in a block::

    <!-- generated: Table 2:; CPU-scale settings: swin_t -->
    <!-- end generated -->

and ``fill`` writes every table whose title starts with one of the names between the two
lines. The front pages (README.md, results/README.md) open with the headline, found by its
first words, with no marker (``analysis.headline.readme_with``). ``scripts/make_tables.py`` rewrites
both with the committed tables; ``tests/test_pages.py`` fails when a page differs from what
the records give.
"""
from __future__ import annotations

import re
from pathlib import Path

from analysis import graphs, headline, optimizer, sentiment_grid, signal, test_time
from analysis.runs import load_runs
from analysis.tables import Table, build_tables, table_markdown

BLOCK = re.compile(r"(<!-- generated: (.*?) -->\n).*?(<!-- end generated -->)", re.S)


def all_tables(paper: dict, runs: list[dict], benchmarks: Path, studies: Path) -> list[Table]:
    """Every table ``make_tables.py`` writes: the paper's and the studies' from the runs
    (``build_tables``), then those of the studies kept apart in ``studies``: the optimizer
    study (``studies/optimizer``, beside the runs it compares with) and the shift benchmark
    (``studies/test_time``), signal propagation at initialisation (``studies/signal``), the
    graph task (``studies/graph``) and the course study's sentiment grid
    (``studies/sentiment_grid``)."""
    apart = load_runs(studies / optimizer.GROUP) if (studies / optimizer.GROUP).is_dir() else []
    shifted = test_time.load(studies / "test_time") if (studies / "test_time").is_dir() else []
    probed = signal.load(studies / "signal") if (studies / "signal").is_dir() else []
    graphed = graphs.load(studies / "graph") if (studies / "graph").is_dir() else []
    graded = (sentiment_grid.read_grid(studies / sentiment_grid.GROUP)
              if (studies / sentiment_grid.GROUP).is_dir() else {})
    return (build_tables(paper, runs, benchmarks) + optimizer.tables(runs + apart)
            + test_time.tables(shifted) + signal.tables(probed) + graphs.tables(graphed)
            + sentiment_grid.tables(graded, sentiment_grid.read_study(studies / sentiment_grid.STUDY)))


def fill(text: str, tables: list[Table]) -> str:
    """``text`` with every generated block holding the tables it names."""
    def tables_of(match: re.Match) -> str:
        lines = []
        for prefix in (name.strip() for name in match.group(2).split(";")):
            found = [table for table in tables if table.title.startswith(prefix)]
            if not found:
                raise ValueError(f"a generated block names {prefix!r}, which starts no table's "
                                 f"title: see results/tables/tables.md for the titles")
            for table in found:
                lines += table_markdown(table, "####")
        return match.group(1) + "\n".join(lines) + match.group(3)
    return BLOCK.sub(tables_of, text)


def pages(root: Path) -> list[Path]:
    """The results pages: ``results/*.md``."""
    return sorted((root / "results").glob("*.md"))


def regenerated(root: Path, tables: list[Table], rows: list[headline.Row]) -> dict[Path, str]:
    """Every page whose generated parts the records change, with its new text."""
    out = {}
    for page in pages(root) + [root / "README.md"]:
        text = new = page.read_text()
        if page.name == "README.md":  # the project's and the results' front pages
            figure = Path("tables" if page.parent.name == "results" else "results/tables")
            try:
                new = headline.readme_with(new, rows, str(figure / headline.FIGURE))
            except ValueError as error:
                raise ValueError(f"{page}: {error}") from None
        try:
            new = fill(new, tables)
        except ValueError as error:
            raise ValueError(f"{page}: {error}") from None
        if new != text:
            out[page] = new
    return out
