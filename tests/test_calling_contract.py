"""What a norm's training call commits, whatever the calling pattern (docs/core.md, "What a
training call commits"): one step per training call, as torch's BatchNorm and the releases
(which update in the forward) do; the backward's state once per call; a skipped update, a
recomputation and a cast leave the state as the contract says; folds that cannot be exact
are refused."""
from __future__ import annotations

import pytest
import torch
from torch.utils.checkpoint import checkpoint

import unnorm
from test_norms import STATEFUL, make_sequence, random_affine
from test_scale_path import _Overflow, _scaler, model, norm_state

C = 8
SHAPE = (4, 5, C)
#: the buffers the forward of each norm commits (the backward's are UN's window and EMA, PN's
#: EMA); a norm not listed is expected to commit all its state there
FORWARD_STATE = {"un": ("running_var", "fwd_buffer", "num_iters", "num_skipped", "bwd_buffer"),
                 "mabn": ("running_var", "fwd_buffer", "num_iters", "bwd_buffer"),
                 "pn": ("running_phi", "num_iters"), "pn_ls": ("running_phi", "num_iters"),
                 "bn": ("running_mean", "running_var"),
                 "prepbn": ("running_mean", "running_var", "num_iters"),
                 "bcn": ("running_mean", "running_var"), "evonorm_b0": ("running_var",)}


def build(name):
    torch.manual_seed(0)
    return random_affine(unnorm.build_norm(name, C, **STATEFUL[name]))


def state(norm):
    return {k: v.clone() for k, v in norm.state_dict().items()}


def consecutive_steps(norm, xs, dys):
    for x, dy in zip(xs, dys):
        norm(x.clone().requires_grad_(True)).backward(dy)


def one_backward_for_two_calls(norm, pairs):
    """Each step: two calls (two views, or a layer shared by two sites), then one backward."""
    for (x1, dy1), (x2, dy2) in pairs:
        y1, y2 = norm(x1.clone().requires_grad_(True)), norm(x2.clone().requires_grad_(True))
        torch.autograd.backward([y1, y2], [dy1, dy2])


@pytest.mark.parametrize("name", list(STATEFUL))
def test_two_calls_before_one_backward_are_two_consecutive_steps(name):
    """The release's per-call behaviour: each call advances the step and writes its own slot
    (UN's and MABN's backward windows too: slot t holds call t's q). EMAs of the gradient
    (UN's, PN's) take the calls in the order the backward reaches them, as the release's."""
    xs, dys = make_sequence(24, shape=SHAPE)
    per_call, shared = build(name), build(name)
    consecutive_steps(per_call, xs, dys)
    one_backward_for_two_calls(shared, zip(zip(xs[0::2], dys[0::2]), zip(xs[1::2], dys[1::2])))
    want, got = state(per_call), state(shared)
    for key in FORWARD_STATE.get(name, per_call._state()):
        torch.testing.assert_close(got[key], want[key], rtol=1e-5, atol=1e-6, msg=key)
    if name == "un":  # the failure this guards against: empty slots made the mean 0
        assert (shared.fwd_buffer > 0).all() and (shared.bwd_buffer != 0).all()


def test_bn_updates_once_per_call_as_torch_batchnorm():
    ours = unnorm.build_norm("bn", C, momentum=0.9)
    theirs = torch.nn.BatchNorm1d(C, momentum=0.1)
    xs, dys = make_sequence(6, shape=SHAPE)
    for x1, x2 in zip(xs[0::2], xs[1::2]):
        y = ours(x1.requires_grad_(True)) + ours(x2.requires_grad_(True))
        y.sum().backward()
        theirs(x1.reshape(-1, C)), theirs(x2.reshape(-1, C))
    torch.testing.assert_close(ours.running_mean, theirs.running_mean)
    torch.testing.assert_close(ours.running_var, theirs.running_var)


@pytest.mark.parametrize("name", list(STATEFUL))
def test_a_graph_backpropagated_twice_commits_once_and_gives_the_same_gradient(name):
    xs, dys = make_sequence(12, shape=SHAPE)
    once, twice = build(name), build(name)
    for x, dy in zip(xs, dys):
        consecutive_steps(once, [x], [dy])
        x = x.clone().requires_grad_(True)
        y = twice(x)
        first = torch.autograd.grad(y, [x, twice.weight], dy, retain_graph=True)
        second = torch.autograd.grad(y, [x, twice.weight], dy)
        for a, b in zip(first, second):
            torch.testing.assert_close(b, a, rtol=0, atol=0)
    for key, value in state(once).items():
        torch.testing.assert_close(state(twice)[key], value, rtol=1e-6, atol=1e-7, msg=key)


@pytest.mark.parametrize("name", list(STATEFUL))
def test_a_training_call_without_a_graph_before_the_backward_is_a_step_of_its_own(name):
    """A no_grad training call between a forward and its backward commits its own step and
    overwrites nothing: the same as the graph's step, then the no_grad call."""
    xs, dys = make_sequence(12, shape=SHAPE)
    interleaved, sequential = build(name), build(name)
    for t in range(0, 12, 2):
        y = interleaved(xs[t].clone().requires_grad_(True))
        with torch.no_grad():
            interleaved(xs[t + 1])
        y.backward(dys[t])
        consecutive_steps(sequential, [xs[t]], [dys[t]])
        with torch.no_grad():
            sequential(xs[t + 1])
    for key, value in state(sequential).items():
        torch.testing.assert_close(state(interleaved)[key], value, rtol=1e-6, atol=1e-7, msg=key)
    assert int(interleaved.num_rejected) == 0


