"""GRANOLA (Eliasof, Bevilacqua, Schönlieb & Maron, "GRANOLA: Adaptive Normalization for
Graph Neural Networks", NeurIPS 2024, arXiv:2404.13344), written from the paper's equations:
there is no release.

For node features ``H`` of a batch of graphs, per layer:

    R ~ N(0, 1)                               random node features, (num_nodes, rnf_dim)
    Z = GNN_norm(A, H || R)                   a shallow GNN over the graph (GIN layers here)
    gamma = f_1(Z),  beta = f_2(Z)            per node and channel
    out = gamma * (H - mu_g) / sqrt(var_g + eps) + beta

with ``mu_g`` and ``var_g`` each graph's per-channel mean and (biased) variance over its
nodes: InstanceNorm's statistics, which GRANOLA's affine then makes adaptive.

Where the paper leaves a choice open, and what is chosen here (docs/graphs.md):

- ``f_1``, ``f_2``: linear maps of Z; ``f_1`` starts at weight 0, bias 1, and ``f_2`` at 0,
  so GRANOLA starts as InstanceNorm without affine (the paper does not state its init);
- GNN_norm: ``depth`` GIN layers (torch_geometric's ``GINConv``, each MLP Linear-ReLU-Linear)
  of width ``hidden`` (default: the norm's channels), ReLU between;
- R: fresh standard normal features at every call, in training and evaluation alike (the
  paper samples RNF at inference too), drawn from torch's generator (seeded by the run);
  ``rnf_dim`` defaults to the norm's channels. A caller can pass R (tests, a fixed draw).
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import nn
from torch_geometric.nn import GINConv
from torch_geometric.utils import scatter


class Granola(nn.Module):
    """GRANOLA over ``(num_nodes, C)`` node features; ``forward(x, edge_index, batch)``."""

    def __init__(self, num_features: int, rnf_dim: Optional[int] = None, depth: int = 2,
                 hidden: Optional[int] = None, eps: float = 1e-5):
        super().__init__()
        if depth < 1:
            raise ValueError(f"GRANOLA's normalisation GNN needs depth >= 1 GIN layers, got {depth}")
        self.num_features, self.eps = num_features, float(eps)
        self.rnf_dim = rnf_dim or num_features
        hidden = hidden or num_features
        widths = [num_features + self.rnf_dim] + [hidden] * depth
        self.gnn = nn.ModuleList(
            GINConv(nn.Sequential(nn.Linear(a, b), nn.ReLU(), nn.Linear(b, b)), train_eps=True)
            for a, b in zip(widths[:-1], widths[1:]))
        self.gamma, self.beta = nn.Linear(hidden, num_features), nn.Linear(hidden, num_features)
        nn.init.zeros_(self.gamma.weight)
        nn.init.ones_(self.gamma.bias)
        nn.init.zeros_(self.beta.weight)
        nn.init.zeros_(self.beta.bias)

    def extra_repr(self) -> str:
        return f"{self.num_features}, rnf_dim={self.rnf_dim}, depth={len(self.gnn)}, eps={self.eps}"

    def forward(self, x: torch.Tensor, edge_index: torch.Tensor, batch: torch.Tensor,
                rnf: Optional[torch.Tensor] = None) -> torch.Tensor:
        if rnf is None:
            rnf = torch.randn(x.shape[0], self.rnf_dim, device=x.device, dtype=x.dtype)
        z = torch.cat([x, rnf.to(x.dtype)], dim=-1)
        for index, layer in enumerate(self.gnn):
            z = layer(z, edge_index)
            if index < len(self.gnn) - 1:
                z = torch.relu(z)
        return self.gamma(z) * instance_standardize(x, batch, self.eps) + self.beta(z)


def instance_standardize(x: torch.Tensor, batch: torch.Tensor, eps: float) -> torch.Tensor:
    """Each graph's nodes standardised per channel by the graph's mean and biased variance,
    computed in float32 (float64 for float64 input), returned in x's dtype."""
    rows = x if x.dtype == torch.float64 else x.float()
    mean = scatter(rows, batch, dim=0, reduce="mean")
    centred = rows - mean[batch]
    var = scatter(centred.square(), batch, dim=0, reduce="mean")
    return (centred * torch.rsqrt(var + eps)[batch]).to(x.dtype)
