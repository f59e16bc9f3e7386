"""DyT and PRepBN against float64 references written from their papers' formulas (and
``spec_reference.RefPRepBN``), torch's gradcheck, folding, precision and state."""
from __future__ import annotations

import pytest
import torch

import unnorm
from spec_reference import RefPRepBN
from test_norms import SHAPE, assert_close64, make_sequence, module_step

C = SHAPE[-1]


def _randomise(norm, seed=2):
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in norm.parameters():
            param.copy_(param + 0.3 * torch.randn(param.shape, generator=gen))
    return norm


# --- DyT ---------------------------------------------------------------------------------------

def test_dyt_is_weight_tanh_alpha_x_plus_bias_with_exact_gradients():
    norm = _randomise(unnorm.build_norm("dyt", C, alpha_init=0.7))
    assert norm.alpha.shape == (1,) and not unnorm.is_offline("dyt")
    assert [name for name, _ in norm.named_parameters()] == ["weight", "bias", "alpha"]
    x, dy = make_sequence(1)[0][0], make_sequence(1)[1][0]
    y, dx, dw, db = module_step(norm, x, dy)
    params = {k: v.detach().double().requires_grad_(True) for k, v in norm.named_parameters()}
    xr = x.double().requires_grad_(True)
    yr = params["weight"] * torch.tanh(params["alpha"] * xr) + params["bias"]
    yr.backward(dy.double())
    assert_close64(y, yr.detach())
    assert_close64(dx, xr.grad)
    assert_close64(dw, params["weight"].grad)
    assert_close64(db, params["bias"].grad)
    assert_close64(norm.alpha.grad, params["alpha"].grad)


def test_dyt_ignores_the_pad_mask_and_keeps_no_statistics():
    norm = unnorm.build_norm("dyt", C)
    x = torch.randn(SHAPE)
    pad = torch.zeros(SHAPE[:-1], dtype=torch.bool)
    pad[0, 2:] = True
    torch.testing.assert_close(norm(x, pad), norm(x), rtol=0, atol=0)
    assert list(norm.buffers()) == []
    with pytest.raises(ValueError, match="alpha_init"):
        unnorm.build_norm("dyt", C, alpha_init=0)


@pytest.mark.parametrize("name", ["dyt", "prepbn"])
def test_gradcheck_in_float64(name):
    options = {"warmup_iters": 1, "decay_iters": 3} if name == "prepbn" else {}
    norm = _randomise(unnorm.build_norm(name, 3, **options)).double()
    names = [n for n, _ in norm.named_parameters()]
    params = [p.detach().clone().requires_grad_(True) for p in norm.parameters()]
    x = torch.randn(5, 3, dtype=torch.float64, requires_grad=True)

    def fn(x, *params):
        if name == "prepbn":
            norm.num_iters.fill_(2)  # every call is step 3, inside the hand-over
        return torch.func.functional_call(norm, dict(zip(names, params)), (x,))
    assert torch.autograd.gradcheck(fn, (x, *params))


# --- PRepBN ------------------------------------------------------------------------------------

def _prepbn(**options):
    norm = _randomise(unnorm.build_norm("prepbn", C, **options))
    return norm, RefPRepBN(dict(norm.named_parameters()), warmup=options["warmup_iters"],
                           decay=options["decay_iters"], r0=options.get("r0", 1.0))


@pytest.mark.parametrize("padded", [False, True])
def test_prepbn_matches_the_reference_across_warmup_and_decay(padded):
    norm, ref = _prepbn(warmup_iters=3, decay_iters=5, r0=0.9)
    pad = torch.zeros(SHAPE[:-1], dtype=torch.bool)
    if padded:
        pad[0, 3:] = pad[2, 1:] = True
    for step, (x, dy) in enumerate(zip(*make_sequence(12, spikes={})), 1):
        dy = dy.masked_fill(pad[..., None], 0.0)  # hosts give padding no gradient
        y, dx, _, _ = module_step(norm, x, dy, pad_mask=pad if padded else None)
        y_ref, dx_ref, grads = ref.step(x.reshape(-1, C), dy.reshape(-1, C), ~pad.reshape(-1))
        assert_close64(y[~pad], y_ref.reshape(y.shape)[~pad])
        assert_close64(dx[~pad], dx_ref.reshape(dx.shape)[~pad])
        for name, param in norm.named_parameters():
            assert_close64(param.grad, grads[name].reshape(param.shape))
        assert int(norm.num_iters) == step
    assert_close64(norm.running_mean, ref.running_mean)
    assert_close64(norm.running_var, ref.running_var)
    norm.eval()
    x = make_sequence(1, seed=9)[0][0]
    assert_close64(norm(x), ref.eval(x.reshape(-1, C)).reshape(x.shape))


