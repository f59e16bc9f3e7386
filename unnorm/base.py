"""What every norm of the package shares: channels-last flattening, pad masks, float32
statistics, the affine parameters, the statistics tap, and the guarded running state.

A norm sees its input as ``(N, C)`` rows (every leading axis flattened), computes its
statistics in float32 (float64 for float64 input) over the valid rows, and returns the
input's dtype.
"""
from __future__ import annotations

import math
import warnings
from typing import Callable, Optional

import torch
import torch.distributed as dist
from torch import nn


def upcast(tensor: torch.Tensor) -> torch.Tensor:
    """The precision statistics are computed in: float32, or float64 for float64 input."""
    return tensor if tensor.dtype == torch.float64 else tensor.float()


class ChannelNorm(nn.Module):
    """Base of all norms: ``forward(x, pad_mask=None)`` on ``(..., C)`` input.

    Subclasses implement ``_normalize(rows, valid)`` on float-or-input-dtype rows ``(N, C)``
    and a boolean ``valid`` row mask (None when there is no padding).
    """

    #: inference is a fixed per-channel affine (foldable into a linear layer); the class
    #: decides it, and ``offline_for`` where an option does
    offline: bool = False
    #: the factor the loss was multiplied by in this update (a 0-dim float32 tensor shared by
    #: the model's norms), set by ``unnorm.LossScaleGuard``; None: gradients are unscaled
    loss_scale: Optional[torch.Tensor] = None
    #: the learnable per-channel affine: the parameters whose per-example gradients give the
    #: gradient noise scale (``unnorm.gns``)
    affine_names: tuple[str, ...] = ("weight", "bias")
    #: the statistics and gradient-noise-scale taps while recording (unnorm.stats, unnorm.gns);
    #: class defaults, so a module pickled before either existed still runs
    _tap = None
    _gns = None

    def __init__(self, num_features: int, eps: float = 1e-5, bias: bool = True, device=None,
                 dtype=None):
        super().__init__()
        if not isinstance(num_features, int) or num_features < 1:
            raise ValueError(f"num_features must be a positive int, got {num_features!r}")
        if not (isinstance(eps, (int, float)) and math.isfinite(eps) and eps > 0):
            raise ValueError(f"eps must be a positive number (it keeps 1/sqrt(v + eps) finite), "
                             f"got {eps!r}; the usual value is 1e-5")
        self.num_features = num_features
        self.eps = float(eps)
        factory = {"device": device, "dtype": dtype}
        self.weight = nn.Parameter(torch.ones(num_features, **factory))
        # bias=False: no shift, as torch's LayerNorm(bias=False) and Llama's RMSNorm
        self.register_parameter("bias", nn.Parameter(torch.zeros(num_features, **factory))
                                if bias else None)

    @classmethod
    def offline_for(cls, **options) -> bool:
        """Whether a norm built with ``options`` is offline, known before building it (the
        registry's ``is_offline``). A norm whose options decide it overrides this."""
        return cls.offline

    def extra_repr(self) -> str:
        return f"{self.num_features}, eps={self.eps}"

    def forward(self, x: torch.Tensor, pad_mask: Optional[torch.Tensor] = None) -> torch.Tensor:
        if x.dim() < 1 or x.shape[-1] != self.num_features:
            raise ValueError(
                f"{type(self).__name__} expects channels-last input (..., {self.num_features}), "
                f"got shape {tuple(x.shape)}; move the channel axis last (e.g. x.permute(0, 2, 3, 1) "
                "for NCHW maps)")
        if not x.is_floating_point():
            raise TypeError(f"{type(self).__name__} expects a floating-point input, got {x.dtype}; "
                            "convert it first (x.float())")
        valid = None
        if pad_mask is not None:
            if pad_mask.dtype != torch.bool:
                raise TypeError(f"pad_mask must be a bool tensor (True = padding), got {pad_mask.dtype}; "
                                "pass e.g. tokens.eq(pad_index) or mask.bool()")
            if pad_mask.shape != x.shape[:-1]:
                raise ValueError(
                    f"pad_mask must have the leading shape of x {tuple(x.shape[:-1])} "
                    f"(True = padding), got {tuple(pad_mask.shape)}; transpose fairseq's (B, T) "
                    "mask to (T, B) for time-first input")
            valid = ~pad_mask.reshape(-1)
        if self._gns is not None and self.training:
            self._gns.begin(x.shape[:-1], valid)  # which rows are which example's
        rows = x.reshape(-1, self.num_features)
        return self._normalize(rows, valid).to(x.dtype).reshape(x.shape)

    def _normalize(self, rows: torch.Tensor, valid: Optional[torch.Tensor]) -> torch.Tensor:
        raise NotImplementedError

    @property
    def _recording(self) -> bool:
        """Statistics are recorded for training steps only."""
        return self._tap is not None and self.training

    def affine_parameters(self) -> dict[str, nn.Parameter]:
        """The learnable affine parameters this norm has (none for NoNorm)."""
        return {name: getattr(self, name) for name in self.affine_names
                if isinstance(getattr(self, name, None), nn.Parameter)}

    def _affine(self, z: torch.Tensor, valid: Optional[torch.Tensor]) -> torch.Tensor:
        """``weight * z + bias`` in float32 (z float32); ``weight * z`` without a bias."""
        z_value = z.detach()
        z = self._watch_grad(z, valid)
        if self.bias is None:
            out = z * upcast(self.weight)
        else:
            out = torch.addcmul(upcast(self.bias), z, upcast(self.weight))
        return self._watch_affine(out, lambda: {"weight": z_value, "bias": None})

    def _watch_affine(self, out: torch.Tensor,
                      factors: Callable[[], dict[str, Optional[torch.Tensor]]]) -> torch.Tensor:
        """When recording the gradient noise scale, hook dL/d(out) to record the per-example
        gradients of the affine parameters. ``factors()``, called in the backward (so a
        factor costs no memory until then), gives for each parameter name the tensor that
        multiplies dL/d(out) row by row into that parameter's gradient (None: 1, a bias)."""
        if self._gns is None or not self.training or not builds_graph(out):
            return out
        tap, examples, scale, trained = self._gns, self._gns.current, self.loss_scale, {
            name for name, param in self.affine_parameters().items() if param.requires_grad}
        out.register_hook(lambda dy: tap.record(
            dy, examples, [f for name, f in factors().items() if name in trained], scale))
        return out

    def _watch_grad(self, z: torch.Tensor, valid: Optional[torch.Tensor]) -> torch.Tensor:
        """When recording, hook dL/dz to record mean(g * z). Returns the tensor to use as z:
        a fresh leaf when the input carries no gradient (e.g. a model's first norm)."""
        if not self._recording or not torch.is_grad_enabled():
            return z
        if not z.requires_grad:
            z = z.detach().requires_grad_(True)
        tap, z_value, scale = self._tap, z.detach(), self.loss_scale  # detached: no cycle
        z.register_hook(lambda g: tap.record_grad(unscaled(grad_channel_mean(g * z_value, valid),
                                                           scale)))
        return z


