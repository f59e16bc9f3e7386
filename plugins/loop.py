"""The training loop every trainer of ours shares (classification, torchvision detection,
language modelling): epochs of optimizer updates (with gradient accumulation), the collapse
watch, the replicas' norm state made one before each evaluation and save, metrics, statistics
taps, checkpoints and resume, the result.

A trainer builds its data, model, optimizer and schedule, then hands the loop what differs
between tasks: how a batch becomes a loss (``forward``), what happens after an update (an
EMA), how the model is scored (``evaluate``) and what the progress line adds (``summary``).
fairseq and mmdetection train in their own loops and share the records
(``plugins.runlog``).
"""
from __future__ import annotations

import time
from contextlib import nullcontext
from itertools import islice
from pathlib import Path
from typing import Callable, Iterable, Mapping, Optional, Sequence, Union

import torch
from omegaconf import DictConfig, OmegaConf
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from tqdm import tqdm

import unnorm
from plugins.runlog import (CollapseDetector, RunDirectory, TrainingCollapsed, config_differences,
                            metrics_row, record_collapse, rejected_steps, run_logger)
from plugins.sam import SharpnessAware, configured, trained_parameters
from plugins.training import (Checkpointer, Distributed, backward, optimizer_step, save_gns,
                              save_statistics)

CHECKPOINT = "last.pt"

Losses = Union[torch.Tensor, Mapping[str, torch.Tensor]]


