"""Fold a trained model's offline norms (and DyT's affine) into its linear layers (paper Alg. 1).

    python scripts/fold.py runs/swin_t_un-cpu/<time>            # writes folded.pt beside it
    python scripts/fold.py runs/.../last.pt --ema --out swin_un_folded.pt
    python scripts/fold.py runs/mask_rcnn_swin_t_un-cpu/<time>  # a detector's Swin backbone

Every norm becomes part of the linear layer that reads it (qkv, fc1, patch-merging reduction,
head; a detector's FPN laterals) or, where none does directly, a frozen per-channel affine
(a DyT there stays whole; folded elsewhere, it leaves its elementwise tanh). SepNorm's two
norms (``model.class_norm``) each become a frozen affine; weight-standardised layers
(``model.weight_standardization``) first become plain layers holding their standardised
weights (``unnorm.bake_standardized_weights``, exact).
The fold is proved before the model changes, on a batch of random images (``--check-batch``):
a plan that changes a float64 copy's eval outputs (a detector's FPN features) beyond float32
rounding is refused (``unnorm.fold_norms``). The script prints the folded model's own change
in its dtype.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Optional

import project_env  # noqa: F401  (first: the project's Python, whatever `python` ran this)

import torch
from omegaconf import OmegaConf

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import unnorm  # noqa: E402
from plugins.checkpoints import load_checkpoint  # noqa: E402
from plugins.norms import norm_kwargs  # noqa: E402
from plugins.timm import fold_model, model_from_config  # noqa: E402
from plugins.torchvision.detectors import build_detector, fold_detector  # noqa: E402


def _model(cfg, weights: dict) -> torch.nn.Module:
    """The model of a run config: a classifier, or a detector sized by its saved classifier."""
    if cfg.task == "detection":
        classes = weights["roi_heads.box_predictor.cls_score.weight"].shape[0]
        return build_detector(cfg.model, cfg.norm, classes)
    return model_from_config(cfg)


def _fold(cfg, model: torch.nn.Module, probe: Optional[torch.Tensor]) -> dict:
    """Fold ``model``'s norms, proved on ``probe`` (a batch of images; None: unchecked); its
    weight-standardised layers (``model.weight_standardization``) first become plain layers
    holding their standardised weights (exact), which take a fold."""
    baked = unnorm.bake_standardized_weights(model)
    fold = fold_detector if cfg.task == "detection" else fold_model
    return {**fold(model, probe=probe), "baked": baked}


def load_folded(path: Path, trusted: bool = False) -> torch.nn.Module:
    """Rebuild a model saved by this script: its structure, folded, then its weights
    (``trusted``: unpickle anything, for a file you trust)."""
    saved = load_checkpoint(path, trusted=trusted, opt_in="trusted=True")
    cfg = OmegaConf.create(saved["config"])
    model = _model(cfg, saved["model"]).eval()
    _fold(cfg, model, probe=None)  # the structure only: the saved weights, proved when folded, replace these
    model.load_state_dict(saved["model"])
    return model


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("checkpoint", type=Path, help="a run directory or its last.pt")
    parser.add_argument("--ema", action="store_true", help="fold the EMA weights")
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--check-batch", type=int, default=4)
    parser.add_argument("--trust-checkpoint", action="store_true",
                        help="unpickle anything the checkpoint holds (it can run code): only for "
                             "files you made or trust; by default only tensors and plain data load")
    args = parser.parse_args(argv)
    path = args.checkpoint / "last.pt" if args.checkpoint.is_dir() else args.checkpoint
    if not path.exists():
        sys.exit(f"no checkpoint at {path}: pass a run directory or its last.pt")
    saved = load_checkpoint(path, trusted=args.trust_checkpoint, opt_in="--trust-checkpoint")
    cfg = OmegaConf.create(saved["config"])
    norms = {"norm": (cfg.norm.name, norm_kwargs(cfg.norm)),  # as the run built them
             "model.class_norm": (cfg.model.get("class_norm"), {})}
    for option, (name, options) in norms.items():
        if name is not None and not unnorm.is_foldable(name, **options):
            sys.exit(f"{option}={name} is an online norm as this run built it: it does not fold "
                     f"(foldable with their defaults: "
                     f"{[n for n in unnorm.available_norms() if unnorm.is_foldable(n)]})")
    weights = saved["model_ema"] if args.ema else saved["model"]
    if weights is None:
        sys.exit("this run kept no EMA weights; drop --ema")
    model = _model(cfg, weights)
    model.load_state_dict(weights)
    model.eval()
    detection = cfg.task == "detection"
    size = cfg.model.min_size[-1] if detection else cfg.model.img_size
    images = torch.randn(args.check_batch, 3, size, size)
    run = model.backbone if detection else model
    with torch.no_grad():
        before = run(images)
        done = _fold(cfg, model, probe=images)
        after = run(images)
    pairs = [(after[k], before[k]) for k in before] if detection else [(after, before)]
    error = max(((a - b).abs().max() / b.abs().max()).item() for a, b in pairs)
    out = args.out or path.with_name("folded.pt")
    torch.save({"model": model.state_dict(), "config": saved["config"], "fold": done}, out)
    print(f"folded {done['folded']} norms into linear layers, {done['affine']} into frozen "
          f"affines, kept {done['kept']} whole (weight-standardised layers baked first: "
          f"{done['baked']}); max relative output change {error:.2e}; wrote {out}")


if __name__ == "__main__":
    main()
