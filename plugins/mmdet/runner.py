"""The mmdetection backend of ``scripts/train.py`` (``model.backend=mmdet``).

The paper's configs in ``configs/mmdet`` are filled from the Hydra config (norm, data,
schedule, scale) and run by mmengine's Runner; the run directory gets the same
``config.yaml``, ``metrics.jsonl`` and ``result.json`` as the torchvision backend, with COCO
AP under the same names. Resume uses mmengine's own ``last_checkpoint``; a collapse (checked
by our detector on every iteration's loss) ends the run with ``status: FAIL``.
"""
from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Sequence

import torch
from mmengine.config import Config
from mmengine.hooks import Hook
from mmengine.registry import HOOKS
from mmengine.runner import Runner
from omegaconf import DictConfig, OmegaConf

from plugins.norms import fit_norm_to_run, norm_options
from plugins.runlog import (CollapseDetector, RunDirectory, TrainingCollapsed, record_collapse,
                            rejected_steps)
from plugins.scale import effective_config
from plugins.training import read_checkpoint, require_init

from . import norm_cfg
from .convert import timm_to_mmdet

CHECKPOINT = "last_checkpoint"  # mmengine's pointer to the newest checkpoint
CONFIGS = Path(__file__).resolve().parents[2] / "configs" / "mmdet"
_COCO_NAMES = {"mAP": "AP", "mAP_50": "AP50", "mAP_75": "AP75", "mAP_s": "APs", "mAP_m": "APm",
               "mAP_l": "APl"}


def our_metrics(mm_metrics: dict) -> dict[str, float]:
    """mmdet's ``coco/bbox_mAP_50`` (a fraction) as our ``bbox_AP50`` (percent)."""
    ours = {}
    for key, value in mm_metrics.items():
        iou_type, _, name = key.removeprefix("coco/").partition("_")
        if name in _COCO_NAMES and value >= 0:
            ours[f"{iou_type}_{_COCO_NAMES[name]}"] = 100.0 * float(value)
    return ours


@HOOKS.register_module(force=True)
class UnnormRunHook(Hook):
    """Feeds every iteration's loss to our collapse detector and logs metrics our way."""

    priority = "LOW"

    def __init__(self, run_dir: str, collapse: dict):
        self.run = RunDirectory(Path(run_dir))
        self.detector = CollapseDetector(**collapse)
        self.last: dict = {}

    def after_train_iter(self, runner, batch_idx, data_batch=None, outputs=None) -> None:
        if outputs is not None and "loss" in outputs:
            self.detector.update(runner.iter + 1, outputs["loss"])

    def after_train_epoch(self, runner) -> None:
        self.detector.check()

    def after_val_epoch(self, runner, metrics=None) -> None:
        self.last = {"epoch": runner.epoch, "step": runner.iter, **our_metrics(metrics or {})}
        if runner.rank == 0:
            self.run.log(**self.last)


