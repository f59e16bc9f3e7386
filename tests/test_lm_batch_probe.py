"""The batch-statistics probe of a causal LM (plugins/lm/batch_probe.py, scripts/probe_lm_batch.py,
analysis/batch_probe.py): against closed forms on tiny Llamas with planted outliers, losses
against torch's cross-entropy on the model's logits, and the model left as it was."""
from __future__ import annotations

import copy
import json
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from plugins.lm.batch_probe import norm_modules, probe_model
from plugins.lm.model import build_lm
from plugins.lm.trainer import train
from plugins.runlog import FINISHED
from test_lm import TINY_MODEL, TINY_RECIPE, corpus_root  # noqa: F401 (a fixture)
from test_vision import config

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "scripts"))
import probe_lm_batch  # noqa: E402

TINY = dict(vocab_size=61, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
            num_attention_heads=4, context=16)
FIRST = "model.layers.0.input_layernorm"  # in Pre placement its input is the embeddings


def tiny(norm: dict, seed: int = 0):
    torch.manual_seed(seed)
    return build_lm(TINY, norm, initializer_range=0.1).eval()


def batch(size=4, seed=0, avoid=None):
    """``(inputs, targets)`` of random tokens, never ``avoid``."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, TINY["vocab_size"] - 1, (size, TINY["context"] + 1), generator=gen)
    if avoid is not None:
        ids = torch.where(ids >= avoid, ids + 1, ids)
    return ids[:, :-1], ids[:, 1:]


def test_one_outsized_position_takes_its_closed_form_share():
    """Token k, at position p of every sequence, embedded a * u (|u| = 1, a >> the others):
    p's share of the pooled centred second moment tends to (T - 1) / T (its B rows carry the
    whole batch's mean, a u / T, so every other row holds (a / T)^2 and p (a (1 - 1/T))^2)."""
    model, k, p, length = tiny({"name": "bn"}), 7, 5, TINY["context"]
    with torch.no_grad():
        u = torch.randn(TINY["hidden_size"], generator=torch.Generator().manual_seed(1))
        model.model.embed_tokens.weight[k] = 1e3 * u / u.norm()
    inputs, targets = batch(avoid=k)
    inputs[:, p] = k
    share = probe_model(model, [(inputs, targets)])["layers"][FIRST]["position_share"]
    assert share["argmax"] == p and share["uniform"] == 1 / length
    assert share["max"] == pytest.approx((length - 1) / length, rel=1e-4)
    assert share["max_over_uniform"] == pytest.approx(length - 1, rel=1e-4)
    assert sum(share["per_position"]) == pytest.approx(1.0)


def test_a_scaled_copy_of_a_channel_takes_s_squared_times_its_share():
    """Channel k of every embedding made s times channel j: centring is linear, so k's share
    is exactly s^2 times j's, and k is the largest channel (top 1% of 32 channels: one)."""
    model, j, k, s = tiny({"name": "bn"}), 3, 11, 5.0
    with torch.no_grad():
        weight = model.model.embed_tokens.weight
        weight[:, k] = s * weight[:, j]
    result = probe_model(model, [batch()])
    channel = result["layers"][FIRST]["channel_share"]
    x = model.model.embed_tokens.weight[batch()[0]].detach().double()
    x = x.reshape(-1, TINY["hidden_size"])
    energy = (x - x.mean(dim=0)).square().sum(dim=0)
    assert channel["argmax"] == k and channel["top_1pct_channels"] == 1
    assert channel["max"] == pytest.approx((energy[k] / energy.sum()).item(), rel=1e-9)
    assert channel["max"] == pytest.approx(s ** 2 * (energy[j] / energy.sum()).item(), rel=1e-6)
    assert channel["top_1pct_share"] == pytest.approx(channel["max"])
    assert channel["max_over_uniform"] == pytest.approx(channel["max"] * TINY["hidden_size"])


@pytest.mark.parametrize("norm", ["bn", "ln"])
def test_losses_are_cross_entropy_of_the_models_logits_in_each_mode(norm):
    """Per position, the mean over the windows of torch's cross-entropy on the eval-mode
    logits, and on a training-mode copy's (BN's batch statistics; LN's modes agree)."""
    model = tiny({"name": norm})
    batches = [batch(seed=0), batch(seed=1)]
    result = probe_model(model, batches)

    def expected(net):
        with torch.no_grad():
            losses = [F.cross_entropy(net(ids).logits.permute(0, 2, 1), targets, reduction="none")
                      for ids, targets in batches]
        return torch.cat(losses)  # (windows, T)

    eval_windows, train_windows = expected(model), expected(copy.deepcopy(model).train())
    eval_mode, train_mode = eval_windows.mean(dim=0), train_windows.mean(dim=0)
    assert result["windows"] == 8 and result["batch_size"] == 4 and result["context"] == 16
    for mode, want in (("eval", eval_mode), ("train_mode", train_mode)):
        got = torch.tensor(result["loss"][mode]["per_position"], dtype=torch.float64)
        torch.testing.assert_close(got, want.double(), rtol=1e-5, atol=1e-6)
        assert result["loss"][mode]["mean"] == pytest.approx(want.mean().item(), rel=1e-5)
    worst = result["windows_worst_in_eval"]["worst"]
    order = eval_windows.mean(dim=1).argsort(descending=True)[:5]
    assert [entry["window"] for entry in worst] == order.tolist()
    assert worst[0]["eval"] == pytest.approx(eval_windows[order[0]].mean().item(), rel=1e-5)
    assert worst[0]["train_mode"] == pytest.approx(train_windows[order[0]].mean().item(), rel=1e-5)
    assert worst[0]["worst_position"] == int(eval_windows[order[0]].argmax())
    if norm == "ln":
        assert result["loss"]["eval"]["per_position"] == pytest.approx(
            result["loss"]["train_mode"]["per_position"])
        assert all(layer["running"] is None for layer in result["layers"].values())
    else:  # the two modes differ before any training: running statistics are 0 and 1
        assert not torch.allclose(eval_mode, train_mode)
    assert set(result["layers"]) == set(norm_modules(model)) and len(result["layers"]) == 5


