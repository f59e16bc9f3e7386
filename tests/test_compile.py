"""Compiled training: one graph for every step, equal to eager step for step (dynamo with a
counting backend; inductor only where its code is what is tested), and CUDA-graph capture."""
from __future__ import annotations

import pytest
import torch
import torch._dynamo
from torch._dynamo.testing import CompileCounterWithBackend
from torch._dynamo.utils import counters

import unnorm
from test_norms import QUICK_OPTIONS as OPTIONS
from test_norms import make_sequence

C = 8
SPIKES = {14: 8.0, 22: 0.1, 27: 9.0}  # outliers for UN's filter


@pytest.fixture(autouse=True)
def no_silent_fallback():
    """With dynamo's limits raised, per-step recompiles show as graphs instead of a quiet
    fall-back to eager; a graph break fails ``fullgraph=True``."""
    torch._dynamo.reset()
    counters.clear()
    with torch._dynamo.config.patch(recompile_limit=1000, accumulated_recompile_limit=10000):
        yield
    torch._dynamo.reset()


def _model(name):
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(C, C), unnorm.build_norm(name, C, **OPTIONS[name]),
                               torch.nn.GELU(), torch.nn.Linear(C, C))


def _step(model, x):
    x = x.clone().requires_grad_(True)
    for p in model.parameters():
        p.grad = None
    y = model(x)
    y.square().mean().backward()
    return [y.detach(), x.grad] + [p.grad for p in model.parameters()]


@pytest.mark.parametrize("name", list(OPTIONS))
def test_compiled_training_is_one_graph_and_equals_eager_step_for_step(name):
    eager, compiled = _model(name), _model(name)
    counter = CompileCounterWithBackend("aot_eager")
    run = torch.compile(compiled, backend=counter, fullgraph=True)
    xs = make_sequence(36, shape=(4, 5, C), spikes=SPIKES)[0]
    for t, x in enumerate(xs, 1):
        for a, b in zip(_step(eager, x), _step(run, x)):
            torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-6, msg=f"step {t}")
        if t == 2:
            graphs_early = counter.frame_count
    assert counter.frame_count == graphs_early == 1  # no graph after the first step
    eager_state, compiled_state = eager.state_dict(), compiled.state_dict()
    for key, value in eager_state.items():
        torch.testing.assert_close(compiled_state[key], value, rtol=1e-5, atol=1e-6, msg=key)
    if name == "un":
        assert int(compiled[1].num_skipped) > 0  # the outlier branch was exercised


def test_a_rejected_step_compiles_into_the_same_graph():
    counter = CompileCounterWithBackend("aot_eager")
    model = _model("un")
    run = torch.compile(model, backend=counter, fullgraph=True)
    for t, x in enumerate(make_sequence(12, shape=(4, 5, C))[0]):
        _step(run, x * float("nan") if t == 7 else x)
    assert counter.frame_count == 1 and int(model[1].num_rejected) == 1
    assert int(model[1].num_iters) == 11


def test_inductor_fuses_un_and_matches_eager():
    """Inductor's own kernels (what ``compile: true`` runs) for UN's steady state."""
    eager, compiled = _model("un"), _model("un")
    run = torch.compile(compiled, fullgraph=True)
    for t, x in enumerate(make_sequence(14, shape=(4, 5, C))[0], 1):
        for a, b in zip(_step(eager, x), _step(run, x)):
            torch.testing.assert_close(b, a, rtol=1e-4, atol=1e-5, msg=f"step {t}")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a CUDA device")
def test_a_un_training_step_is_captured_by_cuda_graphs():
    torch.manual_seed(0)
    model = _model("un").cuda()
    reference = _model("un").cuda()
    run = torch.compile(model, mode="reduce-overhead", fullgraph=True)
    xs = [x.cuda() for x in make_sequence(20, shape=(4, 5, C), spikes=SPIKES)[0]]
    for x in xs:
        for a, b in zip(_step(reference, x), _step(run, x)):
            torch.testing.assert_close(b, a, rtol=1e-4, atol=1e-5)
    assert counters["inductor"]["cudagraph_skips"] == 0  # captured, not skipped


@pytest.mark.slow
@pytest.mark.parametrize("name", ["un", "mabn", "pn", "bn"])
def test_inductor_compiles_every_row_count(name):
    """Inductor failed to lower the blocked channel sum when no whole block of rows exists
    (40-63 rows: ``LoweringException: IndexError: pop from empty list``); every count up to
    and past a block compiles and matches eager."""
    for rows in (48, 63, 100):
        eager = unnorm.build_norm(name, 16, **OPTIONS[name])
        compiled = unnorm.build_norm(name, 16, **OPTIONS[name])
        run = torch.compile(compiled, backend="inductor", fullgraph=True)
        x = torch.randn(rows, 16, generator=torch.Generator().manual_seed(rows))
        results = []
        for norm in (eager, run):
            leaf = x.clone().requires_grad_(True)
            out = norm(leaf)
            out.square().sum().backward()
            results.append((out.detach(), leaf.grad))
        for a, b in zip(*results):
            torch.testing.assert_close(b, a, rtol=1e-4, atol=1e-5, msg=f"{rows} rows")
