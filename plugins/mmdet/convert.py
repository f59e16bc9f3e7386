"""Our timm Swin checkpoints (ImageNet runs) as mmdetection Swin backbone weights.

    python -m plugins.mmdet.convert runs/swin_t_un-full/<time>/last.pt swin_t_un_mmdet.pth

Keys are renamed to mmdet's layout (``stages``, ``attn.w_msa``, ``ffn.layers``); timm puts
patch merging at the start of stage i+1 where mmdet puts it at the end of stage i; and the
merged 4C channels are reordered from Swin's concatenation order to ``nn.Unfold``'s, for every
per-channel tensor of the merging norm (weights and UN's buffers alike), as mmdet's own
``swin_converter`` does for LayerNorm. Step counters are reset: UN, MABN and PN warm up again
on the detection task, as the release does. The conversion itself is plain torch.
"""
from __future__ import annotations

import argparse
import re
from pathlib import Path

import torch

_DROPPED = ("head.", "norm.")  # the classifier and its final norm
_RENAMES = [(r"^patch_embed\.proj\.", "patch_embed.projection."),
            (r"\.attn\.", ".attn.w_msa."),
            (r"\.mlp\.fc1\.", ".ffn.layers.0.0."),
            (r"\.mlp\.fc2\.", ".ffn.layers.1."),
            (r"^layers\.", "stages.")]


def _unfold_order(tensor: torch.Tensor, dim: int) -> torch.Tensor:
    """Reorder 4C channels from Swin's [x(0,0), x(1,0), x(0,1), x(1,1)] blocks to Unfold's
    channel-major order c*4 + (2*row + col)."""
    moved = tensor.movedim(dim, -1)
    channels = moved.shape[-1] // 4
    blocks = moved.reshape(*moved.shape[:-1], 4, channels)[..., [0, 2, 1, 3], :]
    return blocks.transpose(-1, -2).reshape(moved.shape).movedim(-1, dim)


def timm_to_mmdet(state_dict: dict[str, torch.Tensor], reset_steps: bool = True) -> dict[str, torch.Tensor]:
    """A timm SwinTransformer state dict as mmdet ``SwinTransformer`` weights, ``backbone.``-prefixed."""
    converted = {}
    for key, value in state_dict.items():
        if key.startswith(_DROPPED):
            continue
        merging = re.match(r"^layers\.(\d+)\.downsample\.(norm|reduction)\.(.+)$", key)
        if merging:
            stage, part, leaf = merging.groups()
            key = f"stages.{int(stage) - 1}.downsample.{part}.{leaf}"
            if part == "reduction" and leaf == "weight":
                value = _unfold_order(value, 1)
            elif part == "norm" and value.ndim >= 1:
                value = _unfold_order(value, -1)
        else:
            for pattern, replacement in _RENAMES:
                key = re.sub(pattern, replacement, key)
        if reset_steps and key.endswith("num_iters"):
            value = torch.zeros_like(value)
        converted["backbone." + key] = value
    return converted


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("checkpoint", type=Path, help="last.pt of a swin_t classification run")
    parser.add_argument("out", type=Path)
    parser.add_argument("--keep-steps", action="store_true", help="do not reset step counters")
    parser.add_argument("--no-ema", action="store_true", help="use the raw, not EMA, weights")
    args = parser.parse_args()
    saved = torch.load(args.checkpoint, map_location="cpu", weights_only=False)
    weights = (None if args.no_ema else saved.get("model_ema")) or saved["model"]
    torch.save({"state_dict": timm_to_mmdet(weights, reset_steps=not args.keep_steps)}, args.out)
    print(f"wrote {args.out}: mmdet Swin backbone weights (init_cfg=dict(type='Pretrained', "
          f"checkpoint='{args.out}'))")


if __name__ == "__main__":
    main()
