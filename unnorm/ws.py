"""Weight Standardization (Qiao et al., "Micro-Batch Training with Batch-Channel Normalization
and Weight Standardization"; joe-siyuan-qiao/WeightStandardization): each output unit's weights
standardised over its fan-in (a linear layer's row, a convolution's C_in x k x k) in every
forward, the layer then applied with them.

The releases disagree on eps, so ``eps_form`` names each:

- ``"var"``: ``(w - mean) / sqrt(var + eps)``, unbiased variance: Batch-Channel-Normalization's
  ``imagenet/models/layers.py`` ``Conv2d``;
- ``"std"``: ``(w - mean) / (std + eps)``, unbiased std: the WeightStandardization README, the
  DeepLab code and mmcv's ``conv_ws_2d``;
- ``"biased_var"``: ``(w - mean) / sqrt(biased var + eps)``: timm's ``StdConv2d`` (whose eps
  defaults to 1e-6).

``standardize_weights(model, include=...)`` puts the option on named ``nn.Linear`` and
``nn.Conv2d`` layers (the release standardises the layers a norm follows; name them: an
embedding or a classifier head is not one). The layers keep their class's parameters and
state-dict names. A standardised layer does not take a folded norm: ``bake_standardized_weights``
first replaces each by a plain layer holding its standardised weight (exact, for inference).
"""
from __future__ import annotations

import fnmatch
import math
from typing import Sequence, Union

import torch
import torch.nn.functional as F
from torch import nn


EPS_FORMS = ("var", "std", "biased_var")


def standardized(weight: torch.Tensor, eps: float, eps_form: str) -> torch.Tensor:
    """``weight`` with each output unit's fan-in standardised (float32 arithmetic for half
    weights; the result keeps the weight's dtype)."""
    flat = weight.reshape(weight.shape[0], -1)
    flat = flat if flat.dtype == torch.float64 else flat.float()
    centred = flat - flat.mean(dim=1, keepdim=True)
    if eps_form == "std":
        scale = centred.std(dim=1, keepdim=True) + eps
    else:
        var = centred.var(dim=1, keepdim=True, unbiased=eps_form == "var")
        scale = torch.sqrt(var + eps)
    return (centred / scale).to(weight.dtype).reshape(weight.shape)


class StandardizedWeight:
    """Weight Standardization on a layer's ``weight`` (see the module)."""

    ws_eps: float = 1e-5
    ws_form: str = "var"

    def _set_standardization(self, eps: float, eps_form: str) -> None:
        if eps_form not in EPS_FORMS:
            raise ValueError(f"eps_form must be one of {', '.join(map(repr, EPS_FORMS))} (var: "
                             f"sqrt(var + eps), the BCN release's layers.py; std: std + eps, the "
                             f"WS README, DeepLab and mmcv's conv_ws_2d; biased_var: timm's "
                             f"StdConv2d), got {eps_form!r}")
        if not (isinstance(eps, (int, float)) and math.isfinite(eps) and eps > 0):
            raise ValueError(f"eps must be a positive number, got {eps!r}")
        self.ws_eps, self.ws_form = float(eps), eps_form

    def standardized_weight(self) -> torch.Tensor:
        return standardized(self.weight, self.ws_eps, self.ws_form)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, weight_standardization={self.ws_form}, eps={self.ws_eps}"


class StandardizedLinear(StandardizedWeight, nn.Linear):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.standardized_weight(), self.bias)


class StandardizedConv2d(StandardizedWeight, nn.Conv2d):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._conv_forward(x, self.standardized_weight(), self.bias)


_STANDARDIZED = {nn.Linear: StandardizedLinear, nn.Conv2d: StandardizedConv2d}


def _patterns(value) -> list[str]:
    return [] if value is None else [value] if isinstance(value, str) else list(value)


def standardize_weights(model: nn.Module, include: Union[str, Sequence[str]],
                        exclude: Union[str, Sequence[str], None] = None, eps: float = 1e-5,
                        eps_form: str = "var") -> int:
    """Weight-standardise the ``nn.Linear``/``nn.Conv2d`` layers of ``model`` whose names match
    ``include`` and not ``exclude`` (``fnmatch`` patterns), in place: each stays the same module
    object with the same parameters (an optimizer built before still holds them), its class
    the standardised one. Returns how many. A pattern that matches no such layer is refused,
    naming the model's layers."""
    included, excluded = _patterns(include), _patterns(exclude)
    if not included:
        raise ValueError("name the layers to standardise (include=...): the release standardises "
                         "the layers a norm follows, not the embeddings or the heads")
    StandardizedWeight()._set_standardization(eps, eps_form)  # checked before anything changes
    layers = {name: module for name, module in model.named_modules()
              if name and type(module) in _STANDARDIZED}
    for pattern in included + excluded:
        if not any(fnmatch.fnmatchcase(name, pattern) for name in layers):
            raise ValueError(f"pattern {pattern!r} matches no plain nn.Linear or nn.Conv2d of the "
                             f"model; its layers: {', '.join(sorted(layers)) or 'none'}")
    chosen = [module for name, module in layers.items()
              if any(fnmatch.fnmatchcase(name, p) for p in included)
              and not any(fnmatch.fnmatchcase(name, p) for p in excluded)]
    for module in chosen:
        module.__class__ = _STANDARDIZED[type(module)]
        module._set_standardization(eps, eps_form)
    return len(chosen)


@torch.no_grad()
def bake_standardized_weights(model: nn.Module) -> int:
    """Make every weight-standardised layer of ``model`` a plain one holding its standardised
    weight: the same function, exactly, with nothing left to re-standardise (for inference,
    before folding norms into those layers). Returns how many."""
    baked = 0
    for module in model.modules():
        if isinstance(module, StandardizedWeight):
            module.weight.copy_(module.standardized_weight())
            module.__class__ = next(plain for plain, ws in _STANDARDIZED.items()
                                    if type(module) is ws)
            for attribute in ("ws_eps", "ws_form"):
                module.__dict__.pop(attribute, None)
            baked += 1
    return baked
