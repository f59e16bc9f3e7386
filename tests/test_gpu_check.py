"""scripts/gpu_check.py: its rehearsal on the CPU runs every step, and a budget that runs out
stops the step in flight and starts no other, with what was measured kept."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
STEPS = ["tests", "swin_t_inference", "swin_t_training", "llama_71m", "norms_bfloat16",
         "norms_float32", "norms_bfloat16_compiled", "models_training_eager", "profile_norms"]


def gpu_check(*args):
    return subprocess.run([sys.executable, "scripts/gpu_check.py", *map(str, args)], cwd=ROOT,
                          capture_output=True, text=True, timeout=900)


@pytest.mark.slow
def test_the_dry_run_runs_every_step_and_keeps_each_record(tmp_path):
    done = gpu_check("--dry-run", "--out-dir", tmp_path, "--budget", 800, "--commit", "c0ffee")
    assert done.returncode == 0, done.stderr + (tmp_path / "gpu_check.log").read_text()[-3000:]
    summary = json.loads((tmp_path / "gpu_check.json").read_text())
    assert [step["name"] for step in summary["steps"]] == STEPS
    assert all(step["status"] == "passed" and (step["wrote"] or step["out"] is None)
               for step in summary["steps"])
    assert summary["git_commit"] == "c0ffee" and summary["git_dirty"] is None
    inference = json.loads((tmp_path / "inference_cuda.json").read_text())
    assert inference["context"]["git_commit"] == "c0ffee"  # the copied tree's, as named
    assert {row["variant"] for row in inference["inference"]} == {"ln", "un_folded", "no_norm"}
    assert inference["training"] == []
    assert inference["memory_rounds"] == 0  # the CPU's peak-RSS probe is not rehearsed
    assert all(row["peak_mem_mb"] is None for row in inference["inference"])
    training = json.loads((tmp_path / "training_cuda.json").read_text())
    assert {row["norm"] for row in training["training"]} == {"ln", "un"}
    for dtype, modes in (("bfloat16", {"eager"}), ("float32", {"eager"}),
                         ("bfloat16_compiled", {"eager", "compiled"})):
        norms = json.loads((tmp_path / f"norms_cuda_{dtype}.json").read_text())
        assert {row["dtype"] for row in norms["results"]} == {dtype.split("_")[0]}
        assert {row["mode"] for row in norms["results"]} == modes
    per_model = json.loads((tmp_path / "training_cuda_norms_eager.json").read_text())
    assert {(row["model"], row["norm"], row["mode"]) for row in per_model["training"]} == {
        ("llama_71m", "ln", "eager"), ("llama_71m", "un", "eager")}
    assert "== un: wall" in (tmp_path / "gpu_check.log").read_text()  # the profile's
    llama = json.loads((tmp_path / "inference_cuda_llama.json").read_text())
    assert {row["variant"] for row in llama["inference"]} == {"ln", "crms_converted", "no_norm"}


def test_a_spent_budget_cuts_the_step_in_flight_and_starts_no_other(tmp_path):
    done = gpu_check("--dry-run", "--out-dir", tmp_path, "--budget", 1.5)
    assert done.returncode == 0, done.stderr
    steps = json.loads((tmp_path / "gpu_check.json").read_text())["steps"]
    assert [step["status"] for step in steps] == ["cut"] + ["not started"] * (len(STEPS) - 1)
    assert steps[0]["returncode"] is None  # killed by the budget, not waited for
    assert "== tests" in (tmp_path / "gpu_check.log").read_text()


def test_bad_requests_are_refused_by_name(tmp_path):
    done = gpu_check("--dry-run", "--out-dir", tmp_path, "--only", "tables")
    assert done.returncode == 2 and "the steps are tests, swin_t_inference" in done.stderr
    done = gpu_check("--dry-run", "--out-dir", tmp_path, "--budget", 0)
    assert done.returncode == 2 and "must be positive" in done.stderr
    if not torch.cuda.is_available():
        done = gpu_check("--out-dir", tmp_path)
        assert done.returncode == 1 and "use --dry-run" in done.stderr
