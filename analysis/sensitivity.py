"""Learning-rate sensitivity (Wortsman et al., "Small-scale proxies for large-scale Transformer
training instabilities", 2023): how much worse than its best a setting ends, on average over a
log-spaced ladder of learning rates. Reads the ladder's run records (``analysis.runs.ladder``).

Wortsman et al. define it as E over rates of min(loss(rate), loss at initialisation) minus the
best loss. Here the bound is the testbed's chance level (the records' own chance rule: a run
that learned nothing counts as one, whether it collapsed or finished at chance), for any metric
(a loss bounded above, top-1 or BLEU below), and a collapsed run (FAIL) counts at the bound. A
rate's value is the mean over its seeds; the best is the best rate's; the interval is a
percentile bootstrap over the seeds within each rate.

    python -m analysis.sensitivity --best DIR [DIR ...]

prints, for the runs under the folders, each setting's best rate as ``<run-name prefix>
<multiple>`` (the prefix: a run folder's name less ``-lr<m>x`` and ``-s<seed>``), which
``scripts/reproduce_cpu.sh`` reads to add a third seed there.
"""
from __future__ import annotations

import argparse
import re
import statistics
from pathlib import Path
from typing import Optional

import numpy as np

from .runs import LOWER_IS_BETTER, TASK_METRIC, ladder, load_runs

#: a ladder of at least this many rates gives a sensitivity (Wortsman et al. sweep 7)
MIN_RATES = 7
BOOTSTRAP_SAMPLES = 2000
_RUN_NAME = re.compile(r"^(?P<prefix>.+?)(-lr(?P<multiple>[0-9.e+-]+)x)?-s(?P<seed>\d+)$")


def chance_bound(settings: dict[str, dict[float, list[dict]]], metric: str) -> float:
    """The testbed's chance level for ``metric`` (a ladder's ``{setting: {multiple: [runs]}}``):
    the threshold of the records' chance rule."""
    runs = [r for points in settings.values() for cell in points.values() for r in cell]
    bounds = {r["chance"]["threshold"] for r in runs
              if (r.get("chance") or {}).get("metric") == metric}
    if len(bounds) != 1:
        raise ValueError(f"the runs give {len(bounds)} chance thresholds for {metric} "
                         f"({sorted(bounds)}); a sensitivity needs the testbed's one (records "
                         f"written since the chance rule have it in result.json's 'chance')")
    return bounds.pop()


def bounded(run: dict, metric: str, bound: float) -> float:
    """A run's metric no worse than the chance level; a collapse counts at it."""
    if run["status"] == "FAIL" or metric not in run.get("metrics", {}):
        return bound
    value = run["metrics"][metric]
    return min(value, bound) if metric in LOWER_IS_BETTER else max(value, bound)


def _summary(values: dict[float, list[float]], lower: bool) -> tuple[float, float]:
    """(best rate, sensitivity) of per-rate bounded values."""
    means = {m: statistics.fmean(v) for m, v in values.items()}
    best = (min if lower else max)(means, key=means.get)
    gaps = [abs(mean - means[best]) for mean in means.values()]
    return best, statistics.fmean(gaps)


def sensitivity(points: dict[float, list[dict]], metric: str, bound: float, stream: int = 0) -> dict:
    """``{"best": multiple, "value": the best rate's mean, "sensitivity": s, "interval": (lo,
    hi), "draws": the bootstrap's sensitivities, "rates": n}`` of a setting's ladder;
    ``sensitivity``, ``interval`` and ``draws`` are None with fewer than ``MIN_RATES`` rates.
    ``stream`` seeds the bootstrap (settings compared by ``difference_interval`` need
    independent ones)."""
    lower = metric in LOWER_IS_BETTER
    values = {m: [bounded(r, metric, bound) for r in runs] for m, runs in points.items() if runs}
    best, lrs = _summary(values, lower)
    out = {"best": best, "value": statistics.fmean(values[best]), "rates": len(values),
           "sensitivity": None, "interval": None, "draws": None}
    if len(values) < MIN_RATES:
        return out
    rng = np.random.default_rng(stream)  # the same interval on every regeneration
    draws = []
    for _ in range(BOOTSTRAP_SAMPLES):
        resampled = {m: list(rng.choice(v, size=len(v))) for m, v in values.items()}
        draws.append(_summary(resampled, lower)[1])
    low, high = np.percentile(draws, [2.5, 97.5])
    out.update(sensitivity=lrs, interval=(float(low), float(high)), draws=np.array(draws))
    return out


def difference_interval(ours: dict, theirs: dict) -> tuple[float, float]:
    """95% percentile bootstrap interval of ``ours``' sensitivity minus ``theirs``' (two
    ``sensitivity`` results with independent streams): an interval without 0 is a difference."""
    low, high = np.percentile(ours["draws"] - theirs["draws"], [2.5, 97.5])
    return float(low), float(high)


def best_rates(runs: list[dict]) -> dict[str, float]:
    """Each ladder setting's best rate, by the run-name prefix its runs share."""
    out = {}
    for (task, _, _), settings in ladder(runs).items():
        metric = TASK_METRIC[task]
        bound = chance_bound(settings, metric)
        for points in settings.values():
            prefixes = {run_prefix(r) for rs in points.values() for r in rs} - {None}
            best = sensitivity(points, metric, bound)["best"]
            for prefix in prefixes:
                out[prefix] = best
    return out


def run_prefix(run: dict) -> Optional[str]:
    """The run's folder name less its ``-lr<m>x`` and ``-s<seed>`` (None for another naming)."""
    match = _RUN_NAME.match(Path(run.get("run_dir") or run["_path"]).name)
    return match["prefix"] if match else None



def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--best", type=Path, nargs="+", required=True,
                        help="folders of run records (a grid's groups)")
    args = parser.parse_args(argv)
    runs = [r for folder in args.best if folder.exists() for r in load_runs(folder)]
    for prefix, multiple in sorted(best_rates(runs).items()):
        print(prefix, f"{multiple:g}")


if __name__ == "__main__":
    main()
