"""Norm state across data-parallel replicas, on two gloo processes, every replica checked:
``sync_stats`` (two replicas with batch b each equal one process with batch 2b; BN, PRepBN,
BCN and EvoNorm-B0 also with causal statistics, BCN's micro-batch estimates, and the per-example
statistics of layout "image") and
``distribute_norm_state`` (the replicas' states made one before evaluating and saving)."""
from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import unnorm
from test_vision import free_port

# one worker runs the module: its fixtures (shared runs) are made once
pytestmark = pytest.mark.xdist_group("sync")

NORMS = {"un": {"warmup_iters": 4, "outlier_filtration": True, "window_size": 2},
         "mabn": {"warmup_iters": 4, "window_size": 2}, "pn": {"warmup_iters": 4},
         "pn_ls": {"warmup_iters": 4, "group_num": 5}, "bn": {},
         "prepbn": {"warmup_iters": 2, "decay_iters": 4},
         "bn-causal": {"causal": True, "positions": 3},
         "prepbn-causal": {"decay_iters": 2, "causal": True, "positions": 3},
         "bcn": {}, "bcn-estimate": {"estimate": True},
         "bcn-causal": {"causal": True, "positions": 3, "estimate": True},
         "bcn-image": {"layout": "image", "groups": 1},
         "evonorm_b0": {}, "evonorm_b0-causal": {"causal": True, "positions": 3},
         "evonorm_b0-image": {"layout": "image"}}
STEPS, C = 8, 5


def _batches():
    gen = torch.Generator().manual_seed(0)
    xs = [torch.randn(4, 3, C, generator=gen) * (1 + t % 3) for t in range(STEPS)]
    dys = [torch.randn(4, 3, C, generator=gen) for _ in range(STEPS)]
    pad = torch.zeros(4, 3, dtype=torch.bool)
    pad[1, 2] = pad[3, 1:] = True  # uneven padding across the two halves
    return xs, dys, pad


def _run(norm, xs, dys, pad, rows):
    """Per step: output, input gradient, weight gradient and the norm's state after it."""
    outputs = []
    for x, dy in zip(xs, dys):
        x = x[rows].clone().requires_grad_(True)
        for p in norm.parameters():
            p.grad = None
        y = norm(x, pad[rows])
        y.backward(dy[rows])
        state = {k: v.clone() for k, v in norm.state_dict().items()}
        outputs.append((y.detach(), x.grad.clone(), norm.weight.grad.clone(), state))
    return outputs


