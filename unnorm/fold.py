"""Inference-time folding of offline norms (paper Algorithm 1), and of DyT's affine.

An offline norm in eval mode is ``x * scale + shift`` per channel. Followed by
``Linear(W, b)`` it folds into ``W' = W * scale`` (column scaling) and ``b' = b + W @ shift``,
exactly up to rounding, provided nothing between them breaks a per-channel affine. A 1x1
convolution (e.g. an FPN lateral) is the same linear map at every pixel and folds alike.
DyT ends in such an affine too (``weight * tanh(alpha x) + bias``): its affine folds the same
way, leaving the elementwise ``tanh(alpha x)`` in its place.
"""
from __future__ import annotations

from copy import deepcopy
from typing import Callable, Mapping, Optional, Sequence, Union

import torch
from torch import nn

from .base import ChannelNorm
from .registry import available_norms, is_offline
from .swap import replace_module
from .ws import StandardizedWeight


class FoldedNorm(nn.Module):
    """Stands where a folded norm was: the identity, accepting the norm's ``pad_mask``."""

    def forward(self, x: torch.Tensor, pad_mask: Optional[torch.Tensor] = None) -> torch.Tensor:
        return x


class ChannelAffine(nn.Module):
    """A frozen per-channel affine ``x * scale + shift``: an offline norm with no linear
    consumer to fold into."""

    def __init__(self, scale: torch.Tensor, shift: torch.Tensor):
        super().__init__()
        self.register_buffer("scale", scale)
        self.register_buffer("shift", shift)

    def forward(self, x: torch.Tensor, pad_mask: Optional[torch.Tensor] = None) -> torch.Tensor:
        return torch.addcmul(self.shift.to(x.dtype), x, self.scale.to(x.dtype))


def _check_foldable(norm: nn.Module) -> tuple[torch.Tensor, torch.Tensor]:
    if not getattr(norm, "offline", False) or not hasattr(norm, "inference_affine"):
        offline = ", ".join(name for name in available_norms() if is_offline(name))
        raise ValueError(f"{type(norm).__name__} is an online norm (its inference depends on "
                         f"each input); only offline norms ({offline}) become an affine, and "
                         "only those and dyt fold into a linear layer")
    _check_eval(norm)
    return norm.inference_affine()


def _check_eval(norm: nn.Module) -> None:
    if norm.training:
        raise RuntimeError("folding uses the inference statistics: call model.eval() first")


def _fold_parts(norm: nn.Module) -> tuple[torch.Tensor, torch.Tensor, nn.Module]:
    """``(scale, shift, rest)``: the norm's inference is ``rest(x) * scale + shift``."""
    if hasattr(norm, "fold_parts"):  # DyT: an affine after an elementwise function
        _check_eval(norm)
        return norm.fold_parts()
    scale, shift = _check_foldable(norm)
    return scale, shift, FoldedNorm()


def _is_pointwise(layer: nn.Module, channels: int) -> bool:
    """A linear map over ``channels`` input channels: nn.Linear, or a plain 1x1 convolution."""
    if isinstance(layer, nn.Linear):
        return layer.in_features == channels
    return (isinstance(layer, nn.Conv2d) and layer.in_channels == channels and layer.groups == 1
            and layer.kernel_size == (1, 1) and layer.padding in ((0, 0), "valid"))


@torch.no_grad()
def fold_into_linear(norm: nn.Module, linears: Sequence[nn.Module]) -> nn.Module:
    """Fold ``norm``'s affine into every linear layer that consumes its output (e.g. q, k, v).

    Consumers are ``nn.Linear`` or 1x1 ``nn.Conv2d`` layers, changed in place; put the
    returned module where the norm was (``FoldedNorm``, the identity, for offline norms;
    ``tanh(alpha x)`` for DyT). Unchecked: that these are all the norm's readers is the
    caller's word (``fold_norms`` with a probe checks a model's fold).
    """
    scale, shift, rest = _fold_parts(norm)
    scale, shift = scale.double(), shift.double()
    if not linears:
        raise ValueError("no linear consumer given; use to_affine(norm) for such a norm")
    standardized = [repr(linear) for linear in linears if isinstance(linear, StandardizedWeight)]
    if standardized:
        _refuse_standardized(standardized)
    for linear in linears:
        if not _is_pointwise(linear, scale.numel()):
            raise ValueError(f"cannot fold a {scale.numel()}-channel norm into {linear!r}: a "
                             "consumer must be an nn.Linear or 1x1 nn.Conv2d reading that many channels")
        weight = linear.weight.double()
        matrix = weight.reshape(weight.shape[0], weight.shape[1])
        bias = matrix @ shift
        if linear.bias is not None:
            bias += linear.bias.double()
            linear.bias.copy_(bias)
        else:
            linear.bias = nn.Parameter(bias.to(linear.weight.dtype))
        linear.weight.copy_((matrix * scale).reshape(weight.shape))
    return rest


