"""What every training path writes and watches: run directory, metrics, result, collapse.

Each run owns a directory with the resolved ``config.yaml``, ``metrics.jsonl`` (one JSON
object per logged step or epoch) and ``result.json`` (final metrics and status, ``ok`` or
``FAIL`` with the step and reason, or ``chance`` when the final headline metric is no better
than what learning nothing gives, ``chance_rule``), and per epoch ``stats/`` and ``gns/``
(``save_statistics``, ``save_gns``). Training paths of every framework share this format,
so ``scripts/make_tables.py`` reads them all alike.
"""
from __future__ import annotations

import ast
import fcntl
import json
import math
import os
import platform
import secrets
import subprocess
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Callable, Iterator, Optional

import torch
import yaml
from omegaconf import DictConfig, OmegaConf

import unnorm
from plugins.checkpoints import save_atomic
from plugins.logger import make_logger
from plugins.norms import norm_kwargs

RESULT_FILE = "result.json"
METRICS_FILE = "metrics.jsonl"
CONFIG_FILE = "config.yaml"
LOCK_FILE = "run.lock"  # held by the run writing the folder (flock), names its holder
#: options a resume may change (the record switches too: a run from before them resumes)
RESUME_KEYS = {"resume", "trust_checkpoint", "record_scale_invariance", "record_updates",
               "record_landscape"}
#: keys a run's config.yaml recorded before Hydra composed the scale (issue 45): the scale's
#: variants inside the model and recipe (merged in, so recorded twice) and the scale's data
#: names (the data itself recorded); and the recipe's optimizer before ``optimizer=`` (issue
#: 49), which ``with_optimizer`` spells anew. A config that no longer has them continues such a run
RETIRED_KEYS = {"model.cpu", "recipe.cpu", "scale.data", "recipe.opt", "recipe.momentum",
                "recipe.betas", "recipe.train.optimizer", "recipe.train.adam_betas"}
#: keys added since runs were recorded that a run reads only through another recorded key
#: (``ws=nf`` copies ``model.nf_targets`` into ``model.weight_standardization``): a config
#: that lacks them continues such a run
ADDED_KEYS = {"model.nf_targets", "model.nf_targets_of"}
#: the weights a model is exactly scale-invariant in at a run's start (record_scale_invariance),
#: found on the first PROBE_EXAMPLES training examples: enough for batch statistics, and the
#: float64 copy's activations stay small
SCALE_INVARIANCE_FILE = "scale_invariance.json"
PROBE_EXAMPLES = 16
#: a detector's: its norms pool every position of an image, so two images give them thousands,
#: where 16 whole images through the detector cost a probe about 20 s at scale=cpu (3 s for two)
DETECTION_PROBE_EXAMPLES = 2
FINISHED = ("ok", "chance")  # statuses of a run that trained to its end (FAIL: collapsed)
EPOCH_FOLDERS = ("stats", "gns")  # per-epoch records: <folder>/epoch_XXXX.pt
LANDSCAPE_FILE = "landscape.jsonl"  # record_landscape's probes, a row each (plugins.landscape)


def config_differences(stored: Any, new: Any, prefix: str = "") -> list[str]:
    """Dotted keys whose values differ between two configurations (as loaded from YAML); a
    retired key (``RETIRED_KEYS``) that only ``stored`` has is none, and so is an added key
    (``ADDED_KEYS``) that only ``new`` has."""
    if isinstance(stored, dict) and isinstance(new, dict):
        keys = sorted(set(stored) | set(new))
        return [diff for key in keys if f"{prefix}{key}" not in RESUME_KEYS
                and not (f"{prefix}{key}" in RETIRED_KEYS and key not in new)
                and not (f"{prefix}{key}" in ADDED_KEYS and key not in stored)
                for diff in config_differences(stored.get(key), new.get(key), f"{prefix}{key}.")]
    return [] if stored == new else [f"{prefix.rstrip('.')} ({stored!r} -> {new!r})"]


