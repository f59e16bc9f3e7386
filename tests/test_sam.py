"""Training through the norms (plugins/sam.py): SAM on a quadratic against its closed form,
SAM-ON and ASAM-ON against the release's algorithm written out from sam_on.py, the norms'
running state advanced once per SAM update (also when a scaler skips it, and compiled in one
graph), norm-only training, and both through the shared training loop."""
from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import unnorm
from plugins.sam import SharpnessAware, freeze_except, norm_parameters
from test_lm import TINY_MODEL, TINY_RECIPE, config, corpus_root  # noqa: F401 (a fixture)
from test_norms import STATEFUL, make_sequence

C = 8
SHAPE = (4, 5, C)


class Block(nn.Module):
    """A tiny model whose norm layers carry 'norm' in their names, as the release needs."""

    def __init__(self, norm: str):
        super().__init__()
        self.inp = nn.Linear(C, C)
        self.norm1 = unnorm.build_norm(norm, C, **STATEFUL.get(norm, {}))
        self.mid = nn.Linear(C, C)
        self.norm2 = nn.LayerNorm(C)
        self.head = nn.Linear(C, 3)

    def forward(self, x):
        return self.head(self.norm2(self.mid(torch.nn.functional.gelu(self.norm1(self.inp(x))))))


def loss_of(model, x):
    return model(x).square().mean()


def sam_update(model, optimizer, sam, x, scaler=None):
    """One update as the shared loop makes it."""
    optimizer.zero_grad(set_to_none=True)
    sam.new_update()
    loss = loss_of(model, x)
    scaled = (lambda loss: loss) if scaler is None else scaler.scale
    scaled(loss).backward()
    sam.perturbed_gradient(lambda: scaled(loss_of(model, x)).backward())
    if scaler is None:
        optimizer.step()
    else:
        scaler.step(optimizer)
        scaler.update()


def test_sam_on_a_quadratic_is_its_closed_form():
    """L = w^T A w / 2: g = A w, eps = rho g / |g|, w' = w - lr A (w + eps)."""
    a = torch.tensor([[3.0, 0.5], [0.5, 1.0]], dtype=torch.float64)
    w0 = torch.tensor([1.0, -2.0], dtype=torch.float64)
    model = nn.Linear(2, 1, bias=False).double()
    with torch.no_grad():
        model.weight.copy_(w0)
    sam = SharpnessAware(model, rho=0.1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.2)
    quadratic = lambda: 0.5 * model.weight[0] @ a @ model.weight[0]  # noqa: E731
    quadratic().backward()
    sam.ascend()
    optimizer.zero_grad()
    quadratic().backward()
    sam.restore()
    optimizer.step()
    g = a @ w0
    expected = w0 - 0.2 * a @ (w0 + 0.1 * g / g.norm())
    torch.testing.assert_close(model.weight[0].detach(), expected, rtol=1e-12, atol=1e-12)


def release_update(model, x, rho, adaptive, eta=0.0, elementwise=True, normalize_bias=False,
                   lr=0.1):
    """sam_on.py's SAM_BN/ASAM_BN with only_bn (parameters chosen by name), then SGD."""
    optimizer = torch.optim.SGD(model.parameters(), lr=lr)
    loss_of(model, x).backward()
    old, scaled, norms = {}, {}, []
    for name, p in model.named_parameters():
        old[name] = p.detach().clone()
        if p.grad is None or ("norm" not in name and "bn" not in name):
            continue
        grad = p.grad.clone()
        t = None
        if adaptive and ("weight" in name or normalize_bias):
            t = p.detach().abs() + eta if elementwise else torch.ones_like(p) * p.norm() + eta
            grad = grad * t
        scaled[name] = (grad, t)
        norms.append(grad.norm())
    total = torch.stack(norms).norm() + 1e-16
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name in scaled:
                grad, t = scaled[name]
                p.add_((grad if t is None else grad * t) * rho / total)
    optimizer.zero_grad()
    loss_of(model, x).backward()
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(old[name])
    optimizer.step()


