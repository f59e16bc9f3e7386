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

``"scaled"`` is NF-Nets' Scaled WS (Brock et al., "Characterizing signal propagation to close
the performance gap in unnormalized ResNets", 2021), the normalizer-free baseline: the
``biased_var`` standardisation times a learnable gain per output unit (``gain``, initialised to
1) and ``gamma / sqrt(fan-in)``, which makes a layer variance-preserving without a norm (gamma
undoes the variance an activation before the layer takes away). timm's ``ScaledStdConv2d``
computes exactly this for convolutions only; ``ScaledStandardizedLinear`` is its linear form.

``standardize_weights(model, include=...)`` puts the option on named ``nn.Linear`` and
``nn.Conv2d`` layers (the release standardises the layers a norm follows; name them: an
embedding or a classifier head is not one). The layers keep their class's parameters and
state-dict names. A standardised layer does not take a folded norm: ``bake_standardized_weights``
first replaces each by a plain layer holding its standardised weight (exact, for inference).
"""
from __future__ import annotations

import fnmatch
import math
from typing import Optional, Sequence, Union

import torch
import torch.nn.functional as F
from torch import nn


EPS_FORMS = ("var", "std", "biased_var")
SCALED = "scaled"  # NF-Nets' Scaled WS: biased_var's standardisation, a gain, gamma / sqrt(fan-in)


def _standardized_rows(weight: torch.Tensor, eps: float, eps_form: str) -> torch.Tensor:
    """``weight`` as (output units, fan-in) rows, each standardised, in float32 for half
    weights (float64 stays float64)."""
    flat = weight.reshape(weight.shape[0], -1)
    flat = flat if flat.dtype == torch.float64 else flat.float()
    centred = flat - flat.mean(dim=1, keepdim=True)
    if eps_form == "std":
        scale = centred.std(dim=1, keepdim=True) + eps
    else:
        var = centred.var(dim=1, keepdim=True, unbiased=eps_form == "var")
        scale = torch.sqrt(var + eps)
    return centred / scale


def standardized(weight: torch.Tensor, eps: float, eps_form: str) -> torch.Tensor:
    """``weight`` with each output unit's fan-in standardised (float32 arithmetic for half
    weights; the result keeps the weight's dtype)."""
    return _standardized_rows(weight, eps, eps_form).to(weight.dtype).reshape(weight.shape)


def scaled_standardized(weight: torch.Tensor, gain: torch.Tensor, gamma: float,
                        eps: float) -> torch.Tensor:
    """NF-Nets' Scaled WS of ``weight``: each output unit's fan-in standardised with its biased
    variance (``sqrt(var + eps)``), times ``gain`` (one per output unit) and
    ``gamma / sqrt(fan-in)``: timm's ``ScaledStdConv2d`` (float32 arithmetic for half weights;
    the result keeps the weight's dtype)."""
    rows = _standardized_rows(weight, eps, "biased_var")
    scale = gain.reshape(-1, 1).to(rows.dtype) * (gamma * weight[0].numel() ** -0.5)
    return (rows * scale).to(weight.dtype).reshape(weight.shape)


def _check_positive(**values: float) -> None:
    for name, value in values.items():
        if not (isinstance(value, (int, float)) and math.isfinite(value) and value > 0):
            raise ValueError(f"{name} must be a positive number, got {value!r}")


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
        _check_positive(eps=eps)
        self.ws_eps, self.ws_form = float(eps), eps_form

    def standardized_weight(self) -> torch.Tensor:
        return standardized(self.weight, self.ws_eps, self.ws_form)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, weight_standardization={self.ws_form}, eps={self.ws_eps}"


class ScaledStandardizedWeight(StandardizedWeight):
    """NF-Nets' Scaled WS on a layer's ``weight`` (see the module): a ``gain`` parameter, one
    per output unit in timm's shape (``(out, 1, 1, 1)`` for a convolution), joins the
    layer's."""

    ws_eps: float = 1e-6
    ws_form: str = SCALED
    ws_gamma: float = 1.0

    def _set_scaling(self, eps: float, gamma: float, gain_init: float) -> None:
        _check_positive(eps=eps, gamma=gamma, gain_init=gain_init)
        self.ws_eps, self.ws_form, self.ws_gamma = float(eps), SCALED, float(gamma)
        shape = (self.weight.shape[0],) + (1,) * (self.weight.ndim - 1)
        self.gain = nn.Parameter(torch.full(shape, float(gain_init), dtype=self.weight.dtype,
                                            device=self.weight.device))

    def standardized_weight(self) -> torch.Tensor:
        return scaled_standardized(self.weight, self.gain, self.ws_gamma, self.ws_eps)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, gamma={self.ws_gamma}"


class StandardizedLinear(StandardizedWeight, nn.Linear):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.standardized_weight(), self.bias)


class StandardizedConv2d(StandardizedWeight, nn.Conv2d):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._conv_forward(x, self.standardized_weight(), self.bias)


class ScaledStandardizedLinear(ScaledStandardizedWeight, StandardizedLinear):
    """Scaled WS on a linear layer: timm's ``ScaledStdConv2d`` on a 1x1 convolution."""


class ScaledStandardizedConv2d(ScaledStandardizedWeight, StandardizedConv2d):
    """Scaled WS on a convolution: timm's ``ScaledStdConv2d``."""


_STANDARDIZED = {nn.Linear: StandardizedLinear, nn.Conv2d: StandardizedConv2d}
_SCALED = {nn.Linear: ScaledStandardizedLinear, nn.Conv2d: ScaledStandardizedConv2d}


def _patterns(value) -> list[str]:
    return [] if value is None else [value] if isinstance(value, str) else list(value)


def standardize_weights(model: nn.Module, include: Union[str, Sequence[str]],
                        exclude: Union[str, Sequence[str], None] = None, eps: float = 1e-5,
                        eps_form: str = "var", gamma: Optional[float] = None,
                        gain_init: float = 1.0) -> int:
    """Weight-standardise the ``nn.Linear``/``nn.Conv2d`` layers of ``model`` whose names match
    ``include`` and not ``exclude`` (``fnmatch`` patterns), in place: each stays the same module
    object with the same parameters (an optimizer built before still holds them), its class
    the standardised one. ``eps_form="scaled"``: NF-Nets' Scaled WS, with ``gamma`` (default 1)
    and each layer's new ``gain`` parameter at ``gain_init`` (build the optimizer after). Returns
    how many. A pattern that matches no such layer is refused, naming the model's layers."""
    included, excluded = _patterns(include), _patterns(exclude)
    if not included:
        raise ValueError("name the layers to standardise (include=...): the release standardises "
                         "the layers a norm follows, not the embeddings or the heads")
    scaled = eps_form == SCALED
    if gamma is not None and not scaled:
        raise ValueError(f"gamma is Scaled WS's (eps_form='scaled'), not eps_form={eps_form!r}'s: "
                         "drop it, or standardise with eps_form='scaled'")
    gamma = 1.0 if gamma is None else gamma
    if scaled:  # the options checked before anything changes
        _check_positive(eps=eps, gamma=gamma, gain_init=gain_init)
    else:
        StandardizedWeight()._set_standardization(eps, eps_form)
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
        if scaled:
            module.__class__ = _SCALED[type(module)]
            module._set_scaling(eps, gamma, gain_init)
        else:
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
            module.__class__ = next(plain for plain in _STANDARDIZED if isinstance(module, plain))
            for attribute in ("ws_eps", "ws_form", "ws_gamma"):
                module.__dict__.pop(attribute, None)
            module._parameters.pop("gain", None)
            baked += 1
    return baked
