"""The norms on the scale path: a module cast to fp16/bf16, autocast, a GradScaler that grows,
backs off and skips, gradient accumulation and activation checkpointing all train as one
float32 process does (reference: the same norm, in float32, without them)."""
from __future__ import annotations

import pytest
import torch
from torch.utils.checkpoint import checkpoint

import unnorm
from test_norms import QUICK_OPTIONS as OPTIONS
from test_norms import STATEFUL as STATEFUL_OPTIONS
from test_norms import make_sequence

C = 8
SHAPE = (4, 5, C)
STATEFUL = list(STATEFUL_OPTIONS)
# autocast and the GradScalers are the device's own kernels (a GPU's are what clusters run);
# scripts/gpu_check.py runs the CUDA ones on a lent GPU (`-k cuda`)
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA device"))]


def model(name, seed=0, device="cpu"):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(C, C), unnorm.build_norm(name, C, **OPTIONS[name]),
                               torch.nn.GELU(), torch.nn.Linear(C, 3)).to(device)


def sequence(steps, device, **options):
    """``make_sequence``'s batches (and output gradients) on ``device``."""
    return [[t.to(device) for t in tensors] for tensors in make_sequence(steps, **options)]


def norm_state(net):
    return {k: v.clone() for k, v in net[1].state_dict().items()}


def loss_of(net, x):
    return net(x).float().square().mean()


# --- a module cast to half precision ------------------------------------------------------------

@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("name", list(OPTIONS))
def test_a_cast_norm_keeps_float32_statistics_and_trains_as_in_float32(name, dtype):
    """``norm.half()`` / ``.bfloat16()`` (fairseq's --fp16/--bf16): statistics buffers stay
    float32 with their values, and training and eval follow the float32 norm fed the same
    half-precision data, to the output's rounding."""
    reference = unnorm.build_norm(name, C, **OPTIONS[name])
    cast = unnorm.build_norm(name, C, **OPTIONS[name]).to(dtype)
    with torch.no_grad():
        for p, q in zip(reference.parameters(), cast.parameters()):
            p.copy_(q.float())
    xs, dys = make_sequence(12, shape=SHAPE, spikes={})
    for x, dy in zip(xs, dys):
        x, dy = (x * 3).to(dtype), dy.to(dtype)
        x32 = x.float().requires_grad_(True)
        x16 = x.clone().requires_grad_(True)
        y32, y16 = reference(x32), cast(x16)
        y32.backward(dy.float())
        y16.backward(dy)
        assert y16.dtype == dtype
        torch.testing.assert_close(y16, y32.to(dtype), rtol=0, atol=0)
        torch.testing.assert_close(x16.grad.float(), x32.grad, rtol=1e-2, atol=1e-2)
    floats = {k: v for k, v in cast.state_dict().items() if v.is_floating_point()}
    for key, value in reference.state_dict().items():
        if key in floats and key not in dict(cast.named_parameters()):
            assert floats[key].dtype == torch.float32, key
            torch.testing.assert_close(floats[key], value, rtol=1e-5, atol=1e-6)
    reference.eval(), cast.eval()
    x = (xs[0] * 3).to(dtype)
    torch.testing.assert_close(cast(x), reference(x.float()).to(dtype), rtol=0, atol=0)


@pytest.mark.parametrize("name", STATEFUL)
def test_casting_a_trained_norm_keeps_its_statistics_unrounded(name):
    norm = unnorm.build_norm(name, C, **OPTIONS[name])
    for x, dy in zip(*make_sequence(6, shape=SHAPE)):
        norm(x.requires_grad_(True)).backward(dy)
    before = {k: v.clone() for k, v in norm.named_buffers() if v.is_floating_point()}
    norm.half()
    for key, value in before.items():  # bit for bit: not rounded through fp16
        assert torch.equal(norm.get_buffer(key), value), key
    norm.to(torch.float64)
    assert all(norm.get_buffer(k).dtype == torch.float64 for k in before)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name", list(OPTIONS))
