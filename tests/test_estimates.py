"""The replay of UN's estimates (analysis/estimates.py) against UN itself: from the recorded
statistics it must land on the layer's own final state, for the released UN and each ablation,
and the compact inputs file must re-derive the same estimates."""
from __future__ import annotations

import json

import numpy as np
import pytest
import torch

import unnorm
from analysis.estimates import (REPLAYED_OPTIONS, cosine, learning_rates, load_inputs, main,
                                relative_distance, replay)
from test_norms import C, SPIKES, make_sequence, module_step, random_affine

OPTIONS = {"window_size": 4, "warmup_iters": 6, "momentum": 0.8, "outlier_filtration": True,
           "compensation_start": 10}
ABLATIONS = {
    "released": {},
    "no_fwd_gm": {"fwd_gm": False},
    "no_bwd_am": {"bwd_am": False},
    "no_bwd_ema": {"bwd_ema": False},
    "window_pair": {"window_size": [5, 3]},  # a list, as result.json holds it
    "no_filtration": {"outlier_filtration": False},
}


def train_recorded(options, steps=40, spikes=SPIKES):
    """A UN layer trained ``steps`` steps, and what record_statistics recorded, as numpy."""
    norm = random_affine(unnorm.build_norm("un", C, **options))
    with unnorm.record_statistics(torch.nn.Sequential(norm)) as recorder:
        for x, dy in zip(*make_sequence(steps, spikes=spikes)):
            module_step(norm, x, dy)
        chunk = recorder.flush()["0"]
    return norm, {key: value.numpy() for key, value in chunk.items()}


def replay_recorded(recorded, options):
    return replay(recorded["act"], recorded["grad"], recorded["skip"].astype(bool),
                  recorded["rejected"].astype(bool), options)


@pytest.mark.parametrize("ablation", ABLATIONS)
def test_replay_lands_on_the_layers_own_state(ablation):
    options = {**OPTIONS, **ABLATIONS[ablation]}
    norm, recorded = train_recorded(options)
    skip = recorded["skip"].astype(bool)
    assert (0 < skip.sum() < 40) == options["outlier_filtration"]  # the spikes are filtered
    v, psi, replayed = replay_recorded(recorded, options)
    for name, buffer in norm.named_buffers():  # windows, EMA, running_var, counters
        torch.testing.assert_close(getattr(replayed, name), buffer, rtol=0, atol=0, msg=name)
    # the last step (not skipped) used the layer's EMA and its window's geometric mean
    assert not skip[-1]
    np.testing.assert_allclose(psi[-1], norm.ema_grad.double().numpy(), rtol=1e-6)
    window = norm.fwd_buffer.double().numpy()
    expected_v = np.exp(np.log(window).mean(0)) if options.get("fwd_gm", True) else recorded["act"][-1]
    np.testing.assert_allclose(v[-1], expected_v, rtol=1e-5)


def test_replay_leaves_a_rejected_step_out():
    norm, recorded = train_recorded(OPTIONS, spikes={**SPIKES, 20: float("nan")})
    rejected = recorded["rejected"].astype(bool)
    assert rejected.tolist() == [step == 19 for step in range(40)]
    v, psi, replayed = replay_recorded(recorded, OPTIONS)
    assert int(replayed.num_iters) == 39 and int(replayed.num_rejected) == 1
    torch.testing.assert_close(replayed.ema_grad, norm.ema_grad, rtol=0, atol=0)
    torch.testing.assert_close(replayed.fwd_buffer, norm.fwd_buffer, rtol=0, atol=0)
    assert np.isnan(v[19]).all() and np.isnan(psi[19]).all() and np.isfinite(v[20:]).all()


def test_replay_refuses_an_unknown_option_and_skips_that_contradict_the_options():
    assert set(REPLAYED_OPTIONS) == set(unnorm.option_names("un"))  # a new option needs a decision
    _, recorded = train_recorded(OPTIONS, steps=30)
    with pytest.raises(ValueError, match="center.*REPLAYED_OPTIONS"):
        replay_recorded(recorded, {**OPTIONS, "center": True})
    with pytest.raises(ValueError, match="contradict"):  # the run filtered, the options say not
        replay_recorded(recorded, {**OPTIONS, "outlier_filtration": False})