@pytest.mark.parametrize("norm", ["ln", "dyt", "evonorm_s0", "bcn"])
@pytest.mark.parametrize("adaptive, normalize_bias", [(False, False), (True, False), (True, True)])
def test_sam_on_and_asam_on_are_the_releases_algorithm(adaptive, normalize_bias, norm):
    """The perturbation touches the norm layers' parameters only, all of them (DyT's alpha,
    EvoNorm's v, BCN's per-group affine too), and ASAM scales the ones named weight; the
    descent uses the perturbed gradient for every parameter. Training outputs read no running
    state (BCN's BN normalises by the batch's), so the second pass is the release's exactly."""
    torch.manual_seed(0)
    ours = Block(norm)
    with torch.no_grad():  # away from their initial values, which a perturbation keeps apart
        for name, param in ours.named_parameters():
            if name.startswith("norm1."):
                param.add_(torch.randn_like(param) * 0.1)
    theirs = copy.deepcopy(ours)
    x = make_sequence(1, shape=SHAPE)[0][0]
    release_update(theirs, x, rho=0.5, adaptive=adaptive, normalize_bias=normalize_bias, eta=0.01)
    sam = SharpnessAware(ours, rho=0.5, adaptive=adaptive, only_norm=True, eta=0.01,
                         normalize_bias=normalize_bias)
    assert set(sam.perturbed) == {name for name, _ in ours.named_parameters() if "norm" in name}
    sam_update(ours, torch.optim.SGD(ours.parameters(), lr=0.1), sam, x)
    for (name, p), q in zip(ours.named_parameters(), theirs.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-6, atol=1e-7, msg=name)


def test_the_perturbed_set_is_chosen_by_module_type():
    """Every parameter of each norm layer, whatever the layer is named (the release's rule
    needs 'norm' in the name)."""
    model = nn.Sequential(nn.Linear(C, C), unnorm.build_norm("dyt", C),
                          unnorm.build_norm("prepbn", C, decay_iters=4), nn.GroupNorm(2, C),
                          unnorm.build_norm("evonorm_b0", C), unnorm.build_norm("bcn", C, groups=2))
    chosen = set(norm_parameters(model))
    assert chosen == {"1.weight", "1.bias", "1.alpha",
                      "2.weight", "2.bias", "2.bn_weight", "2.bn_bias", "2.alpha",
                      "3.weight", "3.bias", "4.weight", "4.bias", "4.v",
                      "5.weight", "5.bias", "5.group_weight", "5.group_bias"}


@pytest.mark.parametrize("name", list(STATEFUL))
def test_a_sam_update_advances_the_norms_state_once(name):
    """Every running statistic, window and counter as after one plain step on the batch."""
    torch.manual_seed(0)
    plain = Block(name)
    sharp = copy.deepcopy(plain)
    sam = SharpnessAware(sharp, rho=0.5, only_norm=True)
    optimizer = torch.optim.SGD(sharp.parameters(), lr=0.1)
    for x in make_sequence(6, shape=SHAPE)[0]:
        loss_of(plain, x).backward()  # the state depends on the weights: compare step 1 only
        sam_update(sharp, optimizer, sam, x)
        break
    parameters = dict(plain.norm1.named_parameters())  # SAM's update moved them; not the state
    for key, value in plain.norm1.state_dict().items():
        if key not in parameters:
            torch.testing.assert_close(sharp.norm1.state_dict()[key], value, rtol=0, atol=0, msg=key)
    if hasattr(sharp.norm1, "num_iters"):
        assert int(sharp.norm1.num_iters) == 1


