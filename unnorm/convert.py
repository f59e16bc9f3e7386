"""Exact Pre-LN -> Pre-RMSNorm -> Pre-CRMSNorm conversion (Jiang et al., NeurIPS 2023).

In a Pre-LN Transformer the residual stream is only ever read through a LayerNorm, and
``LN(x)`` depends on ``x`` only through its zero-mean part. So:

1. **Centre the writers.** Every module that adds into the stream (embeddings, class and
   position tokens, each attention's output projection, each MLP's output linear, a patch
   merging's reduction) is made to write the zero-mean part of what it wrote: ``W' = W - 1
   mean_rows(W)``, ``b' = b - mean(b)``, tables centred over their last axis. The stream is
   then zero-mean and every norm sees what it saw before.
2. **Pre-RMSNorm.** On a zero-mean vector ``LN(x) = gamma * x / rms(x) + beta``, an RMSNorm
   with the same gamma and eps; ``beta`` folds into the bias of the linear layers reading
   the norm (its *readers*: q/k/v, fc1, the head).
3. **Pre-CRMSNorm.** A zero-mean d-vector is its first d-1 coordinates ``z`` (the last is
   ``-sum(z)``): writers drop their last output row, the norm takes the RMS of the full vector
   from ``z``, ``sqrt((sum z^2 + (sum z)^2) / d)``, and a reader ``W`` of the norm's output
   ``gamma * x / rms`` reads ``z / rms`` through ``W'[:, i] = W[:, i] gamma_i - W[:, d]
   gamma_d`` (i < d). Gamma is folded into the readers rather than kept on the d-1 stored
   coordinates: keeping it would need ``gamma_d / gamma_i``, which a zero gain makes
   impossible. The compressed norm's own gain starts at ones.

The functions work on plain modules: ``convert_to_pre_rms``/``convert_to_pre_crms`` take a
model and the names of its writers and of each norm's readers; a host's adapter only lists
them. The outputs are equal in eval mode (and in training without dropout after a writer,
whose elementwise mask breaks the zero mean).
"""
from __future__ import annotations

from typing import Mapping, Sequence, Union

import torch
from torch import nn

from .base import ChannelNorm, channel_mean_sq, upcast
from .simple import LayerNorm, RMSNorm
from .swap import replace_module
from .ws import StandardizedWeight

Writer = Union[nn.Module, torch.Tensor]
_WRITER_TYPES = "nn.Linear, nn.Conv2d, nn.Embedding or a tensor whose last axis is the stream"


class CompressedRMSNorm(ChannelNorm):
    """RMSNorm of a zero-mean vector stored without its last coordinate (Pre-CRMSNorm).

    The input's ``num_features`` channels are the first d-1 coordinates of a zero-mean
    d-vector; the RMS is over all d, the dropped one recovered as minus the others' sum. Scales
    the stored coordinates by ``weight``; no bias (a shift on the dropped coordinate would have
    nowhere to go: the shift folds into the readers).
    """

    def __init__(self, num_features: int, eps: float = 1e-5, device=None, dtype=None):
        super().__init__(num_features, eps=eps, bias=False, device=device, dtype=dtype)

    def _normalize(self, rows, valid):
        if self._recording:
            self._tap.record_act(channel_mean_sq(rows, valid))
        rows = upcast(rows)
        sum_sq = rows.square().sum(-1, keepdim=True) + rows.sum(-1, keepdim=True).square()
        return self._affine(rows * torch.rsqrt(sum_sq / (self.num_features + 1) + self.eps), valid)


def _is_layer_norm(norm: nn.Module) -> bool:
    if isinstance(norm, LayerNorm):
        return True
    return isinstance(norm, nn.LayerNorm) and len(norm.normalized_shape) == 1


def _width(norm: nn.Module) -> int:
    return norm.num_features if isinstance(norm, LayerNorm) else norm.normalized_shape[0]


