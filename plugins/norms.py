"""A run's norm config as ``unnorm.build_norm`` options, shared by every framework's adapter.

A norm config is ``name`` plus the norm's options, except options given relative to the
run's length, which each trainer resolves once it knows how many steps the run takes:
``decay_end`` (PRepBN) sets ``decay_iters`` so that the LayerNorm-to-RepBN hand-over ends at
that fraction of training, when ``decay_iters`` is null. ``trainer_norm_options`` reads a
norm's options as the trainers do, for a model built outside a run (``unnorm.swap_norms``).
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Mapping, Optional

from omegaconf import DictConfig, OmegaConf

RUN_LENGTH_KEYS = ("decay_end",)  # resolved by fit_norm_to_run, not build_norm options
CONFIGS = Path(__file__).resolve().parents[1] / "configs"


def norm_kwargs(norm_cfg: Mapping) -> dict:
    """The ``build_norm`` options of a norm config (everything but its name)."""
    if not isinstance(norm_cfg, dict):
        norm_cfg = OmegaConf.to_container(norm_cfg, resolve=True)
    return {key: value for key, value in norm_cfg.items()
            if key != "name" and key not in RUN_LENGTH_KEYS}


def follows_run_length(norm_cfg: Mapping) -> bool:
    """Whether an option of the norm config is set from the run's length (PRepBN's
    ``decay_iters``, null, from ``decay_end``)."""
    return "decay_end" in norm_cfg and norm_cfg.get("decay_iters") is None


def groups_by_heads(norm_cfg: Mapping) -> bool:
    """PN with layer-scale whose ``group_num`` is left to the model (null)."""
    return norm_cfg["name"] == "pn_ls" and norm_kwargs(norm_cfg).get("group_num") is None


def fit_norm_to_run(cfg: DictConfig, total_steps: int) -> DictConfig:
    """``cfg`` with the norm's run-length options resolved for a run of ``total_steps``."""
    norm = cfg.norm
    if not follows_run_length(norm):
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


def trainer_norm_options(name: str, total_steps: Optional[int] = None, **given) -> dict:
    """The ``build_norm`` options the trainers give norm ``name`` at the paper's scale, for
    ``unnorm.swap_norms(model, name, **trainer_norm_options(name))`` (left unset, an option is
    the module's default, which for un, mabn, pn_ls and prepbn is not the trainers').

    Read as a run reads them: ``configs/train.yaml`` composed with ``norm=<name>`` and ``given``
    as ``norm.<option>=<value>`` on the command line, then ``plugins.scale.effective_config``
    and ``norm_kwargs``. Step counts are the yaml's, the paper's: ``scale=cpu`` scales them to
    each run's schedule, which a model outside a run has not. Options a run sets from itself
    are refused unless given: PRepBN's ``decay_iters`` follows the run's length (pass
    ``total_steps``, the steps the model will train, or ``decay_iters``), PN-LS's ``group_num``
    each block's attention heads (pass ``group_num``). An experiment may set options of its own
    (translation's UN turns ``outlier_filtration`` off: configs/exp/).
    """
    from hydra import compose, initialize_config_dir

    from plugins.scale import effective_config
    norms = sorted(path.stem for path in (CONFIGS / "norm").glob("*.yaml"))
    if name not in norms:
        raise ValueError(f"no trainer config for norm {name!r} (configs/norm/); choose one of "
                         f"{', '.join(norms)}")
    overrides = [f"norm={name}"] + [f"norm.{key}={json.dumps(value)}" for key, value in given.items()]
    with initialize_config_dir(config_dir=str(CONFIGS), version_base="1.3"):
        cfg = effective_config(compose("train", overrides=overrides), overrides)
    if follows_run_length(cfg.norm) and total_steps is None:
        raise ValueError(f"{name}'s decay_iters follows the run's length (decay_end "
                         f"{cfg.norm.decay_end} of training): pass total_steps, the steps the "
                         "model will train, or decay_iters")
    if groups_by_heads(cfg.norm):
        raise ValueError("pn_ls's group_num is null in its config: the trainers take each block's "
                         "attention heads from their own models; pass group_num (a divisor of "
                         "every norm's width)")
    if total_steps is not None:
        cfg = fit_norm_to_run(cfg, total_steps)
    return norm_kwargs(cfg.norm)
