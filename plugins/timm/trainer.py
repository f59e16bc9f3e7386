"""Image classification training with timm's optimizer, scheduler, augmentation, mixup and EMA.

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
from timm.data import Mixup
from timm.loss import LabelSmoothingCrossEntropy, SoftTargetCrossEntropy
from timm.optim import create_optimizer_v2
from timm.scheduler import create_scheduler_v2
from timm.utils import ModelEmaV3, accuracy
from torch import nn
from tqdm import tqdm

import unnorm
from plugins.logger import make_logger
from plugins.norms import norm_options
from plugins.runlog import CollapseDetector, TrainingCollapsed, record_collapse, rejected_steps
from plugins.training import (Checkpointer, Distributed, amp_context, begin_run, data_parallel,
                              epoch_plan, load_weights, optimizer_step, require_init, run_task,
                              save_statistics)

from .data import build_datasets
from .models import model_from_config

CHECKPOINT = "last.pt"


def _param_groups(model: nn.Module, weight_decay: float, backbone_lr_ratio: float) -> list[dict]:
    """Decay matrices only (not biases, norms, tokens); scale the backbone's lr if asked."""
    skip = set(getattr(model, "no_weight_decay", lambda: set())())
    head = {id(p) for p in model.get_classifier().parameters()}
    groups: dict[tuple[bool, bool], list] = {}
    for name, param in model.named_parameters():
        if not param.requires_grad:
            continue
        decay = param.ndim > 1 and name not in skip
        groups.setdefault((decay, id(param) in head), []).append(param)
    return [{"params": params, "weight_decay": weight_decay if decay else 0.0,
             "lr_scale": 1.0 if is_head else backbone_lr_ratio}
            for (decay, is_head), params in groups.items()]


def classifier_prefix(model: nn.Module) -> str:
    """The state-dict prefix of the model's classifier (``head.``, ``head.fc.``)."""
    head = model.get_classifier()
    return next(name for name, module in model.named_modules() if module is head) + "."


@torch.no_grad()
def evaluate(model: nn.Module, loader, world: Distributed, amp) -> dict:
    model.eval()
    totals = torch.zeros(3, device=world.device)  # correct@1, correct@5, count
    for images, targets in loader:
        images, targets = images.to(world.device), targets.to(world.device)
        with amp():
            logits = model(images)
        top1, top5 = accuracy(logits.float(), targets, topk=(1, min(5, logits.shape[1])))
        totals += torch.stack([top1 * len(targets) / 100, top5 * len(targets) / 100,
                               torch.tensor(float(len(targets)), device=world.device)])
    totals = world.sum(totals)
    return {"top1": (100 * totals[0] / totals[2]).item(), "top5": (100 * totals[1] / totals[2]).item()}


def train(cfg: DictConfig, out_dir: Path, overrides: Sequence[str] = ()) -> dict:
    """Train and evaluate one run; returns the ``result.json`` content.

    ``overrides`` (the command line's) are recorded so tables can tell sweeps from defaults.
    """
    return run_task(_train, cfg, out_dir, overrides)


