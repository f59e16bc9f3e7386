"""The run skeleton every trainer of ours shares: ``train`` runs a ``Task`` (what a task
supplies: its data, model, optimizer, schedule, forward and evaluation) in the one order of
a run, and ``started`` opens a run (scale switch, process group, run folder). Around them:
seeds, ``begin_run`` (the run folder's start or resume check), ``init_from`` weights
(``load_weights``), and compiling without a silent fall-back to eager.

Import direction (``tests/test_layout.py``): this module builds on ``plugins.loop``,
``plugins.fsdp``, ``plugins.checkpoints``, ``plugins.precision`` and
``plugins.distributed``, none of which imports it; the trainers (``plugins/timm``,
``plugins/torchvision``, ``plugins/lm``) and mmdetection's runner build on it.
"""
from __future__ import annotations

import random
from contextlib import ExitStack, contextmanager, nullcontext
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType
from typing import Callable, Iterator, Mapping, Optional, Sequence

import numpy as np
import torch
from omegaconf import DictConfig, OmegaConf
from torch import nn

import unnorm
from plugins.checkpoints import Checkpointer, ShardedCheckpointer, read_checkpoint
from plugins.distributed import Distributed, data_parallel
from plugins.fsdp import STRATEGIES, amp_for, check_distributed
from plugins.loop import CHECKPOINT, EpochLoop, Losses
from plugins.model_options import carry_standardization, standardized_in_run, standardized_layers
from plugins.norms import fit_norm_to_run
from plugins.precision import amp_context, check_amp
from plugins.runlog import (PROBE_EXAMPLES, RunDirectory, RunFolderInUse,
                            recorded_scale_invariance, run_folder_lock, write_scale_invariance)
from plugins.sam import freeze_except
from plugins.scale import effective_config


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


@dataclass(kw_only=True)
class Plan:
    """A task's data and how an epoch draws it (``Task.data``'s answer; a task adds its own
    fields in a subclass). ``batch``: each replica's micro-batch, one forward;
    ``steps_per_epoch``: optimizer updates an epoch, each of ``accumulate`` micro-batches;
    ``norm_steps``: the run's micro-batches, the unit of the norms' step counts
    (``fit_norm_to_run``); ``record``: what the run records about its data (a resume onto
    other data is refused)."""
    train_set: torch.utils.data.Dataset
    val_set: torch.utils.data.Dataset
    batch: int
    sampler: Optional[torch.utils.data.Sampler]
    steps_per_epoch: int
    norm_steps: int
    accumulate: int = 1
    collate_fn: Optional[Callable] = None
    record: Optional[dict] = None


@dataclass
class Steps:
    """What the loop runs of a task (``Task.steps``'s answer): ``forward(batch)``, the loss
    or a dict of losses that add up to it; ``evaluate(epoch)``, the epoch's scores;
    ``summary(metrics)``, the progress line's part; ``meta``, the task's part of
    ``result.json`` (``plugins.runlog.run_meta``)."""
    forward: Callable[[object], Losses]
    evaluate: Callable[[int], dict]
    summary: Callable[[dict], str]
    meta: dict


@dataclass
class Run:
    """One run as ``train`` builds it, in its order: each of a task's functions reads what
    was built before it is called."""
    cfg: DictConfig
    world: Distributed
    out_dir: Path
    data: Plan
    sharded: bool
    model: Optional[nn.Module] = None
    init: str = "scratch"
    ema: Optional[nn.Module] = None
    optimizer: Optional[torch.optim.Optimizer] = None
    scheduler: object = None
    epochs: int = 0
    amp: Callable = nullcontext
    scaler: object = None
    loop: Optional[EpochLoop] = None
    net: Optional[nn.Module] = None


def _load_init(run: Run) -> str:
    cfg = run.cfg
    return load_weights(run.model, cfg.init_from, cfg.reset_norm_steps, trusted=cfg.trust_checkpoint)


def _compile(run: Run) -> None:
    run.model.compile()  # in place: state-dict keys stay as they are


