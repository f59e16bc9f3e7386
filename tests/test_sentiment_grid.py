"""The sentiment grid's tables (analysis/sentiment_grid.py) from hand-made records: each run's
C/S/D by the rule in docs/text_classification.md, applied here by hand, beside the study's mark,
and the landscape summary from the probes' rows."""
from __future__ import annotations

import json
import math
from pathlib import Path

from analysis import sentiment_grid
from analysis.tables import Table

ROOT = Path(__file__).resolve().parents[1]


def _run(root: Path, name: str, status: str, losses: list[float], probes=()):
    run = root / name
    run.mkdir(parents=True)
    (run / "result.json").write_text(json.dumps({"status": status, "metrics": {}, "initial_gradients": {
        "loss": 0.7, "grad_norm": {"embeddings": 0.5, "layers.0": 0.25, "classifier": 1.0}}}))
    (run / "metrics.jsonl").write_text("".join(json.dumps({"train_loss": x}) + "\n" for x in losses))
    if probes:
        (run / "landscape.jsonl").write_text("".join(json.dumps(row) + "\n" for row in probes))


def test_the_outcomes_follow_the_rule_and_sit_beside_the_studys(tmp_path):
    entropy = sentiment_grid.label_entropy()
    assert abs(entropy - (-(5655 / 9908) * math.log(5655 / 9908)
                          - (4253 / 9908) * math.log(4253 / 9908))) < 1e-12
    # C: ends below 0.9 H; S: a plateau just above it; D: the loss rose, or a collapse
    _run(tmp_path, "post_d5_w32_ln_lr0.5", "ok", [0.70, 0.5])
    _run(tmp_path, "post_d5_w32_ln_lr0.1", "chance", [0.70, 0.9 * entropy + 1e-4])
    _run(tmp_path, "post_d5_w32_bn_lr0.5", "ok", [0.69, 0.70])
    _run(tmp_path, "post_d5_w32_bn_lr0.1", "FAIL", [0.69, 0.3],
         probes=[{"step": 0, "lipschitz": 0.5, "smoothness": 2.0},
                 {"step": 100, "lipschitz": float("nan"), "smoothness": 4.0},
                 {"step": 200, "lipschitz": 0.1, "smoothness": 1.0}])
    study = sentiment_grid.read_study(ROOT / "results" / sentiment_grid.STUDY)
    cells = sentiment_grid.read_grid(tmp_path)
    tables = {t.title: t for t in sentiment_grid.tables(cells, study)}
    assert all(isinstance(t, Table) for t in tables.values())
    convergence = tables["Sentiment grid: convergence, Post"]
    rows = {row[2]: row[3:] for row in convergence.rows}
    # the study at depth 5, normal width, lr 0.5 and 0.1: LN C, C; BN N, N
    assert rows["ln"][2:4] == ["C (C)", "S (C)"] and rows["ln"][0] == "– (N)"
    assert rows["bn"][2:4] == ["D (N)", "D (N)"]
    agreement = {row[1]: row[2:] for row in tables["Sentiment grid: agreement with the study"].rows}
    assert agreement["ln"] == ["2", "1", "1", "2", "D 0, S 1"]
    assert agreement["bn"] == ["2", "2", "0", "0", "D 2, S 0"]
    landscape = tables["Sentiment grid: Lipschitz and smoothness along the update"].rows
    assert landscape == [["5", "32", "bn", "0.1", "D", "3", "0.5", "0.3 / 0.5 (1 not finite)",
                          "2", "2 / 4"]]
    gradients = tables["Sentiment grid: gradient norms at initialisation"].rows
    assert [row[:2] for row in gradients] == [["5", "ln"], ["5", "bn"]]
    assert gradients[0][3] == "0.5, 0.25, 1"
    assert sentiment_grid.tables({}, study) == []


def _probe(step: int, beta: float, spread: float) -> dict:
    return {"step": step, "beta": beta, "predictiveness": beta, "loss_min": 1.0,
            "loss_max": 1.0 + spread, "lipschitz": spread, "smoothness": beta}


def test_the_smoother_landscape_is_tested_paired_over_cells_on_the_probes_both_runs_made(tmp_path):
    # BN's beta under NoNorm's by a different factor at each rate; at rate 10 NoNorm's only
    # probe is not finite (diverged); BN's probe at 200, which NoNorm lacks, must not count
    factors = [0.5 - 0.05 * i for i in range(len(sentiment_grid.RATES))]
    for rate, factor in zip(sentiment_grid.RATES, factors):
        nonorm = ([_probe(0, math.inf, 1.0)] if rate == "10" else
                  [_probe(0, 2.0, 1.0), _probe(100, 4.0, 1.0)])
        bn = [_probe(0, 2.0 * factor, 3.0), _probe(100, 4.0 * factor, 3.0), _probe(200, 1e6, 3.0)]
        _run(tmp_path, f"post_d5_w32_nonorm_lr{rate}", "ok", [0.7, 0.5], nonorm)
        _run(tmp_path, f"post_d5_w32_bn_lr{rate}", "ok", [0.7, 0.5], bn)
    # a uniform initialisation's run is not a cell of the pairing
    _run(tmp_path, "post_d5_w32_bn_lr0.1_uniform100", "ok", [0.7, 0.5], [_probe(0, 1e-9, 1e-9)])
    cells = sentiment_grid.read_grid(tmp_path)
    rows = {(row[1], row[2]): row[3:] for row in sentiment_grid.smoother_table(cells).rows}
    beta = rows[("bn vs nonorm", "beta")]
    n = len(factors)
    # six finite ratios (the factors of rates 1 ... 0.0001) and one -inf: the median of the
    # seven log ratios is the fourth smallest, and every sign is negative, so Wilcoxon's exact
    # two-sided p is 2 / 2^7
    expected_median = sorted([-math.inf] + [math.log(f) for f in factors[1:]])[n // 2]
    assert beta[:3] == [str(n), f"{n} of {n}", f"{math.exp(expected_median):.3g}"]
    assert beta[3] == f"p = {2 / 2 ** n:.2g} **"
    # the loss range: BN's is 3x NoNorm's at every cell, a tie in every magnitude
    spread = rows[("bn vs nonorm", "loss range")]
    assert spread[:3] == [str(n), f"0 of {n}", "3"]
    assert ("ln vs nonorm", "beta") not in rows  # no LN runs: no row