#: Every default momentum is 0.9-0.98; one below this more likely follows torch's convention.
TORCH_STYLE_MOMENTUM_BELOW = 0.5


def check_momentum(name: str, value) -> float:
    """A momentum option as the paper's alpha: the weight of the OLD value (0.9 keeps 90% of
    the running value per step). torch's BatchNorm momentum is the weight of the NEW batch
    (torch's 0.1 == alpha 0.9), so a small value is warned about, not refused: ablations
    set one on purpose."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0.0 <= value < 1.0:
        raise ValueError(f"{name} (alpha, the weight of the old value) must be in [0, 1), got "
                         f"{value!r}; torch's BatchNorm momentum m is alpha = 1 - m (0.1 -> 0.9)")
    if value < TORCH_STYLE_MOMENTUM_BELOW:
        warnings.warn(
            f"{name}={value} keeps {100 * value:g}% of the running value per step: unnorm's "
            f"{name} is the paper's alpha, the weight of the old value (torch's BatchNorm "
            f"momentum 0.1 == alpha 0.9); pass 1 - {value} = {1 - value:g} for torch's "
            f"behaviour. Values below {TORCH_STYLE_MOMENTUM_BELOW} are allowed (ablations go there on purpose)",
            UserWarning, stacklevel=2)
    return float(value)


def unscaled(grad_stat: torch.Tensor, loss_scale: Optional[torch.Tensor]) -> torch.Tensor:
    """A gradient statistic in the units of the unscaled loss."""
    return grad_stat if loss_scale is None else grad_stat / loss_scale


class OfflineNorm(ChannelNorm):
    """A norm whose inference is a fixed per-channel affine ``x * scale + shift``."""

    offline = True

    def inference_affine(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``(scale, shift)`` in float32 such that eval output is ``x * scale + shift``."""
        raise NotImplementedError


