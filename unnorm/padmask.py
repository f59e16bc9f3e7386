"""Hands a host's norms the pad mask of the batch in flight.

Hosts call their norms as ``norm(x)`` (fairseq's layers, torch's ``nn.TransformerEncoderLayer``);
a batch-statistic norm needs ``pad_mask=`` to keep padding out of its statistics. A forward
pre-hook on each norm adds the mask that the host's forward set for the batch.
"""
from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator, Optional

import torch
from torch import nn

from .base import ChannelNorm


class PadMaskFeed:
    """Gives the norms of ``module`` that their host calls as ``norm(x)`` the pad mask of the
    current batch.

    ``with feed.batch(pad_mask):`` sets the mask (the leading shape of the norms' input, True
    = padding) for the block's duration; a forward pre-hook on each ``ChannelNorm`` adds it as
    ``pad_mask=`` unless the call passes one. ``enabled=False`` hands no mask (fairseq's
    ``--norm-pad-mask false``, as the UN release's fork). The hooks also keep torch's
    ``nn.TransformerEncoderLayer`` off its fused inference path, which would read a swapped
    norm's weight and bias as a LayerNorm's.
    """

    def __init__(self, module: nn.Module, enabled: bool = True):
        self.mask: Optional[torch.Tensor] = None
        self.enabled = enabled
        for norm in module.modules() if enabled else ():
            if isinstance(norm, ChannelNorm):
                norm.register_forward_pre_hook(self._add_mask, with_kwargs=True)

    def _add_mask(self, norm, args, kwargs):
        if self.mask is not None and "pad_mask" not in kwargs:
            return args, {**kwargs, "pad_mask": self.mask}
        return None

    @contextmanager
    def batch(self, pad_mask: Optional[torch.Tensor]) -> Iterator[None]:
        """``pad_mask``: the norms' input's leading shape, True = padding (None: no padding)."""
        self.mask = pad_mask if self.enabled else None
        try:
            yield
        finally:
            self.mask = None
