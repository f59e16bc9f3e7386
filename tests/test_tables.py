"""make_tables on synthetic recorded runs, and the SLURM launcher config rendered by submitit."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import submitit
from hydra import compose, initialize_config_dir
from hydra_plugins.hydra_submitit_launcher.config import BaseQueueConf
from omegaconf import OmegaConf

ROOT = Path(__file__).resolve().parents[1]


def write_run(root: Path, name: str, **fields) -> None:
    run = {"status": "ok", "task": "classification", "model": "swin_t", "exp_data": "imagenet",
           "data": "digits", "norm": "un", "scale": "full", "overrides": [], "metrics": {}, "fail_step": None}
    run.update(fields)
    (root / name).mkdir(parents=True)
    (root / name / "result.json").write_text(json.dumps(run))


def make_tables(runs: Path, out: Path) -> str:
    runs.mkdir(parents=True, exist_ok=True)
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
    window = table_row(markdown, "Table 6", "ours: swin_t imagenet top1, run on digits")
    assert window[1:] == ["—", "—", "10.0 (n=1); vs default -71.0 (n=1 vs 3: no test)", "—", "—"]
    tex = (tmp_path / "out" / "tables.tex").read_text()
    assert "81.0 $\\pm$ 1.0 (n=3)" in tex and "\\begin{tabular}" in tex


def test_ours_are_named_by_the_data_they_ran_on_beside_the_papers_dataset(tmp_path):
    """A column, row or title of ours names the data its runs trained on (``data``) beside the
    experiment's dataset, the paper's (``exp_data``, by which runs are still grouped and the
    paper's numbers looked up); a run on the paper's own data names that alone."""
    runs = tmp_path / "runs"
    write_run(runs, "ln_cpu", norm="ln", scale="cpu", metrics={"top1": 90.0})
    write_run(runs, "ln_t2t", norm="ln", model="t2t_vit_14", data="imagenet", metrics={"top1": 79.0})
    write_run(runs, "un_m2", scale="cpu", overrides=["norm.window_size=2"], metrics={"top1": 85.0})
    markdown = make_tables(runs, tmp_path / "out")
    assert table_row(markdown, "Table 2", "method")[1:] == [
        "swin_t_imagenet (ours on digits)", "t2t_vit_14_imagenet (ours on imagenet)",
        "t2t_vit_14_cifar10", "t2t_vit_14_cifar100"]
    assert table_row(markdown, "Table 2", "LN")[1:3] == ["81.3 / 90.0 (n=1)†", "81.5 / 79.0 (n=1)"]
    assert table_row(markdown, "Table 6", "ours: swin_t imagenet top1, run on digits")[1] == "85.0 (n=1)†"
    assert "## CPU-scale settings: swin_t imagenet, run on digits\n" in markdown
    assert "run on imagenet" not in markdown


def test_a_damaged_record_is_named_with_the_fix(tmp_path):
    runs = tmp_path / "runs"
    write_run(runs, "ln0", norm="ln", metrics={"top1": 80.0})
    write_run(runs, "bn0", norm="bn", metrics={"top1": 70.0})
    damaged = runs / "bn0" / "result.json"
    damaged.write_text(damaged.read_text()[:40])
    proc = subprocess.run([sys.executable, "scripts/make_tables.py", "--runs", str(runs),
                           "--out", str(tmp_path / "out")], cwd=ROOT, capture_output=True, text=True)
    assert proc.returncode != 0
    assert f"{damaged} is not a whole result.json" in proc.stderr and "copy it again" in proc.stderr


def test_a_broken_record_is_counted_and_named_and_an_undefined_metric_is_not(tmp_path):
    """A run that learned without a number for its task's metric is skipped, counted and named
    with why; one with another metric broken stays in its task's cells and says 'broken' in
    that metric's; a metric not defined for a run (recorded null, or a COCO area range left
    out) is no broken record, and its cell says so."""
    runs = tmp_path / "runs"
    write_run(runs, "ln0", norm="ln", metrics={"top1": 80.0})
    write_run(runs, "ln1", norm="ln", metrics={"top1": 82.0})
    write_run(runs, "ln_missing", norm="ln", metrics={"top5": 99.0})
    write_run(runs, "ln_text", norm="ln", metrics={"top1": "n/a"})
    write_run(runs, "ln_chance", norm="ln", status="chance", metrics={})  # not a run that learned
    detection = {"task": "detection", "model": "mask_rcnn_swin_t", "exp_data": "coco", "data": "shapes"}
    for seed, ap in enumerate([40.0, 42.0]):  # no large objects: no APl; a box-only mask AP: null
        write_run(runs, f"mask{seed}", **detection, metrics={"bbox_AP": ap, "bbox_AP50": 60.0 + seed,
                                                             "segm_AP": None})
    write_run(runs, "mask_text", **detection, metrics={"bbox_AP": 44.0, "bbox_AP50": "x"})
    out = tmp_path / "out"
    proc = subprocess.run([sys.executable, "scripts/make_tables.py", "--runs", str(runs), "--out",
                           str(out), "--benchmarks", str(runs / "none")], cwd=ROOT,
                          capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("8 runs read, 2 skipped ->")
    named = {line.split(": ", 1)[0]: line.split(": ", 1)[1]
             for line in proc.stderr.split("runs read. ", 1)[1].strip().split("; ")}
    assert named == {f"{runs / 'ln_missing' / 'result.json'} (skipped)": "top1 missing",
                     f"{runs / 'ln_text' / 'result.json'} (skipped)": "top1 is 'n/a', not a number",
                     f"{runs / 'mask_text' / 'result.json'}": "bbox_AP50 is 'x', not a number"}
    markdown = (out / "tables.md").read_text()
    assert markdown.startswith("# The paper's tables beside ours (8 runs read, 2 skipped)")
    assert str(runs / "ln_missing" / "result.json") in markdown
    assert table_row(markdown, "Table 2", "LN")[1] == "81.3 / 81.0 ± 1.4 (n=2); broken 2/5; chance 1/5"
    un = {column.removesuffix(" (ours on shapes)"): cell for column, cell in
          zip(table_row(markdown, "Table 4", "method"), table_row(markdown, "Table 4", "UN"))}
    assert un["box AP"] == "45.6 / 42.0 ± 2.0 (n=3)"
    assert un["box AP50"] == "67.6 / 60.5 ± 0.7 (n=2); broken 1/3"
    assert un["mask AP"] == "41.4 / not defined 3/3"  # recorded null: by design
    assert un["box APl"] == "58.9 / not defined 3/3"  # left out by COCO evaluation: by design
    table4 = markdown.split("## Table 4")[1].split("## ")[0]
    assert "'not defined k/n'" in table4 and "'broken k/n'" in table4
    proc = subprocess.run([sys.executable, "-m", "analysis.stability", "--runs", str(runs), "--out",
                           str(tmp_path / "fig")], cwd=ROOT, capture_output=True, text=True)
    assert proc.stdout.startswith("8 runs read, 2 skipped") and "ln_missing" in proc.stderr


def test_my_runs_beside_the_committed_ones_never_over_the_committed_tables(tmp_path):
    """Several run folders table together; the committed tables are written only from the
    committed runs, and a folder that is not there is named."""
    mine, theirs = tmp_path / "mine", tmp_path / "theirs"
    write_run(mine, "bn0", norm="bn", metrics={"top1": 70.0})
    write_run(theirs, "ln0", norm="ln", metrics={"top1": 80.0})
    out = tmp_path / "out"
    proc = subprocess.run([sys.executable, "scripts/make_tables.py", "--runs", str(mine),
                           str(theirs), "--out", str(out)], cwd=ROOT, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    assert table_row((out / "tables.md").read_text(), "Table 2", "BN")[1] == (
        "80.8 / 70.0 (n=1); vs LN -10.0 (n=1 vs 1: no test)")
    committed = (ROOT / "results" / "tables" / "tables.md").read_bytes()
    for argv, message in ((["--runs", str(mine)], "--out <folder>"),
                          (["--runs", str(tmp_path / "typo"), "--out", str(out)], "no such folder")):
        proc = subprocess.run([sys.executable, "scripts/make_tables.py", *argv], cwd=ROOT,
                              capture_output=True, text=True)
        assert proc.returncode != 0 and message in proc.stderr
    assert (ROOT / "results" / "tables" / "tables.md").read_bytes() == committed


def test_a_composed_norm_is_its_method_and_weight_standardization_a_change(tmp_path):
    """``+exp=swin_t norm=bcn`` is BCN as configured, as ``+exp=swin_t_un`` is UN; adding
    ``ws=transformer`` changes what trains, so it is neither BCN's default cell nor merged in."""
    runs = tmp_path / "runs"
    cpu = {"scale": "cpu", "norm": "bcn"}
    write_run(runs, "bcn", overrides=["+exp=swin_t", "norm=bcn"], metrics={"top1": 70.0}, **cpu)
    write_run(runs, "bcn_ws", overrides=["+exp=swin_t", "norm=bcn", "ws=transformer"],
              metrics={"top1": 10.0}, **cpu)
    write_run(runs, "evonorm", norm="evonorm_s0", overrides=["+exp=swin_t", "norm=evonorm_s0"],
              metrics={"top1": 60.0})
    markdown = make_tables(runs, tmp_path / "out")
    assert table_row(markdown, "Table 2", "BCN")[1] == "— / 70.0 (n=1)†"
    assert table_row(markdown, "Table 2", "EvoNorm-S0")[1] == "— / 60.0 (n=1)"
    settings = "CPU-scale settings: swin_t imagenet, run on digits"
    assert table_row(markdown, settings, "BCN")[1:3] == ["70.0 (n=1)†", "—"]
    assert table_row(markdown, settings, "BCN ws=transformer")[1:3] == ["10.0 (n=1)†", "BCN"]


