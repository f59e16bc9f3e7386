"""The mmdetection plugin: our norms through mmcv's build_norm_layer and mmdet's Swin, timm
checkpoints converted to mmdet weights, the paper's configs, and the Hydra backend (one
process and two, resume, the settings it honours or refuses, safe checkpoint loading).

mmdet is imported plainly: ``make test`` installs it, and a broken install fails here."""
from __future__ import annotations

import copy
import json
import math
import os
import shutil
import socket
import sys
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp
from mmcv.cnn import build_norm_layer
from mmengine.config import Config
from mmengine.logging import HistoryBuffer
from mmengine.optim import build_optim_wrapper
from mmdet.registry import MODELS
from mmdet.utils import register_all_modules
from omegaconf import OmegaConf
from timm.utils.agc import adaptive_clip_grad

import unnorm
from plugins.checkpoints import UnsafeCheckpoint, load_checkpoint
from plugins.distributed import Distributed
from plugins.mmdet import (MMDET_NAMES, UnfoldOrderPowerNorm, convert_checkpoint, norm_cfg,
                           timm_to_mmdet)
from plugins.mmdet import convert as convert_cli
from plugins.mmdet import runner as runner_module
from plugins.mmdet.runner import (CONFIGS, UnnormRunHook, UnnormRunner, amp_optim_wrapper,
                                  guard_loss_scaler, mmdet_config, our_metrics,
                                  plain_logged_values, rebuild_logged_values, steps_per_epoch,
                                  train)
from plugins.runlog import FINISHED, SCALE_INVARIANCE_FILE
from plugins.scale import effective_config
from plugins.timm import model_from_config
from test_vision import config

register_all_modules()
TINY_SWIN = dict(type="UnnormSwinTransformer", embed_dims=32, depths=[2, 2, 2, 2],
                 num_heads=[1, 2, 4, 8], window_size=7)
# scale=cpu on a few generated images
DETECTION = ["model.backend=mmdet", "scale=cpu", "data=shapes", "data.generate.num_val=4"]


def detection(tmp_path: Path, exp: str, *more: str, num_train: int = 16, epochs: int = 1,
              logger: str = "none") -> list[str]:
    """Hydra overrides of a short mmdet run (evaluated once, at its end)."""
    return [f"+exp={exp}", *DETECTION, f"data.root={tmp_path / 'shapes'}",
            f"data.generate.num_train={num_train}", f"recipe.epochs={epochs}",
            f"recipe.eval_every={epochs}", f"logger={logger}", *more]


