"""The ``scale`` switch shared by every task: the paper's setting, or one that runs on a CPU."""
from __future__ import annotations

import logging
from types import MappingProxyType
from typing import Mapping, Optional, Sequence

from omegaconf import DictConfig, OmegaConf

from plugins.model_options import check_model_options
from plugins.optim import check_clipping
from unnorm.base import forgotten_warmup

NORM_STEP_OPTIONS = ("warmup_iters", "compensation_start")  # norm options counted in steps
log = logging.getLogger(__name__)
_ABSENT = object()


#: what a valid range in ``check_ranges`` may say, and its test
RANGE_TESTS = {"> 0": lambda v: v > 0, ">= 0": lambda v: v >= 0, ">= 1": lambda v: v >= 1,
               "> 1": lambda v: v > 1, "in [0, 1]": lambda v: 0 <= v <= 1,
               "in [0, 1)": lambda v: 0 <= v < 1, "in (0, 1)": lambda v: 0 < v < 1}

#: options every task reads, with their valid ranges (``check_ranges``)
COMMON_RANGES = {"lr_multiple": "> 0", "scale.num_workers": ">= 0",
                 "scale.warmup_init_weight": "null or in (0, 1)",
                 "scale.max_steps_per_epoch": "null or >= 1", "collapse.loss_multiple": "> 1",
                 "collapse.ema": "in [0, 1)", "collapse.min_steps": ">= 0",
                 "collapse.check_every": ">= 1", "recipe.agc": "null or > 0"}


def check_ranges(cfg: DictConfig, ranges: Mapping[str, str]) -> None:
    """Refuse at the start, by name, an option outside its valid range (``{"recipe.lr":
    "> 0"}``; ``"null or ..."`` allows null), before it fails deep in other code (a zero
    division, a scheduler's assertion) or trains without a word."""
    for option, valid in ranges.items():
        value = OmegaConf.select(cfg, option)
        rule = valid.removeprefix("null or ")
        if value is None and rule != valid:
            continue
        number = isinstance(value, (int, float)) and not isinstance(value, bool)
        if not number or not RANGE_TESTS[rule](value):
            raise ValueError(f"{option} must be {valid}, got {value!r}")


def effective_config(cfg: DictConfig, overrides: Sequence[str] = (),
                     ranges: Mapping[str, str] = MappingProxyType({})) -> DictConfig:
    """The config that runs, from the one Hydra composed. Hydra has merged the scale's
    variants (configs/scale/<group>/) and the command line; what is computed from the paper's
    setting stays here: at ``scale=cpu`` the norms' step counts and groups, against the
    paper's model, data and recipe that Hydra composed under ``paper`` (the run drops them:
    ``scale.norm_step_factor`` and the norm options record the result in ``config.yaml``). A
    norm option the command line set (``overrides``, Hydra's ``key=value`` strings) is kept
    as given. The values that will run are checked against ``ranges`` and ``COMMON_RANGES``
    (``check_ranges``) before anything computes with them, and a layer option the task does
    not have (``check_model_options``) or clipping it cannot do (``check_clipping``) is
    refused."""
    cfg = cfg.copy()
    was_struct = OmegaConf.is_struct(cfg)
    OmegaConf.set_struct(cfg, False)
    if "paper" not in cfg:
        raise ValueError("this config has no `paper` (the paper's model, data and recipe that "
                         "configs/train.yaml composes): the scale is applied once, to a config "
                         "Hydra composed from configs/train.yaml")
    paper = OmegaConf.create({"task": cfg.task, **cfg.pop("paper")})
    scale = cfg.scale
    explicit = command_line_values(cfg, overrides)
    check_ranges(cfg, {**COMMON_RANGES, **ranges})
    check_model_options(cfg)
    check_clipping(cfg)
    computed = {}
    if scale.scale_norm_steps:  # against the schedule that runs, command-line values included
        factor = lr_warmup_steps(cfg, scale.get("max_steps_per_epoch")) / lr_warmup_steps(paper)
        cfg.scale.norm_step_factor = factor
        for option in NORM_STEP_OPTIONS:
            if cfg.norm.get(option) and f"norm.{option}" not in explicit:
                computed[option] = max(1, round(cfg.norm[option] * factor))
        if computed.get("warmup_iters"):
            computed["warmup_iters"] = warmup_floor({**cfg.norm, **computed}, cfg.norm.warmup_iters,
                                                    scale.get("warmup_init_weight"))
    if scale.get("scale_norm_groups") and cfg.norm.get("groups") and "norm.groups" not in explicit:
        computed["groups"] = scaled_groups(cfg.norm.groups, _width(cfg.model), _width(paper.model))
    if computed:
        log.info("scale=%s computed from the paper's setting: %s", scale.name, ", ".join(
            f"norm.{key} {cfg.norm[key]} -> {value}" for key, value in computed.items()))
        cfg.norm.update(computed)
    OmegaConf.set_struct(cfg, was_struct)
    return cfg


