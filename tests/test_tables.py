"""make_tables on synthetic recorded runs, and the SLURM launcher config rendered by submitit."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import submitit
from hydra import compose, initialize_config_dir
from hydra_plugins.hydra_submitit_launcher.config import BaseQueueConf
from omegaconf import OmegaConf

ROOT = Path(__file__).resolve().parents[1]


def write_run(root: Path, name: str, **fields) -> None:
    run = {"status": "ok", "task": "classification", "model": "swin_t", "exp_data": "imagenet",
           "norm": "un", "scale": "full", "overrides": [], "metrics": {}, "fail_step": None}
    run.update(fields)
    (root / name).mkdir(parents=True)
    (root / name / "result.json").write_text(json.dumps(run))


def make_tables(runs: Path, out: Path) -> str:
    proc = subprocess.run([sys.executable, "scripts/make_tables.py", "--runs", str(runs),
                           "--out", str(out), "--benchmarks", str(runs / "none")],
                          cwd=ROOT, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    return (out / "tables.md").read_text()


def table_row(markdown: str, table: str, first_cell: str) -> list[str]:
    section = markdown.split(f"## {table}")[1].split("## ")[0]
    for line in section.splitlines():
        cells = [c.strip() for c in line.strip("|").split("|")]
        if cells[0] == first_cell:
            return cells
    raise AssertionError(f"no row {first_cell!r} in {table}")


def test_cells_summarise_seeds_failures_and_cpu_scale(tmp_path):
    runs = tmp_path / "runs"
    for seed, top1 in enumerate([80.0, 81.0, 82.0]):
        write_run(runs, f"un{seed}", metrics={"top1": top1}, seed=seed)
    write_run(runs, "bn_fail", norm="bn", status="FAIL", fail_step=1234)
    write_run(runs, "bn_ok", norm="bn", metrics={"top1": 79.5})
    write_run(runs, "ln_cpu", norm="ln", scale="cpu", metrics={"top1": 90.25}, model="t2t_vit_14")
    write_run(runs, "un_swept", overrides=["norm.window_size=6"], metrics={"top1": 10.0})
    markdown = make_tables(runs, tmp_path / "out")
    un = table_row(markdown, "Table 2", "UN")
    assert un[1] == "81.0 / 81.0 ± 1.0 (n=3)"  # the swept run is not a default run
    assert table_row(markdown, "Table 2", "BN")[1] == "80.8 / 79.5 (n=1); FAIL 1/2 (step 1234)"
    assert table_row(markdown, "Table 2", "LN")[2] == "81.5 / 90.2 (n=1)†"
    window = table_row(markdown, "Table 6", "ours: swin_t imagenet top1")
    assert window[1:] == ["—", "—", "10.0 (n=1)", "—", "—"]
    tex = (tmp_path / "out" / "tables.tex").read_text()
    assert "81.0 $\\pm$ 1.0 (n=3)" in tex and "\\begin{tabular}" in tex


def test_detection_runs_fill_the_coco_tables_and_sweeps(tmp_path):
    runs = tmp_path / "runs"
    detection = {"task": "detection", "model": "mask_rcnn_swin_t", "exp_data": "coco"}
    write_run(runs, "mask_un", **detection, metrics={"bbox_AP": 45.0, "segm_AP": 40.5, "segm_AP50": 64.0})
    write_run(runs, "faster_ln", **{**detection, "model": "faster_rcnn_swin_t"}, norm="ln",
              status="FAIL", fail_step=77)
    write_run(runs, "mask_un_m2", **detection, overrides=["norm.window_size=2"],
              metrics={"bbox_AP": 42.0})
    markdown = make_tables(runs, tmp_path / "out")
    header = table_row(markdown, "Table 4", "method")
    un = dict(zip(header, table_row(markdown, "Table 4", "UN")))
    assert un["box AP"] == "45.6 / 45.0 (n=1)" and un["mask AP"] == "41.4 / 40.5 (n=1)"
    assert un["mask AP50"] == "64.8 / 64.0 (n=1)" and un["box APl"] == "58.9 / —"  # not measured
    assert table_row(markdown, "Table 3", "LN")[1] == "45.5 / FAIL 1/1 (step 77)"
    window = table_row(markdown, "Table 6", "ours: mask_rcnn_swin_t coco bbox_AP")
    assert window[1:] == ["42.0 (n=1)", "—", "—", "—", "—"]


def test_paper_numbers_are_copied_beside_ours(tmp_path):
    markdown = make_tables(tmp_path / "empty", tmp_path / "out")
    assert table_row(markdown, "Table 1", "NoNorm")[1:] == ["FAIL / —", "32.8 / —"]
    assert table_row(markdown, "Table 9", "4")[4] == "18.3"


def test_slurm_launcher_config_renders_an_sbatch_script(tmp_path, monkeypatch):
    monkeypatch.setattr(submitit.SlurmExecutor, "affinity", classmethod(lambda cls: 1))  # no srun here
    with initialize_config_dir(str(ROOT / "configs"), version_base="1.3"):
        cfg = compose("train", overrides=["+exp=swin_t_un", "hydra/launcher=slurm",
                                          "hydra.launcher.partition=gpu", f"hydra.sweep.dir={tmp_path}"],
                      return_hydra_config=True)
    params = OmegaConf.to_container(cfg.hydra.launcher, resolve=True)
    assert params.pop("_target_").endswith("SlurmLauncher")
    # as hydra-submitit-launcher builds its executor, without submitting
    executor = submitit.AutoExecutor(folder=params.pop("submitit_folder"), cluster="slurm",
                                     slurm_max_num_timeout=params.pop("max_num_timeout"))
    base = set(OmegaConf.structured(BaseQueueConf).keys())
    executor.update_parameters(**{k if k in base else f"slurm_{k}": v for k, v in params.items()})
    script = executor._executor._make_submission_file_text("python scripts/train.py", "uid")
    for line in ("#SBATCH --partition=gpu", "#SBATCH --gpus-per-node=8", "#SBATCH --ntasks-per-node=8",
                 "#SBATCH --cpus-per-task=10", "#SBATCH --time=4320", "#SBATCH --nodes=1"):
        assert line in script, line
