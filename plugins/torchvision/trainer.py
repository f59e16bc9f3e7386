"""Detection training (torchvision Faster / Mask R-CNN, Swin backbone with any norm) and COCO
evaluation. The schedule follows mmdetection's Swin configs: AdamW (``optimizer``), linear warm-up over
iterations, step decay at given epochs, multi-scale training. The task's parts (``TASK``) of
the shared run skeleton, ``plugins.training.train``.

Runs on one process or under ``torchrun`` (DDP; the replicas' norm state is made one before
every evaluation and checkpoint, ``norm_sync``). Checkpoints every epoch to ``last.pt`` and
resumes from it; a collapse ends the run cleanly with ``status: FAIL`` in ``result.json``.
"""
from __future__ import annotations

from pathlib import Path
from typing import Sequence

import torch
from omegaconf import DictConfig
from timm.optim import param_groups_weight_decay
from timm.scheduler import create_scheduler_v2
from torch import nn

from plugins.distributed import Distributed
from plugins.loop import CHECKPOINT  # noqa: F401  (scripts/train.py's resume check)
from plugins.optim import create_optimizer
from plugins.runlog import DETECTION_CHANCE, DETECTION_PROBE_EXAMPLES, run_meta
from plugins.training import Plan, Run, Steps, Task, epoch_plan, load_weights
from plugins.training import train as train_task

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
    """COCO AP of ``model`` on ``dataset``, predicted in batches of ``batch_size`` consecutive
    images, each replica predicting whole batches (every ``world``-th): a batch is padded to
    its largest image, so its composition changes what the model sees, and a fixed batching
    keeps the predictions independent of the number of replicas."""
    model.eval()
    batches = list(torch.utils.data.BatchSampler(range(len(dataset)), batch_size, drop_last=False))
    loader = torch.utils.data.DataLoader(dataset, batch_sampler=batches[world.rank::world.world],
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
    return train_task(TASK, cfg, out_dir, overrides)


def _data(cfg: DictConfig, world: Distributed) -> Plan:
    recipe = cfg.recipe
    train_set, val_set = build_datasets(cfg.data, cfg.model.masks)
    batch, sampler, steps_per_epoch = epoch_plan(train_set, recipe.batch_size,
                                                 cfg.scale.max_steps_per_epoch, world, cfg.seed)
    return Plan(train_set=train_set, val_set=val_set, batch=batch, sampler=sampler,
                steps_per_epoch=steps_per_epoch, norm_steps=recipe.epochs * steps_per_epoch,
                collate_fn=collate)


def _init(run: Run) -> str:  # an ImageNet classification run of ours, into the backbone
    cfg = run.cfg
    return load_weights(run.model.backbone.body, cfg.init_from, cfg.reset_norm_steps,
                        ignore=CLASSIFIER_ONLY, trusted=cfg.trust_checkpoint)


def _describe(run: Run) -> str:
    cfg = run.cfg
    return (f"{cfg.exp_name}: {cfg.model.name} with {cfg.norm.name} on {cfg.data.name} "
            f"(scale {cfg.scale.name}, init {run.init}, {run.world.world} process(es), {run.world.device})")


def _optimizer(run: Run):
    cfg, recipe, model = run.cfg, run.cfg.recipe, run.model
    skip = {f"backbone.body.{name}" for name in model.backbone.body.no_weight_decay()}
    skip |= {name for name, _ in model.named_parameters() if "relative_position_bias_table" in name}
    peak_lr = recipe.lr * recipe.batch_size / recipe.lr_batch * cfg.lr_multiple
    return create_optimizer(
        param_groups_weight_decay(model, recipe.weight_decay, no_weight_decay_list=skip),
        cfg.optimizer, lr=peak_lr, weight_decay=recipe.weight_decay)


def _scheduler(run: Run):
    cfg, recipe, steps_per_epoch = run.cfg, run.cfg.recipe, run.data.steps_per_epoch
    peak_lr = recipe.lr * recipe.batch_size / recipe.lr_batch * cfg.lr_multiple
    return create_scheduler_v2(
        run.optimizer, sched="multistep", num_epochs=recipe.epochs,
        decay_milestones=list(recipe.decay_epochs), decay_rate=recipe.decay_rate,
        warmup_epochs=recipe.warmup_iters / steps_per_epoch,
        warmup_lr=peak_lr * recipe.warmup_ratio, step_on_epochs=False,
        updates_per_epoch=steps_per_epoch)


def _probe(model: nn.Module, batch) -> dict[str, torch.Tensor]:
    """``record_scale_invariance``: the training losses of the float64 copy on ``batch``, what
    the update reads, so every trained weight is tested, the heads' included (a standardised
    head layer is row-invariant), where the backbone's features would leave the heads inert.
    Training mode is deterministic here: its draws (the multi-scale size, drop path, the
    RPN's and RoI heads' sampling) come from torch's RNG, which ``unnorm.scale_invariance``
    reseeds before every forward, and the proposals kept and matched are chosen by comparisons
    that a scale-invariant weight's change, at float64 rounding, does not flip."""
    device = next(model.parameters()).device

    def moved(value):  # float64 boxes, as the images
        if not torch.is_tensor(value):
            return value
        return value.to(device, torch.float64) if value.is_floating_point() else value.to(device)
    images, targets = batch
    return model([moved(image) for image in images],
                 [{key: moved(value) for key, value in target.items()} for target in targets])


def _compile(run: Run) -> None:
    run.model.backbone.compile(dynamic=True)  # torchvision's heads branch on data; in place, keys unchanged


def _steps(run: Run) -> Steps:
    cfg, world, device, recipe = run.cfg, run.world, run.world.device, run.cfg.recipe
    model, net, amp, epochs = run.model, run.net, run.amp, run.epochs
    iou_types = ("bbox", "segm") if cfg.model.masks else ("bbox",)

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
        # in batches of the global batch (one process: the records' batches), not a replica's
        return evaluate(model, run.data.val_set, recipe.batch_size, world, amp, iou_types)

    return Steps(
        forward=forward, evaluate=scores,
        summary=lambda m: " ".join(f"{k} {m[k]:.2f}" for k in ("bbox_AP", "segm_AP") if k in m),
        meta=run_meta(cfg, "detection", world.world, run.out_dir, backend="torchvision",
                      chance=DETECTION_CHANCE))


TASK = Task(ranges=RANGES, data=_data, init=_init, describe=_describe, optimizer=_optimizer,
            model=lambda run: build_detector(run.cfg.model, run.cfg.norm, run.data.train_set.num_classes),
            head=lambda model: model.roi_heads, scheduler=_scheduler, compile=_compile,
            tapped=lambda model: model.backbone, steps=_steps, probe=_probe,
            probe_examples=DETECTION_PROBE_EXAMPLES)
