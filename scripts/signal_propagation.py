"""Signal propagation at initialisation ("Beyond BatchNorm", Lubana et al., NeurIPS 2021):
``unnorm.signal``'s probes at every block of freshly built models, for norms x placements x
depths x seeds; one JSON line per (model, norm, placement, depth, seed) under --out.

    python scripts/signal_propagation.py                       # the CPU grid of results/signal/
    python scripts/signal_propagation.py --models lm --norms ln gn:groups=4 --placements pre post \\
        --depths 12 48 --seeds 0 1 2 3 4 --width 256 --batch 32   # a wider one
    python -m analysis.signal                                  # the figures and the tests

A norm is a registry name with options after a colon: ``gn:groups=4`` (GroupNorm, 4 groups
per token), ``gn:groups=1000000:layout=image`` (a count past every width: each norm's
instance extreme; vision only, the language model refuses layout=image).
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import project_env  # noqa: F401  (first: the project's Python, whatever `python` ran this)

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # plugins/ from a plain checkout

import unnorm  # noqa: E402
from plugins.lm.signal import probe_setup as lm_setup  # noqa: E402
from plugins.timm.signal import probe_setup as vision_setup  # noqa: E402

MODELS = ("lm", "t2t_vit", "swin_t")
PLACEMENTS = ("pre", "post", "peri", "mix")
#: the CPU grid: narrow widths, small batches, five seeds, depths to 48
NORMS = ["ln", "rms", "bn", "un", "dyt", "nonorm", "gn:groups=4", "gn:groups=16"]
VISION_NORMS = ["ln", "bn", "un", "dyt", "nonorm", "gn:groups=16", "gn:groups=1:layout=image",
                "gn:groups=1000000:layout=image"]
#: Swin at 32 px ends on one position a map (stage 4), where a statistic over positions is of
#: one value: its layout=image norms are left out
DEFAULT_NORMS = {"lm": NORMS, "t2t_vit": VISION_NORMS,
                 "swin_t": [norm for norm in VISION_NORMS if "layout=image" not in norm]}


def parse_norm(text: str) -> dict:
    """``name:key=value:...`` -> a norm config (values as JSON where they parse)."""
    name, *pairs = text.split(":")
    cfg = {"name": name}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep:
            raise ValueError(f"norm option {pair!r} of {text!r} needs key=value (gn:groups=4)")
        try:
            cfg[key] = json.loads(value)
        except json.JSONDecodeError:
            cfg[key] = value
    unnorm.norm_layer(name, **{k: v for k, v in cfg.items() if k != "name"})  # fails early
    return cfg


def group_size(points) -> int | None:
    """Channels per group of the first GroupNorm in the probed blocks (None: no GroupNorm)."""
    for module in points.values():
        for norm in module.modules():
            if isinstance(norm, unnorm.GroupNorm):
                return norm.num_features // norm.groups
    return None


def run_one(model: str, norm: str, placement: str, depth: int, seed: int, args) -> dict:
    cfg = parse_norm(norm)
    if model == "lm":
        points, loss = lm_setup(cfg, placement=placement, depth=depth, width=args.width,
                                batch=args.batch, context=args.context, seed=seed)
    else:
        points, loss = vision_setup(cfg, model=model, depth=depth, width=args.width,
                                    batch=args.batch, seed=seed)
    layers = unnorm.signal_propagation(points, loss)
    return {"model": model, "norm": norm, "norm_cfg": cfg, "group_size": group_size(points),
            "placement": placement, "depth": depth, "seed": seed, "width": args.width,
            "batch": args.batch, "context": args.context if model == "lm" else None,
            "layers": layers}


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", nargs="+", choices=MODELS, default=list(MODELS))
    parser.add_argument("--norms", nargs="+", default=None,
                        help="registry norms with options (default: DEFAULT_NORMS)")
    parser.add_argument("--placements", nargs="+", choices=PLACEMENTS, default=list(PLACEMENTS),
                        help="the language model's (the vision models are Pre-norm)")
    parser.add_argument("--depths", nargs="+", type=int, default=[8, 16, 32, 48])
    parser.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2, 3, 4])
    parser.add_argument("--width", type=int, default=32)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--context", type=int, default=32, help="the language model's tokens")
    parser.add_argument("--out", type=Path, default=REPO / "results" / "signal")
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    for model in args.models:
        norms = args.norms or DEFAULT_NORMS[model]
        placements = args.placements if model == "lm" else ["pre"]
        path = args.out / f"{model}.jsonl"
        start = time.time()
        with path.open("w") as out:
            for norm in norms:
                for placement in placements:
                    for depth in args.depths:
                        for seed in args.seeds:
                            record = run_one(model, norm, placement, depth, seed, args)
                            out.write(json.dumps(record) + "\n")
                out.flush()
                print(f"{model} {norm}: {time.time() - start:.0f} s", flush=True)
        print(f"wrote {path}")


if __name__ == "__main__":
    main()
