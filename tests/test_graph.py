"""The graph task (plugins/graph): the Graph Transformer's attention against a float64
reference written from the release's equations, the norms over nodes against torch's and
torch_geometric's layers, GRANOLA's reduction and equivariance, and short runs of every norm
on every dataset (the loss falls, a resume continues exactly, bf16 and two gloo replicas)."""
from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from torch_geometric.data import Batch, Data
from torch_geometric.nn.norm import InstanceNorm

import unnorm
from plugins.checkpoints import load_checkpoint
from plugins.graph.data import build_graphs, laplacian_pe
from plugins.graph.granola import Granola
from plugins.graph.model import full_attention, sparse_attention
from plugins.graph.norms import GRAPH_NORMS, NodeNorm
from plugins.graph.trainer import train
from plugins.runlog import FINISHED
from test_vision import config, free_port, train_as_replica


def _random_batch(sizes=(5, 7, 4), channels=8, p=0.5, seed=0) -> Batch:
    generator = torch.Generator().manual_seed(seed)
    graphs = []
    for n in sizes:
        upper = torch.triu(torch.rand(n, n, generator=generator) < p, diagonal=1)
        adjacency = upper | upper.T
        graphs.append(Data(x=torch.randn(n, channels, generator=generator, dtype=torch.float64),
                           edge_index=adjacency.nonzero().T, num_nodes=n))
    return Batch.from_data_list(graphs)


def _complete(sizes) -> torch.Tensor:
    """Every ordered pair of distinct nodes of each graph (the release's full graph)."""
    edges, offset = [], 0
    for n in sizes:
        pairs = torch.cartesian_prod(torch.arange(n), torch.arange(n))
        edges.append(pairs[pairs[:, 0] != pairs[:, 1]].T + offset)
        offset += n
    return torch.cat(edges, dim=1)


def reference_attention(q, k, v, edge_index, e=None):
    """The release's ``propagate_attention``, node by node in float64: for each target node,
    its incoming edges' weights exp(clamp(score, -5, 5)), the values' weighted sum over the
    weights' sum (+1e-6 with edge features)."""
    nodes, heads, d = q.shape
    out = torch.zeros(nodes, heads, d, dtype=torch.float64)
    e_out = None if e is None else torch.zeros_like(e)
    for target in range(nodes):
        for head in range(heads):
            weighted, total = torch.zeros(d, dtype=torch.float64), 0.0
            for index in (edge_index[1] == target).nonzero().flatten().tolist():
                source = edge_index[0, index].item()
                if e is None:
                    score = (k[source, head] @ q[target, head]).item() / math.sqrt(d)
                else:
                    per_channel = k[source, head] * q[target, head] / math.sqrt(d) * e[index, head]
                    e_out[index, head] = per_channel
                    score = per_channel.sum().item()
                weight = math.exp(min(max(score, -5.0), 5.0))
                weighted += weight * v[source, head]
                total += weight
            if total:
                out[target, head] = weighted / (total + (1e-6 if e is not None else 0.0))
    return out, e_out


@pytest.mark.parametrize("edges", [False, True])
def test_sparse_attention_matches_the_releases_equations(edges):
    """On a random graph (scores large enough that the clamp bites), node and edge variants."""
    batch = _random_batch(channels=6)
    n, heads, d = batch.num_nodes, 2, 3
    generator = torch.Generator().manual_seed(1)
    q, k, v = (4 * torch.randn(n, heads, d, generator=generator, dtype=torch.float64) for _ in range(3))
    e = torch.randn(batch.edge_index.shape[1], heads, d, generator=generator,
                    dtype=torch.float64) if edges else None
    got, got_e = sparse_attention(q, k, v, batch.edge_index, e)
    want, want_e = reference_attention(q, k, v, batch.edge_index, e)
    assert torch.allclose(got, want, rtol=1e-12, atol=1e-12)
    if edges:
        assert torch.allclose(got_e, want_e, rtol=1e-12, atol=1e-12)