class _RunsCode:
    """Unpickling this touches ``marker``: a checkpoint that runs code when loaded."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return Path.touch, (self.marker,)


def malicious_checkpoint(path: Path, **entries) -> Path:
    marker = path.with_suffix(".ran")
    torch.save({**entries, "payload": _RunsCode(marker)}, path)
    return marker


@pytest.mark.parametrize("norm", unnorm.available_norms())
def test_build_norm_layer_builds_ours_with_the_injected_eps(norm):
    abbr, layer = build_norm_layer(norm_cfg(norm), 24, postfix=1)
    assert type(layer) is type(unnorm.build_norm(norm, 24)) and abbr == f"{norm}1"
    if "eps" in unnorm.option_names(norm):
        assert layer.eps == 1e-5
        assert build_norm_layer(dict(type=MMDET_NAMES[norm], eps=1e-3), 24)[1].eps == 1e-3


def test_unknown_options_and_names_fail_with_the_valid_ones():
    with pytest.raises(ValueError, match="valid options"):
        build_norm_layer(dict(type="UN", window=4), 8)
    with pytest.raises(ValueError, match="unknown norm"):
        norm_cfg("groupnorm")
    assert type(build_norm_layer(dict(type="LN"), 8)[1]) is torch.nn.LayerNorm  # mmcv's kept


@pytest.mark.parametrize("norm", ["un", "mabn", "pn", "rms", "bn"])
def test_mmdet_swin_uses_our_norms_everywhere_and_decays_none(norm):
    backbone = MODELS.build({**TINY_SWIN, "norm_cfg": norm_cfg(norm)})
    backbone.init_weights()
    norms = [m for m in backbone.modules() if isinstance(m, unnorm.ChannelNorm)]
    assert len(norms) == 2 * 8 + 3 + 4 + 1 and not any(
        isinstance(m, torch.nn.LayerNorm) for m in backbone.modules())
    assert all(torch.equal(m.weight, torch.ones_like(m.weight)) for m in norms)
    backbone.train()  # mmdet's Swin.train returns None
    outputs = backbone(torch.rand(2, 3, 64, 96))
    assert [o.shape[1] for o in outputs] == [32, 64, 128, 256]
    paper = Config.fromfile(str(CONFIGS / "mask_rcnn_swin_t_fpn_3x_coco.py"))
    wrapper = build_optim_wrapper(backbone, paper.optim_wrapper)
    decay = {id(p): group["weight_decay"] for group in wrapper.optimizer.param_groups
             for p in group["params"]}
    for module in norms:
        assert all(decay[id(p)] == 0 for p in module.parameters())
    assert decay[id(backbone.stages[0].blocks[0].ffn.layers[0][0].weight)] == 0.05


def test_pn_ls_groups_by_the_heads_of_each_stage():
    """group_num=None: the heads of the norm's stage (a patch merging counts with the stage
    after it, as in timm's Swin); an int forces one value; mmdet's own Swin cannot know the
    heads and says what to use."""
    backbone = MODELS.build({**TINY_SWIN, "norm_cfg": norm_cfg("pn_ls", group_num=None)})
    groups = {name: m.group_num for name, m in backbone.named_modules()
              if isinstance(m, unnorm.PowerNorm)}
    assert len(groups) == 2 * 8 + 3 + 4 + 1
    assert groups["patch_embed.norm"] == 1
    assert groups["stages.1.blocks.0.norm1"] == groups["stages.1.blocks.1.norm2"] == 2
    assert groups["stages.3.blocks.1.norm2"] == groups["norm3"] == 8 and groups["norm2"] == 4
    assert [groups[f"stages.{i}.downsample.norm"] for i in range(3)] == [2, 4, 8]
    assert all(m.layer_scale for m in backbone.modules() if isinstance(m, unnorm.PowerNorm))
    assert type(backbone.stages[0].downsample.norm) is UnfoldOrderPowerNorm
    backbone.train()
    assert [o.shape[1] for o in backbone(torch.rand(2, 3, 64, 64))] == [32, 64, 128, 256]
    forced = MODELS.build({**TINY_SWIN, "norm_cfg": norm_cfg("pn_ls", group_num=2)})
    assert {m.group_num for m in forced.modules() if isinstance(m, unnorm.PowerNorm)} == {2}
    with pytest.raises(ValueError, match="UnnormSwinTransformer"):
        MODELS.build({**TINY_SWIN, "type": "SwinTransformer",
                      "norm_cfg": norm_cfg("pn_ls", group_num=None)})


def _trained_classifier(norm: str, options: dict, steps: int = 3, embed_dim: int = 16,
                        window_size: int = 2):
    """A narrow timm Swin with ``norm`` after ``steps`` training steps, and its run config.

    At 128 px with 2x2 windows every stage map (32 ... 4) exceeds one window: there timm and
    mmdet compute the same thing (timm drops the shift when a map is a single window)."""
    run = OmegaConf.create({
        "model": {"timm_name": "swin_tiny_patch4_window7_224", "img_size": 128,
                  "kwargs": {"embed_dim": embed_dim, "depths": [2, 2, 2, 2],
                             "num_heads": [1, 2, 4, 8], "window_size": window_size}},
        "norm": {"name": norm, **options}, "data": {"num_classes": 5}})
    torch.manual_seed(0)
    classifier = model_from_config(run)
    optimizer = torch.optim.SGD(classifier.parameters(), lr=0.01)
    for _ in range(steps):
        loss = classifier(torch.randn(2, 3, 128, 128)).logsumexp(1).mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    return classifier.eval(), OmegaConf.to_container(run)


CONVERTED_OPTIONS = {"un": {"warmup_iters": 2, "window_size": 2}, "mabn": {"warmup_iters": 2},
                     "pn": {"warmup_iters": 2}, "pn_ls": {"warmup_iters": 2, "group_num": None},
                     "prepbn": {"decay_iters": 4}}


@pytest.mark.parametrize("norm", unnorm.available_norms())
def test_converted_checkpoint_gives_mmdet_swin_the_same_features(norm):
    """Our ImageNet Swin (timm layout, live statistics) converted: step counters restarted
    exactly as ``unnorm.reset_steps`` restarts them (UN, MABN, PN; PRepBN keeps its count),
    and mmdet's Swin, loading the result, computes the same stage outputs."""
    options = CONVERTED_OPTIONS.get(norm, {})
    classifier, run = _trained_classifier(norm, options, steps=3)
    converted = convert_checkpoint({"model": classifier.state_dict(), "config": run},
                                   reset_steps=True)
    restarted = copy.deepcopy(classifier)
    unnorm.reset_steps(restarted)
    want = timm_to_mmdet(restarted.state_dict())
    assert converted.keys() == want.keys()
    assert all(torch.equal(converted[key], want[key]) for key in want)
    counters = {int(v) for k, v in converted.items() if k.endswith("num_iters")}
    restarted_norms = {"un": {0}, "mabn": {0}, "pn": {0}, "pn_ls": {0}, "prepbn": {3}}
    assert counters == restarted_norms.get(norm, set())

    backbone = MODELS.build({**TINY_SWIN, "embed_dims": 16, "window_size": 2,
                             "norm_cfg": norm_cfg(norm, **options)})
    missing, unexpected = backbone.load_state_dict(
        {key.removeprefix("backbone."): value for key, value in converted.items()}, strict=False)
    assert not unexpected and all(key.startswith(tuple(f"norm{i}." for i in range(4)))
                                  or key.endswith("relative_position_index") for key in missing)
    backbone.eval()
    for index in range(4):  # compare the stages themselves, before the detection output norms
        setattr(backbone, f"norm{index}", torch.nn.Identity())
    # Compared in float64 (the float32 weights exactly): the two Swins order their arithmetic
    # differently, and some norms make the features ill-conditioned. EvoNorm-S0's two-channel
    # groups at this width divide by sqrt(var + 1e-5) of near-equal channels, layer after
    # layer: in float32 either model is up to 5e-3 of the maximum from its float64 value
    # (1e5 times float32's unit roundoff 6e-8), so other CPUs' kernels set the two 2e-4 apart.
    # That gain on float64's 1.1e-16 is 1e-11: 1e-9 of the maximum leaves a margin of 100 and
    # sees a wrong weight float32 hid (DyT's q and k swapped in one block: 7e-7).
    classifier, backbone = classifier.double(), backbone.double()
    images = torch.randn(2, 3, 128, 128, dtype=torch.float64)
    with torch.no_grad():
        wanted = classifier.forward_intermediates(images, intermediates_only=True)
        got = backbone(images)
    for stage, (a, b) in enumerate(zip(wanted, got)):
        assert (a - b).abs().max() <= 1e-9 * a.abs().max(), stage


