"""The Graph Transformer (Dwivedi & Bresson, "A Generalization of Transformer Networks to
Graphs", AAAI DLG workshop 2021) on torch_geometric, written from its release
(graphdeeplearning/graphtransformer ``layers/graph_transformer_layer.py``,
``layers/graph_transformer_edge_layer.py``, ``nets/*/graph_transformer_net.py``; the release
needs DGL), with the norm a switch at every site; and GIN (torch_geometric's ``GINConv``),
the message-passing baseline.

The release's layer, kept here:

- attention over the graph's edges, each head's score ``K_src . Q_dst / sqrt(d)`` clamped to
  [-5, 5] before its exponential, which is summed over a node's incoming edges (no max
  subtracted: the clamp is the release's numerical guard) and divides the weighted values;
  or over every other node of the graph (``model.attention=full``, the release's
  ``full_graph``: a complete graph without self-loops), computed densely per graph;
- with edge features (``model.edge_features``): the score per channel ``K_src * Q_dst /
  sqrt(d) * E``, which is also the edge stream's output; its channels summed, clamped and
  exponentiated give the weights, and the node output divides by their sum + 1e-6;
- Post-norm: ``norm(x + O(attn))``, then ``norm(h + FFN(h))`` with a ReLU FFN of
  ``ffn_multiple`` x the width (2), on nodes and (edge variant) on edges alike;
- Laplacian positional encodings (``lap_pe``) through a linear layer added to the node
  embedding, their signs flipped at random per training batch (one draw per eigenvector,
  as the release's training loop);
- the readout: the release's ``MLPReadout`` (widths d, d/2, d/4, out), per node for node
  classification, on each graph's mean node for graph regression.

What differs: a node with no incoming edge (possible in a generated graph) gets zero from
attention where the release divides 0 by 0; the last layer of the edge variant does not
update the edges, which nothing reads after it (the release computes and drops them).
"""
from __future__ import annotations

import math
from typing import Mapping, Optional, Sequence

import torch
from torch import nn
from torch_geometric.nn import GINConv, global_mean_pool
from torch_geometric.utils import scatter, to_dense_batch

from .norms import NodeNorm

SCORE_CLAMP = 5.0  # the release's clamp of the scaled scores before exp
EDGE_EPS = 1e-6    # the edge layer's guard on the weights' sum (the release's)


def sparse_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, edge_index: torch.Tensor,
                     e: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """The release's ``propagate_attention`` over ``edge_index`` (source -> target): q, k, v
    ``(nodes, heads, d)``, e ``(edges, heads, d)`` the projected edge features or None.
    Returns the nodes' ``(nodes, heads, d)`` and (edge variant) the edges' scores."""
    src, dst = edge_index
    scores = k[src] * q[dst] / math.sqrt(q.shape[-1])
    if e is None:
        weights = torch.exp(scores.sum(-1, keepdim=True).clamp(-SCORE_CLAMP, SCORE_CLAMP))
        e_out = None
    else:
        scores = scores * e
        e_out = scores
        weights = torch.exp(scores.sum(-1, keepdim=True).clamp(-SCORE_CLAMP, SCORE_CLAMP))
    nodes = q.shape[0]
    weighted = scatter(v[src] * weights, dst, dim=0, dim_size=nodes, reduce="sum")
    total = scatter(weights, dst, dim=0, dim_size=nodes, reduce="sum")
    if e is not None:
        return weighted / (total + EDGE_EPS), e_out
    return weighted / torch.where(total > 0, total, torch.ones_like(total)), None


def full_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                   batch: torch.Tensor) -> torch.Tensor:
    """The same attention over every other node of each graph (the release's full graph),
    computed on each graph's padded ``(heads, n, n)`` scores."""
    heads, d = q.shape[1:]
    dense = [to_dense_batch(t.flatten(1), batch)[0].unflatten(-1, (heads, d)).transpose(1, 2)
             for t in (q, k, v)]  # (graphs, heads, n, d)
    present = to_dense_batch(q[:, 0, 0], batch)[1]  # (graphs, n)
    scores = dense[0] @ dense[1].transpose(-1, -2) / math.sqrt(d)  # (graphs, heads, n_q, n_k)
    weights = torch.exp(scores.clamp(-SCORE_CLAMP, SCORE_CLAMP))
    n = present.shape[1]
    keep = present[:, None, None, :] & ~torch.eye(n, dtype=torch.bool, device=q.device)
    weights = weights * keep
    total = weights.sum(-1, keepdim=True)
    out = (weights @ dense[2]) / torch.where(total > 0, total, torch.ones_like(total))
    return out.transpose(1, 2)[present]  # (nodes, heads, d)


