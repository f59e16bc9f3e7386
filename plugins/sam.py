"""Training through the norms: sharpness-aware minimization over every parameter or over the
norm layers' only, and training the norm layers alone.

SAM and ASAM (Foret et al. 2021; Kwon et al. 2021) and their norm-only forms SAM-ON and
ASAM-ON (Mueller et al., NeurIPS 2023; release: mueller-mp/SAM-ON, ``sam_on.py``), around the
recipe's own optimizer: the first pass's gradient g over the perturbed set S gives

    SAM:  eps = rho * g / ||g||            ASAM: eps = rho * T^2 g / ||T g||

with T = |w| + eta (``elementwise``) or ||w|| + eta per tensor (layerwise) for weights, and 1
for biases unless ``normalize_bias`` (the release tells them by the name ``weight``); norms
are over S, plus 1e-16. The second forward and backward run at w + eps, the weights are put
back, and the recipe's optimizer steps every parameter with the second pass's gradient.

The release picks S by parameter name (``norm``/``bn``), which misses norms named otherwise;
S here is every parameter of the layers chosen by module type (unnorm's, torch's and timm's
norms): the release's set where the layers are so named. Written here rather than taken from
a package: the SAM family of ``pytorch-optimizer`` perturbs the parameters it steps, while
SAM-ON perturbs a subset and steps them all, and the norms' running state must see the second
pass as not a step (``unnorm.UpdateStart.second_pass``).

``train_only`` (Frankle et al., ICLR 2021, "Training BatchNorm and Only BatchNorm"; release:
facebookresearch/open_lth): every other parameter stays at its initialisation.
"""
from __future__ import annotations

from typing import Callable, Mapping, Optional

import torch
from torch import nn

import unnorm
from unnorm.base import upcast

#: torch's per-channel norm layers whose affine is a norm's (timm's subclass these, or are
#: listed by name below, so this module needs no timm import)
TORCH_NORMS = (nn.LayerNorm, nn.GroupNorm, nn.RMSNorm, nn.modules.batchnorm._NormBase)
TIMM_NORM_NAMES = ("RmsNorm", "RmsNorm2d", "SimpleNorm", "SimpleNorm2d")
TRAIN_ONLY = ("all", "norm", "norm+head")


def norm_parameters(model: nn.Module) -> dict[str, nn.Parameter]:
    """Every parameter of every norm layer of ``model``, by name: with the per-channel affine,
    a norm's own others (DyT's and PRepBN's alpha, EvoNorm's ``v``, BCN's per-group affine),
    as the release takes every parameter of a layer named ``norm`` or ``bn``."""
    chosen = {}
    for name, module in model.named_modules():
        if isinstance(module, (unnorm.ChannelNorm, *TORCH_NORMS)) or \
                type(module).__name__ in TIMM_NORM_NAMES:
            chosen.update({f"{name}.{key}" if name else key: param
                           for key, param in module.named_parameters(recurse=False)})
    return chosen


def freeze_except(model: nn.Module, train_only: str, head: Optional[nn.Module]) -> int:
    """Freeze every parameter but the norms' (and the head's, for ``norm+head``) at its
    current value; returns the number of trainable parameters. Call before the optimizer and
    DDP see the model."""
    if train_only not in TRAIN_ONLY:
        raise ValueError(f"train_only must be one of {', '.join(TRAIN_ONLY)}, got {train_only!r}")
    if train_only == "all":
        return sum(p.numel() for p in model.parameters() if p.requires_grad)
    kept = {id(p) for p in norm_parameters(model).values()}
    if train_only == "norm+head":
        if head is None:
            raise ValueError("train_only=norm+head: this task names no head to train")
        kept |= {id(p) for p in head.parameters()}
    if not kept:
        raise ValueError(f"train_only={train_only}: the model has no norm parameters to train "
                         "(nonorm has none); pick another norm or train_only=all")
    for param in model.parameters():
        param.requires_grad_(id(param) in kept)
    return sum(p.numel() for p in model.parameters() if p.requires_grad)


