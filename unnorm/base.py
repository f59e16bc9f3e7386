"""What every norm of the package shares: channels-last flattening, pad masks, float32
statistics, the affine parameters, the statistics tap, and the guarded running state.

A norm sees its input as ``(N, C)`` rows (every leading axis flattened), computes its
statistics in float32 (float64 for float64 input) over the valid rows, and returns the
input's dtype.
"""
from __future__ import annotations

import math
import warnings
from contextlib import contextmanager
from typing import Callable, Iterator, Optional

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
    #: the learnable affine, per channel or one value for every channel (ScaleNorm's gain): the
    #: parameters whose per-example gradients give the gradient noise scale (``unnorm.gns``)
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

    @property
    def _tapped(self) -> bool:
        """The statistics tap hooks dL/dz in this call (``_watch_grad``): z must be a tensor of
        the graph, so the norm takes its general path, the affine a separate step. The
        gradient-noise-scale tap needs no z in the graph: a fused path hands it z recomputed
        in the backward (``_watch_affine``), and trains bit for bit as without it."""
        return self._recording

    def _affine_weights(self) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
        """``(weight, bias)`` in float32 (bias None without one)."""
        return upcast(self.weight), None if self.bias is None else upcast(self.bias)

    def _affine(self, z: torch.Tensor, valid: Optional[torch.Tensor]) -> torch.Tensor:
        """``weight * z + bias`` in float32 (z float32); ``weight * z`` without a bias."""
        z_value = z.detach()
        z = self._watch_grad(z, valid)
        out = affine(z, *self._affine_weights())
        return self._watch_affine(out, lambda: {"weight": z_value, "bias": None})

    def _watch_affine(self, out: torch.Tensor,
                      factors: Callable[[], dict[str, Optional[torch.Tensor]]]) -> torch.Tensor:
        """When recording the gradient noise scale, hook dL/d(out) to record the per-example
        gradients of the affine parameters. ``factors()``, called in the backward (so a
        factor costs no memory until then), gives for each parameter name the tensor that
        multiplies dL/d(out) row by row into that parameter's gradient (None: 1, a bias)."""
        if self._gns is None or not self.training or not builds_graph(out):
            return out
        tap, examples, scale = self._gns, self._gns.current, self.loss_scale
        shared = {name: param.numel() == 1 for name, param in self.affine_parameters().items()
                  if param.requires_grad}  # trained; one value for every channel
        out.register_hook(lambda dy: tap.record(
            dy, examples, [(f, shared[name]) for name, f in factors().items() if name in shared],
            scale))
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


def affine(z: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor],
           inplace: bool = False) -> torch.Tensor:
    """``weight * z + bias``; ``weight * z`` without a bias. ``inplace`` writes into z (a new
    tensor of the caller's that nothing else reads): no (N, C) allocation, and one pass (an
    ``addcmul`` into z: ``mul_`` then ``add_`` cost 1.7x that on CPU)."""
    if inplace:
        return z.mul_(weight) if bias is None else torch.addcmul(bias, z, weight, out=z)
    return z * weight if bias is None else torch.addcmul(bias, z, weight)


#: Every default momentum is 0.9-0.98; one below this more likely follows torch's convention.
TORCH_STYLE_MOMENTUM_BELOW = 0.5


def forgetting_steps(momentum: float, init_weight: float) -> int:
    """Updates after which a running average ``alpha * running + (1 - alpha) * new`` (alpha =
    ``momentum``) keeps at most ``init_weight`` of its initial value: the smallest n with
    alpha^n <= init_weight (44 at alpha 0.9 and 1%). Before then the average still reports
    its initialisation, not the statistics it has seen."""
    if not 0.0 < init_weight < 1.0:
        raise ValueError(f"init_weight must be in (0, 1), got {init_weight!r}")
    return 1 if momentum == 0 else max(1, math.ceil(math.log(init_weight) / math.log(momentum) - 1e-9))


