"""The mmdetection plugin: our norms through mmcv's build_norm_layer and mmdet's Swin, timm
checkpoints converted to mmdet weights, the paper's configs, and the Hydra backend."""
from __future__ import annotations

import json
import shutil

import pytest
import torch

pytest.importorskip("mmdet.models", reason="mmdetection not installed: scripts/install_mmdet.sh")
from mmcv.cnn import build_norm_layer  # noqa: E402
from mmengine.config import Config, ConfigDict  # noqa: E402
from mmengine.optim import build_optim_wrapper  # noqa: E402
from mmdet.registry import MODELS  # noqa: E402
from mmdet.utils import register_all_modules  # noqa: E402

import unnorm  # noqa: E402
from plugins.mmdet import MMDET_NAMES, norm_cfg, timm_to_mmdet  # noqa: E402
from plugins.mmdet.runner import CONFIGS, our_metrics, train  # noqa: E402
from plugins.timm import create_classifier  # noqa: E402
from test_vision import config  # noqa: E402

register_all_modules()
TINY_SWIN = dict(type="SwinTransformer", embed_dims=32, depths=[2, 2, 2, 2],
                 num_heads=[1, 2, 4, 8], window_size=7)


@pytest.mark.parametrize("norm", unnorm.available_norms())
def test_build_norm_layer_builds_ours_with_the_injected_eps(norm):
    abbr, layer = build_norm_layer(norm_cfg(norm), 24, postfix=1)
    assert type(layer) is type(unnorm.build_norm(norm, 24)) and abbr == f"{norm}1"
    if "eps" in unnorm.norm_options(norm):
        assert layer.eps == 1e-5
        assert build_norm_layer(dict(type=MMDET_NAMES[norm], eps=1e-3), 24)[1].eps == 1e-3


def test_unknown_options_and_names_fail_with_the_valid_ones():
    with pytest.raises(ValueError, match="valid options"):
        build_norm_layer(dict(type="UN", window=4), 8)
    with pytest.raises(ValueError, match="unknown norm"):
        norm_cfg("groupnorm")
    assert type(build_norm_layer(dict(type="LN"), 8)[1]) is torch.nn.LayerNorm  # mmcv's kept


@pytest.mark.parametrize("norm", ["un", "mabn", "pn", "rms", "bn"])
def test_mmdet_swin_uses_our_norms_everywhere_and_decays_none(norm):
    backbone = MODELS.build({**TINY_SWIN, "norm_cfg": norm_cfg(norm)})
    backbone.init_weights()
    norms = [m for m in backbone.modules() if isinstance(m, unnorm.ChannelNorm)]
    assert len(norms) == 2 * 8 + 3 + 4 + 1 and not any(
        isinstance(m, torch.nn.LayerNorm) for m in backbone.modules())
    assert all(torch.equal(m.weight, torch.ones_like(m.weight)) for m in norms)
    backbone.train()  # mmdet's Swin.train returns None
    outputs = backbone(torch.rand(2, 3, 64, 96))
    assert [o.shape[1] for o in outputs] == [32, 64, 128, 256]
    paper = Config.fromfile(str(CONFIGS / "mask_rcnn_swin_t_fpn_3x_coco.py"))
    wrapper = build_optim_wrapper(backbone, paper.optim_wrapper)
    decay = {id(p): group["weight_decay"] for group in wrapper.optimizer.param_groups
             for p in group["params"]}
    for module in norms:
        assert all(decay[id(p)] == 0 for p in module.parameters())
    assert decay[id(backbone.stages[0].blocks[0].ffn.layers[0][0].weight)] == 0.05


def _warm_un_classifier(size: int):
    classifier = create_classifier("swin_tiny_patch4_window7_224", {"name": "un", "warmup_iters": 2},
                                   num_classes=5, img_size=size, embed_dim=32, depths=[2, 2, 2, 2],
                                   num_heads=[1, 2, 4, 8])
    optimizer = torch.optim.SGD(classifier.parameters(), lr=0.01)
    for _ in range(6):
        loss = classifier(torch.randn(2, 3, size, size)).logsumexp(1).mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    return classifier.eval()


