"""timm models with our norms, and their fold plans (which linear reads each norm)."""
from __future__ import annotations

from typing import Mapping, Optional

import timm
import torch
from omegaconf import OmegaConf
from timm.models.swin_transformer import SwinTransformer, SwinTransformerBlock
from torch import nn

import unnorm
from plugins.model_options import separate_class_token, standardize_layers
from plugins.norms import groups_by_heads, norm_kwargs

from .t2t_vit import T2TViT


def create_classifier(timm_name: str, norm_cfg: Mapping, num_classes: int, img_size: int,
                      **kwargs) -> nn.Module:
    """``timm.create_model`` with every norm layer built as ``norm_cfg`` says.

    PN with layer-scale and ``group_num: null`` groups each norm's channels by the number of
    attention heads of its block, as the release does (``block_heads``)."""
    model = timm.create_model(timm_name, pretrained=False, num_classes=num_classes,
                              img_size=img_size, norm_layer=host_norm_layer(norm_cfg), **kwargs)
    if groups_by_heads(norm_cfg):
        regroup(model, norm_cfg, block_heads(model))
    return model


def host_norm_layer(norm_cfg: Mapping):
    """The ``norm_layer`` a host model builds its norms with (PN's head groups come after)."""
    options = norm_kwargs(norm_cfg)
    if groups_by_heads(norm_cfg):
        options["group_num"] = 1  # until ``regroup`` knows each norm's block
    return unnorm.norm_layer(norm_cfg["name"], **options)


def regroup(model: nn.Module, norm_cfg: Mapping, heads: Mapping[str, int]) -> None:
    """Rebuild the named PN-with-layer-scale norms with ``heads[name]`` groups."""
    for name, count in heads.items():
        old = model.get_submodule(name)
        new = unnorm.build_norm("pn_ls", old.num_features, **{**norm_kwargs(norm_cfg),
                                                              "group_num": count})
        unnorm.replace_module(model, name, new.to(old.weight.device).train(old.training))


def block_heads(model: nn.Module) -> dict[str, int]:
    """The number of attention heads each PN-with-layer-scale norm of ``model`` groups by:
    that of the smallest enclosing module whose attentions all have one count (a block, a
    Swin stage: so a patch merging counts with the stage it starts); for a norm outside every
    such module, the next attention's (Swin's patch embedding), else the previous one's (the
    final norm). An attention without ``num_heads`` (T2T's Performer token layers) has one."""
    attentions = [(name, getattr(m, "num_heads", 1)) for name, m in model.named_modules()
                  if isinstance(getattr(m, "num_heads", None), int) or name.endswith(".attn")]
    order = {name: i for i, (name, _) in enumerate(model.named_modules())}
    heads = {}
    for name, module in model.named_modules():
        if not (isinstance(module, unnorm.PowerNorm) and module.layer_scale):
            continue
        parts = name.split(".")
        for depth in range(len(parts) - 1, 0, -1):
            prefix = ".".join(parts[:depth]) + "."
            counts = {h for attention, h in attentions if attention.startswith(prefix)}
            if len(counts) == 1:
                heads[name] = counts.pop()
                break
        else:
            after = [h for attention, h in attentions if order[attention] > order[name]]
            before = [h for attention, h in attentions if order[attention] < order[name]]
            if not attentions:
                raise ValueError(f"{name}: no attention in the model to take PN's group_num "
                                 "from; set norm.group_num")
            heads[name] = after[0] if after else before[-1]
    return heads


def model_from_config(cfg) -> nn.Module:
    """The classifier a run config describes (``model``, ``norm``, ``data.num_classes``),
    with the layer options ``model.class_norm`` (SepNorm) and ``model.weight_standardization``
    (``plugins.model_options``)."""
    kwargs = cfg.model.kwargs
    if not isinstance(kwargs, dict):
        kwargs = OmegaConf.to_container(kwargs, resolve=True)
    model = create_classifier(cfg.model.timm_name, cfg.norm, cfg.data.num_classes,
                              cfg.model.img_size, **kwargs)
    separate_class_token(model, cfg.model, class_token_sites(model))
    standardize_layers(model, cfg.model, embedding=[embedding_name(model)],
                       head=[classifier_prefix(model).removesuffix(".")])
    return model


