"""Which weights a model is exactly scale-invariant in, found by scaling them.

A weight is ``"row"``-invariant when the model's outputs do not change as each output row
(a linear layer's row, a convolution's output channel) is multiplied by its own positive
factor: a standardised layer (``unnorm.ws``), a layer a batch norm reads. It is
``"tensor"``-invariant when only multiplying the whole weight by one factor leaves them
unchanged: a bias-free layer a layer norm reads, the projection before a qk-norm. These are
the weights whose gradient is orthogonal to them, per row or per tensor, and whose update
AdamP and SGDP project (Heo et al., ICLR 2021).

``scale_invariance(model, outputs)`` tests each matrix (``ndim >= 2``: the parameters AdamP
and SGDP consider; a bias or a norm's gain is scale-invariant only behind another norm) on a
float64 copy, so the comparison's tolerance can be tight (``rtol`` 1e-9 of the outputs'
largest magnitude, where a weight that is not invariant moves them by far more):

- **training mode**: a batch norm is scale-invariant only through its batch statistics. Each
  evaluation runs on a fresh copy of the pristine float64 model, so no running statistic,
  window or step count one forward advances reaches the next, and the model's own state is
  never touched. Dropout and other draws are reseeded before every forward.
- **eps made negligible** (``TINY_EPS``): a norm's ``var + eps`` makes every invariance
  approximate, by a relative ``eps / var`` that depends on the weight's size rather than on
  the structure; the copy's norms (and standardised layers) take an eps that changes no
  non-zero variance in float64 but still guards a zero one.
- **cost**: one backward finds the candidates first: a weight invariant under scaling has its
  gradient orthogonal to it (per row for row-invariance; Euler's identity), so only the
  weights whose cosine with their gradient is about 0 are scaled, each in one or two further
  forwards. A weight whose gradient is 0 (the outputs do not depend on it on this batch) is
  ``"inert"`` and one that is all zeros ``"zero"``: scaling proves nothing about either.
"""
from __future__ import annotations

import copy
import fnmatch
from collections.abc import Mapping, Sequence
from contextlib import contextmanager
from typing import Callable, Iterator, Union

import torch
from torch import nn

KINDS = ("row", "tensor", "none", "inert", "zero")
#: the copy's eps: no float64 variance above about 1e-184 notices it, a zero one is still guarded
TINY_EPS = 1e-200
#: Euler's test: a candidate's |cos(gradient, weight)| is at most this (float64 rounding is ~1e-13)
CANDIDATE_COSINE = 1e-6
#: module attributes that hold a norm's or a standardised layer's eps
_EPS_NAMES = ("eps", "ws_eps", "group_eps", "variance_epsilon", "epsilon")

Outputs = Union[torch.Tensor, Mapping, Sequence]


def scale_invariance(model: nn.Module, outputs: Callable[[nn.Module], Outputs], *,
                     include: Union[str, Sequence[str]] = "*", rtol: float = 1e-9,
                     seed: int = 0) -> dict[str, str]:
    """``{parameter name: kind}`` (``KINDS``) for the trainable matrices of ``model`` whose
    names match ``include`` (``fnmatch`` patterns: a subset costs less).

    ``outputs(copy)`` runs the float64 copy on a fixed batch and returns what the loss reads
    (a tensor, or a mapping or sequence of them): give it float64 inputs. ``model`` is left
    as it was, its parameters, buffers and mode included."""
    patterns = [include] if isinstance(include, str) else list(include)
    base = _float64_copy(model)
    named = dict(base.named_parameters())
    chosen = [name for name, param in named.items()
              if param.requires_grad and param.ndim >= 2
              and any(fnmatch.fnmatchcase(name, pattern) for pattern in patterns)]
    if not chosen:
        raise ValueError(f"include={patterns} matches no trainable parameter of 2 or more "
                         f"dimensions; the model's: {', '.join(n for n, p in named.items() if p.ndim >= 2)}")

    def evaluate(scaled: str = "", factor: Union[torch.Tensor, float] = 1.0) -> torch.Tensor:
        trial = copy.deepcopy(base)
        if scaled:
            with torch.no_grad():
                dict(trial.named_parameters())[scaled].mul_(factor)
        with _seeded(seed, trial):
            return _flat(outputs(trial)).detach()

    reference = evaluate()
    tolerance = rtol * reference.abs().max().item()
    if (evaluate() - reference).abs().max().item() > tolerance:
        raise RuntimeError("outputs(copy) differs between two evaluations of the same weights: "
                           "make it deterministic (a fixed batch, no draw outside the model's "
                           "forward) before testing invariance")
    gradients = _gradients(base, chosen, outputs, reference, seed)
    draws = torch.Generator().manual_seed(seed)
    kinds = {}
    for name in chosen:
        weight, gradient = named[name].detach(), gradients[name]
        if not weight.any():
            kinds[name] = "zero"
        elif gradient is None or not gradient.any():
            kinds[name] = "inert"
        else:
            kinds[name] = "none"
            rows = _log_uniform((weight.shape[0],) + (1,) * (weight.ndim - 1), draws)
            whole = _log_uniform((), draws).item()
            for kind, factor in (("row", rows), ("tensor", whole)):
                if (_cosines(weight, gradient, per_row=kind == "row").max() <= CANDIDATE_COSINE
                        and (evaluate(name, factor.to(weight) if kind == "row" else factor)
                             - reference).abs().max().item() <= tolerance):
                    kinds[name] = kind
                    break
    return kinds


