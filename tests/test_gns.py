"""The gradient noise scale: the norms' per-example gradient tap (unnorm.gns) against exact
per-example gradients, the estimator (analysis.gns) against noise scales known in closed form,
and the classification trainer's records read back by ``python -m analysis.gns``."""
from __future__ import annotations

import copy
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from omegaconf import OmegaConf
from test_vision import QUICK, config

import unnorm
from analysis.gns import noise_scale, step_norms, unbiased_estimates
from plugins.timm import model_from_config
from plugins.timm.trainer import train

ROOT = Path(__file__).resolve().parents[1]
B, T, C = 4, 3, 6
#: every norm with learnable affine parameters (per channel, or ScaleNorm's one gain: the
#: tap sums its share over the channels); a model of norms without any (NoNorm) is refused.
#: Options that put PRepBN mid hand-over (both its LayerNorm and its RepBN parameters receive
#: gradient)
AFFINE_NORMS = [name for name in unnorm.available_norms()
                if unnorm.build_norm(name, C).affine_parameters()]
OPTIONS = {"prepbn": {"warmup_iters": 0, "decay_iters": 10}}


def _model(norm: str, layers: int = 1) -> torch.nn.Sequential:
    """Linear, then ``layers`` x (norm, GELU, Linear), in float64; nothing but the norms
    touches more than one example."""
    parts = [torch.nn.Linear(C, C)]
    for _ in range(layers):
        parts += [unnorm.build_norm(norm, C, **OPTIONS.get(norm, {})), torch.nn.GELU(),
                  torch.nn.Linear(C, C)]
    model = torch.nn.Sequential(*parts).double()
    for module in model.modules():
        if isinstance(module, unnorm.ProgressiveRepBN):
            module.num_iters.fill_(5)  # step 6: LayerNorm share 0.5
    return model


