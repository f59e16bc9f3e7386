"""Scale invariance made visible (issue 49): ``unnorm.scale_invariance`` on constructed cases,
AdamP's and SGDP's projected update orthogonal to the weight, and the records a short run
writes (``result.json``'s ``scale_invariant``, ``metrics.jsonl``'s ``effective_step`` and
``projection``)."""
from __future__ import annotations

import json
from pathlib import Path

import adamp
import pytest
import torch
from hydra import compose, initialize_config_dir
from timm.optim import AdamP
from torch import nn

import unnorm
from plugins.optim import UpdateRecord, projected_view
from plugins.runlog import SCALE_INVARIANCE_FILE
from plugins.timm.trainer import train

ROOT = Path(__file__).resolve().parents[1]


def linear_then(after: nn.Module, bias: bool = False) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 6, bias=bias), after, nn.Linear(6, 3))


@pytest.mark.parametrize("model, first", [
    (lambda: linear_then(nn.BatchNorm1d(6)), "row"),  # batch statistics, per output feature
    (lambda: linear_then(nn.BatchNorm1d(6), bias=True), "row"),  # the mean removes the bias
    (lambda: linear_then(nn.LayerNorm(6)), "tensor"),  # one statistic over all output rows
    (lambda: linear_then(nn.LayerNorm(6), bias=True), "none"),  # the bias does not scale
    (lambda: linear_then(nn.ReLU(), bias=True), "none"),
    (lambda: nn.Sequential(unnorm.StandardizedLinear(8, 6), nn.ReLU(), nn.Linear(6, 3)), "row"),
    (lambda: linear_then(nn.Sequential(nn.Dropout(0.5), nn.BatchNorm1d(6))), "row"),  # reseeded
])
def test_the_detector_on_constructed_cases(model, first):
    """Each case's first layer as scaling it shows; the last layer (a plain head) is never
    invariant. The model keeps its weights, running statistics and mode."""
    net = model().eval()
    state = {key: value.clone() for key, value in net.state_dict().items()}
    inputs = torch.randn(16, 8, dtype=torch.float64)
    found = unnorm.scale_invariance(net, lambda copy: copy(inputs))
    assert found == {"0.weight": first, "2.weight": "none"}
    assert not net.training and all(torch.equal(value, state[key])
                                    for key, value in net.state_dict().items())


def test_zero_and_unused_weights_are_not_called_invariant():
    """A weight of zeros is unchanged by any scaling and one the outputs do not read has no
    gradient: neither says anything about invariance."""
    net = linear_then(nn.BatchNorm1d(6))
    net.add_module("unused", nn.Linear(3, 3))
    with torch.no_grad():
        net[2].weight.zero_()
    found = unnorm.scale_invariance(net, lambda copy: copy[:3](torch.randn(16, 8, dtype=torch.float64,
                                                                           generator=torch.Generator().manual_seed(0))))
    assert found == {"0.weight": "inert", "2.weight": "zero", "unused.weight": "inert"}
    assert unnorm.invariance_record(found)["counts"] == {"row": 0, "tensor": 0, "none": 0, "inert": 2, "zero": 1}


def test_a_subset_and_a_nondeterministic_probe():
    net = linear_then(nn.BatchNorm1d(6))
    inputs = torch.randn(16, 8, dtype=torch.float64)
    assert unnorm.scale_invariance(net, lambda copy: copy(inputs), include="0.*") == {"0.weight": "row"}
    with pytest.raises(ValueError, match="matches no trainable parameter"):
        unnorm.scale_invariance(net, lambda copy: copy(inputs), include="head.*")
    calls = iter(range(100))  # a draw the reseeding does not reach
    with pytest.raises(RuntimeError, match="make it deterministic"):
        unnorm.scale_invariance(net, lambda copy: copy(inputs) + next(calls))


def standardized_net() -> nn.Module:
    torch.manual_seed(0)
    net = nn.Sequential(nn.Conv2d(3, 8, 3), nn.GroupNorm(2, 8), nn.ReLU(), nn.Conv2d(8, 8, 3),
                        nn.ReLU(), nn.Flatten(), nn.Linear(8 * 4 * 4, 16), nn.ReLU(), nn.Linear(16, 4))
    unnorm.standardize_weights(net, include=["0", "3", "6"])
    return net.double()


