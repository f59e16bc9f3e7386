"""The ``causal`` option of BN and PRepBN (unnorm.simple.CausalStatistics): position t of each
sequence standardised by the batch statistics of positions <= t, checked against torch's own
batch norm run on each prefix (values and gradients), with padding, and the running
per-position running statistics it leaves, which evaluation uses position by position."""
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
    norm = randomized(unnorm.build_norm("bn", C, causal=True, positions=T).double())
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
        norm = unnorm.build_norm("bn", C, causal=causal, positions=T if causal else None).double()
        before, after = norm(x)[:, :4], norm(changed)[:, :4]
        assert (not torch.allclose(before, after, rtol=0, atol=1e-12)) == leaks


def test_running_statistics_follow_each_prefix_and_evaluation_uses_its_position():
    """Position t's running statistics are the EMAs of the prefix statistics it is trained
    with (torch's BatchNorm1d on the prefix's rows, unbiased variance); the last position's
    are the whole batch's, as without the option; eval standardises each position by its own."""
    causal = unnorm.build_norm("bn", C, causal=True, positions=T + 2).double()
    pooled = unnorm.build_norm("bn", C).double()
    prefixes = [torch.nn.BatchNorm1d(C, momentum=0.1).double() for _ in range(T)]
    for seed in range(3):
        x = sequences(seed)
        for norm in (causal, pooled):
            norm(x).sum().backward()
        for t, reference in enumerate(prefixes):
            reference(x.detach()[:, :t + 1].reshape(-1, C))
    for t, reference in enumerate(prefixes):
        torch.testing.assert_close(causal.running_mean[t], reference.running_mean, rtol=1e-12, atol=0)
        torch.testing.assert_close(causal.running_var[t], reference.running_var, rtol=1e-12, atol=0)
    assert (causal.running_var[T:] == 1).all()  # positions never trained keep their start
    torch.testing.assert_close(causal.running_var[T - 1], pooled.running_var, rtol=1e-12, atol=0)
    causal.eval()
    x = sequences(5).detach()
    expected = torch.stack([(x[:, t] - prefixes[t].running_mean) / torch.sqrt(
        prefixes[t].running_var + causal.eps) * causal.weight + causal.bias for t in range(T)], 1)
    torch.testing.assert_close(causal(x), expected, rtol=1e-12, atol=1e-12)


def test_evaluation_matches_training_at_every_position_on_position_dependent_inputs():
    """A language model's early positions are larger: one whole-batch estimate standardised
    them wrongly (train/eval std 0.17 at t = 0). Per-position estimates: within 10% everywhere."""
    positions = 16
    scale = torch.linspace(10, 1, positions)[None, :, None]  # early positions 10x larger
    norm = unnorm.build_norm("bn", C, causal=True, positions=positions)
    gen = torch.Generator().manual_seed(0)
    for _ in range(60):
        norm(torch.randn(8, positions, C, generator=gen) * scale).sum().backward()
    x = torch.randn(64, positions, C, generator=gen) * scale
    with torch.no_grad():
        trained = norm.train()(x).std(dim=(0, 2))
        evaluated = norm.eval()(x).std(dim=(0, 2))
    ratio = evaluated / trained
    assert ((ratio > 0.9) & (ratio < 1.1)).all(), ratio


@pytest.mark.parametrize("name", ["bn", "prepbn"])
def test_causal_options_are_checked_and_causal_norms_do_not_fold(name):
    with pytest.raises(ValueError, match="positions must be the longest sequence"):
        unnorm.build_norm(name, C, causal=True)
    with pytest.raises(ValueError, match="positions sizes"):
        unnorm.build_norm(name, C, positions=8)
    norm = unnorm.build_norm(name, C, causal=True, positions=T)
    with pytest.raises(ValueError, match=f"statistics for {T} positions.*positions={T + 1}"):
        norm(torch.randn(2, T + 1, C))
    with pytest.raises(ValueError, match="per position"):
        unnorm.build_norm(name, C, causal=True, positions=T).load_state_dict(
            unnorm.build_norm(name, C).state_dict())
    assert not norm.offline
    with pytest.raises(ValueError, match="online"):
        unnorm.to_affine(norm.eval())


def test_causal_prepbn_after_the_hand_over_is_causal_bn_plus_alpha_x():
    prepbn = randomized(unnorm.build_norm("prepbn", C, decay_iters=0, causal=True, positions=T).double())
    x = sequences()
    expected = prefix_reference(x, prepbn.bn_weight, prepbn.bn_bias, prepbn.eps) + prepbn.alpha * x
    torch.testing.assert_close(prepbn(x), expected, rtol=1e-12, atol=1e-12)


def test_a_far_mean_keeps_float32_precision_when_position_0_is_all_padding():
    """The shift comes from the first position with a valid row: left padding of every
    sequence must not fall back to a shift of 0 (E[x^2] - E[x]^2 would cancel at mean 1000)."""
    x = sequences().detach() + 1000
    pad_mask = torch.zeros(B, T, dtype=torch.bool)
    pad_mask[:, 0] = True
    norm = unnorm.build_norm("bn", C, causal=True, positions=T)
    y = norm(x.float(), pad_mask)
    expected = prefix_reference(x, norm.weight.double(), norm.bias.double(), norm.eps, pad_mask)
    torch.testing.assert_close(y[:, 1:].double(), expected[:, 1:], rtol=0, atol=1e-4)


def test_low_precision_input_keeps_float32_statistics():
    norm = unnorm.build_norm("bn", C, causal=True, positions=T)
    x = sequences().detach().float()
    y = norm(x.bfloat16())
    assert y.dtype == torch.bfloat16
    expected = prefix_reference(x.bfloat16().float(), norm.weight, norm.bias, norm.eps)
    torch.testing.assert_close(y.float(), expected, rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("name", ["bn", "prepbn"])
def test_input_without_a_time_axis_is_refused_with_the_fix(name):
    norm = unnorm.build_norm(name, C, causal=True, positions=T)
    with pytest.raises(ValueError, match=r"batch-first sequences \(B, T, C\).*transpose"):
        norm(torch.randn(8, C))
