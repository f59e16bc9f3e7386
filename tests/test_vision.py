"""The vision path end to end on the embedded digits: Hydra configs, trainer, resume, DDP,
collapse, folding of timm models."""
from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import timm
import torch
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

import unnorm
from plugins.runlog import CollapseDetector, TrainingCollapsed
from plugins.timm import fold_model, fold_plan, model_from_config
from plugins.timm.data import DigitsDataset, build_datasets
from plugins.scale import effective_config
from plugins.timm.trainer import _param_groups, train

ROOT = Path(__file__).resolve().parents[1]
QUICK = ["scale=cpu", "logger=none", "recipe.cpu.epochs=1", "scale.max_steps_per_epoch=3"]


def config(*overrides):
    with initialize_config_dir(str(ROOT / "configs"), version_base="1.3"):
        return compose("train", overrides=list(overrides))


def run_script(*args, timeout=300, **kwargs):
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "WANDB_MODE": "offline"}
    return subprocess.run([sys.executable, *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=timeout, env=env, **kwargs)


@pytest.mark.parametrize("model", ["swin_t", "t2t_vit_14"])
@pytest.mark.parametrize("norm", unnorm.available_norms())
def test_every_norm_trains_both_models(model, norm, tmp_path):
    result = train(config(f"+exp={model}_{norm}", *QUICK), tmp_path)
    assert result["status"] == "ok" and result["norm"] == norm and result["steps"] == 3
    assert torch.isfinite(torch.tensor(result["metrics"]["train_loss"]))
    saved = json.loads((tmp_path / "result.json").read_text())
    assert saved["metrics"] == result["metrics"] and saved["scale"] == "cpu"
    assert (tmp_path / "config.yaml").exists() and (tmp_path / "last.pt").exists()
    checkpoint = torch.load(tmp_path / "last.pt", weights_only=False)
    model_norms = [m for m in model_from_config(OmegaConf.create(checkpoint["config"])).modules()
                   if isinstance(m, unnorm.ChannelNorm)]
    assert model_norms and all(type(m) is type(unnorm.build_norm(norm, 8)) for m in model_norms)
    assert not any(isinstance(m, torch.nn.LayerNorm) for m in
                   model_from_config(OmegaConf.create(checkpoint["config"])).modules())


def test_cpu_scale_learns_the_digits(tmp_path):
    """A short CPU run beats chance (10%) clearly: the pipeline really trains."""
    result = train(config("+exp=swin_t_ln", "scale=cpu", "logger=none", "recipe.cpu.epochs=4"),
                   tmp_path)
    assert result["metrics"]["top1"] > 40


def kill_and_resume(args: list[str], tmp_path: Path) -> tuple[dict, dict]:
    """Run ``scripts/train.py args`` whole; run it again, SIGKILL it as soon as its first
    checkpoint is written, and resume it. Returns both runs' result.json."""
    whole = tmp_path / "whole"
    done = run_script(*args, f"hydra.run.dir={whole}")
    assert done.returncode == 0, done.stderr[-2000:]
    killed = tmp_path / "killed"
    proc = subprocess.Popen([sys.executable, *args, f"hydra.run.dir={killed}"], cwd=ROOT,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.time() + 120
    while not (killed / "last.pt").exists() and time.time() < deadline:
        time.sleep(0.05)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    saved = torch.load(killed / "last.pt", weights_only=False)
    assert not (killed / "result.json").exists(), "the run finished before it was killed"
    resumed = run_script(*args, f"resume={killed}")
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert f"resuming {killed} at epoch {saved['epoch'] + 1}, step {saved['step']}" in resumed.stdout
    epochs = [json.loads(line)["epoch"] for line in (killed / "metrics.jsonl").read_text().splitlines()]
    assert epochs == list(range(1, len(epochs) + 1))
    return (json.loads((whole / "result.json").read_text()),
            json.loads((killed / "result.json").read_text()))


def test_resume_after_kill_continues_from_the_saved_epoch(tmp_path):
    want, got = kill_and_resume(["scripts/train.py", "+exp=t2t_vit_14_un", "scale=cpu", "logger=none",
                                 "recipe.cpu.epochs=3", "scale.max_steps_per_epoch=8",
                                 "recipe.cpu.model_ema.decay=0.9"], tmp_path)
    assert got["steps"] == want["steps"] == 24
    for key in ("top1", "top1_ema", "train_loss"):
        assert got["metrics"][key] == pytest.approx(want["metrics"][key], rel=1e-5), key


def test_two_process_ddp_with_synced_statistics(tmp_path):
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    proc = run_script("-m", "torch.distributed.run", "--nproc_per_node=2", f"--master_port={port}",
                      "scripts/train.py", "+exp=swin_t_un", *QUICK, "norm.sync_stats=true",
                      f"hydra.run.dir={tmp_path}", timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads((tmp_path / "result.json").read_text())
    assert result["status"] == "ok" and result["world_size"] == 2


def test_collapse_is_recorded_as_fail_with_its_step(tmp_path):
    result = train(config("+exp=swin_t_nonorm", "scale=cpu", "logger=none", "recipe.cpu.lr=1e6",
                          "recipe.cpu.warmup_epochs=0", "collapse.check_every=1"), tmp_path)
    saved = json.loads((tmp_path / "result.json").read_text())
    assert saved["status"] == "FAIL" and saved == result
    assert isinstance(saved["fail_step"], int) and saved["fail_step"] < 22
    assert saved["fail_reason"]
    assert not (tmp_path / "metrics.jsonl").exists()  # stopped inside the first epoch


def test_collapse_detector_names_the_exact_step():
    detector = CollapseDetector(loss_multiple=3.0, ema=0.0, min_steps=2, check_every=4)
    for step, loss in enumerate([2.0, 1.5, 1.0, 1.2, 2.9], start=1):
        detector.update(step, torch.tensor(loss))
    with pytest.raises(TrainingCollapsed) as caught:
        detector.update(6, torch.tensor(3.5))
        detector.check()
    assert caught.value.step == 6 and "diverged" in caught.value.reason
    detector = CollapseDetector(check_every=10)
    detector.update(1, torch.tensor(1.0))
    detector.update(2, torch.tensor(float("nan")))
    with pytest.raises(TrainingCollapsed, match="step 2: non-finite"):
        detector.check()


def test_bad_configs_fail_with_a_clear_message(tmp_path):
    proc = run_script("scripts/train.py", "+exp=swin_t_un", "norm=groupnorm", "scale=cpu")
    assert proc.returncode != 0 and "Available options" in proc.stderr and "un" in proc.stderr
    proc = run_script("scripts/train.py", "+exp=swin_t_un", "norm.window=3", "scale=cpu")
    assert proc.returncode != 0 and "window" in proc.stderr
    with pytest.raises(ValueError, match="valid options: .*window_size"):
        train(config("+exp=swin_t_un", *QUICK, "+norm.window=3"), tmp_path / "a")
    with pytest.raises(FileNotFoundError, match="IMAGENET_ROOT"):
        train(config("+exp=swin_t_un", "logger=none", "data.root=/nonexistent"), tmp_path / "b")
    with pytest.raises(ValueError, match="init_from"):  # fine-tuning needs the ImageNet run
        train(config("+exp=t2t_vit_14_cifar10_un", "logger=none"), tmp_path / "c")
    with pytest.raises(FileNotFoundError, match="cifar-10-batches-py"):
        train(config("+exp=t2t_vit_14_cifar10_un", "logger=none", "data.root=/nonexistent",
                     "init_from=/nonexistent/last.pt"), tmp_path / "c")
    proc = run_script("scripts/train.py", "+exp=swin_t_un", "scale=cpu", f"resume={tmp_path}")
    assert proc.returncode != 0 and "no last.pt" in proc.stderr


def test_finetuning_resets_norm_steps_and_scales_the_backbone_lr(tmp_path):
    train(config("+exp=t2t_vit_14_un", *QUICK), tmp_path / "pre")
    cfg = config("+exp=t2t_vit_14_cifar10_un", *QUICK, f"init_from={tmp_path / 'pre' / 'last.pt'}")
    model = model_from_config(effective_config(cfg))
    groups = _param_groups(model, 5e-4, 0.01)
    head = {id(p) for p in model.get_classifier().parameters()}
    for group in groups:
        is_head = any(id(p) in head for p in group["params"])
        assert group["lr_scale"] == (1.0 if is_head else 0.01)
        assert (group["weight_decay"] == 0) == all(p.ndim <= 1 or p is model.cls_token
                                                   for p in group["params"])
    result = train(cfg, tmp_path / "fine")
    assert result["init"].startswith(str(tmp_path / "pre")) and result["status"] == "ok"
    tuned = torch.load(tmp_path / "fine" / "last.pt", weights_only=False)["model"]
    steps = {k: int(v) for k, v in tuned.items() if k.endswith("num_iters")}
    assert steps and set(steps.values()) == {3}  # counted from 0 again, not 3 + 3


def test_digits_dataset_is_the_real_sklearn_set():
    train_set, val_set = DigitsDataset(True, 32), DigitsDataset(False, 32)
    assert len(train_set) + len(val_set) == 1797 and len(val_set) == 360
    image, label = train_set[0]
    assert image.size == (32, 32) and image.mode == "RGB" and 0 <= label < 10
    assert sorted(set(val_set.targets)) == list(range(10))
    cfg = effective_config(config("+exp=swin_t_un", "scale=cpu"))
    train_tf, _ = build_datasets(cfg.data, cfg.recipe.aug, cfg.model.img_size)
    assert train_tf[0][0].shape == (3, 32, 32)


def _warm(model, img_size, steps=4):
    """Train a few steps so the offline norms have non-trivial inference statistics."""
    model.train()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    for _ in range(steps):
        optimizer.zero_grad()
        model(torch.randn(4, 3, img_size, img_size) * 2).logsumexp(-1).mean().backward()
        optimizer.step()
    return model.eval().double()


@pytest.mark.parametrize("norm", ["un", "bn", "mabn", "pn"])
def test_folded_swin_with_padded_windows_matches_the_original(norm):
    torch.manual_seed(0)
    model = timm.create_model("swin_tiny_patch4_window7_224", num_classes=5, img_size=48,
                              embed_dim=16, depths=(2, 2, 2, 1), num_heads=(1, 2, 2, 4),
                              window_size=4, norm_layer=unnorm.norm_layer(norm, warmup_iters=2)
                              if norm != "bn" else unnorm.norm_layer(norm))
    model = _warm(model, 48)
    plan = fold_plan(model)
    padded = [name for name, linears in plan.items() if name.endswith("norm1") and not linears]
    assert padded == ["layers.1.blocks.0.norm1", "layers.1.blocks.1.norm1"]  # 6x6 map, window 4
    x = torch.randn(3, 3, 48, 48, dtype=torch.float64)
    with torch.no_grad():
        before = model(x)
        done = fold_model(model)
        after = model(x)
    assert done == {"folded": len(plan) - 3, "affine": 3, "kept": 0}  # patch_embed + the two padded blocks
    assert not any(isinstance(m, unnorm.ChannelNorm) for m in model.modules())
    assert ((after - before).abs().max() / before.abs().max()) < 1e-4


def test_folded_t2t_vit_matches_the_original():
    torch.manual_seed(0)
    model = timm.create_model("t2t_vit_tiny", num_classes=5, img_size=32,
                              norm_layer=unnorm.norm_layer("un", warmup_iters=2))
    model = _warm(model, 32)
    x = torch.randn(3, 3, 32, 32, dtype=torch.float64)
    with torch.no_grad():
        before = model(x)
        assert fold_model(model) == {"folded": 13, "affine": 0, "kept": 0}
        after = model(x)
    assert not any(isinstance(m, unnorm.ChannelNorm) for m in model.modules())
    assert ((after - before).abs().max() / before.abs().max()) < 1e-4


@pytest.mark.parametrize("norm, summary, left", [
    ("un", "20 norms into linear layers, 1 into frozen affines, kept 0 whole", ()),
    ("dyt", "20 norms into linear layers, 0 into frozen affines, kept 1 whole", (unnorm.DynamicTanh,))])
def test_fold_script_writes_a_loadable_folded_checkpoint(norm, summary, left, tmp_path):
    train(config(f"+exp=swin_t_{norm}", *QUICK), tmp_path)
    proc = run_script("scripts/fold.py", str(tmp_path))
    assert proc.returncode == 0, proc.stderr
    assert f"folded {summary}" in proc.stdout
    sys.path.insert(0, str(ROOT / "scripts"))
    from fold import load_folded

    folded = load_folded(tmp_path / "folded.pt")
    assert [type(m) for m in folded.modules() if isinstance(m, unnorm.ChannelNorm)] == list(left)
    proc = run_script("scripts/fold.py", str(tmp_path / "nowhere"))
    assert proc.returncode != 0 and "no checkpoint" in proc.stderr
