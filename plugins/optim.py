"""``optimizer=<name>`` (configs/optimizer): the algorithm and its options, for every task.

The recipe keeps what it schedules (lr, weight decay); the optimizer config names the
algorithm and states every option it takes. Classification, both detection backends and the
language model build it with timm's ``create_optimizer_v2``, passing each option explicitly so
that no default of timm's factory names decides (its ``adamp`` sets wd_ratio 0.01 and nesterov,
its ``sgd`` nesterov); translation hands it to fairseq's registry (``plugins.fairseq.launcher``).

AdamP and SGDP are the release's (clovaai/AdamP, PyPI ``adamp``; Heo et al., ICLR 2021), in
every task. timm's AdamP computes the release's exactly, so timm's runs it; timm's SGDP does
not: it copies the momentum buffer before projecting the step, where the release (without
Nesterov) projects the buffer itself, so their weights part once a projection acts. The
release's SGDP is therefore registered with timm's factory (``sgdp-release``) and runs
``optimizer=sgdp`` (tests/test_optim.py holds both to the release).

Gradient clipping, of the unscaled gradients before the step (``clip_gradients``):
``recipe.clip_grad`` clips their global norm (torch's ``clip_grad_norm_``); ``recipe.agc``
clips each output unit's gradient to that fraction of its weight's norm (NF-Nets' Adaptive
Gradient Clipping, Brock et al. 2021: timm's ``adaptive_clip_grad``, eps 1e-3), the
normalizer-free baseline's (docs/vision.md). One or neither: both set is refused
(``check_clipping``), and so is ``recipe.agc`` in translation, which clips in fairseq's
trainer.
"""
from __future__ import annotations

from typing import Any, Iterable, Mapping, Optional

import adamp
import torch
from omegaconf import DictConfig, OmegaConf
from timm.optim import OptimInfo, create_optimizer_v2
from timm.optim._optim_factory import default_registry
from timm.utils.agc import adaptive_clip_grad

default_registry.register(OptimInfo(
    name="sgdp-release", opt_class=adamp.SGDP, has_momentum=True,
    description="SGDP as clovaai/AdamP releases it (the momentum buffer projected in place)"))

#: timm's factory name of an optimizer whose own name is not it
TIMM_NAMES = {"sgdp": "sgdp-release"}
#: each optimizer's options, as its config file states them
OPTIONS = {"adamw": ("betas", "eps"),
           "sgd": ("momentum", "nesterov"),
           "adamp": ("betas", "eps", "delta", "wd_ratio", "nesterov"),
           "sgdp": ("momentum", "nesterov", "eps", "delta", "wd_ratio")}


def optimizer_options(optimizer: DictConfig | Mapping) -> tuple[str, dict[str, Any]]:
    """``(name, options)`` of a run's ``optimizer`` node; an unknown name, or an option the
    optimizer lacks or does not take, is refused (none is silently left to a default)."""
    options = (OmegaConf.to_container(optimizer, resolve=True) if isinstance(optimizer, DictConfig)
               else dict(optimizer))
    name = options.pop("name", None)
    if name not in OPTIONS:
        raise ValueError(f"optimizer.name={name!r}: choose optimizer={'|'.join(OPTIONS)} "
                         "(configs/optimizer)")
    extra = sorted(set(options) - set(OPTIONS[name]))
    missing = [key for key in OPTIONS[name] if key not in options]
    if extra or missing:
        raise ValueError(f"optimizer={name} takes {', '.join(OPTIONS[name])}"
                         + (f"; it does not take {', '.join(extra)} (drop it: "
                            f"{' '.join('~optimizer.' + key for key in extra)})" if extra else "")
                         + (f"; set {', '.join(missing)} (configs/optimizer/{name}.yaml)"
                            if missing else ""))
    if "betas" in options:
        options["betas"] = tuple(options["betas"])
    return name, options


def create_optimizer(params: Iterable, optimizer: DictConfig | Mapping, lr: float,
                     weight_decay: float):
    """timm's optimizer ``optimizer`` names, with its options explicit, over ``params`` (a
    module's parameters or param groups, whose own ``weight_decay`` wins)."""
    name, options = optimizer_options(optimizer)
    return create_optimizer_v2(params, opt=TIMM_NAMES.get(name, name), lr=lr,
                               weight_decay=weight_decay, **options)


def check_clipping(cfg: DictConfig) -> None:
    """Refuse ``recipe.agc`` together with ``recipe.clip_grad`` (two clippings of one step),
    and in translation (fairseq's trainer clips by the global norm only)."""
    recipe = cfg.recipe
    agc = recipe.get("agc")
    if agc is None:
        return
    if cfg.task == "translation":
        raise ValueError(f"recipe.agc={agc}: fairseq's trainer clips gradients by their global "
                         "norm only (recipe.train.clip_norm); drop recipe.agc for translation")
    if recipe.get("clip_grad") is not None:
        raise ValueError(f"recipe.agc={agc} and recipe.clip_grad={recipe.clip_grad} both clip the "
                         "gradients: choose one, recipe.clip_grad=null for adaptive clipping "
                         "(the normalizer-free baseline) or recipe.agc=null")


def clip_gradients(parameters, clip_grad: Optional[float], agc: Optional[float]) -> None:
    """The recipe's clipping of the (unscaled) gradients of ``parameters``: by their global
    norm (``clip_grad``), or adaptively, unit-wise (``agc``: timm's ``adaptive_clip_grad``
    with that clipping factor, on every parameter, as timm's ``--clip-mode agc`` does); None
    for neither (``check_clipping`` refuses both)."""
    if clip_grad:
        torch.nn.utils.clip_grad_norm_(parameters, clip_grad)
    elif agc:
        adaptive_clip_grad(parameters, agc)