def forgotten_warmup(warmup: int, full_warmup: int, momenta, init_weight: float) -> int:
    """``warmup`` lengthened until every running average (alpha in ``momenta``) keeps at most
    ``init_weight`` of its initial value, and never past ``full_warmup``: a warm-up that ends
    only once the averages that replace the batch's statistics report what they have seen."""
    longest = max(forgetting_steps(momentum, init_weight) for momentum in momenta)
    return min(full_warmup, max(warmup, longest))


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
    """An offline norm whose training calls update running state, guarded against bad batches.

    The calling contract (``docs/core.md``, "What a training call commits"): every training
    call is one step, as in torch's BatchNorm and the releases. Its forward commits the
    forward state at once (running statistics, forward windows, step counters), so several
    calls before one backward (a shared layer, several views) are consecutive steps. Its
    backward commits the backward state (UN's gradient window and EMA, PN's EMA), once however
    often the graph is backpropagated. A call is *rejected* when its batch has no valid row or
    a non-finite statistic (it commits nothing) or when its gradient statistic is non-finite
    (it is taken back: the norm returns to the state before the call, and calls made since
    are undone with it); ``num_rejected`` counts both. A training call made inside a backward
    is an activation checkpoint's recomputation: it replays, from its starting state, the
    latest call made outside a backward whose backward has not come, and commits nothing again
    (eager; compiled, the recomputation is the graph's own). An update that a GradScaler skips
    is taken back whole by ``unnorm.GradScaler``. Every decision on data is a device-side
    ``torch.where``: no host read, no Python branch on data or on the step.
    """

    _migrated = {"num_rejected": 0}  # buffers older checkpoints lack -> their starting value
    _LOW_PRECISION = (torch.float16, torch.bfloat16)
    #: calls kept for a recomputation (eager): enough for a layer shared by this many
    #: checkpointed segments; older ones, whose backward never came, are forgotten
    MAX_PENDING_CALLS = 16
    _pending_calls: Optional[list] = None
    #: ``(first_call, state)`` while an ``UpdateStart`` watches this norm: the state before
    #: the update's first training call is copied into ``state`` while ``first_call`` is set
    _update_start: Optional[tuple[torch.Tensor, dict]] = None

    #: what evaluation normalises by, for test-time adaptation (``unnorm.test_time``):
    #: "moments", a mean and a variance (BN's); "second_moment", a quadratic mean about 0 (UN's,
    #: MABN's, PN's); "variance", a variance without its mean (EvoNorm-B0's)
    statistic_form: str = "moments"
    #: the running buffers evaluation reads, in that form's order (none: an affine alone)
    eval_statistics: tuple[str, ...] = ()

    def __init__(self, num_features: int, eps: float = 1e-5, device=None, dtype=None):
        super().__init__(num_features, eps=eps, device=device, dtype=dtype)
        self.register_buffer("num_rejected", torch.zeros((), dtype=torch.long, device=device))

    def _eval_buffers(self) -> dict[str, torch.Tensor]:
        return {name: getattr(self, name) for name in self.eval_statistics}

    def _evaluate(self, rows: torch.Tensor, valid: Optional[torch.Tensor],
                  statistics: dict[str, torch.Tensor]) -> torch.Tensor:
        """The evaluation output of float32 ``rows`` (after ``_statistic_input``) normalised
        by ``statistics`` (``eval_statistics`` by name, per channel or per row ``(N, C)``): the
        running buffers in eval, test-time estimates under ``unnorm.test_time``."""
        raise NotImplementedError

    def _statistic_input(self, rows: torch.Tensor) -> torch.Tensor:
        """The rows the statistics are taken over (PN-LS: after its layer-scale)."""
        return rows

    def register_buffer(self, name: str, tensor: Optional[torch.Tensor], persistent: bool = True) -> None:
        """Statistics are float32 also when the norm is built under a half default dtype
        (``from_pretrained(dtype=torch.bfloat16)``), as ``_apply`` keeps them under a cast."""
        if tensor is not None and tensor.dtype in self._LOW_PRECISION:
            tensor = tensor.float()
        super().register_buffer(name, tensor, persistent)

    def _apply(self, fn, recurse=True):
        """Casting the module (``.half()``, ``.bfloat16()``, ``.to(dtype)``, as fairseq's
        ``--fp16`` does) leaves the running statistics in float32, as apex's
        ``keep_batchnorm_fp32``: a momentum-0.1 EMA stalls in bf16. The values are kept from
        before the cast, not rounded through it; integer counters keep their dtype under
        ``.type()`` too (a float16 step counter cannot count past 2048)."""
        kept = {name: buffer for name, buffer in self._buffers.items() if buffer is not None}
        super()._apply(fn, recurse)
        for name, before in kept.items():
            after = self._buffers[name]
            if before.is_floating_point() and after.dtype in self._LOW_PRECISION:
                self._buffers[name] = before.to(device=after.device, dtype=torch.float32)
            elif not before.is_floating_point() and after.dtype != before.dtype:
                self._buffers[name] = before.to(device=after.device)
        return self

    def forward(self, x: torch.Tensor, pad_mask: Optional[torch.Tensor] = None) -> torch.Tensor:
        if self.training and recomputing():
            return self._replay(x, pad_mask)
        return super().forward(x, pad_mask)

    def _state(self) -> dict[str, torch.Tensor]:
        """Every buffer a training call may change (``num_rejected`` only counts)."""
        return {name: buffer for name, buffer in self._buffers.items()
                if buffer is not None and name != "num_rejected"}

    @torch.no_grad()  # statistics that carry a graph (a synced count) must not give it to a buffer
    def _restore(self, state: dict[str, torch.Tensor], where: Optional[torch.Tensor] = None) -> None:
        """Write ``state`` into the buffers (where ``where`` holds, if given)."""
        for name, value in state.items():
            buffer = self._buffers[name]
            buffer.copy_(value if where is None else torch.where(where, value, buffer))

    def _replay(self, x: torch.Tensor, pad_mask: Optional[torch.Tensor]) -> torch.Tensor:
        """A recomputation inside a backward: the call it recomputes, from that call's start,
        recording nothing twice and leaving the state as it found it."""
        if not self._pending_calls:
            raise RuntimeError(
                f"{type(self).__name__}: a training call inside a backward is taken for an "
                "activation checkpoint's recomputation, but no call awaits one; run extra "
                "forwards inside a backward in eval mode, or under torch.no_grad()")
        start, tap = self._pending_calls.pop(), self._tap
        now = {name: buffer.clone() for name, buffer in self._state().items()}
        self._restore(start)
        self._tap = None  # its activation statistics were recorded by the call itself
        try:
            return super().forward(x, pad_mask)
        finally:
            self._tap = tap
            self._restore(now)

    def _commit_forward(self, state: dict[str, torch.Tensor], accepted: torch.Tensor) -> dict:
        """Commit a training call's forward ``state`` if its batch was ``accepted``; count a
        rejection. Returns the state before the call (for a take-back)."""
        start = {name: snapshot(buffer) for name, buffer in self._state().items()}
        if self._update_start is not None:  # what a skipped update and a second pass return to
            first_call, saved = self._update_start
            for name, value in start.items():
                saved[name].copy_(torch.where(first_call, value, saved[name]))
            first_call.fill_(False)
        if not (torch.compiler.is_compiling() or inside_backward()):
            self._remember_call(start)
        self._restore(state, accepted)
        self.num_rejected.add_((~accepted).long())
        return start

    def _commit_graphless(self, state: dict[str, torch.Tensor], accepted: torch.Tensor) -> None:
        """A training call that builds no graph: committed whole now (no backward will come)."""
        self._commit_forward(state, accepted)
        self._record_rejected(~accepted)

    def _remember_call(self, start: dict) -> None:
        calls = self._pending_calls = self._pending_calls or []
        calls.append(start)
        del calls[:-self.MAX_PENDING_CALLS]

    def _forget_call(self, call: Optional[int]) -> None:
        """A call's backward has come (``call_id`` of its start): no recomputation of it will."""
        if self._pending_calls and call is not None:
            self._pending_calls[:] = [start for start in self._pending_calls if id(start) != call]

    def _commit_backward(self, state: dict[str, torch.Tensor], accepted: torch.Tensor,
                         finite: torch.Tensor, start: dict, record: bool = True) -> None:
        """Commit a call's backward ``state`` if the call is clean; take the call back (to
        ``start``) if only its gradient statistic is not ``finite``."""
        clean, taken_back = accepted & finite, accepted & ~finite
        self._restore(state, clean)
        self._restore(start, taken_back)
        self.num_rejected.add_(taken_back.long())
        if record:
            self._record_rejected(~clean)

    def _record_rejected(self, rejected: torch.Tensor) -> None:
        if self._recording:
            self._tap.record_rejected(rejected)

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs):
        for name, start in self._migrated.items():  # checkpoints from before the buffer existed
            state_dict.setdefault(prefix + name, torch.full_like(getattr(self, name), start))
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)


