"""The paper's Tables 1-10 from recorded runs, beside the paper's numbers, as Markdown and
LaTeX (``scripts/make_tables.py`` writes them). Reads run records and benchmark records only."""
from __future__ import annotations

import json
import re
import statistics
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

from analysis.runs import (LOWER_IS_BETTER, METHOD_NORMS, NORM_METHODS, PLACEMENT_NAMES, STABILITY_KEY,
                           TASK_METRIC, broken_text, changes, ladder, method_order, micro_batch,
                           option_value, override_value, runs_read, setting, where)
from analysis.sensitivity import (BOOTSTRAP_SAMPLES, MIN_RATES, chance_bound, difference_interval,
                                  sensitivity)
from analysis.significance import CELL_NOTES, DIGITS, Cell, Comparisons, select, with_tests

#: the ways of training through the norms (sam=..., train_only=...): tabled on their own
TRAINING_THROUGH_NORMS = ("sam=", "train_only=")
CPU_NOTE = ("† CPU scale (scale=cpu) on the project's small data (digits, synthetic corpus, "
            "generated shapes), not the paper's dataset or schedule. Ours are named by the "
            "experiment, as the paper's model and dataset ('swin_t imagenet'), and by the data "
            "they ran on where that is another ('run on digits'; a column: 'ours on digits').")


SUPERSEDED_NOTE = ("‡ with runs whose norm warm-up ended before its running averages had "
                   "forgotten their initial values: made under the CPU rule before its warm-up "
                   "floor (configs/scale/cpu.yaml, warmup_init_weight), re-run by "
                   "scripts/reproduce_cpu.sh; `python -m analysis.runs --superseded "
                   "results/runs/cpu` lists them.")


def is_default(run: dict) -> bool:
    """A run of an experiment as configured: no override changes what it trains (a sweep, an
    ablation, a rate, Weight Standardization, ...)."""
    return not changes(run)


def paper_text(value) -> str:
    """A paper's number as printed; its FAIL says whose, beside ours (``FAIL 1/3 (step 50)``)."""
    return "—" if value is None else "FAIL (paper)" if value == "FAIL" else str(value)


@dataclass
class Table:
    title: str
    header: list[str]
    rows: list[list[str]]
    notes: list[str] = field(default_factory=list)


def method_table(title, paper: dict, runs, columns: dict, task: str) -> Table:
    """Rows: methods; each cell "paper / ours". ``columns``: name -> (model, data, metric), the
    paper's column and the runs of ours for it, whose header names the data they ran on."""
    cells = {(norm, column): select(runs, task=lambda r: r.get("task") == task,
                                    norm=lambda r, n=norm: r.get("norm") == n,
                                    model=lambda r, m=model: m is None or r.get("model") == m,
                                    data=lambda r, d=data: r.get("exp_data") == d,
                                    default=is_default)
             for norm in METHOD_NORMS.values() for column, (model, data, _) in columns.items()}
    header = ["method"]
    for column in columns:
        ran = [r for norm in METHOD_NORMS.values() for r in cells[(norm, column)].runs]
        header.append(f"{column} (ours on {data_ran(ran)})" if ran else column)
    comparisons = Comparisons()
    rows = []
    for method, norm in METHOD_NORMS.items():
        row = [method]
        for column, (_, _, metric) in columns.items():
            cell = cells[(norm, column)]
            text = f"{paper_text(paper.get(method, {}).get(column))} / {cell.text(metric)}"
            row.append(text if norm == "ln" else
                       (text, comparisons.add(cell.values(metric), cells[("ln", column)].values(metric),
                                              metric)))
        if any(_text(cell) != "— / —" for cell in row[1:]):
            rows.append(row)
    return Table(title, header, with_tests(rows, comparisons, "; vs LN "),
                 ["Each cell: paper (on the column's dataset) / ours (on the data the header "
                  "names); vs LN: our difference from LN's runs in the column.",
                  comparisons.note()])


def data_ran(runs: list[dict]) -> str:
    """The data ``runs`` trained on (result.json's ``data``: ``digits`` at CPU scale), which
    the tables name beside the experiment's dataset they group runs by (``exp_data``)."""
    return ", ".join(sorted({str(r.get("data", "unrecorded data")) for r in runs}))


def ran_on(place: tuple, runs: list[dict]) -> str:
    """``, run on digits``: the data a place's runs trained on, where that is not the
    experiment's dataset that names the place (``swin_t imagenet``: the paper's); "" where
    it is."""
    data = data_ran(runs)
    return "" if data == place[2] else f", run on {data}"


def place_name(place: tuple) -> str:
    """``swin_t imagenet``: a place's model and its experiment's dataset, as the tables (and
    the prose's table titles) name it."""
    return f"{place[1]} {place[2]}"


def _text(cell) -> str:
    return cell if isinstance(cell, str) else cell[0]


#: what the paper measured under each key of its sweep and ablation tables (tables.yaml), in
#: our names: (model, dataset, metric); Tables 5, 6 and 10's COCO numbers are Mask R-CNN 1x's
PAPER_MEASURES = {"box_AP": ("mask_rcnn_swin_t", "coco", "bbox_AP"),
                  "mask_AP": ("mask_rcnn_swin_t", "coco", "segm_AP"),
                  "bleu": ("transformer_iwslt_de_en", "iwslt14", "bleu"),
                  "t2t_vit_14_imagenet": ("t2t_vit_14", "imagenet", "top1"),
                  "swin_t_imagenet": ("swin_t", "imagenet", "top1"),
                  "faster_rcnn_box_AP": ("faster_rcnn_swin_t", "coco", "bbox_AP"),
                  "mask_rcnn_box_AP": ("mask_rcnn_swin_t", "coco", "bbox_AP"),
                  "mask_rcnn_mask_AP": ("mask_rcnn_swin_t", "coco", "segm_AP")}


def paper_measure(key: str) -> tuple[str, str, str]:
    """``PAPER_MEASURES[key]``, or an error saying where to add a new key's."""
    if key not in PAPER_MEASURES:
        raise ValueError(f"results/paper/tables.yaml: {key!r} has no entry in "
                         f"analysis.tables.PAPER_MEASURES; add the model, dataset and metric "
                         f"the paper measured under it")
    return PAPER_MEASURES[key]


