"""Separate normalization of the class token (SepNorm: Chen, Wang, Du, Hassoun and Liu, "On
Separate Normalization in Self-supervised Transformers", NeurIPS 2023; release:
tufts-ml/SepNorm, ``SepNorm.ipynb``, class ``SepNorm``): the [CLS] token normalised by a norm
of its own (``nn.BatchNorm1d`` over the batch's class tokens in the release), the other tokens
by the token norm (``nn.LayerNorm``). Where: the release's README says "Replace the
normalization layer with SepNorm", a drop-in module for any norm: every norm the class token
passes (the trainers' ``model.class_norm_sites=all``), not only the final one.

Not a registry name: it composes two registry norms (or any norm module for the tokens) and is
defined only for models with a class token, so it wraps a model's norms
(``separate_class_norms``) instead of replacing them.
"""
from __future__ import annotations

import fnmatch
from typing import Optional, Sequence, Union

import torch
from torch import nn

from .base import ChannelNorm, sequence_kind
from .registry import build_norm
from .swap import replace_module


def _call(norm: nn.Module, x: torch.Tensor, pad_mask: Optional[torch.Tensor]) -> torch.Tensor:
    return norm(x) if pad_mask is None else norm(x, pad_mask)


class SeparateClassNorm(nn.Module):
    """``class_norm`` on the first ``class_tokens`` tokens of batch-first ``(B, N, C)`` input,
    ``token_norm`` on the rest (the release's ``SepNorm(hidden, cls_norm, tok_norm)``, whose
    ``cls_norm`` sees the ``(B, C)`` class states: a batch norm there pools over the batch's
    class tokens). A pad mask ``(B, N)`` is split the same way; a token norm without one
    (torch's LayerNorm) is called without it."""

    def __init__(self, class_norm: nn.Module, token_norm: nn.Module, class_tokens: int = 1):
        super().__init__()
        if isinstance(class_tokens, bool) or not isinstance(class_tokens, int) or class_tokens < 1:
            raise ValueError(f"class_tokens must be a positive int (the class and other prefix "
                             f"tokens leading the sequence), got {class_tokens!r}")
        self.class_norm, self.token_norm, self.class_tokens = class_norm, token_norm, class_tokens

    def extra_repr(self) -> str:
        return f"class_tokens={self.class_tokens}"

    @property
    def weight(self) -> torch.Tensor:  # hosts read norm.weight (its device, its dtype)
        return self.token_norm.weight

    def forward(self, x: torch.Tensor, pad_mask: Optional[torch.Tensor] = None) -> torch.Tensor:
        if x.dim() != 3 or x.shape[1] <= self.class_tokens:
            raise ValueError(f"SeparateClassNorm needs batch-first tokens (B, N, C) led by "
                             f"{self.class_tokens} class token(s) and at least one other token, "
                             f"got shape {tuple(x.shape)}; a model without a class token (Swin, "
                             "a language model, fairseq's time-first layers) has none to separate")
        k = self.class_tokens
        heads = tails = None
        if pad_mask is not None:
            heads, tails = pad_mask[:, :k], pad_mask[:, k:]
        return torch.cat([_call(self.class_norm, x[:, :k], heads),
                          _call(self.token_norm, x[:, k:], tails)], dim=1)


def _is_norm(module: nn.Module) -> bool:
    return isinstance(module, (ChannelNorm, nn.LayerNorm, nn.RMSNorm))


def _why_no_class_token(model: nn.Module) -> Optional[str]:
    """Why ``model`` has no class token to separate, where its modules say so (None: they do
    not): causal attention, whose first token starts the text, or fairseq's layers, whose
    tokens are time-first ``(T, B, C)`` (``unnorm.base.sequence_kind``)."""
    found = sequence_kind(model)
    if found is None:
        return None
    where, kind = found
    if kind == "causal":
        return (f"{where} attends causally: a decoder's first token is the start of its text, "
                "not a class token")
    return "fairseq's layers pass time-first (T, B, C) tokens, and its Transformer has no class token"


def separate_class_norms(model: nn.Module, class_norm: str = "bn", *,
                         include: Union[str, Sequence[str], None] = None,
                         exclude: Union[str, Sequence[str], None] = None,
                         class_tokens: int = 1, **options) -> int:
    """Wrap the chosen norms of ``model`` (unnorm's, torch's LayerNorm and RMSNorm; all of
    them, or those whose names match ``include`` and not ``exclude``, ``fnmatch`` patterns) in
    ``SeparateClassNorm``: the norm stays the token norm, and the class token gets
    ``build_norm(class_norm, C, **options)``. Returns the number wrapped; a pattern that
    matches no norm is refused, naming the model's norms, and so is a model that has no class
    token where its modules say so (a causal decoder, fairseq's time-first layers)."""
    why = _why_no_class_token(model)
    if why is not None:
        raise ValueError(f"SepNorm separates a class token leading batch-first (B, N, C) tokens "
                         f"(a ViT's, BERT's [CLS]), and {why}; give every token the model's norm "
                         f"instead (unnorm.swap_norms(model, {class_norm!r}))")

    def patterns(value):
        return [] if value is None else [value] if isinstance(value, str) else list(value)
    included, excluded = patterns(include), patterns(exclude)
    norms = {name: module for name, module in model.named_modules()
             if name and _is_norm(module) and not isinstance(module, SeparateClassNorm)
             and ".class_norm" not in f".{name}" and ".token_norm" not in f".{name}"}
    for pattern in included + excluded:
        if not any(fnmatch.fnmatchcase(name, pattern) for name in norms):
            raise ValueError(f"pattern {pattern!r} matches no norm of the model; its norms: "
                             f"{', '.join(sorted(norms)) or 'none'}")
    chosen = [name for name in norms
              if (not included or any(fnmatch.fnmatchcase(name, p) for p in included))
              and not any(fnmatch.fnmatchcase(name, p) for p in excluded)]
    for name in chosen:
        token_norm = norms[name]
        width = getattr(token_norm, "num_features", None) or token_norm.normalized_shape[-1]
        weight = token_norm.weight
        factory = {} if weight is None else {"device": weight.device, "dtype": weight.dtype}
        replace_module(model, name, SeparateClassNorm(
            build_norm(class_norm, width, **factory, **options), token_norm, class_tokens))
    return len(chosen)