@dataclass(frozen=True)
class Task:
    """What a task supplies to ``train``: functions, each called once, in the run's order.

    - ``data(cfg, world)``: its datasets and how an epoch draws them (a ``Plan``);
    - ``model(run)``: the model; ``describe(run)``: the line the run starts with;
      ``head(model)``: what ``train_only=norm+head`` trains besides the norms;
    - ``optimizer(run)``; ``scheduler(run)``: ``(timm scheduler stepped per update,
      epochs)``;
    - ``steps(run)``: forward, evaluation, progress line and result entries (``Steps``).

    Optional: ``init(run)``, ``init_from``'s weights (default: ``load_weights`` into the
    whole model); ``ema(run)``, an average of the weights (timm's ``ModelEmaV3``, or None
    when the recipe keeps none), updated after every update, checkpointed as ``model_ema``,
    made one across the replicas and compiled as the model is; ``shard(run)``, FSDP2 (a task
    without it trains with DDP only); ``compile(run)`` (default: the whole model);
    ``tapped(model)``, what ``record_statistics`` and ``record_gns`` tap (default: the
    model); ``activation_checkpointing(model)``, turns it on for
    ``distributed.activation_checkpointing=true`` (a task without it refuses that option);
    ``probe(model, batch)``, the outputs the loss reads of a float64 copy of the model on a
    collated training batch of the first ``probe_examples`` training examples, for
    ``record_scale_invariance`` (a task without it records none).
    """
    ranges: Mapping[str, str]
    data: Callable[[DictConfig, Distributed], Plan]
    model: Callable[[Run], nn.Module]
    describe: Callable[[Run], str]
    head: Callable[[nn.Module], nn.Module]
    optimizer: Callable[[Run], torch.optim.Optimizer]
    scheduler: Callable[[Run], tuple]
    steps: Callable[[Run], Steps]
    init: Callable[[Run], str] = _load_init
    ema: Optional[Callable[[Run], Optional[nn.Module]]] = None
    shard: Optional[Callable[[Run], None]] = None
    compile: Callable[[Run], None] = _compile
    tapped: Callable[[nn.Module], nn.Module] = lambda model: model
    activation_checkpointing: Optional[Callable[[nn.Module], None]] = None
    probe: Optional[Callable[[nn.Module, object], object]] = None
    probe_examples: int = PROBE_EXAMPLES


def train(task: Task, cfg: DictConfig, out_dir: Path, overrides: Sequence[str] = ()) -> dict:
    """One run of ``task``, in the order of every run of ours; returns its ``result.json``
    content. ``overrides`` (the command line's) are recorded so tables can tell sweeps from
    defaults."""
    out_dir = Path(out_dir)
    strategies = STRATEGIES if task.shard is not None else ("ddp",)
    with started(cfg, out_dir, overrides, task.ranges, strategies,  # scale switch, processes,
                 task.activation_checkpointing is not None) as (cfg, world, meta):  # run folder
        require_init(cfg)
        data = task.data(cfg, world)
        cfg, folder, finished = begin_run(cfg, out_dir, world, data.norm_steps, CHECKPOINT)
        if finished is not None:  # a resume, or a requeue, of a run that has ended
            return finished
        run = Run(cfg, world, out_dir, data, sharded=cfg.distributed.strategy == "fsdp")
        run.model = task.model(run).to(world.device)
        if cfg.init_from:
            run.init = task.init(run)
        if world.main:
            print(task.describe(run))
        freeze_except(run.model, cfg.train_only, head=task.head(run.model))  # train_only=norm|norm+head
        invariance = invariance_at_start(task, run)  # the trained weights, unwrapped
        run.ema = task.ema(run) if task.ema is not None else None
        if cfg.distributed.activation_checkpointing:  # each layer recomputed in the backward
            task.activation_checkpointing(run.model)
        if run.sharded:  # before the optimizer, which must hold the shards
            task.shard(run)
        run.optimizer = task.optimizer(run)
        run.scheduler, run.epochs = task.scheduler(run)
        run.amp, run.scaler = (amp_for if run.sharded else amp_context)(cfg.amp, world.device,
                                                                        run.model)
        averaged = run.ema.module if run.ema is not None else None
        run.loop = EpochLoop(
            cfg, out_dir, world, folder, run.model, run.optimizer, run.scheduler, run.scaler,
            replicas=[m for m in (run.model, averaged) if m is not None],
            stats_module=task.tapped(run.model), data=data.record,
            checkpointer=ShardedCheckpointer if run.sharded else Checkpointer,
            **({"model_ema": averaged} if task.ema is not None else {}))
        run.init = run.loop.resume(run.init)
        if cfg.compile and not run.sharded:  # (shard compiles a sharded model's blocks)
            task.compile(run)
            if averaged is not None:
                averaged.compile()
        run.net = (data_parallel(run.model, world.device) if world.world > 1 and not run.sharded
                   else run.model)
        steps = task.steps(run)
        return run.loop.fit(
            run.net, data.train_set, data.batch, data.sampler, data.steps_per_epoch, run.epochs,
            forward=steps.forward, evaluate=steps.evaluate, summary=steps.summary,
            after_update=(lambda step: run.ema.update(run.model, step=step))
            if run.ema is not None else None,
            meta={**meta, **steps.meta, **invariance}, init=run.init, collate_fn=data.collate_fn,
            clip_grad=cfg.recipe.clip_grad, agc=cfg.recipe.get("agc"), accumulate=data.accumulate)