def test_detection_runs_fill_the_coco_tables_and_sweeps(tmp_path):
    runs = tmp_path / "runs"
    detection = {"task": "detection", "model": "mask_rcnn_swin_t", "exp_data": "coco", "data": "shapes"}
    write_run(runs, "mask_un", **detection, metrics={"bbox_AP": 45.0, "segm_AP": 40.5, "segm_AP50": 64.0})
    write_run(runs, "faster_ln", **{**detection, "model": "faster_rcnn_swin_t"}, norm="ln",
              status="FAIL", fail_step=77)
    write_run(runs, "mask_un_m2", **detection, overrides=["norm.window_size=2"],
              metrics={"bbox_AP": 42.0})
    markdown = make_tables(runs, tmp_path / "out")
    header = table_row(markdown, "Table 4", "method")
    un = dict(zip(header, table_row(markdown, "Table 4", "UN")))
    assert header[1] == "box AP (ours on shapes)"
    un = {column.removesuffix(" (ours on shapes)"): cell for column, cell in un.items()}
    assert un["box AP"] == "45.6 / 45.0 (n=1)" and un["mask AP"] == "41.4 / 40.5 (n=1)"
    assert un["mask AP50"] == "64.8 / 64.0 (n=1)" and un["box APl"] == "58.9 / not defined 1/1"
    assert table_row(markdown, "Table 3", "LN")[1] == "45.5 / FAIL 1/1 (step 77)"
    window = table_row(markdown, "Table 6", "ours: mask_rcnn_swin_t coco bbox_AP, run on shapes")
    assert window[1:] == ["42.0 (n=1); vs default -3.0 (n=1 vs 1: no test)", "—", "—", "—", "—"]


def test_sweeps_and_ablations_count_the_experiments_own_runs(tmp_path):
    """A run of the experiment as configured is the sweep's point at its configured value
    (and Exp1 of the component ablation); runs that change anything else are left out."""
    runs = tmp_path / "runs"
    options = {"window_size": 4, "momentum": 0.9}
    for seed in range(3):
        write_run(runs, f"un{seed}", seed=seed, norm_options=options, metrics={"top1": 80.0 + seed})
    write_run(runs, "un_m2", overrides=["norm.window_size=2"], norm_options=options,
              metrics={"top1": 70.0})
    write_run(runs, "un_exp4", overrides=["+ablation=un_exp4"], norm_options=options,
              metrics={"top1": 60.0})
    write_run(runs, "un_m2_lr", overrides=["norm.window_size=2", "recipe.lr=1"],
              norm_options=options, metrics={"top1": 1.0})
    # a job of the documented sweep (+sweep=window_size, restricted: norm.window_size=6,8)
    write_run(runs, "un_m6_sweep", overrides=["+exp=swin_t_un", "+sweep=window_size",
                                              "norm.window_size=6"],
              norm_options=options, metrics={"top1": 75.0})
    markdown = make_tables(runs, tmp_path / "out")
    window = table_row(markdown, "Table 6", "ours: swin_t imagenet top1, run on digits")
    assert window[1:] == ["70.0 (n=1); vs default -11.0 (n=1 vs 3: no test)", "81.0 ± 1.0 (n=3)",
                          "75.0 (n=1); vs default -6.0 (n=1 vs 3: no test)", "—", "—"]
    assert table_row(markdown, "Table 5", "1")[-1] == "81.0 ± 1.0 (n=3)"
    assert table_row(markdown, "Table 5", "4")[-1] == "60.0 (n=1); vs Exp1 -21.0 (n=1 vs 3: no test)"