def paper_label(key: str) -> str:
    """``paper: mask_rcnn_swin_t coco bbox_AP``, as ours read ``ours: swin_t imagenet top1``."""
    return "paper: " + " ".join(paper_measure(key))


def metrics_note(keys: list[str], ours: list[tuple], across: str) -> str:
    """A table's note where some of ``ours`` (``(place, metric)``) measure a model or metric
    none of the paper's numbers (``keys``) do, so that the two are read apart ("" where
    every one of ours has a paper counterpart)."""
    paper = {(model, metric) for model, _, metric in map(paper_measure, keys)}
    other = [f"{place_name(place)} {metric}" for place, metric in ours if (place[1], metric) not in paper]
    if not other:
        return ""
    return (f"Not the paper's metric: {', '.join(other)} of ours {'is' if len(other) == 1 else 'are'} "
            f"another model or metric than the paper's numbers beside "
            f"{'it' if len(other) == 1 else 'them'} ({', '.join(' '.join(paper_measure(k)) for k in keys)}): "
            f"compare how each changes across {across}, not the numbers.")


def sweep_table(title, values: list, paper_rows: dict, runs, key: str) -> Table:
    """Columns: the swept values; rows: the paper's (``paper_rows``: its key in tables.yaml ->
    numbers), then ours: UN runs that change nothing but ``key`` (the experiment's own runs
    count at their configured value), a row per (task, model, data) where ``key`` was swept,
    in that task's metric; each row names its model and metric."""
    header = [key] + [str(v) for v in values]
    rows = [[paper_label(name)] + [paper_text(v) for v in numbers] for name, numbers in paper_rows.items()]
    unswept = [r for r in runs if r.get("norm") == "un" and override_value(r, STABILITY_KEY) is None
               and all(item.lstrip("+").startswith(key) for item in changes(r))]
    swept = {where(r) for r in unswept if override_value(r, key) is not None}
    comparisons = Comparisons()
    for place in sorted(swept):
        metric = TASK_METRIC[place[0]]
        group = [r for r in unswept if where(r) == place]
        default = Cell([r for r in group if not changes(r)]).values(metric)
        row: list = [f"ours: {place_name(place)} {metric}{ran_on(place, group)}"]
        for v in values:
            cell = Cell([r for r in group if _same(option_value(r, key), v)])
            has_default = any(not changes(r) for r in cell.runs)
            row.append(cell.text(metric) if has_default or not cell.runs else
                       (cell.text(metric), comparisons.add(cell.values(metric), default, metric)))
        rows.append(row)
    return Table(title, header, with_tests(rows, comparisons, "; vs default "),
                 [f"ours: vs default: against UN as configured (the column holding its runs). "
                  f"{comparisons.note()}",
                  metrics_note(list(paper_rows), [(place, TASK_METRIC[place[0]]) for place in sorted(swept)],
                               key)])


def _same(text: Optional[str], value) -> bool:
    if text is None:
        return False
    try:
        return float(text) == float(value)
    except ValueError:
        return text.lower() == str(value).lower()


def ablation_table(title, paper_rows: list, metrics: list[str], runs) -> Table:
    """Rows: the paper's component experiments, its numbers under ``metrics`` (keys of
    tables.yaml); ours: a column per (task, model, data) of UN runs with
    ``+ablation=un_expN`` (Exp1, every component on, is the experiment's default). Each
    column names its model and metric."""
    un = [r for r in runs if r.get("norm") == "un" and override_value(r, STABILITY_KEY) is None]
    groups = sorted({where(r) for r in un if override_value(r, "ablation")})
    header = (["exp", "fwd_gm", "bwd_am", "bwd_ema"] + [paper_label(m) for m in metrics]
              + [f"ours: {place_name(place)} {TASK_METRIC[place[0]]}"
                 f"{ran_on(place, [r for r in un if where(r) == place])}" for place in groups])
    comparisons = Comparisons()
    rows = []
    for item in paper_rows:
        row: list = [str(item[k]) for k in ("exp", "fwd_gm", "bwd_am", "bwd_ema")]
        row += [paper_text(item.get(m)) for m in metrics]
        wanted = [] if item["exp"] == 1 else [f"+ablation=un_exp{item['exp']}"]
        for place in groups:
            metric = TASK_METRIC[place[0]]
            cell = Cell([r for r in un if where(r) == place and changes(r) == wanted])
            default = Cell([r for r in un if where(r) == place and not changes(r)])
            row.append(cell.text(metric) if not wanted or not cell.runs else
                       (cell.text(metric), comparisons.add(cell.values(metric), default.values(metric),
                                                           metric)))
        rows.append(row)
    return Table(title, header, with_tests(rows, comparisons, "; vs Exp1 "),
                 [f"ours: vs Exp1: against UN as configured (every component on). {comparisons.note()}",
                  metrics_note(metrics, [(place, TASK_METRIC[place[0]]) for place in groups],
                               "the experiments")])


def stability_tables(runs: list[dict]) -> list[Table]:
    """The stability map: per model, every setting at each learning-rate multiple, as the
    collapsed fraction and the mean metric of the runs that did not collapse."""
    tables = []
    for place, settings in sorted(ladder(runs).items()):
        task, metric = place[0], TASK_METRIC[place[0]]
        multiples = sorted({m for cells in settings.values() for m in cells})
        comparisons = Comparisons(DIGITS.get(metric, 1))
        reference = reference_method(task)
        rows = []
        for label in sorted(settings, key=method_order):
            row: list = [label]
            ours = reference_setting(label, reference, settings)
            for m in multiples:
                cell = Cell(settings[label].get(m, []))
                baseline = Cell(settings.get(ours, {}).get(m, []))
                row.append(cell.text(metric) if label == ours or not cell.runs else
                           (cell.text(metric), comparisons.add(cell.values(metric), baseline.values(metric))))
            rows.append(row)
        tables.append(Table(f"Stability: {place_name(place)}, {metric} by learning-rate multiple"
                            f"{ran_on(place, on_ladder(settings))}",
                            ["setting"] + [f"{m:g}x lr" for m in multiples],
                            with_tests(rows, comparisons, f"; vs {reference} "),
                            ["FAIL k/n (step ...): k of n seeds collapsed, at those steps; "
                             "chance k/n: k finished no better than chance; the number is the mean "
                             f"of the others. vs {reference}: against {reference} at the same multiple "
                             "(with the row's overrides where it was run with them).",
                             comparisons.note()]))
    return tables


