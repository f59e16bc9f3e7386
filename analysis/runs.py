"""Recorded runs (``result.json`` files) read back: what each run trained and how it ended.

Shared by ``scripts/make_tables.py`` and the analysis figures, so that a setting is named the
same way everywhere.
"""
from __future__ import annotations

import argparse
import json
import math
import sys
from functools import lru_cache
from pathlib import Path
from typing import Optional

import yaml

CONFIGS = Path(__file__).resolve().parents[1] / "configs"

# the paper's method names -> our norm names, in the paper's row order (rivals, then the
# literature's other norms, last)
METHOD_NORMS = {"LN": "ln", "RMSNorm": "rms", "PN_LS": "pn_ls", "NoNorm": "nonorm", "BN": "bn",
                "MABN": "mabn", "PN": "pn", "UN": "un", "DyT": "dyt", "PRepBN": "prepbn",
                "BCN": "bcn", "EvoNorm-B0": "evonorm_b0", "EvoNorm-S0": "evonorm_s0",
                "ScaleNorm": "scalenorm"}
NORM_METHODS = {norm: method for method, norm in METHOD_NORMS.items()}
#: the reproduction's groups whose records are kept apart from ``results/runs`` in
#: ``results/<group>`` (scripts/reproduce_cpu.sh's STUDIES), read by their own analyses
STUDIES = ("test_time", "optimizer", "graph", "sentiment_grid")
STABILITY_KEY = "lr_multiple"  # the learning-rate ladder of the stability map
#: each task's headline metric, and the metrics where lower is better
TASK_METRIC = {"classification": "top1", "translation": "bleu", "detection": "bbox_AP",
               "language_modelling": "val_loss"}
LOWER_IS_BETTER = {"val_loss"}
#: Llama placements (model.norm_position) as the papers name them with their norm
PLACEMENT_NAMES = {"pre": "Pre", "post": "Post", "peri": "Peri", "mix": "Mix"}
# overrides that say how a run was made, not what was trained (``+sweep=window_size`` launches
# the values its job records, e.g. ``norm.window_size=6``)
RUN_MECHANICS = ("exp", "scale", "logger", "record_statistics", "record_gns", "seed", "device", "resume",
                 "hydra", "sweep")


#: where a run recorded before Hydra composed the CPU scale (issue 45) put its CPU overrides:
#: ``recipe.cpu.lr=...`` then is ``recipe.lr=...`` (with scale=cpu) now
RETIRED_SCALE_PREFIXES = {"recipe.cpu.": "recipe.", "model.cpu.": "model."}


def load_runs(root: Path) -> list[dict]:
    """Every ``result.json`` under ``root``, in path order; overrides in today's spelling
    (``RETIRED_SCALE_PREFIXES``), so that a setting is one whenever its runs were made."""
    runs = []
    for path in sorted(Path(root).rglob("result.json")):
        try:
            run = json.loads(path.read_text())
        except json.JSONDecodeError as error:
            raise ValueError(f"{path} is not a whole result.json ({error}): the run writes it "
                             "atomically, so it was damaged after (a partial copy?); copy it "
                             "again from the run, or move the run folder out of the runs "
                             "read") from error
        run["_path"] = str(path.parent)
        if "overrides" in run:
            run["overrides"] = [current_spelling(item) for item in run["overrides"]]
        runs.append(run)
    return runs


def broken_metric(run: dict, metric: str) -> Optional[str]:
    """Why a run that learned gives no number for ``metric`` though one is expected (``top1
    missing``, ``top1 is 'n/a', not a number``), or None. Not broken: a number, or a metric
    not defined for the run, recorded null or, other than the task's own (``TASK_METRIC``,
    which every finished run records), left out, as COCO evaluation leaves out an area range
    without ground truth (``bbox_APl`` on shapes) and a box-only detector's mask AP."""
    metrics = run.get("metrics")
    if not isinstance(metrics, dict):
        return "no metrics"
    value = metrics.get(metric)
    if value is None:
        if metric != TASK_METRIC.get(run.get("task", "classification")):
            return None
        return f"{metric} {'null' if metric in metrics else 'missing'}"
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        return f"{metric} is {value!r}, not a number"
    return None


