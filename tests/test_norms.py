"""The norms against independent expectations: torch's own layers and the spec's float64
references in ``spec_reference.py``."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import unnorm
from spec_reference import RefMABN, RefMaskPN, RefPN, RefUN, group_scale
from unnorm.registry import quick_options

C = 6
SHAPE = (3, 5, C)  # (B, N, C) tokens
SPIKES = {27: 6.0, 41: 0.2, 52: 8.0}  # steps whose input is scaled: outliers for the filter
# Every registry norm with the options its registry entry gives for short runs (warm-up, full
# windows, compensation, outlier skips and PRepBN's whole hand-over within a test's few
# steps); the norms with running state among them
QUICK_OPTIONS = {name: quick_options(name) for name in unnorm.available_norms()}
STATEFUL = {name: options for name, options in QUICK_OPTIONS.items()
            if unnorm.has_running_state(name)}
def make_sequence(steps, seed=0, spikes=SPIKES, shape=SHAPE):
    gen = torch.Generator().manual_seed(seed)
    channel_scale = torch.linspace(0.5, 2.0, shape[-1])
    xs, dys = [], []
    for t in range(1, steps + 1):
        x = torch.randn(shape, generator=gen) * channel_scale + 0.3
        xs.append(x * spikes.get(t, 1.0))
        dys.append(torch.randn(shape, generator=gen))
    return xs, dys


def random_affine(norm, seed=1):
    """The norm's learnable ``weight`` and ``bias``, whichever it has and in their own shapes
    (ScaleNorm's one gain), set to random values."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, centre, spread in (("weight", 1.0, 0.5), ("bias", 0.0, 0.1)):
            param = getattr(norm, name)
            if isinstance(param, torch.nn.Parameter):
                param.copy_(centre + spread * torch.randn(param.shape, generator=gen))
    return norm


def module_step(norm, x, dy, pad_mask=None):
    x = x.clone().requires_grad_(True)
    for p in norm.parameters():
        p.grad = None
    y = norm(x, pad_mask) if pad_mask is not None else norm(x)
    y.backward(dy)
    return y.detach(), x.grad, norm.weight.grad, getattr(norm.bias, "grad", None)


def assert_close64(actual, expected, rtol=2e-4, atol=2e-5):
    torch.testing.assert_close(actual.double(), expected.double().reshape(actual.shape),
                               rtol=rtol, atol=atol)


def run_against(norm, ref, xs, dys):
    for x, dy in zip(xs, dys):
        got = module_step(norm, x, dy)
        want = ref.step(x.reshape(-1, C), dy.reshape(-1, C))
        for a, b in zip(got, want):
            assert_close64(a, b)


# --- per-position norms and BN against torch -------------------------------------------------

def test_ln_equals_torch_layer_norm():
    norm = random_affine(unnorm.build_norm("ln", C, eps=1e-6))
    x, dy = make_sequence(1)[0][0], make_sequence(1)[1][0]
    y, dx, dw, db = module_step(norm, x, dy)
    xr = x.clone().requires_grad_(True)
    w = norm.weight.detach().clone().requires_grad_(True)
    b = norm.bias.detach().clone().requires_grad_(True)
    yr = F.layer_norm(xr, (C,), w, b, 1e-6)
    yr.backward(dy)
    for got, want in ((y, yr), (dx, xr.grad), (dw, w.grad), (db, b.grad)):
        torch.testing.assert_close(got, want.detach(), rtol=1e-5, atol=1e-6)
    norm.eval()
    torch.testing.assert_close(norm(x), F.layer_norm(x, (C,), w, b, 1e-6), rtol=1e-5, atol=1e-6)


def test_rms_equals_torch_rmsnorm():
    norm = unnorm.build_norm("rms", C, eps=1e-6)
    with torch.no_grad():
        norm.weight.uniform_(0.5, 1.5)
    ref = torch.nn.RMSNorm(C, eps=1e-6)
    with torch.no_grad():
        ref.weight.copy_(norm.weight)
    x, dy = make_sequence(1)[0][0], make_sequence(1)[1][0]
    y, dx, dw, _ = module_step(norm, x, dy)
    xr = x.clone().requires_grad_(True)
    yr = ref(xr)
    yr.backward(dy)
    torch.testing.assert_close(y, yr.detach(), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(dx, xr.grad, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(dw, ref.weight.grad, rtol=1e-5, atol=1e-5)


def test_bn_equals_batchnorm1d_on_flattened_positions():
    norm = random_affine(unnorm.build_norm("bn", C, momentum=0.9))
    ref = torch.nn.BatchNorm1d(C, momentum=0.1)  # torch's momentum is 1 - alpha
    with torch.no_grad():
        ref.weight.copy_(norm.weight)
        ref.bias.copy_(norm.bias)
    xs, dys = make_sequence(4)
    for x, dy in zip(xs, dys):
        y, dx, dw, db = module_step(norm, x, dy)
        xr = x.reshape(-1, C).clone().requires_grad_(True)
        ref.weight.grad = ref.bias.grad = None
        yr = ref(xr)
        yr.backward(dy.reshape(-1, C))
        torch.testing.assert_close(y.reshape(-1, C), yr.detach(), rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(dx.reshape(-1, C), xr.grad, rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(dw, ref.weight.grad, rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(db, ref.bias.grad, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(norm.running_mean, ref.running_mean, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(norm.running_var, ref.running_var, rtol=1e-5, atol=1e-6)
    norm.eval(), ref.eval()
    torch.testing.assert_close(norm(xs[0]).reshape(-1, C), ref(xs[0].reshape(-1, C)),
                               rtol=1e-5, atol=1e-5)


def test_bn_with_padding_equals_batchnorm1d_on_the_valid_positions():
    norm = random_affine(unnorm.build_norm("bn", C))
    ref = torch.nn.BatchNorm1d(C)
    with torch.no_grad():
        ref.weight.copy_(norm.weight)
        ref.bias.copy_(norm.bias)
    pad = torch.zeros(SHAPE[:-1], dtype=torch.bool)
    pad[1, 2:] = True
    for x, dy in zip(*make_sequence(3)):
        dy = dy.masked_fill(pad[..., None], 0.0)  # hosts give padding no gradient
        y, dx, dw, db = module_step(norm, x, dy, pad_mask=pad)
        xr = x[~pad].clone().requires_grad_(True)
        ref.weight.grad = ref.bias.grad = None
        yr = ref(xr)
        yr.backward(dy[~pad])
        torch.testing.assert_close(y[~pad], yr.detach(), rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(dx[~pad], xr.grad, rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(dw, ref.weight.grad, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(norm.running_var, ref.running_var, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(norm.running_mean, ref.running_mean, rtol=1e-5, atol=1e-6)


# --- ScaleNorm against its closed form -------------------------------------------------------

def test_scalenorm_is_one_gain_over_the_l2_norm_clamped_at_eps():
    """Nguyen and Salazar's ScaleNorm as released (``x * g / norm(x).clamp(min=eps)``): the
    output and the gradients of x and of the one gain g equal the float64 closed form's, a row
    of norm below eps included, in training and in eval (no state)."""
    norm = unnorm.build_norm("scalenorm", C, eps=1e-3)
    assert norm.weight.shape == (1,) and norm.weight.item() == pytest.approx(C ** 0.5)
    assert norm.bias is None and not dict(norm.named_buffers())
    x, dy = make_sequence(1)[0][0], make_sequence(1)[1][0]
    # the initial g = sqrt(C) makes it RMSNorm without eps or weight
    torch.testing.assert_close(norm(x), F.rms_norm(x, (C,), eps=0.0), rtol=1e-5, atol=1e-6)
    x[0, 0], x[0, 1] = 1e-5, 0.0  # norms below eps: the clamp's linear branch
    random_affine(norm)
    y, dx, dg, _ = module_step(norm, x, dy)
    x64 = x.double().requires_grad_(True)
    g64 = norm.weight.detach().double().requires_grad_(True)
    y64 = g64 * x64 / x64.square().sum(-1, keepdim=True).clamp_min(1e-3 ** 2).sqrt()
    y64.backward(dy.double())
    for got, want in ((y, y64), (dx, x64.grad), (dg, g64.grad)):
        assert_close64(got, want.detach(), rtol=1e-5, atol=1e-6)
    gain = abs(g64.item())
    assert y[0, 0].norm() < 0.1 * gain and y[1, 0].norm().item() == pytest.approx(gain)
    assert_close64(norm.eval()(x), y64.detach(), rtol=1e-5, atol=1e-6)


# --- GroupNorm against torch's layers --------------------------------------------------------

GN_C = 12


def _gn_step(norm, ref, x, dy, to_ref, from_ref):
    """Output and gradients (x, weight, bias) of ``norm`` on channels-last ``x`` and of the
    torch layer ``ref`` on ``to_ref(x)``, mapped back with ``from_ref``, float64."""
    with torch.no_grad():
        ref.weight.copy_(norm.weight)
        ref.bias.copy_(norm.bias)
    got = module_step(norm, x, dy)
    xr = x.clone().requires_grad_(True)
    from_ref(ref(to_ref(xr))).backward(dy)
    return got, (from_ref(ref(to_ref(x))).detach(), xr.grad, ref.weight.grad, ref.bias.grad)


@pytest.mark.parametrize("groups", [1, 3, 6])
def test_gn_per_token_is_torch_group_norm_on_each_token(groups):
    """layout token: each token a sample of torch's ``nn.GroupNorm`` (rows ``(B*T, C)``),
    output and every gradient, in float64; one group is exactly ``nn.LayerNorm``."""
    norm = random_affine(unnorm.build_norm("gn", GN_C, groups=groups).double())
    assert norm.groups == groups
    xs, dys = make_sequence(1, shape=(3, 5, GN_C))
    x, dy = xs[0].double() * 3 + 1, dys[0].double()
    ref = torch.nn.GroupNorm(groups, GN_C).double()
    got, want = _gn_step(norm, ref, x, dy, lambda t: t.reshape(-1, GN_C),
                         lambda t: t.reshape(x.shape))
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-10)
    if groups == 1:
        ln = torch.nn.LayerNorm(GN_C).double()
        with torch.no_grad():
            ln.weight.copy_(norm.weight)
            ln.bias.copy_(norm.bias)
        torch.testing.assert_close(norm(x), ln(x), rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("groups", [1, 4, GN_C])
def test_gn_per_example_is_torch_group_norm_and_instance_norm_over_positions(groups):
    """layout image: torch's ``nn.GroupNorm`` on ``(B, C, T)``; ``groups=C`` is
    ``nn.InstanceNorm1d`` (affine), each channel over its example's positions."""
    norm = random_affine(unnorm.build_norm("gn", GN_C, groups=groups, layout="image").double())
    assert norm.groups == groups
    xs, dys = make_sequence(1, shape=(3, 5, GN_C))
    x, dy = xs[0].double() * 3 + 1, dys[0].double()
    refs = [torch.nn.GroupNorm(groups, GN_C).double()]
    if groups == GN_C:
        refs.append(torch.nn.InstanceNorm1d(GN_C, affine=True).double())
    for ref in refs:
        got, want = _gn_step(norm, ref, x, dy, lambda t: t.transpose(1, 2),
                             lambda t: t.transpose(1, 2))
        for a, b in zip(got, want):
            torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-10)


def test_gn_per_example_with_padding_is_group_norm_of_the_valid_positions():
    """A padded example's statistics pool its valid positions only, whatever the padding
    holds (0, 1e6, inf): each example's valid rows equal ``nn.GroupNorm`` on them alone."""
    norm = random_affine(unnorm.build_norm("gn", GN_C, groups=4, layout="image").double())
    ref = torch.nn.GroupNorm(4, GN_C).double()
    with torch.no_grad():
        ref.weight.copy_(norm.weight)
        ref.bias.copy_(norm.bias)
    x = make_sequence(1, shape=(3, 5, GN_C))[0][0].double()
    pad = torch.zeros(3, 5, dtype=torch.bool)
    pad[0, 3:] = True
    pad[2, 1:] = True
    for fill in (0.0, 1e6, float("inf")):
        y = norm(x.masked_fill(pad[..., None], fill), pad)
        for b in range(3):
            valid = x[b][~pad[b]]
            want = ref(valid.T[None])[0].T
            torch.testing.assert_close(y[b][~pad[b]], want.detach(), rtol=1e-10, atol=1e-10)


def test_gn_statistics_are_float32_under_a_half_input():
    """bf16 tokens: the output is GroupNorm of the same values in float32, rounded once."""
    norm = random_affine(unnorm.build_norm("gn", GN_C, groups=3))
    x = (make_sequence(1, shape=(3, 5, GN_C))[0][0] * 100 + 500).bfloat16()
    ref = torch.nn.GroupNorm(3, GN_C)
    ref.load_state_dict(norm.state_dict())
    want = ref(x.float().reshape(-1, GN_C)).reshape(x.shape).bfloat16()
    assert torch.equal(norm(x), want)


def test_gn_groups_follow_the_grouped_norms_rule():
    """A ``groups`` that does not divide the channels falls to the largest divisor below it,
    as BCN's and EvoNorm-S0's; per token a group keeps two channels, per example one may
    hold one (instance normalisation); a bad value or layout is refused."""
    assert unnorm.build_norm("gn", 12, groups=5).groups == 4
    assert unnorm.build_norm("gn", 12, groups=12).groups == 6
    assert unnorm.build_norm("gn", 12, groups=12, layout="image").groups == 12
    with pytest.raises(ValueError, match="positive int"):
        unnorm.build_norm("gn", 12, groups=0)
    with pytest.raises(ValueError, match="layout must be one of"):
        unnorm.build_norm("gn", 12, layout="batch")
    with pytest.raises(ValueError, match="position axis"):
        unnorm.build_norm("gn", 12, layout="image")(torch.randn(4, 12))


# --- UN, MABN, PN against the spec's float64 references --------------------------------------

UN_VARIANTS = {
    "released": {},
    "per_channel_bound": {"outlier_var_per_channel": True},
    "no_fwd_gm": {"fwd_gm": False},
    "no_bwd_am": {"bwd_am": False},
    "no_bwd_ema": {"bwd_ema": False},
    "no_am_no_ema": {"bwd_am": False, "bwd_ema": False},
    "no_filtration": {"outlier_filtration": False},
    "threshold": {"outlier_threshold": 1.5},
    "window_6": {"window_size": 6},
    "window_1": {"window_size": 1},
}
_REF_NAMES = {"outlier_var_per_channel": "per_channel", "outlier_threshold": "threshold",
              "window_size": "window", "outlier_filtration": "outlier_filtration"}


@pytest.mark.parametrize("variant", UN_VARIANTS)
def test_un_matches_spec_reference_over_60_steps(variant):
    options = {"warmup_iters": 20, "outlier_filtration": True, **UN_VARIANTS[variant]}
    norm = random_affine(unnorm.build_norm("un", C, **options))
    ref_options = {_REF_NAMES.get(k, k): v for k, v in options.items()}
    ref_options["warmup"] = ref_options.pop("warmup_iters")
    ref = RefUN(norm.weight.detach(), norm.bias.detach(), **ref_options)
    xs, dys = make_sequence(60)
    run_against(norm, ref, xs, dys)
    assert all(m > 1e-3 for m in ref.margins), "an outlier decision sits on its threshold"
    assert int(norm.num_skipped) == ref.skipped
    assert int(norm.num_iters) == 60
    for name in ("running_var", "fwd_buffer", "bwd_buffer", "ema_grad"):
        assert_close64(getattr(norm, name), getattr(ref, name))
    if variant == "released":  # the sequence exercises every branch of the algorithm
        assert 0 < ref.skipped < 60 - 20


def _start_at(norm, ref, step, seed=3):
    """Put module and reference in the same mid-training state (as a checkpoint would)."""
    gen = torch.Generator().manual_seed(seed)
    state = norm.state_dict()
    state["num_iters"] = torch.tensor(step)
    for name in ("running_var", "fwd_buffer", "x_window", "running_phi"):
        if name in state:
            state[name] = torch.rand(state[name].shape, generator=gen) + 0.5
    norm.load_state_dict(state)
    ref.t = step
    ref.running_var = state.get("running_var", torch.ones(C)).double()
    if hasattr(ref, "fwd_buffer"):
        ref.fwd_buffer = state["fwd_buffer"].double()
    if hasattr(ref, "x_window"):
        ref.x_window = state["fwd_buffer"].double()


@pytest.mark.parametrize("compensation", [True, False])
def test_un_gradient_compensation_from_step_1000(compensation):
    norm = random_affine(unnorm.build_norm("un", C, warmup_iters=20,
                                           grad_compensation=compensation))
    ref = RefUN(norm.weight.detach(), norm.bias.detach(), warmup=20,
                grad_compensation=compensation)
    _start_at(norm, ref, 990)
    assert int(norm.num_iters) == 990
    xs, dys = make_sequence(30, seed=5, spikes={})
    run_against(norm, ref, xs, dys)
    assert int(norm.num_iters) == 1020
    # one more step with a shifted scale: r != 1 shows in dweight = sum(dy * r * z)
    x, dy = xs[-1] * 3, dys[-1]
    dweight = module_step(norm, x, dy)[2]
    z = x.reshape(-1, C) / torch.sqrt(torch.exp(torch.log(norm.fwd_buffer).mean(0)) + norm.eps)
    uncompensated = (dy.reshape(-1, C) * z).sum(0)
    assert torch.allclose(dweight, uncompensated, rtol=1e-4) != compensation


def test_mabn_matches_spec_reference():
    norm = random_affine(unnorm.build_norm("mabn", C, window_size=4, warmup_iters=10, momentum=0.9))
    ref = RefMABN(norm.weight.detach(), norm.bias.detach(), window=4, warmup=10, alpha=0.9)
    xs, dys = make_sequence(50)
    run_against(norm, ref, xs, dys)
    assert_close64(norm.running_var, ref.running_var)


def test_mabn_renormalisation_from_step_1000():
    norm = random_affine(unnorm.build_norm("mabn", C, window_size=4, warmup_iters=10))
    ref = RefMABN(norm.weight.detach(), norm.bias.detach(), window=4, warmup=10)
    _start_at(norm, ref, 990)
    xs, dys = make_sequence(20, seed=7, spikes={})
    run_against(norm, ref, xs, dys)


@pytest.mark.parametrize("warmup", [10, 100])
def test_pn_matches_spec_reference(warmup):
    norm = random_affine(unnorm.build_norm("pn", C, warmup_iters=warmup))
    ref = RefPN(norm.weight.detach(), norm.bias.detach(), warmup=warmup)
    xs, dys = make_sequence(50)
    run_against(norm, ref, xs, dys)
    assert_close64(norm.running_phi, ref.running_phi)
    assert_close64(norm.ema_grad, ref.ema_gz)


@pytest.mark.parametrize("padded_in_backward", [True, False])
@pytest.mark.parametrize("warmup", [5, 100])
def test_pn_with_a_pad_mask_matches_maskpowernorm_or_exact_masking(warmup, padded_in_backward):
    """Released: padded positions' z^2 (and g z) enter the gradient EMA; the option leaves
    them out. Padded inputs are not zero, as inside a Transformer."""
    norm = random_affine(unnorm.build_norm("pn", C, warmup_iters=warmup,
                                           padded_in_backward=padded_in_backward))
    ref = RefMaskPN(norm.weight.detach(), norm.bias.detach(), warmup=warmup,
                    padded_in_backward=padded_in_backward)
    pad = torch.zeros(SHAPE[:-1], dtype=torch.bool)
    pad[0, 3:] = pad[2, 1:] = True
    for x, dy in zip(*make_sequence(30)):
        dy = dy.masked_fill(pad[..., None], 0.0)  # hosts give padding no gradient
        got = module_step(norm, x, dy, pad_mask=pad)
        want = ref.step(x.reshape(-1, C), dy.reshape(-1, C), ~pad.reshape(-1))
        for a, b in zip(got, want):
            assert_close64(a, b)
    assert_close64(norm.running_phi, ref.running_phi)
    assert_close64(norm.ema_grad, ref.ema_gz)


def test_pn_ls_is_group_scaling_then_pn():
    groups = 3
    norm = random_affine(unnorm.build_norm("pn_ls", C, warmup_iters=10, group_num=groups))
    ref = RefPN(norm.weight.detach(), norm.bias.detach(), warmup=10)
    for x, dy in zip(*make_sequence(30)):
        y, dx, dw, _ = module_step(norm, x, dy)
        x64 = x.reshape(-1, C).double().requires_grad_(True)
        scaled = group_scale(x64, groups)
        y_ref, dscaled, dw_ref, _ = ref.step(scaled.detach(), dy.reshape(-1, C))
        (dx_ref,) = torch.autograd.grad(scaled, x64, dscaled)
        assert_close64(y, y_ref)
        assert_close64(dx, dx_ref)
        assert_close64(dw, dw_ref)
    assert not norm.offline and unnorm.build_norm("pn", C).offline


def test_un_warmup_gradient_is_exact_without_gradient_ema():
    """During warm-up (and with psi = q_t, i.e. bwd_ema off: the release uses the EMA even in
    warm-up) UN's input gradient is autograd's gradient of x / sqrt(mean(x^2) + eps)."""
    norm = random_affine(unnorm.build_norm("un", C, warmup_iters=100, bwd_ema=False))
    for x, dy in zip(*make_sequence(8)):
        _, dx, _, _ = module_step(norm, x, dy)
        xr = x.reshape(-1, C).double().requires_grad_(True)
        z = xr / torch.sqrt((xr * xr).mean(dim=0) + norm.eps)
        (norm.weight.detach().double() * z).backward(dy.reshape(-1, C).double())
        assert_close64(dx.reshape(-1, C), xr.grad)


# --- ablation switches: each changes what the spec says it changes ---------------------------

def _after_warmup(norm, steps=12):
    xs, dys = make_sequence(steps, spikes={})
    for x, dy in zip(xs[:-1], dys[:-1]):
        module_step(norm, x, dy)
    return xs[-1], dys[-1]


def test_fwd_gm_off_normalises_by_the_batch_statistic():
    x_gm, x_batch = [], []
    for fwd_gm, out in ((True, x_gm), (False, x_batch)):
        norm = unnorm.build_norm("un", C, warmup_iters=5, fwd_gm=fwd_gm)
        x, dy = _after_warmup(norm)
        out.append(module_step(norm, x, dy)[0])
    s = (x.reshape(-1, C) ** 2).mean(dim=0)
    expected = (x / torch.sqrt(s + 1e-5))
    torch.testing.assert_close(x_batch[0], expected, rtol=1e-5, atol=1e-6)
    assert not torch.allclose(x_gm[0], expected, rtol=1e-3)


def test_bwd_am_and_ema_off_give_the_batch_gradient_after_warmup():
    norm = unnorm.build_norm("un", C, warmup_iters=5, bwd_am=False, bwd_ema=False)
    x, dy = _after_warmup(norm)
    norm.fwd_gm = False  # so the exact gradient of the batch-statistic form applies
    _, dx, _, _ = module_step(norm, x, dy)
    xr = x.reshape(-1, C).double().requires_grad_(True)
    (xr / torch.sqrt((xr * xr).mean(dim=0) + 1e-5)).backward(dy.reshape(-1, C).double())
    assert_close64(dx.reshape(-1, C), xr.grad)


def test_bwd_ema_off_makes_psi_the_window_mean():
    norm = unnorm.build_norm("un", C, warmup_iters=5, bwd_ema=False)
    x, dy = _after_warmup(norm)
    module_step(norm, x, dy)
    torch.testing.assert_close(norm.ema_grad, norm.bwd_buffer.mean(dim=0))


def test_outlier_filtration_skips_a_spike_and_uses_the_batch_statistic():
    for filtration in (True, False):
        norm = unnorm.build_norm("un", C, warmup_iters=5, outlier_filtration=filtration)
        x, dy = _after_warmup(norm)
        spike = x * 10
        y = module_step(norm, spike, dy)[0]
        s = (spike.reshape(-1, C) ** 2).mean(dim=0)
        if filtration:
            assert int(norm.num_skipped) == 1
            torch.testing.assert_close(y, spike / torch.sqrt(s + 1e-5), rtol=1e-5, atol=1e-5)
        else:
            assert int(norm.num_skipped) == 0
            assert not torch.allclose(y, spike / torch.sqrt(s + 1e-5), rtol=1e-3)


def test_skipped_slot_holds_the_previous_running_var():
    norm = unnorm.build_norm("un", C, warmup_iters=5, outlier_filtration=True)
    x, dy = _after_warmup(norm)
    running_before = norm.running_var.clone()
    module_step(norm, x * 10, dy)
    assert int(norm.num_skipped) == 1
    torch.testing.assert_close(norm.fwd_buffer[int(norm.num_iters) % 4], running_before)


def test_huge_outlier_threshold_never_skips():
    norm = unnorm.build_norm("un", C, warmup_iters=5, outlier_filtration=True,
                             outlier_threshold=1e9)
    x, dy = _after_warmup(norm)
    module_step(norm, x * 10, dy)
    assert int(norm.num_skipped) == 0


def test_window_pair_sets_forward_and_backward_windows():
    norm = unnorm.build_norm("un", C, window_size=(2, 5))
    assert norm.fwd_buffer.shape == (2, C) and norm.bwd_buffer.shape == (5, C)
    with pytest.raises(ValueError, match="window"):
        unnorm.build_norm("un", C, window_size=(2, 3, 4))


# --- padding, precision, state --------------------------------------------------------------

def _state_tensors(norm):
    return {k: v.clone() for k, v in norm.state_dict().items()}


@pytest.mark.parametrize("name", unnorm.available_norms())
def test_padding_changes_no_statistic_and_no_valid_output(name):
    options = dict(QUICK_OPTIONS[name])
    if "padded_in_backward" in unnorm.option_names(name):  # PN: exact masking; the release's
        options["padded_in_backward"] = False  # padded backward is tested above
    xs, dys = make_sequence(10, spikes={})
    pad = torch.zeros(SHAPE[:-1], dtype=torch.bool)
    pad[0, 3:] = True
    pad[2, 1:] = True
    runs = []
    for pad_value in (0.0, 1e6, float("inf")):
        norm = random_affine(unnorm.build_norm(name, C, **options))
        outputs = []
        with unnorm.record_statistics(norm) as recorder:
            for x, dy in zip(xs, dys):
                x = x.masked_fill(pad[..., None], pad_value)
                y, dx, _, _ = module_step(norm, x, dy, pad_mask=pad)
                outputs.append((y[~pad], dx[~pad]))
            stats = recorder.flush()[""]
        runs.append((outputs, stats, _state_tensors(norm)))
    (out_a, stats_a, state_a) = runs[0]
    for out_b, stats_b, state_b in runs[1:]:
        for (ya, dxa), (yb, dxb) in zip(out_a, out_b):
            torch.testing.assert_close(ya, yb)
            torch.testing.assert_close(dxa, dxb)
        for key in stats_a:
            torch.testing.assert_close(stats_a[key], stats_b[key])
        for key in state_a:
            torch.testing.assert_close(state_a[key], state_b[key])


@pytest.mark.parametrize("name", unnorm.available_norms())
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision_inputs_up_to_1e4(name, dtype):
    norm = unnorm.build_norm(name, C)
    x = (torch.rand(SHAPE) * 2 - 1) * 1e4
    if name == "evonorm_s0":  # S0 divides x, not centred, by its group's std: a constant
        x[0, 0, 0] = 1e4      # group gives x / sqrt(eps), past float16 (as released, as timm)
    else:
        x[0, 0] = 1e4
    x = x.to(dtype).requires_grad_(True)
    y = norm(x)
    assert y.dtype == dtype and torch.isfinite(y).all()
    y.float().square().mean().backward()
    assert torch.isfinite(x.grad).all()
    assert all(torch.isfinite(p.grad).all() for p in norm.parameters())


def test_released_checkpoint_names_load_and_reproduce_eval():
    gen = torch.Generator().manual_seed(4)
    released = {
        "weight": torch.rand(C, generator=gen) + 0.5, "bias": torch.randn(C, generator=gen),
        "running_var": torch.rand(C, generator=gen) + 0.1,
        "ema_gz": torch.randn(C, generator=gen), "iters": torch.tensor([4321]),
        "buffer_x2": torch.rand(4, C, generator=gen), "buffer_gz": torch.randn(4, C, generator=gen),
        "skip_counter": torch.tensor([7]),
    }
    model = torch.nn.Sequential(unnorm.build_norm("un", C))
    state = unnorm.convert_released_state_dict({f"0.{k}": v for k, v in released.items()})
    model.load_state_dict(state)
    norm = model[0]
    assert int(norm.num_iters) == 4321 and int(norm.num_skipped) == 7
    torch.testing.assert_close(norm.ema_grad, released["ema_gz"])
    x = torch.randn(SHAPE, generator=gen)
    expected = released["weight"] * x / torch.sqrt(released["running_var"] + 1e-5) + released["bias"]
    torch.testing.assert_close(model.eval()(x), expected)


@pytest.mark.parametrize("name, options", [*STATEFUL.items(), ("bcn", {"estimate": True})],
                         ids=[*STATEFUL, "bcn-estimate"])
def test_state_dict_round_trip_resumes_identically(name, options):
    """Every norm with running state, its phases (warm-up, hand-over) crossed in the 25 steps."""
    first = random_affine(unnorm.build_norm(name, C, **options))
    xs, dys = make_sequence(40)
    for x, dy in zip(xs[:25], dys[:25]):
        module_step(first, x, dy)
    second = unnorm.build_norm(name, C, **options)
    second.load_state_dict(first.state_dict())
    for x, dy in zip(xs[25:], dys[25:]):
        for a, b in zip(module_step(first, x, dy), module_step(second, x, dy)):
            torch.testing.assert_close(a, b, rtol=0, atol=0)
    # the running state too, which a batch-statistics norm's training outputs do not read
    torch.testing.assert_close(second.state_dict(), first.state_dict(), rtol=0, atol=0)
    torch.testing.assert_close(second.eval()(xs[0]), first.eval()(xs[0]), rtol=0, atol=0)


def test_training_step_reads_nothing_back_from_the_device(monkeypatch):
    """No .item()/bool()/int() on tensors in a training step: choices stay on the device."""
    norms = [unnorm.build_norm("un", C, warmup_iters=3, outlier_filtration=True),
             unnorm.build_norm("mabn", C, window_size=2, warmup_iters=3),
             unnorm.build_norm("pn", C, warmup_iters=3), unnorm.build_norm("bn", C)]
    xs, dys = make_sequence(8)
    pad = torch.zeros(SHAPE[:-1], dtype=torch.bool)
    pad[1, 2:] = True

    def refuse(*args, **kwargs):
        raise AssertionError("device-to-host read in a training step")
    for method in ("item", "__bool__", "__int__", "__float__", "tolist"):
        monkeypatch.setattr(torch.Tensor, method, refuse)
    for norm in norms:
        for x, dy in zip(xs, dys):
            y = norm(x.requires_grad_(True), pad)
            y.backward(dy)
    monkeypatch.undo()
    assert int(norms[0].num_iters) == 8


# --- registry and model surgery -------------------------------------------------------------

def test_build_norm_errors_name_the_valid_choices():
    with pytest.raises(ValueError, match="un, .*|ln, rms"):
        unnorm.build_norm("groupnorm", C)
    with pytest.raises(ValueError, match="window_size"):
        unnorm.build_norm("un", C, window=4)
    assert isinstance(unnorm.build_norm("UN", C), unnorm.UnifiedNorm)


@pytest.mark.parametrize("name", unnorm.available_norms())
def test_host_constructor_arguments(name):
    """timm passes device/dtype and reads norm.weight.device; mmcv injects eps (refused by a
    norm without one: the mmdet adapter drops it there)."""
    if "eps" in unnorm.option_names(name):
        norm = unnorm.norm_layer(name)(C, device="cpu", dtype=torch.float32, eps=1e-6)
        assert norm.eps == 1e-6
    else:
        with pytest.raises(ValueError, match="no option.*eps"):
            unnorm.norm_layer(name)(C, eps=1e-6)
        norm = unnorm.norm_layer(name)(C, device="cpu", dtype=torch.float32)
    assert norm.weight.device.type == "cpu"
    with pytest.raises(ValueError, match="expects channels-last"):
        norm(torch.randn(2, C + 1))
    with pytest.raises(ValueError, match="pad_mask"):
        norm(torch.randn(2, 3, C), torch.zeros(3, 2, dtype=torch.bool))


class _Block(torch.nn.Module):
    """A small pre-norm Transformer block (norm -> q/k/v, norm -> MLP)."""

    def __init__(self, dim=8, heads=2, norm="ln"):
        super().__init__()
        self.heads = heads
        self.norm1 = torch.nn.LayerNorm(dim)
        self.q, self.k, self.v = (torch.nn.Linear(dim, dim) for _ in range(3))
        self.proj = torch.nn.Linear(dim, dim)
        self.norm2 = torch.nn.LayerNorm(dim)
        self.fc1, self.fc2 = torch.nn.Linear(dim, 2 * dim), torch.nn.Linear(2 * dim, dim)

    def forward(self, x):
        h = self.norm1(x)
        B, N, D = h.shape
        q, k, v = (lin(h).reshape(B, N, self.heads, -1).transpose(1, 2)
                   for lin in (self.q, self.k, self.v))
        attn = F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(B, N, D)
        x = x + self.proj(attn)
        return x + self.fc2(F.gelu(self.fc1(self.norm2(x))))


def test_swap_norms_carries_affine_and_ln_reproduces_the_model():
    block = _Block()
    with torch.no_grad():
        block.norm1.weight.uniform_(0.5, 2)
        block.norm2.bias.uniform_(-1, 1)
    x = torch.randn(2, 5, 8)
    before = block(x)
    assert unnorm.swap_norms(block, "ln") == 2
    torch.testing.assert_close(block(x), before)
    assert unnorm.swap_norms(block, "un") == 0  # ours are not LayerNorms
    fresh = _Block()
    fresh.load_state_dict(block.state_dict(), strict=False)
    assert unnorm.swap_norms(fresh, "un", window_size=3) == 2
    assert isinstance(fresh.norm1, unnorm.UnifiedNorm) and fresh.norm1.fwd_buffer.shape[0] == 3
    torch.testing.assert_close(fresh.norm1.weight, block.norm1.weight)


def test_swap_norms_to_scalenorm_starts_from_its_own_gain_and_trains():
    """No per-channel affine to carry: each ScaleNorm starts at g = sqrt(C), whatever the
    LayerNorm's affine was, and the block learns through it."""
    torch.manual_seed(0)
    block = _Block()
    with torch.no_grad():
        block.norm1.weight.uniform_(0.5, 2)
    assert unnorm.swap_norms(block, "scalenorm") == 2
    for module in (block.norm1, block.norm2):
        assert isinstance(module, unnorm.ScaleNorm) and module.weight.tolist() == pytest.approx([8 ** 0.5])
    x, target = torch.randn(4, 5, 8), torch.randn(4, 5, 8)
    optimizer = torch.optim.SGD(block.parameters(), lr=0.05)
    losses = []
    for _ in range(20):
        loss = (block(x) - target).square().mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    assert losses[-1] < 0.8 * losses[0] and block.norm1.weight.item() != pytest.approx(8 ** 0.5)


@pytest.mark.parametrize("name", ["bn", "mabn", "pn", "un"])
def test_folding_a_prenorm_block_is_exact(name):
    torch.manual_seed(0)
    block = _Block()
    unnorm.swap_norms(block, name, **({"warmup_iters": 3} if name != "bn" else {}))
    for module in (block.norm1, block.norm2):
        random_affine(module, seed=hash(name) % 100)
    for _ in range(8):  # populate the inference statistics
        block(torch.randn(4, 5, 8) * 3).sum().backward()
    block = block.double().eval()
    x = torch.randn(3, 7, 8, dtype=torch.float64)
    before = block(x)
    block.norm1 = unnorm.fold_into_linear(block.norm1, [block.q, block.k, block.v])
    block.norm2 = unnorm.fold_into_linear(block.norm2, [block.fc1])
    after = block(x)
    assert not any(isinstance(m, unnorm.ChannelNorm) for m in block.modules())
    assert ((after - before).abs().max() / before.abs().max()) < 1e-5


def test_fold_norms_and_to_affine_by_name():
    torch.manual_seed(1)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), unnorm.build_norm("un", 8, warmup_iters=2),
                                torch.nn.Linear(8, 3), unnorm.build_norm("bn", 3))
    for _ in range(5):
        model(torch.randn(16, 4)).sum().backward()
    model.eval()
    x = torch.randn(10, 4)
    before = model(x)
    assert unnorm.fold_norms(model, {"1": ["2"], "3": []}, probe=x) == 2
    assert isinstance(model[1], unnorm.FoldedNorm) and isinstance(model[3], unnorm.ChannelAffine)
    torch.testing.assert_close(model(x), before, rtol=1e-5, atol=1e-5)


def test_folding_refuses_online_norms_and_training_mode():
    linear = torch.nn.Linear(C, C)
    with pytest.raises(ValueError, match="online"):
        unnorm.fold_into_linear(unnorm.build_norm("ln", C).eval(), [linear])
    with pytest.raises(RuntimeError, match="online"):
        unnorm.build_norm("pn_ls", C).eval().inference_affine()
    with pytest.raises(RuntimeError, match="eval"):
        unnorm.fold_into_linear(unnorm.build_norm("un", C), [linear])
    with pytest.raises(ValueError, match="1x1"):  # a 3x3 kernel mixes pixels the norm kept apart
        unnorm.fold_into_linear(unnorm.build_norm("bn", C).eval(), [torch.nn.Conv2d(C, 4, 3)])


def test_folding_into_a_1x1_convolution_is_exact_at_every_pixel():
    norm = unnorm.build_norm("bn", C).double().eval()
    norm.running_mean.normal_()
    norm.running_var.uniform_(0.5, 2.0)
    torch.nn.init.normal_(norm.weight)
    conv = torch.nn.Conv2d(C, 5, 1, stride=2).double()
    x = torch.randn(2, 6, 8, C, dtype=torch.float64)  # channels-last, as the norm reads it
    before = conv(norm(x).permute(0, 3, 1, 2))
    unnorm.fold_into_linear(norm, [conv])
    # the inference affine is float32, so float32 rounding is the bar
    torch.testing.assert_close(conv(x.permute(0, 3, 1, 2)), before, rtol=1e-5, atol=1e-6)


# --- statistics taps ------------------------------------------------------------------------

def test_recorder_hands_over_per_step_statistics():
    norm = random_affine(unnorm.build_norm("un", C, warmup_iters=5, outlier_filtration=True))
    ref = RefUN(norm.weight.detach(), norm.bias.detach(), warmup=5, outlier_filtration=True)
    model = torch.nn.Sequential(norm)
    xs, dys = make_sequence(30)
    with unnorm.record_statistics(model) as recorder:
        expected_act = []
        for x, dy in zip(xs, dys):
            module_step(model[0], x, dy)
            rows, g = x.reshape(-1, C).double(), dy.reshape(-1, C).double()
            expected_act.append((rows ** 2).mean(dim=0))
            ref.step(rows, g)
        chunk = recorder.flush()["0"]
        assert recorder.flush()["0"] == {}
    assert model[0]._tap is None
    assert chunk["act"].shape == (30, C) and chunk["grad"].shape == (30, C)
    assert_close64(chunk["act"], torch.stack(expected_act))
    assert int(chunk["skip"].sum()) == ref.skipped > 0


@pytest.mark.parametrize("name", unnorm.available_norms())
def test_recorder_records_training_steps_only(name):
    norm = unnorm.build_norm(name, C)
    x = make_sequence(1)[0][0]
    with unnorm.record_statistics(torch.nn.Sequential(norm)) as recorder:
        norm.eval()
        with torch.no_grad():
            norm(x)
        assert recorder.flush()["0"] == {}
        norm.train()
        norm(x).sum().backward()  # x carries no gradient, as at a model's first norm
        chunk = recorder.flush()["0"]
    assert chunk["act"].shape == chunk["grad"].shape == (1, C)


@pytest.mark.parametrize("name", ["ln", "bn", "rms", "nonorm"])
def test_recorder_gradient_statistic_is_mean_of_g_times_z(name):
    norm = unnorm.build_norm(name, C)
    x, dy = make_sequence(1)[0][0], make_sequence(1)[1][0]
    with unnorm.record_statistics(torch.nn.Sequential(norm)) as recorder:
        module_step(norm, x, dy)
        chunk = recorder.flush()["0"]
    rows = x.reshape(-1, C).double()
    if name == "ln":
        z = (rows - rows.mean(-1, keepdim=True)) / torch.sqrt(rows.var(-1, unbiased=False, keepdim=True) + 1e-5)
    elif name == "bn":
        z = (rows - rows.mean(0)) / torch.sqrt(rows.var(0, unbiased=False) + 1e-5)
    elif name == "rms":
        z = rows / torch.sqrt((rows ** 2).mean(-1, keepdim=True) + 1e-5)
    else:
        z = rows
    g = dy.reshape(-1, C).double()  # weight is one
    assert_close64(chunk["grad"][0], (g * z).mean(dim=0))