def sensitivity_tables(runs: list[dict]) -> list[Table]:
    """Learning-rate sensitivity per model (``analysis.sensitivity``): each setting's best rate,
    its result there, its sensitivity with a bootstrap interval, and the comparison with the
    reference (LN, Pre-LN) at each one's own best rate beside the one at the recipe's rate."""
    tables = []
    for place, settings in sorted(ladder(runs).items()):
        task, metric = place[0], TASK_METRIC[place[0]]
        digits = DIGITS.get(metric, 1)
        bound = chance_bound(settings, metric)
        reference = reference_method(task)
        summaries = {label: sensitivity(settings[label], metric, bound, stream)
                     for stream, label in enumerate(sorted(settings, key=method_order))}
        comparisons = Comparisons(digits)
        rows = []
        for label in sorted(settings, key=method_order):
            summary, points = summaries[label], settings[label]
            at_best = Cell(points[summary["best"]])
            lrs = summary["sensitivity"]
            row: list = [label, f"{summary['best']:g}x", at_best.text(metric),
                         "—" if lrs is None else f"{lrs:.{digits}f} [{summary['interval'][0]:.{digits}f}, "
                                                 f"{summary['interval'][1]:.{digits}f}]"]
            ours = reference_setting(label, reference, settings)
            if label == ours or ours not in settings:
                row += ["—", "—", "—"]
            else:
                theirs = settings[ours]
                if lrs is None or summaries[ours]["sensitivity"] is None:
                    row.append("—")
                else:
                    low, high = difference_interval(summary, summaries[ours])
                    row.append(f"{lrs - summaries[ours]['sensitivity']:+.{digits}f} "
                               f"[{low:+.{digits}f}, {high:+.{digits}f}]{'*' if low > 0 or high < 0 else ''}")
                row += [("", comparisons.add(at_best.values(metric),
                                             Cell(theirs[summaries[ours]["best"]]).values(metric))),
                        ("", comparisons.add(Cell(points.get(1.0, [])).values(metric),
                                             Cell(theirs.get(1.0, [])).values(metric)))]
            rows.append(row)
        worse = "above" if metric in LOWER_IS_BETTER else "below"
        tables.append(Table(
            f"Learning-rate sensitivity: {place_name(place)}, {metric}{ran_on(place, on_ladder(settings))}",
            ["setting", "best rate", f"{metric} at the best rate",
             "sensitivity [95% bootstrap]", f"sensitivity vs {reference} [95% bootstrap]",
             f"vs {reference}, each at its best", f"vs {reference} at 1x"],
            with_tests(rows, comparisons),
            [f"Sensitivity (Wortsman et al. 2023): the mean over the ladder's rates of how far "
             f"{worse} its best a setting ends, each run bounded at the chance level "
             f"({metric} {bound:.{digits}f}; a collapse counts there); '—' with fewer than "
             f"{MIN_RATES} rates. Intervals: percentile bootstrap over the seeds within each rate "
             f"({BOOTSTRAP_SAMPLES} resamples); * on a difference: its interval excludes 0 "
             f"(uncorrected for the table's number of intervals). "
             f"Rates are multiples of the recipe's.", comparisons.note()]))
    return tables


ATTENTION_LOGIT = "max_attn_logit"  # the language model's largest attention logit (plugins/lm/attention.py)


def attention_logit_tables(runs: list[dict]) -> list[Table]:
    """Wortsman et al.'s (2023) instability signal on each language-model ladder: the largest
    attention logit at the final evaluation, per setting and learning-rate multiple (the median
    over the seeds that recorded it, whatever their status, with their largest)."""
    tables = []
    for place, settings in sorted(ladder(runs).items()):
        if not any(ATTENTION_LOGIT in r["metrics"] for r in on_ladder(settings)):
            continue
        multiples = sorted({m for cells in settings.values() for m in cells})
        rows = []
        for label in sorted(settings, key=method_order):
            row = [label]
            for m in multiples:
                group = settings[label].get(m, [])
                logits = [r["metrics"][ATTENTION_LOGIT] for r in group if ATTENTION_LOGIT in r["metrics"]]
                ended = [r["status"] for r in group if ATTENTION_LOGIT in r["metrics"]]
                others = ", ".join(f"{status} {ended.count(status)}" for status in ("chance", "FAIL")
                                   if status in ended)
                row.append(f"{statistics.median(logits):.3g} (max {max(logits):.3g}, n={len(logits)}"
                           f"{'; ' + others if others else ''})" if logits else "—")
            if any(cell != "—" for cell in row[1:]):
                rows.append(row)
        tables.append(Table(f"Attention logits: {place_name(place)}, the largest at the end by "
                            f"learning-rate multiple{ran_on(place, on_ladder(settings))}",
                            ["setting"] + [f"{m:g}x lr" for m in multiples], rows,
                            ["The largest pre-softmax attention logit over the layers and heads, "
                             "on one validation batch at the final evaluation (eval mode): the "
                             "median over the seeds that recorded it (max, n; how many of them "
                             "ended at chance or collapsed). '—': no run of the cell recorded it "
                             "(made before the probe existed); settings without any are left "
                             "out. Wortsman et al. (2023) tie divergence at high rates to this "
                             "logit's growth, and qk-layernorm to bounding it."]))
    return tables


def on_ladder(settings: dict[str, dict[float, list[dict]]]) -> list[dict]:
    """Every run of a place's ladder (``ladder``'s ``{setting: {multiple: [runs]}}``)."""
    return [r for points in settings.values() for group in points.values() for r in group]


def reference_setting(label: str, reference: str, settings) -> str:
    """A setting's baseline on the ladder: the reference method with the same overrides (a
    recipe's other length, say) where that was run and is another setting, else the reference
    method as configured."""
    same = " ".join([reference, *label.split(" ")[1:]])
    return same if same in settings and same != label else reference