def with_optimizer(stored: dict) -> dict:
    """A run's stored config with the optimizer its recipe chose before ``optimizer=`` (issue
    49) as ``optimizer`` states it: timm's ``adamw`` and ``momentum`` (SGD), fairseq's ``adam``
    (decoupled decay), the LM's AdamW ``betas``, each at the defaults it ran with. Other
    configs as they are (an optimizer this does not know then differs from any)."""
    if "optimizer" in stored:
        return stored
    recipe = stored.get("recipe") or {}
    train = recipe.get("train") or {}
    if recipe.get("opt") == "adamw":
        optimizer = {"name": "adamw", "betas": [0.9, 0.999], "eps": 1e-8}
    elif recipe.get("opt") == "momentum":
        optimizer = {"name": "sgd", "momentum": recipe["momentum"], "nesterov": False}
    elif train.get("optimizer") == "adam":
        optimizer = {"name": "adamw", "betas": list(ast.literal_eval(train["adam_betas"])),
                     "eps": train.get("adam_eps", 1e-8)}
    elif "betas" in recipe:
        optimizer = {"name": "adamw", "betas": recipe["betas"], "eps": 1e-8}
    else:
        return stored
    return {**stored, "optimizer": optimizer}


def git_commit() -> str:
    """The commit of this checkout (with ``+dirty`` when it has local changes)."""
    root = Path(__file__).resolve().parents[1]
    try:
        commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=root, capture_output=True,
                                text=True, check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"],
                               cwd=root, capture_output=True, text=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    return commit + ("+dirty" if dirty else "")


def run_folder_suffix() -> str:
    """What makes a default run folder's name (``hydra.run.dir``) its own beyond the second
    it starts in, alike on every replica of one launch: torchrun's run id and port, a SLURM
    job's id, else this process's id and a random part."""
    if "TORCHELASTIC_RUN_ID" in os.environ:
        return f"torchrun-{os.environ['TORCHELASTIC_RUN_ID']}-{os.environ.get('MASTER_PORT', '')}"
    if int(os.environ.get("SLURM_NTASKS", "1")) > 1:
        return f"slurm-{os.environ['SLURM_JOB_ID']}"
    return f"{os.getpid()}-{secrets.token_hex(3)}"


class RunFolderInUse(RuntimeError):
    """Another live run holds the run folder."""


@contextmanager
def run_folder_lock(path: Path, enabled: bool = True) -> Iterator[None]:
    """Hold ``<path>/run.lock`` for the block: a second run into the folder is refused.

    An exclusive ``fcntl.flock``, not a file whose existence is the lock: the kernel drops it
    when the holder exits in any way (SIGKILL and OOM kills included), so a lock left by a
    dead run never blocks, and no stale-lock guessing from pids is needed. The file keeps the
    holder's host, pid and start for the refusal. It is deleted only with a folder the run
    made and left empty (a run refused by its settings), and while still locked: a lock file
    deleted under another run would let two runs lock two different files. ``enabled=False``
    (a replica that does not write) holds nothing.
    """
    if not enabled:
        yield
        return
    path = Path(path)
    created = not path.exists()
    path.mkdir(parents=True, exist_ok=True)
    with _locked(path):
        try:
            yield
        finally:  # a run refused before it wrote anything leaves no folder (still locked here)
            if created and [p.name for p in path.iterdir()] == [LOCK_FILE]:
                (path / LOCK_FILE).unlink()
                path.rmdir()


@contextmanager
def _locked(path: Path) -> Iterator[None]:
    with open(path / LOCK_FILE, "a+") as handle:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            handle.seek(0)
            raise RunFolderInUse(
                f"{path} is in use by another run that is still going ({handle.read().strip()}); "
                "one folder holds one run. Give this run its own folder (leave hydra.run.dir "
                "unset for a new one, or set hydra.run.dir=<a new folder>), or wait for that run "
                f"to end before resume={path}") from None
        handle.truncate(0)
        handle.write(json.dumps({"host": platform.node(), "pid": os.getpid(),
                                 "since": time.strftime("%Y-%m-%dT%H:%M:%S")}) + "\n")
        handle.flush()
        yield  # closing the file releases the lock


