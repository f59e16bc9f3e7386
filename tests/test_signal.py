"""Signal-propagation probes (``unnorm.signal``) against closed forms and against the
probes of "Beyond BatchNorm"'s release on the same tensors; the models' probe points
(``plugins.lm.signal``, ``plugins.timm.signal``)."""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from torch import nn

import unnorm
from unnorm.signal import activation_statistics, signal_propagation


# --- the release's probes, the oracle ----------------------------------------------------------
# Copied verbatim from EkdeepSLubana/BeyondBatchNorm, layer_defs.py, commit
# 23102a4da3bd2ad130daedd05cdbdf072c9eacd0 (classes Conv_prober and Activs_prober; NCHW maps).

### Conv_prober (i.e., probes activations and gradients from convolutional layers) ###
class Conv_prober(nn.Module):
    def __init__(self):
        super(Conv_prober, self).__init__()
        self.std_list = []
        # Grads
        self.grads_norms = []

        class sim_grads(torch.autograd.Function):
            @staticmethod
            def forward(ctx, input):
                self.std_list.append(input.std(dim=[0,2,3]).mean().item())
                return input.clone()

            @staticmethod
            def backward(ctx, grad_output):
                M = grad_output.view(grad_output.shape[0], -1)
                # Gradient Norms
                self.grads_norms.append(M.norm().item())
                M = (M / (torch.linalg.norm(M, dim=[1], keepdim=True)+1e-10))
                M = torch.matmul(M, M.T)
                return grad_output.clone()
            
        self.cal_prop = sim_grads.apply

    def forward(self, input):
        if not torch.is_grad_enabled():
            return input
        else:
            return self.cal_prop(input)


### Activs_prober (i.e., probes activations) ###
class Activs_prober(nn.Module):
    def __init__(self):
        super(Activs_prober, self).__init__()
        # Activs
        self.activs_norms = []
        self.activs_corr = []
        self.activs_ranks = []

        class sim_activs(torch.autograd.Function):
            @staticmethod
            def forward(ctx, input):
                M = input.clone()
                # Activation Variance
                avar = M.var(dim=[0,2,3], keepdim=True)
                self.activs_norms.append(avar.mean().item())
                anorms = torch.linalg.norm(M, dim=[1,2,3], keepdim=True)
                # self.activs_norms.append(anorms.mean().item())
                M = (M / anorms).reshape(M.shape[0], -1)
                M = torch.matmul(M, M.T) 
                # Activation Correlations
                self.activs_corr.append(((M.sum(dim=1) - 1) / (M.shape[0]-1)).mean().item())
                # Activation Ranks (calculates stable rank)
                tr = torch.diag(M).sum()
                opnom = torch.linalg.norm(M, ord=2)
                self.activs_ranks.append((tr / opnom).item())
                return input.clone()

            @staticmethod
            def backward(ctx, grad_output):
                return grad_output.clone()
            
        self.cal_prop = sim_activs.apply

    def forward(self, input):
        if not torch.is_grad_enabled():
            return input
        else:
            return self.cal_prop(input)

# --- end of the release's code -----------------------------------------------------------------


class ChannelsLast(nn.Module):
    """NCHW -> NHWC: the probe point our probes read channels-last."""

    def forward(self, x):
        return x.permute(0, 2, 3, 1)


class ChannelsFirst(nn.Module):
    def forward(self, x):
        return x.permute(0, 3, 1, 2)


def probed_cnn(seed=0):
    """A small residual-free CNN with the release's probers after each convolution and a
    channels-last probe point of ours before them (the same tensor, permuted)."""
    torch.manual_seed(seed)
    layers, points = [], {}
    channels = 3
    for i in range(3):
        conv = nn.Conv2d(channels, 8, 3, padding=1)
        last = ChannelsLast()
        layers += [conv, last, ChannelsFirst(), Activs_prober(), Conv_prober(),
                   nn.GroupNorm(2, 8), nn.ReLU()]
        points[f"conv{i}"] = last
        channels = 8
    return nn.Sequential(*layers, nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, 5)), points


def _release_norm(linalg_norm):
    """``torch.linalg.norm`` as the release's torch took it: a ``dim`` of three axes is the
    2-norm over them (``Activs_prober``'s per-sample norm; today's torch refuses three)."""
    def norm(x, *args, dim=None, keepdim=False, **kwargs):
        if dim is not None and len(dim) > 2:
            return torch.linalg.vector_norm(x, dim=dim, keepdim=keepdim)
        return linalg_norm(x, *args, dim=dim, keepdim=keepdim, **kwargs)
    return norm


