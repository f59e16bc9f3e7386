"""BCN, EvoNorm-B0/S0 and SepNorm against independent references: references written from the
releases' formulas (BCN: joe-siyuan-qiao/Batch-Channel-Normalization ``imagenet/models/layers.py``
``GN`` and the README's ``EstBN``; EvoNorm: tensorflow/tpu ``resnet_model.py``; SepNorm:
tufts-ml/SepNorm's ``SepNorm``), timm's ``EvoNorm2dB0``/``EvoNorm2dS0`` and torch's own
layers; the token layout (``unnorm.sample``), causality, padding and the guards of BCN's
micro-batch estimates. The shared tests (test_norms' ``STATEFUL``/``QUICK_OPTIONS``) add the
calling contract, casts, loss scaling, accumulation, compilation and 2 gloo replicas."""
from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from timm.layers import EvoNorm2dB0, EvoNorm2dS0

import unnorm
from test_causal_norms import prefix_reference
from test_norms import make_sequence, module_step
from test_reliability import bad_step, state, train_step
from test_scale_path import _scaler, _train

B, T, C, G = 3, 5, 12, 4


def tokens(seed=0, shape=(B, T, C), scale=2.0, shift=0.5):
    gen = torch.Generator().manual_seed(seed)
    channel = torch.linspace(0.5, 2.0, shape[-1], dtype=torch.float64)
    return torch.randn(shape, generator=gen, dtype=torch.float64) * channel * scale + shift


def randomized(module, seed=1):
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in module.parameters():
            param.add_(0.3 * torch.randn(param.shape, generator=gen, dtype=param.dtype))
    return module


def grads(out, inputs, seed=2):
    dy = torch.randn(out.shape, generator=torch.Generator().manual_seed(seed), dtype=out.dtype)
    return torch.autograd.grad(out, inputs, dy)


def close(a, b, tol=1e-9):
    torch.testing.assert_close(a, b, rtol=tol, atol=tol)


# --- BCN --------------------------------------------------------------------------------------

class ReleaseBCN(torch.nn.Module):
    """The release's ``GN`` (BCN) on NCHW input, written from its formulas: torch's
    BatchNorm2d (momentum 0.1, its own affine), then ``F.group_norm`` without affine, then the
    per-group affine; ``estimate``: the README's EstBN (moving speed ms) in place of the BN."""

    def __init__(self, channels, groups, eps=1e-5, estimate_speed=None):
        super().__init__()
        self.groups, self.eps, self.speed = groups, eps, estimate_speed
        self.bn = torch.nn.BatchNorm2d(channels, eps=eps).double()
        self.weight = torch.nn.Parameter(torch.ones(1, groups, 1, dtype=torch.float64))
        self.bias = torch.nn.Parameter(torch.zeros(1, groups, 1, dtype=torch.float64))

    def est_bn(self, x):
        if self.training:
            with torch.no_grad():
                flat = x.transpose(0, 1).reshape(x.shape[1], -1)
                mean = flat.mean(dim=1)
                var = ((flat - self.bn.running_mean[:, None]) ** 2).mean(dim=1)
                self.bn.running_mean.mul_(1 - self.speed).add_(self.speed * mean)
                self.bn.running_var.mul_(1 - self.speed).add_(self.speed * var)
        shape = (1, -1, 1, 1)
        out = (x - self.bn.running_mean.view(shape)) / torch.sqrt(self.bn.running_var.view(shape) + 1e-5)
        return out * self.bn.weight.view(shape) + self.bn.bias.view(shape)

    def forward(self, x):
        out = self.bn(x) if self.speed is None else self.est_bn(x)
        out = F.group_norm(out, self.groups, eps=self.eps)
        out = out.reshape(x.shape[0], self.groups, -1) * self.weight + self.bias
        return out.reshape(x.shape)


def load_bcn(ours, release):
    with torch.no_grad():
        release.bn.weight.copy_(ours.weight)
        release.bn.bias.copy_(ours.bias)
        release.weight.copy_(ours.group_weight.reshape(1, -1, 1))
        release.bias.copy_(ours.group_bias.reshape(1, -1, 1))


