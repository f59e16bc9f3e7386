"""The optimiser meets the norm (issue 49; results/optimizer.md): AdamP against AdamW on
scale-invariant weights, and the normalizer-free baseline against NoNorm and LN, on the
learning-rate ladder; what AdamP projected and the effective steps, from the runs' records.

The study's own runs are ``results/optimizer`` (``in_study``), kept apart from ``results/runs``
so that they stay out of the other tables and their Holm corrections. Its AdamW baselines come
from ``results/runs``: the main and micro-batch runs at the recipe's rate, T2T-ViT's LN and
NoNorm at 3x and 10x from the stability runs, the LM's Pre-LN with qk-layernorm from the lm and
lm_stability runs. Every record of a setting counts, whichever group made it.
"""
from __future__ import annotations

import json
import statistics
from pathlib import Path
from typing import Optional

from analysis.runs import STABILITY_KEY, TASK_METRIC, changes, override_value
from analysis.significance import Cell, Comparisons, with_tests
from analysis.tables import Table

GROUP = "optimizer"
RATES = (1.0, 3.0, 10.0)
ADAMP = "optimizer=adamp"
#: the settings AdamP meets: label -> (norm, overrides besides the optimizer and the rate)
SCALE_INVARIANT = {"LN": ("ln", ()), "BCN + WS": ("bcn", ("ws=residual",)),
                   "WS alone": ("nonorm", ("ws=residual",))}
LM_SETTING = {"Pre-LN + qk-LN": ("ln", ("model.qk_norm=ln",))}
NF = ("nonorm", ("recipe.agc=0.01", "ws=nf"))
MODELS = {"t2t_vit_14": "T2T-ViT", "swin_t": "Swin-T", "llama_cpu": "LM"}


def in_study(run: dict) -> bool:
    """A run of the study's own group."""
    return Path(run.get("_path", "")).parent.name == GROUP


def pick(runs: list[dict], model: str, norm: str, overrides: tuple, rate: float) -> Cell:
    """The runs of ``model`` with ``norm`` whose changes are exactly ``overrides`` at ``rate``
    times the recipe's learning rate (a Swin-T normalizer-free run's ``recipe.clip_grad=null``,
    which AGC requires there, is not a change of its own)."""
    wanted = sorted(overrides)
    return Cell([r for r in runs if r.get("model") == model and r.get("norm") == norm
                 and float(override_value(r, STABILITY_KEY) or 1) == rate
                 and changes(r, (STABILITY_KEY, "recipe.clip_grad")) == wanted
                 and (override_value(r, "recipe.clip_grad") is None or "ws=nf" in overrides)])


def _metric(model: str) -> str:
    return TASK_METRIC["language_modelling" if model == "llama_cpu" else "classification"]


def adamp_table(runs: list[dict], model: str) -> Optional[Table]:
    """AdamP against AdamW, each setting at each rate."""
    metric = _metric(model)
    settings = LM_SETTING if model == "llama_cpu" else SCALE_INVARIANT
    comparisons, rows = Comparisons(), []
    for label, (norm, overrides) in settings.items():
        for rate in RATES:
            adamw = pick(runs, model, norm, overrides, rate)
            adamp = pick(runs, model, norm, (*overrides, ADAMP), rate)
            if not adamp.runs:
                continue
            rows.append([label, f"{rate:g}x", adamw.text(metric), adamp.text(metric),
                         ("", comparisons.add(adamp.values(metric), adamw.values(metric), metric))])
    if not rows:
        return None
    return Table(f"Optimizer: AdamP against AdamW, {MODELS[model]}, {metric} by learning-rate multiple",
                 ["setting", "lr", "AdamW", "AdamP", "AdamP - AdamW"], with_tests(rows, comparisons),
                 ["AdamP with the release's defaults (delta 0.1, wd_ratio 0.1, no Nesterov; "
                  "configs/optimizer/adamp.yaml); AdamW the recipe's. Every record of a setting "
                  "counts, whichever group made it.", comparisons.note()])