def test_the_probe_leaves_the_model_as_it_was():
    """A training-mode forward commits BN's running statistics: on the model itself it would
    change them (checked here), so the probe must run it on a copy."""
    model = tiny({"name": "bn"})
    before = {key: value.clone() for key, value in model.state_dict().items()}
    probe_model(model, [batch(seed=0), batch(seed=1)])
    assert not model.training
    for key, value in model.state_dict().items():
        assert torch.equal(value, before[key]), key
    with torch.no_grad():  # the control: a training forward on the model moves its buffers
        model.train()(batch()[0])
    key = f"{FIRST}.running_var"
    assert not torch.equal(model.state_dict()[key], before[key])


def test_running_against_batch_statistics_in_closed_form():
    """Running variance set to 4x the batch's unbiased variance and the running mean 2 batch
    standard deviations off, per channel: every channel's ratio is 4 and shift 2."""
    model = tiny({"name": "bn"})
    inputs, targets = batch()
    x = model.model.embed_tokens.weight[inputs].detach().reshape(-1, TINY["hidden_size"])
    norm = norm_modules(model)[FIRST]
    with torch.no_grad():
        norm.running_var.copy_(4 * x.var(dim=0))
        norm.running_mean.copy_(x.mean(dim=0) - 2 * x.std(dim=0))
    running = probe_model(model, [(inputs, targets)])["layers"][FIRST]["running"]
    assert running["centred"] and not running["per_position"]
    for value in running["var_ratio"].values():
        assert value == pytest.approx(4.0, rel=1e-5)
    for value in running["mean_shift"].values():
        assert value == pytest.approx(2.0, rel=1e-5)


def test_causal_running_statistics_against_each_prefix():
    """Causal BN keeps statistics per position: position t's running variance set to 3x the
    unbiased variance of every sequence's positions <= t; the whole-window comparison reads
    the last position's (the whole batch)."""
    model = tiny({"name": "bn", "causal": True})
    inputs, targets = batch()
    x = model.model.embed_tokens.weight[inputs].detach()
    norm = norm_modules(model)[FIRST]
    prefix = torch.stack([x[:, :t + 1].reshape(-1, TINY["hidden_size"]).var(dim=0)
                          for t in range(TINY["context"])])
    with torch.no_grad():
        norm.running_var.copy_(3 * prefix)
    running = probe_model(model, [(inputs, targets)])["layers"][FIRST]["running"]
    assert running["per_position"]
    for key in ("var_ratio", "position_var_ratio"):
        for value in running[key].values():
            assert value == pytest.approx(3.0, rel=1e-4), key
    assert running["position_var_ratio_median_per_position"] == pytest.approx([3.0] * 16, rel=1e-4)


def test_the_script_probes_trained_runs_and_draws_from_the_json(
        corpus_root, tmp_path):  # noqa: F811 (the fixture imported above)
    """Two tiny trained runs (BN, LN): probe.json keyed by exp and seed with the record's
    fields, its losses the probe's, and the figure."""
    runs = []
    for norm in ("bn", "ln"):
        cfg = config(f"+exp=llama_71m_{norm}", "logger=none", "device=cpu",
                     "scale.num_workers=0", f"data.root={corpus_root}", *TINY_MODEL,
                     *TINY_RECIPE, "seed=3")
        result = train(cfg, tmp_path / norm)
        assert result["status"] in FINISHED, result
        runs.append(tmp_path / norm)
    out = tmp_path / "probe"
    probe_lm_batch.main([*map(str, runs), "--out", str(out), "--windows", "8"])
    report = json.loads((out / "probe.json").read_text())
    assert list(report) == ["llama_71m_bn-s3", "llama_71m_ln-s3"]
    bn = report["llama_71m_bn-s3"]
    assert bn["norm"] == "bn" and bn["seed"] == 3 and bn["norm_options"]["causal"] is False
    assert bn["windows"] == 8 and bn["batch_size"] == 4 and "git_commit" in bn
    assert bn["layers"][FIRST]["running"]["var_ratio"]["median"] > 0
    assert report["llama_71m_ln-s3"]["layers"][FIRST]["running"] is None
    assert (out / "batch_probe.png").stat().st_size > 10_000
