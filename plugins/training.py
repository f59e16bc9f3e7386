"""Training plumbing every task's trainer shares: processes, seeds and RNG states, autocast,
DDP, compiling without a silent fall-back, and initialising from one of our checkpoints."""
from __future__ import annotations

import inspect
import os
import random
from contextlib import ExitStack, contextmanager, nullcontext
from pathlib import Path
from types import MappingProxyType
from typing import Iterator, Mapping, Optional, Sequence

import numpy as np
import torch
import torch.distributed as dist
from omegaconf import DictConfig, OmegaConf
from torch import nn
from torch.nn.parallel import DistributedDataParallel

import unnorm
from plugins.checkpoints import UnsafeCheckpoint, load_checkpoint
from plugins.model_options import carry_standardization, standardized_in_run, standardized_layers
from plugins.norms import fit_norm_to_run
from plugins.runlog import RunDirectory, RunFolderInUse, run_folder_lock, save_atomic
from plugins.scale import effective_config


class Distributed:
    """Process-group facts for one process (a single process when not under torchrun).
    ``group``: join a process group also when alone (a group of one: FSDP shards over one)."""

    def __init__(self, device_name: str, group: bool = False):
        if "RANK" not in os.environ and int(os.environ.get("SLURM_NTASKS", "1")) > 1:
            import submitit  # a SLURM job array task: export torchrun's variables from SLURM's
            submitit.helpers.TorchDistributedEnvironment().export()
        self.world = int(os.environ.get("WORLD_SIZE", "1"))
        self.rank = int(os.environ.get("RANK", "0"))
        local = int(os.environ.get("LOCAL_RANK", "0"))
        if device_name == "auto":
            device_name = "cuda" if torch.cuda.is_available() else "cpu"
        if device_name == "cuda" and not torch.cuda.is_available():
            raise RuntimeError("device=cuda but no CUDA device is visible; use device=cpu")
        self.device = torch.device(f"cuda:{local}" if device_name == "cuda" else "cpu")
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        self._owns_group = (self.world > 1 or group) and not dist.is_initialized()
        if self._owns_group:
            backend = "nccl" if self.device.type == "cuda" else "gloo"
            if self.world > 1:
                dist.init_process_group(backend)
            else:  # no torchrun: a group of one needs no rendezvous
                dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)

    @property
    def main(self) -> bool:
        return self.rank == 0

    def mean(self, tensor: torch.Tensor) -> torch.Tensor:
        if self.world > 1:
            tensor = tensor.clone()
            dist.all_reduce(tensor)
            tensor /= self.world
        return tensor

    def sum(self, tensor: torch.Tensor) -> torch.Tensor:
        if self.world > 1:
            dist.all_reduce(tensor)
        return tensor

    def shard(self, dataset) -> torch.utils.data.Dataset:
        """This replica's part of ``dataset`` for evaluation: every ``world``-th item, so the
        shards cover it exactly once (no padding with repeated items)."""
        if self.world == 1:
            return dataset
        return torch.utils.data.Subset(dataset, range(self.rank, len(dataset), self.world))

    def gather(self, obj) -> list:
        """Every replica's ``obj`` (picklable), in rank order."""
        if self.world == 1:
            return [obj]
        gathered = [None] * self.world
        dist.all_gather_object(gathered, obj)
        return gathered

    def close(self) -> None:
        if (self.world > 1 or self._owns_group) and dist.is_initialized():
            dist.destroy_process_group()


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def rng_state() -> dict:
    return {"python": random.getstate(), "numpy": np.random.get_state(),
            "torch": torch.get_rng_state()}


def set_rng_state(states: list[dict], rank: int) -> None:
    """Restore this replica's RNG state from ``gather_rng``'s list (rank 0's if it had fewer)."""
    state = states[rank] if rank < len(states) else states[0]
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])


def gather_rng(world: Distributed) -> list:
    """Every replica's RNG state, so a resumed run draws the same augmentations."""
    return world.gather(rng_state())