@pytest.mark.parametrize("name", ["un", "bn", "bcn", "evonorm_b0"])  # with v, the group affine
def test_a_scaler_that_skips_a_sam_update_leaves_every_norm_as_it_was(name):
    torch.manual_seed(0)
    model = Block(name)
    scaler = unnorm.GradScaler(model, "cpu", init_scale=2.0 ** 8)
    sam = SharpnessAware(model, rho=0.5, only_norm=True)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    xs = make_sequence(4, shape=SHAPE, spikes={})[0]
    sam_update(model, optimizer, sam, xs[0], scaler)
    before = copy.deepcopy(model.state_dict())
    model.head.weight.register_hook(lambda g: g * float("inf"))  # both passes overflow
    sam_update(model, optimizer, sam, xs[1], scaler)
    for key, value in before.items():
        assert torch.equal(model.state_dict()[key], value), key
    assert int(scaler.guard.skipped_updates) == 1


def test_compiled_sam_training_is_one_graph():
    from torch._dynamo.testing import CompileCounterWithBackend
    torch._dynamo.reset()
    model = Block("un")
    counter = CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(model, backend=counter, fullgraph=True)
    sam = SharpnessAware(model, rho=0.5, only_norm=True)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with torch._dynamo.config.patch(recompile_limit=1000):
        for x in make_sequence(6, shape=SHAPE)[0]:
            sam_update(compiled, optimizer, sam, x)
    torch._dynamo.reset()
    assert counter.frame_count == 1 and int(model.norm1.num_iters) == 6


@pytest.mark.parametrize("name", ["un", "bn", "bcn", "evonorm_b0"])
def test_a_sam_update_on_a_bfloat16_model_keeps_float32_state_and_restores_w_exactly(name):
    """A module cast to bfloat16: eps is computed in float32 and w is put back bit for bit
    (subtracting eps again would round), and the norm's state is one plain step's."""
    torch.manual_seed(0)
    plain = Block(name).to(torch.bfloat16)
    sharp = copy.deepcopy(plain)
    sam = SharpnessAware(sharp, rho=0.5, only_norm=True)
    x = make_sequence(1, shape=SHAPE)[0][0].to(torch.bfloat16)
    loss_of(plain, x).backward()
    start = copy.deepcopy(sharp.state_dict())
    sam.new_update()
    loss_of(sharp, x).backward()
    moved = []
    sam.perturbed_gradient(lambda: (moved.append(sharp.norm2.weight.detach().clone()),
                                    loss_of(sharp, x).backward()))
    assert not torch.equal(moved[0], start["norm2.weight"])  # the second pass was perturbed
    for key, param in sharp.named_parameters():
        assert torch.equal(param, start[key]), key
    for key, value in plain.norm1.state_dict().items():
        if key not in ("weight", "bias") and "bn_" not in key:
            assert sharp.norm1.state_dict()[key].dtype == value.dtype, key
            torch.testing.assert_close(sharp.norm1.state_dict()[key], value, rtol=0, atol=0, msg=key)
    assert all(b.dtype != torch.bfloat16 for k, b in sharp.norm1.named_buffers()
               if b.is_floating_point()), "statistics are kept in float32"


def _sam_replica(rank, port, path, norm):
    """Replica ``rank`` of two (gloo): three SAM-ON updates of a DDP-wrapped Block on its
    half of each batch; saves its state."""
    import os

    import torch.distributed as dist

    from plugins.distributed import data_parallel
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    torch.set_num_threads(1)
    try:
        torch.manual_seed(0)
        model = Block(norm)
        net = data_parallel(model, torch.device("cpu"))  # the trainers' DDP
        sam = SharpnessAware(model, rho=0.5, only_norm=True)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        for x in make_sequence(3, shape=SHAPE)[0]:
            sam_update(net, optimizer, sam, x.chunk(2)[rank])
        torch.save(model.state_dict(), f"{path}.{rank}")
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("norm", ["ln", "un"])
def test_sam_on_two_replicas_averages_both_passes_and_keeps_them_identical(norm, tmp_path):
    """2 gloo replicas, each on half of every batch: DDP averages the gradients of both
    passes, so the replicas' weights stay identical (the norms' statistics are per replica, as
    the trainers' DDP keeps them); with norms that use no batch statistics (LN) the updates
    equal one process's on the whole batch, and UN counts one step per update on each."""
    import torch.multiprocessing as mp
    from test_vision import free_port
    mp.start_processes(_sam_replica, args=(free_port(), str(tmp_path / "state"), norm),
                       nprocs=2, start_method="spawn")
    states = [torch.load(tmp_path / f"state.{rank}") for rank in (0, 1)]
    for key, _ in Block(norm).named_parameters():
        assert torch.equal(states[0][key], states[1][key]), key
    if norm == "un":
        assert [int(state["norm1.num_iters"]) for state in states] == [3, 3]
        return
    torch.manual_seed(0)
    whole = Block(norm)
    sam = SharpnessAware(whole, rho=0.5, only_norm=True)
    optimizer = torch.optim.SGD(whole.parameters(), lr=0.1)
    for x in make_sequence(3, shape=SHAPE)[0]:
        sam_update(whole, optimizer, sam, x)  # the halves' mean losses average to the whole's
    for key, value in whole.state_dict().items():
        torch.testing.assert_close(states[0][key], value, rtol=1e-5, atol=1e-6, msg=key)


