"""``sync_stats``: two gloo replicas with batch b each equal one process with batch 2b."""
from __future__ import annotations

import os
import socket

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import unnorm

NORMS = {"un": {"warmup_iters": 4, "outlier_filtration": True, "window_size": 2},
         "mabn": {"warmup_iters": 4, "window_size": 2}, "pn": {"warmup_iters": 4},
         "bn": {}}
STEPS, C = 8, 5


def _batches():
    gen = torch.Generator().manual_seed(0)
    xs = [torch.randn(4, 3, C, generator=gen) * (1 + t % 3) for t in range(STEPS)]
    dys = [torch.randn(4, 3, C, generator=gen) for _ in range(STEPS)]
    pad = torch.zeros(4, 3, dtype=torch.bool)
    pad[1, 2] = pad[3, 1:] = True  # uneven padding across the two halves
    return xs, dys, pad


def _run(norm, xs, dys, pad, rows):
    outputs = []
    for x, dy in zip(xs, dys):
        x = x[rows].clone().requires_grad_(True)
        for p in norm.parameters():
            p.grad = None
        y = norm(x, pad[rows])
        y.backward(dy[rows])
        outputs.append((y.detach(), x.grad.clone(), norm.weight.grad.clone()))
    return outputs


def _replica(rank, port, name, out_dir):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    torch.manual_seed(0)
    norm = unnorm.build_norm(name, C, sync_stats=True, **NORMS[name])
    xs, dys, pad = _batches()
    outputs = _run(norm, xs, dys, pad, slice(2 * rank, 2 * rank + 2))
    for y, dx, dw in outputs:  # DDP would average parameter gradients: sum them here
        dist.all_reduce(dw)
    torch.save((outputs, norm.state_dict()), f"{out_dir}/rank{rank}.pt")
    dist.destroy_process_group()


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize("name", NORMS)
def test_synced_replicas_equal_one_process_with_the_whole_batch(name, tmp_path):
    mp.start_processes(_replica, args=(_free_port(), name, str(tmp_path)), nprocs=2,
                       start_method="spawn")
    results = {rank: torch.load(tmp_path / f"rank{rank}.pt") for rank in range(2)}
    single = unnorm.build_norm(name, C, **NORMS[name])
    xs, dys, pad = _batches()
    whole = _run(single, xs, dys, pad, slice(0, 4))
    for step, (y, dx, dw) in enumerate(whole):
        for rank in range(2):
            y_r, dx_r, dw_r = results[rank][0][step]
            rows = slice(2 * rank, 2 * rank + 2)
            torch.testing.assert_close(y_r, y[rows], rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(dx_r, dx[rows], rtol=1e-4, atol=1e-5)
            torch.testing.assert_close(dw_r, dw, rtol=1e-4, atol=1e-5)
    for key, value in single.state_dict().items():
        torch.testing.assert_close(results[0][1][key], value, rtol=1e-5, atol=1e-6)
