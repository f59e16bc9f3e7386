"""record_landscape's probe (unnorm/landscape.py, plugins/landscape.py): its quantities
against the closed forms of a quadratic, and a probe that leaves every state of a run as
it found it (weights, gradients, every buffer, optimizer state, RNG streams), for every
norm with running state, alone and inside the shared loop, bit for bit."""
from __future__ import annotations

import copy
import json
import random

import numpy as np
import pytest
import torch
from test_loop import _train
from test_norms import STATEFUL

import unnorm
from plugins.landscape import HOST_STREAMS, landscape_interval
from plugins.runlog import LANDSCAPE_FILE, RunDirectory
from unnorm.landscape import POINTS, UpdateProbe, step_grid

C = 6


class Quadratic(torch.nn.Module):
    """L(w) = 1/2 w^T A w, in float64."""

    def __init__(self, matrix: torch.Tensor, start: torch.Tensor):
        super().__init__()
        self.matrix = matrix
        self.w = torch.nn.Parameter(start.clone())

    def forward(self) -> torch.Tensor:
        return 0.5 * self.w @ self.matrix @ self.w


def _backward(model: torch.nn.Module) -> torch.Tensor:
    loss = model()
    loss.backward()
    return loss


def test_a_quadratic_has_its_closed_forms():
    """Along g = A w: grad L(W) - grad L(W - eta g) = eta A g, so the predictiveness is
    lr ||A g|| (at eta = lr), beta ||A g|| / ||g||, the loss along the step the parabola
    L - eta |g|^2 + eta^2/2 g^T A g, and the study's Lipschitz its largest distance from L."""
    gen = torch.Generator().manual_seed(0)
    basis = torch.linalg.qr(torch.randn(5, 5, generator=gen, dtype=torch.float64))[0]
    matrix = basis @ torch.diag(torch.tensor([0.1, 0.5, 1.0, 3.0, 9.0], dtype=torch.float64)) @ basis.T
    model = Quadratic(matrix, torch.randn(5, generator=gen, dtype=torch.float64))
    lr = 0.3
    probe = UpdateProbe(model, model.parameters())
    loss = _backward(model)
    gradient = model.w.grad.clone()
    record = probe.measure(lambda: _backward(model), loss, lr)

    w = model.w.detach()
    g = matrix @ w
    ag = matrix @ g
    etas = torch.tensor(step_grid(lr), dtype=torch.float64)
    along = loss.item() - etas * (g @ g) + 0.5 * etas ** 2 * (g @ ag)
    exact = {"eta": etas, "loss": 0.5 * w @ matrix @ w, "grad_norm": g.norm(), "losses": along,
             "grad_differences": etas * ag.norm(), "loss_min": along.min(),
             "loss_max": along.max(), "predictiveness": lr * ag.norm(),
             "beta": ag.norm() / g.norm(), "lipschitz": (loss.item() - along).abs().max(),
             "smoothness": lr * ag.norm()}
    assert set(record) == set(exact)
    for key, value in exact.items():  # float64 throughout: a few roundings of values ~ 10
        torch.testing.assert_close(torch.tensor(record[key], dtype=torch.float64), value,
                                   rtol=1e-12, atol=1e-12, msg=key)
    assert len(record["eta"]) == POINTS and record["eta"][-1] == lr
    assert torch.equal(model.w.grad, gradient)  # the update's gradient, back in place


def _snapshot(model, optimizer) -> dict:
    """Everything a probe must leave as it found it."""
    return {"state": {k: v.clone() for k, v in model.state_dict(keep_vars=False).items()},
            "buffers": {k: v.clone() for k, v in model.named_buffers()},
            "grads": {k: p.grad.clone() for k, p in model.named_parameters()},
            "optimizer": {i: {k: v.clone() for k, v in s.items()}
                          for i, s in enumerate(optimizer.state.values())},
            "torch": torch.get_rng_state(), "python": random.getstate(),
            "numpy": np.random.get_state()[1].copy()}


def _assert_same(before: dict, after: dict) -> None:
    for part in ("state", "buffers", "grads"):
        assert before[part].keys() == after[part].keys(), part
        for key, value in before[part].items():
            assert torch.equal(value, after[part][key]), f"{part} {key}"
    for index, state in before["optimizer"].items():
        for key, value in state.items():
            assert torch.equal(value, after["optimizer"][index][key]), f"optimizer {key}"
    assert torch.equal(before["torch"], after["torch"])
    assert before["python"] == after["python"]
    assert np.array_equal(before["numpy"], after["numpy"])


def _host_streams() -> tuple:
    return torch.get_rng_state(), random.getstate(), np.random.get_state()


def _set_host_streams(states: tuple) -> None:
    torch.set_rng_state(states[0])
    random.setstate(states[1])
    np.random.set_state(states[2])