def test_under_autocast_the_statistics_are_float32(name, device):
    """bf16 autocast: the norm sees bf16 activations; its statistics must be those of a float32
    norm fed the same bf16 values (bf16 arithmetic would be off by ~1e-3)."""
    torch.manual_seed(0)
    layer = torch.nn.Linear(C, C, device=device)
    under_amp = unnorm.build_norm(name, C, device=device, **OPTIONS[name])
    reference = unnorm.build_norm(name, C, device=device, **OPTIONS[name])
    for x, dy in zip(*sequence(10, device, shape=SHAPE, spikes={})):
        with torch.autocast(device, dtype=torch.bfloat16):
            h = layer(x * 30)
            y = under_amp(h)
        assert h.dtype == torch.bfloat16 and y.dtype == torch.bfloat16
        y.float().backward(dy)  # reaches the norm as bf16
        h32 = h.detach().float().requires_grad_(True)
        y32 = reference(h32)
        y32.backward(dy.to(torch.bfloat16).float())
        torch.testing.assert_close(y.float(), y32.to(torch.bfloat16).float(), rtol=0, atol=0)
    for key, value in reference.state_dict().items():
        mine = under_amp.state_dict()[key]
        assert mine.dtype == value.dtype
        torch.testing.assert_close(mine, value, rtol=1e-6, atol=1e-7)


# --- a GradScaler ---------------------------------------------------------------------------------

class _Overflow:
    """Makes one weight's gradient inf at chosen steps: a loss-scaled overflow in one layer."""

    def __init__(self, parameter, steps):
        self.steps, self.step = set(steps), 0
        parameter.register_hook(lambda g: g * float("inf") if self.step in self.steps else g)


def _train(net, batches, scaler=None, overflow_steps=(), micro_batches=1):
    """SGD; ``micro_batches`` batches accumulate into each update. Returns the norm's state
    after each update."""
    optimizer = torch.optim.SGD(net.parameters(), lr=0.05)
    overflow = _Overflow(net[3].weight, overflow_steps)  # the head's weight
    states = []
    for start in range(0, len(batches), micro_batches):
        optimizer.zero_grad()
        for x in batches[start:start + micro_batches]:
            loss = loss_of(net, x) / micro_batches
            (loss if scaler is None else scaler.scale(loss)).backward()
            overflow.step += 1
        if scaler is None:
            optimizer.step()
        else:
            scaler.step(optimizer)
            scaler.update()
        states.append(norm_state(net))
    return states


def _scaler(cls, net, **options):
    options = {"init_scale": 2.0 ** 8, "growth_interval": 3, **options}
    device = next(net.parameters()).device.type
    return cls(net, device, **options) if cls is unnorm.GradScaler else cls(device, **options)