def _layer_norm_affine(norm: nn.Module) -> tuple[torch.Tensor, torch.Tensor]:
    """A LayerNorm's ``(gamma, beta)`` in float64 (ones and zeros where it has none)."""
    if not _is_layer_norm(norm):
        raise TypeError(f"{type(norm).__name__} is not a LayerNorm: only a LayerNorm equals an "
                        "RMSNorm on zero-mean input")
    weight, bias = getattr(norm, "weight", None), getattr(norm, "bias", None)
    gamma = torch.ones(_width(norm), dtype=torch.float64) if weight is None else weight.double()
    beta = torch.zeros_like(gamma) if bias is None else bias.double()
    return gamma, beta


def _check_not_standardized(modules: Mapping[str, object]) -> None:
    """Refuse weight-standardised layers, by name: they standardise their weight in every
    forward, which would undo what the conversion does to it."""
    standardized = [name for name, module in modules.items()
                    if isinstance(module, StandardizedWeight)]
    if standardized:
        raise ValueError(f"{', '.join(standardized)}: weight-standardised (the weight is "
                         "standardised again in every forward, which would undo the conversion's "
                         "change to it); bake such layers first (unnorm.bake_standardized_weights"
                         "(model), exact for inference), then convert")


def _check_writer(writer: Writer) -> None:
    if isinstance(writer, torch.Tensor):
        return
    _check_not_standardized({repr(writer): writer})
    if not isinstance(writer, (nn.Linear, nn.Conv2d, nn.Embedding)):
        raise TypeError(f"cannot centre {type(writer).__name__}: a stream writer must be an "
                        f"{_WRITER_TYPES}; for another module, name the linear layer or "
                        "tensor that produces its output")


def _check_readers(norm_name: str, width: int, readers: Sequence[nn.Module]) -> None:
    _check_not_standardized({f"{norm_name}'s reader {reader!r}": reader for reader in readers})
    for reader in readers:
        if not isinstance(reader, nn.Linear) or reader.in_features != width:
            raise ValueError(f"{norm_name}: a reader must be an nn.Linear with in_features={width} "
                             f"(the norm's width), got {reader!r}; name the linear layers that "
                             "read the norm's output")


def _centred(tensor: torch.Tensor, dim: int) -> torch.Tensor:
    """``tensor`` minus its mean over ``dim``, computed in float64."""
    wide = tensor.double()
    return wide - wide.mean(dim=dim, keepdim=True)


def _output_dim(writer: Writer) -> int:
    """The weight axis that indexes the stream's coordinates."""
    return 0 if isinstance(writer, (nn.Linear, nn.Conv2d)) else -1


@torch.no_grad()
def center_writer(writer: Writer) -> Writer:
    """Make ``writer`` write the zero-mean part of what it wrote, in place (and return it).

    ``nn.Linear``/``nn.Conv2d``: weight rows and bias centred over the output channels;
    ``nn.Embedding``: each row centred; a tensor (class token, position table): centred over
    its last axis.
    """
    _check_writer(writer)
    weight = writer if isinstance(writer, torch.Tensor) else writer.weight
    weight.copy_(_centred(weight, _output_dim(writer)))
    bias = getattr(writer, "bias", None)
    if bias is not None:
        bias.copy_(_centred(bias, 0))
    return writer


def _without_last(tensor: torch.Tensor, dim: int) -> torch.Tensor:
    kept = _centred(tensor, dim).narrow(dim, 0, tensor.shape[dim] - 1).to(tensor.dtype)
    if isinstance(tensor, nn.Parameter):
        return nn.Parameter(kept, requires_grad=tensor.requires_grad)
    return kept