def reference_method(task: str) -> str:
    """The setting every method is tested against: LN (a language model's: Pre-LN)."""
    return "Pre-LN" if task == "language_modelling" else "LN"


MICRO_BATCH_KEY = "recipe.micro_batch_size"
#: the micro-batch question's rows (issue 33): each setting, as ``setting`` names it without
#: the micro-batch, and its row's name
MICRO_BATCH_SETTINGS = {"LN": "LN", "BN": "BN", "MABN": "MABN", "UN": "UN", "BCN": "BCN",
                        "BCN ws=residual": "BCN + WS",
                        "BCN norm.estimate=true ws=residual": "BCN EstBN + WS",
                        "BCN ws=transformer": "BCN + WS (qkv, fc1)",
                        "BCN norm.estimate=true ws=transformer": "BCN EstBN + WS (qkv, fc1)",
                        "EvoNorm-B0": "EvoNorm-B0",
                        "EvoNorm-S0": "EvoNorm-S0"}


def micro_batch_swept(run: dict) -> bool:
    """Whether ``micro_batch_tables`` tables the run: one of its norms in classification at a
    micro-batch other than the recipe's."""
    return (run.get("task") == "classification" and override_value(run, MICRO_BATCH_KEY) is not None
            and setting(run, (MICRO_BATCH_KEY,)) in MICRO_BATCH_SETTINGS)


def settings_tables(runs: list[dict]) -> list[Table]:
    """Every CPU-scale setting (defaults, sweeps, ablations) per model, mean +- std over seeds:
    the evidence behind the CPU mini-reproduction, in one place. Training through the norms
    and classification's micro-batches have their own tables (``sam_tables``,
    ``micro_batch_tables``), and stay out of these tables' Holm correction."""
    small = [r for r in runs if r.get("scale", "full") != "full"
             and override_value(r, STABILITY_KEY) is None and not through_norms(r)
             and not micro_batch_swept(r)]
    tables = []
    for place in sorted({where(r) for r in small}):
        group = [r for r in small if where(r) == place]
        task, metric = place[0], TASK_METRIC[place[0]]
        labels = sorted({setting(r) for r in group}, key=method_order)
        cells = {label: Cell([r for r in group if setting(r) == label]) for label in labels}
        reference = reference_method(task)
        comparisons = Comparisons(DIGITS.get(metric, 1))
        rows = []
        for label, cell in cells.items():
            baseline = reference_setting(label, reference, cells)
            if baseline == reference and " " in label:  # no reference run with these overrides
                baseline = label.split(" ")[0]
            tested = baseline != label and baseline in cells
            rows.append([label, cell.text(metric), baseline if tested else "—",
                         ("", comparisons.add(cell.values(metric), cells[baseline].values(metric)))
                         if tested else "—"])
        tables.append(Table(f"CPU-scale settings: {place_name(place)}{ran_on(place, group)}",
                            ["setting", metric, "baseline", "vs baseline"],
                            with_tests(rows, comparisons),
                            [f"Baseline: {reference} with the same overrides where that was run, "
                             f"else the method as configured for a changed setting, else "
                             f"{reference}. {comparisons.note()}"]))
    return tables


def micro_batch_tables(runs: list[dict]) -> list[Table]:
    """Classification by micro-batch, the BCN and MABN papers' question, for each model the
    sweep ran: the norms' batch statistics see the micro-batch while every update accumulates
    the recipe's images. Each norm against LN at the same micro-batch, and against itself at
    the largest."""
    def micro(run: dict) -> str:
        return setting(run, (MICRO_BATCH_KEY,))

    swept = {where(r) for r in runs if micro_batch_swept(r)}
    tables = []
    for place in sorted(swept):
        group = [r for r in runs if where(r) == place and r.get("scale", "full") != "full"
                 and micro(r) in MICRO_BATCH_SETTINGS]
        sizes = sorted({micro_batch(r) for r in group})
        cells = {(label, size): Cell([r for r in group if micro(r) == label
                                      and micro_batch(r) == size])
                 for label in MICRO_BATCH_SETTINGS for size in sizes}
        comparisons, rows = Comparisons(), []
        for label, name in MICRO_BATCH_SETTINGS.items():
            own = [cells[(label, size)] for size in sizes]
            if not any(cell.runs for cell in own):
                continue
            row: list = [name]
            for size, cell in zip(sizes, own):
                row.append(cell.text("top1") if label == "LN" or not cell.runs else
                           (cell.text("top1"),
                            comparisons.add(cell.values("top1"), cells[("LN", size)].values("top1"))))
            smallest, largest = own[0], own[-1]
            row.append(("", comparisons.add(smallest.values("top1"), largest.values("top1")))
                       if smallest.runs and largest.runs and len(sizes) > 1 else "—")
            rows.append(row)
        images = sorted({micro_batch(r) * r.get("accumulate", 1) * r.get("world_size", 1)
                         for r in group})
        tables.append(Table(
            f"Micro-batch training: {place_name(place)}, top-1 (%) by images per micro-batch"
            f"{ran_on(place, group)}",
            ["norm", *map(str, sizes), f"{sizes[0]} vs {sizes[-1]}"],
            with_tests(rows, comparisons, "; vs LN "),
            [f"A norm's batch statistics see the micro-batch in the column; each update "
             f"accumulates {', '.join(map(str, images))} images (micro-batch x accumulation). "
             f"'vs LN': LN at the same micro-batch; the last column: the norm at {sizes[0]} "
             f"against itself at {sizes[-1]}. BCN + WS: Weight Standardization on the layers "
             f"writing the residual stream, which the next norm reads (ws=residual: attention "
             f"output, fc2); (qkv, fc1): on the layers reading the norms instead "
             f"(ws=transformer); EstBN: micro-batch BCN, whose BN part normalises by its "
             f"running estimates in training too (norm.estimate=true). "
             f"{comparisons.note()}"]))
    return tables


def through_norms(run: dict) -> list[str]:
    """The run's ``sam=``/``train_only=`` overrides (none: the recipe's optimizer, all
    parameters)."""
    return [c for c in changes(run) if c.startswith(TRAINING_THROUGH_NORMS)]