def invariance_record(kinds: Mapping[str, str]) -> dict:
    """``scale_invariance``'s answer as a run records it: the names of each kind found
    (``none`` counted only) and every kind's count."""
    record = {kind: sorted(name for name, found in kinds.items() if found == kind)
              for kind in KINDS if kind != "none"}
    return {**record, "counts": {kind: sum(found == kind for found in kinds.values())
                                 for kind in KINDS}}


def _float64_copy(model: nn.Module) -> nn.Module:
    """A float64 copy in training mode with negligible eps, on this process alone (norms that
    share batch statistics across replicas keep them local)."""
    base = copy.deepcopy(model).to(torch.float64).train()
    for module in base.modules():
        for attribute in _EPS_NAMES:
            value = getattr(module, attribute, None)  # a class's default included
            if isinstance(value, float) and value > 0:
                setattr(module, attribute, TINY_EPS)
        if module.__dict__.get("sync_stats") is True:
            module.sync_stats = False
    return base


def _gradients(base: nn.Module, chosen: list[str], outputs, reference: torch.Tensor,
               seed: int) -> dict[str, torch.Tensor]:
    """The gradient of a fixed random projection of the outputs (invariant wherever they are)."""
    trial = copy.deepcopy(base)
    direction = torch.randn(reference.shape, generator=torch.Generator().manual_seed(seed),
                            dtype=torch.float64).to(reference.device)
    with _seeded(seed, trial):
        (_flat(outputs(trial)) * direction).sum().backward()
    params = dict(trial.named_parameters())
    return {name: params[name].grad for name in chosen}


def _cosines(weight: torch.Tensor, gradient: torch.Tensor, per_row: bool) -> torch.Tensor:
    """|cos| of gradient and weight, per output row or of the whole tensor (0 where either is 0)."""
    shape = (weight.shape[0], -1) if per_row else (1, -1)
    w, g = weight.reshape(shape), gradient.reshape(shape)
    norms = w.norm(dim=1) * g.norm(dim=1)
    return ((w * g).sum(dim=1).abs() / norms.clamp_min(torch.finfo(norms.dtype).tiny)).where(
        norms > 0, torch.zeros_like(norms))


def _log_uniform(shape, generator: torch.Generator) -> torch.Tensor:
    """Positive factors in [0.5, 2], as likely to halve as to double."""
    return torch.exp2(torch.rand(shape, generator=generator, dtype=torch.float64) * 2 - 1)


def _flat(outputs: Outputs) -> torch.Tensor:
    if torch.is_tensor(outputs):
        return outputs.to(torch.float64).reshape(-1)
    values = outputs.values() if isinstance(outputs, Mapping) else outputs
    return torch.cat([_flat(value) for value in values])


@contextmanager
def _seeded(seed: int, model: nn.Module) -> Iterator[None]:
    """The same draws in every forward (dropout, sampling), the caller's RNG left as it was."""
    devices = sorted({p.device.index or 0 for p in model.parameters() if p.device.type == "cuda"})
    with torch.random.fork_rng(devices=devices):
        torch.manual_seed(seed)
        yield