def test_a_restricted_sweep_lands_in_its_paper_table_with_each_rows_metric_named(tmp_path):
    """The documented ``+exp=swin_t_un scale=cpu +sweep=window_size norm.window_size=2,8``:
    its jobs' records land in Table 6 and in the settings table as the plain change, never
    as a ``+sweep`` setting; the paper's rows (Mask R-CNN box and mask AP) and ours (top-1)
    are named by model and metric, and the note says they differ where they do."""
    from analysis.tables import paper_label
    runs = tmp_path / "runs"
    cpu = {"scale": "cpu", "norm_options": {"window_size": 4}}
    for seed, top1 in enumerate([80.0, 82.0]):
        write_run(runs, f"un{seed}", seed=seed, overrides=["+exp=swin_t_un", "scale=cpu", f"seed={seed}"],
                  metrics={"top1": top1}, **cpu)
    for size, top1 in ((2, 70.0), (8, 75.0)):
        write_run(runs, f"sweep_m{size}", overrides=["+exp=swin_t_un", "scale=cpu", "+sweep=window_size",
                                                     f"norm.window_size={size}"],
                  metrics={"top1": top1}, **cpu)
    detection = {"task": "detection", "model": "mask_rcnn_swin_t", "exp_data": "coco", "data": "shapes"}
    write_run(runs, "mask_m2", **detection, **cpu, overrides=["+sweep=window_size", "norm.window_size=2"],
              metrics={"bbox_AP": 30.0})
    markdown = make_tables(runs, tmp_path / "out")
    table6 = markdown.split("## Table 6")[1].split("## ")[0]
    assert table_row(markdown, "Table 6", "paper: mask_rcnn_swin_t coco bbox_AP")[1:] == [
        "42.8", "42.8", "42.8", "42.8", "42.5"]
    assert table_row(markdown, "Table 6", "paper: mask_rcnn_swin_t coco segm_AP")[1] == "39.2"
    assert table_row(markdown, "Table 6", "ours: swin_t imagenet top1, run on digits")[1:] == [
        "70.0 (n=1)†; vs default -11.0 (n=1 vs 2: no test)", "81.0 ± 1.4 (n=2)†", "—",
        "75.0 (n=1)†; vs default -6.0 (n=1 vs 2: no test)", "—"]
    assert table_row(markdown, "Table 6", "ours: mask_rcnn_swin_t coco bbox_AP, run on shapes")[1] == "30.0 (n=1)†"
    assert ("Not the paper's metric: swin_t imagenet top1 of ours is another model or metric than "
            "the paper's numbers beside it (mask_rcnn_swin_t coco bbox_AP, mask_rcnn_swin_t coco "
            "segm_AP)") in table6  # the detector's box AP is the paper's metric: not named
    settings = "CPU-scale settings: swin_t imagenet, run on digits"
    assert table_row(markdown, settings, "UN norm.window_size=2")[1] == "70.0 (n=1)†"
    assert "+sweep" not in markdown
    table9 = markdown.split("## Table 9")[1].split("## ")[0]
    assert "paper: transformer_iwslt_de_en iwslt14 bleu" in table9 and "Not the paper's" not in table9
    with pytest.raises(ValueError, match="top5.*PAPER_MEASURES"):
        paper_label("top5")


