"""What a host model's norm computes, read without importing its framework.

torch, timm and transformers spell one per-channel norm many ways: ``eps`` or
``variance_epsilon``; LayerNorm or RMSNorm (T5's ``T5LayerNorm`` is an RMSNorm); a scale ``w``
or ``1 + w`` (Gemma's RMSNorms, Nemotron's LayerNorm1P); channels-last or NCHW (timm's
``LayerNorm2d``/``RmsNorm2d``, ConvNeXt's). The attributes give the numbers (channels, eps,
weight, bias). Which computation the module performs is settled by running a copy of it, with
random affine parameters, on a probe whose rows range from far below to far above ``sqrt(eps)``,
and comparing it with each reading (LayerNorm or RMSNorm, ``w`` or ``1 + w``, channels-last or
first). So there is no table of class names to keep up with two frameworks' releases, and a
reading that does not reproduce the module exactly is never used.
"""
from __future__ import annotations

import copy
import inspect
import re
from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from .base import ChannelNorm

# "Norm" as a word of a class name: LayerNorm, RmsNorm2d, RmsNormFp32, RMSNormGated, QKNorm;
# not NormedEmbedding or Normalize
_NORM_LIKE_NAME = re.compile(r"Norm(?![a-z])|norm$")
_EPS_NAMES = ("eps", "variance_epsilon", "epsilon")
_DEFAULT_EPS = 1e-5  # torch's; a module with no eps attribute must still reproduce it
_CARRIED = {"weight", "bias"}
# (what the module is given, channels first?, the dims besides C): 24 positions each
_LAYOUTS = (("channels-last (..., C)", False, (4, 6)),
            ("channels-first (N, C, H, W)", True, (2, 3, 4)),
            ("channels-first (N, C, L)", True, (4, 6)))
_PROBE_RTOL, _PROBE_ATOL = 1e-3, 1e-4  # float32 kernels differ by ~1e-6; readings by O(1)
# Batch, instance and group statistics are not per-position norms: swap_norms keeps them.
_BATCH_STATISTICS = (nn.modules.batchnorm._NormBase, nn.GroupNorm, nn.LocalResponseNorm,
                     nn.CrossMapLRN2d)


@dataclass(frozen=True)
class HostNorm:
    """A host norm's reading: a LayerNorm or RMSNorm over ``channels`` per position, then
    ``* scale + bias``."""

    channels: int
    eps: float
    scale: Optional[torch.Tensor]  # the effective scale (1 + w for a 1 + w norm); None: no affine
    bias: Optional[torch.Tensor]
    channels_first: bool  # normalises dim 1 of NCHW input


def is_ours(module: nn.Module) -> bool:
    """unnorm's own modules (its norms, their wrappers, folded norms) are never swapped."""
    return isinstance(module, ChannelNorm) or type(module).__module__.split(".")[0] == "unnorm"


def is_norm_like(module: nn.Module) -> bool:
    """torch's LayerNorm/RMSNorm, or a leaf module with the word Norm in its class name
    (LayerNorm, RmsNorm2d, RMSNormGated, ...) that is not a batch, instance or group norm. A
    module with children (an encoder named ``...StableLayerNorm``) is judged by its children."""
    if is_ours(module) or is_batch_statistics(module):
        return False
    if isinstance(module, (nn.LayerNorm, nn.RMSNorm)):
        return True
    return not any(module.children()) and bool(_NORM_LIKE_NAME.search(type(module).__name__))


def is_batch_statistics(module: nn.Module) -> bool:
    """torch's batch/instance/group norms, and frozen batch norms (``running_var``)."""
    return isinstance(module, _BATCH_STATISTICS) or hasattr(module, "running_var")


def read_host_norm(module: nn.Module) -> HostNorm:
    """The reading that reproduces ``module``; ValueError saying why when none does."""
    state = [n for n, _ in (*module.named_parameters(recurse=False),
                            *module.named_buffers(recurse=False))]
    extra = sorted(set(state) - _CARRIED)
    if extra:
        raise ValueError(f"has state besides weight and bias ({', '.join(extra)}) that no "
                         "LayerNorm or RMSNorm carries")
    extra_inputs = [p.name for p in inspect.signature(module.forward).parameters.values()
                    if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)][1:]
    if extra_inputs:
        raise ValueError(f"its forward takes more than the input ({', '.join(extra_inputs)}): "
                         "a gated or conditioned norm")
    channels, eps = _channels(module), _eps(module)
    # the scale is w, 1 + w (Gemma), or an unused placeholder (None: FalconMamba's)
    scale_offsets = (0.0, 1.0, None) if _tensor(module, "weight") is not None else (None,)
    failures = []
    for layout, channels_first, leading in _LAYOUTS:
        probe = _probe(channels, eps, leading, channels_first)
        try:
            weight, bias, out = _run_with_random_affine(module, probe, eps)
        except Exception as error:  # a layout the module does not take: another may fit
            failures.append(f"{layout} input raised {type(error).__name__}: {error}")
            continue
        for kind in ("ln", "rms"):
            for offset in scale_offsets:
                scale = None if offset is None else weight + offset
                if _reproduces(out, _reading_output(kind, probe, eps, scale, bias, channels_first)):
                    return HostNorm(channels, eps, _effective(module, "weight", offset),
                                    _effective(module, "bias", 0.0), channels_first)
        failures.append(f"{layout} output is no LayerNorm or RMSNorm (scale w or 1 + w) with "
                        f"eps={eps:g}")
    raise ValueError("; ".join(failures))


