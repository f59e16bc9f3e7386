"""Language-model pretraining (a Llama-style decoder with any norm at any placement) on the
shared training loop: the run's optimizer (``optimizer``, AdamW by default: ``plugins.optim``),
linear warm-up and cosine decay per update, gradient accumulation to a fixed number of
sequences per update, validation loss over a fixed set of token windows. The task's parts (``TASK``) of the shared run skeleton,
``plugins.training.train``.

An "epoch" of the shared loop is ``recipe.eval_every`` updates: the run validates, logs and
checkpoints after each. Runs on one process or under ``torchrun`` (DDP, or sharded with
``distributed=fsdp``: ``plugins.fsdp``, one FSDP2 unit per decoder layer); a collapse ends the
run cleanly with ``status: FAIL`` in ``result.json``.
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import torch
from omegaconf import DictConfig, OmegaConf
from timm.scheduler import create_scheduler_v2

from plugins import fsdp
from plugins.distributed import Distributed
from plugins.loop import CHECKPOINT  # noqa: F401  (scripts/train.py's resume check)
from plugins.model_options import standardize_layers
from plugins.optim import create_optimizer
from plugins.runlog import chance_rule, run_meta
from plugins.scale import micro_batches_per_update
from plugins.training import Plan, Run, Steps, Task, epoch_plan
from plugins.training import train as train_task

from .data import PreparedCorpus, prepare_corpus, unigram_loss
from .attention import max_attention_logits
from .leak import future_leak, training_copy
from .model import build_lm


RANGES = {"model.context": ">= 1", "recipe.max_steps": ">= 1", "recipe.warmup_steps": ">= 0",
          "recipe.min_lr_ratio": "in [0, 1]", "recipe.batch_size": ">= 1",
          "recipe.micro_batch_size": ">= 1", "recipe.lr": "> 0", "recipe.weight_decay": ">= 0",
          "recipe.clip_grad": "null or > 0", "recipe.z_loss": ">= 0", "recipe.eval_every": ">= 1",
          "recipe.eval_tokens": ">= 1", "recipe.interval_eval_tokens": ">= 1",
          "recipe.probe_sequences": ">= 1"}
EVAL_BUDGETS = ("recipe.eval_tokens", "recipe.interval_eval_tokens")  # each >= one context


def check_eval_budgets(cfg: DictConfig) -> None:
    """Refuse, by name, an evaluation budget of less than one window (it would score nothing)."""
    for option in EVAL_BUDGETS:
        if OmegaConf.select(cfg, option) < cfg.model.context:
            raise ValueError(f"{option} must be at least one context (model.context="
                             f"{cfg.model.context} tokens), got {OmegaConf.select(cfg, option)}")


def train(cfg: DictConfig, out_dir: Path, overrides: Sequence[str] = ()) -> dict:
    """Train and validate one run; returns the ``result.json`` content."""
    return train_task(TASK, cfg, out_dir, overrides)


def next_token_loss(logits: torch.Tensor, targets: torch.Tensor, reduction: str = "mean"):
    """Cross-entropy of the logits (float32) against the next tokens."""
    return torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), targets.flatten(),
                                             reduction=reduction)


def z_loss(logits: torch.Tensor) -> torch.Tensor:
    """Mean squared log-partition of the logits (float32), ``log(Z)^2``: the auxiliary loss
    (PaLM; Wortsman et al. 2023, weight 1e-4) that keeps the output logits from drifting."""
    return torch.logsumexp(logits.float(), dim=-1).square().mean()


@torch.no_grad()
def validation_loss(model, windows, batch_size: int, world: Distributed, amp,
                    replicated: bool = False) -> dict:
    """Mean next-token loss (nats) over the validation windows, with the model in the mode it
    is in (eval: running statistics; a training-mode copy: batch statistics). Each replica
    scores its shard of the windows, unless ``replicated``: then every replica scores every
    window itself, in the same batches of ``batch_size`` in the same order (what a
    training-mode copy needs: its batch statistics, and a UN's or MABN's windows over the
    batches before, are then one process's, whatever the number of replicas)."""
    totals = torch.zeros(2, dtype=torch.float64, device=world.device)  # loss sum, tokens
    loader = torch.utils.data.DataLoader(windows if replicated else world.shard(windows),
                                         batch_size=batch_size)
    for (inputs, targets), counted in fsdp.lockstep(loader, model, world):
        inputs, targets = inputs.to(world.device), targets.to(world.device)
        with amp():
            logits = model(input_ids=inputs).logits
        if counted:  # a sharded model's extra forward (fsdp.lockstep) is not
            totals += torch.stack([next_token_loss(logits, targets, "sum").double(),
                                   torch.tensor(targets.numel(), dtype=torch.float64, device=world.device)])
    if not replicated:
        totals = world.sum(totals)
    val_loss = (totals[0] / totals[1]).item()
    return {"val_loss": val_loss, "val_ppl": math.exp(min(val_loss, 50.0)),
            "val_tokens": int(totals[1].item())}


@dataclass(kw_only=True)
class Windows(Plan):
    """The corpus's token windows: ``val_set`` the whole validation set (the last
    evaluation's), ``interval_set`` its part scored at every other."""
    corpus: PreparedCorpus
    interval_set: torch.utils.data.Dataset


def _data(cfg: DictConfig, world: Distributed) -> Windows:
    recipe = cfg.recipe
    check_eval_budgets(cfg)
    corpus = prepare_corpus(cfg.data)
    context = cfg.model.context
    train_set, val_set = corpus.windows("train", context), corpus.windows("validation", context)
    val_set = torch.utils.data.Subset(val_set, range(min(len(val_set), recipe.eval_tokens // context)))
    interval_set = torch.utils.data.Subset(val_set, range(min(len(val_set),
                                                              recipe.interval_eval_tokens // context)))
    accumulate = micro_batches_per_update(recipe, world.world)
    micro_batch, sampler, _ = epoch_plan(train_set, recipe.micro_batch_size * world.world, None,
                                         world, cfg.seed)
    if recipe.max_steps % recipe.eval_every:
        raise ValueError(f"recipe.max_steps {recipe.max_steps} is not a multiple of "
                         f"recipe.eval_every {recipe.eval_every}; make it one")
    updates_per_epoch = recipe.eval_every
    if len(train_set) // (micro_batch * world.world) < updates_per_epoch * accumulate:
        raise ValueError(f"{cfg.data.name}: {len(train_set)} training windows of {context} tokens "
                         f"give fewer micro-batches than recipe.eval_every x accumulation "
                         f"({updates_per_epoch} x {accumulate}); lower recipe.eval_every")
    return Windows(train_set=train_set, val_set=val_set, batch=micro_batch, sampler=sampler,
                   steps_per_epoch=updates_per_epoch, accumulate=accumulate,
                   norm_steps=recipe.max_steps * accumulate, record=corpus.record(),
                   corpus=corpus, interval_set=interval_set)


def _describe(run: Run) -> str:
    cfg, recipe, world = run.cfg, run.cfg.recipe, run.world
    params = sum(p.numel() for p in run.model.parameters())
    return (f"{cfg.exp_name}: {cfg.model.name} ({params / 1e6:.1f}M parameters, "
            f"{cfg.model.norm_position}-{cfg.norm.name}) on {run.data.corpus.name} (scale {cfg.scale.name}, "
            f"{recipe.batch_size} x {cfg.model.context} tokens per update in {run.data.accumulate} "
            f"micro-batch(es), {world.world} process(es), {world.device})")


def _shard(run: Run) -> None:  # one FSDP2 unit per decoder layer, each compiled with compile=true
    cfg = run.cfg
    fsdp.shard(run.model, run.model.model.layers, run.world, amp=cfg.amp, compile=cfg.compile,
               reshard_after_forward=cfg.distributed.reshard_after_forward)


def _optimizer(run: Run):
    cfg, recipe = run.cfg, run.cfg.recipe
    decay, no_decay = [], []
    for param in run.model.parameters():
        (decay if param.ndim > 1 else no_decay).append(param)
    return create_optimizer([{"params": decay, "weight_decay": recipe.weight_decay},
                             {"params": no_decay, "weight_decay": 0.0}],
                            cfg.optimizer, lr=recipe.lr * cfg.lr_multiple, weight_decay=recipe.weight_decay)


def _scheduler(run: Run):
    cfg, recipe, updates_per_epoch = run.cfg, run.cfg.recipe, run.data.steps_per_epoch
    epochs = recipe.max_steps // recipe.eval_every
    scheduler, _ = create_scheduler_v2(
        run.optimizer, sched="cosine", num_epochs=epochs, updates_per_epoch=updates_per_epoch,
        warmup_epochs=recipe.warmup_steps / updates_per_epoch, warmup_lr=0.0, warmup_prefix=True,
        min_lr=recipe.lr * cfg.lr_multiple * recipe.min_lr_ratio, step_on_epochs=False)
    return scheduler, epochs


def _steps(run: Run) -> Steps:
    cfg, world, recipe, device = run.cfg, run.world, run.cfg.recipe, run.world.device
    model, net, amp, sharded, epochs = run.model, run.net, run.amp, run.sharded, run.epochs
    data, context = run.data, cfg.model.context
    corpus, train_set, val_set, interval_set = data.corpus, data.train_set, data.val_set, data.interval_set
    micro_batch, updates_per_epoch, accumulate = data.batch, data.steps_per_epoch, data.accumulate
    tokens_per_update = recipe.batch_size * context
    clock = {"started": time.time(), "step": run.loop.step}

    def forward(batch):
        inputs, targets = (t.to(device, non_blocking=True) for t in batch)
        with amp():
            logits = net(input_ids=inputs).logits
        loss = next_token_loss(logits, targets)
        return loss + recipe.z_loss * z_loss(logits) if recipe.z_loss else loss

    def scores(epoch: int) -> dict:
        elapsed, updates = time.time() - clock["started"], (epoch + 1) * updates_per_epoch - clock["step"]
        last = epoch + 1 == epochs  # the whole validation set at the end, a part of it before
        model.eval()
        metrics = {**validation_loss(model, val_set if last else interval_set, micro_batch, world, amp),
                   "tokens": (epoch + 1) * updates_per_epoch * tokens_per_update,
                   "tokens_per_s": updates * tokens_per_update / max(elapsed, 1e-9)}
        with amp():  # Wortsman et al.'s instability: the largest attention logit, per layer
            per_layer = max_attention_logits(model, probe_inputs.to(device))
        metrics.update(max_attn_logit=max(per_layer), max_attn_logit_per_layer=per_layer)
        if last:  # as trained: PRepBN, say, pools over positions only once its hand-over starts
            probe = fsdp.unsharded_copy(model, lambda: _model(cfg, corpus.vocab_size)) \
                if sharded else model
            leak = future_leak(probe, probe_inputs)
            metrics.update(leaks_future=leak["leaks"], future_logit_change=leak["max_logit_change"])
            if leak["leaks"]:  # how much training mode's view of the future flatters it
                metrics["val_loss_train_mode"] = validation_loss(  # in batches of the probe set
                    training_copy(probe), val_set, probe_batch, world, amp,
                    replicated=True)["val_loss"]
        clock.update(started=time.time(), step=(epoch + 1) * updates_per_epoch)
        return metrics

    # the probes' inputs: the first recipe.probe_sequences validation windows, one batch on every
    # replica, whatever the micro-batch, the accumulation or the number of replicas
    probe_batch = min(len(val_set), recipe.probe_sequences)
    probe_inputs, _ = next(iter(torch.utils.data.DataLoader(val_set, batch_size=probe_batch)))
    return Steps(
        forward=forward, evaluate=scores,
        summary=lambda m: f"val_loss {m['val_loss']:.4f} ppl {m['val_ppl']:.1f} "
                          f"({m['tokens_per_s']:.0f} tokens/s)",
        meta=run_meta(cfg, "language_modelling", world.world, run.out_dir,
                      norm_position=cfg.model.norm_position, corpus=corpus.record(),
                      batch_size=recipe.batch_size, context=context,
                      accumulate=accumulate, chance=chance_rule(
                          "val_loss", unigram_loss(train_set, val_set, corpus.vocab_size)
                          - math.log(1.5), "validation perplexity >= the unigram model's "
                          "(training-token frequencies, no context) / 1.5",
                          lower_is_better=True)))


def _model(cfg: DictConfig, vocab_size: int):
    """The run's language model, with ``model.weight_standardization`` on its layers (``ws=nf``)."""
    model = build_lm(cfg.model, cfg.norm, vocab_size=vocab_size)
    standardize_layers(model, cfg.model, embedding=["model.embed_tokens"], head=["lm_head"])
    return model


TASK = Task(ranges=RANGES, data=_data, describe=_describe, head=lambda model: model.lm_head,
            model=lambda run: _model(run.cfg, run.data.corpus.vocab_size),
            activation_checkpointing=lambda model: model.activation_checkpointing_enable(
                {"use_reentrant": False}),
            shard=_shard, optimizer=_optimizer, scheduler=_scheduler, steps=_steps,
            probe=lambda model, batch: model(  # record_scale_invariance: the logits
                input_ids=batch[0].to(next(model.parameters()).device)).logits)