#: the columns of the training-through-the-norms tables: their override, and the name of the
#: benchmark variant timed for them (scripts/bench_sam.py)
THROUGH_NORMS_COLUMNS = {"base": ([], "base"), "SAM": (["sam=sam"], "sam"),
                         "SAM-ON": (["sam=sam_on"], "sam_on"), "ASAM": (["sam=asam"], "asam"),
                         "ASAM-ON": (["sam=asam_on"], "asam_on"),
                         "norm only": (["train_only=norm"], "norm"),
                         "norm + head": (["train_only=norm+head"], "norm+head")}


def sam_tables(runs: list[dict], benchmarks: Path) -> list[Table]:
    """Per model trained through its norms: each norm with the recipe's optimizer (base), SAM,
    SAM-ON, ASAM(-ON) and norm-only training, every cell tested against base; then the cost of
    an update against base's (scripts/bench_sam.py), where measured."""
    eligible = [r for r in runs if override_value(r, STABILITY_KEY) is None
                and changes(r) == through_norms(r)]
    tables = []
    for place in sorted({where(r) for r in eligible if through_norms(r)}):
        group = [r for r in eligible if where(r) == place]
        metric = TASK_METRIC[place[0]]
        norms = sorted({r.get("norm") for r in group if through_norms(r)},
                       key=lambda n: method_order(NORM_METHODS.get(n, n)))
        columns = {name: wanted for name, (wanted, _) in THROUGH_NORMS_COLUMNS.items()
                   if any(changes(r) == wanted and r.get("norm") in norms for r in group)}
        comparisons = Comparisons(DIGITS.get(metric, 1))
        rows = []
        for norm in norms:
            cells = {name: Cell([r for r in group if r.get("norm") == norm and changes(r) == wanted])
                     for name, wanted in columns.items()}
            base = cells["base"].values(metric) if "base" in cells else []
            rows.append([NORM_METHODS.get(norm, norm)] + [
                cell.text(metric) if name == "base" or not cell.runs else
                (cell.text(metric), comparisons.add(cell.values(metric), base))
                for name, cell in cells.items()])
        tables.append(Table(f"Training through the norms: {place_name(place)}, {metric}{ran_on(place, group)}",
                            ["norm", *columns], with_tests(rows, comparisons, "; vs base "),
                            ["base: the recipe's optimizer on every parameter (the main runs); "
                             "SAM/ASAM perturb every parameter, -ON only the norms' affine "
                             "(configs/sam); norm only: every other parameter frozen at its "
                             "initialisation (train_only). vs base: against base in the row.",
                             comparisons.note()]))
    cost = benchmarks / "sam_cpu.json"
    if cost.exists():
        bench = json.loads(cost.read_text())
        by = {(r["model"], r["norm"], r["variant"]): r for r in bench["results"]}
        names = [name for name, (_, variant) in THROUGH_NORMS_COLUMNS.items()
                 if any(key[2] == variant for key in by)]
        rows = [[model, NORM_METHODS.get(norm, norm)] + [
            _ratio(by[(model, norm, THROUGH_NORMS_COLUMNS[name][1])]["vs_base"])
            if (model, norm, THROUGH_NORMS_COLUMNS[name][1]) in by else "—" for name in names]
            for model, norm in dict.fromkeys(key[:2] for key in by)]
        tables.append(Table(f"Training through the norms: cost of an update, x base ({bench['device']})",
                            ["model", "norm", *names], rows,
                            [f"scripts/bench_sam.py: one update on the CPU-scale run's batch, data "
                             f"loading not timed; the median of per-round ratios to base over "
                             f"{bench['rounds']} rounds, with its {bench['spread']}."]))
    return tables


def _ratio(ratio: dict) -> str:
    return f"{ratio['median']:.2f} [{ratio['lo']:.2f}, {ratio['hi']:.2f}]"


BATCH_KEY = "recipe.batch_size"  # the language-modelling batch-size sweep
#: what a batch-size sweep's run may change: the batch, and the updates that keep its tokens
BATCH_SWEEP_KEYS = tuple(f"recipe.{key}=" for key in
                         ("batch_size", "micro_batch_size", "max_steps", "warmup_steps", "eval_every"))


def lm_tables(runs: list[dict]) -> list[Table]:
    """Per language-modelling testbed: every norm and placement as configured (validation loss,
    its difference from Pre-LN with Welch's p, whether training-mode statistics see later
    tokens); then the batch-size sweep, UN against LN at each batch size."""
    lm = [r for r in runs if r.get("task") == "language_modelling"
          and override_value(r, STABILITY_KEY) is None]
    tables = []
    for place in sorted({where(r) for r in lm}):
        group = [r for r in lm if where(r) == place]
        labels = sorted({setting(r) for r in group if " " not in setting(r)}, key=method_order)
        cells = {label: Cell([r for r in group if setting(r) == label]) for label in labels}
        baseline = cells["Pre-LN"].values("val_loss") if "Pre-LN" in cells else []
        comparisons = Comparisons(DIGITS["val_loss"])
        rows = []
        for label, cell in cells.items():
            leak = {r["metrics"].get("leaks_future") for r in cell.runs if r["status"] == "ok"}
            train_mode = [r["metrics"]["val_loss_train_mode"] for r in cell.runs
                          if r["status"] == "ok" and "val_loss_train_mode" in r["metrics"]]
            seen = ("yes" if leak == {True} else "no" if leak == {False} else "mixed" if leak else "—")
            if train_mode:
                seen += f" (train mode {statistics.mean(train_mode):.3f})"
            rows.append([label, cell.text("val_loss"), "—" if label == "Pre-LN" else
                         ("", comparisons.add(cell.values("val_loss"), baseline)), seen])
        tables.append(Table(
            f"Language modelling: {place_name(place)}, validation loss (nats){ran_on(place, group)}",
            ["setting", "val_loss", "vs Pre-LN: difference (Welch p)", "sees later tokens"],
            with_tests(rows, comparisons),
            ["Lower is better. 'sees later tokens': training-mode logits at position t move when "
             "a later token changes (the future-leak probe); 'train mode' is the validation loss "
             "with training-mode statistics.", comparisons.note()]))
        if any(override_value(r, BATCH_KEY) is not None for r in group):
            tables.append(batch_table(place, group, sorted({r["batch_size"] for r in group
                                                            if "batch_size" in r})))
        if any(override_value(r, key) is not None for r in group for key in EMBEDDING_SCALES[1:]):
            tables.append(embedding_scale_table(place, group))
    return tables


