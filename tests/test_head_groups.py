"""PN with layer-scale groups each norm's channels by the attention heads of its block, as the
release does: per block in T2T-ViT, per stage in Swin."""
from __future__ import annotations

import re

import torch

import unnorm
from plugins.scale import effective_config
from plugins.timm.models import model_from_config
from test_vision import config


def _groups(*overrides):
    cfg = effective_config(config(*overrides), overrides)
    model = model_from_config(cfg)
    groups = {name: m.group_num for name, m in model.named_modules()
              if isinstance(m, unnorm.PowerNorm)}
    return cfg, model, groups


def test_swin_groups_by_the_heads_of_each_stage():
    cfg, model, groups = _groups("+exp=swin_t_pn_ls", "scale=cpu")
    heads = list(cfg.model.kwargs.num_heads)
    assert heads == [1, 2, 4, 8]
    for name, count in groups.items():
        stage = re.match(r"layers\.(\d+)\.", name)
        want = heads[int(stage.group(1))] if stage else heads[0 if name.startswith("patch_embed") else -1]
        assert count == want, name
    assert {groups["layers.1.downsample.norm"], groups["norm"]} == {2, 8}
    model(torch.randn(2, 3, 32, 32)).sum().backward()


def test_t2t_vit_groups_by_block_and_its_performer_token_layers_by_one():
    _, model, groups = _groups("+exp=t2t_vit_14_pn_ls")
    assert {n: g for n, g in groups.items() if n.startswith("tokens_to_token")} == {
        f"tokens_to_token.layer{i}.norm{j}": 1 for i in (1, 2) for j in (1, 2)}
    assert {g for n, g in groups.items() if not n.startswith("tokens_to_token")} == {6}
    assert len(groups) == 4 + 2 * 14 + 1


def test_an_int_group_num_forces_one_count():
    _, _, groups = _groups("+exp=swin_t_pn_ls", "scale=cpu", "norm.group_num=1")
    assert set(groups.values()) == {1}


def test_the_detector_stage_output_norms_group_by_their_stage():
    from plugins.torchvision.detectors import build_detector
    cfg = effective_config(config("+exp=faster_rcnn_swin_t_pn_ls", "scale=cpu"),
                           ["+exp=faster_rcnn_swin_t_pn_ls", "scale=cpu"])
    detector = build_detector(cfg.model, cfg.norm, 4)
    out_norms = detector.backbone.out_norms
    assert [n.group_num for n in out_norms] == list(cfg.model.backbone.kwargs.num_heads)