def test_sparse_attention_on_a_complete_graph_equals_full_attention():
    sizes = (5, 7, 1, 4)  # a one-node graph attends to nothing: zero either way
    batch = _random_batch(sizes)
    generator = torch.Generator().manual_seed(2)
    q, k, v = (2 * torch.randn(batch.num_nodes, 2, 4, generator=generator, dtype=torch.float64)
               for _ in range(3))
    sparse, _ = sparse_attention(q, k, v, _complete(sizes))
    dense = full_attention(q, k, v, batch.batch)
    assert torch.allclose(sparse, dense, rtol=1e-12, atol=1e-12)
    assert not torch.allclose(sparse, sparse_attention(q, k, v, batch.edge_index)[0])  # sparse != full


def test_laplacian_encodings_are_eigenvectors_of_the_normalised_laplacian():
    batch = _random_batch((9,), p=0.6, seed=3)
    pe = laplacian_pe(batch.edge_index, 9, 3).double()
    adjacency = torch.zeros(9, 9, dtype=torch.float64)
    adjacency[batch.edge_index[0], batch.edge_index[1]] = 1
    scale = adjacency.sum(1).clamp_min(1).rsqrt()
    laplacian = torch.eye(9, dtype=torch.float64) - scale[:, None] * adjacency * scale[None]
    values = torch.linalg.eigvalsh(laplacian)[1:4]
    assert torch.allclose(laplacian @ pe, pe * values, atol=1e-5)  # float32 vectors
    assert laplacian_pe(batch.edge_index, 9, 12)[:, 8:].abs().sum() == 0  # k > n - 1: zeros


def test_bn_over_nodes_equals_batchnorm1d_on_the_stacked_nodes():
    batch = _random_batch(channels=8)
    x = batch.x.float().requires_grad_(True)
    ours = NodeNorm({"name": "bn", "momentum": 0.9}, 8)
    torch_bn = torch.nn.BatchNorm1d(8, momentum=0.1)
    for module in (ours.norm, torch_bn):
        with torch.no_grad():
            module.weight.copy_(torch.linspace(0.5, 2, 8))
            module.bias.copy_(torch.linspace(-1, 1, 8))
    y = ours(x, batch.batch)
    x_ref = batch.x.float().requires_grad_(True)
    y_ref = torch_bn(x_ref)
    # float32 over 16 nodes: a few ulps of values of order 1
    assert torch.allclose(y, y_ref, atol=1e-5)
    weights = torch.randn_like(y)
    (y * weights).sum().backward()
    (y_ref * weights).sum().backward()
    assert torch.allclose(x.grad, x_ref.grad, atol=1e-5)
    assert torch.allclose(ours.norm.running_mean, torch_bn.running_mean, atol=1e-6)


def test_a_norm_that_pools_positions_pools_each_graph():
    """EvoNorm-S0 with layout=image: each graph's statistics from its own nodes (the norm on
    that graph alone), not the batch's."""
    batch = _random_batch(channels=8)
    norm = NodeNorm({"name": "evonorm_s0", "groups": 2, "layout": "image"}, 8).double()
    got = norm(batch.x, batch.batch)
    alone = torch.cat([norm.norm(graph.x[None])[0] for graph in batch.to_data_list()])
    assert torch.allclose(got, alone, rtol=1e-12, atol=1e-12)
    assert not torch.allclose(got, norm.norm(batch.x[None])[0])  # the whole batch as one example


def _granola(seed=0, channels=8) -> Granola:
    torch.manual_seed(seed)
    norm = Granola(channels, rnf_dim=4).double()
    for layer in (norm.gamma, norm.beta):  # away from the init, which is InstanceNorm already
        torch.nn.init.normal_(layer.weight)
        torch.nn.init.normal_(layer.bias)
    return norm


def test_granola_with_gamma_one_and_beta_zero_is_instancenorm_without_affine():
    batch = _random_batch()
    norm = _granola()
    torch.nn.init.zeros_(norm.gamma.weight)
    torch.nn.init.ones_(norm.gamma.bias)
    torch.nn.init.zeros_(norm.beta.weight)
    torch.nn.init.zeros_(norm.beta.bias)
    want = InstanceNorm(8, affine=False).double()(batch.x, batch.batch)
    assert torch.allclose(norm(batch.x, batch.edge_index, batch.batch), want, rtol=1e-10, atol=1e-10)