class GuardedNorm(OfflineNorm):
    """An offline norm whose training steps update running state, guarded against bad batches.

    A training step computes its new state (buffers and counters) as candidates and commits
    them when the step's gradient reaches the norm, if the step is clean: its batch had a
    valid row and a finite statistic, and the gradient's statistic is finite. A *rejected*
    step (an empty or all-padding batch, a NaN batch, an fp16 overflow of its own gradient)
    leaves every buffer as it was, so the next clean step trains as if it had never come;
    ``num_rejected`` counts such steps. An update that a GradScaler skips for another
    layer's overflow is taken back by ``unnorm.GradScaler`` (``unnorm.amp``). A training
    forward that builds no graph (no_grad, frozen weights) commits at once; a reentrant
    activation checkpoint's recomputation takes that back, so its step commits once. Every
    decision is a device-side ``torch.where``: no host read, no Python branch on data.

    Committing in the backward also keeps compiled training exact: a buffer that the forward
    mutated could be re-read, already changed, where the backward recomputes from it.
    """

    _migrated = {"num_rejected": 0}  # buffers older checkpoints lack -> their starting value
    _state_before_graphless_step: Optional[dict] = None
    _LOW_PRECISION = (torch.float16, torch.bfloat16)

    def __init__(self, num_features: int, eps: float = 1e-5, device=None, dtype=None):
        super().__init__(num_features, eps=eps, device=device, dtype=dtype)
        self.register_buffer("num_rejected", torch.zeros((), dtype=torch.long, device=device))

    def _apply(self, fn, recurse=True):
        """Casting the module (``.half()``, ``.bfloat16()``, ``.to(dtype)``, as fairseq's
        ``--fp16`` does) leaves the running statistics in float32, as apex's
        ``keep_batchnorm_fp32``: a momentum-0.1 EMA stalls in bf16. The values are kept from
        before the cast, not rounded through it."""
        kept = {name: buffer for name, buffer in self._buffers.items()
                if buffer is not None and buffer.is_floating_point()}
        super()._apply(fn, recurse)
        for name, before in kept.items():
            after = self._buffers[name]
            if after.dtype in self._LOW_PRECISION:
                self._buffers[name] = before.to(device=after.device, dtype=torch.float32)
        return self

    def forward(self, x: torch.Tensor, pad_mask: Optional[torch.Tensor] = None) -> torch.Tensor:
        if self._state_before_graphless_step is not None and self.training and torch.is_grad_enabled():
            self._take_back_graphless_step()
        return super().forward(x, pad_mask)

    def _take_back_graphless_step(self) -> None:
        """Reentrant activation checkpointing runs a training forward twice: under no_grad,
        then again inside the backward, building the graph. The first pass committed at once
        (no backward comes for it); the second must see the state the first saw, and then
        commits once, in its own backward."""
        saved, self._state_before_graphless_step = self._state_before_graphless_step, None
        if torch._C._current_graph_task_id() != -1:  # inside a backward: a recomputation
            for name, value in saved.items():
                self._buffers[name].copy_(value)

    def _commit_without_graph(self, state: dict[str, torch.Tensor], accepted: torch.Tensor) -> None:
        """Commit a training step that builds no graph (no_grad, frozen weights) at once,
        remembering the state it replaced while grad mode is off (see above)."""
        if not torch.is_grad_enabled():
            self._state_before_graphless_step = {name: buffer.clone()
                                                 for name, buffer in self._buffers.items()}
        self._commit_step(state, accepted)

    def _commit_step(self, state: dict[str, torch.Tensor], clean: torch.Tensor) -> None:
        """Write each candidate ``state`` buffer if the step is clean; count a rejection."""
        for name, value in state.items():
            buffer = getattr(self, name)
            buffer.copy_(torch.where(clean, value.to(buffer.dtype), buffer))
        self.num_rejected.add_((~clean).long())
        if self._recording:
            self._tap.record_rejected(~clean)

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs):
        for name, start in self._migrated.items():  # checkpoints from before the buffer existed
            state_dict.setdefault(prefix + name, torch.full_like(getattr(self, name), start))
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)


class StepCounted(GuardedNorm):
    """A guarded norm with a training-step counter, ``num_iters``, kept on the device.

    Every phase decision (warm-up, window filled, compensation active) compares this tensor
    with constants inside ``torch.where``, so a compiled training step is one graph for the
    whole run and CUDA graphs can capture it. A rejected step does not advance the counter.
    """

    def __init__(self, num_features: int, eps: float = 1e-5, device=None, dtype=None):
        super().__init__(num_features, eps=eps, device=device, dtype=dtype)
        self.register_buffer("num_iters", torch.zeros((), dtype=torch.long, device=device))

    def _commit_step(self, state, clean):
        super()._commit_step({**state, "num_iters": self.num_iters + 1}, clean)

    def reset_step(self) -> None:
        """Restart the step counter (fine-tuning from other weights re-runs warm-up)."""
        self.num_iters.zero_()


def statistic_ok(total: torch.Tensor, count: torch.Tensor) -> torch.Tensor:
    """Device-side: the batch has valid rows and its per-channel statistic is finite."""
    return (count > 0).all() & torch.isfinite(total).all()


def builds_graph(*tensors: torch.Tensor) -> bool:
    """Whether autograd will call a backward through these inputs."""
    return torch.is_grad_enabled() and any(t.requires_grad for t in tensors)