class SharpnessAware:
    """SAM/ASAM over ``model``'s trainable parameters, or over its norms' only (``only_norm``:
    SAM-ON, ASAM-ON). Per update: the first forward and backward; ``ascend()``; the second
    forward and backward inside ``second_pass()``; ``restore()`` (the last three:
    ``perturbed_gradient``); the optimizer's step.

    A loss scaler may scale both passes: eps does not depend on the gradient's scale, and a
    non-finite first pass makes a non-finite second one, which the scaler skips."""

    def __init__(self, model: nn.Module, rho: float, adaptive: bool = False,
                 elementwise: bool = True, only_norm: bool = False, eta: float = 0.0,
                 normalize_bias: bool = False):
        if not (isinstance(rho, (int, float)) and rho > 0):
            raise ValueError(f"sam.rho (the radius of the perturbation) must be > 0, got {rho!r}")
        if not (isinstance(eta, (int, float)) and eta >= 0):
            raise ValueError(f"sam.eta (ASAM's offset of |w|) must be >= 0, got {eta!r}")
        named = norm_parameters(model) if only_norm else dict(model.named_parameters())
        self.trainable = [p for p in model.parameters() if p.requires_grad]
        self.perturbed = {name: p for name, p in named.items() if p.requires_grad}
        if not self.perturbed:
            raise ValueError("sam.only_norm: the model has no trainable norm parameters to "
                             "perturb (nonorm has none); use only_norm=false")
        self.rho, self.adaptive, self.elementwise = float(rho), adaptive, elementwise
        self.only_norm = only_norm
        self.eta, self.normalize_bias = float(eta), normalize_bias
        self.update_start = unnorm.UpdateStart(model)
        self._saved: list[tuple[nn.Parameter, torch.Tensor]] = []

    def size(self) -> tuple[int, float]:
        """How many parameters are perturbed, and their share of the trainable ones."""
        count = sum(p.numel() for p in self.perturbed.values())
        return count, count / sum(p.numel() for p in self.trainable)

    def new_update(self) -> None:
        """Call before an update's first forward (the norms' state at its start is kept)."""
        self.update_start.new_update()

    def _scale(self, name: str, param: torch.Tensor) -> Optional[torch.Tensor]:
        """ASAM's T for ``param`` (None: 1)."""
        if not self.adaptive or not ("weight" in name or self.normalize_bias):
            return None  # the release scales weights only (by name), biases if normalize_bias
        if self.elementwise:
            return param.abs() + self.eta
        return torch.ones_like(param) * param.norm() + self.eta

    @torch.no_grad()
    def ascend(self) -> None:
        """Move the perturbed set to ``w + eps`` (keeping ``w``)."""
        steps = []
        for name, param in self.perturbed.items():
            if param.grad is None:
                continue
            scale = self._scale(name, param)
            grad = upcast(param.grad) if scale is None else upcast(param.grad) * scale
            steps.append((param, grad if scale is None else grad * scale, grad.norm()))
        total = torch.stack([norm for _, _, norm in steps]).norm() + 1e-16
        self._saved = [(param, param.detach().clone()) for param, _, _ in steps]
        for param, direction, _ in steps:
            param.add_((direction * (self.rho / total)).to(param.dtype))

    def second_pass(self):
        """The second forward and backward: the norms' state is as the first pass left it
        afterwards (``unnorm.UpdateStart.second_pass``)."""
        return self.update_start.second_pass()

    @torch.no_grad()
    def restore(self) -> None:
        """Put the perturbed set back at ``w``; the optimizer then steps from there."""
        for param, value in self._saved:
            param.copy_(value)
        self._saved = []

    def perturbed_gradient(self, forward_backward: Callable[[], object]) -> None:
        """After the first pass's backward: ascend, clear every gradient, run the second
        forward and backward (``forward_backward()``) at ``w + eps``, and restore ``w``. The
        model's gradients are then the perturbed point's, for the optimizer's step."""
        self.ascend()
        for param in self.trainable:
            param.grad = None
        try:  # w comes back also when the second pass fails (fairseq recovers from an OOM)
            with self.second_pass():
                forward_backward()
        finally:
            self.restore()


def configured(chosen: Optional[Mapping], model: nn.Module,
               announce: bool = True) -> Optional[SharpnessAware]:
    """The SAM a run's ``sam`` entry (``configs/sam/*.yaml``: its ``name`` and options) asks
    for on ``model`` (already frozen by ``freeze_except``), or None (``sam=none``); prints the
    perturbed set's size and share when ``announce`` (the main process)."""
    if chosen is None or chosen.get("name", "none") == "none":
        return None
    options = {key: value for key, value in dict(chosen).items() if key != "name"}
    sam = SharpnessAware(model, **options)
    if announce:
        count, share = sam.size()
        print(f"SAM ({'only the norms' if sam.only_norm else 'every parameter'}) perturbs "
              f"{count} parameters, {100 * share:.2f}% of the trainable ones")
    return sam


def trained_parameters(model: nn.Module, sam: Optional[SharpnessAware]) -> dict:
    """What a run trains, for its ``result.json``: ``trainable_parameters``, and
    ``sam_perturbed_parameters`` with SAM."""
    record = {"trainable_parameters": sum(p.numel() for p in model.parameters() if p.requires_grad)}
    if sam is not None:
        record["sam_perturbed_parameters"] = sam.size()[0]
    return record
