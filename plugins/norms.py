"""A run's norm config as ``unnorm.build_norm`` options, shared by every framework's adapter.

A norm config is ``name`` plus the norm's options, except options given relative to the
run's length, which each trainer resolves once it knows how many steps the run takes:
``decay_end`` (PRepBN) sets ``decay_iters`` so that the LayerNorm-to-RepBN hand-over ends at
that fraction of training, when ``decay_iters`` is null.
"""
from __future__ import annotations

from typing import Mapping

from omegaconf import DictConfig, OmegaConf

RUN_LENGTH_KEYS = ("decay_end",)  # resolved by fit_norm_to_run, not build_norm options


def norm_kwargs(norm_cfg: Mapping) -> dict:
    """The ``build_norm`` options of a norm config (everything but its name)."""
    if not isinstance(norm_cfg, dict):
        norm_cfg = OmegaConf.to_container(norm_cfg, resolve=True)
    return {key: value for key, value in norm_cfg.items()
            if key != "name" and key not in RUN_LENGTH_KEYS}


def fit_norm_to_run(cfg: DictConfig, total_steps: int) -> DictConfig:
    """``cfg`` with the norm's run-length options resolved for a run of ``total_steps``."""
    norm = cfg.norm
    if "decay_end" not in norm or norm.get("decay_iters") is not None:
        return cfg
    end = norm.decay_end
    if not 0 < end <= 1:
        raise ValueError(f"norm.decay_end must be in (0, 1] (the fraction of training at which "
                         f"the hand-over ends), got {end}")
    if total_steps < 1:
        raise ValueError("the run's length is unknown: set norm.decay_iters explicitly")
    cfg = cfg.copy()
    cfg.norm.decay_iters = max(round(end * total_steps) - norm.get("warmup_iters", 0), 0)
    return cfg