def test_the_converter_refuses_a_checkpoint_that_runs_code(tmp_path, monkeypatch):
    marker = malicious_checkpoint(tmp_path / "last.pt", model={})
    monkeypatch.setattr(sys, "argv", ["convert", str(tmp_path / "last.pt"),
                                      str(tmp_path / "out.pth")])
    with pytest.raises(UnsafeCheckpoint, match="--trust-checkpoint") as refused:
        convert_cli.main()
    assert str(tmp_path / "last.pt") in str(refused.value)
    assert not marker.exists() and not (tmp_path / "out.pth").exists()


def test_paper_configs_build_detectors_with_our_norms():
    for name in ("mask_rcnn_swin_t_fpn_3x_coco", "mask_rcnn_swin_t_fpn_1x_coco",
                 "faster_rcnn_swin_t_fpn_3x_coco"):
        paper = Config.fromfile(str(CONFIGS / f"{name}.py"))
        assert paper.custom_imports.imports == ["plugins.mmdet"]
        assert paper.optim_wrapper.optimizer.lr == 1e-4 and paper.train_dataloader.batch_size == 2
        assert paper.param_scheduler[1].milestones == ([8, 11] if "1x" in name else [27, 33])
        paper.model.backbone.norm_cfg = norm_cfg("un")
        detector = MODELS.build(paper.model)
        assert (detector.roi_head.with_mask) == name.startswith("mask")
        assert sum(isinstance(m, unnorm.UnifiedNorm) for m in detector.modules()) == 2 * 12 + 3 + 4 + 1


def test_metric_names_follow_ours():
    assert our_metrics({"coco/bbox_mAP": 0.456, "coco/segm_mAP_50": 0.651, "coco/bbox_mAP_l": -1.0,
                        "data_time": 0.1}) == pytest.approx({"bbox_AP": 45.6, "segm_AP50": 65.1})


