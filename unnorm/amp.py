"""Loss scaling that the norms do not see: a GradScaler's growth, back-off and skipped steps
leave training on the trajectory of the unscaled float32 run.

Two things would otherwise leak. UN, MABN and PN keep gradient statistics (windows, EMAs)
from the gradient they receive, which carries the loss scale: every change of scale would
mix units inside a window. And a norm commits each training call's state (in its forward,
and its backward's), before the scaler knows whether some other gradient (a head weight's,
say) overflowed and the update is to be skipped. ``LossScaleGuard`` tells the norms the scale
(they keep their statistics in unscaled units) and, when an update is skipped, returns every
norm to its state before the update's first training call (a call without a graph, as
reentrant checkpointing and frozen layers make, included) and drops the update's records
from the statistics and GNS taps. Everything stays on the device: no host read, no Python
branch on data.

    scaler = unnorm.GradScaler(model, "cuda")          # torch's GradScaler, norms guarded
    ...
    scaler.scale(loss).backward(); scaler.step(optimizer); scaler.update()

Frameworks with their own loss scaler (fairseq) drive a ``LossScaleGuard`` directly.
"""
from __future__ import annotations

from typing import Union

import torch
from torch import nn

from .base import ChannelNorm, UpdateStart


class LossScaleGuard:
    """The loss scale for every norm of ``model``, and the norms' state kept across an
    update that may be skipped. Create it once the model sits on its device.

    Per optimizer update: ``begin_update(scale)`` before the update's first backward (with
    gradient accumulation, before the first micro-batch's), ``end_update(skipped)`` once
    the update has been taken or skipped. ``skipped_updates`` counts the skipped ones.
    """

    def __init__(self, model: nn.Module):
        self.model = model
        self.norms = [m for m in model.modules() if isinstance(m, ChannelNorm)]
        device = next((t.device for m in self.norms for t in (*m.parameters(), *m.buffers())),
                      torch.device("cpu"))
        self.scale = torch.ones((), device=device)
        self.skipped_updates = torch.zeros((), dtype=torch.long, device=device)
        for norm in self.norms:
            norm.loss_scale = self.scale
        self.update_start = UpdateStart(model)

    def begin_update(self, scale: Union[float, torch.Tensor]) -> None:
        """``scale``: what the loss is multiplied by in this update (a float, or a 0-dim
        tensor such as a GradScaler's, copied on the device)."""
        if isinstance(scale, torch.Tensor):
            if scale.device != self.scale.device:
                raise ValueError(f"the loss scale is on {scale.device} and the norms on "
                                 f"{self.scale.device}: create the guard after moving the model")
            self.scale.copy_(scale.reshape(()))
        else:
            self.scale.fill_(float(scale))

    def end_update(self, skipped: Union[bool, torch.Tensor]) -> None:
        """If the update was skipped, return every norm to its state before the update's
        first training call, and take the update's records out of the taps."""
        skipped = torch.as_tensor(skipped, device=self.scale.device).reshape(()).bool()
        for norm in self.norms:
            for tap in (norm._tap, norm._gns):
                if tap is not None:
                    tap.end_update(skipped)
        self.update_start.restore(skipped)
        self.update_start.new_update()
        self.skipped_updates.add_(skipped.long())


class GradScaler(torch.amp.GradScaler):
    """torch's ``GradScaler`` with the norms of ``model`` guarded (see ``LossScaleGuard``).

    Used exactly as torch's; with gradient accumulation, the update begins at the first
    ``scale()`` after an ``update()``. An update is skipped when the scaler found an inf or
    NaN in any gradient it unscaled, as torch decides it.
    """

    def __init__(self, model: nn.Module, device: str = "cuda", **options):
        super().__init__(device, **options)
        self.guard = LossScaleGuard(model)
        self._updating = False

    def scale(self, outputs):
        scaled = super().scale(outputs)
        if self.is_enabled() and not self._updating:
            self.guard.begin_update(self._scale)
            self._updating = True
        return scaled

    def update(self, new_scale=None) -> None:
        if not self.is_enabled():
            return super().update(new_scale)
        found = [found_inf.to(self.guard.scale.device)
                 for state in self._per_optimizer_states.values()
                 for found_inf in state["found_inf_per_device"].values()]
        super().update(new_scale)  # refuses an update without a step, as torch's does
        if self._updating:
            self.guard.end_update(torch.stack(found).sum() > 0)
            self._updating = False