def test_granola_is_permutation_equivariant_with_its_random_features_seeded():
    batch = _random_batch()
    norm = _granola()
    rnf = torch.randn(batch.num_nodes, 4, generator=torch.Generator().manual_seed(5), dtype=torch.float64)
    order = torch.cat([torch.randperm(count, generator=torch.Generator().manual_seed(6)) + start
                       for start, count in zip(batch.ptr[:-1].tolist(), batch.ptr.diff().tolist())])
    inverse = torch.empty_like(order)
    inverse[order] = torch.arange(len(order))
    out = norm(batch.x, batch.edge_index, batch.batch, rnf)
    permuted = norm(batch.x[order], inverse[batch.edge_index], batch.batch[order], rnf[order])
    assert torch.allclose(permuted, out[order], rtol=1e-10, atol=1e-10)
    assert not torch.allclose(norm(batch.x, batch.edge_index, batch.batch, rnf.flip(0)), out)  # R matters


# --- runs -----------------------------------------------------------------------------------

TINY = ["model.layers=2", "model.hidden=16", "model.heads=2", "recipe.batch_size=8",
        "recipe.lr=3e-3", "recipe.epochs=3", "logger=none", "device=cpu",
        "record_scale_invariance=false"]
TINY_DATA = {
    "pattern": ["data.patterns=4", "data.train_per_pattern=12", "data.test_per_pattern=3",
                "data.num_train=48"],
    "cluster": ["data.num_train=48", "data.num_val=12", "data.num_test=12"],
    "freesolv": ["recipe.batch_size=64"],
}
QUICK = {"un": ["norm.warmup_iters=4", "norm.compensation_start=6"],
         "mabn": ["norm.warmup_iters=4", "norm.window_size=3", "norm.compensation_start=6"],
         "pn": ["norm.warmup_iters=4"], "pn_ls": ["norm.warmup_iters=4", "norm.group_num=2"],
         "prepbn": ["norm.warmup_iters=3", "norm.decay_iters=6"]}
NORMS = [*unnorm.available_norms(), *GRAPH_NORMS]


def _config(data: str, norm: str, *extra: str, model: str = "graph_transformer"):
    return config(f"+exp={model}_{data}_{norm}", "scale=cpu", *TINY, *TINY_DATA[data],
                  *QUICK.get(norm, []), *extra)