def write_run(run_dir, options, epochs, **result):
    """A recorded UN run on disk, as the training loop writes one: result.json, per-epoch
    statistics and metrics.jsonl rows with each update's learning rate."""
    norm = random_affine(unnorm.build_norm("un", C, **options))
    xs, dys = make_sequence(10 * epochs)
    (run_dir / "stats").mkdir(parents=True)
    with unnorm.record_statistics(torch.nn.Sequential(norm)) as recorder:
        for epoch in range(epochs):
            for x, dy in zip(xs[10 * epoch:10 * epoch + 10], dys[10 * epoch:10 * epoch + 10]):
                module_step(norm, x, dy)
            torch.save({"norm": recorder.flush()["0"]}, run_dir / "stats" / f"epoch_{epoch + 1:04d}.pt")
            with open(run_dir / "metrics.jsonl", "a") as f:
                f.write(json.dumps({"epoch": epoch + 1, "lr": 0.1 * epoch + 0.09,
                                    "lr_per_update": [0.1 * epoch + 0.01 * k for k in range(10)]}) + "\n")
    (run_dir / "result.json").write_text(json.dumps({"norm": "un", "norm_options": options,
                                                     "init": "scratch", "world_size": 1, **result}))


def test_inputs_file_rederives_the_estimates_from_a_channel_subset(tmp_path):
    options = {**OPTIONS, "window_size": [5, 3]}
    write_run(tmp_path / "run", options, epochs=4)
    main([str(tmp_path / "run"), "--out", str(tmp_path / "a"), "--channels", "3"])
    main(["--from", str(tmp_path / "a" / "inputs.npz"), "--out", str(tmp_path / "b")])
    first, again = (json.loads((tmp_path / d / "estimates.json").read_text()) for d in "ab")
    assert first == again and (tmp_path / "b" / "estimates.png").exists()
    inputs = load_inputs(tmp_path / "a" / "inputs.npz")
    layer = inputs["layers"]["norm"]
    assert layer["channels"].tolist() == [0, 2, 5] and layer["act"].dtype == np.float32
    assert inputs["norm_options"] == options and inputs["lr_per_update"]
    np.testing.assert_allclose(inputs["lr"], [0.1 * e + 0.01 * k for e in range(4) for k in range(10)])
    # UN's estimates are per channel given the skips: the subset's are the full replay's
    full = {key: torch.cat([torch.load(tmp_path / "run" / "stats" / f"epoch_{e:04d}.pt")["norm"][key]
                            for e in range(1, 5)]).numpy() for key in ("act", "grad", "skip", "rejected")}
    v, psi, _ = replay_recorded(full, options)
    kept = [0, 2, 5]
    act, grad = full["act"][:, kept].astype(np.float64), full["grad"][:, kept].astype(np.float64)
    np.testing.assert_allclose(first["forward"], relative_distance(v[:, kept], act), rtol=1e-5)
    np.testing.assert_allclose(first["backward"], relative_distance(psi[:, kept], grad), rtol=1e-5)
    assert first["channels"] == {"replayed": 3, "of": C}


@pytest.mark.parametrize("result, refusal", [
    ({"init": "runs/imagenet/last.pt"}, "started from runs/imagenet/last.pt"),
    ({"world_size": 2}, "2 replicas.*sync_stats=true"),
])
def test_a_run_whose_state_changed_outside_its_record_is_refused(tmp_path, result, refusal):
    write_run(tmp_path, OPTIONS, epochs=1, **result)
    with pytest.raises(ValueError, match=refusal):
        main([str(tmp_path), "--out", str(tmp_path / "analysis")])


def test_learning_rates_per_update_when_recorded_else_per_epoch(tmp_path):
    metrics = tmp_path / "metrics.jsonl"
    metrics.write_text('{"lr": 0.5}\n{"lr": 0.25}\n')
    lr, per_update = learning_rates(metrics)
    assert lr.tolist() == [0.5, 0.25] and not per_update
    metrics.write_text('{"lr": 0.5, "lr_per_update": [1.0, 0.5]}\n'
                       '{"lr": 0.25, "lr_per_update": [0.4, 0.25]}\n')
    lr, per_update = learning_rates(metrics)
    assert lr.tolist() == [1.0, 0.5, 0.4, 0.25] and per_update


def test_relative_distance_is_zero_for_the_batch_itself():
    batch = np.random.default_rng(0).normal(size=(5, 3))
    assert np.allclose(relative_distance(batch, batch), 0)
    assert np.allclose(relative_distance(2 * batch, batch), 1)


def test_cosine_of_per_step_vectors():
    a = np.array([[1.0, 0.0], [1.0, 1.0], [2.0, 0.0]])
    b = np.array([[0.0, 3.0], [2.0, 2.0], [-1.0, 0.0]])
    np.testing.assert_allclose(cosine(a, b), [0.0, 1.0, -1.0])
