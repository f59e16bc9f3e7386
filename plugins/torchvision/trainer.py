"""Detection training (torchvision Faster / Mask R-CNN, Swin backbone with any norm) and COCO
evaluation. The schedule follows mmdetection's Swin configs: AdamW, linear warm-up over
iterations, step decay at given epochs, multi-scale training.

Runs on one process or under ``torchrun`` (DDP; the replicas' norm state is made one before
every evaluation and checkpoint, ``norm_sync``). Checkpoints every epoch to ``last.pt`` and
resumes from it; a collapse ends the run cleanly with ``status: FAIL`` in ``result.json``.
"""
from __future__ import annotations

import time
from pathlib import Path
from typing import Sequence

import torch
from omegaconf import DictConfig, OmegaConf
from timm.optim import create_optimizer_v2, param_groups_weight_decay
from timm.scheduler import create_scheduler_v2
from tqdm import tqdm

import unnorm
from plugins.logger import make_logger
from plugins.norms import norm_options
from plugins.runlog import CollapseDetector, TrainingCollapsed, record_collapse, rejected_steps
from plugins.training import (Checkpointer, Distributed, amp_context, begin_run, data_parallel,
                              epoch_plan, load_weights, optimizer_step, require_init, run_task,
                              save_statistics)

from .coco import CocoInstances, coco_evaluate, collate, to_coco_results
from .detectors import CLASSIFIER_ONLY, build_detector
from .shapes import ensure_shapes

CHECKPOINT = "last.pt"


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
    return run_task(_train, cfg, out_dir, overrides)


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
    detector = CollapseDetector(**cfg.collapse)
    start_epoch, step = 0, 0

    checkpoint = Checkpointer(out_dir / CHECKPOINT, world, trusted=cfg.trust_checkpoint,
                              model=model, optimizer=optimizer,
                              scheduler=scheduler, collapse=detector, scaler=scaler)
    state = checkpoint.resume()
    if state is not None:
        start_epoch, step, init = state["epoch"] + 1, state["step"], state["init"]

    if cfg.compile:  # the backbone: torchvision's heads branch on data; in place, keys unchanged
        model.backbone.compile(dynamic=True)
    net = data_parallel(model, device) if world.world > 1 else model
    meta = {**meta, "task": "detection", "exp": cfg.exp_name, "model": cfg.model.name,
            "data": cfg.data.name, "norm": cfg.norm.name, "norm_options": norm_options(cfg.norm),
            "seed": cfg.seed, "scale": cfg.scale.name, "epochs": epochs, "init": init,
            "backend": "torchvision", "world_size": world.world, "run_dir": str(out_dir)}
    logger = make_logger(cfg.logger, out_dir, OmegaConf.to_container(cfg, resolve=True),
                         name=f"{cfg.exp_name}-s{cfg.seed}", enabled=world.main)
    loader_args = {"num_workers": cfg.scale.num_workers, "pin_memory": device.type == "cuda",
                   "persistent_workers": cfg.scale.num_workers > 0, "collate_fn": collate}
    recorder = unnorm.record_statistics(model.backbone) if cfg.record_statistics else None
    metrics: dict = {}
    try:
        for epoch in range(start_epoch, epochs):
            net.train()
            if sampler is not None:
                sampler.set_epoch(epoch)
            loader = torch.utils.data.DataLoader(
                train_set, batch_size=batch, sampler=sampler, shuffle=sampler is None,
                generator=torch.Generator().manual_seed(cfg.seed * 1000 + epoch), drop_last=True,
                **loader_args)
            progress = tqdm(loader, total=steps_per_epoch, disable=None if world.main else True,
                            desc=f"epoch {epoch + 1}/{epochs}", leave=False)
            started, stats_chunks = time.time(), []
            loss_sums: dict[str, torch.Tensor] = {}
            for batch_index, (images, targets) in enumerate(progress):
                if batch_index >= steps_per_epoch:
                    break
                images = [image.to(device, non_blocking=True) for image in images]
                targets = [{k: v.to(device) if torch.is_tensor(v) else v for k, v in t.items()}
                           for t in targets]
                with amp():
                    losses = net(images, targets)
                loss = sum(losses.values())
                optimizer_step(loss, optimizer, scaler, recipe.clip_grad, model.parameters())
                step += 1
                scheduler.step_update(num_updates=step)
                for name, value in losses.items():
                    loss_sums[name] = loss_sums.get(name, 0) + value.detach().float()
                reduced_loss = world.mean(loss.detach())
                detector.update(step, reduced_loss)
                if recorder is not None and step % detector.check_every == 0:
                    stats_chunks.append(recorder.flush())
                if world.main and step % detector.check_every == 0:
                    progress.set_postfix(loss=f"{detector.last_loss:.3f}",
                                         lr=f"{optimizer.param_groups[0]['lr']:.2e}")
            detector.check()
            # one norm state for every replica: what is scored is what is saved
            unnorm.distribute_norm_state(model, cfg.norm_sync)
            metrics = {"epoch": epoch + 1, "step": step, "lr": optimizer.param_groups[0]["lr"],
                       "train_loss": sum(world.mean(v) for v in loss_sums.values()).item() / steps_per_epoch,
                       **{f"train_{k}": world.mean(v).item() / steps_per_epoch for k, v in loss_sums.items()},
                       "epoch_time_s": time.time() - started}
            if (epoch + 1) % recipe.eval_every == 0 or epoch + 1 == epochs:
                metrics.update(evaluate(model, val_set, batch, world, amp, iou_types))
            run.log(**metrics)
            logger.log(metrics, step=step)
            if recorder is not None:
                stats_chunks.append(recorder.flush())
                save_statistics(run, epoch, stats_chunks)
            if world.main:
                scores = " ".join(f"{k} {metrics[k]:.2f}" for k in ("bbox_AP", "segm_AP") if k in metrics)
                print(f"epoch {epoch + 1}/{epochs} step {step} loss {metrics['train_loss']:.4f} {scores}")
            checkpoint.save(epoch=epoch, step=step, init=init, config=OmegaConf.to_container(cfg))
        meta.update(steps=step, **rejected_steps(model.state_dict()))
        result = run.write_result(status="ok", metrics=metrics, meta=meta)
    except TrainingCollapsed as collapse:
        meta.update(rejected_steps(model.state_dict()))
        result = record_collapse(run, collapse, metrics, meta)
    finally:
        if recorder is not None:
            recorder.close()
        logger.finish()
    return result