#: the settings that set the embeddings' scale: the testbed's initialisation (none), Peri-LN's
#: embedding norm on every placement, Mix-LN's release initialisation
EMBEDDING_SCALES = (None, "model.embedding_norm", "model.init")
_SCALE_VALUES = {"model.embedding_norm": "true", "model.init": "mixln"}
_SCALE_NAMES = {None: "testbed init (std 0.057)", "model.embedding_norm": "embedding norm",
                "model.init": "Mix-LN init (embeddings std 0.63)"}


def embedding_scale_table(place: tuple, group: list[dict]) -> Table:
    """LN's placements under each embedding scale, each against Pre-LN under the same one, and
    whether a placement's comparison holds under all three (the same sign, p < 0.05 in each)."""
    def runs_of(placement: str, key) -> list[dict]:
        return [r for r in group if r.get("norm") == "ln" and r.get("norm_position") == placement
                and all(override_value(r, k) == (_SCALE_VALUES[k] if k == key else None)
                        for k in EMBEDDING_SCALES[1:])
                and changes(r, ("model.norm_position", *EMBEDDING_SCALES[1:])) == []]

    comparisons, rows, verdicts = Comparisons(DIGITS["val_loss"]), [], {}
    for placement in PLACEMENT_NAMES:
        row: list = [f"{PLACEMENT_NAMES[placement]}-LN"]
        for key in EMBEDDING_SCALES:
            cell, pre = Cell(runs_of(placement, key)), Cell(runs_of("pre", key))
            row.append(cell.text("val_loss") if placement == "pre" or not cell.runs else
                       (cell.text("val_loss"), comparisons.add(cell.values("val_loss"),
                                                               pre.values("val_loss"))))
        rows.append(row)
    results = comparisons.results()
    index = 0
    for row in rows[1:]:
        tested = [results[index + i] for i, cell in enumerate(row[1:]) if not isinstance(cell, str)]
        index += len(tested)
        signs = {(r[0] > 0) for r in tested if r is not None and r[1] is not None and r[1] < 0.05}
        held = (len(tested) == len(EMBEDDING_SCALES) and all(r is not None and r[1] is not None
                                                             and r[1] < 0.05 for r in tested)
                and len(signs) == 1)
        verdicts[row[0]] = ("holds: " + ("worse" if signs.pop() else "better") if held else
                            "depends on the embedding scale" if len(tested) == len(EMBEDDING_SCALES)
                            else "incomplete")
    rows = with_tests(rows, comparisons, "; vs Pre-LN ")
    for row in rows:
        row.append(verdicts.get(row[0], "—"))
    return Table(f"Language modelling: {place_name(place)}, placement under the embedding scale"
                 f"{ran_on(place, group)}",
                 ["setting", *(_SCALE_NAMES[k] for k in EMBEDDING_SCALES), "vs Pre-LN under all three"],
                 rows,
                 ["Validation loss (nats); each placement against Pre-LN under the same embedding "
                  "scale. 'holds': the same sign and p < 0.05 under all three; otherwise the "
                  "comparison depends on the embedding scale. Embedding norm: Peri-LN's norm on "
                  "the embeddings (model.embedding_norm=true), on every placement; Mix-LN init: "
                  "its release's embeddings N(0, 2/5) (model.init=mixln).", comparisons.note()])


def batch_table(place: tuple, group: list[dict], sizes: list[int]) -> Table:
    """Pre-LN and Pre-UN at each batch size of the sweep: runs that change nothing but the
    batch and the updates that keep the training tokens (or nothing), with no accumulation
    (the norms' statistics see the whole batch)."""
    def cell(norm: str, size: int) -> Cell:
        return Cell([r for r in group if r.get("norm") == norm and r.get("norm_position") == "pre"
                     and r.get("accumulate") == 1 and r.get("batch_size") == size
                     and all(c.startswith(BATCH_SWEEP_KEYS) for c in changes(r))])
    cells = {(norm, size): cell(norm, size) for norm in ("ln", "un") for size in sizes}
    rows = [[method] + [cells[(norm, size)].text("val_loss") for size in sizes]
            for method, norm in (("Pre-LN", "ln"), ("Pre-UN", "un"))]
    comparisons = Comparisons(DIGITS["val_loss"])
    rows.append(["UN − LN (Welch p)"] + [("", comparisons.add(cells[("un", size)].values("val_loss"),
                                                              cells[("ln", size)].values("val_loss")))
                                         for size in sizes])
    tokens = sorted({r["metrics"]["tokens"] for c in cells.values() for r in c.runs
                     if "tokens" in r.get("metrics", {})})
    return Table(f"Language modelling: {place_name(place)}, validation loss by batch size "
                 f"(sequences per update, same training tokens){ran_on(place, group)}",
                 ["setting"] + [str(size) for size in sizes], with_tests(rows, comparisons),
                 [f"{comparisons.note()} No run accumulates: UN's and LN's statistics see the "
                  f"batch size in the column. Training tokens per run: {', '.join(map(str, tokens))}."])


FOLDED_VARIANTS = {"un_folded": "UN", "prepbn_folded": "PRepBN", "dyt": "DyT"}