@torch.no_grad()
def compress_writer(writer: Writer) -> Writer:
    """Centre ``writer`` and drop its last output coordinate (``-sum`` of the others).

    Modules change in place and are returned; a tensor cannot change its shape in place, so
    the compressed tensor is returned (an ``nn.Parameter`` for a parameter) for the caller to
    put where the old one was.
    """
    _check_writer(writer)
    dim = _output_dim(writer)
    weight = writer if isinstance(writer, torch.Tensor) else writer.weight
    if weight.shape[dim] < 2:
        raise ValueError(f"cannot compress a {weight.shape[dim]}-wide stream: it needs 2 or more")
    if isinstance(writer, torch.Tensor):
        return _without_last(writer, dim)
    writer.weight = _without_last(writer.weight, dim)
    if getattr(writer, "bias", None) is not None:  # nn.Embedding has none
        writer.bias = _without_last(writer.bias, 0)
    if isinstance(writer, nn.Linear):
        writer.out_features -= 1
    elif isinstance(writer, nn.Conv2d):
        writer.out_channels -= 1
    else:
        writer.embedding_dim -= 1
    return writer


@torch.no_grad()
def _add_to_bias(linear: nn.Linear, shift: torch.Tensor) -> None:
    """``linear(x + shift) == linear'(x)``: the bias takes ``W @ shift`` (made if absent and
    the shift is not zero)."""
    if not shift.any():
        return
    bias = linear.weight.double() @ shift.to(linear.weight.device)
    if linear.bias is None:
        linear.bias = nn.Parameter(bias.to(linear.weight.dtype))
    else:
        linear.bias.copy_(linear.bias.double() + bias)


@torch.no_grad()
def to_rms_norm(norm: nn.Module, readers: Sequence[nn.Linear]) -> RMSNorm:
    """The RMSNorm that equals the LayerNorm ``norm`` on zero-mean input: same gain and eps.

    Its shift folds into the ``readers`` (their bias takes ``W @ beta``) and the RMSNorm has
    no bias; with no readers (something between the norm and its linear layers that a folded
    bias would not pass through, e.g. zero padding) the RMSNorm keeps the shift as its bias.
    """
    gamma, beta = _layer_norm_affine(norm)
    _check_readers(type(norm).__name__, gamma.numel(), readers)
    rms = RMSNorm(gamma.numel(), eps=norm.eps, bias=not readers, device=gamma.device,
                  dtype=getattr(norm.weight, "dtype", None))
    rms.weight.copy_(gamma)
    for reader in readers:
        _add_to_bias(reader, beta)
    if not readers:
        rms.bias.copy_(beta)
    return rms.train(norm.training)


@torch.no_grad()
def compress_readers(readers: Sequence[nn.Linear], gain: torch.Tensor) -> None:
    """Make each reader of ``gain * x``, ``x`` a zero-mean d-vector, read its first d-1
    coordinates instead, in place: ``W'[:, i] = W[:, i] gain_i - W[:, d] gain_d`` (i < d).
    Fold any shift into the readers' biases first."""
    if gain.numel() < 2:
        raise ValueError(f"cannot compress a {gain.numel()}-wide norm: it needs 2 or more")
    _check_readers("compress_readers", gain.numel(), readers)
    for reader in readers:
        scaled = reader.weight.double() * gain.to(reader.weight.device, torch.float64)
        compressed = scaled[:, :-1] - scaled[:, -1:]
        reader.weight = nn.Parameter(compressed.to(reader.weight.dtype),
                                     requires_grad=reader.weight.requires_grad)
        reader.in_features = compressed.shape[-1]


@torch.no_grad()
def to_compressed_rms_norm(norm: nn.Module, readers: Sequence[nn.Linear]) -> CompressedRMSNorm:
    """The CompressedRMSNorm replacing the LayerNorm ``norm`` of a zero-mean stream whose
    writers are compressed (``compress_writer``). The norm's gain and shift fold into the
    ``readers``, which then read d-1 coordinates; there must be at least one (the shift has
    nowhere else to go)."""
    gamma, beta = _layer_norm_affine(norm)
    if not readers:
        raise ValueError("a compressed norm needs the linear layers reading its output: its gain "
                         "and shift fold into them")
    _check_readers(type(norm).__name__, gamma.numel(), readers)
    for reader in readers:
        _add_to_bias(reader, beta)
    compress_readers(readers, gamma)
    crms = CompressedRMSNorm(gamma.numel() - 1, eps=norm.eps, device=gamma.device,
                             dtype=getattr(norm.weight, "dtype", None))
    return crms.train(norm.training)


