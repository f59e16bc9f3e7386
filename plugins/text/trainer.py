"""Text classification (sentiment): the Transformer encoder of ``plugins.text.model`` with any
norm at Post or Pre placement, on the Rotten Tomatoes snippets (``plugins.text.data``), on the
shared training loop: the run's optimizer (``optimizer``: AdamW by default; the study's grid
plain SGD), warm-up then cosine decay or a constant rate per update, accuracy and loss on the
validation and test splits. The task's parts (``TASK``) of ``plugins.training.train``.

An "epoch" of the shared loop is ``recipe.eval_every`` updates: the run evaluates, logs and
checkpoints after each. Before the first update it records, on a copy of the model and the
first ``recipe.probe_examples`` training snippets, the loss and each layer's gradient norm at
initialisation (``initial_gradients`` in ``result.json``; the study's initial gradient
magnitudes). A collapse ends the run with ``status: FAIL``.
"""
from __future__ import annotations

import copy
import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import torch
from omegaconf import DictConfig
from timm.scheduler import create_scheduler_v2
from torch import nn

from plugins.distributed import Distributed
from plugins.loop import CHECKPOINT  # noqa: F401  (scripts/train.py's resume check)
from plugins.optim import create_optimizer
from plugins.runlog import chance_rule, run_meta
from plugins.training import Plan, Run, Steps, Task, epoch_plan, rngs_kept
from plugins.training import train as train_task

from .data import PadCollate, SentimentData, prepare
from .model import SentimentEncoder

RANGES = {"model.width": ">= 1", "model.depth": ">= 1", "model.heads": ">= 1",
          "model.ffn": ">= 1", "model.max_length": "> 1", "model.dropout": "in [0, 1)",
          "recipe.max_steps": ">= 1", "recipe.warmup_steps": ">= 0", "recipe.batch_size": ">= 1",
          "recipe.lr": "> 0", "recipe.min_lr_ratio": "in [0, 1]", "recipe.weight_decay": ">= 0",
          "recipe.clip_grad": "null or > 0", "recipe.eval_every": ">= 1",
          "recipe.probe_examples": ">= 1"}
SCHEDULES = ("cosine", "constant")
INITIAL_GRADIENTS = "initial_gradients.json"  # in the run folder: what a resume reports


def train(cfg: DictConfig, out_dir: Path, overrides: Sequence[str] = ()) -> dict:
    """Train and evaluate one run; returns the ``result.json`` content."""
    return train_task(TASK, cfg, out_dir, overrides)


@dataclass(kw_only=True)
class Snippets(Plan):
    """The plan with the prepared data (its test split, pad id and vocabulary)."""
    prepared: SentimentData


def _data(cfg: DictConfig, world: Distributed) -> Snippets:
    recipe = cfg.recipe
    if recipe.sched not in SCHEDULES:
        raise ValueError(f"recipe.sched must be one of {SCHEDULES}, got {recipe.sched!r}")
    if recipe.max_steps % recipe.eval_every:
        raise ValueError(f"recipe.max_steps {recipe.max_steps} is not a multiple of "
                         f"recipe.eval_every {recipe.eval_every}; make it one")
    prepared = prepare(cfg.data, cfg.model.max_length)
    train_set = prepared.splits["train"]
    batch, sampler, per_pass = epoch_plan(train_set, recipe.batch_size, None, world, cfg.seed)
    if recipe.eval_every > per_pass:
        raise ValueError(f"recipe.eval_every {recipe.eval_every} exceeds the {per_pass} batches "
                         f"of {recipe.batch_size} in the training split; lower it")
    return Snippets(train_set=train_set, val_set=prepared.splits["validation"], batch=batch,
                    sampler=sampler, steps_per_epoch=recipe.eval_every,
                    norm_steps=recipe.max_steps, collate_fn=PadCollate(prepared.pad_id),
                    record=prepared.record(), prepared=prepared)


def _model(run: Run) -> nn.Module:
    prepared = run.data.prepared
    return SentimentEncoder(run.cfg.model, run.cfg.norm, prepared.vocab_size, prepared.pad_id)


def _describe(run: Run) -> str:
    cfg, cfg_model = run.cfg, run.cfg.model
    params = sum(p.numel() for p in run.model.parameters())
    return (f"{cfg.exp_name}: {cfg_model.name} ({params / 1e6:.2f}M parameters, depth "
            f"{cfg_model.depth}, width {cfg_model.width}, {cfg_model.norm_position}-{cfg.norm.name}, "
            f"init {cfg_model.init}) on {cfg.data.name} (scale {cfg.scale.name}, "
            f"{cfg.optimizer.name} lr {cfg.recipe.lr * cfg.lr_multiple:g}, {run.world.device})")


def _optimizer(run: Run):
    cfg, recipe = run.cfg, run.cfg.recipe
    decay, no_decay = [], []
    for param in run.model.parameters():
        if param.requires_grad:
            (decay if param.ndim > 1 else no_decay).append(param)
    return create_optimizer([{"params": decay, "weight_decay": recipe.weight_decay},
                             {"params": no_decay, "weight_decay": 0.0}],
                            cfg.optimizer, lr=recipe.lr * cfg.lr_multiple,
                            weight_decay=recipe.weight_decay)


