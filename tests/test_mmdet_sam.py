"""Training through the norms in the mmdetection backend (plugins/mmdet/runner.py): SAM's
train step against the shared loop's update, a loss scaler's skip through mmengine's
AmpOptimWrapper, norm-only freezing before the optimizer is built, SAM with gradient
accumulation refused, and short Mask R-CNN runs with SAM-ON and with only the norms trained.

mmdet is imported plainly: ``make test`` installs it, and a broken install fails here."""
from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
import torch
from mmengine.config import Config
from mmengine.model import BaseModel
from mmengine.optim import AmpOptimWrapper, OptimWrapper
from mmdet.registry import MODELS
from torch import nn

import unnorm
from plugins.checkpoints import load_checkpoint
from plugins.distributed import Distributed
from plugins.mmdet.runner import (SharpnessAwareStep, UnnormRunHook, UnnormRunner,
                                  guard_loss_scaler, mmdet_config, train)
from plugins.runlog import FINISHED
from plugins.sam import SharpnessAware, norm_parameters
from test_mmdet import _settings_config, detection
from test_norms import STATEFUL, make_sequence
from test_sam import sam_update
from test_vision import config

C = 8
SHAPE = (4, 5, C)


class Tiny(BaseModel):
    """An mmengine model: a norm between two linear layers; its loss is ``test_sam``'s."""

    def __init__(self, norm: str = "un"):
        super().__init__()
        self.inp = nn.Linear(C, C)
        self.norm = unnorm.build_norm(norm, C, **STATEFUL.get(norm, {}))
        self.head = nn.Linear(C, 3)

    def forward(self, inputs, data_samples=None, mode="tensor"):
        out = self.head(self.norm(self.inp(inputs)))
        return {"loss_square": out.square().mean()} if mode == "loss" else out


def test_the_sam_train_step_is_the_shared_loops_update():
    """mmengine's train step with SAM-ON, eight updates (UN through its warm-up and its
    compensation) against the update the shared loop makes (``test_sam.sam_update``): the
    same weights and norm state, the logged loss the first pass's, and UN's step counter
    one per update."""
    torch.manual_seed(0)
    ours = Tiny("un")
    theirs = copy.deepcopy(ours)
    wrapper = OptimWrapper(torch.optim.SGD(ours.parameters(), lr=0.1))
    step = SharpnessAwareStep(ours, SharpnessAware(ours, rho=0.5, only_norm=True))
    sam = SharpnessAware(theirs, rho=0.5, only_norm=True)
    optimizer = torch.optim.SGD(theirs.parameters(), lr=0.1)
    for x in make_sequence(8, shape=SHAPE)[0]:
        with torch.no_grad():
            first_pass = copy.deepcopy(theirs)(x).square().mean()  # at w, from the start state
        logged = step({"inputs": x}, wrapper)
        sam_update(theirs, optimizer, sam, x)
        assert set(logged) == {"loss", "loss_square"}
        torch.testing.assert_close(logged["loss"], first_pass, rtol=1e-6, atol=1e-7)
    for key, value in theirs.state_dict().items():
        torch.testing.assert_close(ours.state_dict()[key], value, rtol=1e-6, atol=1e-7, msg=key)
    assert int(ours.norm.num_iters) == 8
    assert all(p.grad is None for p in ours.parameters())  # zero_grad after the step


# mmengine's AmpOptimWrapper builds torch.cuda.amp's GradScaler, which warns off a GPU; the
# test puts a CPU scaler in its place
@pytest.mark.filterwarnings("ignore:`torch.cuda.amp.GradScaler\\(args...\\)` is deprecated",
                            "ignore:torch.cuda.amp.GradScaler is enabled, but CUDA is not available")
