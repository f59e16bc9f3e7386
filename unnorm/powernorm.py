"""PowerNorm (Shen et al., ICML 2020), following sIncerass/powernorm's ``MaskPowerNorm``.

``pn`` is the offline variant without the layer-scale (PN-dagger in the UN paper); ``pn_ls``
puts the release's GroupScaling in front, which divides each position by its own group
second moment and so makes the norm online.
"""
from __future__ import annotations

import torch

from .base import check_momentum, upcast
from .estimated import EstimatedNorm, StepPlan
from .simple import rms_normalize


class PowerNorm(EstimatedNorm):
    """PN: running quadratic mean in forward, EMA-corrected gradient in backward.

    Args:
        momentum: alpha_fwd of the running quadratic mean.
        momentum_bwd: alpha_bkw of the gradient EMA.
        layer_scale: apply the release's GroupScaling first (``pn_ls``; online).
        group_num: groups of the layer-scale (the number of attention heads).
        padded_in_backward: with a pad mask, the forward statistic covers the valid
            positions only, while the backward's means (of ``g z`` and ``z^2``, which feed
            the gradient EMA) run over every position, padded ones included: what
            MaskPowerNorm does, and what the paper's PN rows were trained with. False
            leaves padded positions out of the backward too (exact masking).
    """

    inference_stat = "running_phi"
    tracks_corrected_gradient = True

    def __init__(self, num_features: int, warmup_iters: int = 10000, momentum: float = 0.9,
                 momentum_bwd: float = 0.9, eps: float = 1e-5, layer_scale: bool = False,
                 group_num: int = 1, padded_in_backward: bool = True, sync_stats: bool = False,
                 device=None, dtype=None):
        super().__init__(num_features, eps=eps, momentum=momentum, warmup_iters=warmup_iters,
                         sync_stats=sync_stats, device=device, dtype=dtype)
        if layer_scale and (group_num < 1 or num_features % group_num):
            raise ValueError(f"group_num must divide num_features ({num_features}), got {group_num}")
        self.momentum_bwd = check_momentum("momentum_bwd", momentum_bwd)
        self.layer_scale = bool(layer_scale)
        self.group_num = int(group_num)
        self.grad_stat_over_valid = not padded_in_backward
        self.offline = self.offline_for(layer_scale=self.layer_scale)
        self.register_buffer("running_phi", torch.ones(num_features, device=device))
        self.register_buffer("ema_grad", torch.zeros(num_features, device=device))

    @classmethod
    def offline_for(cls, *, layer_scale: bool, **options) -> bool:
        """The layer-scale divides each position by its own statistic: ``pn_ls`` is online."""
        return not layer_scale

    def extra_repr(self) -> str:
        text = (f"{super().extra_repr()}, warmup={self.warmup_iters}, "
                f"momentum=({self.momentum}, {self.momentum_bwd})")
        if self.grad_stat_over_valid:
            text += ", padded_in_backward=False"
        return text + (f", layer_scale=groups:{self.group_num}" if self.layer_scale else "")

    def inference_affine(self):
        if self.layer_scale:
            raise RuntimeError("pn_ls is online (its layer-scale depends on each position): "
                               "it has no fixed inference affine; use pn to fold")
        return super().inference_affine()

    def _normalize(self, rows, valid):
        return super()._normalize(self._statistic_input(rows), valid)

    def _statistic_input(self, rows):
        return self._group_scale(rows) if self.layer_scale else rows

    def _group_scale(self, rows: torch.Tensor) -> torch.Tensor:
        """Divide each channel group of each position by its root mean square."""
        grouped = upcast(rows).reshape(-1, self.num_features // self.group_num)
        return rms_normalize(grouped, self.eps).reshape(rows.shape)

    def _plan_step(self, s, t):
        eps, alpha, phi = self.eps, self.momentum, self.running_phi
        inv_batch = torch.rsqrt(s + eps)
        inv_std = torch.where(t <= self.warmup_iters, inv_batch, torch.rsqrt(phi + eps))
        steps = t.float()  # the release first takes a cumulative average during warm-up
        averaged = torch.where(t < self.warmup_iters, phi * (steps - 1) / steps + s / steps, phi)
        # the release divides the gradient by the batch statistic even after warm-up
        return StepPlan(step=t, inv_std=inv_std, inv_std_bwd=inv_batch,
                        state={"running_phi": alpha * averaged + (1 - alpha) * s})

    def _gradient_estimate(self, q, plan):
        return (1 - self.momentum_bwd) * self.ema_grad, {}

    def _corrected_gradient_state(self, grad_stat, psi, mean_z_sq):
        # ema += mean((g - z psi) z) = q - psi * mean(z^2)
        return {"ema_grad": self.ema_grad + grad_stat - psi * mean_z_sq}