class StepCounted(GuardedNorm):
    """A guarded norm with a training-step counter, ``num_iters``, kept on the device.

    Every phase decision (warm-up, window filled, compensation active) compares this tensor
    with constants inside ``torch.where``, so a compiled training step is one graph for the
    whole run and CUDA graphs can capture it. A rejected call does not advance the counter.
    """

    def __init__(self, num_features: int, eps: float = 1e-5, device=None, dtype=None):
        super().__init__(num_features, eps=eps, device=device, dtype=dtype)
        self.register_buffer("num_iters", torch.zeros((), dtype=torch.long, device=device))

    def _commit_forward(self, state, accepted):
        return super()._commit_forward({**state, "num_iters": self.num_iters + 1}, accepted)

    def reset_step(self) -> None:
        """Restart the step counter (fine-tuning from other weights re-runs warm-up)."""
        self.num_iters.zero_()


class UpdateStart:
    """The state of every norm of ``model`` with running state as it was before the current
    optimizer update's first training call, kept on the device by the norms' own calls (a
    flag and a copy per norm: no host read). An update that a loss scaler skips returns to it
    (``unnorm.LossScaleGuard``), and so does SAM's second pass (``second_pass``).
    Watching a model twice shares one copy."""

    def __init__(self, model: nn.Module):
        self.all_norms = [m for m in model.modules() if isinstance(m, ChannelNorm)]
        self.norms = [m for m in self.all_norms if isinstance(m, GuardedNorm)]
        for norm in self.norms:
            if norm._update_start is None:
                device = norm.num_rejected.device
                norm._update_start = (torch.ones((), dtype=torch.bool, device=device),
                                      {name: b.clone() for name, b in norm._state().items()})

    def new_update(self) -> None:
        """The next training call of each norm starts an update."""
        for norm in self.norms:
            norm._update_start[0].fill_(True)

    def restore(self, where: Optional[torch.Tensor] = None) -> None:
        """Return every norm called in this update to its state at the update's start (where
        ``where`` holds); a norm not called keeps its state."""
        for norm in self.norms:
            first_call, start = norm._update_start
            called = ~first_call if where is None else where & ~first_call
            norm._restore(start, called)

    @contextmanager
    def second_pass(self) -> Iterator[None]:
        """SAM's second forward and backward, at perturbed weights: every norm computes from
        the update's start, as the first pass did, and on exit is as the first pass left it:
        the update advances each running statistic, window and counter once, from the first
        (unperturbed) pass. The taps record nothing of it."""
        after = [{name: b.clone() for name, b in norm._buffers.items() if b is not None}
                 for norm in self.norms]
        # only tapped norms are touched: a compiled model's guards read these attributes
        tapped = [(norm, norm._tap, norm._gns) for norm in self.all_norms
                  if norm._tap is not None or norm._gns is not None]
        self.restore()
        for norm, _, _ in tapped:
            norm._tap = norm._gns = None
        try:
            yield
        finally:
            for norm, tap, gns in tapped:
                norm._tap, norm._gns = tap, gns
            for norm, state in zip(self.norms, after):
                norm._restore(state)