def _settings_config(tmp_path, *overrides, exp="mask_rcnn_swin_t_un"):
    from plugins.torchvision.shapes import ensure_shapes

    cfg = effective_config(config(*detection(tmp_path, exp, *overrides)))
    ensure_shapes(Path(cfg.data.root), **cfg.data.generate)
    return cfg


def test_the_optimizer_is_the_one_torchvision_builds_with_its_options(tmp_path):
    from plugins.optim import create_optimizer

    for opt in ("sgd", "adamw", "adamp", "sgdp"):
        cfg = _settings_config(tmp_path, f"optimizer={opt}")
        mm = mmdet_config(cfg, tmp_path / "run", Distributed("cpu"))
        backbone = MODELS.build({**TINY_SWIN, "norm_cfg": norm_cfg("un")})
        optimizer = build_optim_wrapper(backbone, mm.optim_wrapper).optimizer
        reference = create_optimizer(backbone.parameters(), cfg.optimizer, lr=1.0, weight_decay=0.05)
        assert type(optimizer) is type(reference)
        for key, value in cfg.optimizer.items():  # every option of the yaml, as it states it
            assert key == "name" or optimizer.defaults[key] == (tuple(value) if key == "betas" else value)
        scheduled = ("lr", "weight_decay")
        assert ({k: v for k, v in optimizer.defaults.items() if k not in scheduled}
                == {k: v for k, v in reference.defaults.items() if k not in scheduled})
        recipe = cfg.recipe
        assert optimizer.defaults["lr"] == recipe.lr * recipe.batch_size / recipe.lr_batch


@pytest.mark.parametrize("agc", [0.01, None])
def test_adaptive_clipping_clips_the_gradients_the_optimizer_steps(agc, tmp_path):
    """recipe.agc=0.01 (the detection recipes clip nothing else): a step of the optim wrapper
    the runner builds clips every gradient as timm's adaptive_clip_grad does at that factor;
    without it (the control) no gradient changes."""
    cfg = _settings_config(tmp_path, f"recipe.agc={agc or 'null'}")
    runner = UnnormRunner.from_cfg(mmdet_config(cfg, tmp_path / "run", Distributed("cpu")))
    wrapper = runner.build_optim_wrapper(runner.optim_wrapper)
    params = [p for p in runner.model.parameters() if p.requires_grad]
    generator = torch.Generator().manual_seed(0)
    expected = []
    for param in params:
        param.grad = torch.randn(param.shape, generator=generator)
        expected.append(torch.nn.Parameter(param.detach().clone()))
        expected[-1].grad = param.grad.clone()
    if agc:
        drawn = [reference.grad.clone() for reference in expected]
        adaptive_clip_grad(expected, agc)
        assert sum(not torch.equal(e.grad, d) for e, d in zip(expected, drawn)) > len(params) / 2
    wrapper.step()
    assert all(torch.equal(param.grad, reference.grad) for param, reference in zip(params, expected))


def test_amp_is_autocast_on_cuda_only_with_a_scaler_the_norms_do_not_see(monkeypatch):
    """As plugins.precision.amp_context: float32 on the CPU under amp=auto (the default) and
    autocast there refused (mmengine's is GPU-only), bf16 on a GPU that has it, else fp16
    with a dynamic loss scale, whose scaler becomes ``unnorm.GradScaler`` (with the state it
    had) once the model is built."""
    assert amp_optim_wrapper("auto", torch.device("cpu")) == {"type": "OptimWrapper"}
    assert amp_optim_wrapper(False, torch.device("cuda")) == {"type": "OptimWrapper"}
    for amp in ("bf16", "fp16"):
        with pytest.raises(ValueError, match=f"amp={amp}: mmengine's AmpOptimWrapper .* amp=auto"):
            amp_optim_wrapper(amp, torch.device("cpu"))
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: True)
    assert amp_optim_wrapper("auto", torch.device("cuda"))["dtype"] == "bfloat16"
    assert amp_optim_wrapper("fp16", torch.device("cuda"))["dtype"] == "float16"
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: False)
    assert amp_optim_wrapper("auto", torch.device("cuda")) == {
        "type": "AmpOptimWrapper", "dtype": "float16", "loss_scale": "dynamic"}

    model = torch.nn.Sequential(torch.nn.Linear(4, 4), unnorm.build_norm("un", 4))
    wrapper = type("Wrapper", (), {})()
    wrapper.loss_scaler = torch.amp.GradScaler("cpu", init_scale=256.0, growth_interval=3)
    guard_loss_scaler(wrapper, model)
    assert isinstance(wrapper.loss_scaler, unnorm.GradScaler)
    guarded = wrapper.loss_scaler
    assert guarded.get_scale() == 256.0 and guarded.get_growth_interval() == 3
    assert guarded.guard.norms == [model[1]]


