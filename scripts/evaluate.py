"""Evaluate a trained classifier on its own test split under a shift, a test stream and a
test-time normalization mode; record the accuracy beside the run.

    python scripts/evaluate.py runs/t2t_vit_14_bn-cpu/<time> --test-time unmix \\
        --shift gaussian_noise:3 --stream dirichlet --batch 16 [--seed 0]

``--shift``: ``none``, ``<corruption>:<severity 1-5>`` (CIFAR-10-C's constants, 32 px) or
``all:<severity>`` (every corruption); ``--stream``: iid (shuffled), sorted (by label) or
dirichlet (UnMix-TNS's, concentration 0.1); ``--test-time``: a mode of ``unnorm.test_time``
(docs/test_time.md). Each flag takes several values: every combination is evaluated, with the
model loaded and each corrupted split made once. Writes
``<run>/test_time/<mode>_<shift>_<stream>_b<batch>_s<seed>.json`` (``.2.json``... when that
exists: nothing is overwritten; ``--missing`` skips a setting that has a record, so an
interrupted grid continues); a refused setting writes nothing.
"""
from __future__ import annotations

import argparse
import itertools
import json
import sys
from datetime import datetime, timezone
from pathlib import Path

import project_env  # noqa: F401  (first: the project's Python, whatever `python` ran this)

import torch
from omegaconf import OmegaConf

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import unnorm  # noqa: E402
from plugins.checkpoints import load_checkpoint  # noqa: E402
from plugins.runlog import git_commit  # noqa: E402
from plugins.timm import model_from_config  # noqa: E402
from plugins.timm.data import build_datasets  # noqa: E402
from plugins.timm.shift import (CORRUPTIONS, DIRICHLET_CONCENTRATION, IMAGE_SIZE,  # noqa: E402
                                STREAMS, ShiftedSet, evaluate_stream, parse_shift, stream_order)


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("run_dir", type=Path, help="a classification run directory (last.pt)")
    parser.add_argument("--test-time", nargs="+", default=["source"],
                        choices=list(unnorm.TEST_TIME_MODES))
    parser.add_argument("--shift", nargs="+", default=["none"],
                        help="none, <corruption>:<severity 1-5> or all:<severity>")
    parser.add_argument("--stream", nargs="+", default=["iid"], choices=STREAMS)
    parser.add_argument("--batch", nargs="+", type=int, default=[64],
                        help="test batch size, 1 to 64")
    parser.add_argument("--seed", nargs="+", type=int, default=[0],
                        help="the stream's order and the noise")
    parser.add_argument("--missing", action="store_true",
                        help="skip a setting that already has a record (continue a grid)")
    parser.add_argument("--trust-checkpoint", action="store_true",
                        help="unpickle anything the checkpoint holds (it can run code)")
    args = parser.parse_args(argv)
    for batch in args.batch:
        if not 1 <= batch <= 64:
            parser.error(f"--batch must be 1 to 64 (the benchmark's range), got {batch}")
    shifts = []
    for text in args.shift:
        name, _, severity = text.partition(":")
        texts = [f"{c}:{severity}" for c in CORRUPTIONS] if name == "all" else [text]
        try:
            shifts += [parse_shift(t) for t in texts]
        except ValueError as error:
            parser.error(str(error))
    args.shifts = list(dict.fromkeys(shifts))
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
    for mode in args.test_time:  # refused before anything is evaluated
        if mode != "source":
            try:
                unnorm.test_time(model, mode).close()
            except ValueError as error:
                sys.exit(f"--test-time {mode} on this run's norm {cfg.norm.name}: {error}; "
                         "test_time=source evaluates every norm")
    _, test_set = build_datasets(cfg.data, cfg.recipe.aug, cfg.model.img_size)
    for corruption, severity in args.shifts:
        shift = "none" if corruption == "none" else f"{corruption}-{severity}"
        for seed in args.seed:
            dataset = None  # corrupted once, on the first setting that needs it
            for mode, stream, batch in itertools.product(args.test_time, args.stream, args.batch):
                stem = f"{mode}_{shift}_{stream}_b{batch}_s{seed}"
                if args.missing and (args.run_dir / "test_time" / f"{stem}.json").exists():
                    continue
                if dataset is None:
                    shifted = ShiftedSet(test_set, corruption, severity, seed)
                    dataset = torch.utils.data.TensorDataset(
                        *map(torch.stack, zip(*((x, torch.tensor(y)) for x, y in shifted))))
                    targets = shifted.targets
                order = stream_order(targets, stream, seed)
                scores = evaluate_stream(model, dataset, order, batch, mode)
                record = {"run_dir": str(args.run_dir.resolve()), "exp": cfg.get("exp_name"),
                          "norm": cfg.norm.name, "data": cfg.data.name, "split": "val",
                          "test_time": mode, "options": unnorm.TEST_TIME_MODES[mode],
                          "corruption": corruption, "severity": severity, "stream": stream,
                          "concentration": DIRICHLET_CONCENTRATION if stream == "dirichlet" else None,
                          "batch": batch, "seed": seed, **scores, "git_commit": git_commit(),
                          "time": datetime.now(timezone.utc).isoformat(timespec="seconds")}
                path = record_path(args.run_dir / "test_time", stem)
                path.write_text(json.dumps(record, indent=2) + "\n")
                print(f"{record['exp']}: top-1 {scores['top1']:.2f}% ({scores['correct']}/"
                      f"{scores['examples']}) test_time={mode} shift={shift} stream={stream} "
                      f"batch={batch} seed={seed}; wrote {path}")


if __name__ == "__main__":
    main()