def class_token_sites(model: nn.Module) -> Optional[dict[str, list[str]]]:
    """The norms a class token passes (``all``: T2T-ViT's blocks and final norm; its
    tokens-to-token stem runs before the class token joins) and the last of them (``final``),
    as ``fnmatch`` patterns; None for a model without a class token (Swin)."""
    if isinstance(model, T2TViT):
        return {"all": ["blocks.*", "norm"], "final": ["norm"]}
    return None


def embedding_name(model: nn.Module) -> str:
    """The module that embeds the image as tokens: Swin's ``patch_embed``, T2T-ViT's
    ``tokens_to_token`` stem."""
    return "tokens_to_token" if isinstance(model, T2TViT) else "patch_embed"


def classifier_prefix(model: nn.Module) -> str:
    """The state-dict prefix of the model's classifier (``head.``, ``head.fc.``)."""
    head = model.get_classifier()
    return next(name for name, module in model.named_modules() if module is head) + "."


def _swin_block_pads(block: SwinTransformerBlock) -> bool:
    """Whether the block zero-pads its windows after norm1: at a fixed input size, when the
    map does not tile into windows; at any input size (dynamic mask), possibly."""
    if getattr(block, "dynamic_mask", False):
        return True
    height, width = block.input_resolution
    return bool(height % block.window_size[0] or width % block.window_size[1])


def swin_fold_plan(model: SwinTransformer) -> dict[str, list[str]]:
    """The fold plan of a Swin's stages (patch embedding, blocks, patch merging).

    Empty lists mark norms that become a frozen affine: the patch-embedding norm (it feeds
    the residual stream) and block norms whose windows get zero-padded after the norm (the
    padded tokens would see the folded bias, and Swin does not mask them).
    """
    plan: dict[str, list[str]] = {"patch_embed.norm": []}
    for name, module in model.named_modules():
        if isinstance(module, SwinTransformerBlock):
            plan[f"{name}.norm1"] = [] if _swin_block_pads(module) else [f"{name}.attn.qkv"]
            plan[f"{name}.norm2"] = [f"{name}.mlp.fc1"]
        elif name.endswith("downsample") and hasattr(module, "reduction"):
            plan[f"{name}.norm"] = [f"{name}.reduction"]
    return plan


def fold_plan(model: nn.Module) -> dict[str, list[str]]:
    """Map each norm of a Swin or T2T-ViT classifier to the linear layers reading its output."""
    if isinstance(model, SwinTransformer):
        plan = swin_fold_plan(model)
        plan["norm"] = ["head.fc"]  # global average pooling commutes with the affine
    elif isinstance(model, T2TViT):
        plan = {}
        layers = ["tokens_to_token.layer1", "tokens_to_token.layer2"]
        layers += [f"blocks.{i}" for i in range(len(model.blocks))]
        for name in layers:
            plan[f"{name}.norm1"] = [f"{name}.attn.qkv"]
            plan[f"{name}.norm2"] = [f"{name}.mlp.fc1"]
        plan["norm"] = ["head"]  # the class token is selected: a per-channel affine commutes
    else:
        raise TypeError(f"no fold plan for {type(model).__name__}; write one mapping each norm "
                        "to the linear layers that read it (unnorm.fold_norms)")
    return separated_plan(model, plan)


def separated_plan(model: nn.Module, plan: dict[str, list[str]]) -> dict[str, list[str]]:
    """``plan`` with each SepNorm site (``model.class_norm``) as its two norms, each a frozen
    affine: they normalise different tokens that the same linear layers read, so neither
    folds into those layers (``unnorm.fold_norms`` refuses it)."""
    separated = {}
    for name, linears in plan.items():
        if isinstance(model.get_submodule(name), unnorm.SeparateClassNorm):
            separated.update({f"{name}.class_norm": [], f"{name}.token_norm": []})
        else:
            separated[name] = linears
    return separated


def fold_model(model: nn.Module, *, probe: Optional[torch.Tensor]) -> dict[str, int]:
    """Fold every offline norm (and DyT's affine) of an eval-mode classifier in place
    (``unnorm.fold_by_plan`` with the classifier's plan, proved on ``probe``, a batch of images;
    None: unchecked)."""
    return unnorm.fold_by_plan(model, fold_plan(model), probe=probe)