class EpochLoop:
    """One run's training loop. ``parts`` are further stateful parts to checkpoint by name
    (an EMA model); ``replicas`` are the modules whose norm state is made one across the
    replicas (``norm_sync``) before every evaluation and save (default: ``model``);
    ``stats_module`` is what ``record_statistics=true`` and ``record_gns=true`` tap (default:
    ``model``).
    ``scheduler`` is a timm scheduler stepped per optimizer update (``step_on_epochs=False``):
    warm-ups at CPU scale last about an epoch, which a per-epoch schedule would make one jump.
    ``data`` is what the run records about its data (names, hashes): kept in every
    checkpoint, and a resume onto other data is refused. ``checkpointer``: how checkpoints
    are written and resumed (``plugins.fsdp.ShardedCheckpointer`` for a sharded model)."""

    def __init__(self, cfg: DictConfig, out_dir: Path, world: Distributed, run: RunDirectory,
                 model: nn.Module, optimizer, scheduler, scaler, *,
                 replicas: Sequence[nn.Module] = (), stats_module: Optional[nn.Module] = None,
                 data: Optional[dict] = None, checkpointer: type = Checkpointer, **parts):
        if getattr(scheduler, "t_in_epochs", False):
            raise ValueError("the training loop steps the learning rate per optimizer update; "
                             "build the scheduler with create_scheduler_v2(..., step_on_epochs=False)")
        self.cfg, self.out_dir, self.world, self.run = cfg, Path(out_dir), world, run
        self.model, self.optimizer, self.scheduler, self.scaler = model, optimizer, scheduler, scaler
        self.replicas = list(replicas) or [model]
        self.stats_module = stats_module if stats_module is not None else model
        self.data = data
        self.detector = CollapseDetector(**cfg.collapse)
        self.checkpoint = checkpointer(self.out_dir / CHECKPOINT, world, trusted=cfg.trust_checkpoint,
                                       model=model, optimizer=optimizer, scheduler=scheduler,
                                       collapse=self.detector, scaler=scaler, **parts)
        self.start_epoch, self.step, self.metrics = 0, 0, {}
        self.sam = sharpness_aware(cfg, model, world)

    def resume(self, init: str) -> str:
        """Load ``last.pt`` if the run has one, and make the run's records the ones it covers
        (``RunDirectory.restore_epochs``); returns the run's ``init`` description."""
        state = self.checkpoint.resume()
        if state is None:
            return init
        differing = config_differences(state.get("data"), self.data)
        if state.get("data") is not None and differing:
            raise ValueError(f"refusing to resume {self.out_dir}: its data differs from what the "
                             f"run trained on: {', '.join(differing)}. Resume with the run's own "
                             "data (rebuild it as it was), or start a new run without resume=")
        self.start_epoch, self.step = state["epoch"] + 1, state["step"]
        self.metrics = state.get("metrics", {})  # the result's, should no epoch be left
        self.run.restore_epochs(self.start_epoch, state.get("row"))
        return state["init"]

    def fit(self, net: nn.Module, train_set, batch_size: int, sampler, steps_per_epoch: int,
            epochs: int, *, forward: Callable[[object], Losses],
            evaluate: Callable[[int], dict], meta: dict, init: str,
            after_update: Optional[Callable[[int], None]] = None,
            summary: Callable[[dict], str] = lambda metrics: "",
            collate_fn=None, clip_grad: Optional[float] = None, accumulate: int = 1) -> dict:
        """Train epochs ``start_epoch..epochs`` of ``steps_per_epoch`` optimizer updates and
        write the result; returns it.

        ``forward(batch)`` returns the loss, or a dict of losses that add up to it (each
        recorded as ``train_<name>``); ``evaluate(epoch)`` the epoch's scores (may be empty);
        ``after_update(step)`` runs after each optimizer update. Each update accumulates the
        gradients of ``accumulate`` micro-batches (the norms count micro-batches).
        """
        cfg, world, device = self.cfg, self.world, self.world.device
        if self.sam is not None and accumulate > 1:
            raise ValueError(f"sam with gradient accumulation ({accumulate} micro-batches per "
                             "update) is not defined here: SAM's ascent needs the whole update's "
                             "gradient before its second pass. Use one micro-batch per update "
                             "(a smaller batch, or more memory), or sam=none")
        loader_args = {"num_workers": cfg.scale.num_workers, "pin_memory": device.type == "cuda",
                       "persistent_workers": cfg.scale.num_workers > 0, "collate_fn": collate_fn}
        logger = run_logger(cfg, self.out_dir, enabled=world.main)
        detector, step = self.detector, self.step
        metrics: dict = self.metrics
        taps: dict = {}
        chunks: dict[str, list] = {}
        try:
            if cfg.record_statistics:
                taps["stats"] = unnorm.record_statistics(self.stats_module)
            if cfg.record_gns:  # our trainers' norms see batch-first input: examples on axis 0
                taps["gns"] = unnorm.record_gns(self.stats_module, example_dim=0,
                                                loss_multiplier=1 / accumulate)
            for epoch in range(self.start_epoch, epochs):
                net.train()
                if sampler is not None:
                    sampler.set_epoch(epoch)
                loader = torch.utils.data.DataLoader(
                    train_set, batch_size=batch_size, sampler=sampler, shuffle=sampler is None,
                    generator=torch.Generator().manual_seed(cfg.seed * 1000 + epoch),
                    drop_last=True, **loader_args)
                progress = tqdm(loader, total=steps_per_epoch * accumulate,
                                disable=None if world.main else True,
                                desc=f"epoch {epoch + 1}/{epochs}", leave=False)
                started, lrs = time.time(), []
                chunks: dict[str, list] = {name: [] for name in taps}
                loss_sums: dict[str, torch.Tensor] = {}
                for micro_batches in _updates(progress, steps_per_epoch, accumulate):
                    self.optimizer.zero_grad(set_to_none=True)
                    if self.sam is not None:
                        self.sam.new_update()
                    update_sums: dict[str, torch.Tensor] = {}
                    for index, batch in enumerate(micro_batches):
                        last = index == accumulate - 1  # DDP reduces the gradients once, at the last
                        # (FSDP reduce-scatters each micro-batch's into its gradient shards)
                        with net.no_sync() if not last and isinstance(net, DistributedDataParallel) \
                                else nullcontext():
                            losses = forward(batch)
                            parts = dict(losses) if isinstance(losses, Mapping) else {}
                            loss = _total(losses)
                            backward(loss / accumulate, self.scaler)
                        for name, value in {"loss": loss, **parts}.items():
                            update_sums[name] = update_sums.get(name, 0) + value.detach().float() / accumulate
                    if self.sam is not None:  # the second pass, at the perturbed weights
                        self.sam.perturbed_gradient(lambda: backward(
                            _total(forward(micro_batches[0])), self.scaler))
                    lrs.append(self.optimizer.param_groups[0]["lr"])  # a float: no device read
                    optimizer_step(self.optimizer, self.scaler, clip_grad, self.model.parameters())
                    step += 1
                    self.scheduler.step_update(num_updates=step)
                    if after_update is not None:
                        after_update(step)
                    for name, value in update_sums.items():
                        loss_sums[name] = loss_sums.get(name, 0) + value
                    detector.update(step, world.mean(update_sums["loss"]))
                    if step % detector.check_every == 0:
                        for name, tap in taps.items():
                            chunks[name].append(tap.flush())
                        if world.main:
                            progress.set_postfix(loss=f"{detector.last_loss:.3f}",
                                                 lr=f"{self.optimizer.param_groups[0]['lr']:.2e}")
                detector.check()
                for module in self.replicas:  # one norm state: what is scored is what is saved
                    unnorm.distribute_norm_state(module, cfg.norm_sync)
                means = {name: world.mean(total).item() / steps_per_epoch
                         for name, total in loss_sums.items()}
                metrics = {"epoch": epoch + 1, "step": step,
                           "lr": self.optimizer.param_groups[0]["lr"],
                           **{f"train_{name}": value for name, value in means.items()},
                           "epoch_time_s": time.time() - started, **evaluate(epoch)}
                row = metrics_row(**metrics, lr_per_update=lrs)  # the rate each update used
                logger.log(metrics, step=step)
                for name, tap in taps.items():
                    chunks[name].append(tap.flush())
                if "stats" in taps:
                    save_statistics(self.run, epoch, chunks["stats"])
                if "gns" in taps:  # what one record's examples are within an update
                    save_gns(self.run, epoch, chunks["gns"], {
                        "batch_size": batch_size, "accumulate": accumulate, "replicas": world.world})
                if world.main:
                    print(f"epoch {epoch + 1}/{epochs} step {step} loss {metrics['train_loss']:.4f} "
                          f"{summary(metrics)}".rstrip())
                # the commit: the epoch's records count once its checkpoint (holding its
                # row) is written; a resume drops or completes the rest (restore_epochs)
                self.checkpoint.save(epoch=epoch, step=step, init=init, metrics=metrics, row=row,
                                     data=self.data, config=OmegaConf.to_container(cfg))
                self.run.append_row(row)
            meta = {**meta, "epochs": epochs, "init": init, **self._trainable()}
            meta.update(steps=step, **rejected_steps(self.model.state_dict()))
            result = self.run.write_result(status="ok", metrics=metrics, meta=meta)
        except TrainingCollapsed as collapse:
            if "stats" in taps:  # the statistics up to the collapse: what explains it
                save_statistics(self.run, epoch, [*chunks.get("stats", []), taps["stats"].flush()])
            meta = {**meta, "epochs": epochs, "init": init, **rejected_steps(self.model.state_dict())}
            result = record_collapse(self.run, collapse, metrics, meta)
        finally:
            for tap in taps.values():
                tap.close()
            logger.finish()
        return result


    def _trainable(self) -> dict:
        """What the run trains: its trainable parameter count, and SAM's perturbed set."""
        return trained_parameters(self.model, self.sam)


def sharpness_aware(cfg: DictConfig, model: nn.Module, world: Distributed) -> Optional[SharpnessAware]:
    """The run's SAM (``sam=sam|sam_on|asam|asam_on``), or None (``sam=none``)."""
    chosen = cfg.get("sam")
    if chosen is not None:
        chosen = OmegaConf.to_container(chosen, resolve=True)
    return configured(chosen, model, announce=world.main)


def _total(losses: Losses) -> torch.Tensor:
    """The loss a forward returned, or the sum of its parts."""
    return sum(losses.values()) if isinstance(losses, Mapping) else losses


def _updates(batches: Iterable, count: int, accumulate: int):
    """The micro-batches of the first ``count`` updates, ``accumulate`` at a time (an epoch
    may stop short of the loader's end)."""
    iterator = iter(batches)
    for _ in range(count):
        micro_batches = list(islice(iterator, accumulate))
        if len(micro_batches) < accumulate:
            return
        yield micro_batches