def _train(cfg: DictConfig, out_dir: Path, world: Distributed, meta: dict) -> dict:
    recipe, device = cfg.recipe, world.device
    require_init(cfg)
    train_set, val_set = build_datasets(cfg.data, recipe.aug, cfg.model.img_size)
    batch, sampler, steps_per_epoch = epoch_plan(train_set, recipe.batch_size,
                                                 cfg.scale.max_steps_per_epoch, world, cfg.seed)
    cfg, run, finished = begin_run(cfg, out_dir, world, recipe.epochs * steps_per_epoch, CHECKPOINT)
    if finished is not None:
        return finished
    loader_args = {"num_workers": cfg.scale.num_workers, "pin_memory": device.type == "cuda",
                   "persistent_workers": cfg.scale.num_workers > 0}
    val_loader = torch.utils.data.DataLoader(world.shard(val_set), batch_size=batch, **loader_args)

    num_classes = cfg.data.num_classes
    model = model_from_config(cfg).to(device)
    init = "scratch"
    if cfg.init_from:
        init = load_weights(model, cfg.init_from, cfg.reset_norm_steps,
                            resizable=[classifier_prefix(model)], trusted=cfg.trust_checkpoint)
    if world.main:
        print(f"{cfg.exp_name}: {cfg.model.timm_name} with {cfg.norm.name} on {cfg.data.name} "
              f"(scale {cfg.scale.name}, init {init}, {world.world} process(es), {device})")
    ema = ModelEmaV3(model, decay=recipe.model_ema.decay) if recipe.model_ema.enabled else None

    lr = recipe.lr * recipe.batch_size / recipe.lr_batch * cfg.lr_multiple
    optimizer = create_optimizer_v2(
        _param_groups(model, recipe.weight_decay, recipe.backbone_lr_ratio), opt=recipe.opt,
        lr=lr, weight_decay=recipe.weight_decay, momentum=recipe.momentum)
    scheduler, epochs = create_scheduler_v2(
        optimizer, sched=recipe.sched, num_epochs=recipe.epochs, warmup_epochs=recipe.warmup_epochs,
        warmup_lr=recipe.warmup_lr, min_lr=recipe.min_lr, updates_per_epoch=steps_per_epoch)
    mixup = (Mixup(**OmegaConf.to_container(recipe.mixup), label_smoothing=recipe.label_smoothing, num_classes=num_classes)
             if recipe.mixup else None)
    if mixup:
        criterion = SoftTargetCrossEntropy()
    elif recipe.label_smoothing:
        criterion = LabelSmoothingCrossEntropy(recipe.label_smoothing)
    else:
        criterion = nn.CrossEntropyLoss()
    amp, scaler = amp_context(cfg.amp, device, model)
    detector = CollapseDetector(**cfg.collapse)
    start_epoch, step = 0, 0

    checkpoint = Checkpointer(out_dir / CHECKPOINT, world, trusted=cfg.trust_checkpoint,
                              model=model, optimizer=optimizer,
                              scheduler=scheduler, collapse=detector, scaler=scaler,
                              model_ema=ema.module if ema is not None else None)
    state = checkpoint.resume()
    if state is not None:
        start_epoch, step, init = state["epoch"] + 1, state["step"], state["init"]

    if cfg.compile:  # in place: state-dict keys stay as they are
        model.compile()
        if ema is not None:
            ema.module.compile()
    net = data_parallel(model, device) if world.world > 1 else model
    meta = {**meta, "task": "classification", "exp": cfg.exp_name, "model": cfg.model.name,
            "data": cfg.data.name, "norm": cfg.norm.name, "norm_options": norm_options(cfg.norm),
            "seed": cfg.seed, "scale": cfg.scale.name, "epochs": epochs, "init": init,
            "world_size": world.world, "run_dir": str(out_dir)}
    logger = make_logger(cfg.logger, out_dir, OmegaConf.to_container(cfg, resolve=True),
                         name=f"{cfg.exp_name}-s{cfg.seed}", enabled=world.main)
    recorder = unnorm.record_statistics(model) if cfg.record_statistics else None
    metrics: dict = {}
    try:
        for epoch in range(start_epoch, epochs):
            net.train()
            if sampler is not None:
                sampler.set_epoch(epoch)
            generator = torch.Generator().manual_seed(cfg.seed * 1000 + epoch)
            loader = torch.utils.data.DataLoader(
                train_set, batch_size=batch, sampler=sampler, shuffle=sampler is None,
                generator=generator, drop_last=True, **loader_args)
            progress = tqdm(loader, total=steps_per_epoch, disable=None if world.main else True,
                            desc=f"epoch {epoch + 1}/{epochs}", leave=False)
            started, stats_chunks = time.time(), []
            loss_sum = torch.zeros((), device=device)
            for batch_index, (images, targets) in enumerate(progress):
                if batch_index >= steps_per_epoch:
                    break
                images, targets = images.to(device, non_blocking=True), targets.to(device, non_blocking=True)
                if mixup is not None:
                    images, targets = mixup(images, targets)
                with amp():
                    loss = criterion(net(images), targets)
                optimizer_step(loss, optimizer, scaler, recipe.clip_grad, model.parameters())
                step += 1
                scheduler.step_update(num_updates=step)
                if ema is not None:
                    ema.update(model, step=step)
                reduced_loss = world.mean(loss.detach())
                loss_sum += reduced_loss
                detector.update(step, reduced_loss)
                if recorder is not None and step % detector.check_every == 0:
                    stats_chunks.append(recorder.flush())
                if world.main and step % detector.check_every == 0:
                    progress.set_postfix(loss=f"{detector.last_loss:.3f}",
                                         lr=f"{optimizer.param_groups[0]['lr']:.2e}")
            detector.check()
            scheduler.step(epoch + 1)
            for replicated in (model, ema.module if ema is not None else None):
                if replicated is not None:  # one norm state: what is scored is what is saved
                    unnorm.distribute_norm_state(replicated, cfg.norm_sync)
            metrics = evaluate(model, val_loader, world, amp)
            if ema is not None:
                metrics.update({f"{k}_ema": v for k, v in evaluate(ema.module, val_loader, world, amp).items()})
            metrics.update(epoch=epoch + 1, step=step, train_loss=(loss_sum / steps_per_epoch).item(),
                           lr=optimizer.param_groups[0]["lr"], epoch_time_s=time.time() - started)
            run.log(**metrics)
            logger.log(metrics, step=step)
            if recorder is not None:
                stats_chunks.append(recorder.flush())
                save_statistics(run, epoch, stats_chunks)
            if world.main:
                print(f"epoch {epoch + 1}/{epochs} step {step} loss {metrics['train_loss']:.4f} "
                      f"top1 {metrics['top1']:.2f}" + (f" (ema {metrics['top1_ema']:.2f})" if ema else ""))
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
