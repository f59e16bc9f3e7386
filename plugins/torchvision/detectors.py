"""torchvision's Faster / Mask R-CNN on a timm Swin backbone whose every norm is ours.

The backbone follows Swin's detection code: the four stages' outputs, each through a norm of
the chosen kind, feed an FPN (P2-P5 plus a max-pooled P6). The heads are torchvision's.
"""
from __future__ import annotations

from collections import OrderedDict
from typing import Optional

import torch
from omegaconf import OmegaConf
from torch import nn
from torchvision.models.detection import FasterRCNN, MaskRCNN
from torchvision.models.detection.anchor_utils import AnchorGenerator
from torchvision.models.detection.faster_rcnn import FastRCNNPredictor, TwoMLPHead
from torchvision.models.detection.mask_rcnn import MaskRCNNHeads, MaskRCNNPredictor
from torchvision.ops.feature_pyramid_network import FeaturePyramidNetwork, LastLevelMaxPool

import unnorm
from plugins.model_options import standardize_layers
from plugins.timm.models import (create_classifier, groups_by_heads, host_norm_layer, regroup,
                                 swin_fold_plan)

# A classifier checkpoint's keys the backbone has no use for: the head and the final norm.
CLASSIFIER_ONLY = ("head.", "norm.")
# The layers that predict the outputs (classes, boxes, masks, objectness): no norm pairs with
# them, so model.weight_standardization may not reach them.
PREDICTORS = ("roi_heads.box_predictor", "roi_heads.mask_predictor", "rpn.head.cls_logits",
              "rpn.head.bbox_pred")


class SwinFPN(nn.Module):
    """Swin stages -> a norm per stage output -> FPN; ``out_channels`` as torchvision expects."""

    def __init__(self, swin: nn.Module, norm_layer, out_channels: int):
        super().__init__()
        swin.norm, swin.head = nn.Identity(), nn.Identity()  # classification only
        self.body = swin
        widths = [info["num_chs"] for info in swin.feature_info]
        self.out_norms = nn.ModuleList(norm_layer(width) for width in widths)
        self.fpn = FeaturePyramidNetwork(widths, out_channels, extra_blocks=LastLevelMaxPool())
        self.out_channels = out_channels

    def forward(self, images: torch.Tensor) -> "OrderedDict[str, torch.Tensor]":
        tokens = self.body.patch_embed(images)  # (B, H, W, C) throughout the stages
        features = OrderedDict()
        for index, (stage, norm) in enumerate(zip(self.body.layers, self.out_norms)):
            tokens = stage(tokens)
            features[str(index)] = norm(tokens).permute(0, 3, 1, 2)
        return self.fpn(features)


def build_detector(model_cfg, norm_cfg, num_classes: int) -> nn.Module:
    """Faster R-CNN, or Mask R-CNN when ``model_cfg.masks``, as the model config describes
    (``weight_standardization``: the detector's layers so named, ``plugins.model_options``)."""
    cfg = OmegaConf.to_container(model_cfg, resolve=True) if not isinstance(model_cfg, dict) else model_cfg
    backbone_cfg = cfg["backbone"]
    swin = create_classifier(backbone_cfg["timm_name"], norm_cfg, 0, backbone_cfg["img_size"],
                             strict_img_size=False, **backbone_cfg.get("kwargs", {}))
    backbone = SwinFPN(swin, host_norm_layer(norm_cfg), cfg["fpn_channels"])
    if groups_by_heads(norm_cfg):  # each stage output's norm groups by that stage's heads
        stage_heads = [stage.blocks[0].attn.num_heads for stage in swin.layers]
        regroup(backbone, norm_cfg, {f"out_norms.{i}": h for i, h in enumerate(stage_heads)})
    levels = len(swin.feature_info) + 1  # P2..P5 and the pooled P6
    if len(cfg["anchor_sizes"]) != levels:
        raise ValueError(f"anchor_sizes needs one size per FPN level ({levels}), got {cfg['anchor_sizes']}")
    heads = {
        "rpn_anchor_generator": AnchorGenerator(tuple((size,) for size in cfg["anchor_sizes"]),
                                                ((0.5, 1.0, 2.0),) * levels),
        "box_head": TwoMLPHead(cfg["fpn_channels"] * 7 * 7, cfg["box_head_dim"]),
        "box_predictor": FastRCNNPredictor(cfg["box_head_dim"], num_classes),
    }
    detector_cls = FasterRCNN
    if cfg["masks"]:
        layers = tuple(cfg["mask_head_layers"])
        heads["mask_head"] = MaskRCNNHeads(cfg["fpn_channels"], layers, 1)
        heads["mask_predictor"] = MaskRCNNPredictor(layers[-1], layers[-1], num_classes)
        detector_cls = MaskRCNN
    detector = detector_cls(backbone, num_classes=None, min_size=tuple(cfg["min_size"]),
                            max_size=cfg["max_size"], **heads, **cfg.get("detector_kwargs", {}))
    standardize_layers(detector, cfg, embedding=["backbone.body.patch_embed"], head=PREDICTORS)
    return detector


def detector_fold_plan(detector: nn.Module) -> dict[str, list[str]]:
    """Every norm of the backbone and the layers it folds into.

    Block norms before windowed attention become frozen affines (input sizes vary, so any
    window may be zero-padded after the norm); each stage-output norm folds into its FPN
    lateral 1x1 convolution, exactly at every pixel, padding included.
    """
    body = "backbone.body."
    plan = {body + norm: [body + linear for linear in linears]
            for norm, linears in swin_fold_plan(detector.backbone.body).items()}
    for index in range(len(detector.backbone.out_norms)):
        plan[f"backbone.out_norms.{index}"] = [f"backbone.fpn.inner_blocks.{index}.0"]
    return plan


def fold_detector(detector: nn.Module, *, probe: Optional[torch.Tensor]) -> dict[str, int]:
    """Fold the offline norms of an eval-mode detector in place, proved on the backbone's FPN
    features of ``probe``, a batch of images (the heads branch on the data; None: unchecked)."""
    return unnorm.fold_by_plan(detector, detector_fold_plan(detector), probe=None if probe is None
                               else lambda copy: copy.backbone(probe.double()))
