"""Statistics within one sample (BCN's group normalization, EvoNorm-S0's group std and
EvoNorm-B0's instance std), and what a sample is for tokens: the ``layout`` option.

The CNN definitions pool within an image over its channels (a group, or one channel: the
instance) *and* over its positions H x W. Over tokens the position axis is T: pooled over it,
position t would see later tokens in a language model, and the statistic would depend on how
much padding a sequence has. So unnorm defines the sample by ``layout``:

- ``"token"`` (the default; defined in every task): each token is a sample. A group
  statistic pools the group's C/G channels of that token; B0's instance statistic pools the
  token's C channels (one channel at one position is a single value, whose variance is 0).
  Causal, and independent of padding and of the other tokens: for ``(B, T, C)`` tokens,
  Swin's ``(B, H, W, C)`` maps and time-first ``(T, B, C)`` input alike.
- ``"image"``: each example (axis 0 of batch-first input ``(B, ..., C)``) is a sample, as in
  the releases' NCHW code: a statistic pools its channels over every valid (unpadded)
  position of the example. For vision (Swin's maps, ViT tokens) and other non-causal
  batch-first encoders. Refused with ``causal=True`` (it pools over later positions) and on
  input without an example axis.
"""
from __future__ import annotations

from typing import Optional

import torch

from .base import channel_products, zero_padding

LAYOUTS = ("token", "image")


def check_layout(layout: str, causal: bool = False) -> str:
    """``layout`` if it is one of ``LAYOUTS`` and fits ``causal``, else an error naming the fix."""
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {', '.join(map(repr, LAYOUTS))} (what a sample is: "
                         f"each token, or each example's positions pooled), got {layout!r}")
    if causal and layout == "image":
        raise ValueError("layout='image' pools each example's statistics over all its positions, "
                         "later ones included: it cannot be causal. Use layout='token' (each "
                         "token's own channels) with causal=True")
    return layout


def resolve_groups(num_features: int, groups: int, layout: str) -> int:
    """The number of channel groups: ``groups`` if it divides the channels, else the largest
    divisor below it (EvoNorm's release, ``_group_std``). Per token a group must hold at least
    two channels: the variance of one value is 0 (the normalised output would be 0 whatever
    the input), so per token the largest divisor leaving two channels a group is taken."""
    if isinstance(groups, bool) or not isinstance(groups, int) or groups < 1:
        raise ValueError(f"groups must be a positive int (the number of channel groups; the "
                         f"releases use 32), got {groups!r}")
    most = num_features if layout == "image" else num_features // 2
    if most < 1:
        raise ValueError(f"{num_features} channel(s) per token cannot form a group of two: a "
                         "group statistic of one value per token is always 0; use "
                         "layout='image' (pooled over an example's positions)")
    resolved = min(groups, most)
    while num_features % resolved:
        resolved -= 1
    return resolved