def _refuse_standardized(layers: Sequence[str]) -> None:
    raise ValueError(f"{', '.join(layers)} standardise(s) its weight in every forward, which "
                     "would undo a folded scale: bake it first (unnorm.bake_standardized_weights"
                     "(model), exact for inference), then fold")


@torch.no_grad()
def to_affine(norm: nn.Module) -> ChannelAffine:
    """The frozen per-channel affine of an offline norm in eval mode."""
    scale, shift = _check_foldable(norm)
    return ChannelAffine(scale.clone(), shift.clone())


#: What a fold is checked on: the model's input (``model(probe)``, float inputs made float64), or
#: ``probe(model) -> outputs`` (tensors, nested in tuples, lists or dicts) run on float64 copies.
Probe = Union[torch.Tensor, Callable[[nn.Module], object]]


def fold_norms(model: nn.Module, consumers: Mapping[str, Sequence[str]], *,
               probe: Optional[Probe]) -> int:
    """Fold each named norm of ``model`` into its named linear consumers, in place.

    ``consumers`` maps a norm's module name to the names of the linear layers reading its
    output; an empty list turns an offline norm into a ``ChannelAffine`` and leaves a DyT
    as it is. A linear layer may be folded into once only: one reached twice (a name listed
    twice, one module under two names, a weight tied to another module's, as a language
    model's head to its embedding) is refused by name before anything changes, and so are a
    norm that cannot fold (online, or in training mode) and a consumer that standardises its
    weight.

    ``probe`` proves the fold before the model changes: a float64 copy is folded by the plan,
    and its outputs on the probe must equal the unfolded copy's (to float32 rounding), or the
    plan is refused, naming the norm and the module where its missed reader shows; ``model``
    is left as it was. The whole model must be in eval mode. ``probe=None`` folds unchecked:
    only where the weights are to be replaced (a structure for a folded checkpoint). Returns
    the number of norms replaced.
    """
    check_folded_once(model, consumers)
    check_not_separated(model, consumers)
    standardized = [name for names in consumers.values() for name in names
                    if isinstance(model.get_submodule(name), StandardizedWeight)]
    if standardized:
        _refuse_standardized(standardized)
    for norm_name, linear_names in consumers.items():
        try:
            _fold_parts(model.get_submodule(norm_name))
        except (ValueError, RuntimeError) as error:
            raise type(error)(f"{norm_name}: {error}") from error
    if probe is not None:
        _prove_fold(model, consumers, probe)
    return sum(_fold_one(model, name, linears) for name, linears in consumers.items())


def _fold_one(model: nn.Module, norm_name: str, linear_names: Sequence[str]) -> int:
    """Fold one checked plan entry in place; 1 if the norm was replaced, 0 for a DyT kept whole."""
    norm = model.get_submodule(norm_name)
    if linear_names:
        folded = fold_into_linear(norm, [model.get_submodule(n) for n in linear_names])
    elif hasattr(norm, "fold_parts"):
        return 0  # no consumer to take DyT's affine: it stays whole
    else:
        folded = to_affine(norm)
    replace_module(model, norm_name, folded)
    return 1