def efficiency_table(paper: dict, benchmarks: Path) -> Table:
    """The paper's LN vs folded UN, and ours for each folded norm (the rivals beside UN)."""
    header = ["setting", "norm", "LN MB", "norm MB", "mem reduction", "LN img/s", "norm img/s",
              "speed-up", "no-norm limit"]
    rows = []
    for name, values in paper.items():
        rows.append([f"paper {name}", "UN folded", str(values["LN"]["mem_mb"]),
                     str(values["UN"]["mem_mb"]), f"{values['mem_reduction']:.1%}",
                     str(values["LN"]["tput"]), str(values["UN"]["tput"]), f"{values['speedup']:.1%}",
                     "—"])
    for path in sorted(benchmarks.glob("inference_*.json")):
        bench = json.loads(path.read_text())
        by = {(r["model"], r["variant"], r["mode"]): r for r in bench["inference"]}
        for (model, _, mode), row in by.items():  # the baseline of an unpaired memory ratio
            row["ln_peak_mem_mb"] = by[(model, "ln", mode)]["peak_mem_mb"]
        for (model, variant, mode), ln in sorted(by.items()):
            if variant != "ln":
                continue
            for folded, method in FOLDED_VARIANTS.items():
                if (model, folded, mode) not in by:
                    continue
                other = by[(model, folded, mode)]
                mem = (ln["peak_mem_mb"], other["peak_mem_mb"])
                limit = by.get((model, "no_norm", mode), {})
                rows.append([f"ours {model} {mode} bs{ln.get('batch', bench['batch'])} ({bench['device']})",
                             f"{method} folded", f"{mem[0]:.0f}" if mem[0] else "—",
                             f"{mem[1]:.0f}" if mem[1] else "—",
                             _mem_reduction(other) if all(mem) else "—",
                             _rate(ln["images_per_s"]), _rate(other["images_per_s"]),
                             _speedup(other), _speedup(limit) if limit else "—"])
    return Table("Table 8: inference efficiency, LN vs folded norms (Swin-T; Mask R-CNN Swin-T; "
                 "LLaMA-71M, whose img/s are sequences/s)",
                 header, rows, ["ours: scripts/benchmark.py; GPU memory is the peak the "
                                "allocator held during inference above the loaded models "
                                "(torch.cuda.max_memory_allocated, exact: one measurement; the "
                                "weights, about 110 MB for Swin-T, are not in it); CPU memory is "
                                "the peak RSS of the whole "
                                "process during inference, a median over fresh processes, its "
                                "reduction the paired ratio to LN's with the bootstrap 95% "
                                "interval. DyT folded keeps its elementwise tanh. Speed-ups are "
                                "medians of per-round paired ratios with their bootstrap 95% "
                                "interval. The no-norm limit beside each row is what removing "
                                "every norm reaches: a speed-up inside the noise that leaves the "
                                "limit below LN is not one."])


def norm_speed_tables(benchmarks: Path) -> list[Table]:
    """Each norm's cost against its target (issue 51): per layer from ``bench_norms.py``'s
    records (those with targets), per model from ``benchmark.py``'s training steps."""
    tables = []
    for path in sorted(benchmarks.glob("norms_*.json")):
        bench = json.loads(path.read_text())
        if not all("target" in row for row in bench["results"]):
            continue  # recorded before the targets
        by = {(tuple(r["shape"]), r["norm"], r["mode"], r["kind"]): r for r in bench["results"]}
        rows = [["x".join(map(str, shape)), name, mode,
                 *(_against_target(by[(shape, name, mode, kind)]) for kind in ("train", "infer"))]
                for shape, name, mode, kind in by if kind == "train"]
        tables.append(Table(
            f"Norm speed per layer: over the fastest LayerNorm ({bench['device']}, "
            f"{bench.get('dtype', 'float32')}, {path.name})",
            ["shape", "norm", "mode", "training step", "inference"], rows,
            [f"scripts/bench_norms.py, {bench['rounds']} interleaved rounds: median of per-round "
             "ratios to the fastest LayerNorm (ours or torch's, eager or compiled) [bootstrap 95% "
             "interval]; target: issue 51's (3x eager, 2x compiled, RMSNorm eager 1.5x, the "
             "offline norms' inference 1.5x; 1.5x the cost of torch's own ops for the "
             "arithmetic of DyT, EvoNorm and PRepBN where that is more); met: yes where the "
             "whole interval is at or under the target, no where it is over. torch_*: torch's "
             "own layers and ops, the references."]))
    groups: dict[tuple[str, str], list[tuple[Path, dict]]] = {}
    for path in sorted(benchmarks.glob("training_*.json")):
        bench = json.loads(path.read_text())
        if bench["training"]:
            groups.setdefault((bench["device"], bench["training"][0]["mode"]), []).append(
                (path, bench))
    for (device, mode), records in groups.items():
        by = {(r["model"], r["norm"]): r for _, bench in records for r in bench["training"]}
        models = list(dict.fromkeys(model for model, _ in by))
        rows = [[NORM_METHODS.get(norm, norm), *(_ratio(by[(m, norm)]["vs_ln"]) if (m, norm) in by
                                                 else "—" for m in models)]
                for norm in dict.fromkeys(norm for _, norm in by)]
        settings = sorted({f"{path.name}: batch {bench['train_batch']}, {bench['img_size']} px, LM "
                           f"context {bench['lm_context']}, {bench['rounds']} rounds"
                           for path, bench in records})
        tables.append(Table(
            f"Norm speed per model: a training step over LN's ({device}, {mode})",
            ["norm", *models], rows,
            ["scripts/benchmark.py --parts training: one optimizer step (AdamW), the norms past "
             "their warm-ups (PRepBN inside its hand-over); median of per-round ratios to the "
             "LN step of the same run [bootstrap 95% interval]. Runs: " + "; ".join(settings)
             + "."]))
    return tables


def _against_target(row: dict) -> str:
    text = _ratio(row["vs_fastest_ln"])
    return text if row["target"] is None else f"{text}; target {row['target']:.2f}: {row['met']}"


def _mem_reduction(row: dict) -> str:
    """A variant's peak memory below LN's, with its interval over fresh processes when
    recorded (CPU RSS; a GPU's allocator count is exact)."""
    if "mem_vs_ln" not in row:
        return f"{1 - row['peak_mem_mb'] / row['ln_peak_mem_mb']:.1%}"
    ratio = row["mem_vs_ln"]
    return f"{1 - ratio['median']:.1%} [{1 - ratio['hi']:.1%}, {1 - ratio['lo']:.1%}]"


def _speedup(row: dict) -> str:
    """A variant's throughput over LN's as a speed-up, with its interval."""
    ratio = row["vs_ln"]
    return f"{ratio['median'] - 1:+.1%} [{ratio['lo'] - 1:+.1%}, {ratio['hi'] - 1:+.1%}]"