def test_probes_equal_the_releases_probers_on_a_cnn(monkeypatch):
    """Activation variance, similarity, stable rank and gradient norm at each layer equal the
    release's ``Activs_prober`` and ``Conv_prober`` on the same tensors (float32 model,
    statistics ours in float64: relative 1e-5 covers float32's reductions over ~10^3 values)."""
    monkeypatch.setattr(torch.linalg, "norm", _release_norm(torch.linalg.norm))
    model, points = probed_cnn()
    x = torch.randn(6, 3, 8, 8)
    target = torch.randint(0, 5, (6,))
    records = signal_propagation(points, lambda: nn.functional.cross_entropy(model(x), target))
    assert all(p.grad is None for p in model.parameters())  # gradients of the points alone
    activs = [m for m in model if isinstance(m, Activs_prober)]
    grads = [m for m in model if isinstance(m, Conv_prober)]
    # the release's probers ran in the same forward; their backward needs its own pass
    nn.functional.cross_entropy(model(x), target).backward()
    assert [r["point"] for r in records] == ["conv0", "conv1", "conv2"]
    for record, activ, grad in zip(records, activs, grads):
        assert record["variance"] == pytest.approx(activ.activs_norms[0], rel=1e-5)
        assert record["similarity"] == pytest.approx(activ.activs_corr[0], rel=1e-5, abs=1e-6)
        assert record["stable_rank"] == pytest.approx(activ.activs_ranks[0], rel=1e-5)
        assert record["grad_norm"] == pytest.approx(grad.grads_norms[-1], rel=1e-5)


def test_identical_samples_have_similarity_one_and_stable_rank_one():
    x = torch.randn(1, 5, 7).expand(4, 5, 7)
    stats = activation_statistics(x)
    assert stats["similarity"] == pytest.approx(1.0, abs=1e-12)
    assert stats["stable_rank"] == pytest.approx(1.0, abs=1e-12)


def test_orthogonal_samples_have_similarity_zero_and_full_stable_rank():
    """B samples along orthogonal directions, of different norms: similarity 0; the Gram of
    the unit rows is the identity, stable rank B."""
    basis = torch.linalg.qr(torch.randn(12, 12, dtype=torch.float64))[0][:4]
    x = (basis * torch.tensor([[1.0], [3.0], [0.5], [2.0]], dtype=torch.float64)).reshape(4, 3, 4)
    stats = activation_statistics(x)
    assert stats["similarity"] == pytest.approx(0.0, abs=1e-12)
    assert stats["stable_rank"] == pytest.approx(4.0, abs=1e-12)


def test_a_rank_one_batch_has_stable_rank_one():
    """Every sample a positive multiple of one vector: rank one whatever the scales."""
    x = torch.tensor([0.5, 2.0, 7.0], dtype=torch.float64)[:, None, None] * torch.randn(1, 6, 5)
    assert activation_statistics(x)["stable_rank"] == pytest.approx(1.0, abs=1e-12)


def test_stable_rank_is_frobenius_over_spectral_norm_squared():
    """trace(G) / ||G||_2 of the unit rows' Gram is ||U||_F^2 / ||U||_2^2 (U the unit rows),
    the usual stable rank, by the singular values of U."""
    x = torch.randn(5, 3, 4, dtype=torch.float64)
    unit = x.reshape(5, -1) / x.reshape(5, -1).norm(dim=1, keepdim=True)
    singular = torch.linalg.svdvals(unit)
    want = (singular.square().sum() / singular[0].square()).item()
    assert activation_statistics(x)["stable_rank"] == pytest.approx(want, rel=1e-12)