def test_logged_values_are_saved_as_plain_lists_and_come_back(tmp_path):
    """mmengine's HistoryBuffer pickles through getattr, which weights_only loading refuses:
    a checkpoint holds its values as lists, rebuilt into HistoryBuffers on resume."""
    history = HistoryBuffer([0.5, 0.25], [1, 2], max_length=7)
    checkpoint = {"message_hub": {"log_scalars": {"train/loss": history}}}
    plain_logged_values(checkpoint)
    torch.save(checkpoint, tmp_path / "epoch_1.pth")
    loaded = load_checkpoint(tmp_path / "epoch_1.pth")
    rebuild_logged_values(loaded)
    rebuilt = loaded["message_hub"]["log_scalars"]["train/loss"]
    assert isinstance(rebuilt, HistoryBuffer) and rebuilt.max_length == 7
    assert all((a == b).all() for a, b in zip(rebuilt.data, history.data))


def test_device_cpu_keeps_the_model_off_a_visible_gpu(tmp_path, monkeypatch):
    """mmengine puts the model on any visible GPU; ``device=cpu`` keeps it on the CPU (PN_LS:
    its configs' group_num: null reaches the backbone, which resolves it)."""
    cfg = _settings_config(tmp_path, "device=cpu", exp="mask_rcnn_swin_t_pn_ls")
    assert cfg.norm.group_num is None
    mm = mmdet_config(cfg, tmp_path / "run", Distributed("cpu"))
    monkeypatch.setattr("mmengine.runner.runner.get_device", lambda: "cuda")  # as with a GPU
    runner = UnnormRunner.from_cfg(mm)
    assert {p.device.type for p in runner.model.parameters()} == {"cpu"}


@pytest.mark.parametrize("option", ["record_statistics", "record_gns", "compile"])
def test_taps_and_compile_are_refused_before_anything_runs(option, tmp_path):
    """mmengine trains the model: the loop's taps and compiling are torchvision's."""
    with pytest.raises(ValueError, match="drop it for the mmdet backend"):
        train(config(*detection(tmp_path, "mask_rcnn_swin_t_un", f"{option}=true")), tmp_path / "run")
    assert not (tmp_path / "run").exists()


def test_a_run_records_scale_invariance_and_each_epochs_updates(tmp_path, monkeypatch):
    """record_scale_invariance and record_updates (on by default) on Mask R-CNN with LN and
    AdamP, Weight Standardization on one block's qkv and on the box head's first shared layer.
    result.json names those two row-invariant, mmdet's relative position tables "zero" (its
    Swin leaves them at zeros from scratch) and every other matrix "none". Two epochs of one
    update, validated after the second: metrics.jsonl has a row per epoch (the first the
    updates' record alone, the second with the AP), whose effective steps are each
    parameter's ||w_after - w_before|| / ||w_before|| from the weights at the start and in
    each epoch's checkpoint (mmengine's param-wise rules make a param group of each trainable
    parameter, in the model's order; none for a weight that was zeros), and AdamP projected."""
    standardized = ["backbone.stages.0.blocks.0.attn.w_msa.qkv", "roi_head.bbox_head.shared_fcs.0"]
    begun = {}
    before_train = UnnormRunHook.before_train

    def keep_start(hook, runner):
        before_train(hook, runner)
        begun.update({k: v.detach().clone() for k, v in runner.model.named_parameters()})

    monkeypatch.setattr(UnnormRunHook, "before_train", keep_start)
    run = tmp_path / "run"
    result = train(config(*detection(tmp_path, "mask_rcnn_swin_t_ln", "optimizer=adamp",
                                     f"model.weight_standardization=[{','.join(standardized)}]",
                                     "scale.max_steps_per_epoch=1", epochs=2)), run)
    assert result["status"] in FINISHED and result["steps"] == 2
    record = result["scale_invariant"]
    tables = sorted(name for name in begun if name.endswith("relative_position_bias_table"))
    assert tables and all(not begun[name].any() for name in tables)
    assert record["row"] == sorted(f"{name}.weight" for name in standardized)
    assert record["zero"] == tables
    assert record["counts"] == {"row": 2, "tensor": 0, "inert": 0, "zero": len(tables),
                                "none": sum(p.ndim >= 2 for p in begun.values()) - 2 - len(tables)}
    assert json.loads((run / SCALE_INVARIANCE_FILE).read_text()) == record
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [(row["epoch"], "bbox_AP" in row) for row in rows] == [(1, False), (2, True)]
    weights = [begun] + [load_checkpoint(run / f"epoch_{epoch}.pth")["state_dict"]
                         for epoch in (1, 2)]
    for row, before, after in zip(rows, weights, weights[1:]):
        steps = [(after[name].double() - before[name].double()).norm()
                 / before[name].double().norm() for name in begun]
        assert [group["parameters"] for group in row["param_groups"]] == \
            [value.numel() for value in begun.values()]
        # the record's norms are float32 sums (torch._foreach_norm) of up to 2.6e5 squares:
        # 5e-5 of them seen here
        assert row["effective_step"] == [None if not math.isfinite(step) else pytest.approx(
            float(step), rel=2e-4) for step in steps]
        assert row["projection"]["tensors"] >= 2 and row["projection"]["channels"] > 0