def _tensor(module: nn.Module, name: str) -> Optional[torch.Tensor]:
    value = getattr(module, name, None)
    return value if isinstance(value, torch.Tensor) else None


def _effective(module: nn.Module, name: str, offset: Optional[float]) -> Optional[torch.Tensor]:
    """The module's ``weight + offset`` (or bias), detached, in its own dtype; None where the
    module has none or does not use it (offset None)."""
    value = _tensor(module, name)
    return None if value is None or offset is None else (value.detach() + offset).to(value.dtype)


def _channels(module: nn.Module) -> int:
    """C, from ``normalized_shape`` or a 1-D weight."""
    shape = getattr(module, "normalized_shape", None)
    if isinstance(shape, int):
        shape = (shape,)
    weight = _tensor(module, "weight")
    if shape is None and weight is not None:
        shape = tuple(weight.shape)
    if shape is None:
        raise ValueError("has neither normalized_shape nor a weight to give its channel count "
                         "(a parameter-free norm sized by its input)")
    if len(shape) != 1:
        raise ValueError(f"normalises over {tuple(shape)}, not one channel axis")
    return int(shape[0])


def _eps(module: nn.Module) -> float:
    """``eps`` or ``variance_epsilon``; torch's 1e-5 where it has none (the probe checks it);
    torch's RMSNorm(eps=None) uses its dtype's machine epsilon."""
    for name in _EPS_NAMES:
        if hasattr(module, name):
            value = getattr(module, name)
            if value is None:
                weight = _tensor(module, "weight")
                return torch.finfo(torch.float32 if weight is None else weight.dtype).eps
            return float(value)
    return _DEFAULT_EPS


def _probe(channels: int, eps: float, leading: tuple, channels_first: bool) -> torch.Tensor:
    """Rows of random mean and spread, scaled from 0.1 sqrt(eps) to 10 (eps is seen), on a
    private generator (the caller's random state is left alone)."""
    generator = torch.Generator().manual_seed(0)
    rows = 24
    x = (torch.randn(rows, channels, generator=generator)
         + 2 * torch.randn(rows, 1, generator=generator))
    x = x * torch.logspace(torch.tensor(0.1 * eps ** 0.5).log10().item(), 1.0, rows)[:, None]
    x = x.reshape(*leading, channels)
    return x.movedim(-1, 1).contiguous() if channels_first else x


def _run_with_random_affine(module: nn.Module, probe: torch.Tensor, eps: float):
    """``(weight, bias, output)`` of a float32 copy of ``module`` given random affine
    parameters (so a scale of zeros or ones cannot hide how it is used)."""
    generator = torch.Generator().manual_seed(1)
    twin = copy.deepcopy(module).float()
    for name in _EPS_NAMES:  # torch's RMSNorm(eps=None) would take float32's, not the host's
        if getattr(twin, name, 0) is None:
            setattr(twin, name, eps)
    affine = {name: _tensor(twin, name) for name in ("weight", "bias")
              if _tensor(twin, name) is not None}
    with torch.no_grad():
        for value in affine.values():
            value.copy_(torch.randn(value.shape, generator=generator))
        device = next(iter(affine.values()), probe).device
        out = twin(probe.to(device))
    affine = {name: value.detach().cpu() for name, value in affine.items()}
    return affine.get("weight"), affine.get("bias"), out


def _reading_output(kind: str, x: torch.Tensor, eps: float, scale: Optional[torch.Tensor],
                    bias: Optional[torch.Tensor], channels_first: bool) -> torch.Tensor:
    """What a reading computes on ``x``, with torch's own kernels."""
    rows = x.movedim(1, -1) if channels_first else x
    shape = (rows.shape[-1],)
    out = (F.layer_norm(rows, shape, eps=eps) if kind == "ln"
           else F.rms_norm(rows, shape, eps=eps))
    if scale is not None:
        out = out * scale
    if bias is not None:
        out = out + bias
    return out.movedim(-1, 1) if channels_first else out


def _reproduces(out, expected: torch.Tensor) -> bool:
    return (isinstance(out, torch.Tensor) and out.shape == expected.shape
            and torch.allclose(out.float().cpu(), expected, rtol=_PROBE_RTOL, atol=_PROBE_ATOL))
