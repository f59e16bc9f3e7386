"""The training loop every trainer of ours shares (classification, torchvision detection,
language modelling): epochs of optimizer updates (with gradient accumulation), the collapse
watch, the replicas' norm state made one before each evaluation and save, metrics, statistics
taps, landscape probes, checkpoints and resume, the result.

The run skeleton (``plugins.training.train``) builds a task's data, model, optimizer and
schedule, then hands the loop what differs between tasks: how a batch becomes a loss
(``forward``), what happens after an update (an EMA), how the model is scored (``evaluate``)
and what the progress line adds (``summary``). ``EpochLoop.fit`` is the order of an epoch;
one optimizer update is ``_update``, the end of an epoch ``_end_epoch``. fairseq and
mmdetection train in their own loops and share the records (``plugins.runlog``).
"""
from __future__ import annotations

import time
from contextlib import nullcontext
from dataclasses import dataclass, field
from itertools import islice
from pathlib import Path
from typing import Callable, Iterable, Mapping, Optional, Sequence, Union

import torch
from omegaconf import DictConfig, OmegaConf
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from tqdm import tqdm

import unnorm
from plugins.checkpoints import Checkpointer
from plugins.distributed import Distributed
from plugins.landscape import LandscapeRecorder, landscape_interval, probe_update, trained
from plugins.optim import UpdateRecord, clip_gradients
from plugins.runlog import (CollapseDetector, RunDirectory, TrainingCollapsed, config_differences,
                            metrics_row, record_collapse, rejected_steps, run_logger, save_gns,
                            save_statistics)
