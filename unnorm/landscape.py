"""Loss-landscape probes during training: how far the loss and its gradient move along the
step an update is about to take.

Santurkar et al. ("How Does Batch Normalization Help Optimization?", NeurIPS 2018, Fig. 4)
measure, at an update with gradient g = grad L(W) of the update's batch, over step sizes eta:

- the loss landscape: the range (min, max) of L(W - eta g);
- the gradient's predictiveness: ||grad L(W) - grad L(W - eta g)||;
- the effective beta-smoothness: the largest ||grad L(W) - grad L(W - eta g)|| / ||eta g||.

A course study of norms in a Post-LN encoder (``shared/paper/course_study.yaml``) reports
"Lipschitz", the largest |L(W) - L(W - alpha g)|, and "smoothness", the largest
||grad L(W) - grad L(W - alpha g)||, over alpha in (0, lr).

The direction is the raw gradient of the update's loss, g, as both works define it: the
gradient its backward left, before clipping, weight decay or the optimizer's own rescaling
(Adam's), unscaled by the AMP loss scale. It is the update's direction for plain SGD (the
study trains so); with momentum or Adam the update goes elsewhere and this still measures
the landscape along the gradient. So the study's smoothness is the predictiveness by
definition; the records keep both names. The grid is linear, eta_i = lr * i / points for
i = 1..points, ending at the update's learning rate.

Every point is a forward and backward of the update's own batch in training mode, with the
norms' state at the update's start (what the update's forward saw) and the random streams
the update's forward drew from (the same dropout masks at every point). Afterwards the
weights, gradients, buffers, the norms' update-start copies and pending calls, and the RNG
streams are as the update left them: the run trains bit for bit as without the probe.
"""
from __future__ import annotations

import math
from contextlib import contextmanager
from typing import Callable, Iterator, Optional, Sequence

import torch
from torch import nn

from .base import ChannelNorm, GuardedNorm, upcast

#: step sizes a probe evaluates, linearly spaced in (0, lr]
POINTS = 8


def step_grid(lr: float, points: int = POINTS) -> list[float]:
    """The probe's step sizes: ``lr * i / points`` for i = 1..points (the last is ``lr``)."""
    if points < 1:
        raise ValueError(f"a landscape probe needs at least one step size, got points={points}")
    if not (math.isfinite(lr) and lr > 0):
        raise ValueError(f"a landscape probe steps up to the learning rate, which must be "
                         f"positive and finite, got {lr!r}")
    return [lr * i / points for i in range(1, points + 1)]


class RandomStreams:
    """The RNG streams as they are when it is made: torch's (CPU, and the CUDA ``devices``)
    and any further ``(getstate, setstate)`` pairs (Python's ``random``, numpy's: what a
    task's forward draws mixup from). ``restore()`` puts them back there."""

    def __init__(self, devices: Sequence[int] = (), streams: Sequence[tuple[Callable, Callable]] = ()):
        self.devices = list(devices)
        self.cpu = torch.get_rng_state()
        self.cuda = [torch.cuda.get_rng_state(device) for device in self.devices]
        self.streams = [(setstate, getstate()) for getstate, setstate in streams]
        self._pairs = list(streams)

    def restore(self) -> None:
        torch.set_rng_state(self.cpu)
        for device, state in zip(self.devices, self.cuda):
            torch.cuda.set_rng_state(state, device)
        for setstate, state in self.streams:
            setstate(state)

    def now(self) -> "RandomStreams":
        """The same streams' states as they are now."""
        return RandomStreams(self.devices, self._pairs)


class UpdateProbe:
    """Made at an optimizer update's start, before its first forward: the model's buffers
    (the norms' running statistics and step counters) and the RNG streams there. Once the
    update's backward has left its gradients, ``measure`` probes the landscape along them.

    ``params``: the trained parameters (the optimizer's); ``devices``, ``streams``: the RNG
    streams the update's forward draws from (``RandomStreams``)."""

    def __init__(self, model: nn.Module, params: Sequence[torch.Tensor], *,
                 devices: Sequence[int] = (), streams: Sequence[tuple[Callable, Callable]] = ()):
        self.model, self.params = model, [p for p in params if p.requires_grad]
        self.buffers = _buffers(model)
        self.random = RandomStreams(devices, streams)

    @torch.no_grad()
    def measure(self, evaluate: Callable[[], torch.Tensor], loss: torch.Tensor, lr: float, *,
                points: int = POINTS, grad_scale: float = 1.0) -> dict:
        """The landscape along the gradient the update's backward left (``loss`` its loss),
        over ``step_grid(lr, points)``. ``evaluate()`` recomputes the update's loss at the
        current weights the way the update did (its micro-batches, forward and backward,
        under its autocast) and returns it; its gradients carry ``grad_scale`` (a GradScaler's
        scale), divided out here. Returns the record (``landscape_record``)."""
        etas = step_grid(lr, points)
        weights = [p.detach().clone() for p in self.params]
        gradient = [_grad(p) / grad_scale for p in self.params]
        losses, differences = [], []
        with kept(self.model, self.params, self.random.now()):
            for eta in etas:
                _load(self.model, self.buffers)
                self.random.restore()
                for p, w, g in zip(self.params, weights, gradient):
                    p.copy_(w - eta * g)
                    p.grad = None
                with torch.enable_grad():
                    losses.append(upcast(evaluate().detach()).reshape(()))
                differences.append(_norm([_grad(p) / grad_scale - g
                                          for p, g in zip(self.params, gradient)]))
        grad_norm = _norm(gradient)
        values = torch.stack([t.double().reshape(()) for t in (loss.detach(), grad_norm, *losses,
                                                               *differences)]).tolist()  # one host read
        return landscape_record(etas, values[0], values[1], values[2:2 + points], values[2 + points:])


