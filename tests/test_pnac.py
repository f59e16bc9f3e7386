"""PNAC (Eq. 15), the Fig. 4 sliding means and the Fig. 5 outlier counts against plain-loop
expectations, plus a smoke test of scripts/analyze_run.py on a synthetic run directory."""
from __future__ import annotations

import csv
import importlib.util
import json
from pathlib import Path

import numpy as np
import pytest
import torch
from scipy.stats import normaltest

from analysis.pnac import pnac, pnac_rows, window_pvalues
from analysis.statistics import load_statistics, outlier_counts, sliding_means

REPO_ROOT = Path(__file__).resolve().parents[1]


def mixed_channels(steps: int, gaussian: int = 8, outlier: int = 8, seed: int = 0) -> np.ndarray:
    """Half i.i.d. Gaussian channels; half Gaussian with one huge outlier per 20 steps."""
    rng = np.random.default_rng(seed)
    values = rng.normal(1.0, 0.1, size=(steps, gaussian + outlier))
    values[7::20, gaussian:] += 50.0
    return values.astype(np.float32)


def loop_pnac(values: np.ndarray, window: int) -> list[float]:
    values = values.astype(np.float64)  # as pnac computes, so borderline p-values agree
    percentages = []
    for start in range(0, len(values) - window + 1, window):
        passed = [normaltest(values[start:start + window, c]).pvalue > 0.05
                  for c in range(values.shape[1])]
        percentages.append(100.0 * sum(passed) / values.shape[1])
    return percentages


def test_pnac_equals_channel_by_channel_normaltest():
    values = mixed_channels(60)
    got, nans = pnac(values, window=20)
    np.testing.assert_allclose(got, loop_pnac(values, 20))
    assert np.all(nans == 0)
    assert np.all(got <= 50.0)  # every outlier channel fails
    assert np.all(window_pvalues(values, 20)[:, 8:] < 1e-3)
    gaussian_only, _ = pnac(torch.from_numpy(values[:, :8]), window=20)  # tensors accepted too
    np.testing.assert_allclose(gaussian_only, loop_pnac(values[:, :8], 20))
    assert gaussian_only.mean() > 50.0


def test_constant_channels_are_nan_and_not_normal():
    values = mixed_channels(23, gaussian=2, outlier=0)
    values = np.concatenate([values, np.full((23, 1), 3.0, np.float32),
                             np.full((23, 1), 0.1, np.float32)], axis=1)
    pvalues = window_pvalues(values, window=23)
    assert np.isnan(pvalues[0, 2:]).all() and not np.isnan(pvalues[0, :2]).any()
    got, nans = pnac(values, window=23)
    assert nans.tolist() == [2]
    expected = 100.0 * sum(normaltest(values[:, c]).pvalue > 0.05 for c in range(2)) / 4
    assert got.tolist() == [expected]


@pytest.mark.parametrize("window", [0, 5, 7])
def test_window_shorter_than_8_raises(window):
    with pytest.raises(ValueError, match="at least 8"):
        pnac(mixed_channels(40), window=window)