@pytest.mark.parametrize("norm", ["un", "bn"])
def test_a_scaler_that_skips_a_sam_step_leaves_every_norm_as_it_was(norm, monkeypatch):
    """Through mmengine's AmpOptimWrapper (autocast, its loss scaler guarded as the runner
    does): an update whose gradients overflow in both passes is skipped and every buffer and
    weight is as before it; the next update trains."""
    monkeypatch.setattr("mmengine.optim.optimizer.amp_optimizer_wrapper.is_cuda_available",
                        lambda: True)  # the wrapper asks for a GPU; autocast runs on the CPU
    torch.manual_seed(0)
    model = Tiny(norm)
    wrapper = AmpOptimWrapper(optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
                              dtype="bfloat16")
    wrapper.loss_scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 8)
    guard_loss_scaler(wrapper, model)
    step = SharpnessAwareStep(model, SharpnessAware(model, rho=0.5, only_norm=True))
    xs = make_sequence(3, shape=SHAPE, spikes={})[0]
    step({"inputs": xs[0]}, wrapper)
    before = copy.deepcopy(model.state_dict())
    hook = model.head.weight.register_hook(lambda g: g * float("inf"))
    step({"inputs": xs[1]}, wrapper)
    for key, value in before.items():
        assert torch.equal(model.state_dict()[key], value), key
    assert int(wrapper.loss_scaler.guard.skipped_updates) == 1
    hook.remove()
    step({"inputs": xs[2]}, wrapper)
    assert not torch.equal(model.norm.weight, before["norm.weight"])
    if norm == "un":
        assert int(model.norm.num_iters) == 2


def test_norm_only_freezes_before_the_optimizer_and_keeps_its_param_wise_rules(tmp_path):
    """train_only=norm: only the norms' affine parameters require gradients, and the
    optimizer mmengine builds holds exactly those, with the config's no-decay rule for
    norms; norm+head adds the ROI heads (the torchvision backend's roi_heads)."""
    for train_only, with_head in (("norm", False), ("norm+head", True)):
        cfg = _settings_config(tmp_path, f"train_only={train_only}")
        runner = UnnormRunner.from_cfg(mmdet_config(cfg, tmp_path / "run", Distributed("cpu")))
        model = runner.model
        wanted = {id(p) for p in norm_parameters(model).values()}
        if with_head:
            wanted |= {id(p) for p in model.roi_head.parameters()}
        assert {id(p) for p in model.parameters() if p.requires_grad} == wanted
        optimizer = runner.build_optim_wrapper(runner.optim_wrapper).optimizer
        groups = {id(p): group for group in optimizer.param_groups for p in group["params"]}
        assert groups.keys() == wanted
        assert all(groups[id(p)]["weight_decay"] == 0 for p in norm_parameters(model).values())
        if with_head:
            assert groups[id(model.roi_head.bbox_head.fc_cls.weight)]["weight_decay"] > 0


def test_sam_with_gradient_accumulation_is_refused_by_name(tmp_path):
    cfg = _settings_config(tmp_path, "sam=sam_on")
    mm = mmdet_config(cfg, tmp_path / "run", Distributed("cpu"))
    mm.optim_wrapper.accumulative_counts = 2
    runner = UnnormRunner.from_cfg(mm)
    with pytest.raises(ValueError, match="sam with gradient accumulation .*accumulative_counts=2"
                                         ".* Set accumulative_counts=1 .* or sam=none"):
        runner.train()
    assert runner.train_loop.iter == 0


def _trained(tmp_path: Path, monkeypatch, *overrides: str) -> tuple[dict, dict, dict, Path]:
    """A Mask R-CNN run of 16 generated images in batches of 8 (two updates): its result,
    and its model's state when training began and when it ended."""
    begun = {}
    before_train = UnnormRunHook.before_train

    def keep_start(hook, runner):
        before_train(hook, runner)
        begun.update({k: v.detach().clone() for k, v in runner.model.state_dict().items()})

    monkeypatch.setattr(UnnormRunHook, "before_train", keep_start)
    run = tmp_path / "run"
    result = train(config(*detection(tmp_path, "mask_rcnn_swin_t_un", *overrides)), run)
    assert result["status"] in FINISHED and result["steps"] == 2, result
    ended = load_checkpoint(run / "epoch_1.pth")["state_dict"]
    return result, begun, ended, run


