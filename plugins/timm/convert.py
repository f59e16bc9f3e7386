"""Pre-LN -> Pre-RMSNorm / Pre-CRMSNorm for the timm classifiers (``unnorm.convert``).

Which norms convert, and why:

- **T2T-ViT**: the backbone's blocks (``norm1``, ``norm2``) and the final ``norm``. Its stream
  starts at the T2T module's ``proj``; the class token and the sinusoid ``pos_embed`` buffer
  also write it, each block's ``attn.proj`` and ``mlp.fc2`` add to it, and the head reads the
  final norm (the class token's row, or the mean of the others: both commute with the
  conversion). The T2T module's Performer token layers stay LayerNorm: they are the stem, not
  the stream; their first norm reads raw pixel patches (not zero-mean), and their attention
  changes the width and carries its residual inside, on the value path.
- **Swin**: its last stage only (that stage's blocks and the final ``norm``). A patch merging's
  LayerNorm reads four tokens side by side and subtracts their joint mean, so it sees how each
  token's own mean differs from the others': a centred stream has lost that, and every stage
  that feeds a patch merging keeps its LayerNorms. The last stage's stream starts at its patch
  merging's ``reduction`` (the merging's norm stays a LayerNorm); its blocks' ``attn.proj`` and
  ``mlp.fc2`` add to it, and the head's ``fc`` reads the final norm after average pooling
  (which commutes). The relative position bias is inside the attention and plays no part. A
  block that zero-pads its windows after ``norm1`` (a map that does not tile into windows)
  keeps that norm's shift in its RMSNorm, as the padded tokens must not see it; such a model
  converts to Pre-RMSNorm but not to Pre-CRMSNorm.

The model changes in place. ``num_features`` (and ``embed_dim`` in T2T-ViT) follow the final
stream's width.
"""
from __future__ import annotations

from timm.models.swin_transformer import PatchMerging, SwinTransformer
from torch import nn

import unnorm

from .models import _swin_block_pads
from .t2t_vit import T2TViT


def _t2t_plan(model: T2TViT) -> tuple[list[str], dict[str, list[str]]]:
    writers = ["tokens_to_token.proj", "cls_token", "pos_embed"]
    readers: dict[str, list[str]] = {}
    for i in range(len(model.blocks)):
        writers += [f"blocks.{i}.attn.proj", f"blocks.{i}.mlp.fc2"]
        readers[f"blocks.{i}.norm1"] = [f"blocks.{i}.attn.qkv"]
        readers[f"blocks.{i}.norm2"] = [f"blocks.{i}.mlp.fc1"]
    readers["norm"] = ["head"] if isinstance(model.head, nn.Linear) else []  # none: no classes
    return writers, readers


def _swin_plan(model: SwinTransformer) -> tuple[list[str], dict[str, list[str]]]:
    last = len(model.layers) - 1
    stage = f"layers.{last}"
    if not isinstance(model.layers[last].downsample, PatchMerging):
        raise ValueError("this Swin has no patch merging before its last stage, so nothing "
                         "starts a stream that can be centred; only the stage after a patch "
                         "merging converts")
    writers = [f"{stage}.downsample.reduction"]
    readers: dict[str, list[str]] = {}
    for i, block in enumerate(model.layers[last].blocks):
        name = f"{stage}.blocks.{i}"
        writers += [f"{name}.attn.proj", f"{name}.mlp.fc2"]
        readers[f"{name}.norm1"] = [] if _swin_block_pads(block) else [f"{name}.attn.qkv"]
        readers[f"{name}.norm2"] = [f"{name}.mlp.fc1"]
    readers["norm"] = ["head.fc"] if isinstance(model.head.fc, nn.Linear) else []
    return writers, readers


def _plan(model: nn.Module):
    if isinstance(model, T2TViT):
        return _t2t_plan(model)
    if isinstance(model, SwinTransformer):
        return _swin_plan(model)
    raise TypeError(f"no Pre-RMSNorm conversion for {type(model).__name__}: list its stream's "
                    "writers and each norm's readers for unnorm.convert_to_pre_rms")


def to_pre_rms(model: nn.Module) -> nn.Module:
    """A Pre-LN T2T-ViT or Swin (``norm=ln``) as Pre-RMSNorm, in place: the converted stream's
    writers centred, its LayerNorms RMSNorms with their shifts folded into the readers. Eval
    outputs are unchanged; any other norm is refused before anything changes."""
    unnorm.convert_to_pre_rms(model, *_plan(model))
    return model


def to_pre_crms(model: nn.Module) -> nn.Module:
    """A Pre-LN T2T-ViT or Swin (``norm=ln``) as Pre-CRMSNorm, in place: the converted stream
    one coordinate narrower, its LayerNorms ``unnorm.CompressedRMSNorm``. Eval outputs are
    unchanged; any other norm is refused before anything changes."""
    unnorm.convert_to_pre_crms(model, *_plan(model))
    model.num_features -= 1
    model.head_hidden_size = model.num_features
    if isinstance(model, T2TViT):
        model.embed_dim = model.num_features
    return model