def _epochs(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def _trains(data, norm, tmp_path, model="graph_transformer", *extra):
    """The run finishes and its last epoch's training loss is below that of the same run with
    its weights held still (learning rate 1e-12): the same seed draws the same batches, sign
    flips and dropout masks in both, so the gap is the updates' alone (with the draws moving
    a frozen model's epoch loss by up to 0.3%, a fall from the first epoch would not be)."""
    result = train(_config(data, norm, *extra, model=model), tmp_path / "run")
    assert result["status"] in FINISHED and result["task"] == "graph", result
    losses = [epoch["train_loss"] for epoch in _epochs(tmp_path / "run")]
    train(_config(data, norm, *extra, "recipe.lr=1e-12", model=model), tmp_path / "frozen")
    frozen = [epoch["train_loss"] for epoch in _epochs(tmp_path / "frozen")]
    assert all(map(math.isfinite, losses)) and losses[-1] < frozen[-1], (losses, frozen)
    metric = "acc" if data != "freesolv" else "mae"
    assert math.isfinite(result["metrics"][metric]) and f"test_{metric}" in result["metrics"]


@pytest.mark.parametrize("data", ["pattern", "cluster", "freesolv"])
@pytest.mark.parametrize("norm", ["bn", "ln", "un", "granola"])
def test_the_main_norms_train_each_dataset(data, norm, tmp_path):
    _trains(data, norm, tmp_path)


@pytest.mark.parametrize("data", ["pattern", "cluster", "freesolv"])
def test_the_message_passing_baseline_trains_each_dataset(data, tmp_path):
    """GIN (``model=gin``), with the release's norm."""
    _trains(data, "bn", tmp_path, model="gin")


@pytest.mark.slow
@pytest.mark.parametrize("data", ["pattern", "cluster", "freesolv"])
@pytest.mark.parametrize("norm", [n for n in NORMS if n not in ("bn", "ln", "un", "granola")])
def test_every_norm_trains_each_dataset(data, norm, tmp_path):
    _trains(data, norm, tmp_path)


@pytest.mark.parametrize("norm", ["bn", "un", "granola", "prepbn"])
def test_a_run_resumes_exactly(norm, tmp_path, monkeypatch):
    """Stopped after its first epoch's checkpoint and resumed, a run ends where the whole one
    does, weights bit for bit (GRANOLA's random features and the encodings' sign flips come
    from the RNG states the checkpoint keeps)."""
    from plugins import loop
    whole = train(_config("cluster", norm), tmp_path / "whole")
    end_epoch = loop.EpochLoop._end_epoch

    def stop_after_first(self, epoch, *args, **kwargs):
        end_epoch(self, epoch, *args, **kwargs)
        if epoch == 0:
            raise KeyboardInterrupt

    with monkeypatch.context() as patch:
        patch.setattr(loop.EpochLoop, "_end_epoch", stop_after_first)
        with pytest.raises(KeyboardInterrupt):
            train(_config("cluster", norm), tmp_path / "stopped")
    resumed = train(_config("cluster", norm), tmp_path / "stopped")
    assert resumed["metrics"] == {**whole["metrics"], "epoch_time_s": resumed["metrics"]["epoch_time_s"]}
    want = load_checkpoint(tmp_path / "whole" / "last.pt")["model"]
    got = load_checkpoint(tmp_path / "stopped" / "last.pt")["model"]
    assert all(torch.equal(got[key], value) for key, value in want.items())


def test_the_generated_data_is_seeded_and_the_molecules_are_freesolv():
    cfg = _config("pattern", "ln")
    first, again = (build_graphs(dict(cfg.data), 2) for _ in range(2))
    assert first.record == again.record and first.record["graphs"] == [48, 12, 12]
    labels = torch.cat([g.y for g in first.train])
    assert 0 < labels.float().mean() < 0.6  # the pattern's nodes, a minority
    molecules = build_graphs(dict(_config("freesolv", "ln").data), 8)
    assert [len(s) for s in (molecules.train, molecules.val, molecules.test)] == [514, 64, 64]
    assert molecules.record["sha256"] == build_graphs(dict(_config("freesolv", "ln").data), 8).record["sha256"]


def test_bad_settings_are_refused_by_name():
    with pytest.raises(ValueError, match="model.edge_features=false"):
        train(_config("pattern", "ln", "model.edge_features=true"), Path("/tmp/never"))
    with pytest.raises(ValueError, match="unknown graph norm"):
        NodeNorm({"name": "batchnorm"}, 8)
    with pytest.raises(ValueError, match="model.attention"):
        _config_model = dict(_config("freesolv", "ln").model, attention="full")
        from plugins.graph.model import GraphNet
        GraphNet(_config_model, {"name": "ln"}, node_vocab=(3,), edge_vocab=(3,), out=1,
                 graph_level=True)


@pytest.mark.slow
def test_two_gloo_replicas_train_in_float32_and_under_a_bf16_cast(tmp_path):
    """2 replicas (DDP, gloo) in float32 and under bf16 autocast: both finish, UN counts its
    steps alike on each, and bf16 trains differently from float32 (it casts) but scores
    near it."""
    import torch.multiprocessing as mp
    base = [f"+exp=graph_transformer_cluster_un", "scale=cpu", *TINY, *TINY_DATA["cluster"],
            *QUICK["un"]]
    runs = [([*base, f"amp={amp}"], str(tmp_path / amp)) for amp in ("false", "bf16")]
    mp.start_processes(train_as_replica, args=(free_port(), runs, train), nprocs=2, start_method="spawn")
    results = {amp: json.loads((tmp_path / amp / "result.json").read_text()) for amp in ("false", "bf16")}
    states = {amp: load_checkpoint(tmp_path / amp / "last.pt")["model"] for amp in results}
    for amp, result in results.items():
        assert result["status"] in FINISHED and result["world_size"] == 2, amp
        counters = {int(v) for k, v in states[amp].items() if k.endswith("num_iters")}
        assert counters == {result["steps"]}, amp  # 3 epochs of 48 / 8 graphs
    assert any(not torch.equal(states["bf16"][k], v) for k, v in states["false"].items())
    assert results["bf16"]["metrics"]["acc"] == pytest.approx(results["false"]["metrics"]["acc"], abs=15)