class Checkpointer:
    """What a run saves every epoch and resumes from: its stateful parts by name (model,
    optimizer, scheduler, ...; None where a run has no such part), plus every replica's RNG
    state and whatever the trainer adds (epoch, step, config). The previous epoch's
    checkpoint is kept beside it (``previous.pt``), to fall back to if the last is damaged.
    ``trusted`` lets a resume unpickle anything (``trust_checkpoint=true``)."""

    def __init__(self, path: Path, world: Distributed, trusted: bool = False, **parts):
        self.path, self.world, self.trusted, self.parts = Path(path), world, trusted, parts

    @property
    def previous(self) -> Path:
        return self.path.with_name("previous" + self.path.suffix)

    def exists(self) -> bool:
        return self.path.exists()

    def resume(self) -> Optional[dict]:
        """Load the saved state into the parts; returns it (None when there is none)."""
        if not self.path.exists():
            return None
        state = read_checkpoint(self.path, "resume", fallback=self.previous, trusted=self.trusted,
                                unshard=False)
        if state.get("sharded"):
            raise ValueError(f"resume: {self.path} was saved by distributed=fsdp (a sharded "
                             "checkpoint); resume it with distributed=fsdp, or start a new run "
                             f"from its weights with init_from={self.path}")
        for name, part in self.parts.items():
            if part is not None:
                part.load_state_dict(state[name])
        set_rng_state(state["rng"], self.world.rank)
        if self.world.main:
            print(f"resuming {self.path.parent} at epoch {state['epoch'] + 1}, step {state['step']}")
        return state

    def save(self, **extra) -> None:
        """Every replica calls this (the RNG states are gathered); rank 0 writes."""
        rng = gather_rng(self.world)
        if self.world.main:
            parts = {name: None if part is None else part.state_dict()
                     for name, part in self.parts.items()}
            save_atomic({**parts, "rng": rng, **extra}, self.path, keep_previous=self.previous)


def read_checkpoint(path: Path, option: str, fallback: Optional[Path] = None,
                    trusted: bool = False, unshard: bool = True) -> dict:
    """One of our checkpoints, loaded without running its pickle (``trusted``: with), or an
    error naming ``option`` and the fix; a sharded one with its whole model (``unshard``,
    ``plugins.checkpoints.load_checkpoint``)."""
    try:
        state = load_checkpoint(path, trusted=trusted, opt_in="trust_checkpoint=true",
                                unshard=unshard)
    except UnsafeCheckpoint as error:
        raise UnsafeCheckpoint(f"{option}: {error}") from error
    except Exception as error:  # torch raises several kinds for damaged or foreign files
        fix = (f"the previous epoch's checkpoint is kept as {fallback}: move it to {path} to "
               "resume from the epoch before" if fallback is not None and fallback.exists()
               else f"pass {option}= the last.pt of one of our runs (runs/<exp>/<time>/last.pt)")
        raise ValueError(f"{option}: {path} is not a readable checkpoint ({type(error).__name__}: "
                         f"{error}); {fix}") from error
    if not isinstance(state, dict) or "model" not in state:
        raise ValueError(f"{option}: {path} is not a checkpoint written by scripts/train.py (no "
                         "'model' entry); pass the last.pt of one of our runs")
    return state


def backward(loss: torch.Tensor, scaler) -> None:
    """The loss's backward, scaled under fp16 autocast."""
    (scaler.scale(loss) if scaler is not None else loss).backward()


def optimizer_step(optimizer, scaler, clip_grad: Optional[float], parameters) -> None:
    """Optional gradient-norm clipping (of the unscaled gradients), the step, and the
    scaler's update."""
    if scaler is not None:
        if clip_grad:
            scaler.unscale_(optimizer)
            torch.nn.utils.clip_grad_norm_(parameters, clip_grad)
        scaler.step(optimizer)
        scaler.update()
    else:
        if clip_grad:
            torch.nn.utils.clip_grad_norm_(parameters, clip_grad)
        optimizer.step()


def run_task(train_fn, cfg, out_dir: Path, overrides: Sequence[str] = (),
             ranges: Mapping[str, str] = MappingProxyType({}),
             strategies: Sequence[str] = ("ddp",), activation_checkpointing: bool = False) -> dict:
    """Apply the scale switch (refusing an option outside its range: the task's ``ranges``
    and every task's, ``check_ranges``), join the process group, and run ``train_fn(cfg,
    out_dir, world, meta)``; ``overrides`` (the command line's) are recorded so tables can
    tell sweeps from defaults. ``strategies``: the ``distributed.strategy`` values the task
    trains with, ``activation_checkpointing``: whether it has that option
    (``plugins.fsdp.check_distributed``)."""
    from plugins.fsdp import check_distributed

    meta = {"exp_data": cfg.data.name, "overrides": list(overrides)}
    cfg = effective_config(cfg, overrides, ranges)
    check_amp(cfg.amp)
    sharded = check_distributed(cfg, strategies, activation_checkpointing) == "fsdp"
    world = Distributed(cfg.device, group=sharded)
    try:
        with hold_run_folder(Path(out_dir), world), (
                no_eager_fallback() if cfg.compile else nullcontext()):
            return train_fn(cfg, Path(out_dir), world, meta)
    except torch._dynamo.exc.FailOnRecompileLimitHit as error:
        raise RuntimeError(
            "compile=true: dynamo reached its recompile limit and would have run the rest of the "
            "model eager, uncompiled; find what recompiles with TORCH_LOGS=recompiles, or train "
            "eager with compile=false") from error
    finally:
        world.close()


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


