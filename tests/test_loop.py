"""The training loop the trainers share (plugins/loop.py): gradient accumulation against one
large batch, and the norms counting micro-batches."""
from __future__ import annotations

import pytest
import torch
from omegaconf import OmegaConf
from timm.scheduler import create_scheduler_v2

import unnorm
from plugins.distributed import Distributed
from plugins.loop import EpochLoop
from plugins.runlog import RunDirectory

C, SAMPLES = 6, 48


def _cfg(record_gns: bool = False, record_landscape: int = 0, sam: dict | None = None):
    return OmegaConf.create({
        "exp_name": "loop", "seed": 0, "norm_sync": "reduce", "record_statistics": False,
        "record_gns": record_gns, "record_landscape": record_landscape, "sam": sam,
        "trust_checkpoint": False, "logger": {"name": "none"}, "scale": {"num_workers": 0},
        "collapse": {"loss_multiple": 5.0, "ema": 0.9, "min_steps": 50, "check_every": 4}})


def _train(tmp_path, norm: str, batch: int, accumulate: int, updates: int,
           record_gns: bool = False, record_landscape: int = 0, dropout: float = 0.0,
           scaler: bool = False, sam: dict | None = None):
    """``updates`` SGD updates of a linear-norm-linear regression, each over
    ``batch * accumulate`` samples; returns the model and the run's result. ``dropout``
    adds a dropout after the norm (the run's RNG draws), ``scaler`` unnorm's GradScaler
    (float32: its scale and the norms' guard without autocast), ``sam`` a ``configs/sam``
    entry."""
    torch.manual_seed(0)
    data = torch.utils.data.TensorDataset(torch.randn(SAMPLES, 5, C), torch.randn(SAMPLES, 5, 1))
    options = {"warmup_iters": 2, "window_size": 2} if norm == "un" else {}
    model = torch.nn.Sequential(torch.nn.Linear(C, C), unnorm.build_norm(norm, C, **options),
                                *([torch.nn.Dropout(dropout)] if dropout else []),
                                torch.nn.Linear(C, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)  # not scale-free
    scheduler, _ = create_scheduler_v2(optimizer, sched="cosine", num_epochs=1, warmup_epochs=0,
                                       step_on_epochs=False, updates_per_epoch=updates)
    cfg, world = _cfg(record_gns, record_landscape, sam), Distributed("cpu")
    run = RunDirectory(tmp_path)
    loop = EpochLoop(cfg, tmp_path, world, run, model, optimizer, scheduler,
                     unnorm.GradScaler(model, "cpu", init_scale=2.0 ** 10) if scaler else None)

    def forward(batch):
        x, y = batch
        return torch.nn.functional.mse_loss(model(x), y)

    result = loop.fit(model, data, batch, None, updates, 1, forward=forward, evaluate=lambda e: {},
                      meta={}, init="scratch", accumulate=accumulate)
    return model, result


def test_accumulated_micro_batches_make_one_update_of_the_whole_batch(tmp_path):
    """LN (per-position statistics): 2 micro-batches of 8 per update train exactly as one
    batch of 16, with the same samples in the same order; the recorded loss is the update's."""
    whole, whole_result = _train(tmp_path / "whole", "ln", batch=16, accumulate=1, updates=3)
    split, split_result = _train(tmp_path / "split", "ln", batch=8, accumulate=2, updates=3)
    for (name, a), b in zip(whole.state_dict().items(), split.state_dict().values()):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-6, msg=name)
    assert split_result["steps"] == whole_result["steps"] == 3
    assert abs(split_result["metrics"]["train_loss"] - whole_result["metrics"]["train_loss"]) < 1e-6


def test_norms_count_micro_batches_under_accumulation(tmp_path):
    """UN steps once per micro-batch (the unit of every norm's step counts), not per update."""
    model, result = _train(tmp_path, "un", batch=8, accumulate=3, updates=2)
    assert result["status"] == "ok" and result["steps"] == 2
    assert int(model[1].num_iters) == 6


def test_a_per_epoch_schedule_is_refused(tmp_path):
    """The loop steps the rate per update; a schedule stepped per epoch would stay flat
    through a one-epoch warm-up, so it is refused with the fix."""
    optimizer = torch.optim.SGD(torch.nn.Linear(2, 2).parameters(), lr=0.1)
    scheduler, _ = create_scheduler_v2(optimizer, sched="cosine", num_epochs=2, warmup_epochs=1)
    with pytest.raises(ValueError, match="step_on_epochs=False"):
        EpochLoop(_cfg(), tmp_path, Distributed("cpu"), RunDirectory(tmp_path),
                  torch.nn.Linear(2, 2), optimizer, scheduler, None)


@pytest.mark.parametrize("norm", ["ln", "rms", "bn", "bcn", "un", "prepbn", "dyt",
                                  "evonorm_s0", "evonorm_b0", "scalenorm"])
def test_recording_the_gns_changes_no_training(tmp_path, norm):
    """record_gns=true trains bit for bit as without (each norm keeps its fused kernel or
    hand-written backward; the tap only reads gradients), and writes one record per update
    for the norm."""
    plain, plain_result = _train(tmp_path / "plain", norm, batch=8, accumulate=1, updates=5)
    recorded, result = _train(tmp_path / "gns", norm, batch=8, accumulate=1, updates=5, record_gns=True)
    for (name, a), b in zip(plain.state_dict().items(), recorded.state_dict().values()):
        assert torch.equal(a, b), name
    assert result["metrics"]["train_loss"] == plain_result["metrics"]["train_loss"]
    assert not (tmp_path / "plain" / "gns").exists()
    saved = torch.load(tmp_path / "gns" / "gns" / "epoch_0001.pt", weights_only=True)
    assert list(saved["layers"]) == ["1"] and saved["layers"]["1"]["examples"].tolist() == [8.0] * 5
    assert recorded[1]._gns is None  # the loop closed its tap


def test_gns_records_each_micro_batch_in_its_mean_losss_units(tmp_path):
    """With two micro-batches per update each is one record, and the loss's division by the
    micro-batch count is undone: the first micro-batch's record equals the record of the
    same first batch trained without accumulation (same weights, same samples)."""
    _train(tmp_path / "single", "ln", batch=8, accumulate=1, updates=2, record_gns=True)
    _train(tmp_path / "split", "ln", batch=8, accumulate=2, updates=2, record_gns=True)
    single, split = (torch.load(tmp_path / run / "gns" / "epoch_0001.pt", weights_only=True)
                     for run in ("single", "split"))
    assert {k: split[k] for k in ("batch_size", "accumulate", "replicas")} == {
        "batch_size": 8, "accumulate": 2, "replicas": 1}
    records, first = split["layers"]["1"], single["layers"]["1"]
    assert len(records["batch_sq"]) == 4 and len(first["batch_sq"]) == 2
    for key in ("example_sq", "batch_sq", "examples"):
        torch.testing.assert_close(records[key][0], first[key][0], rtol=1e-6, atol=0)
