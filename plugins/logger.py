"""Experiment loggers: wandb (offline by default) or none; metrics.jsonl is always written."""
from __future__ import annotations

from pathlib import Path
from typing import Mapping


class NullLogger:
    def log(self, metrics: Mapping, step: int) -> None:
        pass

    def finish(self) -> None:
        pass


class WandbLogger:
    def __init__(self, cfg, out_dir: Path, config: dict, name: str):
        import wandb

        self._wandb = wandb
        self.run = wandb.init(project=cfg.project, entity=cfg.entity, mode=cfg.mode, name=name,
                              dir=str(out_dir), config=config, id=_run_id(out_dir), resume="allow")

    def log(self, metrics: Mapping, step: int) -> None:
        self.run.log(dict(metrics), step=step)

    def finish(self) -> None:
        self.run.finish()


def _run_id(out_dir: Path) -> str:
    """One wandb run per run directory, so a resumed run continues the same wandb run."""
    import hashlib

    return hashlib.sha1(str(Path(out_dir).resolve()).encode()).hexdigest()[:16]


def make_logger(cfg, out_dir: Path, config: dict, name: str, enabled: bool = True):
    if not enabled or cfg.name == "none":
        return NullLogger()
    if cfg.name == "wandb":
        return WandbLogger(cfg, out_dir, config, name)
    raise ValueError(f"unknown logger {cfg.name!r}; choose wandb or none")
