"""Per-norm cost on (B, N, C) tokens, as ratios to LayerNorm, measured side by side.

Every round times each norm once (training forward+backward, then eval forward), in a
shuffled order, so drift and warm caches affect all norms alike; the report uses medians.

    python scripts/bench_norms.py --batch 32 --tokens 196 --channels 384 --rounds 30
"""
from __future__ import annotations

import argparse
import json
import platform
import random
import statistics
import time
from pathlib import Path

import torch

import unnorm


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _time(fn, device) -> float:
    _sync(device)
    start = time.perf_counter()
    fn()
    _sync(device)
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--tokens", type=int, default=196)
    parser.add_argument("--channels", type=int, default=384)
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--out", type=Path, default=None,
                        help="JSON file (default results/benchmarks/norms_<device>.json)")
    args = parser.parse_args()
    device = torch.device(args.device)
    shape = (args.batch, args.tokens, args.channels)
    # warm-up 0 so UN/MABN/PN time their full (post-warm-up) algorithm
    options = {"un": {"warmup_iters": 0, "outlier_filtration": True},
               "mabn": {"warmup_iters": 0, "window_size": 4}, "pn": {"warmup_iters": 0},
               "pn_ls": {"warmup_iters": 0, "group_num": 6}}
    norms = {name: unnorm.build_norm(name, args.channels, device=device, **options.get(name, {}))
             for name in unnorm.available_norms()}
    x = torch.randn(shape, device=device, requires_grad=True)
    dy = torch.randn(shape, device=device)

    def train_step(norm):
        norm.train()
        norm(x).backward(dy)

    @torch.no_grad()
    def infer(norm):
        norm.eval()
        norm(x)

    times = {name: {"train": [], "infer": []} for name in norms}
    order = list(norms)
    for round_index in range(args.warmup + args.rounds):
        random.shuffle(order)
        for name in order:
            train_time = _time(lambda: train_step(norms[name]), device)
            infer_time = _time(lambda: infer(norms[name]), device)
            if round_index >= args.warmup:
                times[name]["train"].append(train_time)
                times[name]["infer"].append(infer_time)
    median = {name: {k: statistics.median(v) for k, v in t.items()} for name, t in times.items()}
    base = median["ln"]
    print(f"shape (B, N, C) = {shape}, device {device}, {args.rounds} rounds, medians")
    print(f"{'norm':8} {'train ms':>9} {'x LN':>6} {'infer ms':>9} {'x LN':>6}")
    rows = []
    for name, m in median.items():
        row = {"norm": name, "train_ms": 1e3 * m["train"], "train_vs_ln": m["train"] / base["train"],
               "infer_ms": 1e3 * m["infer"], "infer_vs_ln": m["infer"] / base["infer"]}
        rows.append(row)
        print(f"{name:8} {row['train_ms']:9.3f} {row['train_vs_ln']:6.2f} "
              f"{row['infer_ms']:9.3f} {row['infer_vs_ln']:6.2f}")
    machine = (torch.cuda.get_device_name(device) if device.type == "cuda"
               else f"{platform.processor() or platform.machine()}, {torch.get_num_threads()} threads")
    out = args.out or Path("results/benchmarks") / f"norms_{device.type}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"shape": shape, "device": machine, "torch": torch.__version__,
                               "rounds": args.rounds, "results": rows}, indent=2))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