def sequence_kind(model: nn.Module) -> Optional[tuple[str, str]]:
    """``(name, kind)`` of the first module of ``model`` whose tokens are not independent
    batch-first examples: ``"causal"`` where it attends causally (Hugging Face's
    ``is_causal``), ``"fairseq"`` where it is fairseq's (time-first ``(T, B, C)`` tokens; known
    by its class's module, fairseq not imported); None where no module says so."""
    for name, module in model.named_modules():
        where = name or type(model).__name__
        if getattr(module, "is_causal", False) is True:
            return where, "causal"
        if type(module).__module__.partition(".")[0] == "fairseq":
            return where, "fairseq"
    return None


def inside_backward() -> bool:
    """Whether autograd is running a backward on this thread."""
    return torch._C._current_graph_task_id() != -1


def recomputing() -> bool:
    """A training forward building a graph inside a backward: activation checkpointing's
    recomputation (reentrant or not). Compiled graphs recompute inside the graph instead."""
    return not torch.compiler.is_compiling() and torch.is_grad_enabled() and inside_backward()


def statistic_ok(total: torch.Tensor, count: torch.Tensor) -> torch.Tensor:
    """Device-side: the batch has valid rows and its per-channel statistic is finite."""
    return (count > 0).all() & torch.isfinite(total).all()


