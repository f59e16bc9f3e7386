"""Graph learning (the Graph Transformer or GIN with any norm) on the shared training loop:
the task's parts (``TASK``) of the run skeleton, ``plugins.training.train``.

The release's recipe: Adam (``optimizer=adamw`` at weight decay 0 is Adam), its learning rate
halved when the validation loss has not improved for ``recipe.patience`` epochs (torch's
``ReduceLROnPlateau``, stepped at each epoch's evaluation), the class-weighted cross-entropy
of Benchmarking GNNs on SBM nodes, L1 on molecules. Scores: class-balanced accuracy (%) on
validation and test nodes, or MAE on validation and test graphs. Runs on one process or
under ``torchrun`` (DDP); a collapse ends the run with ``status: FAIL``.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import torch
from omegaconf import DictConfig, OmegaConf
from torch_geometric.data import Batch

from plugins.distributed import Distributed
from plugins.loop import CHECKPOINT  # noqa: F401  (scripts/train.py's resume check)
from plugins.optim import create_optimizer
from plugins.runlog import chance_rule, run_meta
from plugins.training import Plan, Run, Steps, Task, epoch_plan
from plugins.training import train as train_task

from .data import GraphSplits, build_graphs
from .model import GraphNet

RANGES = {"recipe.lr": "> 0", "recipe.batch_size": ">= 1", "recipe.epochs": ">= 1",
          "recipe.warmup_epochs": ">= 0", "recipe.weight_decay": ">= 0",
          "recipe.lr_reduce_factor": "in (0, 1)", "recipe.patience": ">= 0",
          "recipe.min_lr": ">= 0", "recipe.clip_grad": "null or > 0", "model.layers": ">= 1",
          "model.hidden": ">= 1", "model.heads": ">= 1", "model.pe_dim": ">= 0",
          "model.dropout": "in [0, 1)"}


def train(cfg: DictConfig, out_dir: Path, overrides: Sequence[str] = ()) -> dict:
    """Train and evaluate one run; returns the ``result.json`` content."""
    return train_task(TASK, cfg, out_dir, overrides)


class PlateauSchedule:
    """torch's ``ReduceLROnPlateau`` as the loop's schedule: nothing per update
    (``step_update``), ``step(val_loss)`` after each evaluation. Not timm's plateau
    scheduler, whose checkpoint keeps only the best value and epoch: a resume would forget
    how many epochs had not improved, and not continue exactly."""

    def __init__(self, optimizer, factor: float, patience: int, min_lr: float):
        self.plateau = torch.optim.lr_scheduler.ReduceLROnPlateau(
            optimizer, mode="min", factor=factor, patience=patience, min_lr=min_lr)

    def step_update(self, num_updates: int) -> None:
        pass

    def step(self, val_loss: float) -> None:
        self.plateau.step(val_loss)

    def state_dict(self) -> dict:
        return self.plateau.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.plateau.load_state_dict(state)


def weighted_cross_entropy(logits: torch.Tensor, labels: torch.Tensor, classes: int) -> torch.Tensor:
    """Benchmarking GNNs' loss on SBM nodes: cross-entropy (float32) with each class weighted
    by the share of the batch's nodes outside it, ``(V - V_c) / V``, and 0 for a class the
    batch lacks."""
    counts = torch.bincount(labels, minlength=classes).float()
    weight = (labels.numel() - counts) / labels.numel() * (counts > 0)
    return torch.nn.functional.cross_entropy(logits.float(), labels, weight=weight)


@torch.no_grad()
def evaluate(model, graphs: list, splits: GraphSplits, batch_size: int, world: Distributed,
             amp) -> dict:
    """The loss (the training loss, averaged over batches as the release does) and the score
    of ``graphs``, each replica scoring its shard: class-balanced accuracy in % (the mean
    over classes of the share of each class's nodes predicted right: Benchmarking GNNs'
    ``accuracy_SBM``, there averaged per batch) or the mean absolute error."""
    model.eval()
    classes = splits.num_classes
    totals = torch.zeros(2 + 2 * max(classes, 1), dtype=torch.float64, device=world.device)
    loader = torch.utils.data.DataLoader(world.shard(graphs), batch_size=batch_size,
                                         collate_fn=Batch.from_data_list)
    for batch in loader:
        batch = batch.to(world.device)
        with amp():
            out = model(batch)
        loss, labels = task_loss(out, batch.y, splits), batch.y
        totals[0] += loss.double()
        totals[1] += 1
        if classes:
            predicted = out.float().argmax(-1)
            totals[2:2 + classes] += torch.bincount(labels, minlength=classes).double()
            totals[2 + classes:] += torch.bincount(labels[predicted == labels],
                                                   minlength=classes).double()
        else:
            totals[2] += (out.float() - labels).abs().sum().double()
            totals[3] += labels.numel()
    totals = world.sum(totals)
    metrics = {"loss": (totals[0] / totals[1]).item()}
    if classes:
        seen = totals[2:2 + classes]
        recall = totals[2 + classes:] / seen.clamp_min(1)
        metrics["acc"] = (100 * recall[seen > 0].mean()).item()
    else:
        metrics["mae"] = (totals[2] / totals[3]).item()
    return metrics


def task_loss(out: torch.Tensor, target: torch.Tensor, splits: GraphSplits) -> torch.Tensor:
    if splits.num_classes:
        return weighted_cross_entropy(out, target, splits.num_classes)
    return torch.nn.functional.l1_loss(out.float(), target)


@dataclass(kw_only=True)
class GraphPlan(Plan):
    """The splits, with what the model and the scores read of them."""
    splits: GraphSplits


def _data(cfg: DictConfig, world: Distributed) -> GraphPlan:
    recipe = cfg.recipe
    splits = build_graphs(OmegaConf.to_container(cfg.data, resolve=True), cfg.model.pe_dim)
    if cfg.data.num_train != len(splits.train):
        raise ValueError(f"data.num_train {cfg.data.num_train} (what scale=cpu scales the norms' "
                         f"step counts by) is not the {len(splits.train)} training graphs "
                         f"{cfg.data.name} made: set data.num_train={len(splits.train)}")
    batch, sampler, steps = epoch_plan(splits.train, recipe.batch_size,
                                       cfg.scale.max_steps_per_epoch, world, cfg.seed)
    return GraphPlan(train_set=splits.train, val_set=splits.val, batch=batch, sampler=sampler,
                     steps_per_epoch=steps, norm_steps=recipe.epochs * steps,
                     collate_fn=Batch.from_data_list, record=splits.record, splits=splits)


def _model(run: Run) -> GraphNet:
    splits = run.data.splits
    return GraphNet(run.cfg.model, run.cfg.norm, node_vocab=splits.node_vocab,
                    edge_vocab=splits.edge_vocab, out=splits.num_classes or 1,
                    graph_level=splits.task == "graph_regression")


def _describe(run: Run) -> str:
    cfg = run.cfg
    params = sum(p.numel() for p in run.model.parameters())
    return (f"{cfg.exp_name}: {cfg.model.name} ({params / 1e3:.0f}k parameters, "
            f"{cfg.model.layers} layers, {cfg.model.get('attention', 'message passing')}) with "
            f"{cfg.norm.name} on {cfg.data.name} {run.data.record['graphs']} graphs "
            f"(scale {cfg.scale.name}, {run.world.world} process(es), {run.world.device})")


def _optimizer(run: Run):
    cfg, recipe = run.cfg, run.cfg.recipe
    return create_optimizer(run.model.parameters(), cfg.optimizer, lr=recipe.lr * cfg.lr_multiple,
                            weight_decay=recipe.weight_decay)


def _scheduler(run: Run):
    recipe = run.cfg.recipe
    if recipe.warmup_epochs:
        raise ValueError("recipe.warmup_epochs: the release's schedule has no warm-up (the "
                         "rate only falls on plateaus); set recipe.warmup_epochs=0")
    return PlateauSchedule(run.optimizer, recipe.lr_reduce_factor, recipe.patience,
                           recipe.min_lr), recipe.epochs


def _steps(run: Run) -> Steps:
    cfg, world, device = run.cfg, run.world, run.world.device
    model, net, amp, splits = run.model, run.net, run.amp, run.data.splits
    batch_size = run.data.batch
    metric = "acc" if splits.num_classes else "mae"

    def forward(batch):
        batch = batch.to(device)
        with amp():
            out = net(batch)
        return task_loss(out, batch.y, splits)

    def scores(epoch: int) -> dict:
        val = evaluate(model, splits.val, splits, batch_size, world, amp)
        test = evaluate(model, splits.test, splits, batch_size, world, amp)
        run.scheduler.step(val["loss"])  # the release: the plateau of the validation loss
        return {"val_loss": val["loss"], metric: val[metric], f"test_{metric}": test[metric]}

    if splits.num_classes:
        chance = chance_rule("acc", 100 / splits.num_classes + 5,
                             "class-balanced accuracy <= 100/classes + 5 points")
    else:  # the training targets' median predicted for every graph
        targets = torch.cat([g.y for g in splits.train])
        median_mae = (torch.cat([g.y for g in splits.val]) - targets.median()).abs().mean().item()
        chance = chance_rule("mae", median_mae, "validation MAE >= that of predicting the "
                             "training targets' median for every molecule", lower_is_better=True)
    return Steps(
        forward=forward, evaluate=scores,
        summary=lambda m: f"val {metric} {m[metric]:.3f} test {m[f'test_{metric}']:.3f}",
        meta=run_meta(cfg, "graph", world.world, run.out_dir, graph_task=splits.task,
                      graphs=run.data.record, batch_size=cfg.recipe.batch_size, chance=chance))


TASK = Task(ranges=RANGES, data=_data, model=_model, describe=_describe,
            head=lambda model: model.readout, optimizer=_optimizer, scheduler=_scheduler,
            steps=_steps)