@pytest.mark.parametrize("pattern", ["reentrant", "non_reentrant", "frozen_input"])
@pytest.mark.parametrize("name", list(STATEFUL))
def test_an_update_the_scaler_skips_restores_what_every_call_committed(name, pattern):
    """The overflow is in the head's weight gradient. Reentrant checkpointing and a frozen
    first layer make training calls without a graph before the first ``scale()``: the
    skipped update must still leave every buffer as it was."""
    net = model(name)
    if pattern == "frozen_input":
        net[0].requires_grad_(False)  # the norm's input needs no gradient: no graph there
    scaler = _scaler(unnorm.GradScaler, net)
    optimizer = torch.optim.SGD(net.parameters(), lr=0.05)
    overflow = _Overflow(net[3].weight, steps=[4])
    states = []
    for x in make_sequence(7, shape=SHAPE, spikes={})[0]:
        optimizer.zero_grad()
        if pattern == "frozen_input":
            y = net(x)
        else:
            y = checkpoint(net[:2], x.requires_grad_(True), use_reentrant=pattern == "reentrant")
            y = net[2:](y)
        scaler.scale(y.float().square().mean()).backward()
        overflow.step += 1
        scaler.step(optimizer)
        scaler.update()
        states.append(norm_state(net))
    for key, value in states[3].items():
        assert torch.equal(states[4][key], value), key
    assert int(scaler.guard.skipped_updates) == 1
    if "num_iters" in states[0]:
        assert int(states[-1]["num_iters"]) == 6


@pytest.mark.parametrize("reentrant", [True, False])
def test_records_follow_the_state_once_per_step_and_without_skipped_updates(reentrant):
    """Under checkpointing every record is made once per step; the records of an update the
    scaler skipped are dropped, as its state was."""
    net = model("un")
    scaler = _scaler(unnorm.GradScaler, net)
    optimizer = torch.optim.SGD(net.parameters(), lr=0.05)
    overflow = _Overflow(net[3].weight, steps=[2])
    xs = make_sequence(5, shape=SHAPE, spikes={})[0]
    with unnorm.record_statistics(net) as stats, unnorm.record_gns(net, example_dim=0) as gns:
        for x in xs:
            optimizer.zero_grad()
            y = net[2:](checkpoint(net[:2], x.requires_grad_(True), use_reentrant=reentrant))
            scaler.scale(y.square().mean()).backward()
            overflow.step += 1
            scaler.step(optimizer)
            scaler.update()
        chunk, gns_chunk = stats.flush()["1"], gns.flush()["1"]
    for key in ("act", "grad", "skip", "rejected"):
        assert chunk[key].shape[0] == len(xs) - 1, key
    assert gns_chunk["batch_sq"].shape == (len(xs) - 1,)
    assert not chunk["rejected"].any()


def test_integer_counters_survive_every_cast():
    norm = unnorm.build_norm("un", C)
    norm.num_iters.fill_(4097)  # float16 would round it to 4096
    for cast in (lambda m: m.type(torch.float16), lambda m: m.half(),
                 lambda m: m.to(torch.bfloat16), lambda m: m.type(torch.float32)):
        cast(norm)
        assert norm.num_iters.dtype == torch.long and int(norm.num_iters) == 4097
        assert norm.running_var.dtype == torch.float32
    norm.train()(torch.randn(SHAPE, dtype=norm.weight.dtype))  # the next step runs
    assert int(norm.num_iters) == 4098


class TwoReaders(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.norm = unnorm.build_norm("bn", C)
        self.q, self.k = torch.nn.Linear(C, C), torch.nn.Linear(C, C)
        self.alias = self.q
        self.embed = torch.nn.Embedding(10, C)

    def forward(self, x):
        h = self.norm(x)
        return self.q(h) + self.k(h)


@pytest.mark.parametrize("plan, named", [
    ({"norm": ["q", "q"]}, "q"),
    ({"norm": ["q", "alias"]}, "alias"),
])
def test_folding_into_a_layer_twice_is_refused_by_name(plan, named):
    net = TwoReaders().eval()
    before = net.q.weight.clone()
    with pytest.raises(ValueError, match=f"{named} .*already folded into"):
        unnorm.fold_norms(net, plan, probe=torch.randn(2, C))
    assert torch.equal(net.q.weight, before)  # refused before anything changed


def test_folding_into_a_tied_weight_is_refused_in_every_entry_point():
    net = TwoReaders().eval()
    net.k.weight = net.embed.weight = torch.nn.Parameter(torch.randn(C, C))  # a tied "head"
    embedding = net.embed.weight.clone()
    with pytest.raises(ValueError, match="k's weight is tied to embed.weight"):
        unnorm.fold_norms(net, {"norm": ["q", "k"]}, probe=torch.randn(2, C))
    with pytest.raises(ValueError, match="tied"):
        unnorm.fold_by_plan(net, {"norm": ["q", "k"]}, probe=torch.randn(2, C))
    assert torch.equal(net.embed.weight, embedding)
