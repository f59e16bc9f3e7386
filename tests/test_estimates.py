"""The replay of UN's estimates (analysis/estimates.py) against UN itself: from the recorded
statistics it must land on the layer's own final windows, EMA and running variance."""
from __future__ import annotations

import numpy as np
import torch

import unnorm
from analysis.estimates import cosine, relative_distance, replay
from test_norms import SHAPE, make_sequence, module_step


def test_replay_from_recorded_statistics_reaches_the_layers_state():
    options = {"window_size": 4, "warmup_iters": 6, "momentum": 0.8, "outlier_filtration": True}
    norm = unnorm.build_norm("un", SHAPE[-1], **options)
    with unnorm.record_statistics(torch.nn.Sequential(norm)) as recorder:
        for x, dy in zip(*make_sequence(40)):
            module_step(norm, x, dy)
        chunk = recorder.flush()["0"]
    skip = chunk["skip"].numpy().astype(bool)
    assert 0 < skip.sum() < 40  # the sequence's spikes are filtered
    v, psi = replay(chunk["act"].double().numpy(), chunk["grad"].double().numpy(), skip,
                    window=4, warmup=6, alpha=0.8)
    # the layer's EMA after the last step is the replayed psi there (that step was not skipped)
    assert not skip[-1]
    np.testing.assert_allclose(psi[-1], norm.ema_grad.double().numpy(), rtol=1e-5, atol=1e-7)
    # and its forward statistic is the geometric mean of the layer's window
    np.testing.assert_allclose(np.exp(np.log(norm.fwd_buffer.double().numpy()).mean(0)),
                               v[-1], rtol=1e-5)


def test_relative_distance_is_zero_for_the_batch_itself():
    batch = np.random.default_rng(0).normal(size=(5, 3))
    assert np.allclose(relative_distance(batch, batch), 0)
    assert np.allclose(relative_distance(2 * batch, batch), 1)


def test_cosine_of_per_step_vectors():
    a = np.array([[1.0, 0.0], [1.0, 1.0], [2.0, 0.0]])
    b = np.array([[0.0, 3.0], [2.0, 2.0], [-1.0, 0.0]])
    np.testing.assert_allclose(cosine(a, b), [0.0, 1.0, -1.0])
