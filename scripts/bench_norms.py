"""Per-layer cost of every norm, eager and compiled, as ratios to LayerNorm, measured side by side.

Two inputs: ViT tokens (64, 196, 384) and Swin stage-1 maps (8, 56, 56, 96), channels last.
Per norm and mode (eager, ``torch.compile``): one training step (forward, and the backward
to the input and the parameters) and one inference forward. Every round times each runner
once in a shuffled order, so drift affects all alike; the report gives medians and their
ratios to torch's LayerNorm eager, to LayerNorm compiled, and to the faster of the two (the
fastest LayerNorm a user can run). Estimated norms are timed after their warm-up. ``crms``
(always measured) is Pre-CRMSNorm's norm (``unnorm.CompressedRMSNorm``) on the stream one
channel narrower that the exact Pre-LN conversion leaves: with ``rms`` among the norms, the
conversion's three norms side by side.

    python scripts/bench_norms.py                         # both shapes, every norm
    python scripts/bench_norms.py --shapes tokens --norms ln un --rounds 50
"""
from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from pathlib import Path

import torch

import unnorm
from benchmark import (  # scripts/: shared by the benchmarks
    add_shared_options,
    compile_side_by_side,
    ln_first,
    machine,
    synchronize,
)

SHAPES = {"tokens": (64, 196, 384), "swin_stage1": (8, 56, 56, 96)}
# past every warm-up: what a long training run spends its steps in
STEADY = {"un": {"warmup_iters": 0, "outlier_filtration": True, "compensation_start": 0},
          "mabn": {"warmup_iters": 0, "window_size": 4, "compensation_start": 0},
          "pn": {"warmup_iters": 0}, "pn_ls": {"warmup_iters": 0, "group_num": 4},
          "prepbn": {"warmup_iters": 0, "decay_iters": 10 ** 9}}  # mid hand-over: LN and BN


def closures(train_norm, eval_norm, x: torch.Tensor, dy: torch.Tensor):
    """``(train_step, inference)``: forward and backward to the input and the parameters;
    an inference forward."""
    inputs = [x, *train_norm.parameters()]

    def train_step():
        torch.autograd.grad(train_norm(x), inputs, dy)

    @torch.inference_mode()
    def inference():
        eval_norm(x)
    return train_step, inference


def runners(name: str, channels: int, x: torch.Tensor, dy: torch.Tensor, compiled: bool):
    """``(train_step, inference)`` of one of our norms in one mode; ``torch_ln`` is
    ``torch.nn.LayerNorm`` itself (ours wraps it), the baseline users know; ``crms`` reads the
    first ``channels - 1`` channels (Pre-CRMSNorm's narrower stream)."""
    if name == "crms":
        x, dy = x[..., :-1].detach().contiguous().requires_grad_(True), dy[..., :-1].contiguous()

    def build():
        if name == "torch_ln":
            return torch.nn.LayerNorm(channels, device=x.device)
        if name == "crms":
            return unnorm.CompressedRMSNorm(channels - 1, device=x.device)
        return unnorm.build_norm(name, channels, device=x.device, **STEADY.get(name, {}))
    train_norm, eval_norm = build(), build().eval()
    if compiled:
        train_norm, eval_norm = torch.compile(train_norm), torch.compile(eval_norm)
    return closures(train_norm, eval_norm, x, dy)


def measure(shape, norms, args, device) -> list[dict]:
    gen = torch.Generator(device="cpu").manual_seed(0)
    x = torch.randn(shape, generator=gen).to(device).requires_grad_(True)
    dy = torch.randn(shape, generator=gen).to(device)
    steps = {}
    for name in [*norms, "crms"]:
        for mode in ("eager", "compiled"):
            train_step, inference = runners(name, shape[-1], x, dy, mode == "compiled")
            steps[(name, mode, "train")], steps[(name, mode, "infer")] = train_step, inference
    steps[("torch_ln", "eager", "train")], steps[("torch_ln", "eager", "infer")] = \
        runners("torch_ln", shape[-1], x, dy, compiled=False)
    print(f"{shape}: warming up {len(steps)} runners (compiling)...", flush=True)
    for fn in steps.values():
        for _ in range(args.warmup):
            fn()
    times = {key: [] for key in steps}
    order = list(steps)
    for _ in range(args.rounds):
        random.shuffle(order)
        for key in order:
            synchronize(device)
            start = time.perf_counter()
            steps[key]()
            synchronize(device)
            times[key].append(time.perf_counter() - start)
    median = {key: statistics.median(values) for key, values in times.items()}
    rows = []
    for (name, mode, kind), seconds in sorted(median.items()):
        eager_ln, compiled_ln = median[("ln", "eager", kind)], median[("ln", "compiled", kind)]
        fastest = min(eager_ln, compiled_ln, median[("torch_ln", "eager", kind)])
        rows.append({"shape": list(shape), "norm": name, "mode": mode, "kind": kind,
                     "ms": 1e3 * seconds, "vs_ln_eager": seconds / eager_ln,
                     "vs_ln_compiled": seconds / compiled_ln, "vs_fastest_ln": seconds / fastest})
    return rows


def report(rows) -> str:
    lines = ["| shape | norm | mode | train ms | x fastest LN | infer ms | x fastest LN |",
             "|---|---|---|---:|---:|---:|---:|"]
    by = {(tuple(r["shape"]), r["norm"], r["mode"], r["kind"]): r for r in rows}
    for shape, name, mode, kind in by:
        if kind != "train":
            continue
        train, infer = by[(shape, name, mode, "train")], by[(shape, name, mode, "infer")]
        lines.append(f"| {'x'.join(map(str, shape))} | {name} | {mode} | {train['ms']:.2f} | "
                     f"{train['vs_fastest_ln']:.2f} | {infer['ms']:.2f} | {infer['vs_fastest_ln']:.2f} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    add_shared_options(parser, "--norms", rounds=30, warmup=5,
                       out_help="JSON file (default results/benchmarks/norms_<device>.json)")
    args = parser.parse_args()
    args.norms = ln_first(args.norms)
    device = torch.device(args.device)
    compile_side_by_side()
    rows = [row for shape in args.shapes for row in measure(SHAPES[shape], args.norms, args, device)]
    table = report(rows)
    print(table)
    out = args.out or Path("results/benchmarks") / f"norms_{device.type}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"device": machine(device), "torch": torch.__version__,
                               "cuda": torch.version.cuda if device.type == "cuda" else None,
                               "rounds": args.rounds, "command": "python scripts/bench_norms.py "
                               + " ".join(f"--{k} {v}" for k, v in vars(args).items()
                                          if k not in ("out",) and not isinstance(v, list)),
                               "results": rows, "table": table}, indent=2))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