def invariance_at_start(task: Task, run: Run) -> dict:
    """``{"scale_invariant": ...}`` for ``result.json`` (``record_scale_invariance=true``):
    the weights the model is exactly scale-invariant in at the run's start, found once by rank
    0 on the first ``task.probe_examples`` training examples and kept in the run folder
    (``plugins.runlog.write_scale_invariance``), which a resume reads. A resume of a run that
    has no such record records none: its weights are no longer the start's. The run's RNGs
    are left as they were."""
    cfg, world, data = run.cfg, run.world, run.data
    if not cfg.get("record_scale_invariance") or task.probe is None:
        return {}
    recorded = recorded_scale_invariance(run.out_dir)
    if recorded or (run.out_dir / CHECKPOINT).exists() or not world.main:
        return recorded
    count = min(len(data.train_set), task.probe_examples)  # whatever the micro-batch: one record
    with rngs_kept(world.device):
        collate = data.collate_fn or torch.utils.data.default_collate
        batch = collate([data.train_set[index] for index in range(count)])
        return write_scale_invariance(run.out_dir, run.model, lambda model: task.probe(model, batch),
                                      examples=count, seed=cfg.seed)


@contextmanager
def rngs_kept(device: torch.device) -> Iterator[None]:
    """Python's, numpy's and torch's RNG states (``device``'s included) as they were before
    the block: what it draws does not change the run."""
    python, numpy = random.getstate(), np.random.get_state()
    with torch.random.fork_rng(devices=[device.index or 0] if device.type == "cuda" else []):
        try:
            yield
        finally:
            random.setstate(python)
            np.random.set_state(numpy)


@contextmanager
def started(cfg, out_dir: Path, overrides: Sequence[str] = (),
            ranges: Mapping[str, str] = MappingProxyType({}), strategies: Sequence[str] = ("ddp",),
            activation_checkpointing: bool = False) -> Iterator[tuple[DictConfig, Distributed, dict]]:
    """A run's start, held for the block: ``(cfg, world, meta)``. Applies the scale switch
    (refusing an option outside its range: the task's ``ranges`` and every task's,
    ``check_ranges``), joins the process group and holds the run folder; ``meta`` records
    the experiment's data (the paper's, which tables group runs by, whatever the scale ran
    on) and ``overrides`` (the command line's, so tables can tell sweeps from defaults).
    ``strategies``: the ``distributed.strategy`` values the task trains with,
    ``activation_checkpointing``: whether it has that option
    (``plugins.fsdp.check_distributed``)."""
    cfg, composed = effective_config(cfg, overrides, ranges), cfg
    meta = {"exp_data": composed.paper.data.name, "overrides": list(overrides)}
    check_amp(cfg.amp)
    sharded = check_distributed(cfg, strategies, activation_checkpointing) == "fsdp"
    world = Distributed(cfg.device, group=sharded)
    try:
        with hold_run_folder(Path(out_dir), world), (
                no_eager_fallback() if cfg.compile else nullcontext()):
            yield cfg, world, meta
    except torch._dynamo.exc.FailOnRecompileLimitHit as error:
        raise RuntimeError(
            "compile=true: dynamo reached its recompile limit and would have run the rest of the "
            "model eager, uncompiled; find what recompiles with TORCH_LOGS=recompiles, or train "
            "eager with compile=false") from error
    finally:
        world.close()


def run_task(train_fn, cfg, out_dir: Path, overrides: Sequence[str] = (),
             ranges: Mapping[str, str] = MappingProxyType({}),
             strategies: Sequence[str] = ("ddp",), activation_checkpointing: bool = False) -> dict:
    """``train_fn(cfg, out_dir, world, meta)`` within ``started``: a task that trains in its
    own loop (mmdetection's runner)."""
    with started(cfg, out_dir, overrides, ranges, strategies,
                 activation_checkpointing) as (cfg, world, meta):
        return train_fn(cfg, Path(out_dir), world, meta)


@contextmanager
def hold_run_folder(out_dir: Path, world: Distributed) -> Iterator[None]:
    """The run folder's lock (``run_folder_lock``), held by rank 0 for the run; every replica
    raises rank 0's refusal, so none waits at a collective for a rank that left."""
    with ExitStack() as stack:
        refusal = None
        try:
            stack.enter_context(run_folder_lock(out_dir, enabled=world.main))
        except RunFolderInUse as error:
            refusal = str(error)
        refusal = world.gather(refusal)[0]
        if refusal is not None:
            raise RunFolderInUse(refusal)
        yield


def no_eager_fallback(recompile_limit: int = 8, accumulated_recompile_limit: int = 256):
    """dynamo settings, as a context manager, under which compiled code that reaches the
    recompile limit raises (``FailOnRecompileLimitHit``) instead of running the rest eager
    without a word: compiling means compiled. Code that compiles many variants of the same
    modules at once (the benchmarks) raises the limits."""
    return torch._dynamo.config.patch(recompile_limit=recompile_limit,
                                      accumulated_recompile_limit=accumulated_recompile_limit,
                                      fail_on_recompile_limit_hit=True)