class GraphTransformerLayer(nn.Module):
    """One Post-norm Graph Transformer layer; ``forward(h, batch, edge_index, e=None)``
    returns ``(h, e)``. ``update_edges=False``: the edge features weight the attention but
    are not updated (the last layer of the edge variant)."""

    def __init__(self, dim: int, heads: int, norm_cfg: Mapping, *, dropout: float = 0.0,
                 residual: bool = True, bias: bool = False, ffn_multiple: int = 2,
                 attention: str = "sparse", edge_features: bool = False, update_edges: bool = True):
        super().__init__()
        if dim % heads:
            raise ValueError(f"model.hidden {dim} is not divisible by model.heads {heads}")
        if attention not in ("sparse", "full"):
            raise ValueError(f"model.attention must be sparse (over the graph's edges) or full "
                             f"(over every node of the graph), got {attention!r}")
        if attention == "full" and edge_features:
            raise ValueError("model.attention=full with model.edge_features=true: the edge "
                             "variant attends over the graph's edges (its features live there); "
                             "use model.attention=sparse, or model.edge_features=false")
        self.heads, self.dropout, self.residual = heads, dropout, residual
        self.attention, self.edge_features = attention, edge_features
        self.update_edges = edge_features and update_edges
        self.q, self.k, self.v = (nn.Linear(dim, dim, bias=bias) for _ in range(3))
        self.o_h = nn.Linear(dim, dim)
        self.ffn_h = nn.Sequential(nn.Linear(dim, dim * ffn_multiple), nn.ReLU(),
                                   nn.Dropout(dropout), nn.Linear(dim * ffn_multiple, dim))
        self.norm1_h, self.norm2_h = NodeNorm(norm_cfg, dim), NodeNorm(norm_cfg, dim)
        if edge_features:
            self.proj_e = nn.Linear(dim, dim, bias=bias)
        if self.update_edges:
            self.o_e = nn.Linear(dim, dim)
            self.ffn_e = nn.Sequential(nn.Linear(dim, dim * ffn_multiple), nn.ReLU(),
                                       nn.Dropout(dropout), nn.Linear(dim * ffn_multiple, dim))
            self.norm1_e = NodeNorm(norm_cfg, dim, nodes=False)
            self.norm2_e = NodeNorm(norm_cfg, dim, nodes=False)

    def forward(self, h: torch.Tensor, batch: torch.Tensor, edge_index: torch.Tensor,
                e: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
        split = lambda t: t.unflatten(-1, (self.heads, -1))  # noqa: E731
        q, k, v = split(self.q(h)), split(self.k(h)), split(self.v(h))
        if self.attention == "full":
            attended, e_attended = full_attention(q, k, v, batch), None
        else:
            attended, e_attended = sparse_attention(
                q, k, v, edge_index, split(self.proj_e(e)) if self.edge_features else None)
        h = self._post_norm(h, self.o_h(self._drop(attended.flatten(1))), self.ffn_h,
                            self.norm1_h, self.norm2_h, batch, edge_index)
        if self.update_edges:
            edge_batch = batch[edge_index[0]]
            e = self._post_norm(e, self.o_e(self._drop(e_attended.flatten(1))), self.ffn_e,
                                self.norm1_e, self.norm2_e, edge_batch, None)
        return h, e

    def _drop(self, x: torch.Tensor) -> torch.Tensor:
        return nn.functional.dropout(x, self.dropout, training=self.training)

    def _post_norm(self, x, update, ffn, norm1, norm2, batch, edge_index):
        x = norm1(x + update if self.residual else update, batch, edge_index)
        update = ffn(x)
        return norm2(x + update if self.residual else update, batch, edge_index)


class CategoricalEncoder(nn.Module):
    """Integer feature columns to one vector: the sum of one embedding per column (a single
    column: the release's ``nn.Embedding``)."""

    def __init__(self, vocab: Sequence[int], dim: int):
        super().__init__()
        self.embeddings = nn.ModuleList(nn.Embedding(size, dim) for size in vocab)

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        return sum(embedding(features[:, i]) for i, embedding in enumerate(self.embeddings))


class MLPReadout(nn.Module):
    """The release's readout: widths d, d/2, d/4 with ReLU, then the output."""

    def __init__(self, dim: int, out: int, hidden_layers: int = 2):
        super().__init__()
        widths = [dim // 2 ** i for i in range(hidden_layers + 1)]
        layers: list[nn.Module] = []
        for a, b in zip(widths[:-1], widths[1:]):
            layers += [nn.Linear(a, b), nn.ReLU()]
        self.mlp = nn.Sequential(*layers, nn.Linear(widths[-1], out))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.mlp(x)


class GraphNet(nn.Module):
    """A graph model's embedding, positional encodings, layers and readout; the layers are
    the Graph Transformer's or GIN's (``model.name``). ``forward(batch)``: node logits
    (node classification) or one value per graph (graph regression)."""

    def __init__(self, model_cfg: Mapping, norm_cfg: Mapping, *, node_vocab: Sequence[int],
                 edge_vocab: Sequence[int], out: int, graph_level: bool):
        super().__init__()
        dim, depth = model_cfg["hidden"], model_cfg["layers"]
        self.kind, self.graph_level = model_cfg["name"], graph_level
        self.edge_features = bool(model_cfg.get("edge_features")) and self.kind == "graph_transformer"
        if self.edge_features and not edge_vocab:
            raise ValueError("model.edge_features=true, but this data has no edge features "
                             "(the SBMs' edges carry none): set model.edge_features=false")
        self.embed_h = CategoricalEncoder(node_vocab, dim)
        self.embed_e = CategoricalEncoder(edge_vocab, dim) if self.edge_features else None
        self.pe_dim = model_cfg["pe_dim"] if model_cfg.get("lap_pe") else 0
        self.embed_pe = nn.Linear(self.pe_dim, dim) if self.pe_dim else None
        self.in_feat_dropout = nn.Dropout(model_cfg.get("in_feat_dropout", 0.0))
        if self.kind == "graph_transformer":
            self.layers = nn.ModuleList(GraphTransformerLayer(
                dim, model_cfg["heads"], norm_cfg, dropout=model_cfg["dropout"],
                residual=model_cfg["residual"], bias=model_cfg["bias"],
                ffn_multiple=model_cfg["ffn_multiple"], attention=model_cfg["attention"],
                edge_features=self.edge_features, update_edges=index < depth - 1)
                for index in range(depth))
        elif self.kind == "gin":
            self.layers = nn.ModuleList(GINLayer(dim, norm_cfg, dropout=model_cfg["dropout"],
                                                 residual=model_cfg["residual"])
                                        for _ in range(depth))
        else:
            raise ValueError(f"unknown graph model {self.kind!r}; choose graph_transformer or gin")
        self.readout = MLPReadout(dim, out)

    def forward(self, data) -> torch.Tensor:
        h = self.embed_h(data.x)
        if self.embed_pe is not None:
            pe = data.lap_pe
            if self.training:  # one random sign per eigenvector and batch (the release)
                pe = pe * (torch.rand(self.pe_dim, device=pe.device) >= 0.5).to(pe.dtype).mul(2).sub(1)
            h = h + self.embed_pe(pe)
        h = self.in_feat_dropout(h)
        e = self.embed_e(data.edge_attr) if self.embed_e is not None else None
        for layer in self.layers:
            h, e = layer(h, data.batch, data.edge_index, e)
        if self.graph_level:
            return self.readout(global_mean_pool(h, data.batch)).squeeze(-1)
        return self.readout(h)


class GINLayer(nn.Module):
    """GIN as Benchmarking GNNs stacks it: ``GINConv`` (a two-layer MLP, learned epsilon),
    the norm, ReLU, residual, dropout."""

    def __init__(self, dim: int, norm_cfg: Mapping, *, dropout: float = 0.0, residual: bool = True):
        super().__init__()
        self.conv = GINConv(nn.Sequential(nn.Linear(dim, dim), nn.ReLU(), nn.Linear(dim, dim)),
                            train_eps=True)
        self.norm, self.dropout, self.residual = NodeNorm(norm_cfg, dim), dropout, residual

    def forward(self, h, batch, edge_index, e=None):
        out = torch.relu(self.norm(self.conv(h, edge_index), batch, edge_index))
        out = nn.functional.dropout(out, self.dropout, training=self.training)
        return (h + out if self.residual else out), e
