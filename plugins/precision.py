"""Mixed precision: what ``amp`` trains in, and its autocast and loss scaler.

Below the training layers: it imports nothing from ``plugins`` (the sharded model,
``plugins.fsdp``, takes its compute dtype from here; fairseq and mmdetection check ``amp``
here too).
"""
from __future__ import annotations

from contextlib import nullcontext
from typing import Optional

import torch
from torch import nn

import unnorm


def check_amp(amp) -> None:
    """Refuse an ``amp`` that is none of its choices (``true`` included: it once meant
    autocast on GPUs only and float32 on a CPU without a word)."""
    if not (amp is False or amp in ("auto", "bf16", "fp16")):
        raise ValueError(f"amp={amp!r}: choose amp=auto (autocast on a GPU: bf16 where it has "
                         "it, else fp16 with a loss scaler; float32 on a CPU), amp=bf16 or "
                         "amp=fp16 (that autocast on any device, a CPU included), or amp=false")


def autocast_dtype(amp, device: torch.device) -> Optional[torch.dtype]:
    """What ``amp`` trains in on ``device`` (None: float32). ``auto``: bf16 on a GPU that
    has it, else fp16; float32 on a CPU, where autocast is slower than float32. ``bf16`` or
    ``fp16``: that, on any device (on a CPU: a rehearsal of the GPU's scale path). ``false``:
    float32."""
    check_amp(amp)
    if amp is False or amp == "auto" and device.type != "cuda":
        return None
    if amp == "auto":
        return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
    if amp == "bf16" and device.type == "cuda" and not torch.cuda.is_bf16_supported():
        raise ValueError(f"amp=bf16: {torch.cuda.get_device_name(device)} has no bf16; "
                         "use amp=fp16 (with a loss scaler) or amp=auto")
    return torch.bfloat16 if amp == "bf16" else torch.float16


def amp_context(amp, device: torch.device, model: nn.Module):
    """``(autocast, scaler)`` for ``amp`` (``autocast_dtype``): fp16 trains with a grad
    scaler, ``unnorm.GradScaler``, under which the norms of ``model`` keep their statistics
    in unscaled units and an update it skips leaves them as they were."""
    dtype = autocast_dtype(amp, device)
    if dtype is None:
        return nullcontext, None
    scaler = unnorm.GradScaler(model, device.type) if dtype == torch.float16 else None
    return (lambda: torch.autocast(device.type, dtype=dtype)), scaler
