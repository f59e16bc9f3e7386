"""Put our norms into an existing model in place of its per-channel norms."""
from __future__ import annotations

import fnmatch
from typing import Iterable, Optional, Union

import torch
from torch import nn

from .host_norms import HostNorm, is_norm_like, read_host_norm
from .registry import build_norm, norm_layer, option_names

_LIKE_FOR_LIKE = ("ln", "rms")  # per-position norms keep the host's eps
Patterns = Optional[Union[str, Iterable[str]]]


class ChannelsFirst(nn.Module):
    """A channels-last norm applied to NCHW maps (in place of timm's LayerNorm2d, say):
    channels moved last, normalised, moved back."""

    def __init__(self, norm: nn.Module):
        super().__init__()
        self.norm = norm

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(x.movedim(1, -1)).movedim(-1, 1)


def replace_module(model: nn.Module, name: str, new: nn.Module) -> None:
    """``model.<name> = new`` for a dotted submodule name."""
    parent_name, _, child = name.rpartition(".")
    setattr(model.get_submodule(parent_name) if parent_name else model, child, new)


@torch.no_grad()
def swap_norms(model: nn.Module, name: str, *, include: Patterns = None,
               exclude: Patterns = None, **options) -> int:
    """Replace the per-channel norms of ``model`` (torch's, timm's, transformers') by ``name``.

    Recognised: torch's LayerNorm and RMSNorm (subclasses included), and any leaf module whose
    class name ends in Norm that computes a LayerNorm or RMSNorm per position, channels-last or
    NCHW, with a scale ``w`` or ``1 + w`` (``unnorm.host_norms``). Batch, instance and group
    norms are kept. ``include``/``exclude``: fnmatch patterns of module names (``"*.norm1"``,
    ``"encoder.*"``) choosing which norms to swap. A norm-like module that is chosen but not
    recognised refuses the whole call, naming it; nothing is swapped then.

    Carried over: the scale (Gemma's ``1 + w``), the bias (none: ``bias=False`` where ``name``
    takes it) and, for ``ln``/``rms``, eps (``options`` win); a norm without a per-channel
    affine (``nonorm``, ``scalenorm``) keeps its own initialisation. Options left unset are
    the module's defaults (``default_options``), not the training configs': for un, mabn,
    pn_ls and prepbn they differ (docs/core.md, "Options"). Returns the number replaced.
    """
    norm_layer(name, **options)  # an unknown name or option fails here, norms or not
    chosen = _choose(_norm_like(model), include, exclude)
    readings, unknown = {}, []
    for module_name, module in chosen.items():
        try:
            readings[module_name] = read_host_norm(module)
        except ValueError as reason:
            unknown.append(f"{module_name} ({type(module).__module__}.{type(module).__qualname__}): "
                           f"{reason}")
    if unknown:
        raise ValueError("swap_norms does not recognise these norm-like modules, so nothing was "
                         "swapped:\n  " + "\n  ".join(unknown) + "\nleave them out with "
                         "exclude=[their names] or replace them yourself (unnorm.replace_module)")
    for module_name, reading in readings.items():
        new = _build(name, reading, options, _factory(model, chosen[module_name]))
        replace_module(model, module_name, new.train(chosen[module_name].training))
    return len(readings)


def _norm_like(model: nn.Module) -> dict[str, nn.Module]:
    """The model's norm-like modules by name; the model itself cannot be one."""
    found = {n: m for n, m in model.named_modules() if is_norm_like(m)}
    if "" in found:
        raise ValueError("swap_norms replaces norms inside a model; build_norm makes one")
    return found


def _choose(found: dict[str, nn.Module], include: Patterns,
            exclude: Patterns) -> dict[str, nn.Module]:
    """The norms ``include`` matches (all when None) less those ``exclude`` matches; a pattern
    that matches no norm is refused (a typo would swap everything or nothing)."""
    chosen = dict(found)
    for option, patterns in (("include", include), ("exclude", exclude)):
        if patterns is None:
            continue
        patterns = [patterns] if isinstance(patterns, str) else list(patterns)
        matched = {n for n in found if any(fnmatch.fnmatchcase(n, p) for p in patterns)}
        for pattern in patterns:
            if not any(fnmatch.fnmatchcase(n, pattern) for n in found):
                raise ValueError(f"{option} pattern {pattern!r} matches no norm of the model; "
                                 f"its norms are: {', '.join(found) or 'none'}")
        chosen = {n: m for n, m in chosen.items() if (n in matched) == (option == "include")}
    return chosen


def _factory(model: nn.Module, old: nn.Module) -> dict:
    """The host norm's device and dtype (the model's for a norm without parameters)."""
    tensor = next(old.parameters(), None)
    tensor = tensor if tensor is not None else next(model.parameters(), None)
    return {} if tensor is None else {"device": tensor.device, "dtype": tensor.dtype}


def _build(name: str, reading: HostNorm, options: dict, factory: dict) -> nn.Module:
    """The norm ``name`` carrying ``reading``'s affine (and eps, like for like)."""
    kwargs = {**factory, **options}
    if name.lower() in _LIKE_FOR_LIKE:
        kwargs.setdefault("eps", reading.eps)
    if reading.bias is None and "bias" in option_names(name):
        kwargs.setdefault("bias", False)
    new = build_norm(name, reading.channels, **kwargs)
    for param, source in (("weight", reading.scale), ("bias", reading.bias)):
        target = getattr(new, param, None)  # NoNorm's weight is a buffer, ScaleNorm's one gain
        if source is not None and isinstance(target, nn.Parameter) and target.shape == source.shape:
            target.copy_(source)
    return ChannelsFirst(new) if reading.channels_first else new