def _rate(images_per_s: float) -> str:
    return f"{images_per_s:.1f}" if images_per_s >= 10 else f"{images_per_s:.3f}"


def build_tables(paper: dict, runs: list[dict], benchmarks: Path) -> list[Table]:
    cls_columns = {"swin_t_imagenet": ("swin_t", "imagenet"),
                   "t2t_vit_14_imagenet": ("t2t_vit_14", "imagenet"),
                   "t2t_vit_14_cifar10": ("t2t_vit_14", "cifar10"),
                   "t2t_vit_14_cifar100": ("t2t_vit_14", "cifar100")}
    tables = [
        method_table("Table 1: translation BLEU (pre-norm Transformer)", paper["table1_nmt_bleu"],
                     runs, {d: (None, d, "bleu") for d in ("iwslt14", "wmt14")}, "translation"),
        method_table("Table 2: classification top-1 (%)", paper["table2_cls_top1"], runs,
                     {name: (*where, "top1") for name, where in cls_columns.items()},
                     "classification"),
    ]
    for key, title in (("table3_faster_rcnn_swin_t_coco_3x", "Table 3: Faster R-CNN Swin-T 3x, COCO"),
                       ("table4_mask_rcnn_swin_t_coco_3x", "Table 4: Mask R-CNN Swin-T 3x, COCO")):
        flat = {method: _flatten(values) for method, values in paper[key].items()}
        model = "faster_rcnn_swin_t" if "faster" in key else "mask_rcnn_swin_t"
        columns = {c: (model, "coco", _coco_metric(c))
                   for c in next(iter(flat.values()))}
        tables.append(method_table(title, flat, runs, columns, "detection"))
    tables += [
        ablation_table("Table 5: UN components, Mask R-CNN 1x", paper["table5_ablation_mask_rcnn_12ep"],
                       ["box_AP", "mask_AP"], runs),
        sweep_table("Table 6: window size M", paper["table6_window_size_mask_rcnn_12ep"]["M"],
                    {k: v for k, v in paper["table6_window_size_mask_rcnn_12ep"].items() if k != "M"},
                    runs, "norm.window_size"),
        sweep_table("Table 7: outlier filtration", [True, False],
                    {k: [paper["table7_outlier_filtration"]["with"][k],
                         paper["table7_outlier_filtration"]["without"][k]]
                     for k in paper["table7_outlier_filtration"]["with"]},
                    runs, "norm.outlier_filtration"),
        efficiency_table(paper["table8_efficiency_swin_t"], benchmarks),
        *norm_speed_tables(benchmarks),
        ablation_table("Table 9: UN components, IWSLT14 BLEU", paper["table9_ablation_iwslt14"],
                       ["bleu"], [r for r in runs if r.get("task") == "translation"]),
        sweep_table("Table 10: momentum alpha", paper["table10_alpha"]["alpha"],
                    {k: v for k, v in paper["table10_alpha"].items() if k != "alpha"},
                    runs, "norm.momentum"),
    ]
    tables += (lm_tables(runs) + stability_tables(runs) + sensitivity_tables(runs)
               + attention_logit_tables(runs) + sam_tables(runs, benchmarks)
               + micro_batch_tables(runs) + settings_tables(runs))
    for table in tables:
        table.notes += [note for mark, note in CELL_NOTES.items()
                        if any(re.search(rf"\b{mark} \d+/\d+", cell) for row in table.rows for cell in row)]
    return tables


def _coco_metric(column: str) -> str:
    """Our detection runs name COCO metrics as pycocotools' iouTypes: bbox_AP50, segm_AP."""
    kind, _, name = column.rpartition(" ")
    return f"{'segm' if kind == 'mask' else 'bbox'}_{name}"


def _flatten(values: dict, prefix: str = "") -> dict:
    flat = {}
    for key, value in values.items():
        if isinstance(value, dict):
            flat.update(_flatten(value, f"{prefix}{key} "))
        else:
            flat[f"{prefix}{key}"] = value
    return flat


def to_markdown(tables: list[Table], runs: list[dict]) -> str:
    out = [f"# The paper's tables beside ours ({runs_read(runs)})", "",
           "Generated by `python scripts/make_tables.py`; do not edit.", "", CPU_NOTE, ""]
    if broken_text(runs):
        out += [broken_text(runs), ""]
    if any("‡" in cell for table in tables for row in table.rows for cell in row):
        out += [SUPERSEDED_NOTE, ""]
    for table in tables:
        out += table_markdown(table, "##")
    return "\n".join(out)


def table_markdown(table: Table, heading: str) -> list[str]:
    """One table's lines: its title under ``heading``, the table, its notes."""
    out = [f"{heading} {table.title}", "", "| " + " | ".join(table.header) + " |",
           "|" + "---|" * len(table.header)]
    out += ["| " + " | ".join(row) + " |" for row in table.rows]
    notes = [note for note in table.notes if note]
    return out + [""] + notes + ([""] if notes else [])


def _tex(text: str) -> str:
    return (text.replace("\\", "\\textbackslash{}").replace("_", "\\_").replace("%", "\\%")
            .replace("±", "$\\pm$").replace("†", "$^\\dagger$").replace("‡", "$^\\ddagger$")
            .replace("—", "--")
            .replace("#", "\\#").replace("&", "\\&"))


def to_latex(tables: list[Table]) -> str:
    out = [f"% Generated by scripts/make_tables.py. {_tex(CPU_NOTE)}"]
    if any("‡" in cell for table in tables for row in table.rows for cell in row):
        out += [f"% {_tex(SUPERSEDED_NOTE)}"]
    for table in tables:
        out += ["\\begin{table}[t]", "\\centering\\small", f"\\caption{{{_tex(table.title)}}}",
                "\\begin{tabular}{l" + "c" * (len(table.header) - 1) + "}", "\\toprule",
                " & ".join(_tex(h) for h in table.header) + " \\\\", "\\midrule"]
        out += [" & ".join(_tex(c) for c in row) + " \\\\" for row in table.rows]
        out += ["\\bottomrule", "\\end{tabular}", "\\end{table}", ""]
    return "\n".join(out)
