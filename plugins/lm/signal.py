"""The language model at initialisation for ``unnorm.signal``'s probes: a Llama-style decoder
of any depth, width, norm and placement, its blocks' outputs (the residual stream) as probe
points, and its own next-token loss on uniformly random tokens."""
from __future__ import annotations

from typing import Callable, Mapping

import torch
from torch import nn

from .model import build_lm

#: LLaMA-71M's initialisation, 0.02 at width 512, kept relative to the width as the CPU
#: testbed keeps it (configs/scale/model/cpu_llama_71m.yaml)
INIT_AT_512 = 0.02


def probe_setup(norm_cfg: Mapping, *, placement: str, depth: int, width: int, batch: int,
                context: int, seed: int, vocab: int = 256,
                heads: int = 4) -> tuple[dict[str, nn.Module], Callable[[], torch.Tensor]]:
    """``(points, loss)`` for ``unnorm.signal_propagation``: the decoder built at seed
    ``seed`` in training mode, ``{"layers.i": block}`` in depth order, and its loss on one
    batch of ``batch`` x ``context`` random tokens (drawn from the same seed)."""
    torch.manual_seed(seed)
    model = build_lm({"vocab_size": vocab, "hidden_size": width,
                      "intermediate_size": 8 * width // 3, "num_hidden_layers": depth,
                      "num_attention_heads": heads, "context": context,
                      "norm_position": placement,
                      "initializer_range": INIT_AT_512 * (512 / width) ** 0.5}, norm_cfg)
    model.train()
    tokens = torch.randint(0, vocab, (batch, context))
    points = {f"layers.{i}": layer for i, layer in enumerate(model.model.layers)}
    return points, lambda: model(input_ids=tokens, labels=tokens).loss
