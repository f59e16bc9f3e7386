"""Layer-by-layer linear CKA of two trained runs (the paper's Fig. 6), e.g. LN vs UN:

    python scripts/cka.py runs/t2t_vit_14_ln-full/<time> runs/t2t_vit_14_un-full/<time>

Both runs are evaluated on RUN_A's validation set (shuffled with a fixed seed, so minibatches mix
classes as the minibatch estimator assumes); writes cka.json and cka.png to --out.
"""
from __future__ import annotations

import argparse
import json
import sys
from contextlib import closing
from pathlib import Path

import project_env  # noqa: F401  (first: the project's Python, whatever `python` ran this)

import torch
from omegaconf import OmegaConf

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # plugins/ and analysis/ from a plain checkout

from analysis.cka import ESTIMATORS, cka_matrix, plot_cka_heatmap  # noqa: E402
from plugins.checkpoints import load_checkpoint  # noqa: E402
from plugins.timm import model_from_config  # noqa: E402
from plugins.timm.data import build_datasets  # noqa: E402
from plugins.timm.features import block_names, paired_layer_features  # noqa: E402

SHUFFLE_SEED = 0


def checkpoint_path(run: Path) -> Path:
    path = run / "last.pt" if run.is_dir() else run
    if not path.is_file():
        raise FileNotFoundError(f"no checkpoint at {path}: pass a run directory written by "
                                "scripts/train.py (runs/<exp>/<time>, holding last.pt) or its last.pt")
    return path


def load_run(run: Path, ema: bool, device: torch.device, trusted: bool = False):
    """(model in eval mode, resolved config) of a run's last checkpoint (``trusted``: unpickle
    anything it holds)."""
    path = checkpoint_path(run)
    state = load_checkpoint(path, trusted=trusted, opt_in="--trust-checkpoint")
    if not isinstance(state, dict) or "model" not in state or "config" not in state:
        raise ValueError(f"{path} is not a training checkpoint of scripts/train.py "
                         "(expected the keys 'model' and 'config')")
    weights = state["model_ema"] if ema else state["model"]
    if weights is None:
        raise ValueError(f"{path} holds no EMA weights (the run had recipe.model_ema.enabled=false); "
                         "drop --ema to compare the raw weights")
    cfg = OmegaConf.create(state["config"])
    model = model_from_config(cfg)
    model.load_state_dict(weights)
    return model.to(device).eval(), cfg


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("run_a", type=Path, help="run directory (or its last.pt): x axis, and its val set")
    parser.add_argument("run_b", type=Path, help="run directory (or its last.pt): y axis")
    parser.add_argument("--out", type=Path, help="output folder (default results/analysis/cka_<expA>_vs_<expB>)")
    parser.add_argument("--estimator", choices=ESTIMATORS, default="minibatch")
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--max-batches", type=int, help="stop after this many batches (default: whole val set)")
    parser.add_argument("--ema", action="store_true", help="compare the EMA weights of both runs")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--trust-checkpoint", action="store_true",
                        help="unpickle anything the checkpoints hold (it can run code): only for "
                             "files you made or trust; by default only tensors and plain data load")
    return parser.parse_args(argv)


def main(argv=None) -> dict:
    args = parse_args(argv)
    device = torch.device(args.device)
    model_a, cfg_a = load_run(args.run_a, args.ema, device, args.trust_checkpoint)
    model_b, cfg_b = load_run(args.run_b, args.ema, device, args.trust_checkpoint)
    for key in ("data.name", "model.img_size"):
        value_a, value_b = OmegaConf.select(cfg_a, key), OmegaConf.select(cfg_b, key)
        if value_a != value_b:
            raise ValueError(f"the runs differ in {key} ({value_a} vs {value_b}); CKA compares "
                             "representations of the same images: pick runs trained on the same data "
                             "at the same resolution")

    _, val_set = build_datasets(cfg_a.data, cfg_a.recipe.aug, cfg_a.model.img_size)
    loader = torch.utils.data.DataLoader(val_set, batch_size=args.batch_size, shuffle=True,
                                         generator=torch.Generator().manual_seed(SHUFFLE_SEED),
                                         num_workers=cfg_a.scale.num_workers)
    names_a, names_b = block_names(model_a), block_names(model_b)
    features = paired_layer_features(model_a, model_b, loader, names_a, names_b, args.max_batches,
                                     equal_batches=args.estimator == "minibatch")
    with closing(features):  # hooks off and modes back even if the estimator raises
        matrix = cka_matrix(features, args.estimator)

    exp_a, exp_b = cfg_a.exp_name, cfg_b.exp_name
    out = args.out or REPO / "results" / "analysis" / f"cka_{exp_a}_vs_{exp_b}"
    out.mkdir(parents=True, exist_ok=True)
    weights = "ema" if args.ema else "model"
    report = {"estimator": args.estimator, "batch_size": args.batch_size, "max_batches": args.max_batches,
              "shuffle_seed": SHUFFLE_SEED, "weights": weights, "data": cfg_a.data.name,
              "val_examples": len(val_set), "img_size": cfg_a.model.img_size,
              "run_a": str(args.run_a.resolve()), "run_b": str(args.run_b.resolve()),
              "exp_a": exp_a, "exp_b": exp_b, "names_a": names_a, "names_b": names_b,
              "matrix": matrix.tolist()}
    (out / "cka.json").write_text(json.dumps(report, indent=1))
    label_a, label_b = (exp_a, exp_b) if exp_a != exp_b else (f"{exp_a} (A)", f"{exp_b} (B)")
    plot_cka_heatmap(matrix, names_a, names_b, label_a, label_b, out / "cka.png",
                     title=f"Linear CKA ({args.estimator}, {weights} weights, {cfg_a.data.name} val)")
    diagonal = matrix.diagonal()
    print(f"{exp_a} vs {exp_b}: {len(names_a)}x{len(names_b)} layers, "
          f"matched-layer CKA mean {diagonal.mean():.3f} (min {diagonal.min():.3f}); wrote {out}/cka.json, cka.png")
    return report


if __name__ == "__main__":
    main()
