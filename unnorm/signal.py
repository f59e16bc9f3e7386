"""Signal propagation at initialisation, as "Beyond BatchNorm" (Lubana, Dick and Tanaka,
NeurIPS 2021) probes it: per probe point across depth, the activation variance, the mean
cosine similarity between samples, the stable rank of the samples' Gram matrix, and the norm
of the loss's gradient at the point.

The release (EkdeepSLubana/BeyondBatchNorm, ``layer_defs.py``: ``Activs_prober``,
``Conv_prober``) probes NCHW maps, a sample being an image. Here the activations are
channels-last, ``(B, ..., C)``: tokens ``(B, T, C)``, Swin's maps ``(B, H, W, C)``. Each
quantity, and what it becomes for tokens:

- ``variance``: each channel's variance over the batch and every position (unbiased, as
  ``torch.var``), averaged over the channels: the release's ``var(dim=[0, 2, 3]).mean()``,
  a token's position standing where a pixel's did.
- ``similarity``: each example's activations flattened (T x C, the release's C x H x W) and
  scaled to unit norm; the mean over examples of its mean cosine similarity to the B - 1
  others (the release's ``(G.sum(1) - 1) / (B - 1)``, G the Gram matrix of the unit rows).
- ``stable_rank``: ``trace(G) / ||G||_2`` of that Gram matrix (B at most, 1 for a rank-one
  batch).
- ``token_similarity`` (tokens only; not in the release, whose samples have no tokens): the
  same mean cosine similarity between the T tokens of one example, averaged over examples:
  rank collapse along the sequence, which similarity between examples cannot see.
- ``grad_norm``: the Frobenius norm of the loss's gradient with respect to the whole
  activation, ``||dL/dx||`` (the release's ``grad_output.view(B, -1).norm()``).
"""
from __future__ import annotations

from typing import Callable, Mapping

import torch
from torch import nn

#: the quantities ``activation_statistics`` returns
ACTIVATION_KEYS = ("variance", "similarity", "stable_rank", "token_similarity")


def _mean_off_diagonal_cosine(rows: torch.Tensor) -> torch.Tensor:
    """``(..., n, d)`` -> ``(...)``: the mean cosine similarity of each row to the n - 1 others
    (a zero row has similarity 0 to every row, not NaN)."""
    unit = rows / torch.linalg.vector_norm(rows, dim=-1, keepdim=True).clamp_min(1e-30)
    gram = unit @ unit.transpose(-1, -2)
    n = rows.shape[-2]
    diagonal = torch.diagonal(gram, dim1=-2, dim2=-1)
    return ((gram.sum(-1) - diagonal) / (n - 1)).mean(-1)


@torch.no_grad()
def activation_statistics(activation: torch.Tensor) -> dict[str, float]:
    """The activation quantities of the module's docstring for a channels-last batch
    ``(B, ..., C)``, computed in float64; ``token_similarity`` is None without positions."""
    if activation.dim() < 2 or activation.shape[0] < 2:
        raise ValueError(f"signal probes compare the samples of a batch: they need batch-first "
                         f"activations (B, ..., C) with B >= 2, got shape "
                         f"{tuple(activation.shape)}")
    x = activation.detach().double()
    batch, channels = x.shape[0], x.shape[-1]
    variance = x.reshape(-1, channels).var(dim=0).mean()
    samples = x.reshape(batch, -1)
    unit = samples / torch.linalg.vector_norm(samples, dim=-1, keepdim=True).clamp_min(1e-30)
    gram = unit @ unit.T
    stable_rank = torch.diagonal(gram).sum() / torch.linalg.matrix_norm(gram, ord=2)
    tokens = x.reshape(batch, -1, channels)
    token_similarity = (_mean_off_diagonal_cosine(tokens).mean().item()
                        if tokens.shape[1] > 1 else None)
    return {"variance": variance.item(), "similarity": _mean_off_diagonal_cosine(samples).item(),
            "stable_rank": stable_rank.item(), "token_similarity": token_similarity}


def _first_tensor(output) -> torch.Tensor:
    """A block's activation: its output, or the first of a tuple (Hugging Face's layers)."""
    tensor = output[0] if isinstance(output, (tuple, list)) else output
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"a probe point returns {type(output).__name__}, not a tensor: probe "
                        "a module whose output is the activation (a block, the residual stream)")
    return tensor


def signal_propagation(points: Mapping[str, nn.Module],
                       loss: Callable[[], torch.Tensor]) -> list[dict]:
    """One record per probe point, in forward order: ``{"point", "index", **statistics,
    "grad_norm"}``, the activation statistics of each module's output during ``loss()`` and
    the norm of ``d loss / d output``.

    ``loss()`` runs the model's forward on a batch and returns a scalar (the model's own loss,
    or one against random targets); it runs once, in the model's current mode (at
    initialisation: training mode, batch statistics as the paper's). The gradients are taken
    with ``torch.autograd.grad`` with respect to the outputs alone: no parameter's ``.grad``
    changes. The forward is a training call: a norm with running state commits it (probe a
    fresh model, or a copy). A module called twice is refused (its two outputs would be two
    points with one name).
    """
    if not points:
        raise ValueError("no probe points: pass {name: module}, e.g. each block of the model")
    outputs: dict[str, torch.Tensor] = {}

    def keep(name):
        def hook(module, inputs, output):
            if name in outputs:
                raise RuntimeError(f"probe point {name!r} ran twice in one forward; probe "
                                   "modules called once (a shared module is two points)")
            outputs[name] = _first_tensor(output)
        return hook

    handles = [module.register_forward_hook(keep(name)) for name, module in points.items()]
    try:
        value = loss()
    finally:
        for handle in handles:
            handle.remove()
    missing = [name for name in points if name not in outputs]
    if missing:
        raise RuntimeError(f"probe points not reached by loss(): {', '.join(missing)}")
    if value.dim() != 0:
        raise ValueError(f"loss() must return a scalar, got shape {tuple(value.shape)}")
    names = list(outputs)  # forward order
    grads = torch.autograd.grad(value, [outputs[name] for name in names], allow_unused=True)
    records = []
    for index, (name, grad) in enumerate(zip(names, grads)):
        grad_norm = 0.0 if grad is None else torch.linalg.vector_norm(grad.double()).item()
        records.append({"point": name, "index": index,
                        **activation_statistics(outputs[name]), "grad_norm": grad_norm})
    return records
