"""The sentiment classifier: the original Transformer encoder (Vaswani et al.; torch's
``nn.TransformerEncoderLayer``: ReLU feed-forward, Post-LN or Pre-LN) with any registry norm.

Why torch's layer and not Hugging Face's BERT built from a config: the study trains "the original
Transformer encoder, Post-LN" and compares placements; ``BertLayer`` is Post-LN only (no Pre-LN
switch), uses GELU (the study initialises the ReLU feed-forward with Kaiming) and adds an
embedding LayerNorm and a tanh pooler the original has not. torch's layer has ``norm_first``
(Pre) and ReLU, and its two norms ``norm1``/``norm2`` are replaced by ``unnorm.build_norm``
modules. The layer calls them as ``norm(x)``; ``unnorm.PadMaskFeed`` hands them the batch's
pad mask, so padding enters no batch statistic (BN, UN, MABN, PN, PRepBN, BCN, EvoNorm-B0),
and its hooks keep the layer off torch's fused inference path (which would read a swapped
norm's weight as a LayerNorm's). Attention ignores padded keys (``src_key_padding_mask``); the
classifier reads the mean of the valid positions' outputs, so padding reaches no logit.

Embeddings: learned token and position embeddings, summed, no norm (the original has none; Pre
placement adds the final norm after the last layer, as Pre-LN Transformers do). The token
embedding is multiplied by sqrt(width), as the original's is ("we multiply those weights by
sqrt(d_model)", section 3.4). Without it, plain SGD barely moves the token embedding: a
snippet's gradient reaches a row only through that token's share of the mean pool, so a
Xavier-initialised row (std sqrt(2 / (vocab + width)), 0.016 at 8,000 x 32) changes little per
update, and at depth 1 and rate 0.1 the loss sat at the text-blind entropy for 1,000 updates
(docs/text_classification.md, "Calibration"). The factor scales both the row's effect and its
gradient, so the rows learn width times faster. Initialisation
(``model.init``): ``study``, Kaiming (fan-in, ReLU) for each feed-forward layer that feeds the
ReLU (``linear1``) and Xavier uniform for every other weight matrix (attention, ``linear2``, the
embeddings, the classifier), biases zero; or ``uniform``, U(-a, a) with a = ``model.init_range``
for every weight matrix and bias alike (the study's U(-0.1, 0.1) and U(-100, 100)). The norms keep
their own initialisation (weight 1, bias 0).
"""
from __future__ import annotations

import math
from typing import Mapping

import torch
from torch import nn

import unnorm
from plugins.norms import groups_by_heads, norm_kwargs

PLACEMENTS = ("post", "pre")
INITS = ("study", "uniform")


def build_norm(norm_cfg: Mapping, width: int, heads: int) -> nn.Module:
    """The run's norm at ``width`` channels (PN-LS grouped by the attention heads unless its
    ``group_num`` is set, as its release groups them)."""
    options = norm_kwargs(norm_cfg)
    if groups_by_heads(norm_cfg):
        options["group_num"] = heads
    return unnorm.build_norm(norm_cfg["name"], width, **options)


class SentimentEncoder(nn.Module):
    """Token ids (B, T) and their pad mask (True = padding) -> class logits (B, classes)."""

    def __init__(self, model_cfg: Mapping, norm_cfg: Mapping, vocab_size: int, pad_id: int):
        super().__init__()
        placement, width, heads = model_cfg["norm_position"], model_cfg["width"], model_cfg["heads"]
        if placement not in PLACEMENTS:
            raise ValueError(f"model.norm_position must be one of {PLACEMENTS}, got {placement!r}")
        if model_cfg["init"] not in INITS:
            raise ValueError(f"model.init must be one of {INITS}, got {model_cfg['init']!r}")
        if model_cfg.get("weight_standardization") is not None:
            raise ValueError("model.weight_standardization: the sentiment encoder has no Weight "
                             "Standardization (torch's attention reads out_proj.weight directly, "
                             "past a standardised layer); drop it (ws=null)")
        if width % heads:
            raise ValueError(f"model.width {width} is not divisible by model.heads {heads}")
        self.pad_id = pad_id
        self.embed_tokens = nn.Embedding(vocab_size, width)
        self.embed_scale = math.sqrt(width)  # the original's sqrt(d_model) (module docstring)
        self.embed_positions = nn.Embedding(model_cfg["max_length"], width)
        self.layers = nn.ModuleList()
        for _ in range(model_cfg["depth"]):
            layer = nn.TransformerEncoderLayer(
                width, heads, model_cfg["ffn"], model_cfg["dropout"], activation="relu",
                batch_first=True, norm_first=placement == "pre")
            layer.norm1, layer.norm2 = (build_norm(norm_cfg, width, heads) for _ in range(2))
            self.layers.append(layer)
        self.final_norm = build_norm(norm_cfg, width, heads) if placement == "pre" else None
        self.classifier = nn.Linear(width, model_cfg["classes"])
        initialise(self, model_cfg["init"], model_cfg.get("init_range"))
        self.pad_feed = unnorm.PadMaskFeed(self)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        pad_mask = input_ids.eq(self.pad_id)
        positions = torch.arange(input_ids.shape[1], device=input_ids.device)
        x = self.embed_tokens(input_ids) * self.embed_scale + self.embed_positions(positions)
        with self.pad_feed.batch(pad_mask):
            for layer in self.layers:
                x = layer(x, src_key_padding_mask=pad_mask)
            if self.final_norm is not None:
                x = self.final_norm(x)
        count = (~pad_mask).sum(1, keepdim=True).clamp_min(1).to(x.dtype)
        pooled = x.masked_fill(pad_mask.unsqueeze(-1), 0.0).sum(1) / count
        return self.classifier(pooled)

    def layer_groups(self) -> dict[str, nn.Module]:
        """The parts whose gradient norms are recorded at step 0, input to output."""
        groups = {"embeddings": nn.ModuleList([self.embed_tokens, self.embed_positions])}
        groups.update({f"layers.{i}": layer for i, layer in enumerate(self.layers)})
        if self.final_norm is not None:
            groups["final_norm"] = self.final_norm
        groups["classifier"] = self.classifier
        return groups


def initialise(model: SentimentEncoder, init: str, init_range=None) -> None:
    """``model.init`` (the module docstring): the study's Kaiming/Xavier, or U(-a, a)."""
    if init == "uniform" and not (isinstance(init_range, (int, float)) and init_range > 0):
        raise ValueError(f"model.init=uniform needs model.init_range > 0 (a of U(-a, a)), "
                         f"got {init_range!r}")
    norms = {id(p) for m in model.modules() if isinstance(m, unnorm.ChannelNorm)
             for p in m.parameters()}
    feeds_relu = {id(layer.linear1.weight) for layer in model.layers}
    with torch.no_grad():
        for param in model.parameters():
            if id(param) in norms:
                continue
            if init == "uniform":
                param.uniform_(-init_range, init_range)
            elif param.ndim < 2:
                param.zero_()
            elif id(param) in feeds_relu:
                nn.init.kaiming_uniform_(param, nonlinearity="relu")
            else:
                nn.init.xavier_uniform_(param)
