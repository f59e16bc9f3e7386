"""Issue 51's fused training paths compute what the general paths compute, to float64 rounding.

Each norm's training call runs on torch's fused kernels or a hand-written backward where it
can (no tap, no padding, no replicas, per token). The general path, autograd's graph of the
composite, still runs where it cannot, and its float64 results are the expectation here:
forward, every gradient, the running state after every step, and evaluation, over steps
that cross the warm-ups and hand-overs, for each option the fused path covers. UN, MABN and
PN, whose one path changed how it sums, are held to the spec's float64 references instead.
The tolerance, 1e-10 relative to each tensor's largest value, is float64 rounding over a few
dozen operations (about 1e-15 each) with room for cancellation, and 1e5 times tighter than
any difference in the algorithm (a dropped term moves a gradient by 1e-2 or more).
"""
from __future__ import annotations

import contextlib
import copy
from unittest import mock

import pytest
import torch

import unnorm
from spec_reference import RefMABN, RefPN, RefUN

D = torch.float64
C = 12
SHAPE = (4, 6, C)
STEPS = 6
#: the norms whose training call has a fused path, and the options it must hold under
FUSED = {
    "rms": [{}, {"bias": False}],
    "bn": [{}],
    "bcn": [{"groups": 4}, {"groups": 4, "estimate": True}],
    "dyt": [{}, {"bias": False}],
    "prepbn": [{"warmup_iters": 2, "decay_iters": 3}, {"warmup_iters": 0, "decay_iters": 4,
                                                       "bias": False}],
    "evonorm_s0": [{"groups": 3}, {"groups": 1}],
    "evonorm_b0": [{}, {"unbiased_running_var": True}],
    "scalenorm": [{}, {"eps": 5.0}],  # eps 5: some rows' norms are clamped
    "gn": [{"groups": 3}, {"groups": 1}, {"groups": 4, "layout": "image"}],
}
CASES = [(name, options) for name, option_sets in FUSED.items() for options in option_sets]


def inputs(step: int, shape=SHAPE):
    """Float64 tokens with channel scales from 0.5 to 2 and a mean of 0.5 (so centring matters),
    and an upstream gradient."""
    gen = torch.Generator().manual_seed(step)
    scale = torch.linspace(0.5, 2.0, shape[-1], dtype=D)
    x = torch.randn(shape, generator=gen, dtype=D) * scale * (1 + step % 3) + 0.5
    return x, torch.randn(shape, generator=gen, dtype=D)


def randomized(norm: torch.nn.Module, seed: int = 1) -> torch.nn.Module:
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in norm.parameters():
            param.add_(0.3 * torch.randn(param.shape, generator=gen, dtype=param.dtype))
    return norm


def train_step(norm, x, dy, general: bool):
    """Output and gradients (input, then each parameter) of one training call; ``general``
    forces the general path, as a tap would."""
    x = x.clone().requires_grad_(True)
    with (mock.patch.object(unnorm.ChannelNorm, "_tapped", property(lambda self: True))
          if general else contextlib.nullcontext()):
        y = norm(x)
    return [y, *torch.autograd.grad(y, [x, *norm.parameters()], dy)]


def assert_same(got, want, what: str):
    scale = want.abs().max().clamp_min(1e-30)
    error = (got - want).abs().max() / scale
    assert error < 1e-10, f"{what}: relative difference {error.item():.2e}"


@pytest.mark.parametrize("name,options", CASES, ids=[f"{n}-{o}" for n, o in CASES])
def test_the_fused_path_equals_the_general_path(name, options):
    fused = randomized(unnorm.build_norm(name, C, **options).to(D)).train()
    general = copy.deepcopy(fused)
    for step in range(STEPS):
        x, dy = inputs(step)
        names = ["output", "dx", *(n for n, _ in fused.named_parameters())]
        for what, got, want in zip(names, train_step(fused, x, dy, False),
                                   train_step(general, x, dy, True)):
            assert_same(got, want, f"step {step + 1} {what}")
        for key, want in general.state_dict().items():
            got = fused.state_dict()[key]
            if want.is_floating_point():
                assert_same(got.double(), want.double(), f"step {step + 1} {key}")
            else:
                assert torch.equal(got, want), key
    fused.eval(), general.eval()
    x = inputs(STEPS)[0]
    with torch.no_grad():
        assert_same(fused(x), general(x), "evaluation")


