"""Where a norm's training step spends its time: the host issuing operations or the device
running them, and how many kernels a step launches.

``bench_norms.py`` says how long a step takes; this says why. On a GPU a step whose host time
exceeds its device time is launch-bound: the device idles between small kernels, and fusing
arithmetic will not help where fewer operations would. One training step (forward, and the
backward to the input and parameters) per norm, past the estimated norms' warm-ups; timed
over ``--steps`` steps (host: until the last call returns; wall: after synchronising), then
profiled over 5 (``torch.profiler``: the kernels' device time and count, and the operator
table). On a CPU there are no kernels; host and wall are the same time.

    python scripts/profile_norms.py                               # on a GPU: bf16, ViT tokens x 8
    python scripts/profile_norms.py --device cpu --shape 4 16 384 --norms ln un
"""
from __future__ import annotations

import argparse
import time

import project_env  # noqa: F401  (first: the project's Python, whatever `python` ran this)

import torch
from torch.profiler import ProfilerActivity, profile

import unnorm
from bench_norms import DTYPES, STEADY

PROFILED_STEPS = 5


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--norms", nargs="+", default=["ln", "un", "pn", "bn", "rms"],
                        choices=unnorm.available_norms())
    parser.add_argument("--shape", nargs="+", type=int, default=[512, 196, 384],
                        help="the input, channels last (default: bench_norms' ViT tokens x 8)")
    parser.add_argument("--dtype", default="bfloat16", choices=list(DTYPES))
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--steps", type=int, default=20, help="timed steps (after 10 warm-up)")
    args = parser.parse_args()
    device = torch.device(args.device)
    synchronize = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    x0 = torch.randn(*args.shape, device=device, dtype=DTYPES[args.dtype])
    dy = torch.randn_like(x0)
    for name in args.norms:
        norm = unnorm.build_norm(name, args.shape[-1], device=device,
                                 **STEADY.get(name, {})).to(DTYPES[args.dtype]).train()
        x = x0.clone().requires_grad_()

        def step():
            norm(x).backward(dy)
        for _ in range(10):
            step()
        synchronize()
        start = time.perf_counter()
        for _ in range(args.steps):
            step()
        host = time.perf_counter() - start
        synchronize()
        wall = time.perf_counter() - start
        with profile(activities=activities) as prof:
            for _ in range(PROFILED_STEPS):
                step()
            synchronize()
        events = prof.key_averages()
        kernels = [e for e in events if e.device_type == torch.autograd.DeviceType.CUDA]
        busy_ms = sum(e.self_device_time_total for e in kernels) / PROFILED_STEPS / 1e3
        launches = sum(e.count for e in kernels) / PROFILED_STEPS
        print(f"== {name}: wall {wall / args.steps * 1e3:.2f} ms/step, host issue "
              f"{host / args.steps * 1e3:.2f} ms/step, device busy {busy_ms:.2f} ms/step, "
              f"{launches:.0f} kernels/step", flush=True)
        sort = "self_device_time_total" if kernels else "self_cpu_time_total"
        print(events.table(sort_by=sort, row_limit=14, max_name_column_width=70))


if __name__ == "__main__":
    main()
