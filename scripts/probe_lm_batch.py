"""Which positions and channels make the batch statistics of trained language models
(``plugins.lm.batch_probe``), e.g. BN, causal BN and LN side by side:

    python scripts/probe_lm_batch.py runs/llama_71m_bn-cpu/<time> runs/llama_71m_ln-cpu/<time> \\
        --out results/analysis/lm_batch_probe-cpu [--windows N]

Each run (a directory holding last.pt and config.yaml) is probed on the validation windows
its final val_loss scored (or the first --windows of them) in micro-batches of its own size; writes probe.json (one entry per run,
keyed by its exp name and seed, with its record's exp, norm, norm_options, seed and
git_commit) and batch_probe.png to --out.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import project_env  # noqa: F401  (first: the project's Python, whatever `python` ran this)

import torch
from omegaconf import OmegaConf

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # plugins/ and analysis/ from a plain checkout

from analysis.batch_probe import plot_batch_probe  # noqa: E402
from plugins.lm.batch_probe import probe_run  # noqa: E402
from plugins.lm.export import load_run  # noqa: E402

RECORD_FIELDS = ("exp", "norm", "norm_options", "seed", "git_commit", "status")


def run_record(run_dir: Path, cfg) -> dict:
    """What identifies the run: its result.json's fields when it has one, else its config's."""
    path = run_dir / "result.json"
    if path.exists():
        result = json.loads(path.read_text())
        record = {key: result.get(key) for key in RECORD_FIELDS}
        record["metrics"] = {key: result.get("metrics", {}).get(key)
                             for key in ("train_loss", "val_loss", "val_loss_train_mode")}
        return record
    norm = OmegaConf.to_container(cfg.norm, resolve=True)
    return {"exp": cfg.exp_name, "norm": norm.pop("name"), "norm_options": norm,
            "seed": cfg.seed, "git_commit": None, "status": None}


def run_key(record: dict) -> str:
    """``<exp>[-causal]-s<seed>``: the exp name does not say causal, the options do."""
    causal = "-causal" if (record.get("norm_options") or {}).get("causal") else ""
    return f"{record['exp']}{causal}-s{record['seed']}"


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("runs", type=Path, nargs="+", help="language-model run directories")
    parser.add_argument("--out", type=Path, required=True, help="output folder")
    parser.add_argument("--windows", type=int,
                        help="validation windows probed per run (default: every one the run's "
                             "final val_loss scored)")
    parser.add_argument("--trust-checkpoint", action="store_true",
                        help="unpickle anything the checkpoints hold (it can run code): only for "
                             "files you made or trust; by default only tensors and plain data load")
    args = parser.parse_args(argv)
    if args.windows is not None and args.windows < 1:
        parser.error("--windows must be at least 1")
    return args


def main(argv=None) -> dict:
    args = parse_args(argv)
    report = {}
    for run_dir in args.runs:
        model, cfg, _ = load_run(run_dir, args.trust_checkpoint)
        record = run_record(run_dir, cfg)
        key = run_key(record)
        if key in report:
            raise SystemExit(f"two runs are {key}: probe one of them at a time")
        with torch.random.fork_rng(devices=[]):
            probe = probe_run(model, cfg, args.windows)
        report[key] = {**record, "run_dir": str(run_dir.resolve()), **probe}
        loss = probe["loss"]
        print(f"{key}: loss eval {loss['eval']['mean']:.4g} train-mode "
              f"{loss['train_mode']['mean']:.4g} ({probe['windows']} windows)")
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "probe.json").write_text(json.dumps(report, indent=1))
    figure = plot_batch_probe(report, args.out / "batch_probe.png")
    print(f"wrote {args.out / 'probe.json'} and {figure}")
    return report


if __name__ == "__main__":
    main()