def test_stability_map_table_and_figure(tmp_path):
    runs = tmp_path / "runs"
    t2t = {"model": "t2t_vit_14", "exp_data": "digits", "scale": "cpu",
           "chance": {"metric": "top1", "threshold": 15.0, "lower_is_better": False}}
    for seed in range(2):
        write_run(runs, f"mabn1_{seed}", norm="mabn", seed=seed, **t2t, metrics={"top1": 80.0})
        write_run(runs, f"mabn30_{seed}", norm="mabn", seed=seed, **t2t,
                  overrides=["lr_multiple=30"], status="FAIL", fail_step=40 + seed)
        write_run(runs, f"mabn3_{seed}", norm="mabn", seed=seed, **t2t, overrides=["lr_multiple=3"],
                  metrics={"top1": 70.0 + 2 * seed})
    write_run(runs, "mabn30_2", norm="mabn", seed=2, **t2t, overrides=["lr_multiple=30"],
              status="chance", metrics={"top1": 10.0})
    write_run(runs, "un_noof3", seed=0, **t2t, overrides=["lr_multiple=3", "norm.outlier_filtration=false"],
              status="FAIL", fail_step=12)
    markdown = make_tables(runs, tmp_path / "out")
    title = "Stability: t2t_vit_14 digits"
    assert table_row(markdown, title, "setting")[1:] == ["1x lr", "3x lr", "30x lr"]
    assert table_row(markdown, title, "MABN")[1:] == ["80.0 ± 0.0 (n=2)†", "71.0 ± 1.4 (n=2)†",
                                                      "chance 1/3; FAIL 2/3 (step 40, 41)†"]
    assert table_row(markdown, title, "UN norm.outlier_filtration=false")[1:] == [
        "—", "FAIL 1/1 (step 12)†", "—"]
    settings = table_row(markdown, "CPU-scale settings: t2t_vit_14 digits", "MABN")
    assert settings[1] == "80.0 ± 0.0 (n=2)†"  # the ladder's runs are in the stability table only
    proc = subprocess.run([sys.executable, "-m", "analysis.stability", "--runs", str(runs),
                           "--out", str(tmp_path / "fig")], cwd=ROOT, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    points = json.loads((tmp_path / "fig" / "t2t_vit_14_digits.json").read_text())
    assert points["MABN"]["30"] == {"ok": [], "chance": [10.0], "fail": [40, 41]} and points["MABN"]["1"]["ok"] == [80.0, 80.0]
    assert (tmp_path / "fig" / "t2t_vit_14_digits.png").stat().st_size > 10_000


def test_the_stability_figure_draws_a_run_at_chance_at_the_chance_level(tmp_path, monkeypatch):
    """An eval loss of 1e14 at chance (BN's in the LM) is drawn on the chance line, as the
    sensitivity counts it, so the learning runs' curves keep the axis."""
    import analysis.stability as stability
    drawn = {}
    monkeypatch.setattr(stability, "save_figure", lambda fig, path: drawn.setdefault("fig", fig))
    lm = {"task": "language_modelling", "norm": "bn", "overrides": [], "metrics": {}}
    settings = {"Pre-LN": {1.0: [{**lm, "norm": "ln", "status": "ok", "metrics": {"val_loss": 3.9}}],
                           3.0: [{**lm, "norm": "ln", "status": "ok", "metrics": {"val_loss": 3.5}}]},
                "Pre-BN": {1.0: [{**lm, "status": "chance", "metrics": {"val_loss": 1.8e14}}]}}
    stability.plot_stability(settings, "t", "val_loss", tmp_path / "f.png", bound=5.7)
    ax = drawn["fig"].axes[0]
    chance_points = [y for collection in ax.collections for _, y in collection.get_offsets()]
    assert chance_points == [5.7] and ax.get_ylim()[1] < 10

def test_the_micro_batch_table_tests_each_norm_against_ln_at_its_micro_batch(tmp_path):
    """Rows: norms (BCN + WS its own row, not BCN's); columns: images per micro-batch (a record
    made before micro-batches: its config's batch); each cell against LN at the same
    micro-batch, the last column the norm's 2 against its 64, the runs at chance counted
    apart; another change (a momentum) is not the norm's setting."""
    from scipy import stats

    from analysis.significance import holm
    runs = tmp_path / "runs"
    values = {("ln", (), 64): [80.0, 82.0, 81.0], ("ln", (), 2): [79.0, 80.0, 82.0],
              ("bn", (), 64): [78.0, 79.0, 81.0], ("bn", (), 2): [40.0, 45.0],
              ("bcn", (), 2): [75.0, 76.0, 78.0], ("bcn", ("ws=residual",), 2): [70.0, 72.0, 71.5]}
    for (norm, extra, size), tops in values.items():
        micro = [] if size == 64 else [f"recipe.micro_batch_size={size}"]
        for seed, top1 in enumerate(tops):
            write_run(runs, f"{norm}{''.join(extra)}-mb{size}-s{seed}", norm=norm, scale="cpu",
                      seed=seed, micro_batch_size=size, accumulate=64 // size,
                      overrides=["+exp=swin_t", f"norm={norm}", *extra, *micro, f"seed={seed}"],
                      metrics={"top1": top1})
    # a record made before micro-batches: no micro_batch_size; its config gives the batch
    record = runs / "ln-mb64-s2" / "result.json"
    record.write_text(json.dumps({k: v for k, v in json.loads(record.read_text()).items()
                                  if k not in ("micro_batch_size", "accumulate")}))
    (record.parent / "config.yaml").write_text("recipe:\n  batch_size: 64\n")
    # records made before Hydra composed the CPU scale spelled the option recipe.cpu.*: the
    # same setting as today's recipe.micro_batch_size (the chance run joins BN's cell)
    write_run(runs, "bn-mb2-chance", norm="bn", scale="cpu", micro_batch_size=2, accumulate=32,
              status="chance", overrides=["+exp=swin_t_bn", "recipe.cpu.micro_batch_size=2"],
              metrics={"top1": 10.0})
    write_run(runs, "bn-mb2-momentum", norm="bn", scale="cpu", micro_batch_size=2, accumulate=32,
              overrides=["+exp=swin_t_bn", "recipe.cpu.micro_batch_size=2", "norm.momentum=0.5"],
              metrics={"top1": 20.0})
    markdown = make_tables(runs, tmp_path / "out")
    title = "Micro-batch training: swin_t imagenet"
    tests = [(values[("bn", (), 2)], values[("ln", (), 2)]),  # in the table's order
             (values[("bn", (), 64)], values[("ln", (), 64)]),
             (values[("bn", (), 2)], values[("bn", (), 64)]),
             (values[("bcn", (), 2)], values[("ln", (), 2)]),
             (values[("bcn", ("ws=residual",), 2)], values[("ln", (), 2)]),
             (values[("ln", (), 2)], values[("ln", (), 64)])]
    ps = [stats.ttest_ind(a, b, equal_var=False).pvalue for a, b in tests]
    adjusted = holm(ps)

    def result(i: int) -> str:
        a, b = tests[i]
        mark = "**" if adjusted[i] < 0.05 else "*" if ps[i] < 0.05 else ""
        return f"{sum(a) / len(a) - sum(b) / len(b):+.1f} (p={ps[i]:.2g}){mark}"
    assert table_row(markdown, title, "norm")[1:] == ["2", "64", "2 vs 64"]
    assert table_row(markdown, title, "LN")[1:] == ["80.3 ± 1.5 (n=3)†", "81.0 ± 1.0 (n=3)†", result(5)]
    assert table_row(markdown, title, "BN")[1:] == [
        f"42.5 ± 3.5 (n=2); chance 1/3†; vs LN {result(0)}",
        f"79.3 ± 1.5 (n=3)†; vs LN {result(1)}", result(2)]
    assert table_row(markdown, title, "BCN")[1:] == [f"76.3 ± 1.5 (n=3)†; vs LN {result(3)}", "—", "—"]
    assert table_row(markdown, title, "BCN + WS")[1:] == [
        f"71.2 ± 1.0 (n=3)†; vs LN {result(4)}", "—", "—"]
    assert "each update accumulates 64 images" in markdown
    # the settings table keeps the change the micro-batch table does not take, and leaves
    # the norms' micro-batches (tested above) out of its own comparisons
    settings = markdown.split("## CPU-scale settings: swin_t imagenet")[1].split("## ")[0]
    assert "BN norm.momentum=0.5 recipe.micro_batch_size=2" in settings
    assert "LN recipe.micro_batch_size=2" not in settings and "recipe.cpu" not in markdown
    assert "ws=residual" not in settings


def write_lm_run(root: Path, name: str, norm: str, seed: int, val_loss: float, position="pre",
                 overrides=(), batch_size=16, **metrics) -> None:
    """A language-modelling run with a two-point validation curve in its metrics.jsonl."""
    write_run(root, name, task="language_modelling", model="llama_cpu", exp_data="lm_cpu", data="lm_cpu",
              scale="cpu", norm=norm, seed=seed, norm_position=position, batch_size=batch_size,
              accumulate=1, overrides=[*overrides, f"seed={seed}"],
              metrics={"val_loss": val_loss, "tokens": 737280, **metrics})
    rows = [{"step": 1, "tokens": 1000, "val_loss": val_loss + 1.0},
            {"step": 2, "tokens": 2000, "val_loss": val_loss}]
    (root / name / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))