@torch.no_grad()
def _prove_fold(model: nn.Module, consumers: Mapping[str, Sequence[str]], probe: Probe) -> None:
    """Refuse a plan whose fold changes ``model``'s outputs on ``probe``; ``model`` is untouched.

    The check folds a float64 copy: there a right plan changes the outputs by float64 rounding
    alone, so the bar can be what float32 rounding of the folded matmul may add, whatever the
    model's dtype: ``K * eps32 * max|output|`` per output tensor, K the largest fan-in of the
    plan's consumers. A missed reader (a residual that reads the norm's output too) sees the
    norm's input instead, off by the whole affine. On a refusal the norms are folded one at a
    time into a fresh copy to name the first that changes the outputs and the first module
    whose output it changes.
    """
    training = [name or "the model" for name, module in model.named_modules() if module.training]
    if training:
        raise RuntimeError(f"{training[0]} is in training mode: the probe's outputs would be random "
                           "(dropout) and running statistics would move; call model.eval() first")
    fan_in = max([1] + [_fan_in(model.get_submodule(n)) for ns in consumers.values() for n in ns])
    rtol = fan_in * torch.finfo(torch.float32).eps
    trial = _float64_copy(model)
    want = _outputs(probe, trial)
    if not all(tensor.isfinite().all() for tensor in want):
        raise ValueError("the unfolded model's outputs on the probe are not finite (in float64): "
                         "pass a probe it computes finitely")
    for name, linears in consumers.items():
        _fold_one(trial, name, linears)
    whole = _worst(_outputs(probe, trial), want, rtol)
    if whole is None:
        return
    trial = _float64_copy(model)
    before = _traced(probe, trial)
    for name, linears in consumers.items():
        if not _fold_one(trial, name, linears):
            continue
        after = _traced(probe, trial)
        worst = _worst(after[0], before[0], rtol)
        if worst is not None:
            _refuse_missed_reader(name, linears, worst, _where(name, linears, before[1], after[1], rtol))
        before = after
    raise ValueError(f"the plan changes the model's outputs on the probe by {whole[0]:.3g} (float32 "
                     f"rounding allows {whole[1]:.3g}), yet folding its norms one by one does not: "
                     "the probe's outputs vary from run to run; pass a deterministic probe")


def _fan_in(layer: nn.Module) -> int:
    return layer.in_features if isinstance(layer, nn.Linear) else layer.in_channels


def _float64_copy(model: nn.Module) -> nn.Module:
    return deepcopy(model).double()


def _outputs(probe: Probe, model: nn.Module) -> list[torch.Tensor]:
    """The tensors ``probe`` gives on ``model`` (a float64 copy), flattened in order."""
    try:
        if isinstance(probe, torch.Tensor):
            result = model(probe.double() if probe.is_floating_point() else probe)
        else:
            result = probe(model)
    except Exception as error:
        raise RuntimeError(f"the fold's probe failed on a float64 copy of the model ({error}); a "
                           "callable probe gets that copy: give it float64 inputs") from error
    tensors = _tensors(result)
    if not tensors:
        raise ValueError(f"the fold's probe returned no tensor ({type(result).__name__}): return "
                         "the model's outputs (tensors, nested in tuples, lists or dicts)")
    return tensors


def _tensors(value: object) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, Mapping):
        value = list(value.values())
    if isinstance(value, (list, tuple)):
        return [tensor for item in value for tensor in _tensors(item)]
    return []  # None, a cache object: not an output to compare


def _worst(got: list[torch.Tensor], want: list[torch.Tensor], rtol: float
           ) -> Optional[tuple[float, float]]:
    """``(change, tolerance)`` of the first tensor of ``got`` off ``want`` by more than
    ``rtol * max|want|`` (over its finite entries; equal entries, infinities too, count as 0)."""
    for a, b in zip(got, want, strict=True):
        if a.shape != b.shape:
            return float("inf"), 0.0
        a, b = a.double(), b.double()
        finite = b[b.isfinite()]
        tolerance = rtol * finite.abs().max().item() if finite.numel() else 0.0
        change = torch.where(a == b, 0.0, (a - b).abs()).max().item() if b.numel() else 0.0
        if not change <= tolerance:  # NaN included
            return change, tolerance
    return None


def _traced(probe: Probe, model: nn.Module) -> tuple[list[torch.Tensor], list]:
    """The probe's outputs, and every module call's name and output tensors in the order the
    calls end (a module inside another ends first)."""
    names: dict[nn.Module, str] = {}
    for name, module in model.named_modules():
        names.setdefault(module, name)
    calls: list[tuple[str, list[torch.Tensor]]] = []

    def record(module, inputs, output):
        calls.append((names[module], [t.clone() for t in _tensors(output)]))

    handles = [module.register_forward_hook(record) for module in names]
    try:
        return _outputs(probe, model), calls
    finally:
        for handle in handles:
            handle.remove()


def _where(norm_name: str, linears: Sequence[str], before: list, after: list, rtol: float) -> str:
    """Where the fold of ``norm_name`` first shows: the first module call, other than the norm
    and modules passing its output on as it is (dropout in eval, a block returning it), whose
    output changed; or, if none did, the probe's outputs themselves."""
    passed = [t for name, tensors in before if name == norm_name for t in tensors]
    if [name for name, _ in before] != [name for name, _ in after]:
        return "the module where it shows is not known (the two runs took different paths)"
    for (name, want), (_, got) in zip(before, after):
        changed = [b for a, b in zip(got, want) if _worst([a], [b], rtol) is not None]
        if name == norm_name or all(any(b.shape == p.shape and torch.equal(b, p) for p in passed)
                                    for b in changed):
            continue
        if name in linears:
            return (f"{name}, a layer of the plan, computes otherwise once folded: it does not read "
                    f"{norm_name}'s output as it is (another input, or an operation between them "
                    "that is not per channel, as zero padding)")
        return (f"{name or 'the model itself'} is the first module whose output changes: it reads "
                f"{norm_name}'s output, directly or through operations outside the plan's layers "
                "(a residual sum)")
    return f"the model returns {norm_name}'s output itself (one of the probe's outputs)"


