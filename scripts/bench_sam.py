"""The cost of an update when training through the norms, as ratios to the base optimizer's
update, measured side by side in one run.

Per model (the CPU-scale runs' Swin-T and T2T-ViT, built from their run configs) and norm:
one optimizer update on a fixed batch for each way of training it: the recipe's optimizer
alone (``base``), SAM over every parameter, SAM-ON, ASAM-ON (each ``plugins.sam`` as the
runs use it: the first forward and backward, the perturbed second pass, the step) and
norm-only training with and without the head. Every round times each variant once in a
shuffled order (``benchmark.timed_rounds``); a ratio is the median of per-round ratios to
``base`` with its bootstrap 95% interval (``benchmark.paired_ratio``). Data loading is not
timed: this is the update's own cost, which the runs' epoch times dilute with augmentation.

    python scripts/bench_sam.py                               # both models, LN, BN and UN
    python scripts/bench_sam.py --models swin_t --norms un --rounds 5
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
from pathlib import Path

import project_env  # noqa: F401  (first: the project's Python, whatever `python` ran this)

import torch
from hydra import compose, initialize_config_dir

from benchmark import (  # scripts/: shared by the benchmarks
    ROOT,
    SPREAD,
    command,
    context,
    interval,
    machine,
    paired_ratio,
    timed_rounds,
)
from plugins.optim import create_optimizer
from plugins.sam import SharpnessAware, freeze_except
from plugins.scale import effective_config
from plugins.timm.models import model_from_config
from plugins.loop import optimizer_step

VARIANTS = ("base", "sam", "sam_on", "asam_on", "norm", "norm+head")


def run_config(model: str, norm: str, sam: str = "none"):
    """The CPU-scale run's config (``+exp=<model>_<norm> scale=cpu sam=<sam>``)."""
    overrides = [f"+exp={model}_{norm}", "scale=cpu", f"sam={sam}"]
    with initialize_config_dir(str(ROOT / "configs"), version_base="1.3"):
        return effective_config(compose("train", overrides=overrides), overrides)


def update_of(variant: str, model: str, norm: str, images, labels):
    """One optimizer update of ``variant`` as the shared loop makes it (plugins/loop.py), on
    its own copy of the run's model (same initialisation for every variant)."""
    cfg = run_config(model, norm, variant if variant.startswith(("sam", "asam")) else "none")
    torch.manual_seed(0)
    net = model_from_config(cfg).train()
    freeze_except(net, variant if variant.startswith("norm") else "all", net.get_classifier())
    recipe = cfg.recipe
    optimizer = create_optimizer([p for p in net.parameters() if p.requires_grad], cfg.optimizer,
                                 lr=recipe.lr, weight_decay=recipe.weight_decay)
    sam = None
    if cfg.sam.name != "none":
        options = {key: value for key, value in cfg.sam.items() if key != "name"}
        sam = SharpnessAware(net, **options)
    criterion = torch.nn.CrossEntropyLoss()

    def update():
        optimizer.zero_grad(set_to_none=True)
        if sam is not None:
            sam.new_update()
        criterion(net(images), labels).backward()
        if sam is not None:
            sam.perturbed_gradient(lambda: criterion(net(images), labels).backward())
        optimizer_step(optimizer, None, recipe.clip_grad, net.parameters())
    return update


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", nargs="+", default=["swin_t", "t2t_vit_14"],
                        choices=["swin_t", "t2t_vit_14"])
    parser.add_argument("--norms", nargs="+", default=["ln", "bn", "un"])
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--warmup", type=int, default=3, help="untimed updates per variant")
    parser.add_argument("--out", type=Path, default=Path("results/benchmarks/sam_cpu.json"))
    args = parser.parse_args()
    if args.rounds < 2:
        parser.error(f"--rounds {args.rounds}: a ratio's spread needs at least 2 rounds")
    device = torch.device("cpu")
    run_context = context()
    updates = {}
    for model in args.models:
        for norm in args.norms:
            cfg = run_config(model, norm)  # the run's batch of its images
            gen = torch.Generator().manual_seed(0)
            size = cfg.model.img_size
            images = torch.randn(cfg.recipe.batch_size, 3, size, size, generator=gen)
            labels = torch.randint(0, cfg.data.num_classes, (cfg.recipe.batch_size,), generator=gen)
            for variant in VARIANTS:
                updates[(model, norm, variant)] = update_of(variant, model, norm, images, labels)
    print(f"warming up {len(updates)} variants...", flush=True)
    for update in updates.values():
        for _ in range(args.warmup):
            update()
    times = timed_rounds(updates, args.rounds, device)
    run_context["load_after"] = list(os.getloadavg())
    rows = [{"model": model, "norm": norm, "variant": variant, "round_s": seconds,
             "ms": 1e3 * statistics.median(seconds),
             "vs_base": paired_ratio(seconds, times[(model, norm, "base")])}
            for (model, norm, variant), seconds in times.items()]
    lines = [f"| model | norm | variant | ms per update | x base, {SPREAD} |", "|---|---|---|---:|---:|"]
    lines += [f"| {r['model']} | {r['norm']} | {r['variant']} | {r['ms']:.1f} | "
              f"{interval(r['vs_base'], 2)} |" for r in rows]
    table = "\n".join(lines)
    print(table)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"device": machine(device), "torch": torch.__version__,
                                    "rounds": args.rounds, "command": command(),
                                    "context": run_context, "spread": SPREAD, "results": rows,
                                    "table": table}, indent=2))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