def builds_graph(*tensors: torch.Tensor) -> bool:
    """Whether autograd will call a backward through these inputs."""
    return torch.is_grad_enabled() and any(t.requires_grad for t in tensors)


def first_backward(ctx) -> bool:
    """Whether this is the first backward through a call's node: a graph backpropagated
    again (``retain_graph=True``) commits nothing more. Eager only: a compiled graph's
    backward is traced once and commits on every backward."""
    if torch.compiler.is_compiling():
        return True
    first, ctx.backward_done = not getattr(ctx, "backward_done", False), True
    return first


def call_id(start: dict) -> Optional[int]:
    """What a call's backward names the call by, to forget it (eager only)."""
    return None if torch.compiler.is_compiling() else id(start)


class _CommitOnBackward(torch.autograd.Function):
    """Identity in forward; its backward takes the call back if the gradient's sum over the
    valid rows is not finite (for norms whose backward is autograd's). One sum of every
    element: inf or NaN anywhere makes it non-finite, as per-channel sums were, at a third of
    their cost on CPU (0.6 against 2.0 ms on ViT tokens, one thread; a BN step: 11 ms)."""

    @staticmethod
    def forward(ctx, out, norm: GuardedNorm, valid, accepted, replay: bool, call: Optional[int],
                names: tuple[str, ...], *start):
        ctx.norm, ctx.replay, ctx.call, ctx.names = norm, replay, call, names
        ctx.save_for_backward(valid, accepted, *start)
        return out.view_as(out)

    @staticmethod
    def backward(ctx, grad):
        valid, accepted, *start = ctx.saved_tensors
        if first_backward(ctx):
            rows = upcast(grad.reshape(-1, grad.shape[-1]))
            total = (rows if valid is None else zero_padding(rows, valid)).sum()
            ctx.norm._forget_call(ctx.call)
            ctx.norm._commit_backward({}, accepted, torch.isfinite(total).all(),
                                      dict(zip(ctx.names, start)), record=not ctx.replay)
        return (grad,) + (None,) * (6 + len(start))


def commit_call(out: torch.Tensor, norm: GuardedNorm, valid: Optional[torch.Tensor],
                       state: dict[str, torch.Tensor], accepted: torch.Tensor) -> torch.Tensor:
    """``out`` of a training call whose forward ``state`` is committed now; its backward takes
    the call back on a non-finite gradient."""
    if not builds_graph(out):
        norm._commit_graphless(state, accepted)
        return out
    start = norm._commit_forward(state, accepted)
    return _CommitOnBackward.apply(out, norm, valid, accepted, recomputing(), call_id(start),
                                   tuple(start), *start.values())


