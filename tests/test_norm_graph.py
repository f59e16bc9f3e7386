"""A guard on the norms' cost that cannot flake (issue 51): the autograd graph of a training call
has as many nodes whatever the rows, channels and groups. A Python loop over rows, channels or
groups adds nodes per iteration, so this test fails on it. A wall-clock test of the same thing
would depend on the machine and its load."""
from __future__ import annotations

import pytest
import torch

import unnorm
from test_norms import QUICK_OPTIONS

GROUP_OPTIONS = {name: option for name in unnorm.available_norms()
                 for option in unnorm.option_names(name) if option in ("groups", "group_num")}
SIZES = [((4, 5), 16), ((8, 7), 16), ((4, 5), 32)]  # (leading dims, channels)
CALLS = 3  # past the quick options' warm-ups, into the steady phase


def graph_nodes(output: torch.Tensor) -> int:
    """The autograd nodes ``output`` was built by (each reached once)."""
    seen, stack = set(), [output.grad_fn]
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        stack.extend(parent for parent, _ in node.next_functions)
    return len(seen)


def training_call_nodes(norm: torch.nn.Module, leading, channels: int) -> int:
    x = torch.randn(*leading, channels, requires_grad=True,
                    generator=torch.Generator().manual_seed(0))
    for _ in range(CALLS):
        output = norm(x)
    return graph_nodes(output)


@pytest.mark.parametrize("name", unnorm.available_norms())
def test_a_training_call_builds_one_graph_whatever_the_rows_and_channels(name):
    counts = {(leading, channels): training_call_nodes(
        unnorm.build_norm(name, channels, **QUICK_OPTIONS[name]).train(), leading, channels)
        for leading, channels in SIZES}
    assert len(set(counts.values())) == 1, counts


@pytest.mark.parametrize("name", sorted(GROUP_OPTIONS))
def test_a_training_call_builds_one_graph_whatever_the_groups(name):
    """From 2 groups on (one group needs no grouping reshape: BCN and EvoNorm-S0 skip it)."""
    option = GROUP_OPTIONS[name]
    counts = {groups: training_call_nodes(unnorm.build_norm(
        name, 32, **{**QUICK_OPTIONS[name], option: groups}).train(), (4, 5), 32)
        for groups in (2, 4, 16)}
    assert len(set(counts.values())) == 1, counts


def test_the_count_grows_with_a_loop_over_groups():
    """The guard's own fault: a group norm written as a loop over its groups."""
    def looped_group_norm(x, groups):
        return torch.cat([torch.nn.functional.layer_norm(part, part.shape[-1:])
                          for part in x.chunk(groups, dim=-1)], dim=-1)
    x = torch.randn(4, 5, 32, requires_grad=True)
    assert graph_nodes(looped_group_norm(x, 8)) > graph_nodes(looped_group_norm(x, 2))