@pytest.mark.parametrize("norm", sorted(STATEFUL))
def test_a_probe_leaves_every_state_as_it_found_it(norm):
    """A small model in training mode, a few updates in (step counters, windows and running
    statistics past their start, SGD's momentum filled), dropout and numpy drawing from the
    run's streams: after a probe of the next update, the state dict (every buffer, step
    counters included), the gradients, the optimizer's state and the RNG streams are as the
    update's backward left them. Each point's loss and gradient are those of a copy of the
    model made at the update's start, stepped to W - eta g and run on the update's batch
    from the update's RNG states: the norms' state and the dropout masks the update saw."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(C, C), unnorm.build_norm(norm, C, **STATEFUL[norm]),
                                torch.nn.Dropout(0.3), torch.nn.Linear(C, 1)).train()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    data = [torch.randn(4, 5, C) for _ in range(4)]

    def loss_of(net, x):  # a forward that draws from numpy too (as timm's mixup does)
        noise = torch.as_tensor(np.random.rand(), dtype=torch.float32)
        return net(x * (1 + 0.1 * noise)).square().mean()

    for x in data[:3]:
        optimizer.zero_grad()
        loss_of(model, x).backward()
        optimizer.step()
    optimizer.zero_grad()
    start, streams = copy.deepcopy(model), _host_streams()
    probe = UpdateProbe(model, model.parameters(), streams=HOST_STREAMS)
    loss = loss_of(model, data[3])
    loss.backward()
    before = _snapshot(model, optimizer)
    gradient = [p.grad.clone() for p in model.parameters()]
    record = probe.measure(lambda: _backward(lambda: loss_of(model, data[3])), loss, 0.05, points=3)
    _assert_same(before, _snapshot(model, optimizer))

    for eta, value, difference in zip(record["eta"], record["losses"], record["grad_differences"]):
        twin = copy.deepcopy(start)
        with torch.no_grad():
            for p, g in zip(twin.parameters(), gradient):
                p.sub_(eta * g)
        _set_host_streams(streams)
        twin_loss = loss_of(twin, data[3])
        twin_loss.backward()
        # float32: the same operations; a few roundings of values about 1 allowed
        assert value == pytest.approx(twin_loss.item(), rel=1e-6), eta
        moved = torch.linalg.vector_norm(torch.stack([
            torch.linalg.vector_norm(g - p.grad) for p, g in zip(twin.parameters(), gradient)]))
        assert difference == pytest.approx(moved.item(), rel=1e-4, abs=1e-6 * record["grad_norm"]), eta


def _rows(run) -> list[dict]:
    return [json.loads(line) for line in (run / LANDSCAPE_FILE).read_text().splitlines()]


@pytest.mark.parametrize("norm", sorted(STATEFUL))
def test_recording_the_landscape_changes_no_training(tmp_path, norm):
    """record_landscape=2 in the shared loop, with dropout: the losses and the final weights
    are bit for bit those of the run without it; rows at updates 0, 2 and 4 at the rate each
    update used."""
    plain, plain_result = _train(tmp_path / "plain", norm, batch=8, accumulate=1, updates=5,
                                 dropout=0.2)
    probed, result = _train(tmp_path / "probed", norm, batch=8, accumulate=1, updates=5,
                            dropout=0.2, record_landscape=2)
    for (name, a), b in zip(plain.state_dict().items(), probed.state_dict().values()):
        assert torch.equal(a, b), name
    assert result["metrics"]["train_loss"] == plain_result["metrics"]["train_loss"]
    assert not (tmp_path / "plain" / LANDSCAPE_FILE).exists()
    rows = _rows(tmp_path / "probed")
    lrs = json.loads((tmp_path / "probed" / "metrics.jsonl").read_text())["lr_per_update"]
    assert [row["step"] for row in rows] == [0, 2, 4]
    assert [row["lr"] for row in rows] == [lrs[0], lrs[2], lrs[4]]
    assert all(row["epoch"] == 1 and len(row["losses"]) == POINTS for row in rows)


def test_accumulation_and_a_loss_scaler_change_no_training(tmp_path):
    """Two micro-batches per update under unnorm's GradScaler (the norms' guard and its
    update-start copies) with UN: bit for bit as without the probe, and the probe's gradient
    is in the loss's units (the scale divided out): the same grad_norm as the unscaled run's."""
    runs = {}
    for name, options in {"plain": {}, "probed": {"record_landscape": 1},
                          "unscaled": {"record_landscape": 1, "scaler": False}}.items():
        runs[name] = _train(tmp_path / name, "un", batch=4, accumulate=2, updates=3, dropout=0.2,
                            **{"scaler": True, **options})
    for (key, a), b in zip(runs["plain"][0].state_dict().items(), runs["probed"][0].state_dict().values()):
        assert torch.equal(a, b), key
    assert runs["probed"][1]["metrics"]["train_loss"] == runs["plain"][1]["metrics"]["train_loss"]
    scaled, unscaled = _rows(tmp_path / "probed"), _rows(tmp_path / "unscaled")
    assert len(scaled) == 3
    # the scale is a power of two: scaling and unscaling are exact, as is the loss
    assert [row["grad_norm"] for row in scaled] == [row["grad_norm"] for row in unscaled]


def test_sam_changes_no_training(tmp_path):
    """With SAM (UN: its second pass returns the norms to the update's start) the probe,
    along the first pass's gradient, leaves training bit for bit as it was."""
    sam = {"name": "sam", "rho": 0.05, "adaptive": False, "only_norm": False}
    plain, _ = _train(tmp_path / "plain", "un", batch=8, accumulate=1, updates=3, dropout=0.2,
                      sam=sam)
    probed, _ = _train(tmp_path / "probed", "un", batch=8, accumulate=1, updates=3, dropout=0.2,
                       sam=sam, record_landscape=1)
    for (name, a), b in zip(plain.state_dict().items(), probed.state_dict().values()):
        assert torch.equal(a, b), name
    assert len(_rows(tmp_path / "probed")) == 3


def test_a_resume_keeps_the_probes_of_the_epochs_its_checkpoint_covers(tmp_path):
    """restore_epochs drops landscape.jsonl's rows of epochs after the checkpoint's."""
    run = RunDirectory(tmp_path)
    (tmp_path / LANDSCAPE_FILE).write_text(
        "".join(json.dumps({"step": s, "epoch": e}) + "\n" for s, e in ((0, 1), (5, 2), (10, 3))))
    run.restore_epochs(2, None)
    assert [row["step"] for row in _rows(tmp_path)] == [0, 5]


@pytest.mark.parametrize("value", [True, -1, 1.5, "often"])
def test_an_interval_that_is_no_count_of_updates_is_refused(value):
    with pytest.raises(ValueError, match="record_landscape=50"):
        landscape_interval(value)
    assert landscape_interval(False) == landscape_interval(0) == 0


def test_a_grid_needs_a_positive_rate():
    with pytest.raises(ValueError, match="positive and finite"):
        step_grid(0.0)
    assert step_grid(1.0, 4) == [0.25, 0.5, 0.75, 1.0]


@pytest.mark.slow
def test_mmdet_records_the_landscape_and_trains_as_without(tmp_path):
    """record_landscape=1 in the mmdet backend (Mask R-CNN, UN; two updates of two images):
    a row per update, and the final weights bit for bit those of the run without it. (Each
    probe is 2 + POINTS passes of the update's batch; whatever it leaves behind, weights,
    buffers or RNG, differs bit for bit at any batch size.)"""
    from plugins.checkpoints import load_checkpoint
    from plugins.mmdet.runner import train
    from test_mmdet import detection
    from test_vision import config

    weights = {}
    for name, more in (("plain", ()), ("probed", ("record_landscape=1",))):
        run = tmp_path / name
        result = train(config(*detection(tmp_path, "mask_rcnn_swin_t_un", "record_updates=false",
                                         "record_scale_invariance=false",
                                         "scale.max_steps_per_epoch=2",
                                         "recipe.batch_size=2", *more)), run)
        assert result["status"] in ("ok", "chance") and result["steps"] == 2
        weights[name] = load_checkpoint(run / "epoch_1.pth")["state_dict"]
    for key, value in weights["plain"].items():
        assert torch.equal(value, weights["probed"][key]), key
    rows = _rows(tmp_path / "probed")
    assert [row["step"] for row in rows] == [0, 1]
    assert all(len(row["losses"]) == POINTS and row["grad_norm"] > 0 for row in rows)


def test_the_reader_and_figure_overlay_runs_and_keep_a_steps_last_row(tmp_path):
    """analysis.landscape on two loop runs (BN, UN): the .json beside the figure holds each
    run's rows as landscape.jsonl has them; a step written twice (a resumed run's) keeps its
    last row."""
    from analysis import landscape

    assert landscape.LANDSCAPE_FILE == LANDSCAPE_FILE
    for norm in ("bn", "un"):
        run = tmp_path / "runs" / norm
        _train(run, norm, batch=8, accumulate=1, updates=5, record_landscape=2)
        result = json.loads((run / "result.json").read_text())
        (run / "result.json").write_text(json.dumps({**result, "norm": norm, "seed": 0}))
    landscape.main(["--runs", str(tmp_path / "runs"), "--out", str(tmp_path / "out")])
    drawn = json.loads((tmp_path / "out" / "None_None_landscape.json").read_text())
    assert (tmp_path / "out" / "None_None_landscape.png").stat().st_size > 0
    assert sorted(drawn) == ["BN s0", "UN s0"]
    assert drawn["UN s0"] == _rows(tmp_path / "runs" / "un")

    with open(tmp_path / "runs" / "un" / LANDSCAPE_FILE, "a") as handle:
        handle.write(json.dumps({**drawn["UN s0"][1], "loss": -1.0}) + "\n")
    rows = landscape.read_landscape(tmp_path / "runs" / "un")
    assert [row["step"] for row in rows] == [0, 2, 4] and rows[1]["loss"] == -1.0


@pytest.mark.slow
def test_a_classification_run_with_mixup_trains_as_without(tmp_path):
    """Swin-T with UN at scale=cpu, mixup and cutmix on (timm's Mixup draws from numpy),
    record_landscape=1 over three updates: last.pt's weights and every buffer are bit for bit
    those of the run without it, and each update has its row."""
    from plugins.checkpoints import load_checkpoint
    from plugins.timm.trainer import train
    from test_vision import QUICK, config

    mixup = "recipe.mixup={mixup_alpha:0.8,cutmix_alpha:1.0,prob:1.0,switch_prob:0.5,mode:batch}"
    states = {}
    for name, more in (("plain", ()), ("probed", ("record_landscape=1",))):
        result = train(config("+exp=swin_t_un", *QUICK, mixup, *more), tmp_path / name)
        assert result["status"] in ("ok", "chance") and result["steps"] == 3
        states[name] = load_checkpoint(tmp_path / name / "last.pt")["model"]
    for key, value in states["plain"].items():
        assert torch.equal(value, states["probed"][key]), key
    assert [row["step"] for row in _rows(tmp_path / "probed")] == [0, 1, 2]


def test_a_forward_that_changes_its_batch_in_place_is_probed_on_the_updates_batch(tmp_path):
    """timm's mixup mixes the images tensor it is given: a forward that scales its batch in
    place gives the same rows, and trains the same, as one that scales a copy."""
    from test_loop import _cfg

    from plugins.distributed import Distributed
    from plugins.loop import EpochLoop
    from timm.scheduler import create_scheduler_v2

    def run(name, in_place):
        torch.manual_seed(0)
        data = torch.utils.data.TensorDataset(torch.randn(32, 5, C), torch.randn(32, 5, 1))
        model = torch.nn.Sequential(torch.nn.Linear(C, C), unnorm.build_norm("bn", C),
                                    torch.nn.Linear(C, 1))
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        scheduler, _ = create_scheduler_v2(optimizer, sched="cosine", num_epochs=1,
                                           step_on_epochs=False, updates_per_epoch=3)
        loop = EpochLoop(_cfg(record_landscape=1), tmp_path / name, Distributed("cpu"),
                         RunDirectory(tmp_path / name), model, optimizer, scheduler, None)

        def forward(batch):
            x, y = batch
            x = x.mul_(2.0) if in_place else x * 2.0
            return torch.nn.functional.mse_loss(model(x), y)

        loop.fit(model, data, 8, None, 3, 1, forward=forward, evaluate=lambda e: {}, meta={},
                 init="scratch")
        return model, _rows(tmp_path / name)

    (copied, copied_rows), (changed, changed_rows) = run("copy", False), run("in_place", True)
    assert changed_rows == copied_rows
    for (name, a), b in zip(copied.state_dict().items(), changed.state_dict().values()):
        assert torch.equal(a, b), name


def test_the_translation_launcher_passes_the_interval_and_the_run_folder(tmp_path):
    from pathlib import Path

    from plugins.fairseq.launcher import train_command
    from plugins.scale import effective_config
    from test_vision import config

    class Env:
        def module(self, name):
            return ["python", "-m", name]

    def command(*more):
        cfg = effective_config(config("+exp=iwslt14_un", "scale=cpu", *more), [], {})
        return train_command(cfg, Env(), Path("/data"), tmp_path / "checkpoints")

    probed = command("record_landscape=5")
    at = probed.index("--record-landscape")
    assert probed[at:at + 4] == ["--record-landscape", "5", "--landscape-dir", str(tmp_path)]
    assert "--record-landscape" not in command()


def test_the_taps_record_nothing_of_a_probe(tmp_path):
    """record_gns with record_landscape=1: one GNS record per update, as without probes."""
    _train(tmp_path, "un", batch=8, accumulate=1, updates=4, record_gns=True, record_landscape=1)
    saved = torch.load(tmp_path / "gns" / "epoch_0001.pt", weights_only=True)
    assert saved["layers"]["1"]["examples"].tolist() == [8.0] * 4
