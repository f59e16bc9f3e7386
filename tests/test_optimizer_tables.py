"""The optimizer study's tables (analysis/optimizer.py) from constructed records: each setting's
runs picked by model, norm, overrides and rate, from the study's group and the others alike;
AdamP against AdamW by Welch's test (scipy); the recorded projections and effective steps."""
from __future__ import annotations

import json

from scipy import stats

from analysis import optimizer
from analysis.runs import load_runs


def write(root, group, name, norm, top1, overrides=(), rows=None):
    run = root / group / name
    run.mkdir(parents=True)
    record = {"status": "ok", "task": "classification", "model": "t2t_vit_14", "norm": norm,
              "scale": "cpu", "metrics": {"top1": top1},
              "overrides": [f"+exp=t2t_vit_14_{norm}", *overrides, "seed=0", "scale=cpu"]}
    if rows is not None:
        record["scale_invariant"] = {"counts": {"row": 8, "tensor": 0}}
        (run / "metrics.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    (run / "result.json").write_text(json.dumps(record))


def epoch(projected, step):
    return {"param_groups": [{"weight_decay": 0.0, "parameters": 10},
                             {"weight_decay": 0.05, "parameters": 1000}],
            "effective_step": [0.5, step], "projection": {"tensors": projected}}


def test_adamp_against_adamw_and_the_records(tmp_path):
    adamw, adamp = [70.0, 72.0, 75.0], [60.0, 66.0, 61.0]
    for seed, (w, p) in enumerate(zip(adamw, adamp)):
        write(tmp_path, "micro_batch", f"bcn-s{seed}", "bcn", w, ["ws=residual"])  # a baseline
        write(tmp_path, "optimizer", f"bcn-adamp-s{seed}", "bcn", p,
              ["ws=residual", "optimizer=adamp"], [epoch(9, 0.002), epoch(7, 0.001)])
        write(tmp_path, "optimizer", f"bcn-adamp-lr3x-s{seed}", "bcn", 10.0,  # another rate
              ["ws=residual", "optimizer=adamp", "lr_multiple=3"])
        write(tmp_path, "main", f"ln-s{seed}", "ln", 99.0)  # another setting
    runs = load_runs(tmp_path)
    tables = optimizer.tables(runs)

    def titled(start):
        [table] = [t for t in tables if t.title.startswith(start)]
        return table
    table = titled("Optimizer: AdamP against AdamW, T2T-ViT")
    row = next(r for r in table.rows if r[:2] == ["BCN + WS", "1x"])
    p = stats.ttest_ind(adamp, adamw, equal_var=False).pvalue
    assert row[2].startswith("72.3 ± 2.5 (n=3)") and row[3].startswith("62.3 ± 3.2 (n=3)")
    assert row[4] == f"-10.0 (p={p:.2g})**"  # the only test: Holm leaves its p as it is
    row = next(r for r in table.rows if r[:2] == ["BCN + WS", "3x"])
    assert row[2] == "—" and row[3].startswith("10.0 ± 0.0 (n=3)")
    records = titled("Optimizer: scale invariance and effective steps, T2T-ViT")
    assert records.rows == [["BCN + WS", "1x", "AdamP", "3", "8.0 ± 0.0 / 0.0 ± 0.0",
                             "9.0 ± 0.0 / 7.0 ± 0.0", "2.00 ± 0.00 / 1.00 ± 0.00"]]


def test_no_table_without_the_study(tmp_path):
    write(tmp_path, "main", "ln-s0", "ln", 70.0)
    assert optimizer.tables(load_runs(tmp_path)) == []
