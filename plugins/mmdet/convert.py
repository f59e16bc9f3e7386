"""Our timm Swin checkpoints (ImageNet runs) as mmdetection Swin backbone weights.

    python -m plugins.mmdet.convert runs/swin_t_un-full/<time>/last.pt swin_t_un_mmdet.pth

Keys are renamed to mmdet's layout (``stages``, ``attn.w_msa``, ``ffn.layers``); timm puts
patch merging at the start of stage i+1 where mmdet puts it at the end of stage i; and the
merged 4C channels are reordered from Swin's concatenation order to ``nn.Unfold``'s, for every
per-channel tensor of the merging norm (weights and UN's buffers alike; PRepBN's and DyT's
scalar ``alpha`` stay as they are), as mmdet's own ``swin_converter`` does for LayerNorm
(PN_LS's layer-scale groups stay timm's: ``UnnormSwinTransformer``).
Step counters are reset by ``unnorm.reset_steps`` on the classifier the checkpoint describes:
UN, MABN and PN warm up again on the detection task, as the release does; PRepBN keeps its
finished hand-over, as SLAB fine-tunes.
Weight-standardised layers (``model.weight_standardization``) are written with their
standardised weights, so mmdet's plain layers compute what the classifier did; the mmdet
backend keeps them raw where its detector standardises the same layers.
"""
from __future__ import annotations

import argparse
import re
from pathlib import Path
from types import MappingProxyType
from typing import Mapping

import torch
from omegaconf import OmegaConf

import unnorm
from plugins.checkpoints import load_checkpoint
from plugins.model_options import carry_standardization, standardized_layers

_DROPPED = ("head.", "norm.")  # the classifier and its final norm
_RENAMES = [(r"^patch_embed\.proj\.", "patch_embed.projection."),
            (r"\.attn\.", ".attn.w_msa."),
            (r"\.mlp\.fc1\.", ".ffn.layers.0.0."),
            (r"\.mlp\.fc2\.", ".ffn.layers.1."),
            (r"^layers\.", "stages.")]


def unfold_order(tensor: torch.Tensor, dim: int) -> torch.Tensor:
    """Reorder 4C channels from Swin's [x(0,0), x(1,0), x(0,1), x(1,1)] blocks to Unfold's
    channel-major order c*4 + (2*row + col)."""
    moved = tensor.movedim(dim, -1)
    channels = moved.shape[-1] // 4
    blocks = moved.reshape(*moved.shape[:-1], 4, channels)[..., [0, 2, 1, 3], :]
    return blocks.transpose(-1, -2).reshape(moved.shape).movedim(-1, dim)


_MERGING = r"^layers\.(\d+)\.downsample\.(norm|reduction)\.(.+)$"


def mmdet_key(key: str) -> str:
    """A timm SwinTransformer state-dict key as the mmdet backbone's, prefixed ``backbone.``."""
    merging = re.match(_MERGING, key)
    if merging:
        stage, part, leaf = merging.groups()
        return f"backbone.stages.{int(stage) - 1}.downsample.{part}.{leaf}"
    for pattern, replacement in _RENAMES:
        key = re.sub(pattern, replacement, key)
    return "backbone." + key


def timm_to_mmdet(state_dict: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A timm SwinTransformer state dict as mmdet ``SwinTransformer`` weights, prefixed
    ``backbone.`` (the layout only: values, step counters included, are carried over)."""
    converted = {}
    for key, value in state_dict.items():
        if key.startswith(_DROPPED):
            continue
        merging = re.match(_MERGING, key)
        if merging:
            stage, part, leaf = merging.groups()
            merged = state_dict[f"layers.{stage}.downsample.reduction.weight"].shape[1]  # 4C
            if part == "reduction" and leaf == "weight":
                value = unfold_order(value, 1)
            elif part == "norm" and value.ndim >= 1 and value.shape[-1] == merged:
                value = unfold_order(value, -1)
        converted[mmdet_key(key)] = value
    return converted


def convert_checkpoint(saved: dict, reset_steps: bool, ema: bool = True,
                       standardized: Mapping[str, tuple[float, str]] = MappingProxyType({})
                       ) -> dict[str, torch.Tensor]:
    """mmdet Swin backbone weights from one of our classification checkpoints (``last.pt``:
    its ``config`` describes the classifier): its EMA weights when it kept them and ``ema``,
    step counters restarted by ``unnorm.reset_steps`` when ``reset_steps``. A layer the
    classifier weight-standardised keeps its raw weight where the detector standardises it
    too (``standardized``: the detector's layers, ``plugins.model_options.standardized_layers``)
    and gets its standardised weight elsewhere, so the backbone computes what the classifier
    did (``carry_standardization``; by default every one: plain mmdet weights)."""
    from timm.models.swin_transformer import SwinTransformer

    from plugins.timm import model_from_config

    if not isinstance(saved, dict) or "model" not in saved or "config" not in saved:
        raise ValueError("not a checkpoint of a classification run of ours (no 'model' and "
                         "'config' entries): pass the last.pt of a swin_t run")
    if saved["config"].get("task", "classification") != "classification":
        raise ValueError(f"the checkpoint is of a {saved['config']['task']} run; the backbone "
                         "comes from a classification run: pass the last.pt of a swin_t run")
    classifier = model_from_config(OmegaConf.create(saved["config"]))
    if not isinstance(classifier, SwinTransformer):
        raise ValueError(f"the checkpoint holds a {type(classifier).__name__}; mmdet's backbone "
                         "is a Swin: pass the last.pt of a swin_t run")
    classifier.load_state_dict((ema and saved.get("model_ema")) or saved["model"])
    if reset_steps:
        unnorm.reset_steps(classifier)
    source = {mmdet_key(f"{name}.weight").removesuffix(".weight"): form
              for name, form in standardized_layers(classifier).items()}
    return carry_standardization(timm_to_mmdet(classifier.state_dict()), source, standardized,
                                 "init_from (the classifier's weights)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("checkpoint", type=Path, help="last.pt of a swin_t classification run")
    parser.add_argument("out", type=Path)
    parser.add_argument("--keep-steps", action="store_true", help="do not reset step counters")
    parser.add_argument("--no-ema", action="store_true", help="use the raw, not EMA, weights")
    parser.add_argument("--trust-checkpoint", action="store_true",
                        help="unpickle the checkpoint without limits (only files you trust)")
    args = parser.parse_args()
    saved = load_checkpoint(args.checkpoint, trusted=args.trust_checkpoint,
                            opt_in="--trust-checkpoint")
    weights = convert_checkpoint(saved, reset_steps=not args.keep_steps, ema=not args.no_ema)
    torch.save({"state_dict": weights}, args.out)
    print(f"wrote {args.out}: mmdet Swin backbone weights (init_cfg=dict(type='Pretrained', "
          f"checkpoint='{args.out}'))")


if __name__ == "__main__":
    main()