@pytest.mark.parametrize("layout", ["token", "image"])
@pytest.mark.parametrize("estimate", [False, True])
def test_bcn_is_the_release_per_token_and_per_image(layout, estimate):
    """Per token, the release run on ``x.reshape(B*T, C, 1, 1)``; per image, on the NCHW map
    of a (B, H, W, C) input. Outputs, every gradient, the running statistics (BatchNorm2d's:
    momentum 0.1 is our 0.9, unbiased variance; EstBN's: biased, ms = 1 - momentum) and
    evaluation, over several steps."""
    ours = randomized(unnorm.build_norm("bcn", C, groups=G, momentum=0.8, estimate=estimate,
                                        layout=layout).double())
    release = ReleaseBCN(C, G, estimate_speed=0.2 if estimate else None)
    release.bn.momentum = 0.2
    load_bcn(ours, release)
    shape = (B, 2, 3, C)  # (B, H, W, C) maps; per token each position is its own sample
    for step in range(4):
        x = tokens(step, shape).requires_grad_(True)
        nchw = x.reshape(-1, C, 1, 1) if layout == "token" else x.permute(0, 3, 1, 2)
        y = ours(x)
        want = release(nchw)
        want = want.reshape(shape) if layout == "token" else want.permute(0, 2, 3, 1)
        close(y, want)
        mine = grads(y, [x, ours.weight, ours.bias, ours.group_weight, ours.group_bias])
        theirs = grads(want, [x, release.bn.weight, release.bn.bias, release.weight, release.bias])
        for a, b in zip(mine, theirs):
            close(a, b.reshape(a.shape))
    close(ours.running_mean, release.bn.running_mean)
    close(ours.running_var, release.bn.running_var)
    ours.eval(), release.eval()
    x = tokens(9, shape)
    nchw = x.reshape(-1, C, 1, 1) if layout == "token" else x.permute(0, 3, 1, 2)
    want = release(nchw)
    close(ours(x), want.reshape(shape) if layout == "token" else want.permute(0, 2, 3, 1))


def test_bcn_image_layout_with_padding_pools_each_examples_valid_positions():
    """BN over the batch's valid positions (torch's BatchNorm1d on them), then each example's
    groups over its own valid positions (``F.group_norm`` on them alone)."""
    norm = randomized(unnorm.build_norm("bcn", C, groups=G, layout="image").double())
    pad = torch.zeros(B, T, dtype=torch.bool)
    pad[0, 3:] = pad[2, 1:] = True
    x = tokens().masked_fill(pad[..., None], 1e6).requires_grad_(True)
    y = norm(x, pad)
    bn = torch.nn.BatchNorm1d(C).double()
    with torch.no_grad():
        bn.weight.copy_(norm.weight)
        bn.bias.copy_(norm.bias)
    h = bn(x[~pad])
    lengths = (~pad).sum(dim=1).tolist()
    normed = [F.group_norm(part.T[None], G, eps=1e-5)[0].T for part in h.split(lengths)]
    size = C // G
    want = torch.cat(normed) * norm.group_weight.repeat_interleave(size) \
        + norm.group_bias.repeat_interleave(size)
    close(y[~pad], want)
    dy = torch.randn(B, T, C, dtype=torch.float64, generator=torch.Generator().manual_seed(3))
    mine = torch.autograd.grad(y, x, dy)[0]  # the padding's own gradient does not leak
    theirs = torch.autograd.grad(want, x, dy[~pad])[0]
    close(mine[~pad], theirs[~pad])


@pytest.mark.parametrize("name", ["bcn", "evonorm_b0", "evonorm_s0"])
def test_per_image_statistics_see_no_padding(name):
    """layout="image" (the shared padding test runs "token"): whatever sits at padded
    positions (0, 1e6, inf), the valid outputs, their input gradients and the state agree."""
    pad = torch.zeros(3, 5, dtype=torch.bool)
    pad[0, 3:] = pad[2, 1:] = True
    runs = []
    for value in (0.0, 1e6, float("inf")):
        norm = randomized(unnorm.build_norm(name, 6, layout="image", groups=1)
                          if name != "evonorm_b0" else unnorm.build_norm(name, 6, layout="image"))
        outputs = []
        for x, dy in zip(*make_sequence(4, spikes={})):
            y, dx, _, _ = module_step(norm, x.masked_fill(pad[..., None], value), dy, pad_mask=pad)
            outputs.append((y[~pad], dx[~pad]))
        runs.append((outputs, {k: v.clone() for k, v in norm.state_dict().items()}))
    for outputs, final in runs[1:]:
        for (a, da), (b, db) in zip(runs[0][0], outputs):
            torch.testing.assert_close(b, a)
            torch.testing.assert_close(db, da)
        for key, value in runs[0][1].items():
            torch.testing.assert_close(final[key], value)


