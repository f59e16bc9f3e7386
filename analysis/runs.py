"""Recorded runs (``result.json`` files) read back: what each run trained and how it ended.

Shared by ``scripts/make_tables.py`` and the analysis figures, so that a setting is named the
same way everywhere.
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Optional

# the paper's method names -> our norm names, in the paper's row order (rivals last)
METHOD_NORMS = {"LN": "ln", "RMSNorm": "rms", "PN_LS": "pn_ls", "NoNorm": "nonorm", "BN": "bn",
                "MABN": "mabn", "PN": "pn", "UN": "un", "DyT": "dyt", "PRepBN": "prepbn"}
NORM_METHODS = {norm: method for method, norm in METHOD_NORMS.items()}
STABILITY_KEY = "lr_multiple"  # the learning-rate ladder of the stability map
#: each task's headline metric, and the metrics where lower is better
TASK_METRIC = {"classification": "top1", "translation": "bleu", "detection": "bbox_AP",
               "language_modelling": "val_loss"}
LOWER_IS_BETTER = {"val_loss"}
#: Llama placements (model.norm_position) as the papers name them with their norm
PLACEMENT_NAMES = {"pre": "Pre", "post": "Post", "peri": "Peri", "mix": "Mix"}
# overrides that say how a run was made, not what was trained
RUN_MECHANICS = ("exp", "scale", "logger", "record_statistics", "record_gns", "seed", "device", "resume",
                 "hydra")


def load_runs(root: Path) -> list[dict]:
    """Every ``result.json`` under ``root``, in path order."""
    runs = []
    for path in sorted(Path(root).rglob("result.json")):
        run = json.loads(path.read_text())
        run["_path"] = str(path.parent)
        runs.append(run)
    return runs


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
    """The run's overrides that change what it trains (not how it was launched), sorted."""
    return sorted(item for item in run.get("overrides", [])
                  if not item.lstrip("+").startswith(RUN_MECHANICS + ignore))


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