def test_max_steps_per_epoch_caps_every_epoch_at_fresh_batches(tmp_path):
    """16 images in batches of 8, at most one batch per epoch: the run's length counts one
    step per epoch, and each epoch's batch is the first of that epoch's shuffled order."""
    cfg = _settings_config(tmp_path, "scale.max_steps_per_epoch=1")
    assert steps_per_epoch(cfg, replicas=1) == 1
    runner = UnnormRunner.from_cfg(mmdet_config(cfg, tmp_path / "run", Distributed("cpu")))
    loader = runner.train_dataloader
    assert len(loader) == 1
    batches, shuffled = loader.batch_sampler, loader.batch_sampler.sampler
    for epoch in range(2):
        shuffled.set_epoch(epoch)
        assert list(batches) == [list(shuffled)[:8]]


@pytest.mark.slow
def test_hydra_backend_trains_resumes_and_refuses_unsafe_checkpoints(tmp_path):
    """One process, from an ImageNet run of ours (``init_from``: PRepBN keeps its count of 3
    steps): the run's length in norm steps (10 images in batches of 8: two per epoch, the
    second short) sets PRepBN's hand-over; metrics reach the logger (wandb, offline);
    mmengine's resume loads our checkpoints without running their pickle and refuses one
    that would run code."""
    classifier, run = _trained_classifier("prepbn", {"decay_iters": 4}, steps=3, embed_dim=32,
                                          window_size=4)  # the detector's backbone at scale=cpu
    torch.save({"model": classifier.state_dict(), "config": run}, tmp_path / "imagenet.pt")
    overrides = detection(tmp_path, "mask_rcnn_swin_t_prepbn",
                          f"init_from={tmp_path / 'imagenet.pt'}", num_train=10, epochs=2,
                          logger="wandb")
    whole = tmp_path / "whole"
    result = train(config(*overrides), whole)
    assert result["status"] in FINISHED and result["backend"] == "mmdet" and result["steps"] == 4
    trained = load_checkpoint(whole / "epoch_2.pth")["state_dict"]
    counts = {key: int(value) for key, value in trained.items()
              if key.endswith("num_iters")}  # the detection output norms (norm0-3) start anew
    assert counts and all(count == (4 if key.startswith("backbone.norm") else 3 + 4)
                          for key, count in counts.items())
    stored = OmegaConf.load(whole / "config.yaml")
    assert stored.norm.decay_iters == round(0.8 * 4) - stored.norm.warmup_iters
    assert {"bbox_AP", "segm_AP"} <= set(result["metrics"])
    assert json.loads((whole / "result.json").read_text())["metrics"] == result["metrics"]
    [logged] = (whole / "wandb").glob("offline-run-*/run-*.wandb")
    assert b"bbox_AP" in logged.read_bytes()
    # as if killed after its first epoch: mmengine's pointer at epoch 1, nothing logged yet
    cut = tmp_path / "cut"
    shutil.copytree(whole, cut, ignore=shutil.ignore_patterns("wandb"))
    for record in ("result.json", "metrics.jsonl"):
        (cut / record).unlink()
    (cut / "last_checkpoint").write_text(str(cut / "epoch_1.pth"))
    with pytest.raises(ValueError, match="recipe.epochs"):
        train(config(*[o.replace("epochs=2", "epochs=3") for o in overrides]), cut)
    evil = tmp_path / "evil"
    shutil.copytree(cut, evil)
    marker = malicious_checkpoint(evil / "epoch_1.pth", meta={}, state_dict={})
    (evil / "last_checkpoint").write_text(str(evil / "epoch_1.pth"))
    with pytest.raises(UnsafeCheckpoint, match="trust_checkpoint=true") as refused:
        train(config(*overrides), evil)
    assert str(evil / "epoch_1.pth") in str(refused.value) and not marker.exists()
    resumed = train(config(*overrides), cut)
    assert resumed["status"] in FINISHED and resumed["steps"] == 4
    logged = [json.loads(line) for line in (cut / "metrics.jsonl").read_text().splitlines()]
    assert [entry["epoch"] for entry in logged] == [2]


