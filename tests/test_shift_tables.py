"""The shift benchmark's tables (analysis/test_time.py) from constructed records: a run's error
is 100 - its top-1 averaged over a condition's shifts, repeats and other batches are not
counted, an incomplete run is named, and each difference's p is Welch's (scipy)."""
from __future__ import annotations

import json
import statistics

from scipy import stats

from analysis import test_time

CORRUPTIONS = ("contrast", "gaussian_noise")


def write_run(root, name, norm, seed, scores, status="ok"):
    """A run with ``scores[(mode, shift, stream)] = top1`` at the grid's batch."""
    run = root / name
    (run / "test_time").mkdir(parents=True)
    (run / "result.json").write_text(json.dumps(
        {"model": "swin_t", "norm": norm, "seed": seed, "status": status}))
    for (mode, shift, stream), top1 in scores.items():
        corruption, _, severity = shift.partition(":")
        stem = f"{mode}_{shift.replace(':', '-')}_{stream}_b{test_time.BATCH}_s0"
        (run / "test_time" / f"{stem}.json").write_text(json.dumps(
            {"test_time": mode, "corruption": corruption, "severity": int(severity or 0),
             "stream": stream, "batch": test_time.BATCH, "seed": 0, "top1": top1}))


def scores(offset, modes=("source", "tbn")):
    out = {}
    for mode in modes:
        streams = ("iid",) if mode == "source" else test_time.STREAMS
        for stream in streams:
            out[(mode, "none", stream)] = 90 + offset
            for k, corruption in enumerate(CORRUPTIONS):
                for severity in (3, 5):
                    out[(mode, f"{corruption}:{severity}", stream)] = (
                        80 - 10 * k - severity + offset + (5 if mode == "tbn" else 0))
    return out


def test_errors_means_and_welch(tmp_path):
    for seed, offset in enumerate((0.0, 1.0, 3.0)):
        write_run(tmp_path, f"swin_t_ln-s{seed}", "ln", seed, scores(offset, ("source",)))
        write_run(tmp_path, f"swin_t_bn-s{seed}", "bn", seed, scores(2 * offset))
    # a repeat at another top-1 and another batch: neither counts
    extra = tmp_path / "swin_t_bn-s0" / "test_time"
    (extra / "source_none_iid_b64_s0.2.json").write_text(json.dumps(
        {"test_time": "source", "corruption": "none", "severity": 0, "stream": "iid",
         "batch": 64, "seed": 0, "top1": 0.0}))
    (extra / "source_none_iid_b16_s0.json").write_text(json.dumps(
        {"test_time": "source", "corruption": "none", "severity": 0, "stream": "iid",
         "batch": 16, "seed": 0, "top1": 0.0}))
    runs = test_time.load(tmp_path)
    bn = next(r for r in runs if r.name == "swin_t_bn-s0")
    # severity 5: (75 + 65) / 2 = 70 top-1, error 30; tbn 5 points better
    assert bn.error("source", "sorted", 5, list(CORRUPTIONS)) == 30
    assert bn.error("tbn", "sorted", 5, list(CORRUPTIONS)) == 25
    assert bn.error("source", "iid", 0, list(CORRUPTIONS)) == 10
    tables = {t.title: t for t in test_time.tables(runs)}
    own = tables["Test-time normalization, Swin-T, severity 5: top-1 error (%)"]
    bn_iid = next(row for row in own.rows if row[:2] == ["BN", "iid"])
    source = [30 - 2 * o for o in (0.0, 1.0, 3.0)]
    assert bn_iid[2].startswith(f"{statistics.mean(source):.1f} ± {statistics.stdev(source):.1f} (n=3)")
    tbn = [e - 5 for e in source]  # Welch's, unpaired, as the issue asks
    p = stats.ttest_ind(tbn, source, equal_var=False).pvalue
    assert bn_iid[3].endswith(f"vs source -5.0 (p={p:.2g})")
    against = tables["Test-time normalization, Swin-T, severity 5: against LN"]
    ln = [30 - o for o in (0.0, 1.0, 3.0)]
    p = stats.ttest_ind(source, ln, equal_var=False).pvalue
    row = next(row for row in against.rows if row[:2] == ["BN", "dirichlet"])
    assert row[2].startswith(f"{statistics.mean(source) - statistics.mean(ln):+.1f} (p={p:.2g})")


def test_an_incomplete_run_is_named_not_averaged(tmp_path):
    for seed in range(2):
        write_run(tmp_path, f"swin_t_ln-s{seed}", "ln", seed, scores(seed, ("source",)))
        partial = scores(seed)
        if seed == 1:
            del partial[("tbn", "contrast:5", "dirichlet")]
        write_run(tmp_path, f"swin_t_bn-s{seed}", "bn", seed, partial)
    write_run(tmp_path, "swin_t_bn-s2", "bn", 2, scores(0), status="chance")
    tables = {t.title: t for t in test_time.tables(test_time.load(tmp_path))}
    row = next(row for row in tables["Test-time normalization, Swin-T, severity 5: top-1 error (%)"].rows
               if row[:2] == ["BN", "dirichlet"])
    assert row[3].startswith("25.0 (n=1); chance or FAIL 1; incomplete 1")
    assert row[2].startswith("29.5 ± 0.7 (n=2); chance or FAIL 1")