class _CommitOnBackward(torch.autograd.Function):
    """Identity in forward; its backward commits the norm's candidate state if the gradient
    has a finite statistic over the valid rows (for norms whose backward is autograd's)."""

    @staticmethod
    def forward(ctx, out, norm: GuardedNorm, names: tuple[str, ...], valid, accepted, *values):
        ctx.norm, ctx.names = norm, names
        ctx.save_for_backward(valid, accepted, *values)
        return out.view_as(out)

    @staticmethod
    def backward(ctx, grad):
        valid, accepted, *values = ctx.saved_tensors
        rows = upcast(grad.reshape(-1, grad.shape[-1]))
        total = channel_sum(rows if valid is None else zero_padding(rows, valid))
        ctx.norm._commit_step(dict(zip(ctx.names, values)), accepted & torch.isfinite(total).all())
        return (grad, None, None, None, None) + (None,) * len(values)


def commit_on_backward(out: torch.Tensor, norm: GuardedNorm, valid: Optional[torch.Tensor],
                       state: dict[str, torch.Tensor], accepted: torch.Tensor) -> torch.Tensor:
    """``out``, whose backward commits ``state`` (or at once when no backward will come)."""
    if not builds_graph(out):
        norm._commit_without_graph(state, accepted)
        return out
    return _CommitOnBackward.apply(out, norm, tuple(state), valid, accepted, *state.values())


def with_slot(window: torch.Tensor, step: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
    """A copy of ``window`` with ``value`` in slot ``step mod M``."""
    slot = torch.remainder(step, window.shape[0]).reshape(1)
    return window.index_copy(0, slot, value.reshape(1, -1))


def replicas_active(sync: bool) -> bool:
    """True when statistics are to be summed across data-parallel replicas."""
    return sync and dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def sum_over_replicas(*tensors: torch.Tensor, differentiable: bool = False) -> list[torch.Tensor]:
    """All-reduce (sum) small tensors in one collective; each keeps its shape."""
    flat = torch.cat([t.reshape(-1) for t in tensors])
    if differentiable:
        flat = _AllReduceSum.apply(flat)
    else:
        dist.all_reduce(flat)
    return [part.reshape(t.shape) for part, t in zip(flat.split([t.numel() for t in tensors]), tensors)]


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


def row_count(rows: torch.Tensor, valid: Optional[torch.Tensor]) -> torch.Tensor:
    """The number of valid rows, as a float ``(1,)`` tensor on the rows' device."""
    if valid is None:
        return torch.ones(1, device=rows.device).mul_(rows.shape[0])
    return valid.float().sum().reshape(1)


@torch.library.custom_op("unnorm::materialize", mutates_args=())
def _materialize(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.clone()


@_materialize.register_fake
def _(tensor: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(tensor)


def per_channel(coefficient: torch.Tensor) -> torch.Tensor:
    """A per-channel coefficient of an ``(N, C)`` pass, computed once. Compiled, inductor
    would otherwise inline its whole chain (window means, ``where``s, ``rsqrt``s) into the
    pass and recompute it for every element (UN's backward ran 1.3x slower on CPU); an
    opaque op makes it a buffer. Eager, it is the tensor itself."""
    return _materialize(coefficient) if torch.compiler.is_compiling() else coefficient


ROW_BLOCK = 64  # rows per partial sum: a block of (64, C) stays in cache while it is reduced


def channel_sum(rows: torch.Tensor) -> torch.Tensor:
    """Per-channel sum of ``(N, C)`` rows, in blocks of rows: compiled, the two-stage form reads
    each block while it is in cache (a plain column sum strides through memory once per
    channel group and ran 2.3x slower on CPU); eager, it costs the same as ``sum(dim=0)``."""
    whole = rows.shape[0] // ROW_BLOCK * ROW_BLOCK
    blocked = rows[:whole].reshape(-1, ROW_BLOCK, rows.shape[1]).sum(dim=1).sum(dim=0)
    return blocked + rows[whole:].sum(dim=0)


def channel_sum_sq(rows: torch.Tensor, valid: Optional[torch.Tensor],
                   sync: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-channel sum of x^2 over the valid rows (of every replica with ``sync``) and their
    count, in float32 (float64 for float64 rows)."""
    rows = upcast(rows)
    if valid is not None:
        rows = zero_padding(rows, valid)
    total = channel_sum(rows.square())
    count = row_count(rows, valid)
    if replicas_active(sync):
        total, count = sum_over_replicas(total, count)
    return total, count


def channel_mean_sq(rows: torch.Tensor, valid: Optional[torch.Tensor]) -> torch.Tensor:
    """Per-channel mean of x^2 over the valid rows, in float32 (float64 for float64 rows)."""
    total, count = channel_sum_sq(rows, valid)
    return total / count.clamp_min(1)


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
