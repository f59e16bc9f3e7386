"""The vision models at initialisation for ``unnorm.signal``'s probes: T2T-ViT and Swin-T of
any depth, their blocks' outputs (the residual stream) as probe points (``block_names``, as
CKA's), and the cross-entropy on Gaussian images against random labels."""
from __future__ import annotations

from typing import Callable, Mapping

import torch
from torch import nn

from .features import block_names
from .models import create_classifier

CLASSES = 10


def model_kwargs(model: str, depth: int, width: int) -> tuple[str, dict]:
    """timm's name and arguments of ``model`` (``t2t_vit``: T2T-ViT's family, every block at
    ``width``; ``swin_t``: Swin-T's four stages from ``width``, the third holding the blocks
    beyond Swin-T's 2 + 2 + 2 others) with ``depth`` blocks in all."""
    if model == "t2t_vit":
        return "t2t_vit_tiny", {"embed_dim": width, "depth": depth, "num_heads": 2,
                                "token_dim": width // 2}
    if model == "swin_t":
        if depth < 7:
            raise ValueError(f"swin_t keeps Swin-T's stages 1, 2 and 4 (2 blocks each): depth "
                             f"must be 7 or more, got {depth}")
        return "swin_tiny_patch4_window7_224", {
            "embed_dim": width, "depths": [2, 2, depth - 6, 2], "num_heads": [1, 2, 4, 8],
            "window_size": 4}
    raise ValueError(f"model must be t2t_vit or swin_t, got {model!r}")


def probe_setup(norm_cfg: Mapping, *, model: str, depth: int, width: int, batch: int,
                seed: int, img_size: int = 32
                ) -> tuple[dict[str, nn.Module], Callable[[], torch.Tensor]]:
    """``(points, loss)`` for ``unnorm.signal_propagation``: the classifier built at seed
    ``seed`` in training mode, its blocks in depth order, and its loss on one batch of
    standard-normal images and uniform labels (drawn from the same seed)."""
    torch.manual_seed(seed)
    timm_name, kwargs = model_kwargs(model, depth, width)
    net = create_classifier(timm_name, norm_cfg, CLASSES, img_size, **kwargs).train()
    images = torch.randn(batch, 3, img_size, img_size)
    labels = torch.randint(0, CLASSES, (batch,))
    points = {name: net.get_submodule(name) for name in block_names(net)}
    return points, lambda: nn.functional.cross_entropy(net(images), labels)