def _resolve(model: nn.Module, name: str) -> Writer:
    """A submodule, parameter or buffer of ``model`` by dotted name."""
    for getter in (model.get_submodule, model.get_parameter, model.get_buffer):
        try:
            return getter(name)
        except AttributeError:
            continue
    raise KeyError(f"{type(model).__name__} has no module, parameter or buffer {name!r}")


def _check_plan(model: nn.Module, writers: Sequence[str], readers: Mapping[str, Sequence[str]],
                compressing: bool) -> None:
    """Refuse a plan before anything changes: a norm that is not a LayerNorm, a reader named
    twice or of the wrong kind, an unsupported writer."""
    if not writers:
        raise ValueError("no writers given: name every module or tensor that adds into the stream")
    layers = [*writers, *(name for names in readers.values() for name in names)]
    _check_not_standardized({name: _resolve(model, name) for name in layers})
    for name in writers:
        _check_writer(_resolve(model, name))
    seen: set[str] = set()
    for norm_name, reader_names in readers.items():
        norm = model.get_submodule(norm_name)
        if not _is_layer_norm(norm):
            raise ValueError(f"{norm_name} is {type(norm).__name__}, not a LayerNorm: the "
                             "conversion is exact only for a Pre-LN model; train it with norm=ln")
        shared = seen.intersection(reader_names)
        if shared:
            raise ValueError(f"{sorted(shared)} read more than one norm ({norm_name} too)")
        seen.update(reader_names)
        _check_readers(norm_name, _width(norm), [model.get_submodule(n) for n in reader_names])
        if compressing and not reader_names:
            raise ValueError(f"{norm_name} has no linear reader to take its gain and shift, so "
                             "it cannot be compressed; convert the model to Pre-RMSNorm only")


def _put(model: nn.Module, name: str, value: Writer) -> None:
    """``model.<name> = value`` for a dotted name of a module, parameter or buffer."""
    parent_name, _, attr = name.rpartition(".")
    setattr(model.get_submodule(parent_name) if parent_name else model, attr, value)


@torch.no_grad()
def convert_to_pre_rms(model: nn.Module, writers: Sequence[str],
                       readers: Mapping[str, Sequence[str]]) -> int:
    """Turn a Pre-LN ``model`` into Pre-RMSNorm in place: centre the ``writers`` (names of
    modules, parameters or buffers adding into the stream) and replace each LayerNorm named
    in ``readers`` by an RMSNorm, its shift folded into the linear layers named for it.
    Returns the number of norms replaced. Nothing changes if the plan is refused."""
    return _convert(model, writers, readers, compressing=False)


@torch.no_grad()
def convert_to_pre_crms(model: nn.Module, writers: Sequence[str],
                        readers: Mapping[str, Sequence[str]]) -> int:
    """Turn a Pre-LN ``model`` into Pre-CRMSNorm in place: the stream one coordinate
    narrower. ``writers`` and ``readers`` as for ``convert_to_pre_rms`` (every norm needs a
    reader). Returns the number of norms replaced. Nothing changes if the plan is refused."""
    return _convert(model, writers, readers, compressing=True)


def _convert(model: nn.Module, writers: Sequence[str], readers: Mapping[str, Sequence[str]],
             compressing: bool) -> int:
    _check_plan(model, writers, readers, compressing=compressing)
    to_norm = to_compressed_rms_norm if compressing else to_rms_norm
    for norm_name, reader_names in readers.items():
        norm = to_norm(model.get_submodule(norm_name), [model.get_submodule(n) for n in reader_names])
        replace_module(model, norm_name, norm)
    for name in writers:
        writer = _resolve(model, name)
        if not compressing:
            center_writer(writer)
            continue
        compressed = compress_writer(writer)
        if compressed is not writer:
            _put(model, name, compressed)
    return len(readers)

