"""Detection training (torchvision Faster / Mask R-CNN, Swin backbone with any norm) and COCO
evaluation. The schedule follows mmdetection's Swin configs: AdamW, linear warm-up over
iterations, step decay at given epochs, multi-scale training.

Runs on one process or under ``torchrun`` (DDP; the replicas' norm state is made one before
every evaluation and checkpoint, ``norm_sync``). Checkpoints every epoch to ``last.pt`` and
resumes from it; a collapse ends the run cleanly with ``status: FAIL`` in ``result.json``.
"""
from __future__ import annotations

from pathlib import Path
from typing import Sequence

import torch
from omegaconf import DictConfig
from timm.optim import create_optimizer_v2, param_groups_weight_decay
from timm.scheduler import create_scheduler_v2

from plugins.loop import CHECKPOINT, EpochLoop
from plugins.runlog import DETECTION_CHANCE, run_meta
from plugins.sam import freeze_except
from plugins.training import (Distributed, amp_context, begin_run, data_parallel,
                              epoch_plan, load_weights, require_init, run_task)

from .coco import CocoInstances, coco_evaluate, collate, to_coco_results
from .detectors import CLASSIFIER_ONLY, build_detector
from .shapes import ensure_shapes


RANGES = {"recipe.lr": "> 0", "recipe.lr_batch": "> 0", "recipe.batch_size": ">= 1",
          "recipe.epochs": ">= 1", "recipe.warmup_iters": ">= 0", "recipe.warmup_ratio": "in [0, 1]",
          "recipe.decay_rate": "> 0", "recipe.weight_decay": ">= 0",
          "recipe.clip_grad": "null or > 0", "recipe.eval_every": ">= 1"}


def build_datasets(data_cfg, masks: bool) -> tuple[CocoInstances, CocoInstances]:
    """The train and val splits of a COCO-layout set; the generated shapes are made on demand."""
    root = Path(data_cfg.root)
    if data_cfg.get("generate"):
        ensure_shapes(root, **data_cfg.generate)
    splits = []
    for split, train in (("train", True), ("val", False)):
        paths = data_cfg[split]
        splits.append(CocoInstances(root / paths.images, root / paths.annotations, train, masks))
    return splits[0], splits[1]


@torch.no_grad()
def evaluate(model, dataset: CocoInstances, batch_size: int, world: Distributed, amp,
             iou_types: Sequence[str]) -> dict[str, float]:
    """COCO AP of ``model`` on ``dataset`` (each replica predicts a shard of it)."""
    model.eval()
    loader = torch.utils.data.DataLoader(world.shard(dataset), batch_size=batch_size,
                                         collate_fn=collate)
    results = []
    for images, targets in loader:
        with amp():
            predictions = model([image.to(world.device) for image in images])
        for target, prediction in zip(targets, predictions):
            results += to_coco_results(target["image_id"], prediction)
    results = [entry for part in world.gather(results) for entry in part]
    return coco_evaluate(dataset.coco, results, iou_types)


def train(cfg: DictConfig, out_dir: Path, overrides: Sequence[str] = ()) -> dict:
    """Train and evaluate one detection run; returns the ``result.json`` content."""
    return run_task(_train, cfg, out_dir, overrides, RANGES)


def _train(cfg: DictConfig, out_dir: Path, world: Distributed, meta: dict) -> dict:
    recipe, device = cfg.recipe, world.device
    require_init(cfg)
    iou_types = ("bbox", "segm") if cfg.model.masks else ("bbox",)
    train_set, val_set = build_datasets(cfg.data, cfg.model.masks)
    batch, sampler, steps_per_epoch = epoch_plan(train_set, recipe.batch_size,
                                                 cfg.scale.max_steps_per_epoch, world, cfg.seed)
    cfg, run, finished = begin_run(cfg, out_dir, world, recipe.epochs * steps_per_epoch, CHECKPOINT)
    if finished is not None:
        return finished

    model = build_detector(cfg.model, cfg.norm, train_set.num_classes).to(device)
    init = "scratch"
    if cfg.init_from:  # an ImageNet classification run of ours, into the backbone
        init = load_weights(model.backbone.body, cfg.init_from, cfg.reset_norm_steps,
                            ignore=CLASSIFIER_ONLY, trusted=cfg.trust_checkpoint)
    if world.main:
        print(f"{cfg.exp_name}: {cfg.model.name} with {cfg.norm.name} on {cfg.data.name} "
              f"(scale {cfg.scale.name}, init {init}, {world.world} process(es), {device})")

    freeze_except(model, cfg.train_only, head=model.roi_heads)  # train_only=norm|norm+head
    skip = {f"backbone.body.{name}" for name in model.backbone.body.no_weight_decay()}
    skip |= {name for name, _ in model.named_parameters() if "relative_position_bias_table" in name}
    peak_lr = recipe.lr * recipe.batch_size / recipe.lr_batch * cfg.lr_multiple
    optimizer = create_optimizer_v2(
        param_groups_weight_decay(model, recipe.weight_decay, no_weight_decay_list=skip),
        opt=recipe.opt, lr=peak_lr,
        weight_decay=recipe.weight_decay)
    scheduler, epochs = create_scheduler_v2(
        optimizer, sched="multistep", num_epochs=recipe.epochs,
        decay_milestones=list(recipe.decay_epochs), decay_rate=recipe.decay_rate,
        warmup_epochs=recipe.warmup_iters / steps_per_epoch,
        warmup_lr=peak_lr * recipe.warmup_ratio, step_on_epochs=False,
        updates_per_epoch=steps_per_epoch)
    amp, scaler = amp_context(cfg.amp, device, model)
    loop = EpochLoop(cfg, out_dir, world, run, model, optimizer, scheduler, scaler,
                     stats_module=model.backbone)
    init = loop.resume(init)

    if cfg.compile:  # the backbone: torchvision's heads branch on data; in place, keys unchanged
        model.backbone.compile(dynamic=True)
    net = data_parallel(model, device) if world.world > 1 else model

    def forward(batch):
        images, targets = batch
        images = [image.to(device, non_blocking=True) for image in images]
        targets = [{k: v.to(device) if torch.is_tensor(v) else v for k, v in t.items()}
                   for t in targets]
        with amp():
            return net(images, targets)

    def scores(epoch: int) -> dict:
        if (epoch + 1) % recipe.eval_every and epoch + 1 != epochs:
            return {}
        return evaluate(model, val_set, batch, world, amp, iou_types)

    return loop.fit(
        net, train_set, batch, sampler, steps_per_epoch, epochs, forward=forward, evaluate=scores,
        summary=lambda m: " ".join(f"{k} {m[k]:.2f}" for k in ("bbox_AP", "segm_AP") if k in m),
        meta={**meta, **run_meta(cfg, "detection", world.world, out_dir, backend="torchvision",
                                 chance=DETECTION_CHANCE)},
        init=init, collate_fn=collate, clip_grad=recipe.clip_grad)
