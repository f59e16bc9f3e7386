"""Every norm on graphs behind one call, ``norm(x, batch, edge_index)`` on ``(num_items, C)``
node (or edge) features:

- the registry's norms (``unnorm.build_norm``) see the batch's nodes as rows: a norm with
  batch statistics (BN, UN, MABN, PN, PRepBN's BN) pools every node of every graph in the
  batch, as the release's ``nn.BatchNorm1d`` on DGL's stacked nodes; a per-row norm (LN, RMS,
  DyT, ScaleNorm) normalises each node alone. A norm whose statistics pool an example's
  positions (``layout="image"``: BCN's and EvoNorm's group statistics) pools each graph's
  nodes: its input is padded per graph (``to_dense_batch``) with the pad mask;
- torch_geometric's graph norms by name, not rewritten: ``graphnorm`` (GraphNorm),
  ``pairnorm`` (PairNorm), ``instancenorm`` (InstanceNorm, per graph, with affine),
  ``graph_ln`` (LayerNorm in graph mode: each graph over its nodes and channels),
  ``diffgroupnorm`` (DiffGroupNorm, soft clusters over the batch's nodes);
- ``granola`` (``plugins.graph.granola``).
"""
from __future__ import annotations

from typing import Mapping

import torch
from torch import nn
from torch_geometric.nn import norm as pyg_norm
from torch_geometric.utils import to_dense_batch

import unnorm
from plugins.norms import norm_kwargs

from .granola import Granola

#: torch_geometric's norms by the name a run gives them, each built for C channels with the
#: norm config's options
PYG_NORMS = {
    "graphnorm": lambda c, **o: pyg_norm.GraphNorm(c, **o),
    "pairnorm": lambda c, **o: pyg_norm.PairNorm(**o),
    "instancenorm": lambda c, **o: pyg_norm.InstanceNorm(c, affine=True, **o),
    "graph_ln": lambda c, **o: pyg_norm.LayerNorm(c, mode="graph", **o),
    "diffgroupnorm": lambda c, **o: pyg_norm.DiffGroupNorm(c, **o),
}
GRAPH_NORMS = (*PYG_NORMS, "granola")


def graph_norm_names() -> list[str]:
    """Every norm name a graph model takes: the registry's and the graph norms."""
    return [*unnorm.available_norms(), *GRAPH_NORMS]


class NodeNorm(nn.Module):
    """One norm site of a graph model: ``forward(x, batch, edge_index)``, x ``(items, C)``,
    ``batch`` each item's graph, ``edge_index`` the graph the items are the nodes of (GRANOLA
    reads it; None for edge features)."""

    def __init__(self, norm_cfg: Mapping, num_features: int, *, nodes: bool = True):
        super().__init__()
        name, options = norm_cfg["name"], norm_kwargs(norm_cfg)
        self.kind = ("registry" if name in unnorm.available_norms() else
                     "pyg" if name in PYG_NORMS else "granola" if name == "granola" else None)
        if self.kind is None:
            raise ValueError(f"unknown graph norm {name!r}; choose one of "
                             f"{', '.join(graph_norm_names())}")
        if self.kind == "granola" and not nodes:
            # GRANOLA's affine comes from a GNN over the nodes: edges get InstanceNorm per
            # graph with affine, the norm GRANOLA reduces to at a constant gamma and beta
            self.kind, name, options = "pyg", "instancenorm", {"eps": options.get("eps", 1e-5)}
        if self.kind == "registry":
            self.norm = unnorm.build_norm(name, num_features, **options)
            self.per_graph = getattr(self.norm, "layout", "token") == "image"
            if getattr(self.norm, "causal", False):
                raise ValueError(f"norm.causal=true pools positions <= t of a sequence; a graph "
                                 f"has no order: drop it for {name}")
        elif self.kind == "pyg":
            self.norm = PYG_NORMS[name](num_features, **options)
        else:
            self.norm = Granola(num_features, **options)

    def forward(self, x: torch.Tensor, batch: torch.Tensor, edge_index=None) -> torch.Tensor:
        if self.kind == "granola":
            return self.norm(x, edge_index, batch)
        if self.kind == "pyg":  # their statistics in float32 whatever x's dtype, as unnorm's
            rows = x if x.dtype == torch.float64 else x.float()
            with torch.autocast(x.device.type, enabled=False):
                out = (self.norm(rows) if isinstance(self.norm, pyg_norm.DiffGroupNorm)
                       else self.norm(rows, batch))  # DiffGroupNorm: clusters over the batch
            return out.to(x.dtype)
        if not self.per_graph:
            return self.norm(x)
        dense, present = to_dense_batch(x, batch)  # (graphs, most nodes, C), True = a node
        return self.norm(dense, pad_mask=~present)[present]
