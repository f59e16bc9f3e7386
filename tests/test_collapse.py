"""The outlier-filtration replay of a collapsed run (analysis/collapse.py) against the bound
written out by hand (the spec's step 3)."""
from __future__ import annotations

import numpy as np

from analysis.collapse import first_filtered_step

OPTIONS = {"window_size": 4, "warmup_iters": 5, "momentum": 0.9, "eps": 1e-5,
           "outlier_filtration": False, "grad_compensation": False}


def test_a_spike_after_warm_up_is_filtered_at_its_step():
    # t = 7 writes 100 into a window of ones: am - gm = 25.75 - 100 ** 0.25 > 4 x Var(sqrt(ones)) = 0
    act = np.ones((10, 3))
    act[6, 1] = 100.0
    assert first_filtered_step(act, OPTIONS) == 7


def test_a_spike_during_warm_up_is_not_tested_and_a_steady_run_never_filtered():
    act = np.ones((10, 3))
    act[2, 0] = 100.0  # t = 3 < warm-up; it has left the window of 4 by t = 7
    assert first_filtered_step(act, OPTIONS) is None
    assert first_filtered_step(np.full((10, 3), 2.0), OPTIONS) is None


def test_a_gradual_drift_within_the_bound_is_not_filtered_and_non_finite_rows_end_the_replay():
    # the previous window's spread sets the bound: growth by 1% a step stays within it
    act = np.outer(1.01 ** np.arange(12), np.ones(2)) * (1 + 0.05 * np.arange(2))
    act[:, 0] *= 1 + 0.2 * (np.arange(12) % 2)  # a window with spread: the bound is positive
    assert first_filtered_step(act, OPTIONS) is None
    act[8] = np.nan
    assert first_filtered_step(act, OPTIONS) is None
