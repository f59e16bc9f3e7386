"""The vision path end to end on the embedded digits: Hydra configs, trainer, resume, DDP,
collapse, folding of timm models."""
from __future__ import annotations

import functools
import importlib
import json
import math
import os
import random
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import timm
import torch
import torch.multiprocessing as mp
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

import unnorm
from plugins.checkpoints import load_checkpoint
from plugins.runlog import FINISHED, CollapseDetector, TrainingCollapsed
from plugins.timm import fold_model, fold_plan, model_from_config
from plugins.timm.data import DigitsDataset, build_datasets
from plugins.scale import effective_config
from analysis.statistics import load_statistics
from plugins.timm.trainer import _param_groups, train

ROOT = Path(__file__).resolve().parents[1]
QUICK = ["scale=cpu", "logger=none", "recipe.epochs=1", "scale.max_steps_per_epoch=3"]


def config(*overrides):
    with initialize_config_dir(str(ROOT / "configs"), version_base="1.3"):
        return compose("train", overrides=list(overrides))


def script_env() -> dict:
    """The environment for a script run by a test: wandb offline, and without the wandb
    service an in-process run of an earlier test started (a run killed while attached to it
    would keep its run ID "in use" there, refusing the resume)."""
    env = {k: v for k, v in os.environ.items() if k != "WANDB_SERVICE"}
    return {**env, "PYTHONUNBUFFERED": "1", "WANDB_MODE": "offline"}