def _refuse_missed_reader(norm_name: str, linears: Sequence[str], worst: tuple[float, float],
                          where: str) -> None:
    into = ", ".join(linears) if linears else "a frozen affine"
    raise ValueError(f"folding {norm_name} into {into} changes the model's outputs on the probe by "
                     f"{worst[0]:.3g} (float32 rounding allows {worst[1]:.3g}): {where}. Name every "
                     f"linear layer that reads {norm_name} in its list, or give it an empty list (a "
                     "frozen affine); nothing was folded")


def check_not_separated(model: nn.Module, consumers: Mapping[str, Sequence[str]]) -> None:
    """Refuse to fold a norm of a ``SeparateClassNorm`` into linear layers: those layers read
    the class token's output and the other tokens' alike, which two norms normalised. Each
    may still become a frozen affine (an empty consumer list)."""
    from .sepnorm import SeparateClassNorm
    for norm_name, linear_names in consumers.items():
        parent_name, _, _ = norm_name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        if linear_names and isinstance(parent, SeparateClassNorm):
            part = "the class token" if parent.class_norm is model.get_submodule(norm_name) \
                else "the tokens after the class token"
            raise ValueError(f"{norm_name} normalises only {part} of {parent_name}, and "
                             f"{', '.join(linear_names)} read(s) every token: "
                             "a separated norm cannot fold into its consumers; give it an empty "
                             "list (a frozen affine, if offline) or leave it unfolded")


def check_folded_once(model: nn.Module, consumers: Mapping[str, Sequence[str]]) -> None:
    """Refuse a plan that would fold into one linear layer twice, or into a weight that
    another module shares: folding scales the weight in place, so the second fold (or the
    other module) would read an already folded one."""
    owners: dict[int, str] = {}  # id of a folded weight -> the first name that reached it
    for norm_name, linear_names in consumers.items():
        for linear_name in linear_names:
            weight = model.get_submodule(linear_name).weight
            if id(weight) in owners:
                raise ValueError(f"{linear_name} (a consumer of {norm_name}) is the layer "
                                 f"{owners[id(weight)]} already folded into: a linear layer "
                                 "takes one fold; list each consumer once, under one name")
            owners[id(weight)] = linear_name
    for name, module in model.named_modules(remove_duplicate=False):
        for param_name, param in module.named_parameters(recurse=False):
            folded = owners.get(id(param))
            if folded is not None and model.get_submodule(folded) is not module:
                raise ValueError(f"{folded}'s weight is tied to {name}.{param_name}: folding "
                                 f"would change {name} too. Untie it first (give {folded} its "
                                 "own copy of the weight) or leave that norm unfolded")


def check_fold_plan(model: nn.Module, plan: Mapping[str, Sequence[str]]) -> Mapping[str, Sequence[str]]:
    """A whole-model fold plan must name every norm of the model, and only those."""
    present = {name for name, module in model.named_modules() if isinstance(module, ChannelNorm)}
    if present != set(plan):
        raise RuntimeError(f"fold plan and model disagree: plan misses {sorted(present - set(plan))}, "
                           f"model lacks {sorted(set(plan) - present)}")
    return plan


def fold_by_plan(model: nn.Module, plan: Mapping[str, Sequence[str]], *,
                 probe: Optional[Probe]) -> dict[str, int]:
    """Fold every offline norm (and DyT's affine) of an eval-mode model in place, by a plan
    naming each norm's linear consumers (``fold_norms``, proved on ``probe``; checked to cover
    every norm). Returns how many norms went into linear layers, how many became frozen
    affines, and how many DyTs without a linear consumer stayed whole."""
    check_fold_plan(model, plan)
    unconsumed = [name for name, linears in plan.items() if not linears]
    kept = sum(1 for name in unconsumed if not model.get_submodule(name).offline)
    fold_norms(model, plan, probe=probe)
    return {"folded": len(plan) - len(unconsumed), "affine": len(unconsumed) - kept, "kept": kept}
