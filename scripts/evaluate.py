"""Evaluate a trained classifier on its own test split under a shift, a test stream and a
test-time normalization mode; record the accuracy beside the run.

    python scripts/evaluate.py runs/t2t_vit_14_bn-cpu/<time> --test-time unmix \\
        --shift gaussian_noise:3 --stream dirichlet --batch 16 [--seed 0]

``--shift``: ``none`` or ``<corruption>:<severity 1-5>`` (CIFAR-10-C's constants, 32 px);
``--stream``: iid (shuffled), sorted (by label) or dirichlet (UnMix-TNS's, concentration 0.1);
``--test-time``: a mode of ``unnorm.test_time`` (docs/test_time.md). Writes
``<run>/test_time/<mode>_<shift>_<stream>_b<batch>_s<seed>.json`` (``.2.json``... when that
exists: nothing is overwritten); a refused setting writes nothing.
"""
from __future__ import annotations

import argparse
import json
import sys
from datetime import datetime, timezone
from pathlib import Path

import project_env  # noqa: F401  (first: the project's Python, whatever `python` ran this)

from omegaconf import OmegaConf

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import unnorm  # noqa: E402
from plugins.checkpoints import load_checkpoint  # noqa: E402
from plugins.runlog import git_commit  # noqa: E402
from plugins.timm import model_from_config  # noqa: E402
from plugins.timm.data import build_datasets  # noqa: E402
from plugins.timm.shift import (DIRICHLET_CONCENTRATION, IMAGE_SIZE, STREAMS,  # noqa: E402
                                ShiftedSet, evaluate_stream, parse_shift, stream_order)


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("run_dir", type=Path, help="a classification run directory (last.pt)")
    parser.add_argument("--test-time", default="source", choices=list(unnorm.TEST_TIME_MODES))
    parser.add_argument("--shift", default="none", help="none or <corruption>:<severity 1-5>")
    parser.add_argument("--stream", default="iid", choices=STREAMS)
    parser.add_argument("--batch", type=int, default=64, help="test batch size, 1 to 64")
    parser.add_argument("--seed", type=int, default=0, help="the stream's order and the noise")
    parser.add_argument("--trust-checkpoint", action="store_true",
                        help="unpickle anything the checkpoint holds (it can run code)")
    args = parser.parse_args(argv)
    if not 1 <= args.batch <= 64:
        parser.error(f"--batch must be 1 to 64 (the benchmark's range), got {args.batch}")
    try:
        args.corruption, args.severity = parse_shift(args.shift)
    except ValueError as error:
        parser.error(str(error))
    return args


def record_path(folder: Path, stem: str) -> Path:
    """A new file for this record: ``stem.json``, else ``stem.2.json``, ... (never overwritten)."""
    folder.mkdir(parents=True, exist_ok=True)
    for n in range(1, 10_000):
        path = folder / (f"{stem}.json" if n == 1 else f"{stem}.{n}.json")
        try:
            path.open("x").close()
            return path
        except FileExistsError:
            continue
    raise RuntimeError(f"{folder} holds 9999 records of {stem}: move some away")


def main(argv=None) -> None:
    args = parse_args(argv)
    checkpoint = args.run_dir / "last.pt"
    if not checkpoint.exists():
        sys.exit(f"no checkpoint at {checkpoint}: pass a run directory holding last.pt")
    saved = load_checkpoint(checkpoint, trusted=args.trust_checkpoint, opt_in="--trust-checkpoint")
    cfg = OmegaConf.create(saved["config"])
    if cfg.task != "classification":
        sys.exit(f"{args.run_dir} is a {cfg.task} run: the shift benchmark evaluates classifiers")
    if cfg.model.img_size != IMAGE_SIZE:
        sys.exit(f"the run's images are {cfg.model.img_size} px; the corruptions' constants "
                 f"(CIFAR-10-C's) are for {IMAGE_SIZE} px: evaluate a scale=cpu run")
    model = model_from_config(cfg)
    model.load_state_dict(saved["model"])
    _, test_set = build_datasets(cfg.data, cfg.recipe.aug, cfg.model.img_size)
    dataset = ShiftedSet(test_set, args.corruption, args.severity, args.seed)
    order = stream_order(dataset.targets, args.stream, args.seed)
    try:
        scores = evaluate_stream(model, dataset, order, args.batch, args.test_time)
    except ValueError as error:
        sys.exit(f"--test-time {args.test_time} on this run's norm {cfg.norm.name}: {error}")
    shift = "none" if args.corruption == "none" else f"{args.corruption}-{args.severity}"
    record = {"run_dir": str(args.run_dir.resolve()), "exp": cfg.get("exp_name"),
              "norm": cfg.norm.name, "data": cfg.data.name, "split": "val",
              "test_time": args.test_time, "options": unnorm.TEST_TIME_MODES[args.test_time],
              "corruption": args.corruption, "severity": args.severity, "stream": args.stream,
              "concentration": DIRICHLET_CONCENTRATION if args.stream == "dirichlet" else None,
              "batch": args.batch, "seed": args.seed, **scores, "git_commit": git_commit(),
              "time": datetime.now(timezone.utc).isoformat(timespec="seconds")}
    path = record_path(args.run_dir / "test_time",
                       f"{args.test_time}_{shift}_{args.stream}_b{args.batch}_s{args.seed}")
    path.write_text(json.dumps(record, indent=2) + "\n")
    print(f"{record['exp']}: top-1 {scores['top1']:.2f}% ({scores['correct']}/{scores['examples']}) "
          f"test_time={args.test_time} shift={shift} stream={args.stream} batch={args.batch} "
          f"seed={args.seed}; wrote {path}")


if __name__ == "__main__":
    main()