def test_converted_timm_checkpoint_gives_mmdet_swin_the_same_features(tmp_path):
    """Our ImageNet Swin (timm layout, UN with live statistics) loads into mmdet's Swin
    through its pretrained path: stage outputs agree, and UN's step counters restart.

    At 448 px every stage map (112 ... 14) tiles into 7x7 windows and exceeds one window:
    there timm and mmdet compute the same thing (timm drops the shift when a map is a single
    window, and the two pad and shift in different orders)."""
    classifier = _warm_un_classifier(448)
    path = tmp_path / "backbone.pth"
    torch.save({"state_dict": timm_to_mmdet(classifier.state_dict())}, path)
    backbone = MODELS.build({**TINY_SWIN, "norm_cfg": norm_cfg("un", warmup_iters=2),
                             "init_cfg": ConfigDict(type="Pretrained", checkpoint=str(path))})
    backbone.init_weights()
    backbone.eval()
    for index in range(4):  # compare the stages themselves, before the detection output norms
        setattr(backbone, f"norm{index}", torch.nn.Identity())
    images = torch.randn(2, 3, 448, 448)
    with torch.no_grad():
        want = classifier.forward_intermediates(images, intermediates_only=True)
        got = backbone(images)
    for stage, (a, b) in enumerate(zip(want, got)):
        assert (a - b).abs().max() / a.abs().max() < 1e-5, stage
    counters = [m for m in backbone.modules() if isinstance(m, unnorm.UnifiedNorm)]
    assert counters and all(int(m.num_iters) == 0 for m in counters)


def test_paper_configs_build_detectors_with_our_norms():
    for name in ("mask_rcnn_swin_t_fpn_3x_coco", "mask_rcnn_swin_t_fpn_1x_coco",
                 "faster_rcnn_swin_t_fpn_3x_coco"):
        paper = Config.fromfile(str(CONFIGS / f"{name}.py"))
        assert paper.custom_imports.imports == ["plugins.mmdet"]
        assert paper.optim_wrapper.optimizer.lr == 1e-4 and paper.train_dataloader.batch_size == 2
        assert paper.param_scheduler[1].milestones == ([8, 11] if "1x" in name else [27, 33])
        paper.model.backbone.norm_cfg = norm_cfg("un")
        detector = MODELS.build(paper.model)
        assert (detector.roi_head.with_mask) == name.startswith("mask")
        assert sum(isinstance(m, unnorm.UnifiedNorm) for m in detector.modules()) == 2 * 12 + 3 + 4 + 1


def test_metric_names_follow_ours():
    assert our_metrics({"coco/bbox_mAP": 0.456, "coco/segm_mAP_50": 0.651, "coco/bbox_mAP_l": -1.0,
                        "data_time": 0.1}) == pytest.approx({"bbox_AP": 45.6, "segm_AP50": 65.1})


def test_hydra_backend_switch_trains_and_resumes_with_mmdet(tmp_path):
    overrides = ["+exp=mask_rcnn_swin_t_un", "model.backend=mmdet", "scale=cpu", "logger=none",
                 "data=shapes", f"data.root={tmp_path / 'shapes'}", "data.generate.num_train=16",
                 "data.generate.num_val=4", "recipe.cpu.eval_every=1", "recipe.cpu.epochs=2"]
    whole = tmp_path / "whole"
    result = train(config(*overrides), whole)
    assert result["status"] == "ok" and result["backend"] == "mmdet" and result["steps"] == 4
    assert {"bbox_AP", "segm_AP"} <= set(result["metrics"])
    assert json.loads((whole / "result.json").read_text())["metrics"] == result["metrics"]
    # as if killed after its first epoch: mmengine's pointer at epoch 1, no result yet
    cut = tmp_path / "cut"
    shutil.copytree(whole, cut)
    (cut / "result.json").unlink()
    (cut / "last_checkpoint").write_text(str(cut / "epoch_1.pth"))
    logged = (cut / "metrics.jsonl").read_text().splitlines()
    (cut / "metrics.jsonl").write_text(logged[0] + "\n")
    with pytest.raises(ValueError, match="recipe.epochs"):
        train(config(*overrides[:-1], "recipe.cpu.epochs=3"), cut)
    resumed = train(config(*overrides), cut)
    assert resumed["steps"] == 4
    logged = [json.loads(line) for line in (cut / "metrics.jsonl").read_text().splitlines()]
    assert [entry["epoch"] for entry in logged] == [1, 2]
