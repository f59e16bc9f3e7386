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

``UpdateRecord`` is what ``record_updates=true`` writes per epoch: each group's effective step
and how many updates the projection acted on (docs/vision.md).

Gradient clipping, of the unscaled gradients before the step (``clip_gradients``):
``recipe.clip_grad`` clips their global norm (torch's ``clip_grad_norm_``); ``recipe.agc``
clips each output unit's gradient to that fraction of its weight's norm (NF-Nets' Adaptive
Gradient Clipping, Brock et al. 2021: timm's ``adaptive_clip_grad``, eps 1e-3), the
normalizer-free baseline's (docs/vision.md). One or neither: both set is refused
(``check_clipping``); in translation fairseq's trainer clips (``plugins.fairseq.train``:
``recipe.agc`` there, or ``recipe.train.clip_norm``).
"""
from __future__ import annotations

import math
import sys
from contextlib import contextmanager
from typing import Any, Iterable, Iterator, Mapping, Optional

import adamp
import torch
import torch.distributed as dist
import torch.nn.functional as F
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


class UpdateRecord:
    """Per epoch, what ``optimizer``'s updates did (``record_updates=true``, metrics.jsonl):

    - ``param_groups``: per param group (the optimizer's order), its ``weight_decay`` and
      ``parameters`` (elements), to tell the groups apart;
    - ``effective_step``: per param group, the mean over the epoch's updates of
      ||w_after - w_before|| / ||w_before||, over the group's parameters together (the step
      a scale-invariant weight feels is this ratio, not the learning rate; an update the
      GradScaler skips counts as 0; a group whose weights are all 0 records null);
    - ``projection``: per update, on average, how many parameters AdamP/SGDP projected
      (``tensors``), by which view (``channel_view``: each output channel's radial part
      removed; ``tensor_view``: the whole tensor's) and how many output channels the channel
      view covered (``channels``); 0 for an optimizer that does not project.

    Memory: one copy of the trained weights, taken before each update. ``step()`` wraps the
    optimizer's step (its scaler's included)."""

    def __init__(self, optimizer: torch.optim.Optimizer):
        self.optimizer = optimizer
        self._site = _projection_site(optimizer)
        self._reset()

    def _reset(self) -> None:
        self.updates = 0
        self.ratios: list = [0.0] * len(self.optimizer.param_groups)  # device scalars: no sync
        self.projected = {"tensors": 0, "channel_view": 0, "tensor_view": 0, "channels": 0}

    @contextmanager
    def step(self) -> Iterator[None]:
        """Measure the update made inside the block."""
        groups = [[p for p in group["params"] if p.requires_grad]
                  for group in self.optimizer.param_groups]
        sharded = any(hasattr(p, "to_local") for params in groups for p in params)
        before = [[_local(p).detach().clone() for p in params] for params in groups]
        norms = [_group_norm(old, sharded) if old else None for old in before]
        with self._counting():
            yield
        for index, (params, old, norm) in enumerate(zip(groups, before, norms)):
            if params:
                torch._foreach_sub_(old, [_local(p).detach() for p in params])
                self.ratios[index] = self.ratios[index] + _group_norm(old, sharded) / norm
        self.updates += 1

    @contextmanager
    def _counting(self) -> Iterator[None]:
        """The optimizer's projection, counted while the block runs (then put back)."""
        if self._site is None:
            yield
            return
        owner, name = self._site
        projection = getattr(owner, name)

        def counted(p, grad, perturb, delta, wd_ratio, eps, *args):
            view = projected_view(p, grad, delta, eps)
            if view is not None:
                self.projected["tensors"] += 1
                self.projected[f"{view}_view"] += 1
                self.projected["channels"] += p.shape[0] if view == "channel" else 0
            return projection(p, grad, perturb, delta, wd_ratio, eps, *args)

        setattr(owner, name, counted)
        try:
            yield
        finally:
            if owner is self.optimizer:
                delattr(owner, name)  # the class's method again
            else:
                setattr(owner, name, projection)

    def flush(self) -> dict:
        """The epoch's record (the mean over its updates), then a new epoch."""
        updates = max(self.updates, 1)
        ratios = [float(total) / updates for total in self.ratios]
        ratios = [value if math.isfinite(value) else None for value in ratios]
        record = {"param_groups": [{"weight_decay": group["weight_decay"],
                                    "parameters": sum(p.numel() for p in group["params"])}
                                   for group in self.optimizer.param_groups],
                  "effective_step": ratios,
                  "projection": {key: count / updates for key, count in self.projected.items()}}
        self._reset()
        return record


def projected_view(p: torch.Tensor, grad: torch.Tensor, delta: float, eps: float) -> Optional[str]:
    """The view in which AdamP and SGDP project ``p``'s update (``"channel"``, ``"tensor"``)
    or None: their test, the first view in which every |cos(grad, p)| < delta / sqrt(width)."""
    for view, shape in (("channel", (p.shape[0], -1)), ("tensor", (1, -1))):
        weight, gradient = p.reshape(shape), grad.reshape(shape)
        cosine = F.cosine_similarity(gradient, weight, dim=1, eps=eps).abs()
        if cosine.max() < delta / math.sqrt(weight.shape[1]):
            return view
    return None


def _projection_site(optimizer) -> Optional[tuple[Any, str]]:
    """Where ``optimizer`` looks up its projection: the release's classes call their own
    method ``_projection``, timm's AdamP and SGDP their module's function ``projection``."""
    if isinstance(optimizer, (adamp.AdamP, adamp.SGDP)):
        return optimizer, "_projection"
    module = sys.modules[type(optimizer).__module__]
    return (module, "projection") if type(optimizer).__module__.startswith("timm.optim.") \
        and callable(getattr(module, "projection", None)) else None


def _local(param: torch.Tensor) -> torch.Tensor:
    """A sharded (FSDP2) parameter's local shard; any other tensor itself."""
    return param.to_local() if hasattr(param, "to_local") else param


def _group_norm(tensors: list[torch.Tensor], sharded: bool) -> torch.Tensor:
    """The 2-norm of the tensors together (over every rank's shards of a sharded model)."""
    squares = torch.stack([norm.double().square() for norm in torch._foreach_norm(tensors)]).sum()
    if sharded:
        dist.all_reduce(squares)
    return squares.sqrt()


def check_clipping(cfg: DictConfig) -> None:
    """Refuse ``recipe.agc`` together with another clipping of the same step:
    ``recipe.clip_grad``, or translation's ``recipe.train.clip_norm`` (fairseq's)."""
    recipe = cfg.recipe
    agc = recipe.get("agc")
    if agc is None:
        return
    if cfg.task == "translation":
        if recipe.train.get("clip_norm"):
            raise ValueError(f"recipe.agc={agc} and recipe.train.clip_norm="
                             f"{recipe.train.clip_norm} both clip the gradients: choose one, "
                             "recipe.train.clip_norm=0.0 for adaptive clipping (the "
                             "normalizer-free baseline) or recipe.agc=null")
        return
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