def nf_table(runs: list[dict], model: str) -> Optional[Table]:
    """The normalizer-free baseline (scaled WS and AGC, no norm) against NoNorm and LN."""
    metric = _metric(model)
    comparisons, rows = Comparisons(), []
    for rate in RATES:
        nf = pick(runs, model, *NF, rate)
        if not nf.runs:
            continue
        nonorm, ln = pick(runs, model, "nonorm", (), rate), pick(runs, model, "ln", (), rate)
        rows.append([f"{rate:g}x", ln.text(metric), nonorm.text(metric), nf.text(metric),
                     ("", comparisons.add(nf.values(metric), nonorm.values(metric), metric)),
                     ("", comparisons.add(nf.values(metric), ln.values(metric), metric))])
    if not rows:
        return None
    return Table(f"Optimizer: the normalizer-free baseline, {MODELS[model]}, {metric} by "
                 "learning-rate multiple",
                 ["lr", "LN", "NoNorm", "NF (scaled WS + AGC 0.01)", "NF - NoNorm", "NF - LN"],
                 with_tests(rows, comparisons),
                 ["NF: norm=nonorm ws=nf recipe.agc=0.01 (Swin-T: recipe.clip_grad=null, AGC "
                  "instead of the recipe's global-norm clipping), AdamW.", comparisons.note()])


def _epochs(run: dict) -> list[dict]:
    path = Path(run["_path"]) / "metrics.jsonl"
    if not path.exists():
        return []
    return [row for row in map(json.loads, path.read_text().splitlines()) if "effective_step" in row]


def matrix_group(row: dict) -> int:
    """The param group of the body's weight matrices: the largest (the trainers group biases,
    norms and tokens apart, and a classifier's head)."""
    groups = row["param_groups"]
    return max(range(len(groups)), key=lambda i: groups[i]["parameters"])


def _mean(values: list[float], digits: int) -> str:
    if not values:
        return "—"
    spread = f" ± {statistics.stdev(values):.{digits}f}" if len(values) > 1 else ""
    return f"{statistics.mean(values):.{digits}f}{spread}"


def updates_table(runs: list[dict], model: str) -> Optional[Table]:
    """What the records say of each AdamP and AdamW run of the study: the weights exactly
    scale-invariant at the start, AdamP's projections per update, and the effective step of
    the body's weight matrices (``matrix_group``), in the first and last epochs."""
    settings = LM_SETTING if model == "llama_cpu" else SCALE_INVARIANT
    rows = []
    for label, (norm, overrides) in settings.items():
        for rate in RATES:
            for name, extra in (("AdamW", ()), ("AdamP", (ADAMP,))):
                cell = [r for r in pick(runs, model, norm, (*overrides, *extra), rate).runs
                        if "scale_invariant" in r and _epochs(r) and "param_groups" in _epochs(r)[0]]
                if not cell:
                    continue
                invariant = [r["scale_invariant"]["counts"] for r in cell]
                epochs = [_epochs(r) for r in cell]
                rows.append([
                    label, f"{rate:g}x", name, str(len(cell)),
                    _mean([c["row"] for c in invariant], 1) + " / " + _mean([c["tensor"] for c in invariant], 1),
                    _mean([e[0]["projection"]["tensors"] for e in epochs], 1) + " / "
                    + _mean([e[-1]["projection"]["tensors"] for e in epochs], 1),
                    _mean([1e3 * e[0]["effective_step"][matrix_group(e[0])] for e in epochs], 2) + " / "
                    + _mean([1e3 * e[-1]["effective_step"][matrix_group(e[-1])] for e in epochs], 2)])
    if not rows:
        return None
    return Table(f"Optimizer: scale invariance and effective steps, {MODELS[model]}",
                 ["setting", "lr", "optimizer", "runs", "invariant weights at start: row / tensor",
                  "projected tensors per update: first / last epoch",
                  "effective step x 1e3, weight matrices: first / last epoch"], rows,
                 ["From the runs that recorded them (record_scale_invariance, record_updates: "
                  "the study's own runs): mean ± std over runs. Invariant weights: "
                  "unnorm.scale_invariance at the start (row: each output row's scale; tensor: "
                  "the whole weight's). Projected tensors: AdamP's projections per update, the "
                  "epoch's mean. Effective step: the epoch's mean of ||dw|| / ||w|| over the "
                  "largest param group (the body's weight matrices). Descriptive: no test in this table."])


def tables(runs: list[dict]) -> list[Table]:
    """The study's tables per model, where its runs exist."""
    if not any(in_study(r) for r in runs):
        return []
    out = []
    for model in MODELS:
        for build in (adamp_table, nf_table, updates_table):
            table = build(runs, model)
            if table is not None:
                out.append(table)
    return out
