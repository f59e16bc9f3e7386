"""Learning-rate sensitivity from records (analysis/sensitivity.py), against Wortsman et al.'s
definition computed by hand on made-up ladders."""
from __future__ import annotations

import json
import statistics

import pytest

from analysis.sensitivity import best_rates, difference_interval, main, sensitivity
from analysis.tables import sensitivity_tables

RATES = (0.1, 0.3, 1, 3, 10, 30, 100)
CHANCE = {"metric": "val_loss", "threshold": 6.0, "lower_is_better": True, "rule": "made up"}


def run(norm: str, multiple: float, seed: int, loss=None, status="ok") -> dict:
    ladder = [] if multiple == 1 else [f"lr_multiple={multiple:g}"]
    name = f"llama_cpu_{norm}" + ("" if multiple == 1 else f"-lr{multiple:g}x") + f"-s{seed}"
    return {"task": "language_modelling", "model": "llama_cpu", "exp_data": "lm_c4", "norm": norm,
            "norm_position": "pre", "overrides": [f"+exp=llama_71m_{norm}", *ladder, f"seed={seed}"],
            "status": status, "fail_step": 7 if status == "FAIL" else None,
            "metrics": {} if loss is None else {"val_loss": loss}, "chance": CHANCE,
            "run_dir": f"/grid/lm/{name}", "_path": f"/records/lm/{name}"}


def ladder_runs(norm: str, losses: dict) -> list[dict]:
    """``losses``: {multiple: [loss or "FAIL", ...]} per seed."""
    return [run(norm, m, seed, None if loss == "FAIL" else loss, "FAIL" if loss == "FAIL" else
                "chance" if loss >= CHANCE["threshold"] else "ok")
            for m, values in losses.items() for seed, loss in enumerate(values)]


LN = {0.1: [5.0, 5.2], 0.3: [4.0, 4.2], 1: [3.5, 3.7], 3: [3.2, 3.4], 10: [3.9, 4.1],
      30: [7.5, "FAIL"], 100: ["FAIL", "FAIL"]}


def by_multiple(runs):
    points = {}
    for r in runs:
        multiple = float(next((o.split("=")[1] for o in r["overrides"] if o.startswith("lr_")), 1))
        points.setdefault(multiple, []).append(r)
    return points


def test_sensitivity_is_the_mean_bounded_gap_to_the_best_rate():
    out = sensitivity(by_multiple(ladder_runs("ln", LN)), "val_loss", CHANCE["threshold"])
    # per-rate means, each run at most the chance level (a collapse counts there): 5.1, 4.1,
    # 3.6, 3.3, 4.0, 6.0, 6.0; best 3.3 at 3x
    gaps = [5.1 - 3.3, 4.1 - 3.3, 3.6 - 3.3, 0.0, 4.0 - 3.3, 6.0 - 3.3, 6.0 - 3.3]
    assert out["best"] == 3 and out["value"] == pytest.approx(3.3)
    assert out["sensitivity"] == pytest.approx(statistics.fmean(gaps))
    low, high = out["interval"]
    assert low <= out["sensitivity"] <= high and high - low > 0


def test_accuracy_ladders_bound_below_and_a_flat_ladder_has_no_spread():
    runs = [{**run("ln", m, seed), "task": "classification", "metrics": {"top1": 50.0 + m},
             "chance": {"metric": "top1", "threshold": 15.0}} for m in RATES for seed in (0, 1)]
    runs[0]["metrics"]["top1"] = 3.0  # below chance: counts at 15
    out = sensitivity(by_multiple(runs), "top1", 15.0)
    means = {m: 50.0 + m for m in RATES}
    means[0.1] = (15.0 + 50.1) / 2
    assert out["best"] == 100 and out["sensitivity"] == pytest.approx(
        statistics.fmean(150.0 - v for v in means.values()))
    flat = sensitivity({m: [run("ln", m, 0, 4.0), run("ln", m, 1, 4.0)] for m in RATES},
                       "val_loss", 6.0)
    assert flat["sensitivity"] == 0 and flat["interval"] == (0.0, 0.0)


def test_fewer_than_seven_rates_give_no_sensitivity():
    out = sensitivity(by_multiple(ladder_runs("ln", {m: LN[m] for m in RATES[:6]})), "val_loss", 6.0)
    assert out["sensitivity"] is None and out["best"] == 3


def test_the_table_compares_each_at_its_best_and_at_the_recipes_rate():
    un = {m: [v + 1.0 if isinstance(v, float) else v for v in values] for m, values in LN.items()}
    un[0.3] = [3.0, 3.1]  # UN's best rate is lower than LN's
    table, = sensitivity_tables(ladder_runs("ln", LN) + ladder_runs("un", un))
    rows = {row[0]: row for row in table.rows}
    assert rows["Pre-LN"][1] == "3x" and rows["Pre-UN"][1] == "0.3x"
    assert rows["Pre-UN"][5].startswith("-0.250 (p=")  # 3.05 at 0.3x against LN's 3.3 at 3x
    assert rows["Pre-UN"][6].startswith("+1.000 (p=")  # 4.6 against 3.6 at 1x


def test_best_rates_name_each_settings_runs_for_the_grid(tmp_path, capsys):
    runs = ladder_runs("ln", LN)
    assert best_rates(runs) == {"llama_cpu_ln": 3}
    for r in runs:
        folder = tmp_path / "lm" / r["run_dir"].rsplit("/", 1)[1]
        folder.mkdir(parents=True)
        (folder / "result.json").write_text(json.dumps({k: v for k, v in r.items() if k != "_path"}))
    main(["--best", str(tmp_path / "lm"), str(tmp_path / "missing")])
    assert capsys.readouterr().out == "llama_cpu_ln 3\n"


def test_the_difference_interval_separates_a_flatter_ladder_and_not_a_copy():
    steep = by_multiple(ladder_runs("ln", LN))
    flat = by_multiple(ladder_runs("un", {m: [3.3 + 0.1 * (m > 10), 3.4] for m in RATES}))
    ours, theirs = sensitivity(flat, "val_loss", 6.0, 1), sensitivity(steep, "val_loss", 6.0, 2)
    low, high = difference_interval(ours, theirs)
    assert high < 0 and low <= ours["sensitivity"] - theirs["sensitivity"] <= high
    low, high = difference_interval(sensitivity(steep, "val_loss", 6.0, 3), theirs)
    assert low < 0 < high