def _scheduler(run: Run):
    cfg, recipe, per_epoch = run.cfg, run.cfg.recipe, run.data.steps_per_epoch
    epochs = recipe.max_steps // recipe.eval_every
    lr = recipe.lr * cfg.lr_multiple
    scheduler, _ = create_scheduler_v2(
        run.optimizer, sched="cosine" if recipe.sched == "cosine" else "step",
        decay_rate=1.0, num_epochs=epochs, updates_per_epoch=per_epoch,
        warmup_epochs=recipe.warmup_steps / per_epoch, warmup_lr=0.0,
        warmup_prefix=True, min_lr=lr * recipe.min_lr_ratio, step_on_epochs=False)
    return scheduler, epochs


@torch.no_grad()
def evaluate(model: nn.Module, dataset, batch_size: int, collate, world: Distributed) -> dict:
    """Accuracy (%) and mean cross-entropy over ``dataset``, in the model's current mode."""
    totals = torch.zeros(3, dtype=torch.float64, device=world.device)  # correct, loss, count
    loader = torch.utils.data.DataLoader(world.shard(dataset), batch_size=batch_size,
                                         collate_fn=collate)
    for ids, labels in loader:
        ids, labels = ids.to(world.device), labels.to(world.device)
        logits = model(ids).float()
        totals += torch.stack([logits.argmax(-1).eq(labels).sum().double(),
                               nn.functional.cross_entropy(logits, labels, reduction="sum").double(),
                               torch.tensor(float(len(labels)), dtype=torch.float64,
                                            device=world.device)])
    totals = world.sum(totals)
    return {"acc": (100 * totals[0] / totals[2]).item(), "loss": (totals[1] / totals[2]).item()}


def initial_gradients(model: nn.Module, batch, device: torch.device) -> dict:
    """The loss and each layer group's gradient norm (``model.layer_groups()``) on ``batch``,
    in training mode, on a copy: the model's weights, running statistics and RNGs stay."""
    probe = copy.deepcopy(model).train()
    with rngs_kept(device):
        ids, labels = (t.to(device) for t in batch)
        loss = nn.functional.cross_entropy(probe(ids).float(), labels)
        loss.backward()
    norms = {}
    for name, group in probe.layer_groups().items():
        grads = [p.grad.double().square().sum() for p in group.parameters() if p.grad is not None]
        norms[name] = math.sqrt(sum(grads).item()) if grads else 0.0
    return {"loss": loss.item(), "grad_norm": norms, "examples": len(labels)}


def recorded_initial_gradients(run: Run) -> dict:
    """``initial_gradients`` of the run: measured at its start and kept in the run folder,
    which a resume reads (its weights are no longer the start's)."""
    path = run.out_dir / INITIAL_GRADIENTS
    if path.exists():
        return json.loads(path.read_text())
    if run.loop.step:  # a resume of a run begun before this record existed
        return {}
    data = run.data
    count = min(len(data.train_set), run.cfg.recipe.probe_examples)
    batch = data.collate_fn([data.train_set[i] for i in range(count)])
    record = initial_gradients(run.model, batch, run.world.device)
    if run.world.main:
        path.write_text(json.dumps(record, indent=1) + "\n")
    return record


def _steps(run: Run) -> Steps:
    cfg, world, recipe, data = run.cfg, run.world, run.cfg.recipe, run.data
    model, net, amp, prepared = run.model, run.net, run.amp, run.data.prepared
    test_set = prepared.splits["test"]

    def forward(batch):
        ids, labels = (t.to(world.device, non_blocking=True) for t in batch)
        with amp():
            logits = net(ids)
        return nn.functional.cross_entropy(logits.float(), labels)

    def scores(epoch: int) -> dict:
        model.eval()
        with amp():
            val = evaluate(model, data.val_set, data.batch, data.collate_fn, world)
            test = evaluate(model, test_set, data.batch, data.collate_fn, world)
        return {"val_acc": val["acc"], "val_loss": val["loss"], "test_acc": test["acc"],
                "test_loss": test["loss"]}

    majority = 100 * prepared.majority("validation")
    return Steps(
        forward=forward, evaluate=scores,
        summary=lambda m: f"val_acc {m['val_acc']:.2f} val_loss {m['val_loss']:.4f} "
                          f"test_acc {m['test_acc']:.2f}",
        meta=run_meta(cfg, "text_classification", world.world, run.out_dir,
                      norm_position=cfg.model.norm_position, depth=cfg.model.depth,
                      width=cfg.model.width, init=cfg.model.init,
                      init_range=cfg.model.get("init_range"), lr=recipe.lr * cfg.lr_multiple,
                      optimizer=cfg.optimizer.name, batch_size=recipe.batch_size,
                      corpus=prepared.record(), initial_gradients=recorded_initial_gradients(run),
                      chance=chance_rule("val_acc", majority + 1.0,
                                         "validation accuracy <= the majority class's share "
                                         "of the validation split (predicting one class) + 1 point")))


def _probe(model: nn.Module, batch) -> torch.Tensor:  # record_scale_invariance: the logits
    return model(batch[0].to(next(model.parameters()).device))


TASK = Task(ranges=RANGES, data=_data, model=_model, describe=_describe,
            head=lambda model: model.classifier, optimizer=_optimizer, scheduler=_scheduler,
            steps=_steps, probe=_probe)