def broken_records(runs: list[dict]) -> dict[Path, tuple[bool, list[str]]]:
    """``{result.json: (skipped, whys)}`` for each run that learned (status ok) with a value
    ``broken_metric`` finds broken: its task's metric (then the run counts in no table:
    skipped) or any other it records, but the probes' flags and per-layer lists."""
    broken = {}
    for run in runs:
        if run.get("status") != "ok":
            continue
        task_metric = TASK_METRIC.get(run.get("task", "classification"))
        recorded = run.get("metrics") if isinstance(run.get("metrics"), dict) else {}
        others = [m for m, value in recorded.items()
                  if m != task_metric and not isinstance(value, (bool, list))]
        whys = [why for metric in [task_metric, *others] if (why := broken_metric(run, metric))]
        if whys:
            skipped = broken_metric(run, task_metric) is not None
            broken[Path(run["_path"]) / "result.json"] = (skipped, whys)
    return broken


def runs_read(runs: list[dict]) -> str:
    """``1361 runs read, none skipped`` (``broken_records``)."""
    skipped = sum(whole for whole, _ in broken_records(runs).values())
    return f"{len(runs)} runs read, {skipped or 'none'} skipped"


def broken_text(runs: list[dict]) -> str:
    """Each broken record (``broken_records``) named with why and the fix ("" without any)."""
    broken = broken_records(runs)
    if not broken:
        return ""
    return ("Broken records (status ok, but no number where one is expected), skipped whole "
            "where that is the task's metric, else counted in their cells as 'broken k/n': fix "
            "them from the run's metrics.jsonl, re-run them, or move their folders out of the "
            "runs read. " + "; ".join(f"{path}{' (skipped)' if whole else ''}: {', '.join(whys)}"
                                      for path, (whole, whys) in broken.items()))


def current_spelling(override: str) -> str:
    """``recipe.cpu.lr=1`` -> ``recipe.lr=1`` (``RETIRED_SCALE_PREFIXES``); others as given."""
    key = override.lstrip("+")
    plus = override[:len(override) - len(key)]
    for retired, current in RETIRED_SCALE_PREFIXES.items():
        if key.startswith(retired):
            return plus + current + key[len(retired):]
    return override


def figure_args(description: str, default_out: str, argv=None) -> argparse.Namespace:
    """``--runs`` (default results/runs) and ``--out`` (default results/analysis/<default_out>)
    of a figure drawn from recorded runs."""
    root = Path(__file__).resolve().parents[1]
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--runs", type=Path, default=root / "results" / "runs")
    parser.add_argument("--out", type=Path, default=root / "results" / "analysis" / default_out)
    return parser.parse_args(argv)


def override_value(run: dict, key: str) -> Optional[str]:
    """The value a run's command line gave ``key`` (``+key`` too), or None."""
    for item in run.get("overrides", []):
        name, _, value = item.partition("=")
        if name.lstrip("+") == key:
            return value
    return None


def changes(run: dict, ignore: tuple[str, ...] = ()) -> list[str]:
    """The run's overrides that change what it trains (not how it was launched), sorted. The
    norm a composed experiment chooses (``+exp=swin_t norm=bcn``) is the run's method, as in
    ``+exp=swin_t_bcn``, not a change to it."""
    return sorted(item for item in run.get("overrides", [])
                  if not item.lstrip("+").startswith(RUN_MECHANICS + ignore)
                  and item.partition("=")[0] != "norm")


def setting(run: dict, ignore: tuple[str, ...] = ()) -> str:
    """The run's method and the overrides that change what it trains, e.g.
    ``UN norm.bwd_ema=false``; a language model's placement names its method (``Post-LN``)."""
    method = NORM_METHODS.get(run.get("norm"), str(run.get("norm")))
    if "norm_position" in run:
        method = f"{PLACEMENT_NAMES[run['norm_position']]}-{method}"
        ignore += ("model.norm_position",)
    return " ".join([method, *changes(run, ignore)])


