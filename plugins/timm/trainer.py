"""Image classification training with timm's optimizer, scheduler, augmentation, mixup and EMA:
the task's parts (``TASK``) of the shared run skeleton, ``plugins.training.train``.

Runs on one process or under ``torchrun`` (DDP; the replicas' norm state is made one before
every evaluation and checkpoint, ``norm_sync``). Checkpoints every epoch to ``last.pt`` and
resumes from it; a collapse ends the run cleanly with ``status: FAIL`` in ``result.json``.
"""
from __future__ import annotations

from pathlib import Path
from typing import Sequence

import torch
from omegaconf import DictConfig, OmegaConf
from timm.data import Mixup
from timm.loss import LabelSmoothingCrossEntropy, SoftTargetCrossEntropy
from timm.scheduler import create_scheduler_v2
from timm.utils import ModelEmaV3, accuracy
from torch import nn

from plugins.distributed import Distributed
from plugins.loop import CHECKPOINT  # noqa: F401  (scripts/train.py's resume check)
from plugins.optim import create_optimizer
from plugins.runlog import chance_rule, run_meta
from plugins.scale import micro_batches_per_update
from plugins.training import Plan, Run, Steps, Task, epoch_plan, load_weights
from plugins.training import train as train_task

from .data import build_datasets
from .models import classifier_prefix, model_from_config


RANGES = {"recipe.lr": "> 0", "recipe.lr_batch": "> 0", "recipe.batch_size": ">= 1",
          "recipe.micro_batch_size": "null or >= 1",
          "recipe.epochs": ">= 1", "recipe.warmup_epochs": ">= 0", "recipe.warmup_lr": ">= 0",
          "recipe.min_lr": ">= 0", "recipe.weight_decay": ">= 0", "recipe.clip_grad": "null or > 0",
          "recipe.label_smoothing": "in [0, 1)", "recipe.backbone_lr_ratio": ">= 0",
          "recipe.model_ema.decay": "in [0, 1]"}


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
    return train_task(TASK, cfg, out_dir, overrides)


def _data(cfg: DictConfig, world: Distributed) -> Plan:
    recipe = cfg.recipe
    train_set, val_set = build_datasets(cfg.data, recipe.aug, cfg.model.img_size)
    batch, sampler, steps_per_epoch = epoch_plan(train_set, recipe.batch_size,
                                                 cfg.scale.max_steps_per_epoch, world, cfg.seed)
    # micro-batch training: each replica's norms see recipe.micro_batch_size images per
    # forward/backward, and the update accumulates the recipe's batch
    accumulate = micro_batches_per_update(recipe, world.world) if recipe.micro_batch_size else 1
    return Plan(train_set=train_set, val_set=val_set, batch=batch // accumulate, sampler=sampler,
                steps_per_epoch=steps_per_epoch, accumulate=accumulate,
                norm_steps=recipe.epochs * steps_per_epoch * accumulate)


def _init(run: Run) -> str:
    cfg = run.cfg
    return load_weights(run.model, cfg.init_from, cfg.reset_norm_steps,
                        resizable=[classifier_prefix(run.model)], trusted=cfg.trust_checkpoint)


def _describe(run: Run) -> str:
    cfg = run.cfg
    return (f"{cfg.exp_name}: {cfg.model.timm_name} with {cfg.norm.name} on {cfg.data.name} "
            f"(scale {cfg.scale.name}, init {run.init}, {run.world.world} process(es), {run.world.device})")


def _ema(run: Run):
    recipe = run.cfg.recipe
    return ModelEmaV3(run.model, decay=recipe.model_ema.decay) if recipe.model_ema.enabled else None


def _optimizer(run: Run):
    cfg, recipe = run.cfg, run.cfg.recipe
    lr = recipe.lr * recipe.batch_size / recipe.lr_batch * cfg.lr_multiple
    return create_optimizer(_param_groups(run.model, recipe.weight_decay, recipe.backbone_lr_ratio),
                            cfg.optimizer, lr=lr, weight_decay=recipe.weight_decay)


def _scheduler(run: Run):
    # per optimizer update, as Swin's release: stepped per epoch, a one-epoch warm-up (CPU
    # scale) would be one jump from warmup_lr to the peak
    recipe = run.cfg.recipe
    return create_scheduler_v2(
        run.optimizer, sched=recipe.sched, num_epochs=recipe.epochs, warmup_epochs=recipe.warmup_epochs,
        warmup_lr=recipe.warmup_lr, min_lr=recipe.min_lr, updates_per_epoch=run.data.steps_per_epoch,
        step_on_epochs=False)


def _steps(run: Run) -> Steps:
    cfg, world, recipe, device = run.cfg, run.world, run.cfg.recipe, run.world.device
    model, net, ema, amp = run.model, run.net, run.ema, run.amp
    num_classes, batch = cfg.data.num_classes, run.data.batch * run.data.accumulate
    val_loader = torch.utils.data.DataLoader(
        world.shard(run.data.val_set), batch_size=batch, num_workers=cfg.scale.num_workers,
        pin_memory=device.type == "cuda", persistent_workers=cfg.scale.num_workers > 0)
    mixup = (Mixup(**OmegaConf.to_container(recipe.mixup), label_smoothing=recipe.label_smoothing, num_classes=num_classes)
             if recipe.mixup else None)
    if mixup:
        criterion = SoftTargetCrossEntropy()
    elif recipe.label_smoothing:
        criterion = LabelSmoothingCrossEntropy(recipe.label_smoothing)
    else:
        criterion = nn.CrossEntropyLoss()

    def forward(batch):
        images, targets = (t.to(device, non_blocking=True) for t in batch)
        if mixup is not None:
            images, targets = mixup(images, targets)
        with amp():
            return criterion(net(images), targets)

    def scores(epoch: int) -> dict:
        metrics = evaluate(model, val_loader, world, amp)
        if ema is not None:
            metrics.update({f"{k}_ema": v for k, v in evaluate(ema.module, val_loader, world, amp).items()})
        return metrics

    return Steps(
        forward=forward, evaluate=scores,
        summary=lambda m: f"top1 {m['top1']:.2f}" + (f" (ema {m['top1_ema']:.2f})" if ema else ""),
        meta=run_meta(cfg, "classification", world.world, run.out_dir, accumulate=run.data.accumulate,
                      micro_batch_size=run.data.batch, chance=chance_rule(
                          "top1", 1.5 * 100 / num_classes, "top-1 <= 1.5 x 100/classes")))


def _probe(model: nn.Module, batch) -> torch.Tensor:  # record_scale_invariance: the logits
    return model(batch[0].to(next(model.parameters()).device, torch.float64))


TASK = Task(ranges=RANGES, data=_data, model=lambda run: model_from_config(run.cfg), init=_init,
            describe=_describe, head=lambda model: model.get_classifier(), ema=_ema,
            optimizer=_optimizer, scheduler=_scheduler, steps=_steps, probe=_probe)