class TrainingCollapsed(RuntimeError):
    def __init__(self, step: int, reason: str):
        super().__init__(f"training collapsed at step {step}: {reason}")
        self.step, self.reason = step, reason


class CollapseDetector:
    """Flags a non-finite loss, or a smoothed loss above ``loss_multiple`` times its running
    minimum, at the exact step, while reading the device only every ``check_every`` steps."""

    def __init__(self, loss_multiple: float = 5.0, ema: float = 0.9, min_steps: int = 50,
                 check_every: int = 20):
        self.loss_multiple, self.ema, self.min_steps = loss_multiple, ema, min_steps
        self.check_every = max(1, check_every)
        self.pending: list[tuple[int, torch.Tensor]] = []
        self.smoothed: Optional[float] = None
        self.best = math.inf
        self.last_loss = math.nan

    def update(self, step: int, loss: torch.Tensor) -> None:
        """Queue this step's loss; every ``check_every`` steps, test the queued ones."""
        self.pending.append((step, loss.detach().float().reshape(())))
        if len(self.pending) >= self.check_every:
            self.check()

    def check(self) -> None:
        """Test the queued losses now (one host read); raises ``TrainingCollapsed``."""
        if not self.pending:
            return
        values = torch.stack([loss for _, loss in self.pending]).cpu().tolist()
        steps = [step for step, _ in self.pending]
        self.pending = []
        for step, value in zip(steps, values):
            if not math.isfinite(value):
                raise TrainingCollapsed(step, f"non-finite loss ({value})")
            self.last_loss = value
            self.smoothed = value if self.smoothed is None else (
                self.ema * self.smoothed + (1 - self.ema) * value)
            if step >= self.min_steps and self.smoothed > self.loss_multiple * self.best:
                raise TrainingCollapsed(step, f"loss diverged: smoothed {self.smoothed:.4g} > "
                                              f"{self.loss_multiple} x minimum {self.best:.4g}")
            self.best = min(self.best, self.smoothed)

    def state_dict(self) -> dict:
        return {"smoothed": self.smoothed, "best": self.best}

    def load_state_dict(self, state: dict) -> None:
        self.smoothed, self.best = state["smoothed"], state["best"]