def run_script(*args, timeout=300, **kwargs):
    return subprocess.run([sys.executable, *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=timeout, env=script_env(), **kwargs)


@pytest.mark.parametrize("model", ["swin_t", "t2t_vit_14"])
@pytest.mark.parametrize("norm", unnorm.available_norms())
def test_every_norm_trains_both_models(model, norm, tmp_path):
    result = train(config(f"+exp={model}_{norm}", *QUICK), tmp_path)
    assert result["status"] in FINISHED and result["norm"] == norm and result["steps"] == 3
    assert result["exp_data"] == "imagenet" and result["data"] == "digits"  # tables group by the first
    # three updates inside the warm-up: chance unless top-1 beats 1.5 x 100/10 classes
    assert result["status"] == ("chance" if result["metrics"]["top1"] <= 15 else "ok")
    assert result["chance"]["metric"] == "top1" and result["chance"]["threshold"] == 15
    assert torch.isfinite(torch.tensor(result["metrics"]["train_loss"]))
    saved = json.loads((tmp_path / "result.json").read_text())
    assert saved["metrics"] == result["metrics"] and saved["scale"] == "cpu"
    assert (tmp_path / "config.yaml").exists() and (tmp_path / "last.pt").exists()
    checkpoint = load_checkpoint(tmp_path / "last.pt")
    model_norms = [m for m in model_from_config(OmegaConf.create(checkpoint["config"])).modules()
                   if isinstance(m, unnorm.ChannelNorm)]
    assert model_norms and all(type(m) is type(unnorm.build_norm(norm, 8)) for m in model_norms)
    assert not any(isinstance(m, torch.nn.LayerNorm) for m in
                   model_from_config(OmegaConf.create(checkpoint["config"])).modules())


def test_cpu_scale_learns_the_digits(tmp_path):
    """A short CPU run beats chance (10%) clearly: the pipeline really trains. The learning
    rate moves every update: a linear warm-up from warmup_lr over the first epoch's 22
    updates (flat if the schedule stepped per epoch), then timm's cosine over all 88."""
    result = train(config("+exp=swin_t_ln", "scale=cpu", "logger=none", "recipe.epochs=4"),
                   tmp_path)
    assert result["status"] == "ok" and result["metrics"]["top1"] > 40
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    lrs = [lr for row in rows for lr in row["lr_per_update"]]
    peak, start, low, warmup, total = 2e-3, 1e-6, 1e-5, 22, 88
    expected = [start + (peak - start) * t / warmup if t < warmup else
                low + (peak - low) * (1 + math.cos(math.pi * t / total)) / 2 for t in range(total)]
    assert len(rows[0]["lr_per_update"]) == warmup and lrs == pytest.approx(expected, rel=1e-9)


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
    saved = load_checkpoint(killed / "last.pt")
    assert not (killed / "result.json").exists(), "the run finished before it was killed"
    resumed = run_script(*args, f"resume={killed}")
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert f"resuming {killed} at epoch {saved['epoch'] + 1}, step {saved['step']}" in resumed.stdout
    epochs = [json.loads(line)["epoch"] for line in (killed / "metrics.jsonl").read_text().splitlines()]
    assert epochs == list(range(1, len(epochs) + 1))
    return (json.loads((whole / "result.json").read_text()),
            json.loads((killed / "result.json").read_text()))


@pytest.mark.slow
def test_resume_after_kill_continues_from_the_saved_epoch(tmp_path):
    want, got = kill_and_resume(["scripts/train.py", "+exp=t2t_vit_14_un", "scale=cpu", "logger=none",
                                 "recipe.epochs=3", "scale.max_steps_per_epoch=8",
                                 "recipe.model_ema.decay=0.9"], tmp_path)
    assert got["steps"] == want["steps"] == 24
    for key in ("top1", "top1_ema", "train_loss"):
        assert got["metrics"][key] == pytest.approx(want["metrics"][key], rel=1e-5), key


# --- several processes: two gloo replicas, every replica checked ---------------------------------

def free_port() -> int:
    """A free port below the kernel's ephemeral range: a port the kernel hands out (bind to
    port 0) can be given again, between this probe and the rendezvous, to another test
    process's outgoing connection (gloo opens many), which made the rendezvous fail with
    EADDRINUSE under xdist."""
    ranges = Path("/proc/sys/net/ipv4/ip_local_port_range")  # Linux; macOS's starts at 49152
    first_ephemeral = int(ranges.read_text().split()[0]) if ranges.exists() else 49152
    for port in random.Random().sample(range(10_000, first_ephemeral), 200):
        with socket.socket() as probe:
            try:
                probe.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError(f"no free port in 10000-{first_ephemeral - 1} after 200 tries")


def train_as_replica(rank, port, runs, train):
    """Replica ``rank`` of two (gloo, as under torchrun) training each ``(overrides, run)``
    with a task's ``train``: the body ``torch.multiprocessing`` spawns."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      LOCAL_RANK=str(rank), WORLD_SIZE="2")
    torch.set_num_threads(1)
    for overrides, run_dir in runs:
        train(config(*overrides), Path(run_dir))


def named_norm_state(model) -> dict[str, torch.Tensor]:
    """A copy of every buffer of every norm with running state, by name."""
    return {f"{name}.{key}": buffer.clone() for name, module in model.named_modules()
            if isinstance(module, unnorm.GuardedNorm)
            for key, buffer in module.named_buffers(recurse=False)}


# what each trainer evaluates, recorded at the call that scores it: (function, argument index)
EVALUATED = {"plugins.timm.trainer": ("accuracy", 0),  # the logits of a batch
             "plugins.torchvision.trainer": ("coco_evaluate", 1)}  # every replica's detections


def ddp_replica(rank, ports, trainer, runs, out_dir, every_step):
    """Replica ``rank`` of two running ``trainer``'s ``train`` as under torchrun (gloo), for
    each ``(overrides, run directory)`` of ``runs`` in turn. Saves ``out_dir/rank<r>.pt``, per
    run: per evaluation, the norm state the replica evaluated with and what it scored
    (``EVALUATED``); with ``every_step``, its norm state after every optimizer step."""
    os.environ.update(MASTER_ADDR="127.0.0.1", RANK=str(rank), LOCAL_RANK=str(rank),
                      WORLD_SIZE="2")
    torch.set_num_threads(1)
    module = importlib.import_module(trainer)
    records, models = [], []

    def wrap(name, before=None, after=None, owner=module):
        original = getattr(owner, name)

        @functools.wraps(original)
        def wrapped(*args, **kwargs):
            if before:
                before(*args)
            value = original(*args, **kwargs)
            if after:
                after()
            return value
        setattr(owner, name, wrapped)

    evaluated, index = EVALUATED[trainer]
    wrap("data_parallel", before=lambda model, *_: models.append(model),  # the run skeleton's DDP
         owner=importlib.import_module("plugins.training"))
    wrap("evaluate", before=lambda model, *_: records[-1]["eval"].append(
        {"state": named_norm_state(model), "outputs": []}))
    wrap(evaluated, before=lambda *args: records[-1]["eval"][-1]["outputs"].append(args[index]))
    if every_step:
        wrap("optimizer_step", after=lambda: records[-1]["step"].append(named_norm_state(models[-1])),
             owner=importlib.import_module("plugins.loop"))  # the shared loop steps every trainer
    try:
        for port, (overrides, run_dir) in zip(ports, runs):
            os.environ["MASTER_PORT"] = str(port)
            records.append({"eval": [], "step": []})
            module.train(config(*overrides), Path(run_dir))
    finally:
        torch.save(records, Path(out_dir) / f"rank{rank}.pt")


def two_replicas(trainer, runs: list[tuple[list[str], Path]], out_dir: Path,
                 every_step=False) -> list[list[dict]]:
    """Per run of ``runs``, each replica's records (``ddp_replica``): ``[run][rank]``."""
    out_dir.mkdir(parents=True)
    mp.start_processes(ddp_replica, args=([free_port() for _ in runs], trainer,
                                          [(list(o), str(d)) for o, d in runs], str(out_dir),
                                          every_step),
                       nprocs=2, start_method="spawn")
    per_rank = [load_checkpoint(out_dir / f"rank{rank}.pt") for rank in range(2)]
    return [list(replicas) for replicas in zip(*per_rank)]


def assert_states_equal(first: dict, second: dict, what: str, rtol=0.0, atol=0.0) -> None:
    assert first.keys() == second.keys() and first, what
    for key, value in first.items():
        torch.testing.assert_close(second[key], value, rtol=rtol, atol=atol, msg=f"{what}: {key}")


DDP_RUN = ["+exp=t2t_vit_14_un", "scale=cpu", "logger=none", "recipe.epochs=2",
           "scale.max_steps_per_epoch=3", "recipe.model_ema.decay=0.9"]


@pytest.mark.slow
def test_ddp_replicas_score_and_save_one_norm_state_and_resume_alike(tmp_path):
    """Per-replica statistics (the default): at every evaluation (model and EMA) both
    replicas hold one norm state; last.pt, evaluated alone, gives the recorded top-1 and each
    replica's logits; resumed after epoch 1, both replicas continue as without the kill."""
    whole = tmp_path / "whole"
    [replicas] = two_replicas("plugins.timm.trainer", [(DDP_RUN, whole)], tmp_path / "records")
    result = json.loads((whole / "result.json").read_text())
    assert result["status"] in FINISHED and result["world_size"] == 2 and result["steps"] == 6
    assert len(replicas[0]["eval"]) == len(replicas[1]["eval"]) == 4  # 2 epochs x (model, EMA)
    for number, (first, second) in enumerate(zip(replicas[0]["eval"], replicas[1]["eval"])):
        assert_states_equal(first["state"], second["state"], f"evaluation {number}")

    saved = load_checkpoint(whole / "last.pt")
    cfg = OmegaConf.create(saved["config"])
    _, val_set = build_datasets(cfg.data, cfg.recipe.aug, cfg.model.img_size)
    loader = torch.utils.data.DataLoader(val_set, batch_size=32)
    targets = torch.cat([labels for _, labels in loader])
    for key, weights, number in (("top1", "model", 2), ("top1_ema", "model_ema", 3)):
        model = model_from_config(cfg).eval()
        model.load_state_dict(saved[weights])
        with torch.no_grad():
            logits = torch.cat([model(images) for images, _ in loader])
        top1 = 100 * (logits.argmax(-1) == targets).float().mean().item()
        assert top1 == pytest.approx(result["metrics"][key], abs=1e-4), key
        for rank in range(2):  # each replica scored items rank, rank + 2, ...
            torch.testing.assert_close(torch.cat(replicas[rank]["eval"][number]["outputs"]),
                                       logits[rank::2], rtol=1e-4, atol=1e-5)

    killed = tmp_path / "killed"  # as a kill right after epoch 1's checkpoint leaves it
    killed.mkdir()
    (killed / "config.yaml").write_bytes((whole / "config.yaml").read_bytes())
    (killed / "last.pt").write_bytes((whole / "previous.pt").read_bytes())
    (killed / "metrics.jsonl").write_text((whole / "metrics.jsonl").read_text().splitlines()[0] + "\n")
    [resumed] = two_replicas("plugins.timm.trainer", [([*DDP_RUN, f"resume={killed}"], killed)],
                             tmp_path / "resumed_records")
    for rank in range(2):
        for number, (want, got) in enumerate(zip(replicas[rank]["eval"][2:], resumed[rank]["eval"])):
            assert_states_equal(want["state"], got["state"], f"rank {rank}, evaluation {number}",
                                rtol=1e-5, atol=1e-7)
    again = json.loads((killed / "result.json").read_text())
    for key in ("top1", "top5", "top1_ema", "train_loss"):
        assert again["metrics"][key] == pytest.approx(result["metrics"][key], rel=1e-5), key


def test_synced_statistics_agree_on_every_replica_at_every_step(tmp_path):
    """``norm.sync_stats=true``: after every optimizer step, every replica's norms hold the
    same state (UN's windows and EMAs, PRepBN's running statistics, every counter)."""
    norms = ["un", "prepbn"]
    runs = two_replicas("plugins.timm.trainer",
                        [([f"+exp=swin_t_{norm}", *QUICK, "norm.sync_stats=true"], tmp_path / norm)
                         for norm in norms], tmp_path / "records", every_step=True)
    for norm, replicas in zip(norms, runs):
        assert json.loads((tmp_path / norm / "result.json").read_text())["world_size"] == 2
        steps = [replica["step"] for replica in replicas]
        assert len(steps[0]) == len(steps[1]) == 3
        for step, (first, second) in enumerate(zip(*steps)):
            assert_states_equal(first, second, f"{norm}, step {step + 1}")
        changed = [k for k, v in steps[0][0].items() if v.is_floating_point()
                   and not torch.equal(v, steps[0][-1][k])]
        assert any(k.endswith("running_var") for k in changed), norm  # the statistics moved


def test_collapse_is_recorded_as_fail_with_its_step(tmp_path):
    result = train(config("+exp=swin_t_nonorm", "scale=cpu", "logger=none", "recipe.lr=1e6",
                          "recipe.warmup_epochs=0", "collapse.check_every=1"), tmp_path)
    saved = json.loads((tmp_path / "result.json").read_text())
    assert saved["status"] == "FAIL" and saved == result
    assert isinstance(saved["fail_step"], int) and saved["fail_step"] < 22
    assert saved["fail_reason"]
    assert not (tmp_path / "metrics.jsonl").exists()  # stopped inside the first epoch


def test_a_collapse_keeps_the_statistics_recorded_up_to_it(tmp_path):
    """record_statistics=true: the epoch a run collapsed in is saved up to the collapse (every
    step it took, the last non-finite), so the collapse can be looked at."""
    result = train(config("+exp=swin_t_un", "scale=cpu", "logger=none", "recipe.lr=1e6",
                          "recipe.warmup_epochs=0", "collapse.check_every=1",
                          "record_statistics=true"), tmp_path)
    assert result["status"] == "FAIL"
    stats = load_statistics(tmp_path)
    steps = {len(layer["act"]) for layer in stats.values()}
    assert steps == {result["fail_step"]}, (steps, result["fail_step"])


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
    with pytest.raises(ValueError, match="norm_sync='mean': choose reduce .* or broadcast"):
        train(config("+exp=swin_t_un", *QUICK, "norm_sync=mean"), tmp_path / "a")
    with pytest.raises(FileNotFoundError, match="IMAGENET_ROOT"):
        train(config("+exp=swin_t_un", "logger=none", "data.root=/nonexistent"), tmp_path / "b")
    with pytest.raises(ValueError, match="init_from"):  # fine-tuning needs the ImageNet run
        train(config("+exp=t2t_vit_14_cifar10_un", "logger=none"), tmp_path / "c")
    with pytest.raises(FileNotFoundError, match="cifar-10-batches-py"):
        train(config("+exp=t2t_vit_14_cifar10_un", "logger=none", "data.root=/nonexistent",
                     "init_from=/nonexistent/last.pt"), tmp_path / "c")
    launched = tmp_path / "launched"  # Hydra's folder for the launch: gone with the refusal
    for refused, message in ((f"resume={tmp_path}", "no last.pt"),
                             ("lr_multiple=-1", "lr_multiple must be > 0")):
        proc = run_script("scripts/train.py", "+exp=swin_t_un", "scale=cpu", refused,
                          f"hydra.run.dir={launched}")
        assert proc.returncode != 0 and message in proc.stderr
        assert not launched.exists()
    for mistyped in (["+exp=swin_t_uun"], ["-m", "+exp=swin_t_un,swin_t_uun"]):  # one run, a sweep
        proc = run_script("scripts/train.py", *mistyped, "scale=cpu", f"hydra.run.dir={launched}")
        assert proc.returncode != 0 and not launched.exists()
        assert proc.stderr.splitlines() == [
            "+exp=swin_t_uun is no experiment. Closest: swin_t_un, swin_t_pn, swin_t_ln, swin_t_gn, "
            "swin_t_bn"]  # difflib's closest, not Hydra's list of every experiment


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
    assert result["init"].startswith(str(tmp_path / "pre")) and result["status"] in FINISHED
    tuned = load_checkpoint(tmp_path / "fine" / "last.pt")["model"]
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
        done = fold_model(model, probe=x)
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
        assert fold_model(model, probe=x) == {"folded": 13, "affine": 0, "kept": 0}
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


MICRO_RUN = ["scale=cpu", "logger=none", "recipe.epochs=1", "scale.max_steps_per_epoch=2",
             "recipe.batch_size=8", "recipe.lr_batch=8", "recipe.mixup=null",
             "model.kwargs.drop_path_rate=0", "seed=0"]


def test_micro_batches_accumulate_the_update_and_the_norms_count_them(tmp_path):
    """recipe.micro_batch_size=4 of a batch of 8: LN (no batch statistics) takes the same
    updates as with the whole batch in one pass; UN counts micro-batches (2 per update), and
    the norms' step counts keep their place in updates (the scale rule's factor doubles)."""
    states = {}
    for name, extra in (("whole", []), ("micro", ["recipe.micro_batch_size=4"])):
        result = train(config("+exp=t2t_vit_14_ln", *MICRO_RUN, *extra), tmp_path / name)
        assert result["status"] in FINISHED and result["accumulate"] == (2 if extra else 1)
        states[name] = load_checkpoint(tmp_path / name / "last.pt")["model"]
    assert_states_equal(states["whole"], states["micro"], "LN: micro-batches against the batch",
                        rtol=1e-5, atol=1e-6)
    result = train(config("+exp=t2t_vit_14_un", *MICRO_RUN, "recipe.micro_batch_size=4"),
                   tmp_path / "un")
    state = load_checkpoint(tmp_path / "un" / "last.pt")["model"]
    assert {int(v) for k, v in state.items() if k.endswith("num_iters")} == {2 * 2}
    factors = [OmegaConf.load(tmp_path / name / "config.yaml").scale.norm_step_factor
               for name in ("un", "micro")]  # the rule's factor: twice the norm steps per update
    assert factors[0] == factors[1] and factors[0] == pytest.approx(
        2 * OmegaConf.load(tmp_path / "whole" / "config.yaml").scale.norm_step_factor)
    with pytest.raises(ValueError, match="micro_batch_size"):
        train(config("+exp=t2t_vit_14_ln", *MICRO_RUN, "recipe.micro_batch_size=3"),
              tmp_path / "bad")