def mmdet_config(cfg: DictConfig, out_dir: Path) -> Config:
    """The mmdet config of this run: the paper's file, with our norm, data and schedule."""
    model, recipe, data = cfg.model, cfg.recipe, cfg.data
    mm = Config.fromfile(str(CONFIGS / f"{model.name.replace('_swin_t', '_swin_t_fpn')}_3x_coco.py"))
    options = norm_options(cfg.norm)
    backbone = mm.model.backbone
    backbone.norm_cfg = norm_cfg(cfg.norm.name, **options)
    kwargs = OmegaConf.to_container(model.backbone.kwargs, resolve=True)
    backbone.drop_path_rate = kwargs.get("drop_path_rate", backbone.drop_path_rate)
    if "embed_dim" in kwargs:  # a narrow Swin (scale=cpu)
        backbone.update(embed_dims=kwargs["embed_dim"], depths=kwargs["depths"],
                        num_heads=kwargs["num_heads"], window_size=kwargs["window_size"])
        mm.model.neck.in_channels = [kwargs["embed_dim"] * 2 ** i for i in range(4)]
    width = model.fpn_channels
    categories = json.loads((Path(data.root) / data.val.annotations).read_text())["categories"]
    classes = [category["name"] for category in categories]
    mm.model.neck.out_channels = width
    mm.model.rpn_head.update(in_channels=width, feat_channels=width)
    mm.model.rpn_head.anchor_generator.scales = [model.anchor_sizes[0] // 4]  # P2's stride is 4
    heads = mm.model.roi_head
    heads.bbox_roi_extractor.out_channels = width
    heads.bbox_head.update(in_channels=width, fc_out_channels=model.box_head_dim,
                           num_classes=len(classes))
    if model.masks:
        heads.mask_roi_extractor.out_channels = width
        heads.mask_head.update(num_classes=len(classes), in_channels=width,
                               conv_out_channels=model.mask_head_layers[-1],
                               num_convs=len(model.mask_head_layers))
    if cfg.scale.name != "full":  # plain multi-scale resizing at the model config's sizes
        scales = [(model.max_size, size) for size in model.min_size]
        pipeline = mm.train_dataloader.dataset.pipeline
        pipeline[3] = dict(type="RandomChoiceResize", scales=scales, keep_ratio=True)
        mm.val_dataloader.dataset.pipeline[1].scale = scales[-1]
    for split, loader in (("train", mm.train_dataloader), ("val", mm.val_dataloader)):
        paths = data[split]
        loader.dataset.update(data_root=str(data.root), ann_file=paths.annotations,
                              data_prefix=dict(img=paths.images + "/"), metainfo=dict(classes=classes))
        loader.update(num_workers=cfg.scale.num_workers, persistent_workers=cfg.scale.num_workers > 0)
    mm.test_dataloader = mm.val_dataloader
    mm.val_evaluator.ann_file = str(Path(data.root) / data.val.annotations)
    mm.test_evaluator = mm.val_evaluator
    world = int(os.environ.get("WORLD_SIZE", "1"))
    mm.train_dataloader.batch_size = recipe.batch_size // world
    peak_lr = recipe.lr * recipe.batch_size / recipe.lr_batch * cfg.lr_multiple
    mm.optim_wrapper.optimizer.update(lr=peak_lr, weight_decay=recipe.weight_decay)
    if recipe.clip_grad:
        mm.optim_wrapper.clip_grad = dict(max_norm=recipe.clip_grad)
    mm.param_scheduler = [
        dict(type="LinearLR", start_factor=recipe.warmup_ratio, by_epoch=False, begin=0,
             end=recipe.warmup_iters),
        dict(type="MultiStepLR", begin=0, end=recipe.epochs, by_epoch=True,
             milestones=list(recipe.decay_epochs), gamma=recipe.decay_rate)]
    mm.train_cfg.update(max_epochs=recipe.epochs, val_interval=recipe.eval_every)
    mm.work_dir = str(out_dir)
    mm.randomness = dict(seed=cfg.seed)
    mm.resume = (out_dir / CHECKPOINT).exists()
    mm.default_hooks.logger.interval = cfg.collapse.check_every
    mm.custom_hooks = [dict(type="UnnormRunHook", run_dir=str(out_dir),
                            collapse=OmegaConf.to_container(cfg.collapse))]
    if cfg.device == "cpu" or not torch.cuda.is_available():
        mm.env_cfg.dist_cfg.backend = "gloo"
    return mm


def train(cfg: DictConfig, out_dir: Path, overrides: Sequence[str] = ()) -> dict:
    """Train and evaluate one detection run with mmdetection; returns ``result.json``'s content."""
    meta = {"exp_data": cfg.data.name, "overrides": list(overrides)}
    cfg = effective_config(cfg, overrides)
    out_dir = Path(out_dir)
    # mmengine's checkpoints hold its own objects, and it never passes weights_only to torch.load
    os.environ.setdefault("TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD", "1")
    for option in ("record_statistics", "compile"):
        if cfg[option]:
            raise ValueError(f"{option}=true is supported by model.backend=torchvision; drop it "
                             "for the mmdet backend")
    require_init(cfg)
    if cfg.data.get("generate"):
        from plugins.torchvision.shapes import ensure_shapes
        ensure_shapes(Path(cfg.data.root), **cfg.data.generate)
    cfg = fit_norm_to_run(cfg, cfg.recipe.epochs * steps_per_epoch(cfg))
    run = RunDirectory(out_dir)
    finished = run.begin(OmegaConf.to_yaml(cfg, resolve=True),
                         resuming=(out_dir / CHECKPOINT).exists())
    if finished is not None:
        return finished
    mm = mmdet_config(cfg, out_dir)
    init = "scratch"
    if cfg.init_from:
        saved = read_checkpoint(Path(cfg.init_from), "init_from")
        converted = out_dir / "backbone_init.pth"
        torch.save({"state_dict": timm_to_mmdet(saved.get("model_ema") or saved["model"],
                                                reset_steps=cfg.reset_norm_steps)}, converted)
        mm.model.backbone.init_cfg = dict(type="Pretrained", checkpoint=str(converted))
        init = cfg.init_from
    mm.dump(str(out_dir / "mmdet_config.py"))
    meta = {**meta, "task": "detection", "exp": cfg.exp_name, "model": cfg.model.name,
            "data": cfg.data.name, "norm": cfg.norm.name, "norm_options": norm_options(cfg.norm),
            "seed": cfg.seed, "scale": cfg.scale.name, "epochs": cfg.recipe.epochs, "init": init,
            "backend": "mmdet", "world_size": int(os.environ.get("WORLD_SIZE", "1")),
            "run_dir": str(out_dir)}
    runner = Runner.from_cfg(mm)
    hook = next(h for h in runner.hooks if isinstance(h, UnnormRunHook))
    try:
        runner.train()
        meta.update(steps=runner.iter, **rejected_steps(runner.model.state_dict()))
        result = run.write_result(status="ok", metrics=hook.last, meta=meta)
    except TrainingCollapsed as collapse:
        meta.update(rejected_steps(runner.model.state_dict()))
        result = record_collapse(run, collapse, hook.last, meta)
    return result


def steps_per_epoch(cfg: DictConfig) -> int:
    """Training iterations per epoch: the annotated images of the training split (mmdet
    drops images without objects) over the global batch."""
    coco = json.loads((Path(cfg.data.root) / cfg.data.train.annotations).read_text())
    annotated = {a["image_id"] for a in coco["annotations"] if not a.get("iscrowd", 0)}
    return len(annotated) // cfg.recipe.batch_size