def test_language_modelling_table_tests_each_setting_against_pre_ln(tmp_path):
    from scipy import stats
    runs = tmp_path / "runs"
    ln, un, post = [3.90, 3.91, 3.92], [3.95, 3.97, 3.99], [3.905, 3.925, 3.915]
    for seed in range(3):
        write_lm_run(runs, f"ln{seed}", "ln", seed, ln[seed], leaks_future=False)
        write_lm_run(runs, f"un{seed}", "un", seed, un[seed], leaks_future=True,
                     val_loss_train_mode=3.5)
        write_lm_run(runs, f"post{seed}", "ln", seed, post[seed], "post",
                     overrides=["model.norm_position=post"], leaks_future=False)
    write_lm_run(runs, "nonorm_fail", "nonorm", 0, 0.0)
    (runs / "nonorm_fail" / "result.json").write_text(json.dumps(
        {**json.loads((runs / "nonorm_fail" / "result.json").read_text()),
         "status": "FAIL", "fail_step": 77, "metrics": {}}))
    for seed in range(2):  # the batch-size sweep: 4 and 64 beside the configured 16
        recipe = "recipe.cpu." if seed else "recipe."  # seed 1 as recorded before issue 45
        for size, shift in ((4, 0.2), (64, -0.1)):
            for norm, loss in (("ln", ln[seed]), ("un", un[seed])):
                write_lm_run(runs, f"{norm}_b{size}_{seed}", norm, seed, loss + shift,
                             overrides=[f"{recipe}batch_size={size}", f"{recipe}max_steps=9"],
                             batch_size=size)
    # another learning rate at the configured batch: neither a setting of the table nor the sweep's
    write_lm_run(runs, "ln_lr", "ln", 5, 9.0, overrides=["recipe.lr=0.01"])
    markdown = make_tables(runs, tmp_path / "out")
    title = "Language modelling: llama_cpu lm_cpu, validation loss"
    p_un = stats.ttest_ind(un, ln, equal_var=False).pvalue
    p_post = stats.ttest_ind(post, ln, equal_var=False).pvalue
    assert p_un < 0.05 < p_post  # the synthetic data: one difference real, one within noise
    assert table_row(markdown, title, "Pre-LN")[1:] == ["3.910 ± 0.010 (n=3)†", "—", "no"]
    # two tests in the table (UN, Post-LN; NoNorm has no finished run): Holm doubles the smaller p
    mark = "**" if 2 * p_un < 0.05 else "*"
    assert table_row(markdown, title, "Pre-UN")[1:] == [
        "3.970 ± 0.020 (n=3)†", f"+0.060 (p={p_un:.2g}){mark}", "yes (train mode 3.500)"]
    assert table_row(markdown, title, "Post-LN")[1:] == [
        "3.915 ± 0.010 (n=3)†", f"+0.005 (p={p_post:.2g})", "no"]
    assert table_row(markdown, title, "Pre-NoNorm")[1] == "FAIL 1/1 (step 77)†"
    sweep = "Language modelling: llama_cpu lm_cpu, validation loss by batch size"
    assert table_row(markdown, sweep, "setting")[1:] == ["4", "16", "64"]
    assert table_row(markdown, sweep, "Pre-LN")[1:] == [
        "4.105 ± 0.007 (n=2)†", "3.910 ± 0.010 (n=3)†", "3.805 ± 0.007 (n=2)†"]
    p16 = stats.ttest_ind(un, ln, equal_var=False).pvalue  # one of three tests (4, 16, 64)
    p4 = stats.ttest_ind([x + 0.2 for x in un[:2]], [x + 0.2 for x in ln[:2]], equal_var=False).pvalue
    p64 = stats.ttest_ind([x - 0.1 for x in un[:2]], [x - 0.1 for x in ln[:2]], equal_var=False).pvalue
    rank = sorted([p4, p16, p64]).index(p16)
    holm16 = max(min(1, (3 - i) * p) for i, p in enumerate(sorted([p4, p16, p64])[:rank + 1]))
    mark = "**" if holm16 < 0.05 else "*" if p16 < 0.05 else ""
    assert table_row(markdown, sweep, "UN − LN (Welch p)")[2] == f"+0.060 (p={p16:.2g}){mark}"
    proc = subprocess.run([sys.executable, "-m", "analysis.lm_curves", "--runs", str(runs),
                           "--out", str(tmp_path / "fig")], cwd=ROOT, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    curves = json.loads((tmp_path / "fig" / "llama_cpu_lm_cpu_curves.json").read_text())
    assert list(curves) == ["Pre-LN", "Post-LN", "Pre-UN"]  # as configured, finished runs only
    assert curves["Pre-UN"] == {"1000": [v + 1.0 for v in un], "2000": un}
    assert (tmp_path / "fig" / "llama_cpu_lm_cpu_curves.png").stat().st_size > 10_000


def test_cells_test_against_ln_and_show_chance_apart(tmp_path):
    """Each method's cell carries its difference from LN's runs of the column with Welch's p;
    a run at chance is counted apart, not in the mean or the test."""
    from scipy import stats
    runs = tmp_path / "runs"
    ln, bn = [80.0, 82.0, 81.0], [70.0, 71.0, 73.0]
    for seed in range(3):
        write_run(runs, f"ln{seed}", norm="ln", seed=seed, metrics={"top1": ln[seed]})
        write_run(runs, f"bn{seed}", norm="bn", seed=seed, metrics={"top1": bn[seed]})
    write_run(runs, "bn_chance", norm="bn", seed=3, status="chance", metrics={"top1": 10.0})
    markdown = make_tables(runs, tmp_path / "out")
    p = stats.ttest_ind(bn, ln, equal_var=False).pvalue
    assert p < 0.05  # one test in the table: Holm changes nothing
    assert table_row(markdown, "Table 2", "BN")[1] == (
        f"80.8 / 71.3 ± 1.5 (n=3); chance 1/4; vs LN -9.7 (p={p:.2g})**")
    assert "1 comparison in this table" in markdown


def test_a_difference_shows_at_any_n_and_a_test_where_both_sides_have_two(tmp_path):
    """One run against three, or three against one, prints the difference of means without p
    and the caption says what that means; claims, which check a p, still refuse a side of
    one run."""
    from analysis import claims
    runs = tmp_path / "runs"
    ln, un = [80.0, 82.0, 81.0], [60.0, 64.0]
    for seed, top1 in enumerate(ln):
        write_run(runs, f"ln{seed}", norm="ln", seed=seed, metrics={"top1": top1})
    write_run(runs, "bn0", norm="bn", metrics={"top1": 70.5})
    t2t = {"model": "t2t_vit_14"}
    write_run(runs, "t2t_ln0", norm="ln", metrics={"top1": 70.0}, **t2t)
    for seed, top1 in enumerate(un):
        write_run(runs, f"t2t_un{seed}", norm="un", seed=seed, metrics={"top1": top1}, **t2t)
    markdown = make_tables(runs, tmp_path / "out")
    assert table_row(markdown, "Table 2", "BN")[1] == "80.8 / 70.5 (n=1); vs LN -10.5 (n=1 vs 3: no test)"
    assert table_row(markdown, "Table 2", "UN")[2] == "80.9 / 62.0 ± 2.8 (n=2); vs LN -8.0 (n=2 vs 1: no test)"
    table2 = markdown.split("## Table 2")[1].split("## ")[0]
    assert "A difference without p" in table2 and "comparison" not in table2  # no test: no count
    records = [{**json.loads((folder / "result.json").read_text()), "scale": "cpu"}
               for folder in sorted(runs.iterdir())]
    with pytest.raises(ValueError, match="fewer than two runs on a side"):
        claims.compare(records, "swin_t:BN", "swin_t:LN")


def test_training_through_the_norms_has_its_table_tested_against_base(tmp_path):
    """SAM and norm-only runs fill their own table, each cell tested against the same norm
    with the recipe's optimizer, and count in no method table; the cost table reads the
    benchmark's ratios."""
    from scipy import stats
    runs = tmp_path / "runs"
    base, sam_on = [80.0, 81.0, 82.0], [84.0, 85.5, 85.0]
    for seed, (b, s) in enumerate(zip(base, sam_on)):
        write_run(runs, f"ln{seed}", norm="ln", metrics={"top1": b}, seed=seed)
        write_run(runs, f"ln_sam_on{seed}", norm="ln", overrides=["sam=sam_on"],
                  metrics={"top1": s}, seed=seed)
    write_run(runs, "ln_only", norm="ln", overrides=["train_only=norm"], status="chance",
              metrics={"top1": 10.0})
    bench = tmp_path / "bench"
    bench.mkdir()
    (bench / "sam_cpu.json").write_text(json.dumps({
        "device": "cpu", "rounds": 3, "spread": "interval", "results": [
            {"model": "swin_t", "norm": "ln", "variant": variant,
             "vs_base": {"median": ratio, "lo": ratio - 0.1, "hi": ratio + 0.1}}
            for variant, ratio in (("base", 1.0), ("sam_on", 2.05))]}))
    subprocess.run([sys.executable, "scripts/make_tables.py", "--runs", str(runs), "--out",
                    str(tmp_path / "out"), "--benchmarks", str(bench)], cwd=ROOT, check=True,
                   capture_output=True)
    markdown = (tmp_path / "out" / "tables.md").read_text()
    title = "Training through the norms: swin_t imagenet, top1, run on digits"
    header = markdown.split(f"## {title}")[1].splitlines()[2]
    assert header == "| norm | base | SAM-ON | norm only |"
    p = stats.ttest_ind(sam_on, base, equal_var=False).pvalue
    assert p < 0.05  # and the only test: Holm's correction leaves it, hence **
    assert table_row(markdown, title, "LN")[1:] == [
        "81.0 ± 1.0 (n=3)", f"84.8 ± 0.8 (n=3); vs base +3.8 (p={p:.2g})**", "chance 1/1"]
    assert table_row(markdown, "Table 2", "LN")[1].endswith("/ 81.0 ± 1.0 (n=3)")  # base only
    assert table_row(markdown, "Training through the norms: cost", "swin_t")[1:] == [
        "LN", "1.00 [0.90, 1.10]", "2.05 [1.95, 2.15]"]


def test_holm_adjustment_against_hand_computed_values():
    from analysis.significance import holm
    # sorted 0.01, 0.03, 0.04 -> 3 x 0.01, max(0.03, 2 x 0.03), max(0.06, 1 x 0.04)
    assert holm([0.04, 0.01, 0.03]) == pytest.approx([0.06, 0.03, 0.06])
    assert holm([0.5, 0.9]) == pytest.approx([1.0, 1.0])


def test_table8_prints_speedups_with_their_interval_beside_the_no_norm_limit(tmp_path):
    """A benchmark record with per-round paired ratios shows each speed-up (and memory
    reduction) as median and 95% interval, and the no-norm limit of the same model and mode
    beside it."""
    bench = tmp_path / "bench"
    bench.mkdir()
    ratio = lambda median, lo, hi: {"median": median, "lo": lo, "hi": hi}  # noqa: E731
    rows = [{"model": "swin_t", "variant": v, "mode": "eager", "batch": 8, "images_per_s": ips,
             "peak_mem_mb": 100.0, "vs_ln": r} for v, ips, r in
            (("ln", 10.0, ratio(1, 1, 1)), ("un_folded", 10.5, ratio(1.05, 1.038, 1.064)),
             ("no_norm", 10.8, ratio(1.08, 1.06, 1.11)))]
    rows[1]["mem_vs_ln"] = ratio(0.9, 0.85, 0.97)  # peak RSS over LN's, paired by process
    (bench / "inference_cpu.json").write_text(json.dumps({"device": "cpu", "batch": 8, "inference": rows}))
    (tmp_path / "none").mkdir()
    proc = subprocess.run([sys.executable, "scripts/make_tables.py", "--runs", str(tmp_path / "none"),
                           "--out", str(tmp_path / "out"), "--benchmarks", str(bench)],
                          cwd=ROOT, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    row = table_row((tmp_path / "out" / "tables.md").read_text(), "Table 8", "ours swin_t eager bs8 (cpu)")
    assert row[1] == "UN folded" and row[-2:] == ["+5.0% [+3.8%, +6.4%]", "+8.0% [+6.0%, +11.0%]"]
    assert row[4] == "10.0% [3.0%, 15.0%]"  # the memory reduction, its interval reversed


def test_placements_under_each_embedding_scale(tmp_path):
    """Each placement against Pre-LN under the same embedding scale; a comparison that keeps
    its sign and significance under all three holds, the others depend on the scale."""
    runs = tmp_path / "runs"
    losses = {  # placement -> (testbed, embedding norm, Mix-LN init)
        "pre": (3.9, 3.6, 3.6), "post": (3.6, 3.3, 3.3), "peri": (4.2, 3.6, 3.6), "mix": (3.6, 3.6, 3.6)}
    scales = ([], ["model.embedding_norm=true"], ["model.init=mixln"])
    for position, values in losses.items():
        for scale, loss in zip(scales, values):
            for seed in range(3):
                write_lm_run(runs, f"{position}-{len(scale) and scale[0]}-{seed}", "ln", seed,
                             loss + 0.01 * seed, position=position,
                             overrides=[f"model.norm_position={position}", *scale])
    markdown = make_tables(runs, tmp_path / "out")
    title = "Language modelling: llama_cpu lm_cpu, placement under the embedding scale"
    assert table_row(markdown, title, "Post-LN")[-1] == "holds: better"
    assert table_row(markdown, title, "Peri-LN")[-1] == "depends on the embedding scale"
    assert table_row(markdown, title, "Mix-LN")[-1] == "depends on the embedding scale"
    assert table_row(markdown, title, "Post-LN")[2].startswith("3.310 ± 0.010 (n=3)†; vs Pre-LN -0.300 (p=")


def test_the_attention_logit_table_gives_each_rates_median_and_max_with_how_runs_ended(tmp_path):
    """Per setting and rate: the median of the recorded logits, their max, n and how many
    ended at chance; a cell whose runs predate the probe is '—', a setting without any logit
    is left out."""
    runs = tmp_path / "runs"
    chance = {"metric": "val_loss", "threshold": 5.7, "lower_is_better": True}
    cells = {("ln", "", 0.3): [(5.0, 9.0, "ok"), (5.1, 10.0, "ok"), (5.2, 20.0, "ok")],
             ("ln", "", 100): [(6.0, 1e6, "chance"), (5.5, 2e4, "ok")],
             ("ln", "", 1): [(3.9, None, "ok")],
             ("rms", "", 0.3): [(5.0, None, "ok")]}
    for (norm, extra, multiple), seeds in cells.items():
        for seed, (loss, logit, status) in enumerate(seeds):
            metrics = {"val_loss": loss, **({"max_attn_logit": logit} if logit else {})}
            over = [f"+exp=llama_71m_{norm}", f"seed={seed}"]
            if multiple != 1:
                over.append(f"lr_multiple={multiple:g}")
            write_run(runs, f"{norm}-{multiple:g}-{seed}", task="language_modelling",
                      model="llama_cpu", exp_data="lm_c4", data="lm_cpu", norm=norm, norm_position="pre",
                      scale="cpu", seed=seed, chance=chance, status=status, metrics=metrics,
                      overrides=over)
    markdown = make_tables(runs, tmp_path / "out")
    title = ("Attention logits: llama_cpu lm_c4, the largest at the end by learning-rate multiple, "
             "run on lm_cpu")
    row = table_row(markdown, title, "Pre-LN")
    assert row[1:] == ["10 (max 20, n=3)", "—", "5.1e+05 (max 1e+06, n=2; chance 1)"]
    with pytest.raises(AssertionError):
        table_row(markdown, title, "Pre-RMSNorm")


def test_reproduction_copies_each_runs_records_once(tmp_path):
    """reproduce_cpu.sh copies a finished run's records to $RECORDS, and not again: a record
    changed after the copy (a relabelling, a re-run on another machine) is not overwritten by
    the stale run folder, unless that run finishes again."""
    out, records = tmp_path / "out", tmp_path / "records"
    run = out / "main" / "swin_t_ln-s0"
    run.mkdir(parents=True)
    (run / "config.yaml").write_text("seed: 0\n")
    (run / "result.json").write_text('{"status": "ok"}')
    env = {"PATH": "/usr/bin:/bin", "PY": "true", "OUT": str(out), "RECORDS": str(records),
           "SKIP_TRAINING": "1"}  # PY=true: the tables and figures after the copy do nothing

    def reproduce() -> str:
        proc = subprocess.run(["bash", "scripts/reproduce_cpu.sh"], cwd=ROOT, env=env,
                              capture_output=True, text=True)
        assert proc.returncode == 0, proc.stderr
        return (records / "main" / "swin_t_ln-s0" / "result.json").read_text()

    assert reproduce() == '{"status": "ok"}'
    (records / "main" / "swin_t_ln-s0" / "result.json").write_text('{"status": "chance"}')
    assert reproduce() == '{"status": "chance"}'  # relabelled after the copy: kept
    (run / "result.json").write_text('{"status": "ok", "seed": 0}')  # the run finished again
    later = (run / ".synced").stat().st_mtime + 10
    os.utime(run / "result.json", (later, later))
    assert reproduce() == '{"status": "ok", "seed": 0}'


def test_reproduction_resumes_from_committed_records(tmp_path):
    """A grid started on a fresh machine (an empty $OUT) trains only the runs that have no
    record in $RECORDS: what an earlier session committed is not trained again."""
    records, calls = tmp_path / "records", tmp_path / "calls"
    listing = subprocess.run(["bash", "scripts/reproduce_cpu.sh", "--list", "detection"], cwd=ROOT,
                             capture_output=True, text=True, check=True).stdout.splitlines()
    names = [line.split()[0] for line in listing]
    for name in names[1:]:  # every run but the first was committed earlier
        (records / name).mkdir(parents=True)
        (records / name / "result.json").write_text('{"status": "ok"}')
    fake_python = tmp_path / "python"  # records each call; trains nothing
    fake_python.write_text(f'#!/bin/sh\necho "$@" >> {calls}\n')
    fake_python.chmod(0o755)
    env = {"PATH": "/usr/bin:/bin", "PY": str(fake_python), "OUT": str(tmp_path / "out"),
           "RECORDS": str(records), "JOBS": "1"}
    proc = subprocess.run(["bash", "scripts/reproduce_cpu.sh", "detection"], cwd=ROOT, env=env,
                          capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    trained = [line for line in calls.read_text().splitlines() if line.startswith("scripts/train.py")]
    assert len(trained) == 1 and f"hydra.run.dir={tmp_path / 'out' / names[0]}" in trained[0]


def test_a_record_made_under_an_earlier_rule_is_trained_again_and_kept_aside(tmp_path):
    """A committed UN record whose warm-up (4 steps, alpha 0.9) ended before the floor (44) is
    trained again, even with its old run folder finished in $OUT, and the record is moved to
    $SUPERSEDED_RECORDS, not overwritten; a record the rule leaves alone is not retrained."""
    records, out, kept = tmp_path / "records", tmp_path / "out", tmp_path / "superseded"
    listing = subprocess.run(["bash", "scripts/reproduce_cpu.sh", "--list", "detection"], cwd=ROOT,
                             capture_output=True, text=True, check=True).stdout.splitlines()
    names = [line.split()[0] for line in listing]
    old, current = "detection/mask_rcnn_swin_t_un-s0", "detection/mask_rcnn_swin_t_un-s1"
    for name in names:
        warmup = 4 if name == old else 44
        write_run(records / "detection", name.split("/")[1], norm="un", scale="cpu",
                  norm_options={"warmup_iters": warmup, "momentum": 0.9}, overrides=[])
    (out / old).mkdir(parents=True)
    (out / old / "result.json").write_text('{"status": "ok"}')  # the old rule's run, finished
    calls = tmp_path / "calls"
    fake_python = tmp_path / "python"  # the listing from the real one; training records a call
    fake_python.write_text(
        f'#!/bin/sh\nif [ "$1" = -m ] && [ "$2" = analysis.runs ]; then exec {sys.executable} "$@"; fi\n'
        f'echo "$@" >> {calls}\n'
        'for arg; do case $arg in hydra.run.dir=*) dir=${arg#hydra.run.dir=};; esac; done\n'
        '[ -n "$dir" ] && echo "{\\"status\\": \\"rerun\\"}" > "$dir/result.json" && echo "seed: 0" > "$dir/config.yaml"\n'
        'exit 0\n')
    fake_python.chmod(0o755)
    before = (records / old / "result.json").read_text()
    env = {"PATH": "/usr/bin:/bin", "PY": str(fake_python), "OUT": str(out), "RECORDS": str(records),
           "SUPERSEDED_RECORDS": str(kept), "JOBS": "1", "PYTHONPATH": str(ROOT)}
    proc = subprocess.run(["bash", "scripts/reproduce_cpu.sh", "detection"], cwd=ROOT, env=env,
                          capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    trained = [line for line in calls.read_text().splitlines() if line.startswith("scripts/train.py")]
    assert len(trained) == 1 and f"hydra.run.dir={out / old}" in trained[0]
    assert (kept / old / "result.json").read_text() == before
    assert json.loads((records / old / "result.json").read_text()) == {"status": "rerun"}
    assert not (kept / current).exists() and (records / current / "result.json").exists()


def test_the_ladder_lists_a_third_seed_at_each_settings_best_rate(tmp_path):
    """Two seeds a rate on the translation ladder; once their records rank the rates, the best
    one (here 0.3x, where LN ends highest) is listed with a third seed, and only it."""
    records = tmp_path / "records"
    chance = {"metric": "bleu", "threshold": 1.0, "lower_is_better": False}
    bleu = {0.1: 20.0, 0.3: 60.0, 1: 50.0, 3: 40.0, 10: 0.5, 30: 0.5, 100: 0.5}
    for multiple, value in bleu.items():
        for seed in (0, 1):
            name = f"iwslt14_ln-e6{'' if multiple == 1 else f'-lr{multiple:g}x'}-s{seed}"
            write_run(records / "translation_ladder", name, task="translation", model="transformer",
                      exp_data="iwslt14", norm="ln", chance=chance, run_dir=f"/grid/{name}",
                      status="ok" if value > 1 else "chance", metrics={"bleu": value + seed},
                      overrides=["+exp=iwslt14_ln", "recipe.train.max_update=252",
                                 "recipe.train.max_epoch=6", f"seed={seed}",
                                 *([] if multiple == 1 else [f"lr_multiple={multiple:g}"])])
    env = {**os.environ, "RECORDS": str(records), "OUT": str(tmp_path / "out")}
    listing = subprocess.run(["bash", "scripts/reproduce_cpu.sh", "--list", "translation_ladder"],
                             cwd=ROOT, env=env, capture_output=True, text=True, check=True).stdout
    thirds = [line for line in listing.splitlines() if "-lr" in line and line.split()[0].endswith("-s2")]
    assert thirds == ["translation_ladder/iwslt14_ln-e6-lr0.3x-s2 +exp=iwslt14_ln "
                      "recipe.train.max_update=252 recipe.train.max_epoch=6 lr_multiple=0.3 seed=2"]


def test_the_committed_tables_regenerate_byte_for_byte(tmp_path):
    """``make_tables`` on the committed runs gives the committed tables: every number in them
    can be traced to a committed result.json."""
    proc = subprocess.run([sys.executable, "scripts/make_tables.py", "--out", str(tmp_path)],
                          cwd=ROOT, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    for name in ("tables.md", "tables.tex"):
        assert (tmp_path / name).read_bytes() == (ROOT / "results" / "tables" / name).read_bytes(), name


def test_paper_numbers_are_copied_beside_ours(tmp_path):
    markdown = make_tables(tmp_path / "empty", tmp_path / "out")
    assert table_row(markdown, "Table 1", "NoNorm")[1:] == ["FAIL (paper) / —", "32.8 / —"]
    assert table_row(markdown, "Table 9", "4")[4] == "18.3"
    assert table_row(markdown, "Table 9", "5")[4] == "FAIL (paper)"


def test_the_papers_fail_and_ours_read_apart(tmp_path):
    """A paper's FAIL says it is the paper's; ours carries how many collapsed and when."""
    runs = tmp_path / "runs"
    write_run(runs, "nonorm", task="translation", model="transformer_iwslt_de_en",
              exp_data="iwslt14", data="synthetic_mt", norm="nonorm", status="FAIL", fail_step=77)
    markdown = make_tables(runs, tmp_path / "out")
    assert table_row(markdown, "Table 1", "NoNorm")[1] == "FAIL (paper) / FAIL 1/1 (step 77)"


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


def test_norm_speed_tables_show_each_ratio_against_its_target(tmp_path):
    """A per-layer record with targets prints each ratio with its interval, target and
    verdict; a record from before the targets is left out; a per-model training record prints
    each norm's step over LN's per model."""
    bench = tmp_path / "bench"
    bench.mkdir()
    ratio = lambda median, lo, hi: {"median": median, "lo": lo, "hi": hi}  # noqa: E731
    layer = [{"shape": [2, 3], "norm": name, "mode": "eager", "kind": kind, "vs_fastest_ln": r,
              "target": target, "met": met} for name, kind, r, target, met in (
        ("un", "train", ratio(1.8, 1.7, 1.9), 3.0, "yes"),
        ("un", "infer", ratio(0.9, 0.8, 1.6), 1.5, "unresolved"),
        ("torch_ln", "train", ratio(1, 1, 1), None, None),
        ("torch_ln", "infer", ratio(1, 1, 1), None, None))]
    (bench / "norms_cpu.json").write_text(json.dumps({"device": "cpu", "rounds": 5, "results": layer}))
    old = [{**row, "shape": [4, 4]} for row in layer]
    for row in old:
        del row["target"], row["met"]
    (bench / "norms_old.json").write_text(json.dumps({"device": "gpu", "rounds": 5, "results": old}))
    steps = [{"model": model, "norm": norm, "mode": "eager", "vs_ln": r} for model, norm, r in (
        ("swin_t", "ln", ratio(1, 1, 1)), ("swin_t", "un", ratio(1.04, 1.01, 1.08)),
        ("llama_71m", "ln", ratio(1, 1, 1)))]
    (bench / "training_cpu.json").write_text(json.dumps({
        "device": "cpu", "rounds": 5, "train_batch": 2, "img_size": 224, "lm_context": 128,
        "training": steps}))
    other = [{"model": "llama_71m", "norm": norm, "mode": "eager", "vs_ln": r} for norm, r in (
        ("ln", ratio(1, 1, 1)), ("dyt", ratio(0.97, 0.9, 1.05)))]
    (bench / "training_cpu_b.json").write_text(json.dumps({  # the same device and mode: one table
        "device": "cpu", "rounds": 7, "train_batch": 2, "img_size": 224, "lm_context": 128,
        "training": other}))
    (tmp_path / "none").mkdir()
    proc = subprocess.run([sys.executable, "scripts/make_tables.py", "--runs", str(tmp_path / "none"),
                           "--out", str(tmp_path / "out"), "--benchmarks", str(bench)],
                          cwd=ROOT, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    markdown = (tmp_path / "out" / "tables.md").read_text()
    title = "Norm speed per layer: over the fastest LayerNorm (cpu, float32, norms_cpu.json)"
    assert table_row(markdown, title, "2x3")[1:] == [
        "un", "eager", "1.80 [1.70, 1.90]; target 3.00: yes",
        "0.90 [0.80, 1.60]; target 1.50: unresolved"]
    assert "norms_old.json" not in markdown
    title = "Norm speed per model: a training step over LN's (cpu, eager)"
    assert table_row(markdown, title, "UN")[1:] == ["1.04 [1.01, 1.08]", "—"]
    assert table_row(markdown, title, "DyT")[1:] == ["—", "0.97 [0.90, 1.05]"]  # the other run
