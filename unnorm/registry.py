"""One switch for every norm: ``build_norm(name, num_features, **options)``."""
from __future__ import annotations

import inspect
from dataclasses import dataclass, field
from typing import Callable

from torch import nn

from .base import GuardedNorm
from .bcn import BatchChannelNorm
from .dyt import DynamicTanh
from .evonorm import EvoNormB0, EvoNormS0
from .groupnorm import GroupNorm
from .mabn import MovingAverageBatchNorm
from .powernorm import PowerNorm
from .prepbn import ProgressiveRepBN
from .scalenorm import ScaleNorm
from .simple import BatchNorm, LayerNorm, NoNorm, RMSNorm
from .unified import UnifiedNorm


@dataclass(frozen=True)
class NormSpec:
    cls: type
    fixed: dict  # options the name implies (pn vs pn_ls)
    description: str
    #: options under which every phase of the norm (warm-up, full windows, compensation,
    #: outlier skips, a hand-over) comes within a few training steps: the test suite builds
    #: each norm with them (``quick_options``); none where the defaults have no phase to wait for
    quick: dict = field(default_factory=dict)


_NORMS: dict[str, NormSpec] = {
    "ln": NormSpec(LayerNorm, {}, "LayerNorm"),
    "rms": NormSpec(RMSNorm, {}, "RMSNorm"),
    "bn": NormSpec(BatchNorm, {}, "BatchNorm over batch x tokens"),
    "mabn": NormSpec(MovingAverageBatchNorm, {}, "moving-average BatchNorm",
                     {"warmup_iters": 4, "window_size": 3, "compensation_start": 6}),
    "pn": NormSpec(PowerNorm, {"layer_scale": False}, "PowerNorm without layer-scale",
                   {"warmup_iters": 4}),
    "pn_ls": NormSpec(PowerNorm, {"layer_scale": True}, "PowerNorm with layer-scale",
                      {"warmup_iters": 4, "group_num": 2}),
    "nonorm": NormSpec(NoNorm, {}, "identity"),
    "un": NormSpec(UnifiedNorm, {}, "Unified Normalization",
                   {"warmup_iters": 4, "outlier_filtration": True, "compensation_start": 6}),
    "dyt": NormSpec(DynamicTanh, {}, "Dynamic Tanh, no statistics (affine foldable)"),
    "prepbn": NormSpec(ProgressiveRepBN, {}, "LayerNorm handing over to RepBN (SLAB)",
                       {"warmup_iters": 3, "decay_iters": 6}),
    "bcn": NormSpec(BatchChannelNorm, {}, "Batch-Channel Normalization: BN, then group norm"),
    "evonorm_b0": NormSpec(EvoNormB0, {}, "EvoNorm-B0: batch and instance std, fused activation"),
    "evonorm_s0": NormSpec(EvoNormS0, {}, "EvoNorm-S0: group std, fused sigmoid activation"),
    "scalenorm": NormSpec(ScaleNorm, {}, "ScaleNorm: each position scaled to one learned L2 norm"),
    "gn": NormSpec(GroupNorm, {}, "GroupNorm: each token's (or example's) channel groups"),
}

# Arguments hosts pass to every norm; accepted whether or not the norm uses them.
_HOST_ARGS = ("device", "dtype")


def available_norms() -> list[str]:
    return list(_NORMS)


def _spec(name: str) -> NormSpec:
    if not isinstance(name, str) or name.lower() not in _NORMS:
        raise ValueError(f"unknown norm {name!r}; choose one of {', '.join(_NORMS)}")
    return _NORMS[name.lower()]


def is_offline(name: str, **options) -> bool:
    """True where inference is a fixed per-channel affine (foldable into a linear layer), for
    the norm built with ``options`` (some decide it: ``causal`` BN, EvoNorm's ``apply_act``)."""
    spec = _check_options(name, options)
    return spec.cls.offline_for(**spec.fixed, **options)


def is_foldable(name: str, **options) -> bool:
    """True where folding has something to take into a linear layer: an offline norm's whole
    inference, or DyT's affine."""
    return is_offline(name, **options) or hasattr(_spec(name).cls, "fold_parts")


def has_running_state(name: str) -> bool:
    """True where training calls update state that evaluation reads and checkpoints carry
    (running statistics, windows, step counters), guarded by the calling contract
    (``docs/core.md``, "What a training call commits")."""
    return issubclass(_spec(name).cls, GuardedNorm)


def quick_options(name: str) -> dict:
    """Options under which every phase of ``name`` comes within a few training steps (tests,
    smoke runs); ``{}`` where its defaults have no phase to wait for."""
    return dict(_spec(name).quick)


def option_names(name: str) -> list[str]:
    """The options ``build_norm(name, C, **options)`` accepts."""
    params = inspect.signature(_spec(name).cls.__init__).parameters
    return [p for p in params if p not in ("self", "num_features", *_HOST_ARGS)
            and p not in _spec(name).fixed]


def default_options(name: str) -> dict:
    """What ``build_norm`` gives each option left unset: the module's defaults (a training
    config, ``configs/norm/<name>.yaml``, may choose others; docs/core.md)."""
    params = inspect.signature(_spec(name).cls.__init__).parameters
    return {option: params[option].default for option in option_names(name)}


def _check_options(name: str, options: dict) -> NormSpec:
    spec = _spec(name)
    valid = option_names(name)
    unknown = sorted(set(options) - set(valid) - set(_HOST_ARGS))
    if unknown:
        raise ValueError(f"norm {name!r} has no option(s) {', '.join(unknown)}; "
                         f"valid options: {', '.join(valid)}")
    return spec


def build_norm(name: str, num_features: int, **options) -> nn.Module:
    """Build the norm ``name`` for ``num_features`` channels; unknown options are an error."""
    spec = _check_options(name, options)
    return spec.cls(num_features, **spec.fixed, **options)


def norm_layer(name: str, **options) -> Callable[..., nn.Module]:
    """A ``norm_layer(dim, device=..., dtype=..., eps=...)`` constructor for host frameworks.

    Option names are checked now, so a typo fails at configuration time, not mid-model. A
    function, not a ``functools.partial``: timm's ``get_norm_layer`` (ViT, ConvNeXt) unbinds
    a partial's keywords and drops its positional arguments, the norm's name among them.
    """
    _check_options(name, options)

    def layer(num_features: int, **kwargs) -> nn.Module:
        return build_norm(name, num_features, **{**options, **kwargs})
    layer.__name__ = layer.__qualname__ = f"norm_layer_{name}"
    return layer