class RunDirectory:
    """The files of one run; only the main process (rank 0) writes."""

    def __init__(self, path: Path, writer: bool = True):
        self.path = Path(path)
        self.writer = writer
        if writer:
            self.path.mkdir(parents=True, exist_ok=True)

    @property
    def result_path(self) -> Path:
        return self.path / RESULT_FILE

    def finished(self) -> Optional[dict]:
        """The run's result if it has one (it ended, ok or FAIL), else None."""
        return json.loads(self.result_path.read_text()) if self.result_path.exists() else None

    def begin(self, resolved_yaml: str, resuming: bool) -> Optional[dict]:
        """Start the run, or check that a resume continues it; returns the stored result of
        a run that has ended (a resume or a requeue after the end: the caller does nothing).

        A fresh run writes ``config.yaml``. A resume writes nothing: it is refused, listing
        the keys, if its configuration differs from the run's ``config.yaml``, whether the
        run is still to finish or has finished (the changed options would be dropped).
        """
        result = self.finished()
        if resuming or result is not None:
            differing = config_differences(
                with_optimizer(yaml.safe_load((self.path / CONFIG_FILE).read_text())),
                yaml.safe_load(resolved_yaml))
            if differing:
                raise ValueError(
                    f"refusing to resume {self.path}: these options differ from its {CONFIG_FILE}: "
                    f"{', '.join(differing)}. Resume with the run's own options (its config.yaml), "
                    "or start a new run without resume=")
        if result is not None:
            if self.writer:
                print(f"{self.path} has finished (status {result['status']}); nothing to do, "
                      "its records are left as they are")
            return result
        if not resuming and self.writer:
            (self.path / CONFIG_FILE).write_text(resolved_yaml)
        return None

    def log(self, **metrics: Any) -> None:
        self.append_row(metrics_row(**metrics))

    def append_row(self, row: str) -> None:
        """Append one line (``metrics_row``) to ``metrics.jsonl``."""
        if self.writer:
            with open(self.path / METRICS_FILE, "a") as f:
                f.write(row)

    def restore_epochs(self, epochs: int, row: Optional[str]) -> None:
        """Make the records those of the first ``epochs`` epochs, the ones the checkpoint
        covers, before a resume runs the next: ``metrics.jsonl`` loses the rows of later
        epochs (an epoch killed after its row) and a torn last line, and gains epoch
        ``epochs``'s ``row`` (kept in its checkpoint) when a kill came between the checkpoint
        and the row; ``landscape.jsonl`` loses the rows of later epochs (and a torn last line);
        ``stats/`` and ``gns/`` lose the files of later epochs."""
        if not self.writer:
            return
        for name in (METRICS_FILE, LANDSCAPE_FILE):
            path = self.path / name
            lines = path.read_text().splitlines(keepends=True) if path.exists() else []
            kept = [line for line in lines if _row_epoch(line, path) <= epochs]
            if name == METRICS_FILE and row is not None and not any(
                    _row_epoch(line, path) == epochs for line in kept):
                kept.append(row)
            if kept != lines:
                tmp = path.with_suffix(".tmp")
                tmp.write_text("".join(kept))
                os.replace(tmp, path)
        for folder in EPOCH_FOLDERS:
            for record in (self.path / folder).glob("epoch_*.pt"):
                if int(record.stem.split("_")[1]) > epochs:
                    record.unlink()

    def write_result(self, *, status: str, metrics: dict, meta: dict,
                     fail: Optional[TrainingCollapsed] = None) -> dict:
        if status == "ok" and at_chance(metrics, meta.get("chance")):
            status = "chance"
            if self.writer:
                print(f"chance: {meta['chance']['metric']} {metrics[meta['chance']['metric']]:.4g} "
                      f"is no better than learning nothing ({meta['chance']['rule']})")
        result = {"status": status, **meta, "metrics": metrics,
                  "fail_step": fail.step if fail else None,
                  "fail_reason": fail.reason if fail else None,
                  "git_commit": git_commit(), "host": platform.node(),
                  "torch": torch.__version__, "finished": time.strftime("%Y-%m-%dT%H:%M:%S")}
        if self.writer:
            tmp = self.result_path.with_suffix(".tmp")
            tmp.write_text(json.dumps(result, indent=2))
            os.replace(tmp, self.result_path)
        return result


def metrics_row(**metrics: Any) -> str:
    """One line of ``metrics.jsonl``: the metrics and when they were written."""
    return json.dumps({"time": time.time(), **metrics}) + "\n"


def _row_epoch(line: str, path: Path) -> float:
    """The epoch of a ``metrics.jsonl`` line; a torn line (a kill while it was written, so
    the last) counts as past every epoch."""
    try:
        return json.loads(line)["epoch"]
    except json.JSONDecodeError:
        if not line.endswith("\n"):
            return math.inf
        raise ValueError(f"{path}: a damaged line that is not the last ({line[:80]!r}); "
                         "remove it, or start the run again") from None


def chance_rule(metric: str, threshold: float, rule: str, lower_is_better: bool = False) -> dict:
    """``result.json``'s ``chance`` entry (pass it to ``run_meta``): a run whose final
    ``metric`` is at or beyond ``threshold`` (``rule`` says how that was set) learned nothing
    and ends with status ``chance``, shown apart from the mean of the runs that learned."""
    return {"metric": metric, "threshold": float(threshold), "lower_is_better": lower_is_better,
            "rule": rule}


DETECTION_CHANCE = chance_rule("bbox_AP", 1.0, "box AP <= 1 (a detector that learned nothing scores 0)")
TRANSLATION_CHANCE = chance_rule("bleu", 1.0, "BLEU <= 1 (a model that learned nothing scores about 0)")