def warmup_floor(norm: Mapping, full_warmup: int, init_weight: Optional[float]) -> int:
    """A norm's scaled warm-up (``norm.warmup_iters``: the phase after which its running
    averages replace the batch's statistics), lengthened until each of its averages (every
    ``momentum*`` option) keeps at most ``init_weight`` of its initial value, as at full scale
    (UN's 4000 steps against 44 at alpha 0.9), and never past ``full_warmup``, the paper's own
    count. ``init_weight`` None: no floor (the CPU rule before it)."""
    momenta = [value for key, value in norm.items() if str(key).startswith("momentum")]
    if init_weight is None or not momenta:
        return norm["warmup_iters"]
    return forgotten_warmup(norm["warmup_iters"], full_warmup, momenta, init_weight)


def scaled_groups(groups: int, width: int, full_width: int) -> int:
    """A grouped norm's ``groups`` (BCN's, EvoNorm-S0's) for a model ``width`` channels wide
    whose full-scale model is ``full_width``: the full scale's channels a group kept (the
    release's 32 groups are 16 channels at the LM's 512, so 4 at its CPU width 64, not 32
    groups of two, where a group's standardisation is a sign); at least one group."""
    return max(1, round(groups * width / full_width))


def _width(model: DictConfig) -> int:
    width = model.get("width")
    if width is None:
        raise ValueError(f"model {model.get('name')!r} has no `width` (the channels its first "
                         "norms see), which scale.scale_norm_groups scales a norm's groups by: "
                         "add it to configs/model/, or set norm.groups on the command line")
    return width


def norm_steps_per_update(cfg: DictConfig) -> int:
    """Norm steps (micro-batches: training forward/backward passes of one replica, the unit
    the norms count in, as the releases do) per optimizer update: the gradient accumulation
    (fairseq's ``update_freq``). Replicas do not change it: each counts its own micro-batches."""
    if cfg.task == "translation":
        update_freq = cfg.recipe.train.get("update_freq") or 1
        if not isinstance(update_freq, int) or update_freq < 1:
            raise ValueError(f"recipe.train.update_freq must be an int >= 1 (micro-batches per "
                             f"update), got {update_freq!r}")
        return update_freq
    if cfg.task == "language_modelling" or (cfg.task == "classification"
                                            and cfg.recipe.get("micro_batch_size")):
        return micro_batches_per_update(cfg.recipe, world_size=1)
    return 1


def micro_batches_per_update(recipe: DictConfig, world_size: int) -> int:
    """Gradient accumulation (language modelling; micro-batch classification): ``batch_size``
    sequences or images per update over every replica, ``micro_batch_size`` per
    forward/backward of one."""
    per_replica, rest = divmod(recipe.batch_size, recipe.micro_batch_size * world_size)
    if rest or per_replica < 1:
        raise ValueError(f"recipe.batch_size {recipe.batch_size} is not a multiple of "
                         f"recipe.micro_batch_size {recipe.micro_batch_size} x {world_size} "
                         "replica(s); set recipe.micro_batch_size so that it is")
    return per_replica


def lr_warmup_steps(cfg: DictConfig, max_steps_per_epoch: Optional[int] = None) -> float:
    """The learning-rate warm-up of ``cfg`` in norm steps (micro-batches), or its whole
    length for a recipe without warm-up (CIFAR fine-tuning): the yardstick the norms' own step
    counts (warm-up, compensation start) are scaled by, so that at CPU scale each sits
    against the learning-rate schedule where the paper's does. Optimizer updates are
    converted with ``norm_steps_per_update`` (WMT14's 10k warm-up updates at update_freq 16
    are 160k norm steps). ``max_steps_per_epoch`` caps a classification epoch as the run's
    ``scale.max_steps_per_epoch`` does (the trainer's schedule counts the capped epochs)."""
    recipe = cfg.recipe
    if cfg.task == "translation":
        warmup, length = recipe.train.warmup_updates, recipe.train.max_update
    elif cfg.task in ("language_modelling", "text_classification"):
        warmup, length = recipe.warmup_steps, recipe.max_steps
    elif cfg.task == "detection":
        per_epoch = cfg.data.num_train / recipe.batch_size
        warmup, length = recipe.warmup_iters, recipe.epochs * per_epoch
    else:
        per_epoch = cfg.data.num_train // recipe.batch_size  # full batches, as epoch_plan
        per_epoch = min(per_epoch, max_steps_per_epoch or per_epoch)
        warmup, length = recipe.warmup_epochs * per_epoch, recipe.epochs * per_epoch
    steps = (warmup or length) * norm_steps_per_update(cfg)
    if not steps:
        raise ValueError(f"{cfg.recipe.name}: no learning-rate warm-up and no run length to "
                         "scale the norms' step counts by; set scale.scale_norm_steps=false")
    return float(steps)


def command_line_values(cfg: DictConfig, overrides: Sequence[str]) -> list[str]:
    """The dotted keys of ``overrides`` that set a value of ``cfg`` (not a config group such
    as ``norm=un`` or ``+exp=...``, not a deletion, not Hydra's own settings)."""
    keys = []
    for item in overrides:
        key, sep, _ = item.partition("=")
        key = key.lstrip("+")
        if not sep or key.startswith(("~", "hydra.")):
            continue
        value = OmegaConf.select(cfg, key, default=_ABSENT)
        if value is not _ABSENT and not isinstance(value, DictConfig):
            keys.append(key)
    return keys
