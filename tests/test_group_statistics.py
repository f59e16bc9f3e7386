"""The per-token group statistics primitive (``unnorm.sample``: ``group_sums``,
``group_deviations``, ``GroupStandardize``, issue 51) against torch's GroupNorm in float64, each
token a sample of C channels and one position: forward and every gradient, eager and compiled
(where the group sum takes inductor's reduction above ``FUSED_GROUP_SUM_ABOVE`` channels a
group and BLAS below). Tolerance 1e-10 relative to each tensor's largest value: float64
rounding over a few dozen operations; a dropped term or a biased/unbiased swap moves a value by
1e-2 or more."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from unnorm.sample import FUSED_GROUP_SUM_ABOVE, GroupStandardize

D = torch.float64
C = 24
SIZES = [2, 3, 12]  # channels a group: below and above FUSED_GROUP_SUM_ABOVE
assert min(SIZES) <= FUSED_GROUP_SUM_ABOVE < max(SIZES)


def case(size: int):
    gen = torch.Generator().manual_seed(size)
    x = torch.randn(37, C, generator=gen, dtype=D) * torch.linspace(0.5, 3.0, C, dtype=D) + 2.0
    weight, bias = (torch.randn(C, generator=gen, dtype=D) for _ in range(2))
    return x, weight, bias, torch.randn(37, C, generator=gen, dtype=D)


def results(fn, x, weight, bias, dy):
    leaves = [t.clone().requires_grad_(True) for t in (x, weight, bias)]
    out = fn(*leaves)
    return [out, *torch.autograd.grad(out, leaves, dy)]


def torch_group_norm(x, weight, bias, groups):
    return F.group_norm(x.unsqueeze(-1), groups, weight, bias, 1e-5).squeeze(-1)


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
@pytest.mark.parametrize("size", SIZES)
def test_group_standardize_equals_torch_group_norm_in_float64(size, compiled):
    groups = C // size
    x, weight, bias, dy = case(size)

    def ours(x, weight, bias):
        return GroupStandardize.apply(x, weight, bias, groups, 1e-5)
    if compiled:
        torch._dynamo.reset()
        ours = torch.compile(ours, backend="aot_eager", fullgraph=True)
    got = results(ours, x, weight, bias, dy)
    want = results(lambda *a: torch_group_norm(*a, groups), x, weight, bias, dy)
    for what, a, b in zip(("output", "dx", "dweight", "dbias"), got, want):
        error = ((a - b).abs().max() / b.abs().max()).item()
        assert error < 1e-10, f"{what}: relative difference {error:.2e}"