@pytest.mark.parametrize("norm", ["bn", "evonorm_b0", "bcn"])
def test_norm_only_training_freezes_everything_else_at_its_initialisation(norm):
    """Every parameter of the norm layers trains (EvoNorm's v, BCN's per-group affine too)."""
    torch.manual_seed(0)
    model = Block(norm)
    start = copy.deepcopy(model.state_dict())
    count = freeze_except(model, "norm", head=None)
    norms = {name for name, _ in model.named_parameters() if "norm" in name}
    assert {name for name, p in model.named_parameters() if p.requires_grad} == norms
    assert count == sum(p.numel() for name, p in model.named_parameters() if name in norms)
    optimizer = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1)
    for x in make_sequence(3, shape=SHAPE)[0]:
        optimizer.zero_grad()
        loss_of(model, x).backward()
        optimizer.step()
    for key, value in model.named_parameters():
        assert torch.equal(value, start[key]) == (key not in norms), key
    other = Block("bn")
    assert freeze_except(other, "norm+head", head=other.head) == 4 * C + C * 3 + 3
    with pytest.raises(ValueError, match="train_only must be one of all, norm, norm\\+head"):
        freeze_except(model, "norms", head=None)


def test_bad_sam_settings_are_refused_by_name():
    with pytest.raises(ValueError, match="sam.rho .* must be > 0"):
        SharpnessAware(Block("ln"), rho=0)
    with pytest.raises(ValueError, match="no trainable norm parameters"):
        SharpnessAware(nn.Sequential(nn.Linear(C, C), unnorm.build_norm("nonorm", C)), rho=0.5,
                       only_norm=True)


def test_the_loop_trains_with_sam_on_and_records_what_it_trained(corpus_root, tmp_path):  # noqa: F811
    from plugins.lm import build_lm
    from plugins.lm.trainer import train
    cfg = config("+exp=llama_71m_un", "logger=none", "device=cpu", "scale.num_workers=0",
                 f"data.root={corpus_root}", "sam=sam_on", "train_only=norm+head",
                 *TINY_MODEL, *TINY_RECIPE, "recipe.micro_batch_size=8", "norm.warmup_iters=2")
    result = train(cfg, tmp_path / "run")
    assert result["status"] in ("ok", "chance"), result
    model = build_lm(cfg.model, cfg.norm, vocab_size=300)
    norms = sum(p.numel() for p in norm_parameters(model).values())
    head = sum(p.numel() for p in model.lm_head.parameters())
    assert result["sam_perturbed_parameters"] == norms
    assert result["trainable_parameters"] == norms + head
    with pytest.raises(ValueError, match="gradient accumulation"):
        train(config("+exp=llama_71m_un", "logger=none", "device=cpu", "scale.num_workers=0",
                     f"data.root={corpus_root}", "sam=sam_on", *TINY_MODEL, *TINY_RECIPE),
              tmp_path / "refused")