def check_amp(amp) -> None:
    """Refuse an ``amp`` that is none of its choices (``true`` included: it once meant
    autocast on GPUs only and float32 on a CPU without a word)."""
    if not (amp is False or amp in ("auto", "bf16", "fp16")):
        raise ValueError(f"amp={amp!r}: choose amp=auto (autocast on a GPU: bf16 where it has "
                         "it, else fp16 with a loss scaler; float32 on a CPU), amp=bf16 or "
                         "amp=fp16 (that autocast on any device, a CPU included), or amp=false")


def autocast_dtype(amp, device: torch.device) -> Optional[torch.dtype]:
    """What ``amp`` trains in on ``device`` (None: float32). ``auto``: bf16 on a GPU that
    has it, else fp16; float32 on a CPU, where autocast is slower than float32. ``bf16`` or
    ``fp16``: that, on any device (on a CPU: a rehearsal of the GPU's scale path). ``false``:
    float32."""
    check_amp(amp)
    if amp is False or amp == "auto" and device.type != "cuda":
        return None
    if amp == "auto":
        return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
    if amp == "bf16" and device.type == "cuda" and not torch.cuda.is_bf16_supported():
        raise ValueError(f"amp=bf16: {torch.cuda.get_device_name(device)} has no bf16; "
                         "use amp=fp16 (with a loss scaler) or amp=auto")
    return torch.bfloat16 if amp == "bf16" else torch.float16


def amp_context(amp, device: torch.device, model: nn.Module):
    """``(autocast, scaler)`` for ``amp`` (``autocast_dtype``): fp16 trains with a grad
    scaler, ``unnorm.GradScaler``, under which the norms of ``model`` keep their statistics
    in unscaled units and an update it skips leaves them as they were."""
    dtype = autocast_dtype(amp, device)
    if dtype is None:
        return nullcontext, None
    scaler = unnorm.GradScaler(model, device.type) if dtype == torch.float16 else None
    return (lambda: torch.autocast(device.type, dtype=dtype)), scaler


def per_replica_buffers() -> dict:
    """The DDP keyword that leaves the norms' buffers per replica (the paper's statistics;
    ``sync_stats`` shares them, ``norm_sync`` makes them agree before evaluation and saves)."""
    if "forward_sync_buffers" in inspect.signature(DistributedDataParallel).parameters:
        return {"forward_sync_buffers": False}  # torch >= 2.15 name
    return {"broadcast_buffers": False}


def data_parallel(model: nn.Module, device: torch.device) -> DistributedDataParallel:
    """DDP that leaves norm buffers per replica."""
    return DistributedDataParallel(model, device_ids=[device.index] if device.type == "cuda" else None,
                                   **per_replica_buffers())


def merge_records(chunks: list[dict], cat=torch.cat) -> dict:
    """One epoch's flushed chunks of per-step records (``{layer: {key: (T, ...)}}``), each
    key's steps joined by ``cat`` (GNS records: ``cat_padded``, per-example rows zero-padded
    to the widest; statistics must agree in width)."""
    merged: dict = {}
    for chunk in chunks:
        for layer, values in chunk.items():
            for key, tensor in values.items():
                merged.setdefault(layer, {}).setdefault(key, []).append(tensor)
    return {layer: {k: cat(v) for k, v in values.items()}
            for layer, values in merged.items()}


def save_statistics(run: RunDirectory, epoch: int, chunks: list[dict]) -> None:
    """The epoch's statistics chunks into ``stats/epoch_XXXX.pt``."""
    if run.writer:
        (run.path / "stats").mkdir(exist_ok=True)
        save_atomic(merge_records(chunks), run.path / "stats" / f"epoch_{epoch + 1:04d}.pt")


def save_gns(run: RunDirectory, epoch: int, chunks: list[dict], batch: dict) -> None:
    """The epoch's GNS chunks into ``gns/epoch_XXXX.pt``: ``{"layers": {layer: records},
    **batch}``, ``batch`` saying how the examples of a step relate to an update's."""
    if run.writer:
        (run.path / "gns").mkdir(exist_ok=True)
        save_atomic({"layers": merge_records(chunks, unnorm.gns.cat_padded), **batch},
                    run.path / "gns" / f"epoch_{epoch + 1:04d}.pt")