from plugins.sam import SharpnessAware, configured, trained_parameters

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
    are written and resumed (``plugins.checkpoints.ShardedCheckpointer`` for a sharded
    model)."""

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
        # record_updates=true: each epoch's effective steps and projections (metrics.jsonl)
        self.updates = UpdateRecord(optimizer) if cfg.get("record_updates") else None
        # record_landscape=k: every k-th update's loss landscape (landscape.jsonl)
        every = landscape_interval(cfg.get("record_landscape"))
        self.landscape = (LandscapeRecorder(every, model, trained(optimizer), world.device)
                          if every else None)
        self.epoch = 0  # the epoch being trained (0-based), for the landscape's rows
        self.taps: dict = {}  # fit's statistics and GNS taps, and its logger
        self.logger = None

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
            collate_fn=None, clip_grad: Optional[float] = None, agc: Optional[float] = None,
            accumulate: int = 1) -> dict:
        """Train epochs ``start_epoch..epochs`` of ``steps_per_epoch`` optimizer updates and
        write the result; returns it.

        ``forward(batch)`` returns the loss, or a dict of losses that add up to it (each
        recorded as ``train_<name>``); ``evaluate(epoch)`` the epoch's scores (may be empty);
        ``after_update(step)`` runs after each optimizer update. Each update accumulates the
        gradients of ``accumulate`` micro-batches (the norms count micro-batches), clipped by
        their norm (``clip_grad``) or adaptively (``agc``) before the step.
        """
        cfg, world = self.cfg, self.world
        if self.sam is not None and accumulate > 1:
            raise ValueError(f"sam with gradient accumulation ({accumulate} micro-batches per "
                             "update) is not defined here: SAM's ascent needs the whole update's "
                             "gradient before its second pass. Use one micro-batch per update "
                             "(a smaller batch, or more memory), or sam=none")
        meta = {**meta, "epochs": epochs, "init": init}
        self.logger = run_logger(cfg, self.out_dir, enabled=world.main)
        self.taps = {}
        tally = _Epoch(steps_per_epoch)  # the last epoch's (a resume of a run past its epochs)
        try:
            if cfg.record_statistics:
                self.taps["stats"] = unnorm.record_statistics(self.stats_module)
            if cfg.record_gns:  # our trainers' norms see batch-first input: examples on axis 0
                self.taps["gns"] = unnorm.record_gns(self.stats_module, example_dim=0,
                                                     loss_multiplier=1 / accumulate)
            for epoch in range(self.start_epoch, epochs):
                self.epoch = epoch
                net.train()
                progress = self._batches(train_set, batch_size, sampler, collate_fn, epoch, epochs,
                                         steps_per_epoch * accumulate)
                tally = _Epoch(steps_per_epoch, chunks={name: [] for name in self.taps})
                for micro_batches in _updates(progress, steps_per_epoch, accumulate):
                    tally.lrs.append(self.optimizer.param_groups[0]["lr"])  # a float: no device read
                    tally.add(self._update(net, micro_batches, forward, after_update,
                                           clip_grad, agc))
                    if self.step % self.detector.check_every == 0:
                        self._flush(tally)
                        if world.main:
                            progress.set_postfix(loss=f"{self.detector.last_loss:.3f}",
                                                 lr=f"{self.optimizer.param_groups[0]['lr']:.2e}")
                self._end_epoch(epoch, epochs, tally, evaluate, summary, init, {
                    "batch_size": batch_size, "accumulate": accumulate, "replicas": world.world})
            meta.update(**self._trainable(), steps=self.step,
                        **rejected_steps(self.model.state_dict()))
            result = self.run.write_result(status="ok", metrics=self.metrics, meta=meta)
        except TrainingCollapsed as collapse:
            if "stats" in self.taps:  # the statistics up to the collapse: what explains it
                save_statistics(self.run, epoch, [*tally.chunks.get("stats", []),
                                                  self.taps["stats"].flush()])
            if self.landscape is not None:  # the probes up to the collapse
                self.landscape.write(self.run)
            meta.update(**rejected_steps(self.model.state_dict()))
            result = record_collapse(self.run, collapse, self.metrics, meta)
        finally:
            for tap in self.taps.values():
                tap.close()
            self.logger.finish()
        return result

    def _batches(self, train_set, batch_size: int, sampler, collate_fn, epoch: int, epochs: int,
                 total: int):
        """The epoch's micro-batches (its own shuffle, seeded by the run's seed and the
        epoch), behind the progress bar."""
        cfg, device = self.cfg, self.world.device
        if sampler is not None:
            sampler.set_epoch(epoch)
        loader = torch.utils.data.DataLoader(
            train_set, batch_size=batch_size, sampler=sampler, shuffle=sampler is None,
            generator=torch.Generator().manual_seed(cfg.seed * 1000 + epoch), drop_last=True,
            num_workers=cfg.scale.num_workers, pin_memory=device.type == "cuda",
            persistent_workers=cfg.scale.num_workers > 0, collate_fn=collate_fn)
        return tqdm(loader, total=total, disable=None if self.world.main else True,
                    desc=f"epoch {epoch + 1}/{epochs}", leave=False)

    def _update(self, net: nn.Module, micro_batches: list, forward: Callable[[object], Losses],
                after_update: Optional[Callable[[int], None]], clip_grad: Optional[float],
                agc: Optional[float] = None) -> dict:
        """One optimizer update: the gradients of its micro-batches accumulated (the loss of
        each divided by their number), a due landscape probe along them (``record_landscape``;
        it leaves everything as it found it), SAM's second pass, clipping, the step, the
        schedule's step and ``after_update``, then the collapse watch. Returns the update's losses (each
        the mean over its micro-batches)."""
        self.optimizer.zero_grad(set_to_none=True)
        if self.sam is not None:
            self.sam.new_update()
        probe = (self.landscape.start() if self.landscape is not None
                 and self.landscape.due(self.step) else None)
        # each probe point gets the batch as the update got it: a forward may change its batch
        # in place (timm's mixup mixes the images tensor it is given)
        batches = _copied(micro_batches) if probe is not None else None
        update_sums = self._accumulate(net, micro_batches, forward)
        if probe is not None:  # along the gradient just computed, before anything uses it
            probe_update(
                self.landscape, probe,
                lambda: self.world.mean(self._accumulate(net, _copied(batches), forward)["loss"]),
                self.world.mean(update_sums["loss"]), step=self.step, epoch=self.epoch + 1,
                lr=self.optimizer.param_groups[0]["lr"], scaler=self.scaler)
        if self.sam is not None:  # the second pass, at the perturbed weights
            self.sam.perturbed_gradient(lambda: backward(
                _total(forward(micro_batches[0])), self.scaler))
        with self.updates.step() if self.updates is not None else nullcontext():
            optimizer_step(self.optimizer, self.scaler, clip_grad, self.model.parameters(), agc)
        self.step += 1
        self.scheduler.step_update(num_updates=self.step)
        if after_update is not None:
            after_update(self.step)
        self.detector.update(self.step, self.world.mean(update_sums["loss"]))
        return update_sums

    def _accumulate(self, net: nn.Module, micro_batches: list,
                    forward: Callable[[object], Losses]) -> dict[str, torch.Tensor]:
        """The update's gradients, accumulated over its micro-batches (the loss of each
        divided by their number); returns the losses, each the mean over the micro-batches."""
        accumulate = len(micro_batches)
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
        return update_sums

    def _end_epoch(self, epoch: int, epochs: int, tally: _Epoch, evaluate: Callable[[int], dict],
                   summary: Callable[[dict], str], init: str, gns_batch: dict) -> None:
        """The end of an epoch: the collapse watch's last check, the replicas' norm state made
        one, the metrics (training losses, ``evaluate``'s scores), the records (log,
        statistics, GNS), then the checkpoint that commits the epoch and its row."""
        cfg, world = self.cfg, self.world
        self.detector.check()
        for module in self.replicas:  # one norm state: what is scored is what is saved
            unnorm.distribute_norm_state(module, cfg.norm_sync)
        means = {name: world.mean(total).item() / tally.steps for name, total in tally.sums.items()}
        self.metrics = {"epoch": epoch + 1, "step": self.step,
                        "lr": self.optimizer.param_groups[0]["lr"],
                        **{f"train_{name}": value for name, value in means.items()},
                        "epoch_time_s": time.time() - tally.started, **evaluate(epoch)}
        row = metrics_row(**self.metrics, lr_per_update=tally.lrs,  # the rate each update used
                          **(self.updates.flush() if self.updates is not None else {}))
        self.logger.log(self.metrics, step=self.step)
        self._flush(tally)
        if "stats" in self.taps:
            save_statistics(self.run, epoch, tally.chunks["stats"])
        if "gns" in self.taps:  # what one record's examples are within an update
            save_gns(self.run, epoch, tally.chunks["gns"], gns_batch)
        if self.landscape is not None:
            self.landscape.write(self.run)
        if world.main:
            print(f"epoch {epoch + 1}/{epochs} step {self.step} loss "
                  f"{self.metrics['train_loss']:.4f} {summary(self.metrics)}".rstrip())
        # the commit: the epoch's records count once its checkpoint (holding its row) is
        # written; a resume drops or completes the rest (restore_epochs)
        self.checkpoint.save(epoch=epoch, step=self.step, init=init, metrics=self.metrics, row=row,
                             data=self.data, config=OmegaConf.to_container(cfg))
        self.run.append_row(row)

    def _flush(self, tally: _Epoch) -> None:
        """The taps' records so far into the epoch's chunks."""
        for name, tap in self.taps.items():
            tally.chunks[name].append(tap.flush())

    def _trainable(self) -> dict:
        """What the run trains: its trainable parameter count, and SAM's perturbed set."""
        return trained_parameters(self.model, self.sam)