def _replica(rank, port, out_dir):
    """One of two replicas: every norm trained with ``sync_stats`` on its half of each batch,
    then differing norm states made one by each ``distribute_norm_state`` mode."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=2)
    synced = {}
    for name, options in NORMS.items():
        torch.manual_seed(0)
        norm = unnorm.build_norm(name.split("-")[0], C, sync_stats=True, **options)
        outputs = _run(norm, *_batches(), slice(2 * rank, 2 * rank + 2))
        for _, _, dw, _ in outputs:  # DDP would average parameter gradients: sum them here
            dist.all_reduce(dw)
        synced[name] = outputs
    distributed = {}
    for mode in unnorm.NORM_SYNC_MODES:
        model = _diverged_model(rank)
        unnorm.distribute_norm_state(model, mode)
        distributed[mode] = model.state_dict()
    torch.save({"synced": synced, "distributed": distributed}, f"{out_dir}/rank{rank}.pt")
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def replicas(tmp_path_factory) -> list[dict]:
    """What each of two gloo replicas saw (one pair of processes for the whole module)."""
    out = tmp_path_factory.mktemp("replicas")
    mp.start_processes(_replica, args=(free_port(), str(out)), nprocs=2, start_method="spawn")
    return [torch.load(out / f"rank{rank}.pt", weights_only=True) for rank in range(2)]


@pytest.mark.parametrize("name", NORMS)
def test_synced_replicas_equal_one_process_with_the_whole_batch(name, replicas):
    """Every replica, at every step: outputs, gradients and the whole norm state."""
    single = unnorm.build_norm(name.split("-")[0], C, **NORMS[name])
    whole = _run(single, *_batches(), slice(0, 4))
    for step, (y, dx, dw, state) in enumerate(whole):
        for rank in range(2):
            y_r, dx_r, dw_r, state_r = replicas[rank]["synced"][name][step]
            rows = slice(2 * rank, 2 * rank + 2)
            torch.testing.assert_close(y_r, y[rows], rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(dx_r, dx[rows], rtol=1e-4, atol=1e-5)
            torch.testing.assert_close(dw_r, dw, rtol=1e-4, atol=1e-5)
            for key, value in state.items():
                torch.testing.assert_close(state_r[key], value, rtol=1e-5, atol=1e-6,
                                           msg=f"step {step}, rank {rank}: {key}")


def _diverged_model(rank):
    """A UN, a BN and a PRepBN trained on this replica's own batches: every kind of buffer
    (windows, running statistics, EMAs, step and rejection counters) differs by rank."""
    model = torch.nn.Sequential(*(unnorm.build_norm(name, C, **NORMS[name])
                                  for name in ("un", "bn", "prepbn")))
    gen = torch.Generator().manual_seed(rank)
    for step in range(3 + 2 * rank):
        x = torch.randn(6, C, generator=gen) * (1 + rank)
        if rank == 1 and step == 1:
            x[0, 0] = float("nan")  # a step that rank 1's norms reject
        model(x.requires_grad_(True)).backward(torch.randn(6, C, generator=gen))
    return model


def test_distributing_the_norm_state_makes_every_replica_equal(replicas):
    seen = [replica["distributed"] for replica in replicas]
    models = [_diverged_model(rank) for rank in range(2)]
    own = [model.state_dict() for model in models]
    buffers = [name for name, _ in models[0].named_buffers()]
    assert {name.split(".", 1)[1] for name in buffers} == {
        "fwd_buffer", "bwd_buffer", "running_var", "ema_grad", "num_skipped", "num_iters",
        "num_rejected", "running_mean"}
    for key in buffers:
        assert not torch.equal(own[0][key], own[1][key]) or key.endswith("num_skipped"), key
        want = {"reduce": (own[0][key] + own[1][key]) / 2 if own[0][key].is_floating_point()
                else own[0][key], "broadcast": own[0][key]}
        for mode, value in want.items():
            for rank in range(2):
                torch.testing.assert_close(seen[rank][mode][key], value, rtol=1e-5, atol=1e-6,
                                           msg=f"{mode}, rank {rank}: {key}")
    for key, _ in models[0].named_parameters():  # DDP's business: left alone
        for rank in range(2):
            assert torch.equal(seen[rank]["reduce"][key], own[rank][key]), key


def test_one_process_keeps_its_norm_state_and_a_bad_mode_names_both():
    model = _diverged_model(0)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    unnorm.distribute_norm_state(model, "reduce")
    assert all(torch.equal(model.state_dict()[k], v) for k, v in before.items())
    with pytest.raises(ValueError, match="norm_sync='mean'.*reduce.*broadcast"):
        unnorm.distribute_norm_state(model, "mean")


# --- compiled: inductor's own code (what compile=true runs) --------------------------------------

#: the norms whose backward sums their gradient statistic over the replicas (EstimatedNorm)
BACKWARD_SYNCED = ("un", "mabn", "pn", "pn_ls")


def _train(call, norm, xs, dys, rows):
    """Per step: output, input gradient and the affine gradients; then the norm's state."""
    steps = []
    for x, dy in zip(xs, dys):
        x = x[rows].clone().requires_grad_(True)
        norm.zero_grad(set_to_none=True)
        y = call(x)  # no padding: the gradient statistic is then the weight gradient's own sum
        y.backward(dy[rows])
        steps.append((y.detach(), x.grad, norm.weight.grad.clone(), norm.bias.grad.clone()))
    return steps, {k: v.clone() for k, v in norm.state_dict().items()}


def _compiled_replica(rank, port, out_dir):
    """One of two replicas: each of ``BACKWARD_SYNCED`` with ``sync_stats``, eager and
    compiled by inductor, on this replica's half of each batch."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=2)
    xs, dys, _ = _batches()
    seen = {}
    for name in BACKWARD_SYNCED:
        runs = []
        for compiled in (False, True):
            torch.manual_seed(0)
            norm = unnorm.build_norm(name, C, sync_stats=True, **NORMS[name])
            call = torch.compile(norm, backend="inductor", fullgraph=True) if compiled else norm
            runs.append(_train(call, norm, xs, dys, slice(2 * rank, 2 * rank + 2)))
        seen[name] = runs
    torch.save(seen, f"{out_dir}/rank{rank}.pt")
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def compiled_replicas(tmp_path_factory) -> list[dict]:
    out = tmp_path_factory.mktemp("compiled")
    mp.start_processes(_compiled_replica, args=(free_port(), str(out)), nprocs=2,
                       start_method="spawn")
    return [torch.load(out / f"rank{rank}.pt", weights_only=True) for rank in range(2)]


@pytest.mark.slow
@pytest.mark.parametrize("name", BACKWARD_SYNCED)
def test_compiled_synced_norms_give_every_replica_its_own_affine_gradients(name, compiled_replicas):
    """Compiled by inductor, each replica's affine gradients are its own, as eager: inductor
    wrote a ``torch.cat``'s inputs into its output and all-reduced that buffer in place, so
    UN's and MABN's sum(dy * z), summed over the replicas for the gradient statistic, came
    back summed as the weight gradient too (aot_eager does not reuse buffers: it cannot show
    this)."""
    for rank in range(2):
        (eager, eager_state), (compiled, compiled_state) = compiled_replicas[rank][name]
        for step, (want, got) in enumerate(zip(eager, compiled)):
            for what, a, b in zip(("output", "input grad", "weight grad", "bias grad"), want, got):
                torch.testing.assert_close(b, a, rtol=1e-4, atol=1e-5,
                                           msg=f"rank {rank}, step {step}: {what}")
        for key, value in eager_state.items():
            torch.testing.assert_close(compiled_state[key], value, rtol=1e-5, atol=1e-6,
                                       msg=f"rank {rank}: {key}")