def with_slot(window: torch.Tensor, step: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
    """A copy of ``window`` with ``value`` in slot ``step mod M``."""
    slot = torch.remainder(step, window.shape[0]).reshape(1)
    return window.index_copy(0, slot, value.reshape(1, -1))


def replicas_active(sync: bool) -> bool:
    """True when statistics are to be summed across data-parallel replicas."""
    return sync and dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def sum_over_replicas(*tensors: torch.Tensor, differentiable: bool = False) -> list[torch.Tensor]:
    """All-reduce (sum) small tensors in one collective; each keeps its shape. The tensors
    themselves keep their values (this replica's), compiled too."""
    flat = torch.cat([t.reshape(-1) for t in tensors])
    if differentiable:
        flat = _AllReduceSum.apply(flat)
    else:
        flat = _all_reduced(flat)
    return [part.reshape(t.shape) for part, t in zip(flat.split([t.numel() for t in tensors]), tensors)]


def _all_reduced(tensor: torch.Tensor) -> torch.Tensor:
    """The sum of ``tensor`` over the replicas, in a new tensor; ``tensor`` is left as it is.

    Compiled, the copy is an opaque op: inductor computes the inputs of ``torch.cat`` into
    slices of its output and lowers the all-reduce in place into that buffer, so the
    collective overwrote the tensors given to ``sum_over_replicas`` as well. UN's and MABN's
    backward read their sum(dy * z), which is also the weight gradient, after summing it
    over the replicas: each replica's weight gradient became every replica's."""
    tensor = _materialize(tensor) if torch.compiler.is_compiling() else tensor.clone()
    dist.all_reduce(tensor)
    return tensor


class _AllReduceSum(torch.autograd.Function):
    """Sum over replicas whose gradient is the sum of every replica's gradient."""

    @staticmethod
    def forward(ctx, tensor):
        return _all_reduced(tensor)

    @staticmethod
    def backward(ctx, grad):
        return _all_reduced(grad)


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


def snapshot(tensor: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
    """A copy of a value a call's backward reads, computed from buffers the call commits in
    its forward. Compiled, an opaque op: the partitioner would otherwise recompute the value
    in the backward from the buffers, already committed (UN's and MABN's r, PRepBN's share)."""
    if tensor is None:
        return None
    return _materialize(tensor) if torch.compiler.is_compiling() else tensor.clone()


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
    if whole == 0:  # no whole block: inductor fails to lower the empty blocked sum (48 rows)
        return rows.sum(dim=0)
    blocked = rows[:whole].reshape(-1, ROW_BLOCK, rows.shape[1]).sum(dim=1).sum(dim=0)
    return blocked + rows[whole:].sum(dim=0)


def channel_sum_sq(rows: torch.Tensor, valid: Optional[torch.Tensor],
                   sync: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-channel sum of x^2 over the valid rows (of every replica with ``sync``) and their
    count, in float32 (float64 for float64 rows).

    Eager, unpadded and without a gradient, from torch's batch-norm statistics kernel,
    ``N (var + mean^2)``: one read of the rows and no (N, C) tensor of squares, whose
    allocation cost more than the arithmetic on a CPU; compiled, inductor fuses the plain form
    into one loop."""
    rows = upcast(rows)
    count = row_count(rows, valid)
    if (valid is None and rows.shape[0] > 0 and not builds_graph(rows)
            and not torch.compiler.is_compiling()):
        mean, var = torch.batch_norm_update_stats(rows, None, None, 0.0)
        total = (var + mean.square()) * rows.shape[0]
    else:
        total = channel_sum((rows if valid is None else zero_padding(rows, valid)).square())
    if replicas_active(sync):
        total, count = sum_over_replicas(total, count)
    return total, count


def channel_products(dy: torch.Tensor, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(sum(dy * x), sum(dy))`` per channel of ``(N, C)`` rows. Eager, torch's batch-norm
    backward reductions (at mean 0 and scale 1) read both tensors once and allocate no
    (N, C) product; compiled, inductor fuses the plain form. The weight of ones is passed
    though it scales nothing here: CUDA's kernel returns an empty weight gradient without one."""
    if torch.compiler.is_compiling() or x.shape[0] == 0:
        return channel_sum(dy * x), channel_sum(dy)
    zeros, ones = x.new_zeros(x.shape[1]), x.new_ones(x.shape[1])
    _, product, total = torch.ops.aten.native_batch_norm_backward(
        dy, x, ones, None, None, zeros, ones, True, 0.0, [False, True, True])
    return product, total


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