def test_variance_is_each_channels_variance_over_batch_and_positions():
    """Channel c holds ``scale_c * (+-1)`` with as many of each sign over batch and positions:
    its unbiased variance is ``scale_c^2 n / (n - 1)``; the probe averages over channels."""
    scales = torch.tensor([1.0, 2.0, 3.0], dtype=torch.float64)
    signs = torch.tensor([1.0, -1.0], dtype=torch.float64).repeat(4 * 5 // 2).reshape(4, 5, 1)
    x = signs * scales
    n = 20
    want = (scales.square() * n / (n - 1)).mean().item()
    assert activation_statistics(x)["variance"] == pytest.approx(want, rel=1e-12)


def test_token_similarity_is_between_one_examples_tokens():
    """Every token of an example equal: token similarity 1, whatever the examples are;
    a token and its negation: -1."""
    x = torch.randn(3, 1, 6).expand(3, 4, 6)
    stats = activation_statistics(x)
    assert stats["token_similarity"] == pytest.approx(1.0, abs=1e-12)
    assert stats["similarity"] < 0.99
    pair = torch.randn(2, 1, 6)
    assert activation_statistics(torch.cat([pair, -pair], 1))["token_similarity"] == \
        pytest.approx(-1.0, abs=1e-12)
    assert activation_statistics(torch.randn(3, 6))["token_similarity"] is None


def test_gradient_norm_is_the_norm_of_dloss_dactivation_and_leaves_parameters_alone():
    """loss = sum(2 w * h) over B = 3 rows: dL/dh = 2 w in each row, of norm 2 ||w|| sqrt(B),
    at the identity's output and at the linear layer's before it; no parameter's .grad."""
    lin = nn.Linear(4, 4).double()
    double = nn.Identity()
    w = torch.randn(4, dtype=torch.float64)
    x = torch.randn(3, 4, dtype=torch.float64)

    class Twice(nn.Module):
        def forward(self, h):
            return 2 * double(h)

    twice = Twice()
    records = signal_propagation({"lin": lin, "double": double},
                                 lambda: (twice(lin(x)) * w).sum())
    assert records[1]["grad_norm"] == pytest.approx(2 * w.norm().item() * math.sqrt(3), rel=1e-12)
    assert records[0]["grad_norm"] == pytest.approx(records[1]["grad_norm"], rel=1e-12)
    assert lin.weight.grad is None


def test_bad_input_is_refused_naming_the_fix():
    with pytest.raises(ValueError, match="B >= 2"):
        activation_statistics(torch.randn(1, 4, 3))
    lin = nn.Linear(3, 3)
    with pytest.raises(RuntimeError, match="not reached"):
        signal_propagation({"a": lin, "b": nn.Linear(3, 3)}, lambda: lin(torch.randn(2, 3)).sum())
    with pytest.raises(RuntimeError, match="ran twice"):
        signal_propagation({"a": lin}, lambda: lin(lin(torch.randn(2, 3))).sum())
    with pytest.raises(ValueError, match="no probe points"):
        signal_propagation({}, lambda: torch.zeros(()))


@pytest.mark.parametrize("placement", ["pre", "post", "peri", "mix"])
def test_language_model_probes_every_block_of_each_placement(placement):
    """One record per decoder layer, in depth order; the gradient reaches the first layer;
    the LM's Post placement keeps each block's output at unit variance (its last norm's)."""
    from plugins.lm.signal import probe_setup
    points, loss = probe_setup({"name": "gn", "groups": 4}, placement=placement, depth=4,
                               width=16, batch=3, context=5, seed=0)
    records = signal_propagation(points, loss)
    assert [r["point"] for r in records] == [f"layers.{i}" for i in range(4)]
    assert all(r["grad_norm"] > 0 and math.isfinite(r["variance"]) for r in records)
    if placement == "post":  # per-token GroupNorm last: each token's channels at variance ~1
        assert all(r["variance"] == pytest.approx(1.0, abs=0.2) for r in records)


@pytest.mark.parametrize("model", ["t2t_vit", "swin_t"])
def test_vision_models_probe_every_block(model):
    from plugins.timm.signal import probe_setup
    points, loss = probe_setup({"name": "ln"}, model=model, depth=7, width=16, batch=2, seed=0)
    records = signal_propagation(points, loss)
    assert len(records) == 7 and all(r["grad_norm"] > 0 for r in records)
    with pytest.raises(ValueError, match="depth must be 7"):
        probe_setup({"name": "ln"}, model="swin_t", depth=4, width=16, batch=2, seed=0)


def test_growth_exponent_is_the_power_of_the_variance_against_depth():
    """analysis.signal: variance c l^k over blocks l = 1..L gives exponent k (linear 1, flat 0,
    quadratic 2), whatever c."""
    from analysis.signal import growth_exponent
    blocks = np.arange(1, 49)
    assert growth_exponent(3.0 * blocks) == pytest.approx(1.0, abs=1e-12)
    assert growth_exponent(np.full(48, 2.0)) == pytest.approx(0.0, abs=1e-12)
    assert growth_exponent(blocks ** 2.0) == pytest.approx(2.0, abs=1e-12)