def test_causal_bcn_is_causal_bn_then_each_tokens_groups_and_sees_nothing_later():
    b, t, c = 4, 7, 5  # test_causal_norms' prefix_reference shape
    for estimate in (False, True):
        norm = randomized(unnorm.build_norm("bcn", c, causal=True, positions=t,
                                            estimate=estimate).double())
        assert norm.groups == 1  # 5 channels: one group of five
        x = tokens(0, (b, t, c), scale=3.0, shift=2.0)
        changed = x.clone()
        changed[:, 4:] = torch.randn(b, t - 4, c, dtype=torch.float64) * 10
        twin = copy.deepcopy(norm)  # estimates: the same state before the call
        torch.testing.assert_close(twin(changed)[:, :4], norm(x)[:, :4], rtol=0, atol=1e-12)
        if not estimate:
            fresh = randomized(unnorm.build_norm("bcn", c, causal=True, positions=t).double())
            h = prefix_reference(x, fresh.weight, fresh.bias, fresh.eps)
            want = F.layer_norm(h, (c,), eps=1e-5) * fresh.group_weight + fresh.group_bias
            close(fresh(x), want)


def test_bcn_options_and_refusals_name_the_alternative():
    norm = unnorm.build_norm("bcn", 24)
    assert norm.groups == 12 and not norm.offline and not unnorm.is_offline("bcn")
    assert unnorm.build_norm("bcn", 96).groups == 32
    assert unnorm.build_norm("bcn", 24, groups=5).groups == 4  # the largest divisor below
    assert unnorm.build_norm("bcn", 24, layout="image").groups == 24  # one channel over positions
    assert unnorm.build_norm("bcn", 8, eps=1e-3).group_eps == 1e-3
    assert unnorm.build_norm("bcn", 8, group_eps=1e-6).group_eps == 1e-6
    with pytest.raises(ValueError, match="layout='image' pools .* cannot be causal.*layout='token'"):
        unnorm.build_norm("bcn", 8, layout="image", causal=True, positions=4)
    with pytest.raises(ValueError, match="group of two.*layout='image'"):
        unnorm.build_norm("bcn", 1)
    with pytest.raises(ValueError, match="position axis.*layout='token'"):
        unnorm.build_norm("bcn", 8, layout="image")(torch.randn(4, 8))
    with pytest.raises(ValueError, match="layout must be one of"):
        unnorm.build_norm("evonorm_s0", 8, layout="channel")
    with pytest.raises(RuntimeError, match="online"):
        unnorm.build_norm("bcn", 8).eval().inference_affine()
    with pytest.raises(ValueError, match="online"):
        unnorm.to_affine(unnorm.build_norm("bcn", 8).eval())


def test_grouping_in_another_order_is_grouping_the_permuted_channels():
    """``group_channels_as`` (mmdet's patch merging): the norm on channels stored in another
    order computes what it computes on them in the grouping order."""
    order = torch.randperm(C, generator=torch.Generator().manual_seed(0))
    for name in ("bcn", "evonorm_s0"):
        plain = randomized(unnorm.build_norm(name, C, groups=G).double())
        stored = unnorm.build_norm(name, C, groups=G).double()
        stored.load_state_dict({k: v[order] if v.shape == (C,) else v
                                for k, v in plain.state_dict().items()})
        stored.group_channels_as(order)  # stored channel c is channel order[c] of the groups
        x = tokens()
        close(stored(x[..., order]), plain(x)[..., order])


# --- BCN's micro-batch estimates under the guards (the shared tests run estimate=False) -------

