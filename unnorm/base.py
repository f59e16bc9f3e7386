"""What every norm of the package shares: channels-last flattening, pad masks, float32
statistics, the affine parameters and the statistics tap.

A norm sees its input as ``(N, C)`` rows (every leading axis flattened), computes its
statistics in float32 over the valid rows, and returns the input's dtype.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist
from torch import nn


class ChannelNorm(nn.Module):
    """Base of all norms: ``forward(x, pad_mask=None)`` on ``(..., C)`` input.

    Subclasses implement ``_normalize(rows, valid)`` on float-or-input-dtype rows ``(N, C)``
    and a boolean ``valid`` row mask (None when there is no padding) and set ``offline``.
    """

    offline: bool = False

    def __init__(self, num_features: int, eps: float = 1e-5, device=None, dtype=None):
        super().__init__()
        if not isinstance(num_features, int) or num_features < 1:
            raise ValueError(f"num_features must be a positive int, got {num_features!r}")
        self.num_features = num_features
        self.eps = float(eps)
        factory = {"device": device, "dtype": dtype}
        self.weight = nn.Parameter(torch.ones(num_features, **factory))
        self.bias = nn.Parameter(torch.zeros(num_features, **factory))
        self._tap = None  # a statistics tap (unnorm.stats) while recording, else None

    def extra_repr(self) -> str:
        return f"{self.num_features}, eps={self.eps}"

    def forward(self, x: torch.Tensor, pad_mask: Optional[torch.Tensor] = None) -> torch.Tensor:
        if x.dim() < 1 or x.shape[-1] != self.num_features:
            raise ValueError(
                f"{type(self).__name__} expects channels-last input (..., {self.num_features}), "
                f"got shape {tuple(x.shape)}; move the channel axis last (e.g. x.permute(0, 2, 3, 1) "
                "for NCHW maps)")
        valid = None
        if pad_mask is not None:
            if pad_mask.shape != x.shape[:-1]:
                raise ValueError(
                    f"pad_mask must have the leading shape of x {tuple(x.shape[:-1])} "
                    f"(True = padding), got {tuple(pad_mask.shape)}; transpose fairseq's (B, T) "
                    "mask to (T, B) for time-first input")
            valid = ~pad_mask.reshape(-1).to(torch.bool)
        rows = x.reshape(-1, self.num_features)
        return self._normalize(rows, valid).to(x.dtype).reshape(x.shape)

    def _normalize(self, rows: torch.Tensor, valid: Optional[torch.Tensor]) -> torch.Tensor:
        raise NotImplementedError

    @property
    def _recording(self) -> bool:
        """Statistics are recorded for training steps only."""
        return self._tap is not None and self.training

    def _affine(self, z: torch.Tensor, valid: Optional[torch.Tensor]) -> torch.Tensor:
        """``weight * z + bias`` in float32 (z float32)."""
        z = self._watch_grad(z, valid)
        return torch.addcmul(self.bias.float(), z, self.weight.float())

    def _watch_grad(self, z: torch.Tensor, valid: Optional[torch.Tensor]) -> torch.Tensor:
        """When recording, hook dL/dz to record mean(g * z). Returns the tensor to use as z:
        a fresh leaf when the input carries no gradient (e.g. a model's first norm)."""
        if not self._recording or not torch.is_grad_enabled():
            return z
        if not z.requires_grad:
            z = z.detach().requires_grad_(True)
        tap, z_value = self._tap, z.detach()  # detached: no graph -> hook -> z cycle
        z.register_hook(lambda g: tap.record_grad(grad_channel_mean(g * z_value, valid)))
        return z


class OfflineNorm(ChannelNorm):
    """A norm whose inference is a fixed per-channel affine ``x * scale + shift``."""

    offline = True

    def inference_affine(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``(scale, shift)`` in float32 such that eval output is ``x * scale + shift``."""
        raise NotImplementedError


class StepCounted(OfflineNorm):
    """An offline norm with a training-step counter held on the module as a Python int.

    The counter decides warm-up and window phases on the host without reading the device
    (no ``.item()`` per step); the ``num_iters`` buffer mirrors it for checkpoints, and
    loading a state dict resynchronises the host copy once.
    """

    def __init__(self, num_features: int, eps: float = 1e-5, device=None, dtype=None):
        super().__init__(num_features, eps=eps, device=device, dtype=dtype)
        self.register_buffer("num_iters", torch.zeros((), dtype=torch.long, device=device))
        self.step = 0
        self.register_load_state_dict_post_hook(_sync_step)

    def _advance(self) -> int:
        self.step += 1
        self.num_iters.add_(1)
        return self.step

    def reset_step(self) -> None:
        """Restart the step counter (fine-tuning from other weights re-runs warm-up)."""
        self.step = 0
        self.num_iters.zero_()


def _sync_step(module: StepCounted, incompatible_keys) -> None:
    module.step = int(module.num_iters)


def replicas_active(sync: bool) -> bool:
    """True when statistics are to be summed across data-parallel replicas."""
    return sync and dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def sum_over_replicas(*tensors: torch.Tensor, differentiable: bool = False) -> list[torch.Tensor]:
    """All-reduce (sum) small per-channel tensors in one collective."""
    flat = torch.cat([t.reshape(-1) for t in tensors])
    if differentiable:
        flat = _AllReduceSum.apply(flat)
    else:
        dist.all_reduce(flat)
    return list(flat.split([t.numel() for t in tensors]))


class _AllReduceSum(torch.autograd.Function):
    """Sum over replicas whose gradient is the sum of every replica's gradient."""

    @staticmethod
    def forward(ctx, tensor):
        tensor = tensor.clone()
        dist.all_reduce(tensor)
        return tensor

    @staticmethod
    def backward(ctx, grad):
        grad = grad.clone()
        dist.all_reduce(grad)
        return grad


def channel_sum_sq(rows: torch.Tensor, valid: Optional[torch.Tensor],
                   sync: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-channel sum of x^2 over the valid rows (of every replica with ``sync``) and their
    count, in float32."""
    rows = rows.float()
    if valid is None:
        total = torch.linalg.vector_norm(rows, dim=0).square()
        count = torch.full((1,), float(rows.shape[0]), device=rows.device)
    else:
        total = zero_padding(rows, valid).square().sum(dim=0)
        count = valid.to(rows.dtype).sum().reshape(1)
    if replicas_active(sync):
        total, count = sum_over_replicas(total, count)
    return total, count.clamp_min(1)


def channel_mean_sq(rows: torch.Tensor, valid: Optional[torch.Tensor]) -> torch.Tensor:
    """Per-channel mean of x^2 over the valid rows, in float32."""
    total, count = channel_sum_sq(rows, valid)
    return total / count


def grad_channel_mean(gz: torch.Tensor, valid: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Per-channel mean of ``g * z`` over ALL rows, padded rows contributing zero.

    The releases of UN and PowerNorm average over every position (their hosts give padding
    zero gradient); zeroing the padded rows keeps that normaliser while making the statistic
    independent of whatever sits at padded positions.
    """
    if valid is None:
        return gz.mean(dim=0)
    return zero_padding(gz, valid).sum(dim=0) / gz.shape[0]


def zero_padding(rows: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """Rows with padded rows set to zero (a select, so even inf or NaN padding cannot leak)."""
    return torch.where(valid[:, None], rows, torch.zeros((), dtype=rows.dtype, device=rows.device))


def window_slot(step: int, size: int) -> int:
    """Ring-buffer slot written at step ``t`` (the releases use ``t mod M``)."""
    return step % size
