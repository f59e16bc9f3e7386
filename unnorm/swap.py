"""Put our norms into an existing model in place of its LayerNorms."""
from __future__ import annotations

import torch
from torch import nn

from .registry import build_norm, norm_layer

_LIKE_FOR_LIKE = ("ln", "rms")  # per-position norms keep the host's eps


def replace_module(model: nn.Module, name: str, new: nn.Module) -> None:
    """``model.<name> = new`` for a dotted submodule name."""
    parent_name, _, child = name.rpartition(".")
    setattr(model.get_submodule(parent_name) if parent_name else model, child, new)


@torch.no_grad()
def swap_norms(model: nn.Module, name: str, **options) -> int:
    """Replace every ``nn.LayerNorm`` (subclasses included: timm's, fairseq's) in ``model``.

    The affine parameters are carried over. ``eps`` is taken from ``options``, else from the
    LayerNorm for ``ln``/``rms``, else the new norm's own default (as the releases did).
    Returns the number of replaced layers.
    """
    norm_layer(name, **options)  # an unknown name or option fails here, LayerNorms or not
    if isinstance(model, nn.LayerNorm):
        raise ValueError("swap_norms replaces LayerNorms inside a model; build_norm makes one")
    targets = [(n, m) for n, m in model.named_modules() if isinstance(m, nn.LayerNorm)]
    for module_name, old in targets:
        if len(old.normalized_shape) != 1:
            raise ValueError(f"{module_name}: LayerNorm over {tuple(old.normalized_shape)} is "
                             "not a per-channel norm of channels-last input; cannot swap it")
        kwargs = dict(options)
        if name.lower() in _LIKE_FOR_LIKE:
            kwargs.setdefault("eps", old.eps)
        if old.weight is not None:
            kwargs.update(device=old.weight.device, dtype=old.weight.dtype)
        new = build_norm(name, old.normalized_shape[0], **kwargs)
        new.train(old.training)
        for param in ("weight", "bias"):
            source, target = getattr(old, param, None), getattr(new, param, None)
            if source is not None and isinstance(target, nn.Parameter):
                target.copy_(source)
        replace_module(model, module_name, new)
    return len(targets)