@dataclass
class _Epoch:
    """What an epoch gathers as it trains: the rate of each update, its losses' sums over
    ``steps`` updates, and the taps' chunks of records."""
    steps: int
    chunks: dict[str, list] = field(default_factory=dict)
    lrs: list[float] = field(default_factory=list)
    sums: dict[str, torch.Tensor] = field(default_factory=dict)
    started: float = field(default_factory=time.time)

    def add(self, losses: dict[str, torch.Tensor]) -> None:
        for name, value in losses.items():
            self.sums[name] = self.sums.get(name, 0) + value


def backward(loss: torch.Tensor, scaler) -> None:
    """The loss's backward, scaled under fp16 autocast."""
    (scaler.scale(loss) if scaler is not None else loss).backward()


def optimizer_step(optimizer, scaler, clip_grad: Optional[float], parameters,
                   agc: Optional[float] = None) -> None:
    """Optional clipping of the unscaled gradients, by their norm (``clip_grad``) or
    adaptively (``agc``; ``plugins.optim.clip_gradients``), the step, and the scaler's
    update."""
    if scaler is not None:
        if clip_grad or agc:
            scaler.unscale_(optimizer)
            clip_gradients(parameters, clip_grad, agc)
        scaler.step(optimizer)
        scaler.update()
    else:
        clip_gradients(parameters, clip_grad, agc)
        optimizer.step()


def sharpness_aware(cfg: DictConfig, model: nn.Module, world: Distributed) -> Optional[SharpnessAware]:
    """The run's SAM (``sam=sam|sam_on|asam|asam_on``), or None (``sam=none``)."""
    chosen = cfg.get("sam")
    if chosen is not None:
        chosen = OmegaConf.to_container(chosen, resolve=True)
    return configured(chosen, model, announce=world.main)


def _total(losses: Losses) -> torch.Tensor:
    """The loss a forward returned, or the sum of its parts."""
    return sum(losses.values()) if isinstance(losses, Mapping) else losses


def _copied(batch):
    """A copy of a batch's tensors, in its lists, tuples and dicts."""
    if isinstance(batch, torch.Tensor):
        return batch.clone()
    if isinstance(batch, Mapping):
        return type(batch)((key, _copied(value)) for key, value in batch.items())
    if isinstance(batch, (list, tuple)):
        values = [_copied(value) for value in batch]
        return type(batch)(*values) if hasattr(batch, "_fields") else type(batch)(values)
    return batch


def _updates(batches: Iterable, count: int, accumulate: int):
    """The micro-batches of the first ``count`` updates, ``accumulate`` at a time (an epoch
    may stop short of the loader's end)."""
    iterator = iter(batches)
    for _ in range(count):
        micro_batches = list(islice(iterator, accumulate))
        if len(micro_batches) < accumulate:
            return
        yield micro_batches