def test_prepbn_layer_norm_share_counts_down_to_pure_repbn():
    norm = unnorm.build_norm("prepbn", C, warmup_iters=2, decay_iters=4, r0=0.8)
    shares = [float(norm.layer_norm_share(torch.tensor(t))) for t in range(1, 10)]
    assert shares == pytest.approx([1, 1, 0.8, 0.6, 0.4, 0.2, 0, 0, 0])
    assert unnorm.is_offline("prepbn")


def test_prepbn_runs_no_bn_statistics_during_warmup():
    norm = unnorm.build_norm("prepbn", C, warmup_iters=3, decay_iters=2)
    for x, dy in zip(*make_sequence(3)):
        module_step(norm, x, dy)
    assert torch.equal(norm.running_mean, torch.zeros(C)) and torch.equal(norm.running_var, torch.ones(C))
    module_step(norm, *[seq[0] for seq in make_sequence(1, seed=4)])
    assert not torch.equal(norm.running_var, torch.ones(C))


def test_prepbn_state_dict_round_trip_mid_decay_continues_identically():
    first, _ = _prepbn(warmup_iters=2, decay_iters=10)
    xs, dys = make_sequence(14)
    for x, dy in zip(xs[:6], dys[:6]):  # into the hand-over
        module_step(first, x, dy)
    second = unnorm.build_norm("prepbn", C, warmup_iters=2, decay_iters=10)
    second.load_state_dict(first.state_dict())
    for x, dy in zip(xs[6:], dys[6:]):
        for a, b in zip(module_step(first, x, dy), module_step(second, x, dy)):
            torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_prepbn_options_are_checked():
    for bad in ({"r0": 1.5}, {"decay_iters": -1}, {"momentum": 1.0}, {"warmup_iters": 2.5}):
        with pytest.raises(ValueError, match=next(iter(bad))):
            unnorm.build_norm("prepbn", C, **bad)


# --- folding -----------------------------------------------------------------------------------

@pytest.mark.parametrize("name", ["dyt", "prepbn"])
def test_folding_into_the_next_linear_layer_is_exact(name):
    torch.manual_seed(3)
    norm = _randomise(unnorm.build_norm(name, C, **({"warmup_iters": 1, "decay_iters": 2}
                                                     if name == "prepbn" else {})))
    for x, dy in zip(*make_sequence(5)):  # populate PRepBN's running statistics
        module_step(norm, x, dy)
    linear = torch.nn.Linear(C, 4)
    model = torch.nn.Sequential(norm, linear).double().eval()
    x = torch.randn(7, C, dtype=torch.float64) * 3
    before = model(x)
    model[0] = unnorm.fold_into_linear(model[0], [model[1]])
    assert not any(isinstance(m, unnorm.ChannelNorm) for m in model.modules())
    torch.testing.assert_close(model(x), before, rtol=1e-6, atol=1e-6)  # float32 affines
    if name == "dyt":
        torch.testing.assert_close(model[0](x), torch.tanh(norm.alpha.double() * x))


def test_fold_norms_leaves_a_dyt_without_consumer_whole():
    model = torch.nn.Sequential(unnorm.build_norm("dyt", C), torch.nn.Linear(C, C),
                                unnorm.build_norm("dyt", C)).eval()
    x = torch.randn(3, C)
    before = model(x)
    assert unnorm.fold_norms(model, {"0": ["1"], "2": []}, probe=x) == 1
    assert isinstance(model[2], unnorm.DynamicTanh)
    torch.testing.assert_close(model(x), before, rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError, match="online"):
        unnorm.to_affine(unnorm.build_norm("dyt", C).eval())


@pytest.mark.parametrize("name, options", [("dyt", {}), ("prepbn", {"decay_iters": 10})])
def test_swap_norms_puts_the_rivals_in_place_of_layer_norms(name, options):
    model = torch.nn.Sequential(torch.nn.LayerNorm(C), torch.nn.Linear(C, C), torch.nn.LayerNorm(C))
    with torch.no_grad():
        model[0].weight.uniform_(0.5, 2)
        model[2].bias.uniform_(-1, 1)
    weights = [model[i].weight.clone() for i in (0, 2)], [model[i].bias.clone() for i in (0, 2)]
    assert unnorm.swap_norms(model, name, **options) == 2
    for index, weight, bias in zip((0, 2), *weights):
        assert type(model[index]) is type(unnorm.build_norm(name, C, **options))
        torch.testing.assert_close(model[index].weight, weight)  # PRepBN: its LayerNorm's affine
        torch.testing.assert_close(model[index].bias, bias)