def option_value(run: dict, key: str):
    """What a run's norm option ``key`` (``norm.window_size``) was: the command line's value,
    else the one recorded in ``norm_options`` (the experiment's default)."""
    given = override_value(run, key)
    return given if given is not None else run.get("norm_options", {}).get(key.removeprefix("norm."))


@lru_cache(maxsize=None)
def _config(*parts: str) -> dict:
    return yaml.safe_load((CONFIGS.joinpath(*parts)).read_text())


def superseded_warmup(run: dict) -> bool:
    """Whether today's CPU rule would give the run a longer norm warm-up than it had: its
    warm-up (scaled, not given on the command line) ended before its running averages kept at
    most ``warmup_init_weight`` of their initial values (``configs/scale/cpu.yaml``), the floor
    ``plugins.scale.warmup_floor`` has set since issue 30. Such a record was made under the
    earlier rule and is re-run by ``scripts/reproduce_cpu.sh``."""
    from unnorm.base import forgotten_warmup  # here: importing analysis/ loads no torch

    options = run.get("norm_options") or {}
    warmup = options.get("warmup_iters")
    momenta = [value for key, value in options.items() if key.startswith("momentum")]
    if (run.get("scale") != "cpu" or not warmup or not momenta
            or override_value(run, "norm.warmup_iters") is not None
            or override_value(run, "scale.warmup_init_weight") is not None):
        return False
    weight = _config("scale", "cpu.yaml").get("warmup_init_weight")
    if weight is None:
        return False
    full = _config("norm", f"{run['norm']}.yaml")["warmup_iters"]
    return warmup < forgotten_warmup(warmup, full, momenta, weight)


def method_order(label: str) -> tuple:
    """Sort key putting settings in the paper's method order (placements: pre, post, peri,
    mix within a method)."""
    method = label.split(" ")[0]
    placement, _, norm = method.rpartition("-")
    places = [PLACEMENT_NAMES[p] for p in PLACEMENT_NAMES]
    place = places.index(placement) if placement in places else 0
    order = list(METHOD_NORMS)
    return (order.index(norm) if norm in order else len(order), place, label)


def where(run: dict) -> tuple:
    """``(task, model, data)``: what a run trained on, as the tables group runs."""
    return (run.get("task", "classification"), run.get("model"), run.get("exp_data"))


def micro_batch(run: dict) -> int:
    """The images (sequences) a classification run's norms saw per forward/backward. A record
    made before micro-batches (issue 33) has no ``micro_batch_size``: its run trained on whole
    batches, its config's (``config.yaml`` beside the record, the recipe as it ran)."""
    if "micro_batch_size" in run:
        return run["micro_batch_size"]
    config = yaml.safe_load((Path(run["_path"]) / "config.yaml").read_text())
    return config["recipe"]["batch_size"]


def ladder(runs: list[dict]) -> dict[tuple, dict[str, dict[float, list[dict]]]]:
    """The stability map's runs: ``{(task, model, data): {setting: {lr multiple: [runs]}}}``
    for every (task, model, data) and setting the ladder (``lr_multiple``) was run for; a run
    without ``lr_multiple`` counts at 1x."""
    laddered = {(where(r), setting(r, (STABILITY_KEY,))) for r in runs
                if override_value(r, STABILITY_KEY) is not None}
    points: dict = {}
    for run in runs:
        key = (where(run), setting(run, (STABILITY_KEY,)))
        if key in laddered:
            multiple = float(override_value(run, STABILITY_KEY) or 1)
            points.setdefault(key[0], {}).setdefault(key[1], {}).setdefault(multiple, []).append(run)
    return points


def main(argv=None) -> None:
    """``python -m analysis.runs --superseded RECORDS``: the records under RECORDS (its
    ``<group>/<run>`` folders, one per line) that today's CPU rule would train differently."""
    parser = argparse.ArgumentParser(description=main.__doc__.splitlines()[0])
    parser.add_argument("--superseded", type=Path, required=True, metavar="RECORDS")
    root = parser.parse_args(argv).superseded
    for run in load_runs(root) if root.exists() else []:
        if superseded_warmup(run):
            sys.stdout.write(f"{Path(run['_path']).relative_to(root)}\n")


if __name__ == "__main__":
    main()
