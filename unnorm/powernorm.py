"""PowerNorm (Shen et al., ICML 2020), following sIncerass/powernorm's ``MaskPowerNorm``.

``pn`` is the offline variant without the layer-scale (PN-dagger in the UN paper); ``pn_ls``
puts the release's GroupScaling in front, which divides each position by its own group
second moment and so makes the norm online.
"""
from __future__ import annotations

import torch

from .estimated import EstimatedNorm, StepPlan


class PowerNorm(EstimatedNorm):
    """PN: running quadratic mean in forward, EMA-corrected gradient in backward.

    Args:
        momentum: alpha_fwd of the running quadratic mean.
        momentum_bwd: alpha_bkw of the gradient EMA.
        layer_scale: apply the release's GroupScaling first (``pn_ls``; online).
        group_num: groups of the layer-scale (the number of attention heads).
    """

    def __init__(self, num_features: int, warmup_iters: int = 10000, momentum: float = 0.9,
                 momentum_bwd: float = 0.9, eps: float = 1e-5, layer_scale: bool = False,
                 group_num: int = 1, sync_stats: bool = False, device=None, dtype=None):
        super().__init__(num_features, eps=eps, momentum=momentum, warmup_iters=warmup_iters,
                         sync_stats=sync_stats, device=device, dtype=dtype)
        if layer_scale and (group_num < 1 or num_features % group_num):
            raise ValueError(f"group_num must divide num_features ({num_features}), got {group_num}")
        self.momentum_bwd = float(momentum_bwd)
        self.layer_scale = bool(layer_scale)
        self.group_num = int(group_num)
        self.offline = not self.layer_scale
        self.register_buffer("running_phi", torch.ones(num_features, device=device))
        self.register_buffer("ema_grad", torch.zeros(num_features, device=device))

    def extra_repr(self) -> str:
        text = (f"{super().extra_repr()}, warmup={self.warmup_iters}, "
                f"momentum=({self.momentum}, {self.momentum_bwd})")
        return text + (f", layer_scale=groups:{self.group_num}" if self.layer_scale else "")

    inference_stat = "running_phi"

    def inference_affine(self):
        if self.layer_scale:
            raise RuntimeError("pn_ls is online (its layer-scale depends on each position): "
                               "it has no fixed inference affine; use pn to fold")
        return super().inference_affine()

    def _normalize(self, rows, valid):
        if self.layer_scale:
            rows = self._group_scale(rows)
        return super()._normalize(rows, valid)

    def _group_scale(self, rows: torch.Tensor) -> torch.Tensor:
        """Divide each channel group of each position by its root mean square."""
        grouped = rows.float().reshape(rows.shape[0], self.group_num, -1)
        scaled = grouped * torch.rsqrt(grouped.square().mean(dim=-1, keepdim=True) + self.eps)
        return scaled.reshape(rows.shape)

    def _plan_step(self, s):
        t, eps, alpha, phi = self.step, self.eps, self.momentum, self.running_phi
        inv_batch = torch.rsqrt(s + eps)
        inv_std = inv_batch if t <= self.warmup_iters else torch.rsqrt(phi + eps)
        if t < self.warmup_iters:  # the release first takes a cumulative average
            phi.mul_((t - 1) / t).add_(s, alpha=1 / t)
        phi.mul_(alpha).add_(s, alpha=1 - alpha)
        # the release divides the gradient by the batch statistic even after warm-up
        return StepPlan(step=t, inv_std=inv_std, inv_std_bwd=inv_batch)

    def _gradient_estimate(self, q, plan):
        return (1 - self.momentum_bwd) * self.ema_grad

    def _observe_corrected_gradient(self, grad_stat, psi, second_moment, valid_fraction, plan):
        # ema += mean((g - z psi) z) = q - psi * mean(z^2), means over all rows, pads zero
        mean_z_sq = plan.inv_std.square() * second_moment * valid_fraction
        self.ema_grad.add_(grad_stat - psi * mean_z_sq)