def sample_moments(rows: torch.Tensor, groups: int, valid: Optional[torch.Tensor] = None,
                   examples: Optional[int] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The mean and biased variance of each sample's channel groups, broadcast to the
    ``(N, C)`` rows: ``examples=None``, each row is a sample (layout "token"); else the rows
    are ``examples`` batch-first examples of equal length, each a sample pooled over its valid
    rows (layout "image"). ``groups`` must divide C (``groups=C``: one channel a group, the
    instance statistic). Differentiable; a padded row neither enters a statistic nor sends a
    gradient to one (its own output uses detached statistics)."""
    num, channels = rows.shape
    size = channels // groups
    if examples is None:
        grouped = rows.reshape(num, groups, size)
        mean = grouped.mean(dim=-1, keepdim=True)
        var = (grouped - mean).square().mean(dim=-1, keepdim=True)
        full = (num, groups, size)
        return mean.expand(full).reshape(num, channels), var.expand(full).reshape(num, channels)
    shape = (examples, -1, groups, size)
    counted = rows if valid is None else zero_padding(rows, valid)
    seqs = counted.reshape(shape)
    if valid is None:
        count = torch.full((), float(seqs.shape[1] * size), dtype=rows.dtype, device=rows.device)
    else:
        count = valid.reshape(examples, -1).to(rows.dtype).sum(dim=1).reshape(-1, 1, 1, 1) * size
    mean = seqs.sum(dim=(1, 3), keepdim=True) / count.clamp_min(1)
    deviation = (counted.reshape(shape) - mean).reshape(num, channels)
    if valid is not None:
        deviation = zero_padding(deviation, valid)
    var = deviation.reshape(shape).square().sum(dim=(1, 3), keepdim=True) / count.clamp_min(1)
    full = (examples, seqs.shape[1], groups, size)
    mean, var = (stat.expand(full).reshape(num, channels) for stat in (mean, var))
    if valid is not None:
        keep = valid[:, None]
        mean = torch.where(keep, mean, mean.detach())
        var = torch.where(keep, var, var.detach())
    return mean, var


#: compiled, groups of more channels than this are summed by inductor's own reduction, fused
#: with its neighbours; fewer, by BLAS (measured at 12 and 3: ViT's and Swin's 32 groups)
FUSED_GROUP_SUM_ABOVE = 8


def group_sums(values: torch.Tensor, size: int) -> torch.Tensor:
    """``(M, 1)``: each run of ``size`` consecutive values summed (one channel group of a
    token), as a matrix-vector product of the ``(M, size)`` view with ones. A reduction over a
    dim of 3-12 values is the slow case of torch's CPU reduction kernels: ``sum(dim=-1)`` ran
    1.5x (12 values) and 3.7x (3 values) the BLAS product (issue 51; 1 thread, n = 20).
    Compiled, inductor's reduction fused into the passes around it won at 12 values (a BLAS
    call is a pass of its own) and lost at 3 (gn's step 1.7-1.9x slower than with BLAS).
    The product runs with autocast off: autocast would take it in bf16, and the statistics
    stay in the values' dtype (float32)."""
    flat = values.reshape(-1, size)
    if torch.compiler.is_compiling() and size > FUSED_GROUP_SUM_ABOVE:
        return flat.sum(dim=-1, keepdim=True)
    with torch.autocast(values.device.type, enabled=False):
        return flat @ values.new_ones(size, 1)


def group_deviations(rows: torch.Tensor, groups: int, eps: float
                     ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(deviations, mean, rstd, squares)`` of each row's ``groups`` channel groups, the
    ``(N G, C/G)`` deviations from each group's mean, its mean and ``1 / sqrt(biased var +
    eps)``, ``(N G, 1)``, and the squared deviations (a tensor of the caller's to overwrite);
    not differentiable (for hand-written backwards). Two passes for the variance, as torch's
    kernels (no cancellation of a large mean), each sum a ``group_sums``; a per-group value
    meets its group's channels as an ``(N G, 1)`` broadcast over the ``(N G, C/G)`` view."""
    size = rows.shape[1] // groups
    mean = group_sums(rows, size).div_(size)
    deviations = torch.sub(rows.reshape(-1, size), mean)
    squares = torch.mul(deviations, deviations)
    rstd = group_sums(squares, size).div_(size).add_(eps).rsqrt_()
    return deviations, mean, rstd, squares


class GroupStandardize(torch.autograd.Function):
    """Each row's channel groups standardised, then ``weight * z + bias`` per channel, with its
    backward by hand (issue 51): the per-token group norm of ``gn`` and BCN's channel part,
    which torch's GroupNorm kernel runs at 8x a LayerNorm's cost on a CPU (rows without
    positions). Saves z and each group's ``r = 1 / std``. With ``g = dy weight``: ``dx = r (g
    - mean(g) - z mean(g z))`` over the group, ``dweight = sum(dy z)``, ``dbias = sum(dy)``;
    four ``(N, C)`` allocations in all (forward: z, the output; backward: g, dx), two
    broadcasts of per-group values each way."""

    @staticmethod
    def forward(ctx, rows, weight, bias, groups, eps):
        z, _, rstd, squares = group_deviations(rows, groups, eps)
        z = z.mul_(rstd).view(rows.shape)
        ctx.size = rows.shape[1] // groups
        ctx.save_for_backward(z, rstd, weight)
        if bias is None:
            return torch.mul(z, weight, out=squares.view(rows.shape))
        return torch.addcmul(bias, z, weight, out=squares.view(rows.shape))

    @staticmethod
    def backward(ctx, dy):
        z, rstd, weight = ctx.saved_tensors
        size = ctx.size
        dweight, dbias = channel_products(dy, z)
        grad = dy * weight
        product = grad * z
        # -r mean(g) and -r mean(g z) per group, then dx = r g - r mean(g) - r mean(g z) z
        shift = group_sums(grad, size).mul_(rstd / -size)
        slope = group_sums(product, size).mul_(rstd / -size)
        dx = torch.addcmul(shift, z.view(-1, size), slope, out=product.view(-1, size))
        dx = dx.addcmul_(grad.view(-1, size), rstd)
        needs = ctx.needs_input_grad
        return (dx.view(dy.shape), dweight if needs[1] else None, dbias if needs[2] else None,
                None, None)


class SampleStatistics:
    """The ``layout`` option of a norm with statistics within a sample (see the module): the
    number of examples of the input being normalised, when layout is "image"; and the order
    in which channel groups are formed (``group_channels_as``)."""

    layout: str = "token"
    _examples: Optional[int] = None  # examples of the input being normalised (layout "image")
    #: (to grouping order, back to storage order) when the channels are grouped in another
    #: order than they are stored in (mmdet's patch merging); None: as stored
    _grouping: Optional[tuple[torch.Tensor, torch.Tensor]] = None

    def group_channels_as(self, order: torch.Tensor) -> None:
        """Form the channel groups in another order than the channels are stored in:
        ``order[c]`` is stored channel c's place in the grouping order (mmdet's patch merging
        stores its 4C channels in ``nn.Unfold``'s order; grouped in timm's concatenation
        order, a converted timm norm computes what it computed there)."""
        if sorted(order.tolist()) != list(range(self.num_features)):
            raise ValueError(f"order must be a permutation of the {self.num_features} channels")
        self._grouping = (torch.argsort(order), order.clone())

    def forward(self, x: torch.Tensor, pad_mask: Optional[torch.Tensor] = None) -> torch.Tensor:
        self._examples = None
        if self.layout == "image":
            if x.dim() < 3:
                raise ValueError(f"{type(self).__name__}(layout='image') pools each example's "
                                 f"positions: it needs batch-first input (B, ..., C) with a "
                                 f"position axis, got shape {tuple(x.shape)}; use "
                                 "layout='token' for rows without positions")
            self._examples = x.shape[0]
        return super().forward(x, pad_mask)

    def _sample_moments(self, rows: torch.Tensor, groups: int,
                        valid: Optional[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        if self._grouping is None:
            return sample_moments(rows, groups, valid, self._examples)
        to_groups, back = (index.to(rows.device) for index in self._grouping)
        mean, var = sample_moments(rows[:, to_groups], groups, valid, self._examples)
        return mean[:, back], var[:, back]

    def _per_group(self, values: torch.Tensor, groups: int) -> torch.Tensor:
        """A per-group ``(G,)`` parameter as a per-channel one, in storage order."""
        expanded = values.repeat_interleave(self.num_features // groups)
        return expanded if self._grouping is None else expanded[self._grouping[1].to(values.device)]