@pytest.mark.parametrize("build", [
    lambda params: AdamP(params, lr=0.01, weight_decay=0.0, delta=0.1, wd_ratio=0.1, nesterov=False),
    lambda params: adamp.SGDP(params, lr=0.01, momentum=0.9, weight_decay=0.0, delta=0.1, wd_ratio=0.1),
], ids=["timm-adamp", "release-sgdp"])
def test_a_projected_update_has_no_radial_component(build):
    """Where the projection acts, the update is orthogonal to the weight, per output channel
    (channel view) or as a whole (tensor view), up to the release's eps: it projects on
    w / (||w|| + eps), which leaves a radial part of relative size 2 eps / ||w||; weight
    decay off, so the update is the projected step alone. The standardised weights are projected, the plain
    head is not (its update has a radial part), and the record counts what was projected."""
    net = standardized_net()
    optimizer = build(net.parameters())
    record = UpdateRecord(optimizer)
    views, expected = {}, {"tensors": 0, "channels": 0}
    for step in range(3):
        torch.manual_seed(step)
        optimizer.zero_grad()
        nn.functional.cross_entropy(net(torch.randn(16, 3, 8, 8, dtype=torch.float64)),
                                    torch.randint(0, 4, (16,))).backward()
        before = {name: p.detach().clone() for name, p in net.named_parameters()}
        for name, p in net.named_parameters():
            if p.ndim > 1:
                views[name] = projected_view(p, p.grad, 0.1, 1e-8)
                expected["tensors"] += views[name] is not None
                expected["channels"] += p.shape[0] if views[name] == "channel" else 0
        with record.step():
            optimizer.step()
        for name, p in net.named_parameters():
            if p.ndim < 2:
                continue
            w, dw = before[name], p.detach() - before[name]
            shape = (w.shape[0], -1) if views[name] == "channel" else (1, -1)
            cosine = ((w * dw).reshape(shape).sum(1)
                      / (w.reshape(shape).norm(dim=1) * dw.reshape(shape).norm(dim=1))).abs()
            if views[name] is not None:
                bound = 2 * 1e-8 / w.reshape(shape).norm(dim=1) * (1 + 1e-6)
                assert (cosine <= bound).all(), (name, views[name], cosine.max())
            else:
                assert cosine.max() > 1e-4, name
    assert all(views[name] is not None for name in ("0.weight", "3.weight", "6.weight"))
    assert views["8.weight"] is None
    projected = record.flush()["projection"]  # per update, on average
    assert projected["tensors"] == expected["tensors"] / 3 >= 3
    assert projected["channels"] == expected["channels"] / 3


def config(*overrides):
    with initialize_config_dir(str(ROOT / "configs"), version_base="1.3"):
        return compose("train", overrides=list(overrides))


QUICK = ["+exp=t2t_vit_14_ln", "scale=cpu", "logger=none", "recipe.epochs=1",
         "scale.max_steps_per_epoch=3", "ws=transformer"]


def test_an_optimizer_that_does_not_project_records_none():
    """AdamW on the standardised net: the effective steps, and no projection."""
    net = standardized_net()
    optimizer = torch.optim.AdamW(net.parameters(), lr=0.01)
    record, ratios = UpdateRecord(optimizer), []
    for step in range(2):
        torch.manual_seed(step)
        optimizer.zero_grad()
        nn.functional.cross_entropy(net(torch.randn(16, 3, 8, 8, dtype=torch.float64)),
                                    torch.randint(0, 4, (16,))).backward()
        before = [p.detach().clone() for p in net.parameters()]
        with record.step():
            optimizer.step()
        steps = [(p.detach() - b).norm() ** 2 for p, b in zip(net.parameters(), before)]
        ratios.append((torch.stack(steps).sum().sqrt()
                       / torch.stack([b.norm() ** 2 for b in before]).sum().sqrt()).item())
    row = record.flush()
    assert row["projection"] == {"tensors": 0, "channel_view": 0, "tensor_view": 0, "channels": 0}
    assert row["param_groups"] == [{"weight_decay": 0.01,
                                    "parameters": sum(p.numel() for p in net.parameters())}]
    assert row["effective_step"] == [pytest.approx(sum(ratios) / 2, rel=1e-12)]


@pytest.mark.slow
def test_a_short_run_records_invariance_and_its_updates(tmp_path):
    """T2T-ViT with WS on each block's qkv and fc1 (8 layers), AdamP: result.json names the 8
    as row-invariant (kept in scale_invariance.json too); metrics.jsonl's epoch row holds each
    param group's effective step and the projections AdamP made."""
    optimizer = "adamp"
    result = train(config(*QUICK, f"optimizer={optimizer}"), tmp_path)
    record = result["scale_invariant"]
    assert record["counts"]["row"] == 8 and record["counts"]["tensor"] == 0
    assert set(record["row"]) == {f"blocks.{i}.{layer}.weight" for i in range(4)
                                  for layer in ("attn.qkv", "mlp.fc1")}
    assert json.loads((tmp_path / SCALE_INVARIANCE_FILE).read_text()) == record
    assert json.loads((tmp_path / "result.json").read_text())["scale_invariant"] == record
    [row] = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert len(row["effective_step"]) == 4 and 0 < row["effective_step"][1] < 1
    assert [g["weight_decay"] > 0 for g in row["param_groups"]].count(True) == 2  # body, head
    projected = row["projection"]
    assert projected["tensors"] >= 8 and projected["channels"] > 0