@pytest.mark.parametrize("bias", [True, False])
def test_rms_on_torchs_fused_kernel_equals_our_step(bias, monkeypatch):
    """On CUDA RMSNorm runs torch's ``F.rms_norm`` (fused there); the same call on the CPU
    (autograd's composite) gives what ``_RMSNormStep`` gives."""
    ours = randomized(unnorm.build_norm("rms", C, bias=bias).to(D))
    theirs = copy.deepcopy(ours)
    x, dy = inputs(0)
    want = train_step(ours, x, dy, False)
    monkeypatch.setattr(unnorm.simple, "FUSED_RMS_DEVICES", ("cpu",))
    for what, got, expected in zip(["output", "dx", "weight", "bias"],
                                   train_step(theirs, x, dy, False), want):
        assert_same(got, expected, what)


def test_evonorm_b0_splits_the_gradient_of_a_tie_as_torch_maximum():
    """Rows (a, -a) and (-a, a) alternate: each token's instance std equals each channel's batch
    std exactly, and with v = 0 every element is a tie of B0's max, whose gradient torch
    splits in half between its two sides."""
    norm = unnorm.build_norm("evonorm_b0", 2).to(D)
    with torch.no_grad():
        norm.v.zero_()
    x = torch.tensor([[1.5, -1.5], [-1.5, 1.5]] * 4, dtype=D)
    dy = torch.randn(x.shape, generator=torch.Generator().manual_seed(0), dtype=D)
    general = copy.deepcopy(norm)
    for what, got, want in zip(["output", "dx", "v", "weight", "bias"],
                               train_step(norm, x, dy, False), train_step(general, x, dy, True)):
        assert_same(got, want, what)


def test_a_fused_call_under_a_half_cast_keeps_float32_statistics():
    """A bfloat16 norm (``.to(bfloat16)``) on bfloat16 input: the fused paths compute in float32
    and return bfloat16, as the general path does, to bfloat16 rounding."""
    for name, option_sets in FUSED.items():
        fused = randomized(unnorm.build_norm(name, C, **option_sets[0])).to(torch.bfloat16)
        general = copy.deepcopy(fused)
        x, dy = (t.to(torch.bfloat16) for t in inputs(0))
        for got, want in zip(train_step(fused, x, dy, False), train_step(general, x, dy, True)):
            assert got.dtype == want.dtype
            # both paths compute in float32 and round once to bfloat16 (2^-8 relative), so
            # they differ by at most a rounding or two: 2e-2, whatever float32's CPU-dependent
            # last bits
            torch.testing.assert_close(got.float(), want.float(), rtol=2e-2, atol=2e-2)


# --- UN, MABN, PN: one path, held to the spec's float64 references ---------------------------

def references(name: str, norm):
    weight, bias = norm.weight.detach(), norm.bias.detach()
    if name == "un":
        return RefUN(weight, bias, window=4, warmup=3, outlier_filtration=True)
    if name == "mabn":
        return RefMABN(weight, bias, window=4, warmup=3, alpha=0.9)
    return RefPN(weight, bias, warmup=3)


ESTIMATED = {"un": {"window_size": 4, "warmup_iters": 3, "outlier_filtration": True},
             "mabn": {"window_size": 4, "warmup_iters": 3, "momentum": 0.9},
             "pn": {"warmup_iters": 3}}


@pytest.mark.parametrize("name", ESTIMATED)
def test_estimated_norms_equal_the_spec_references_in_float64(name):
    norm = randomized(unnorm.build_norm(name, C, **ESTIMATED[name]).to(D))
    ref = references(name, norm)
    for step in range(12):  # past the warm-up and a full window
        x, dy = inputs(step)
        got = train_step(norm, x, dy, False)
        want = ref.step(x.reshape(-1, C), dy.reshape(-1, C))
        for what, a, b in zip(["output", "dx", "weight", "bias"], got, want):
            assert_same(a.reshape(b.shape), b, f"step {step + 1} {what}")

