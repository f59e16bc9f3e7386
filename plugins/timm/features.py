"""Per-layer features of the timm classifiers (T2T-ViT, Swin), for analyses that compare layers.

The model side of analysis/cka.py: which layers to compare by default, forward hooks that keep
their outputs, and both models driven over one loader. analysis/ only reads the features.
"""
from __future__ import annotations

from contextlib import contextmanager
from itertools import islice
from typing import Iterable, Iterator, Sequence

import torch
from timm.models.swin_transformer import SwinTransformer, SwinTransformerBlock
from torch import nn

from .t2t_vit import T2TViT


def block_names(model: nn.Module) -> list[str]:
    """The default layers: every Transformer block's output, in forward order."""
    if isinstance(model, T2TViT):
        return [f"blocks.{i}" for i in range(len(model.blocks))]
    if isinstance(model, SwinTransformer):
        return [name for name, module in model.named_modules() if isinstance(module, SwinTransformerBlock)]
    raise TypeError(f"no default CKA layers for {type(model).__name__}; pass the module names "
                    "to compare (see model.named_modules())")


def _keep_output(store: dict, name: str):
    def hook(module, inputs, output):
        if not isinstance(output, torch.Tensor):
            raise TypeError(f"{name} returns {type(output).__name__}, not a tensor; pick a module "
                            "whose output is the activation to compare")
        store[name] = output.detach()
    return hook


@contextmanager
def layer_features(model: nn.Module, names: Sequence[str]) -> Iterator[dict[str, torch.Tensor]]:
    """Within the block, each forward of ``model`` fills the yielded dict with the outputs of
    the modules ``names`` (replacing the previous forward's); the hooks go on exit."""
    modules = dict(model.named_modules())
    missing = [name for name in names if name not in modules]
    if missing:
        raise KeyError(f"{type(model).__name__} has no modules {missing}; see model.named_modules()")
    store: dict[str, torch.Tensor] = {}
    handles = [modules[name].register_forward_hook(_keep_output(store, name)) for name in names]
    try:
        yield store
    finally:
        for handle in handles:
            handle.remove()


def _images(batch) -> torch.Tensor:
    return batch[0] if isinstance(batch, (list, tuple)) else batch


def _equal_batches(loader: Iterable, max_batches: int | None) -> Iterator[torch.Tensor]:
    """The loader's inputs, dropping a short final batch (the usual remainder) so the minibatch
    estimator sees equal-size batches; a short batch anywhere else is an error."""
    size, short = None, None
    for batch in islice(loader, max_batches):
        images = _images(batch)
        if short is not None:
            raise ValueError(f"a batch of {short} examples came before the last one; the minibatch "
                             "CKA estimator needs equal-size batches")
        size = size or images.shape[0]
        if images.shape[0] < size:
            short = images.shape[0]
            continue
        yield images


def paired_layer_features(model_a: nn.Module, model_b: nn.Module, loader: Iterable,
                          names_a: Sequence[str], names_b: Sequence[str], max_batches: int | None = None,
                          equal_batches: bool = True) -> Iterator[tuple[list[torch.Tensor], list[torch.Tensor]]]:
    """Per batch of ``loader``'s inputs (the first item of a list or tuple batch), the outputs of
    the modules ``names_a`` of ``model_a`` and ``names_b`` of ``model_b``, all on ``model_a``'s device.

    The models run in eval mode without gradients, each on the device of its parameters; their
    train/eval modes come back when the generator ends or is closed. ``equal_batches`` (what the
    minibatch CKA estimator needs) drops a short final batch and rejects a short one elsewhere;
    ``False`` yields every batch.
    """
    device_a, device_b = next(model_a.parameters()).device, next(model_b.parameters()).device
    batches = (_equal_batches(loader, max_batches) if equal_batches
               else map(_images, islice(loader, max_batches)))
    modes = [(model, model.training) for model in (model_a, model_b)]
    try:
        for model, _ in modes:
            model.eval()
        with layer_features(model_a, names_a) as out_a, layer_features(model_b, names_b) as out_b:
            for images in batches:
                with torch.no_grad():
                    model_a(images.to(device_a))
                    if model_b is not model_a:  # the same model fills both stores in one forward
                        model_b(images.to(device_b))
                yield [out_a[name] for name in names_a], [out_b[name].to(device_a) for name in names_b]
    finally:
        for model, training in modes:
            model.train(training)
