"""The ``scale`` switch shared by every task: the paper's setting, or one that runs on a CPU."""
from __future__ import annotations

from pathlib import Path

from omegaconf import DictConfig, OmegaConf

CONFIGS = Path(__file__).resolve().parents[1] / "configs"


def effective_config(cfg: DictConfig) -> DictConfig:
    """Apply ``scale`` (e.g. cpu) to a copy of the config: the model's small variant, the
    embedded data, a short schedule and shrunk norm warm-ups."""
    cfg = cfg.copy()
    scale = cfg.scale
    was_struct = OmegaConf.is_struct(cfg)
    OmegaConf.set_struct(cfg, False)
    if scale.name != "full":
        cfg.model = OmegaConf.merge(cfg.model, cfg.model.get(scale.name) or {})
        cfg.recipe = OmegaConf.merge(cfg.recipe, cfg.recipe.get(scale.name) or {})
    small_data = (scale.data or {}).get(cfg.task)
    if small_data and cfg.data.name != small_data:  # chosen explicitly: kept with its overrides
        cfg.data = OmegaConf.merge(cfg.data, OmegaConf.load(CONFIGS / "data" / f"{small_data}.yaml"))
    if scale.norm_warmup_iters is not None and "warmup_iters" in cfg.norm:
        cfg.norm.warmup_iters = scale.norm_warmup_iters
    OmegaConf.set_struct(cfg, was_struct)
    return cfg