def begin_run(cfg, out_dir: Path, world: Distributed, total_steps: int,
              checkpoint: str) -> tuple[DictConfig, RunDirectory, Optional[dict]]:
    """Fit the norm to the run's length, then start the run or check its resume (nothing is
    written for a resume): ``(cfg, run directory, stored result of a run that has ended)``.
    Seeds the RNGs of a run that goes on."""
    unnorm.check_norm_sync(cfg.norm_sync)
    cfg = fit_norm_to_run(cfg, total_steps)
    run = RunDirectory(out_dir, writer=world.main)
    finished = run.begin(OmegaConf.to_yaml(cfg, resolve=True),
                         resuming=(out_dir / checkpoint).exists())
    if finished is None:
        seed_everything(cfg.seed + world.rank)
    return cfg, run, finished


def epoch_plan(train_set, batch_size: int, max_steps: Optional[int], world: Distributed, seed: int):
    """Per-replica batch, the DDP sampler (None on one process) and optimizer steps per epoch."""
    if batch_size % world.world:
        raise ValueError(f"batch_size {batch_size} is not divisible by {world.world} replicas")
    sampler = (torch.utils.data.DistributedSampler(train_set, seed=seed, drop_last=True)
               if world.world > 1 else None)
    steps = len(train_set) // batch_size
    if max_steps:
        steps = min(steps, max_steps)
    if steps < 1:
        raise ValueError(f"batch_size {batch_size} exceeds the {len(train_set)} training samples")
    return batch_size // world.world, sampler, steps


def require_init(cfg) -> None:
    """A recipe that starts from one of our ImageNet runs refuses to run without one (at the
    paper's scale; CPU-scale runs start from scratch)."""
    if cfg.recipe.get("requires_init") and not cfg.init_from and cfg.scale.name == "full":
        raise ValueError(f"recipe {cfg.recipe.name} starts from an ImageNet run of ours: pass "
                         "init_from=runs/<exp>/<time>/last.pt (or recipe.requires_init=false)")


def load_weights(model: nn.Module, path: str, reset_steps: bool, *, ignore: Sequence[str] = (),
                 resizable: Sequence[str] = (), trusted: bool = False) -> str:
    """Initialise ``model`` from one of our checkpoints (its EMA weights when it kept them).

    Checkpoint keys starting with an ``ignore`` prefix are dropped. A tensor may differ in
    shape only under a ``resizable`` prefix (the classifier of a task with other classes): it
    stays new, and the returned description names it. Any other difference is an error that
    names every tensor; a norm's windows of another length reach the norm's own check, which
    names ``window_size``. Weight-standardised layers compute what they computed there
    (``plugins.model_options.carry_standardization``). ``reset_steps`` restarts UN/MABN/PN
    step counters, so their warm-up runs again on the new task. ``trusted``:
    ``trust_checkpoint=true``.
    """
    if not Path(path).exists():
        raise FileNotFoundError(f"init_from checkpoint not found: {path}")
    saved = read_checkpoint(Path(path), "init_from", trusted=trusted)
    state = saved.get("model_ema") or saved["model"]
    state = {k: v for k, v in state.items() if not k.startswith(tuple(ignore))}
    source = OmegaConf.create(saved["config"]).model if saved.get("config") else {}
    carry_standardization(state, standardized_in_run(source, model, state),
                          standardized_layers(model), f"init_from: {path}")
    own = model.state_dict()
    resized = {k: (tuple(state[k].shape), tuple(own[k].shape)) for k in state
               if k in own and state[k].shape != own[k].shape}
    new = sorted(k for k in resized if k.startswith(tuple(resizable)))
    try:
        missing, unexpected = model.load_state_dict(
            {k: v for k, v in state.items() if k not in new}, strict=False)
    except RuntimeError as error:  # shapes that differ outside ``resizable``
        differing = [f"{k} {theirs} there, {ours} here" for k, (theirs, ours) in sorted(resized.items())
                     if k not in new]
        if not differing:
            raise
        raise ValueError(f"init_from: {path} does not fit this model: {'; '.join(differing)}. "
                         "Build the model as that run did (its config.yaml); only the classifier "
                         f"may differ in shape{f' ({list(resizable)})' if resizable else ''}") from error
    if unexpected or set(missing) - set(new):
        raise RuntimeError(f"{path} does not fit this model: missing {sorted(set(missing) - set(new))[:5]}, "
                           f"unexpected {sorted(unexpected)[:5]}")
    if reset_steps:
        unnorm.reset_steps(model)
    return f"{path} (new: {new})" if new else path