def test_windows_do_not_overlap_and_drop_the_tail():
    values = mixed_channels(67, gaussian=4, outlier=0)
    values[65, :] = 1e6  # in the incomplete tail window: must not affect anything
    pvalues = window_pvalues(values, window=20)
    assert pvalues.shape == (67 // 20, 4)
    for w in range(3):
        np.testing.assert_allclose(pvalues[w], normaltest(values[w * 20:(w + 1) * 20].astype(np.float64), axis=0).pvalue)
    rows = pnac_rows({"norm": {"act": torch.from_numpy(values), "grad": torch.from_numpy(values)}}, 20)
    spans = [(r["first_step"], r["last_step"]) for r in rows if r["kind"] == "act"]
    assert spans == [(1, 20), (21, 40), (41, 60)]
    assert {r["kind"] for r in rows} == {"act", "grad"} and len(rows) == 6


def test_sliding_geometric_and_arithmetic_means():
    values = np.array([1.0, 2.0, 4.0, 8.0, 16.0, 100.0, 1.0])
    geometric, arithmetic = sliding_means(values, window=4)
    expected_gm = [np.exp(np.log(values[i:i + 4]).mean()) for i in range(4)]
    np.testing.assert_allclose(geometric, expected_gm)
    np.testing.assert_allclose(arithmetic, np.convolve(values, np.ones(4) / 4, mode="valid"))
    assert geometric[0] == pytest.approx(2 ** 1.5)


def test_outlier_counts_are_cumulative_skips():
    flags = torch.tensor([0, 1, 1, 0, 0, 1, 0, 1, 1, 1], dtype=torch.bool)
    counts = outlier_counts({"a": flags, "b": torch.zeros(10, dtype=torch.bool)})
    assert counts["steps"] == [3, 5, 8, 10]  # ceil(f * 10)
    assert counts["layers"]["a"] == [int(flags[:s].sum()) for s in (3, 5, 8, 10)] == [2, 2, 4, 6]
    assert counts["layers"]["b"] == [0, 0, 0, 0]


def make_run(run_dir: Path, skip: bool, epochs: int = 3, steps: int = 15,
             shapes=(("layers.0.norm1", 6), ("layers.0.norm2", 4))) -> None:
    """A synthetic run directory in the trainer's format; act[:, 0] holds the global step."""
    (run_dir / "stats").mkdir(parents=True)
    rng = np.random.default_rng(1)
    for epoch in range(epochs):
        layers = {}
        for name, channels in shapes:
            act = torch.from_numpy(rng.gamma(4.0, 0.25, size=(steps, channels)).astype(np.float32))
            act[:, 0] = torch.arange(epoch * steps + 1, (epoch + 1) * steps + 1)
            layers[name] = {"act": act, "grad": torch.from_numpy(
                rng.normal(size=(steps, channels)).astype(np.float32))}
            if skip:
                layers[name]["skip"] = torch.from_numpy(rng.random(steps) < 0.2)
        torch.save(layers, run_dir / "stats" / f"epoch_{epoch + 1:04d}.pt")
    (run_dir / "result.json").write_text(json.dumps({"exp": "tiny_un", "norm": "un", "model": "toy"}))


def analyze_run_module():
    spec = importlib.util.spec_from_file_location("analyze_run", REPO_ROOT / "scripts" / "analyze_run.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_load_statistics_concatenates_epochs_in_order(tmp_path):
    make_run(tmp_path / "run", skip=True)
    stats = load_statistics(tmp_path / "run")
    assert stats["layers.0.norm1"]["act"][:, 0].tolist() == list(range(1, 46))
    assert stats["layers.0.norm2"]["skip"].shape == (45,)
    with pytest.raises(FileNotFoundError, match="record_statistics=true"):
        load_statistics(tmp_path)


def test_analyze_run_writes_every_file(tmp_path):
    make_run(tmp_path / "run", skip=True)
    out = tmp_path / "out"
    analyze_run_module().main([str(tmp_path / "run"), "--out", str(out), "--layer", "layers.0.norm2",
                               "--channel", "3"])
    for name in ("pnac.csv", "pnac.json", "fig3_pnac.png", "fig7_pnac_density.png",
                 "fig4_statistics.png", "fig5_outliers.png", "outliers.json", "outliers.csv"):
        assert (out / name).stat().st_size > 0, name
    with open(out / "pnac.csv") as f:
        table = list(csv.DictReader(f))
    assert len(table) == 2 * 2 * (45 // 20)  # layers x kinds x windows
    saved = json.loads((out / "pnac.json").read_text())
    assert saved["exp"] == "tiny_un" and saved["window"] == 20 and len(saved["rows"]) == len(table)
    assert json.loads((out / "outliers.json").read_text())["steps"] == [12, 23, 34, 45]


def test_analyze_run_without_skip_flags_skips_fig5(tmp_path):
    make_run(tmp_path / "run", skip=False, epochs=1, steps=16, shapes=(("norm", 5),))  # Fig. 7: 1 value
    out = tmp_path / "out"
    analyze_run_module().main([str(tmp_path / "run"), "--out", str(out), "--window", "8"])
    assert (out / "fig4_statistics.png").exists() and (out / "fig7_pnac_density.png").exists()
    assert not (out / "fig5_outliers.png").exists() and not (out / "outliers.json").exists()