def _detector(run: Path) -> nn.Module:
    """The run's detector built afresh from its mmdet config (an independent count)."""
    return MODELS.build(Config.fromfile(str(run / "mmdet_config.py")).model)


@pytest.mark.slow
def test_sam_on_trains_mask_rcnn_and_records_what_it_trained(tmp_path, monkeypatch):
    """sam=sam_on train_only=norm+head: the run records the norms' parameter count as SAM's
    perturbed set and norms + ROI heads as its trainable count; every UN step counter is 2
    after two SAM updates (each update's second pass leaves the norms as the first left
    them); the backbone's other weights are where they started, the heads' moved."""
    result, begun, ended, run = _trained(tmp_path, monkeypatch, "sam=sam_on",
                                         "train_only=norm+head")
    detector = _detector(run)
    norms = norm_parameters(detector)
    head = dict(detector.roi_head.named_parameters(prefix="roi_head"))
    assert result["sam_perturbed_parameters"] == sum(p.numel() for p in norms.values())
    assert result["trainable_parameters"] == sum(p.numel() for p in {**norms, **head}.values())
    counters = {k: int(v) for k, v in ended.items() if k.endswith("num_iters")}
    assert counters and set(counters.values()) == {2}
    frozen = [k for k, _ in detector.named_parameters() if k not in norms and k not in head]
    assert frozen and all(torch.equal(begun[k], ended[k]) for k in frozen)
    assert not torch.equal(begun["roi_head.bbox_head.fc_cls.weight"],
                           ended["roi_head.bbox_head.fc_cls.weight"])
    assert any(not torch.equal(begun[k], ended[k]) for k in norms)


@pytest.mark.slow
def test_norm_only_training_leaves_every_other_weight_at_its_start(tmp_path, monkeypatch):
    """train_only=norm: every parameter that is not a norm's (backbone, FPN, RPN, ROI heads)
    ends where it began, the norms' weights moved, and the run records their count."""
    result, begun, ended, run = _trained(tmp_path, monkeypatch, "train_only=norm")
    detector = _detector(run)
    norms = norm_parameters(detector)
    assert result["trainable_parameters"] == sum(p.numel() for p in norms.values())
    assert "sam_perturbed_parameters" not in result
    others = [k for k, _ in detector.named_parameters() if k not in norms]
    assert len(others) > 50 and all(torch.equal(begun[k], ended[k]) for k in others)
    weights = [k for k in norms if k.endswith("weight")]
    assert all(not torch.equal(begun[k], ended[k]) for k in weights)


@pytest.mark.slow
def test_sam_on_two_replicas_is_one_run(tmp_path):
    """torchrun's two processes (gloo) with SAM-ON through MMDistributedDataParallel: both
    passes run through DDP, the run records its counts once, and after two updates the
    replicas' norm states agree (synced after the epoch) with every UN counter at 2."""
    import socket

    import torch.multiprocessing as mp

    from test_mmdet import _replica
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    overrides = detection(tmp_path, "mask_rcnn_swin_t_un", "sam=sam_on")
    mp.start_processes(_replica, args=(port, overrides, str(tmp_path)), nprocs=2,
                       start_method="spawn")
    result = json.loads((tmp_path / "run" / "result.json").read_text())
    assert result["status"] in FINISHED and result["world_size"] == 2 and result["steps"] == 2
    norms = sum(p.numel() for p in norm_parameters(_detector(tmp_path / "run")).values())
    assert result["sam_perturbed_parameters"] == norms
    ranks = [torch.load(tmp_path / f"norms_rank{rank}.pt") for rank in range(2)]
    assert ranks[0].keys() == ranks[1].keys()
    assert all(torch.equal(ranks[0][key], ranks[1][key]) for key in ranks[0])
    assert {int(v) for k, v in ranks[0].items() if k.endswith("num_iters")} == {2}
