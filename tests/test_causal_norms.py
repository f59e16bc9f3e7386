"""The ``causal`` option of BN and PRepBN (unnorm.simple.CausalStatistics): position t of each
sequence standardised by the batch statistics of positions <= t, checked against torch's own
batch norm run on each prefix (values and gradients), with padding, and the running
statistics it leaves (the whole batch's, as without the option)."""
from __future__ import annotations

import pytest
import torch

import unnorm

B, T, C = 4, 7, 5


def sequences(seed=0):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(B, T, C, generator=gen, dtype=torch.float64) * 3 + 2  # mean far from 0
    return x.requires_grad_(True)


def randomized(norm):
    with torch.no_grad():
        for param in norm.parameters():
            param.uniform_(0.5, 1.5)
    return norm


def prefix_reference(x, weight, bias, eps, pad_mask=None):
    """torch's batch norm of each prefix's valid rows, keeping position t of each prefix."""
    outputs = []
    for t in range(T):
        rows = x[:, :t + 1].reshape(-1, C)
        valid = rows if pad_mask is None else rows[~pad_mask[:, :t + 1].reshape(-1)]
        if not len(valid):  # a prefix of padding only: nothing to compare there
            outputs.append(torch.full_like(x[:, t], float("nan")))
            continue
        mean, var = valid.mean(dim=0), valid.var(dim=0, unbiased=False)
        outputs.append((x[:, t] - mean) / torch.sqrt(var + eps) * weight + bias)
    return torch.stack(outputs, dim=1)


@pytest.mark.parametrize("padded", [False, True])
def test_causal_bn_is_batch_norm_of_each_prefix(padded):
    pad_mask = None
    if padded:
        pad_mask = torch.zeros(B, T, dtype=torch.bool)
        pad_mask[0, 0] = pad_mask[1, 4:] = pad_mask[3, 2] = True
    norm = randomized(unnorm.build_norm("bn", C, causal=True).double())
    x = sequences()
    y = norm(x, pad_mask)
    expected = prefix_reference(x, norm.weight, norm.bias, norm.eps, pad_mask)
    valid = slice(None) if pad_mask is None else ~pad_mask
    torch.testing.assert_close(y[valid], expected[valid], rtol=1e-12, atol=1e-12)
    grad = torch.randn(B, T, C, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    if pad_mask is not None:
        grad[pad_mask] = 0  # the host gives padding no gradient
    ours = torch.autograd.grad((y * grad).sum(), [x, norm.weight, norm.bias])
    theirs = torch.autograd.grad((expected * grad).sum(), [x, norm.weight, norm.bias])
    for a, b in zip(ours, theirs):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)


def test_nothing_after_t_reaches_position_t_and_the_option_is_what_stops_it():
    x = sequences()
    changed = x.detach().clone()
    changed[:, 4:] = torch.randn(B, T - 4, C, dtype=torch.float64) * 10
    for causal, leaks in ((True, False), (False, True)):
        norm = unnorm.build_norm("bn", C, causal=causal).double()
        before, after = norm(x)[:, :4], norm(changed)[:, :4]
        assert (not torch.allclose(before, after, rtol=0, atol=1e-12)) == leaks


def test_running_statistics_follow_the_whole_batch_as_without_the_option():
    causal = unnorm.build_norm("bn", C, causal=True).double()
    pooled = unnorm.build_norm("bn", C).double()
    x = sequences()
    for norm in (causal, pooled):
        norm(x).sum().backward()  # running state commits with the step's gradient
    torch.testing.assert_close(causal.running_mean, pooled.running_mean, rtol=1e-12, atol=0)
    torch.testing.assert_close(causal.running_var, pooled.running_var, rtol=1e-12, atol=0)
    causal.eval(), pooled.eval()
    torch.testing.assert_close(causal(x), pooled(x))  # evaluation is the same affine


def test_causal_prepbn_after_the_hand_over_is_causal_bn_plus_alpha_x():
    prepbn = randomized(unnorm.build_norm("prepbn", C, decay_iters=0, causal=True).double())
    x = sequences()
    expected = prefix_reference(x, prepbn.bn_weight, prepbn.bn_bias, prepbn.eps) + prepbn.alpha * x
    torch.testing.assert_close(prepbn(x), expected, rtol=1e-12, atol=1e-12)


def test_a_far_mean_keeps_float32_precision_when_position_0_is_all_padding():
    """The shift comes from the first position with a valid row: left padding of every
    sequence must not fall back to a shift of 0 (E[x^2] - E[x]^2 would cancel at mean 1000)."""
    x = sequences().detach() + 1000
    pad_mask = torch.zeros(B, T, dtype=torch.bool)
    pad_mask[:, 0] = True
    norm = unnorm.build_norm("bn", C, causal=True)
    y = norm(x.float(), pad_mask)
    expected = prefix_reference(x, norm.weight.double(), norm.bias.double(), norm.eps, pad_mask)
    torch.testing.assert_close(y[:, 1:].double(), expected[:, 1:], rtol=0, atol=1e-4)


def test_low_precision_input_keeps_float32_statistics():
    norm = unnorm.build_norm("bn", C, causal=True)
    x = sequences().detach().float()
    y = norm(x.bfloat16())
    assert y.dtype == torch.bfloat16
    expected = prefix_reference(x.bfloat16().float(), norm.weight, norm.bias, norm.eps)
    torch.testing.assert_close(y.float(), expected, rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("name", ["bn", "prepbn"])
def test_input_without_a_time_axis_is_refused_with_the_fix(name):
    norm = unnorm.build_norm(name, C, causal=True)
    with pytest.raises(ValueError, match=r"batch-first sequences \(B, T, C\).*transpose"):
        norm(torch.randn(8, C))