def _assert_states_close(got, want, rtol=1e-5, atol=1e-6):
    for key, value in want.items():
        torch.testing.assert_close(got[key].double(), value.double(), rtol=rtol, atol=atol,
                                   msg=lambda m: f"{key}: {m}")


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name", STATEFUL + ["ln"])
def test_training_with_a_changing_loss_scale_follows_the_unscaled_run(name, device):
    """The scale grows every 3 updates: with unnorm's GradScaler the norms' statistics and the
    weights follow the run without loss scaling to float32 precision; torch's plain scaler
    leaves UN, MABN and PN's gradient statistics in mixed scaled units."""
    batches = sequence(24, device, shape=SHAPE, spikes={})[0]
    reference = model(name, device=device)
    want = _train(reference, batches)
    guarded = model(name, device=device)
    got = _train(guarded, batches, _scaler(unnorm.GradScaler, guarded))
    for state, expected in zip(got, want):
        _assert_states_close(state, expected)
    for p, q in zip(guarded.parameters(), reference.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)
    if name in ("un", "mabn", "pn"):  # the test can fail: the old behaviour differs
        plain = model(name, device=device)
        drifted = _train(plain, batches, _scaler(torch.amp.GradScaler, plain))[-1]
        error = max((drifted[k].double() - want[-1][k].double()).abs().max() for k in drifted
                    if drifted[k].is_floating_point())
        assert error > 1e-4


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("micro_batches", [1, 2])
@pytest.mark.parametrize("name", STATEFUL)
def test_an_update_the_scaler_skips_leaves_every_norm_buffer_as_it_was(name, micro_batches,
                                                                        device):
    """The overflow is in the head's weight gradient, not in the norm's: the norm's own step
    was clean, yet the skipped update must leave it exactly as before, and the run then
    continues as the unscaled run that never saw those batches."""
    batches = sequence(20, device, shape=SHAPE, spikes={})[0]
    skipped_update = 5
    skipped_batches = range(skipped_update * micro_batches, (skipped_update + 1) * micro_batches)
    guarded = model(name, device=device)
    scaler = _scaler(unnorm.GradScaler, guarded)
    got = _train(guarded, batches, scaler, overflow_steps=[skipped_batches[-1]],
                 micro_batches=micro_batches)
    for key, value in got[skipped_update - 1].items():
        assert torch.equal(got[skipped_update][key], value), key
    assert int(scaler.guard.skipped_updates) == 1
    assert int(guarded[1].num_rejected) == 0
    if micro_batches == 1:  # the test can fail: torch's own scaler lets the norm commit
        plain = model(name, device=device)
        unguarded = _train(plain, batches, _scaler(torch.amp.GradScaler, plain),
                           overflow_steps=[skipped_batches[-1]])
        assert any(not torch.equal(unguarded[skipped_update][k], v)
                   for k, v in unguarded[skipped_update - 1].items())
    reference = model(name, device=device)
    kept = [x for i, x in enumerate(batches) if i not in skipped_batches]
    want = _train(reference, kept, micro_batches=micro_batches)
    _assert_states_close(got[-1], want[-1])
    for p, q in zip(guarded.parameters(), reference.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)


def test_guarded_compiled_training_is_one_graph():
    import torch._dynamo
    from torch._dynamo.testing import CompileCounterWithBackend
    torch._dynamo.reset()
    net = model("un")
    scaler = _scaler(unnorm.GradScaler, net)
    counter = CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(net, backend=counter, fullgraph=True)
    optimizer = torch.optim.SGD(net.parameters(), lr=0.05)
    with torch._dynamo.config.patch(recompile_limit=1000):
        for x in make_sequence(12, shape=SHAPE, spikes={})[0]:
            optimizer.zero_grad()
            scaler.scale(compiled(x).square().mean()).backward()
            scaler.step(optimizer)
            scaler.update()
    torch._dynamo.reset()
    assert counter.frame_count == 1
    assert scaler.get_scale() == 2.0 ** 12  # it grew every 3 updates while compiled


# --- activation checkpointing --------------------------------------------------------------------

@pytest.mark.parametrize("reentrant", [True, False])
@pytest.mark.parametrize("name", STATEFUL)
def test_a_checkpointed_block_commits_each_step_once(name, reentrant):
    """Activation checkpointing reruns the forward inside the backward; the norms must train
    exactly as without it (reentrant: the first pass runs under no_grad and commits at once)."""
    plain, checkpointed = model(name), model(name)
    xs, dys = make_sequence(10, shape=SHAPE)
    for x, dy in zip(xs, dys):
        for net, wrap in ((plain, False), (checkpointed, True)):
            net.zero_grad()
            x_in = x.clone().requires_grad_(True)
            y = checkpoint(net, x_in, use_reentrant=reentrant) if wrap else net(x_in)
            y.backward(dy[..., :3])
        for p, q in zip(checkpointed.parameters(), plain.parameters()):
            torch.testing.assert_close(p.grad, q.grad, rtol=1e-6, atol=1e-7)
    assert norm_state(checkpointed).keys() == norm_state(plain).keys()
    _assert_states_close(norm_state(checkpointed), norm_state(plain), rtol=1e-6, atol=1e-7)
    if hasattr(plain[1], "num_iters"):
        assert int(checkpointed[1].num_iters) == len(xs)