def test_init_from_refuses_a_checkpoint_that_runs_code(tmp_path):
    marker = malicious_checkpoint(tmp_path / "last.pt", model={}, config={})
    with pytest.raises(UnsafeCheckpoint, match="trust_checkpoint=true"):
        train(config(*detection(tmp_path, "mask_rcnn_swin_t_un",
                                f"init_from={tmp_path / 'last.pt'}")), tmp_path / "run")
    assert not marker.exists()


def _replica(rank: int, port: int, overrides: list[str], out_dir: str) -> None:
    """One of two gloo replicas running the Hydra backend; it records its norms' state after
    the evaluation, and the evaluation writes the replicas' predictions (COCO json)."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      LOCAL_RANK=str(rank), WORLD_SIZE="2")
    torch.set_num_threads(1)
    evaluated, configured = UnnormRunHook.after_val_epoch, runner_module.mmdet_config

    def after_val_epoch(hook, runner, metrics=None):
        evaluated(hook, runner, metrics)
        model = runner.model.module
        state = {f"{name}.{key}": buffer.clone() for name, module in model.named_modules()
                 if isinstance(module, unnorm.GuardedNorm)
                 for key, buffer in module.named_buffers(recurse=False)}
        torch.save(state, f"{out_dir}/norms_rank{rank}.pt")

    def with_predictions(*args, **kwargs):
        mm = configured(*args, **kwargs)
        mm.val_evaluator.outfile_prefix = f"{out_dir}/replicas"
        return mm

    UnnormRunHook.after_val_epoch = after_val_epoch
    runner_module.mmdet_config = with_predictions
    train(config(*overrides), Path(out_dir) / "run")


def _predictions(prefix: Path) -> list:
    return [json.loads(prefix.with_name(f"{prefix.name}.{kind}.json").read_text())
            for kind in ("bbox", "segm")]


@pytest.mark.slow
def test_two_replicas_are_one_run_whose_checkpoint_gives_the_recorded_ap(tmp_path):
    """torchrun's two processes train one run (16 images in global batches of 8: two steps),
    the replicas' norm states agree after the evaluation, and the saved checkpoint,
    evaluated alone, predicts what the replicas predicted and scores the AP they recorded."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    overrides = detection(tmp_path, "mask_rcnn_swin_t_bn")
    mp.start_processes(_replica, args=(port, overrides, str(tmp_path)), nprocs=2,
                       start_method="spawn")
    run = tmp_path / "run"
    result = json.loads((run / "result.json").read_text())
    assert result["status"] in FINISHED and result["world_size"] == 2 and result["steps"] == 2
    ranks = [torch.load(tmp_path / f"norms_rank{rank}.pt") for rank in range(2)]
    assert ranks[0] and ranks[0].keys() == ranks[1].keys()
    assert all(torch.equal(ranks[0][key], ranks[1][key]) for key in ranks[0])
    mm = Config.fromfile(str(run / "mmdet_config.py"))
    mm.update(launcher="none", load_from=str(run / "epoch_1.pth"), resume=False,
              work_dir=str(tmp_path / "alone"))
    mm.test_evaluator.outfile_prefix = str(tmp_path / "alone")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as the replicas: the same sums in the same order
    try:
        alone = our_metrics(UnnormRunner.from_cfg(mm).test())
    finally:
        torch.set_num_threads(threads)
    assert _predictions(tmp_path / "alone") == _predictions(tmp_path / "replicas")
    assert alone == {k: v for k, v in result["metrics"].items() if k not in ("epoch", "step")}