def test_estimates_reject_a_bad_batch_and_train_on_as_without_it():
    for kind in ("nan_batch", "inf_gradient", "all_padding"):
        clean, hit = (unnorm.build_norm("bcn", 6, estimate=True) for _ in range(2))
        xs, dys = zip(*[(tokens(s, (3, 5, 6)).float(), tokens(s + 50, (3, 5, 6)).float())
                        for s in range(8)])
        for t, (x, dy) in enumerate(zip(xs, dys)):
            if t == 4:
                before = state(hit)
                bad_step(hit, kind, x, dy)
                assert all(torch.equal(state(hit)[k], v) for k, v in before.items()), kind
            for a, b in zip(train_step(clean, x, dy), train_step(hit, x, dy)):
                torch.testing.assert_close(b, a, rtol=0, atol=0)
        assert int(hit.num_rejected) == 1


@pytest.mark.parametrize("micro_batches", [1, 2])
def test_estimates_are_left_as_they_were_by_an_update_the_scaler_skips(micro_batches):
    def net():
        torch.manual_seed(0)
        return torch.nn.Sequential(torch.nn.Linear(8, 8), unnorm.build_norm("bcn", 8, estimate=True),
                                   torch.nn.GELU(), torch.nn.Linear(8, 3))
    batches = [tokens(s, (4, 5, 8)).float() for s in range(12)]
    skipped = 3
    guarded = net()
    scaler = _scaler(unnorm.GradScaler, guarded)
    got = _train(guarded, batches, scaler, overflow_steps=[(skipped + 1) * micro_batches - 1],
                 micro_batches=micro_batches)
    assert all(torch.equal(got[skipped][k], v) for k, v in got[skipped - 1].items())
    kept = [x for i, x in enumerate(batches)
            if not skipped * micro_batches <= i < (skipped + 1) * micro_batches]
    want = _train(net(), kept, micro_batches=micro_batches)
    for key, value in want[-1].items():
        torch.testing.assert_close(got[-1][key], value, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_estimates_stay_float32_under_a_module_cast(dtype):
    reference = unnorm.build_norm("bcn", 8, estimate=True)
    cast = unnorm.build_norm("bcn", 8, estimate=True).to(dtype)
    for s in range(5):
        x = tokens(s, (4, 5, 8)).to(dtype)
        y16, y32 = cast(x.requires_grad_(True)), reference(x.float().requires_grad_(True))
        torch.testing.assert_close(y16, y32.to(dtype), rtol=0, atol=0)
        y16.float().sum().backward()
        y32.sum().backward()
    assert cast.running_var.dtype == cast.running_mean.dtype == torch.float32
    torch.testing.assert_close(cast.running_var, reference.running_var, rtol=1e-6, atol=1e-7)


# --- EvoNorm-S0 -------------------------------------------------------------------------------

def copy_evonorm(ours, theirs):
    with torch.no_grad():
        for name in ("weight", "bias", "v"):
            getattr(theirs, name).copy_(getattr(ours, name))
    return theirs


def compare(ours, theirs, x, to_theirs, from_theirs, tol=2e-6):
    """Outputs and the gradients of x, weight, bias and v of ``ours`` on x and of
    ``theirs`` on ``to_theirs(x)`` (timm takes its statistics in float32 even of float64
    input: the tolerance is float32's)."""
    x = x.clone().requires_grad_(True)
    y, want = ours(x), from_theirs(theirs(to_theirs(x)))
    close(y, want, tol)
    params = ("weight", "bias", "v")
    mine = grads(y, [x, *(getattr(ours, p) for p in params)])
    timm = grads(want, [x, *(getattr(theirs, p) for p in params)])
    for a, b in zip(mine, timm):
        close(a, b, tol)


def per_token(x):
    return x.reshape(-1, x.shape[-1], 1, 1)


def nchw(x):
    return x.permute(0, 3, 1, 2)


def nhwc(y):
    return y.permute(0, 2, 3, 1)


@pytest.mark.parametrize("groups", [G, 5])
def test_s0_per_token_is_timm_on_each_token_as_a_1x1_map(groups):
    """A ``groups`` that does not divide C falls to the largest divisor below it, as the
    release's ``_group_std`` (timm asserts divisibility: it is given the resolved count)."""
    ours = randomized(unnorm.build_norm("evonorm_s0", C, groups=groups).double())
    theirs = copy_evonorm(ours, EvoNorm2dS0(C, groups=ours.groups).double())
    assert ours.groups == G
    x = tokens()
    compare(ours, theirs, x, per_token, lambda y: y.reshape(x.shape))


def test_s0_per_image_is_timm_on_the_nchw_map():
    ours = randomized(unnorm.build_norm("evonorm_s0", C, groups=3, layout="image").double())
    theirs = copy_evonorm(ours, EvoNorm2dS0(C, groups=3).double())
    compare(ours, theirs, tokens(0, (B, 2, 3, C)), nchw, nhwc)


def test_s0_is_the_release_formula_and_its_image_layout_ignores_padding():
    """x * sigmoid(v x) / sqrt(group variance + eps) * gamma + beta (tensorflow/tpu), each
    example's groups over its valid positions only."""
    norm = randomized(unnorm.build_norm("evonorm_s0", C, groups=3, layout="image").double())
    pad = torch.zeros(B, T, dtype=torch.bool)
    pad[1, 2:] = True
    x = tokens().masked_fill(pad[..., None], float("inf"))
    y = norm(x, pad)
    for i in range(B):
        valid = x[i][~pad[i]]  # (L, C)
        var = valid.reshape(-1, 3, C // 3).var(dim=(0, 2), unbiased=False).repeat_interleave(C // 3)
        want = valid * torch.sigmoid(norm.v * valid) / torch.sqrt(var + 1e-5) * norm.weight + norm.bias
        close(y[i][~pad[i]], want)


# --- EvoNorm-B0 -------------------------------------------------------------------------------

def test_b0_per_image_is_timm_with_the_releases_eps_and_timms_running_variance():
    """timm's EvoNorm2dB0 with eps=1e-5 (timm's default is 1e-3; the release's 1e-5) and
    ``unbiased_running_var=True`` (timm's n/(n-1); the release keeps it biased); momentum 0.1
    is our 0.9. Training steps, then evaluation from the running variance."""
    ours = randomized(unnorm.build_norm("evonorm_b0", C, layout="image",
                                        unbiased_running_var=True).double())
    theirs = copy_evonorm(ours, EvoNorm2dB0(C, eps=1e-5, momentum=0.1).double())
    assert EvoNorm2dB0(C).eps == 1e-3 and ours.eps == 1e-5
    for step in range(4):
        compare(ours, theirs, tokens(step, (B, 2, 3, C)), nchw, nhwc)
    close(ours.running_var, theirs.running_var, 2e-6)
    ours.eval(), theirs.eval()
    compare(ours, theirs, tokens(7, (B, 2, 3, C)), nchw, nhwc)


def release_b0(x, v, gamma, beta, moving_var, training, per_token, decay=0.9, eps=1e-5):
    """tensorflow/tpu's ``evonorm(layer='evonorm_b0')`` on channels-last (B, P, C) input:
    ``_batch_std`` (biased moments over batch and positions, the moving variance updated
    with ``decay``) and ``_instance_std`` (per token: over its channels)."""
    if training:
        var = x.reshape(-1, x.shape[-1]).var(dim=0, unbiased=False)
        moving_var = moving_var - (moving_var - var.detach()) * (1 - decay)
    else:
        var = moving_var
    left = torch.sqrt(var + eps)
    dims = (-1,) if per_token else (1,)
    instance = torch.sqrt(x.var(dim=dims, unbiased=False, keepdim=True) + eps)
    return x / torch.maximum(left, v * x + instance) * gamma + beta, moving_var


@pytest.mark.parametrize("layout", ["token", "image"])
def test_b0_is_the_release_formula_with_its_biased_moving_variance(layout):
    ours = randomized(unnorm.build_norm("evonorm_b0", C, layout=layout).double())
    moving = torch.ones(C, dtype=torch.float64)
    for step in range(5):
        x = tokens(step, scale=0.5 + step).requires_grad_(True)
        y = ours(x)
        want, moving = release_b0(x, ours.v, ours.weight, ours.bias, moving, True,
                                  layout == "token")
        close(y, want)
        for a, b in zip(grads(y, [x, ours.v]), grads(want, [x, ours.v])):
            close(a, b)
    close(ours.running_var, moving)
    ours.eval()
    x = tokens(8)
    close(ours(x), release_b0(x, ours.v, ours.weight, ours.bias, moving, False,
                              layout == "token")[0])


def test_b0_per_token_differs_from_timm_on_1x1_maps_only_in_the_instance_term():
    """timm on ``x.reshape(B*T, C, 1, 1)`` takes each channel of one position as the
    instance: variance 0, the term sqrt(eps). Per token we take the token's channels (see
    unnorm.sample); with that one term replaced, the two agree."""
    ours = randomized(unnorm.build_norm("evonorm_b0", C, unbiased_running_var=True).double())
    theirs = copy_evonorm(ours, EvoNorm2dB0(C, eps=1e-5, momentum=0.1).double())
    x = tokens()
    with torch.no_grad():
        timm = theirs(per_token(x)).reshape(x.shape)
        left = torch.sqrt(x.reshape(-1, C).var(dim=0, unbiased=False) + 1e-5)
        collapsed = x / torch.maximum(left, ours.v * x + 1e-5 ** 0.5) * ours.weight + ours.bias
        close(timm, collapsed, 2e-6)
        assert not torch.allclose(ours(x), timm)


def test_causal_b0_pools_the_batch_std_over_earlier_positions_only():
    b, t = 4, 7
    norm = randomized(unnorm.build_norm("evonorm_b0", C, causal=True, positions=t).double())
    x = tokens(0, (b, t, C))
    y = norm(x)
    prefix_var = torch.stack([x[:, :i + 1].reshape(-1, C).var(dim=0, unbiased=False)
                              for i in range(t)])  # (T, C)
    left = torch.sqrt(prefix_var + 1e-5)
    instance = torch.sqrt(x.var(dim=-1, unbiased=False, keepdim=True) + 1e-5)
    close(y, x / torch.maximum(left, norm.v * x + instance) * norm.weight + norm.bias)
    close(norm.running_var[:t], 0.9 + 0.1 * prefix_var)
    changed = x.clone()
    changed[:, 5:] *= 7
    twin = randomized(unnorm.build_norm("evonorm_b0", C, causal=True, positions=t).double())
    torch.testing.assert_close(twin(changed)[:, :5], y[:, :5], rtol=0, atol=1e-12)
    with pytest.raises(ValueError, match="cannot be causal"):
        unnorm.build_norm("evonorm_b0", C, causal=True, positions=t, layout="image")


@pytest.mark.parametrize("name", ["evonorm_b0", "evonorm_s0"])
def test_without_the_activation_evonorm_is_its_affine_and_folds(name):
    """The release's ``nonlinearity=False``: ``x * gamma + beta`` alone, no statistic (B0's
    moving variance untouched): offline, and it folds into the next linear layer."""
    norm = randomized(unnorm.build_norm(name, C, apply_act=False).double())
    assert norm.offline and unnorm.is_offline(name, apply_act=False) and norm.v is None
    assert unnorm.is_foldable(name, apply_act=False) and not unnorm.is_offline(name)
    assert unnorm.build_norm(name, C).offline is False
    x = tokens()
    close(norm(x), x * norm.weight + norm.bias)
    norm(x).sum().backward()
    if name == "evonorm_b0":
        assert torch.equal(norm.running_var, torch.ones(C))
    linear = torch.nn.Linear(C, 4).double()
    norm.eval()
    before = linear(norm(x))
    unnorm.fold_into_linear(norm, [linear])
    close(linear(x), before)
    with pytest.raises(RuntimeError, match="online.*apply_act=False"):
        unnorm.build_norm(name, C).eval().inference_affine()


# --- SepNorm ----------------------------------------------------------------------------------

class ReleaseSepNorm(torch.nn.Module):
    """tufts-ml/SepNorm's ``SepNorm``: BatchNorm1d on the (n, d) class states, LayerNorm on
    the other tokens, concatenated."""

    def __init__(self, hidden):
        super().__init__()
        self.cls_norm_layer = torch.nn.BatchNorm1d(hidden).double()
        self.tok_norm_layer = torch.nn.LayerNorm(hidden).double()

    def forward(self, x):
        n, length, d = x.shape
        cls_states, hidden_states = torch.split(x, [1, length - 1], dim=1)
        cls_states = self.cls_norm_layer(cls_states.reshape(n, d))[:, None, :]
        return torch.cat((cls_states, self.tok_norm_layer(hidden_states)), dim=1)


def test_sepnorm_is_the_release_bn_on_the_class_token_ln_on_the_rest():
    ours = unnorm.SeparateClassNorm(randomized(unnorm.build_norm("bn", C).double()),
                                    randomized(unnorm.build_norm("ln", C).double(), seed=4))
    release = ReleaseSepNorm(C)
    with torch.no_grad():
        for mine, theirs in ((ours.class_norm, release.cls_norm_layer),
                             (ours.token_norm, release.tok_norm_layer)):
            theirs.weight.copy_(mine.weight)
            theirs.bias.copy_(mine.bias)
    for step in range(3):
        x = tokens(step).requires_grad_(True)
        y, want = ours(x), release(x)
        close(y, want)
        mine = grads(y, [x, ours.class_norm.weight, ours.token_norm.weight])
        theirs = grads(want, [x, release.cls_norm_layer.weight, release.tok_norm_layer.weight])
        for a, b in zip(mine, theirs):
            close(a, b)
    close(ours.class_norm.running_var, release.cls_norm_layer.running_var)
    ours.eval(), release.eval()
    close(ours(tokens(5)), release(tokens(5)))


def test_sepnorm_splits_the_pad_mask_and_refuses_input_without_a_class_token():
    ours = unnorm.SeparateClassNorm(unnorm.build_norm("bcn", C), unnorm.build_norm("evonorm_b0", C))
    pad = torch.zeros(B, T, dtype=torch.bool)
    pad[0, 3:] = True
    x = tokens().float()
    y = ours(x, pad)
    torch.testing.assert_close(y[:, 1:][~pad[:, 1:]], ours.token_norm(x[:, 1:], pad[:, 1:])[~pad[:, 1:]])
    with pytest.raises(ValueError, match=r"\(B, N, C\) led by 1 class token.*Swin"):
        ours(x[:, :1])
    with pytest.raises(ValueError, match="class token"):
        ours(x.reshape(-1, C))


def test_separate_class_norms_wraps_the_chosen_norms_and_refuses_to_fold_them():
    model = torch.nn.Sequential(torch.nn.LayerNorm(C), torch.nn.Linear(C, C),
                                unnorm.build_norm("ln", C), torch.nn.Linear(C, C))
    assert unnorm.separate_class_norms(model, "bn", include="2") == 1
    assert isinstance(model[2], unnorm.SeparateClassNorm) and isinstance(model[0], torch.nn.LayerNorm)
    assert isinstance(model[2].class_norm, unnorm.BatchNorm)
    with pytest.raises(ValueError, match="matches no norm.*0, 2.class_norm|matches no norm"):
        unnorm.separate_class_norms(model, "bn", include="norm*")
    model(tokens().float()).sum().backward()
    model.eval()
    with pytest.raises(ValueError, match="separated norm cannot fold"):
        unnorm.fold_norms(model, {"2.class_norm": ["3"]}, probe=tokens())
    assert unnorm.fold_norms(model, {"2.class_norm": []}, probe=tokens()) == 1  # a frozen affine on its token


# --- Weight Standardization -------------------------------------------------------------------

def release_ws_conv(x, weight, bias):
    """Batch-Channel-Normalization's ``imagenet/models/layers.py`` ``Conv2d``: the unbiased
    variance, eps 1e-5 inside the square root."""
    centred = weight - weight.mean(dim=(1, 2, 3), keepdim=True)
    std = torch.pow(centred.reshape(weight.shape[0], -1).var(dim=1) + 1e-5, 0.5)
    return F.conv2d(x, centred / std.reshape(-1, 1, 1, 1), bias, padding=1)


def ws_conv(eps_form, eps=1e-5):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Conv2d(4, 6, 3, padding=1)).double()
    assert unnorm.standardize_weights(model, include="0", eps=eps, eps_form=eps_form) == 1
    return model[0]


@pytest.mark.parametrize("eps_form", ["var", "std", "biased_var"])
def test_weight_standardization_is_each_releases_form(eps_form):
    """var: the BCN release's layers.py; std: mmcv's ``conv_ws_2d`` (the README's, DeepLab's);
    biased_var: timm's ``StdConv2d`` (its eps 1e-6). Outputs and gradients of x, the raw
    weight and the bias."""
    from mmcv.cnn.bricks.conv_ws import conv_ws_2d
    from timm.layers import StdConv2d
    eps = 1e-6 if eps_form == "biased_var" else 1e-5
    conv = ws_conv(eps_form, eps)
    assert isinstance(conv, unnorm.StandardizedConv2d) and list(conv.state_dict()) == ["weight", "bias"]
    x = tokens(0, (2, 4, 5, 5)).requires_grad_(True)
    weight = conv.weight.detach().clone().requires_grad_(True)
    bias = conv.bias.detach().clone().requires_grad_(True)
    if eps_form == "var":
        want = release_ws_conv(x, weight, bias)
    elif eps_form == "std":
        want = conv_ws_2d(x, weight, bias, padding=1, eps=eps)
    else:
        timm = StdConv2d(4, 6, 3, padding=1, eps=eps).double()
        timm.weight, timm.bias = torch.nn.Parameter(weight), torch.nn.Parameter(bias)
        weight, bias = timm.weight, timm.bias
        want = timm(x)
    y = conv(x)
    close(y, want)
    for a, b in zip(grads(y, [x, conv.weight, conv.bias]), grads(want, [x, weight, bias])):
        close(a, b)


def test_standardized_linear_layers_fold_only_once_baked():
    torch.manual_seed(0)
    model = torch.nn.Sequential(unnorm.build_norm("bn", C), torch.nn.Linear(C, 8),
                                torch.nn.Linear(8, 2)).double()
    weight = model[1].weight
    optimizer_view = list(model.parameters())
    assert unnorm.standardize_weights(model, include="1") == 1
    assert model[1].weight is weight and list(model.parameters()) == optimizer_view
    x = tokens()
    want = F.linear(model[0](x), (weight - weight.mean(1, keepdim=True))
                    / torch.sqrt(weight.var(1, keepdim=True) + 1e-5), model[1].bias)
    close(model[1](model[0](x)), want)
    model(x).sum().backward()
    model.eval()
    before = model(x)
    with pytest.raises(ValueError, match="bake_standardized_weights"):
        unnorm.fold_norms(model, {"0": ["1"]}, probe=x)
    assert unnorm.bake_standardized_weights(model) == 1 and type(model[1]) is torch.nn.Linear
    close(model(x), before)
    unnorm.fold_norms(model, {"0": ["1"]}, probe=x)
    close(model(x), before)
    with pytest.raises(ValueError, match="matches no plain nn.Linear.*its layers: 1, 2"):
        unnorm.standardize_weights(model, include="head")
    with pytest.raises(ValueError, match="eps_form must be one of"):
        unnorm.standardize_weights(model, include="2", eps_form="sqrt")
    with pytest.raises(ValueError, match="include"):
        unnorm.standardize_weights(model, include=[])


@pytest.mark.parametrize("standardized, refused", [("3", r"^3 standardise"), (None, r"^2: LayerNorm")])
def test_a_fold_plan_is_refused_whole_naming_the_layer(standardized, refused):
    """The first norm of the plan would fold; the second's consumer standardises its weight
    (or the second norm is online): refused by module name before the first fold is made."""
    model = torch.nn.Sequential(unnorm.build_norm("bn", C), torch.nn.Linear(C, C),
                                unnorm.build_norm("ln", C), torch.nn.Linear(C, 2)).double()
    if standardized:
        model[2] = unnorm.build_norm("bn", C).double()
        unnorm.standardize_weights(model, include=standardized)
    model.eval()
    before = {name: value.clone() for name, value in model.state_dict().items()}
    with pytest.raises(ValueError, match=refused):
        unnorm.fold_norms(model, {"0": ["1"], "2": ["3"]}, probe=tokens())
    assert type(model[0]) is not unnorm.FoldedNorm
    for name, value in model.state_dict().items():
        assert torch.equal(value, before[name]), name


def test_a_half_precision_layer_standardises_in_float32():
    torch.manual_seed(0)
    half = torch.nn.Sequential(torch.nn.Linear(C, 8)).bfloat16()
    full = torch.nn.Sequential(torch.nn.Linear(C, 8))
    full.load_state_dict({k: v.float() for k, v in half.state_dict().items()})
    for model in (half, full):
        unnorm.standardize_weights(model, include="0")
    torch.testing.assert_close(half[0].standardized_weight(),
                               full[0].standardized_weight().bfloat16(), rtol=0, atol=0)