def landscape_record(etas: Sequence[float], loss: float, grad_norm: float,
                     losses: Sequence[float], differences: Sequence[float]) -> dict:
    """A probe's record: the grid ``eta``, the loss at W (``loss``) and along the step
    (``losses``), ||g|| (``grad_norm``), ||grad L(W) - grad L(W - eta g)|| (``grad_differences``),
    and the summaries: ``loss_min``, ``loss_max`` (the loss landscape's band along the step),
    ``predictiveness`` (the largest gradient difference), ``beta`` (the largest gradient
    difference over ||eta g||; null when g = 0), ``lipschitz`` (the largest |L(W) - L(W - eta
    g)|) and ``smoothness`` (the study's name for the predictiveness)."""
    betas = [d / (eta * grad_norm) for eta, d in zip(etas, differences) if grad_norm > 0]
    return {"eta": list(etas), "loss": loss, "grad_norm": grad_norm, "losses": list(losses),
            "grad_differences": list(differences), "loss_min": min(losses),
            "loss_max": max(losses), "predictiveness": max(differences),
            "beta": max(betas) if betas else None,
            "lipschitz": max(abs(loss - value) for value in losses),
            "smoothness": max(differences)}


@contextmanager
def kept(model: nn.Module, params: Sequence[torch.Tensor], random: RandomStreams) -> Iterator[None]:
    """Within the block, anything may move the model: on exit its ``params``' values and
    gradients, every buffer, the norms' update-start copies (``unnorm.UpdateStart``) and
    pending calls, and the RNG streams (``random``, made before the block) are put back bit
    for bit. The norms' statistics and GNS taps record nothing of the block."""
    weights = [p.detach().clone() for p in params]
    grads = [(p.grad, None if p.grad is None else p.grad.clone()) for p in params]
    buffers = _buffers(model)
    norms = [m for m in model.modules() if isinstance(m, ChannelNorm)]
    tapped = [(norm, norm._tap, norm._gns) for norm in norms
              if norm._tap is not None or norm._gns is not None]
    guarded = [(norm, _update_start(norm), list(norm._pending_calls or ()))
               for norm in norms if isinstance(norm, GuardedNorm)]
    for norm, _, _ in tapped:
        norm._tap = norm._gns = None
    try:
        yield
    finally:
        with torch.no_grad():
            for p, w, (grad, values) in zip(params, weights, grads):
                p.copy_(w)
                if grad is not None:  # the same tensor (DDP's bucket views alias it)
                    grad.copy_(values)
                p.grad = grad
            _load(model, buffers)
            for norm, start, calls in guarded:
                if start is not None:
                    for value, saved in zip(_flat(norm._update_start), start):
                        value.copy_(saved)
                if norm._pending_calls is not None:
                    norm._pending_calls[:] = calls
        for norm, tap, gns in tapped:
            norm._tap, norm._gns = tap, gns
        random.restore()


def _buffers(model: nn.Module) -> dict[str, torch.Tensor]:
    """Copies of every buffer, non-persistent ones included."""
    return {name: buffer.detach().clone() for name, buffer in model.named_buffers()}


@torch.no_grad()
def _load(model: nn.Module, buffers: dict[str, torch.Tensor]) -> None:
    for name, buffer in model.named_buffers():
        buffer.copy_(buffers[name])


def _flat(update_start: tuple[torch.Tensor, dict]) -> list[torch.Tensor]:
    first_call, state = update_start
    return [first_call, *state.values()]


def _update_start(norm: GuardedNorm) -> Optional[list[torch.Tensor]]:
    return None if norm._update_start is None else [t.clone() for t in _flat(norm._update_start)]


def _grad(p: torch.Tensor) -> torch.Tensor:
    """A parameter's gradient in float32, float64 for a float64 parameter (zeros where the
    loss did not reach it)."""
    return upcast(torch.zeros_like(p) if p.grad is None else p.grad.detach())


def _norm(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """The L2 norm of tensors taken together, each in its own precision, summed in float64."""
    if not tensors:
        return torch.zeros((), dtype=torch.float64)
    return torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(t).double()
                                                 for t in tensors]))