def _losses(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Each example's loss l_i (mean squared error over its positions)."""
    return (out - target).square().flatten(1).mean(dim=1)


def _flat_grad(loss, params) -> torch.Tensor:
    return torch.cat([g.flatten() for g in torch.autograd.grad(loss, params, retain_graph=True)])


def _norm_params(model) -> dict[str, list[torch.Tensor]]:
    return {name: list(module.affine_parameters().values()) for name, module in model.named_modules()
            if isinstance(module, unnorm.ChannelNorm)}


def _record(model, x, target, example_dim=0, backward_scale=1.0, reduction="mean", **options):
    """One training step's records: backward of ``backward_scale`` x the batch-mean loss (the
    batch-sum with ``reduction="sum"``)."""
    with unnorm.record_gns(model, example_dim=example_dim, reduction=reduction, **options) as recorder:
        losses = _losses(model(x), target) if example_dim == 0 else \
            _losses(model(x).transpose(0, 1), target)
        (getattr(losses, reduction)() * backward_scale).backward()
        return recorder.flush()


def _check(records: dict, per_example: dict[str, torch.Tensor], count: int) -> None:
    """Records against exact per-example gradients ``(B, P)`` of each layer's affine
    parameters: |g_i|^2 per example, |mean_i g_i|^2 for the batch, the example count."""
    assert set(records) == set(per_example)
    for name, grads in per_example.items():
        record = records[name]
        torch.testing.assert_close(record["example_sq"][0].double(), grads.square().sum(dim=1),
                                   rtol=1e-5, atol=1e-12)
        torch.testing.assert_close(record["batch_sq"][0].double(),
                                   grads[:count].mean(dim=0).square().sum(), rtol=1e-5, atol=1e-12)
        assert record["examples"].tolist() == [count]


@pytest.mark.parametrize("norm", AFFINE_NORMS)
def test_tap_gives_each_examples_gradient_of_its_own_loss(norm):
    """Against grad(l_i) of each example's loss, taken by autograd through the same batch
    forward (a copy of the model). For a norm whose training output mixes examples (batch
    statistics) that is what per-example means: l_i's gradient with the batch's statistics;
    it equals the tap's split of the batch gradient by rows because nothing after the norm
    mixes examples. The tap recording g_i = B c_i is the loss scaling: dy is the batch-mean
    loss's gradient, so each example's own contribution c_i is grad(l_i) / B."""
    torch.manual_seed(0)
    model = _model(norm)
    reference = copy.deepcopy(model)
    x, target = torch.randn(B, T, C, dtype=torch.float64), torch.randn(B, T, C, dtype=torch.float64)
    records = _record(model, x, target)
    losses = _losses(reference(x), target)
    exact = {name: torch.stack([_flat_grad(losses[i], params) for i in range(B)])
             for name, params in _norm_params(reference).items()}
    _check(records, exact, B)
    assert all(grads.abs().sum(dim=1).min() > 0 for grads in exact.values())  # not vacuous


def test_per_position_norms_match_separate_backward_passes_per_example():
    """LayerNorm (two layers, their records separate): each example run alone, its own
    forward and backward, gives the gradient the tap recorded from the whole batch."""
    torch.manual_seed(0)
    model = _model("ln", layers=2)
    alone = copy.deepcopy(model)
    x, target = torch.randn(B, T, C, dtype=torch.float64), torch.randn(B, T, C, dtype=torch.float64)
    records = _record(model, x, target)
    params = _norm_params(alone)
    exact = {name: [] for name in params}
    for i in range(B):
        loss = _losses(alone(x[i:i + 1]), target[i:i + 1]).sum()
        for name, layer_params in params.items():
            exact[name].append(_flat_grad(loss, layer_params))
    _check(records, {name: torch.stack(grads) for name, grads in exact.items()}, B)


def test_the_example_axis_is_found_in_every_layout():
    """Time-first (T, B, C) told example_dim=1, and image-like (B, H, W, C), give the records
    of the batch-first (B, T, C) layout of the same examples."""
    torch.manual_seed(0)
    model = _model("ln")
    x, target = torch.randn(B, 2 * T, C, dtype=torch.float64), torch.randn(B, 2 * T, C, dtype=torch.float64)
    batch_first = _record(copy.deepcopy(model), x, target)
    time_first = _record(copy.deepcopy(model), x.transpose(0, 1), target, example_dim=1)
    image = _record(copy.deepcopy(model), x.reshape(B, 2, T, C), target.reshape(B, 2, T, C))
    for other in (time_first, image):
        for key, value in batch_first["1"].items():
            torch.testing.assert_close(other["1"][key], value, rtol=1e-5, atol=0)
    # told the wrong axis, the same tap sees other examples
    wrong = _record(copy.deepcopy(model), x.transpose(0, 1), target.transpose(0, 1))
    assert wrong["1"]["examples"].tolist() == [2 * T]


@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_padding_counts_as_no_example(reduction):
    """Padded rows add nothing and an all-padding example is no example: the count is the
    examples with a valid row, and each real example's record is the gradient of its loss
    over its valid positions, computed alone on those positions. The loss backpropagated is
    the real examples' mean, or (fairseq's criteria) their sum: the records are the same."""
    torch.manual_seed(0)
    lengths = [3, 1, 2, 0]  # the last example is all padding
    norm = unnorm.build_norm("ln", C).double()
    first, last = torch.nn.Linear(C, C).double(), torch.nn.Linear(C, C).double()
    x = torch.randn(B, T, C, dtype=torch.float64)
    pad = torch.arange(T)[None, :] >= torch.tensor(lengths)[:, None]  # (B, T), True = padding
    x = torch.where(pad[..., None], torch.full_like(x, 1e6), x)  # junk where padded
    target = torch.randn(B, T, C, dtype=torch.float64)
    real = [i for i, n in enumerate(lengths) if n]

    def forward(inputs, mask):
        return last(norm(first(inputs), pad_mask=mask))

    with unnorm.record_gns(torch.nn.Sequential(norm), example_dim=0, reduction=reduction) as recorder:
        errors = (forward(x, pad) - target).square().mean(dim=-1)  # (B, T)
        per_example = torch.where(pad, 0.0, errors).sum(dim=1) / torch.tensor(lengths).clamp_min(1)
        getattr(per_example[real], reduction)().backward()
        records = recorder.flush()
    params = list(norm.affine_parameters().values())
    exact = [_flat_grad((forward(x[i:i + 1, :n], None) - target[i:i + 1, :n]).square().mean(), params)
             for i, n in enumerate(lengths) if n] + [torch.zeros(2 * C, dtype=torch.float64)]
    _check({"0": records["0"]}, {"0": torch.stack(exact)}, len(real))


def test_loss_scale_and_accumulation_are_divided_out():
    """A backward of the loss x 64 under an AMP loss scale of 64, and one of the loss / 2 with
    loss_multiplier=0.5 (gradient accumulation over two micro-batches), record what the
    plain backward does: the micro-batch's mean loss's units."""
    torch.manual_seed(0)
    model = _model("un")
    x, target = torch.randn(B, T, C, dtype=torch.float64), torch.randn(B, T, C, dtype=torch.float64)
    plain = _record(copy.deepcopy(model), x, target)
    scaled = copy.deepcopy(model)
    unnorm.LossScaleGuard(scaled).begin_update(64.0)
    amp = _record(scaled, x, target, backward_scale=64.0)
    accumulated = _record(copy.deepcopy(model), x, target, backward_scale=0.5, loss_multiplier=0.5)
    for other in (amp, accumulated):
        for key, value in plain["1"].items():
            torch.testing.assert_close(other["1"][key], value, rtol=1e-6, atol=0)


@pytest.mark.parametrize("norm", AFFINE_NORMS)
def test_a_summed_loss_records_what_the_mean_loss_does(norm):
    """reduction="sum" with a backward of sum_i l_i = B x the mean loss (time-first, as fairseq
    trains) records the per-example and batch gradient norms that reduction="mean" records
    for the mean loss: the records mean the same under both."""
    torch.manual_seed(0)
    model = _model(norm)
    x, target = torch.randn(T, B, C, dtype=torch.float64), torch.randn(B, T, C, dtype=torch.float64)
    mean = _record(copy.deepcopy(model), x, target, example_dim=1)
    summed = _record(copy.deepcopy(model), x, target, example_dim=1, reduction="sum")
    assert set(summed) == set(mean)
    for name, values in mean.items():
        assert values["batch_sq"].item() > 0
        for key, value in values.items():
            torch.testing.assert_close(summed[name][key], value, rtol=1e-6, atol=0)


def test_a_skipped_updates_steps_are_dropped():
    """An update the loss-scale guard ends as skipped leaves no records: the records are those
    of the updates taken."""
    torch.manual_seed(0)
    model = _model("ln")
    x, target = torch.randn(B, T, C, dtype=torch.float64), torch.randn(B, T, C, dtype=torch.float64)
    taken = _record(copy.deepcopy(model), x, target)
    guard = unnorm.LossScaleGuard(model)
    with unnorm.record_gns(model, example_dim=0) as recorder:
        for scale, skipped in ((1.0, False), (2.0, True), (4.0, True)):
            guard.begin_update(scale)
            (_losses(model(x), target).mean() * scale).backward()
            guard.end_update(skipped)
        records = recorder.flush()
    for key, value in taken["1"].items():
        assert torch.equal(records["1"][key], value)


def test_bad_settings_fail_naming_the_fix():
    model = _model("ln")
    with pytest.raises(ValueError, match="record_gns needs example_dim"):
        unnorm.record_gns(model)
    with pytest.raises(ValueError, match="1/accumulate"):
        unnorm.record_gns(model, example_dim=0, loss_multiplier=0)
    with pytest.raises(ValueError, match="reduction must be one of 'mean', 'sum'.*got 'none'"):
        unnorm.record_gns(model, example_dim=0, reduction="none")
    with unnorm.record_gns(model, example_dim=0):
        with pytest.raises(RuntimeError, match="already being recorded"):
            unnorm.record_gns(model, example_dim=0)
        with pytest.raises(ValueError, match=r"example_dim=\.\.\.\) must name the batch axis"):
            model(torch.randn(C, dtype=torch.float64))  # one row: no axis holds examples
    assert all(m._gns is None for m in model.modules() if isinstance(m, unnorm.ChannelNorm))


@pytest.mark.parametrize("norm", sorted(set(unnorm.available_norms()) - set(AFFINE_NORMS)))
def test_a_model_of_norms_without_affine_parameters_is_refused(norm):
    with pytest.raises(ValueError, match="no unnorm norm with trainable affine parameters.*"
                                         "nonorm has none"):
        unnorm.record_gns(torch.nn.Sequential(unnorm.build_norm(norm, C)), example_dim=0)


def test_recording_is_off_by_default():
    assert config().record_gns is False
    assert unnorm.build_norm("ln", C)._gns is None


def _within_standard_errors(samples: np.ndarray, truth: float, errors: float = 4.0) -> None:
    """The mean of ``samples`` is ``truth`` within ``errors`` standard errors."""
    error = samples.std(ddof=1) / np.sqrt(len(samples))
    assert abs(samples.mean() - truth) < errors * error, (samples.mean(), truth, error)


def test_estimator_recovers_a_known_noise_scale():
    """Per-example gradients g_i = G + e_i, e_i ~ N(0, diag(s^2)), B = 8: both estimates are
    unbiased (their means over 4000 steps within 4 standard errors of |G|^2 and tr(Sigma)),
    and the smoothed B_simple (alpha 0.999, about 1000 steps of memory) ends within 10% of
    tr(Sigma) / |G|^2 = 12.5 (its relative standard error there is about 3%)."""
    rng = np.random.default_rng(0)
    steps, batch, dims = 4000, 8, 20
    mean = np.full(dims, 0.4)
    scales = np.linspace(0.5, 1.5, dims)
    g = mean + rng.normal(size=(steps, batch, dims)) * scales
    small, big = np.square(g).sum(-1).mean(-1), np.square(g.mean(1)).sum(-1)
    count = np.full(steps, batch)
    g2, trace = unbiased_estimates(small, big, count)
    _within_standard_errors(g2, np.square(mean).sum())
    _within_standard_errors(trace, np.square(scales).sum())
    truth = np.square(scales).sum() / np.square(mean).sum()
    result = noise_scale(small, big, count, alpha=0.999)
    assert abs(result["b_simple"][-1] / truth - 1) < 0.10
    assert result["dropped"] == {"non_finite": 0, "fewer_than_two_examples": 0}


def test_tap_and_estimator_recover_a_least_squares_noise_scale():
    """Least squares through a LayerNorm's affine: pred = (weight * z + bias) . r, loss
    (pred - y)^2 / 2, with z = LN(x) and a fixed readout r. Over a data set of 64 points
    sampled with replacement, g_j = (pred_j - y_j) (z_j r, r), so G and Sigma are the data's
    mean and covariance of g_j (numpy, from the data alone). 3000 batches of 8 recorded by
    the tap and estimated: both estimates unbiased within 4 standard errors, and the
    smoothed B_simple within 10% of tr(Sigma) / |G|^2."""
    rng = np.random.default_rng(1)
    points, batch, steps = 64, 8, 3000
    data_x, data_y, readout = rng.normal(size=(points, C)), rng.normal(size=points), rng.normal(size=C)
    z = (data_x - data_x.mean(1, keepdims=True)) / np.sqrt(data_x.var(1, keepdims=True) + 1e-5)
    residual = z @ readout - data_y  # weight 1, bias 0
    g = residual[:, None] * np.concatenate([z * readout, np.broadcast_to(readout, z.shape)], axis=1)
    grad = g.mean(0)
    trace = np.square(g - grad).sum(1).mean()

    norm = unnorm.build_norm("ln", C).double()
    model = torch.nn.Sequential(norm)
    r = torch.from_numpy(readout)
    inputs, targets = torch.from_numpy(data_x), torch.from_numpy(data_y)
    with unnorm.record_gns(model, example_dim=0) as recorder:
        for index in torch.from_numpy(rng.integers(points, size=(steps, batch))):
            pred = model(inputs[index]) @ r  # (batch, C) rows: each one example
            ((pred - targets[index]).square() / 2).mean().backward()
        records = recorder.flush()
    small, big, count = step_norms(records)
    assert count.tolist() == [batch] * steps
    g2, trace_estimate = unbiased_estimates(small, big, count)
    _within_standard_errors(g2, np.square(grad).sum())
    _within_standard_errors(trace_estimate, trace)
    result = noise_scale(small, big, count, alpha=0.999)
    assert abs(result["b_simple"][-1] / (trace / np.square(grad).sum()) - 1) < 0.10


def test_classification_run_writes_records_that_analysis_reads(tmp_path):
    """Three updates of Swin-T (LN) with record_gns=true: gns/epoch_0001.pt has one record
    per update for every norm of the model, and ``python -m analysis.gns`` turns them into
    gns.json and gns.png (|G_small|^2 >= |G_big|^2 at every step: a mean of squares is at
    least the square of the mean)."""
    result = train(config("+exp=swin_t_ln", *QUICK, "record_gns=true"), tmp_path)
    assert result["status"] in ("ok", "chance") and result["steps"] == 3
    batch = OmegaConf.load(tmp_path / "config.yaml").recipe.batch_size  # as the CPU scale set it
    saved = torch.load(tmp_path / "gns" / "epoch_0001.pt", weights_only=True)
    assert {k: saved[k] for k in ("batch_size", "accumulate", "replicas")} == {
        "batch_size": batch, "accumulate": 1, "replicas": 1}
    model_norms = {name for name, m in model_from_config(OmegaConf.load(tmp_path / "config.yaml"))
                   .named_modules() if isinstance(m, unnorm.ChannelNorm)}
    assert set(saved["layers"]) == model_norms
    assert all(values["examples"].tolist() == [batch] * 3 and values["example_sq"].shape == (3, batch)
               for values in saved["layers"].values())
    proc = subprocess.run([sys.executable, "-m", "analysis.gns", str(tmp_path), "--out",
                           str(tmp_path / "out")], cwd=ROOT, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    gns = json.loads((tmp_path / "out" / "gns.json").read_text())
    assert gns["records"] == gns["used"] == 3 and gns["batch"]["update"] == batch
    assert set(gns["layers"]) == set(saved["layers"])
    series = gns["series"]
    assert series["update"] == [1, 2, 3]
    assert all(small >= big > 0 for small, big in zip(series["small_sq"], series["big_sq"]))
    assert (tmp_path / "out" / "gns.png").stat().st_size > 10_000


def test_summary_reports_late_noise_scale_against_the_batch():
    """One number per run: the median of B_simple over the second half of the records (the
    first half, EMA start-up, left out), and the batch per update divided by it."""
    from analysis.gns import late_b_simple, summary
    result = {"series": {"b_simple": [1000.0, None, 5.0, 7.0, 9.0, None, 8.0, 6.0]},
              "batch": {"update": 14}}
    assert late_b_simple(result) == 8.0  # median of 9, 8, 6 (None dropped)
    assert "| run | 14 | 8 | 1.75 |" in summary({"run": result})