def at_chance(metrics: dict, chance: Optional[dict]) -> bool:
    """Whether ``metrics`` is no better than the ``chance_rule`` entry ``chance`` (a
    non-finite metric learned nothing either)."""
    if not chance or chance["metric"] not in metrics:
        return False
    value = metrics[chance["metric"]]
    if not math.isfinite(value):
        return True
    return value >= chance["threshold"] if chance["lower_is_better"] else value <= chance["threshold"]


def rejected_steps(state_dict: dict) -> dict:
    """``{"rejected_steps": {"total": n, "layers": {layer: n}}}`` from the norms'
    ``num_rejected`` buffers (training steps whose batch or gradient a norm refused)."""
    layers = {key[: -len(".num_rejected")]: int(value) for key, value in state_dict.items()
              if key.endswith(".num_rejected") and int(value) > 0}
    return {"rejected_steps": {"total": sum(layers.values()), "layers": layers}}


def record_collapse(run: RunDirectory, collapse: TrainingCollapsed, metrics: dict, meta: dict) -> dict:
    """Write (and announce) the FAIL result of a run that collapsed; returns it."""
    if run.writer:
        print(f"FAIL: {collapse}")
    return run.write_result(status="FAIL", metrics=metrics, meta={**meta, "steps": collapse.step},
                            fail=collapse)


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


def write_scale_invariance(run_dir: Path, model: torch.nn.Module,
                           outputs: Callable[[torch.nn.Module], Any], *, examples: int,
                           seed: int) -> dict:
    """``{"scale_invariant": record}`` (``record_scale_invariance=true``): the weights ``model``
    is exactly scale-invariant in (``unnorm.scale_invariance`` of ``outputs``, what the loss
    reads of a float64 copy on ``examples`` training examples), with ``examples`` and
    ``seconds``, kept in ``run_dir``'s ``scale_invariance.json`` for a resume to read
    (``recorded_scale_invariance``). Every task's trainer calls it once, on rank 0, before the
    first update; with no trainable matrix (``train_only=norm``) it records none."""
    started = time.time()
    kinds = (unnorm.scale_invariance(model, outputs, seed=seed)
             if any(p.requires_grad and p.ndim >= 2 for p in model.parameters()) else {})
    record = {**unnorm.invariance_record(kinds), "examples": examples,
              "seconds": round(time.time() - started, 2)}
    path = Path(run_dir) / SCALE_INVARIANCE_FILE
    temporary = path.with_suffix(".tmp")
    temporary.write_text(json.dumps(record, indent=2))
    os.replace(temporary, path)
    return {"scale_invariant": record}


def recorded_scale_invariance(run_dir: Path) -> dict:
    """``{"scale_invariant": record}`` as ``write_scale_invariance`` kept it in ``run_dir``;
    empty where the run has none."""
    path = Path(run_dir) / SCALE_INVARIANCE_FILE
    return {"scale_invariant": json.loads(path.read_text())} if path.exists() else {}


def run_meta(cfg: DictConfig, task: str, world_size: int, run_dir: Path, **extra) -> dict:
    """The part of ``result.json`` every task writes alike (what ran, where, on how many
    processes); ``extra`` adds the task's own facts."""
    return {"task": task, "exp": cfg.exp_name, "model": cfg.model.name, "data": cfg.data.name,
            "norm": cfg.norm.name, "norm_options": norm_kwargs(cfg.norm), "seed": cfg.seed,
            "scale": cfg.scale.name, **extra, "world_size": world_size, "run_dir": str(run_dir)}


def run_logger(cfg: DictConfig, out_dir: Path, enabled: bool = True):
    """The run's experiment logger (wandb offline by default), named after the run."""
    return make_logger(cfg.logger, out_dir, OmegaConf.to_container(cfg, resolve=True),
                       name=f"{cfg.exp_name}-s{cfg.seed}", enabled=enabled)
