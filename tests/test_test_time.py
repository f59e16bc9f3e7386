"""Norms at test time (``unnorm.test_time``, docs/test_time.md) against independent oracles:
the release's ``UnMixTNS2d`` and ``AlphaBatchNorm`` and ``EMABatchNorm`` transcribed below
(devavratTomar/unmixtns, commit 8e12b9f03f394290eb89df58e17d949f082d5152,
``tta_experiments/unmixtns.py`` and ``tta_experiments/methods/bn.py``) on torch's
``BatchNorm2d``, torch's ``F.batch_norm``, and float64 references written from the modes'
definitions for every norm with running statistics (checked through each norm's own eval with
its buffers set to the reference statistics)."""
from __future__ import annotations

import copy
import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import unnorm

C, K, SEED = 6, 4, 3
#: every registry norm with running statistics (its quick options), and the image layouts
STATEFUL = {name: unnorm.registry.quick_options(name) for name in unnorm.available_norms()
            if unnorm.has_running_state(name)}
STATEFUL.update({"bcn_image": {"layout": "image"}, "evonorm_b0_image": {"layout": "image"}})


# --- the release, transcribed (unmixtns.py lines 28-122 and 142-166; methods/bn.py 29-98) ---

class ReleaseUnMixTNS2d(nn.Module):
    """``BaseNormLayer`` + ``UnMixTNS2d`` of unmixtns.py, commit 8e12b9f, as released (the
    noise from torch's global generator, ``randn_like``)."""

    def __init__(self, bn_layer, momentum, K):
        super().__init__()
        self.momentum = momentum
        self.K = K
        self.eps = bn_layer.eps
        self.register_buffer("running_means_mat", bn_layer.running_mean.repeat(K, 1))
        self.register_buffer("running_vars_mat", bn_layer.running_var.repeat(K, 1))
        coeff = 0.5
        if K == 1:
            noise = 0
            coeff = 0
        else:
            noise = math.sqrt(coeff * K / (K - 1)) * self.running_vars_mat.sqrt() \
                * torch.randn_like(self.running_means_mat)
        self.running_means_mat += noise
        self.running_vars_mat = (1 - coeff) * self.running_vars_mat
        self.weight = copy.deepcopy(bn_layer.weight)
        self.bias = copy.deepcopy(bn_layer.bias)

    def forward(self, x):
        inst_mean = torch.mean(x, dim=[2, 3], keepdim=False)
        inst_var = torch.var(x, dim=[2, 3], unbiased=False, keepdim=False)
        with torch.no_grad():
            runnning_means_mat_norm = F.normalize(self.running_means_mat, dim=1)
            inst_mean_norm = F.normalize(inst_mean, dim=1)
            sim = torch.einsum("bc,kc->bk", inst_mean_norm, runnning_means_mat_norm)
            probs = torch.softmax(sim / 0.07, dim=1)
        mean_mat = (1. - probs.unsqueeze(-1)) * self.running_means_mat.unsqueeze(0) + probs.unsqueeze(-1) * inst_mean.unsqueeze(1)
        var_mat = (1. - probs.unsqueeze(-1)) * self.running_vars_mat.unsqueeze(0) + probs.unsqueeze(-1) * inst_var.unsqueeze(1)
        mean = torch.mean(mean_mat, dim=1)
        var = torch.mean(var_mat, dim=1) + torch.mean(mean_mat**2, dim=1) - (torch.mean(mean_mat, dim=1))**2
        with torch.no_grad():
            diff_mean = inst_mean.unsqueeze(1) - self.running_means_mat.unsqueeze(0)
            self.running_means_mat = self.running_means_mat + self.momentum * \
                torch.mean(probs.unsqueeze(-1) * diff_mean, dim=0)
            diff_var = inst_var.unsqueeze(1) - self.running_vars_mat.unsqueeze(0)
            self.running_vars_mat = self.running_vars_mat + self.momentum * \
                torch.mean(probs.unsqueeze(-1) * diff_var, dim=0)
        b, c = mean.shape
        x = (x - mean.view(b, c, 1, 1)) / torch.sqrt(var.view(b, c, 1, 1) + self.eps)
        return x * self.weight.view(1, -1, 1, 1) + self.bias.view(1, -1, 1, 1)


def release_momentum(bn_momentum, bs, bs_max=64):
    """``replace_bn_layers``' momentum corrected for the batch size (lines 158-161)."""
    M = 1 - bn_momentum
    M = M ** (bs / bs_max)
    return 1 - M


class ReleaseAlphaBatchNorm(nn.Module):
    """methods/bn.py ``AlphaBatchNorm`` (lines 54-79), alpha weighting the test batch."""

    def __init__(self, layer, alpha):
        super().__init__()
        self.layer = layer
        self.layer.eval()
        self.alpha = alpha
        self.norm = nn.BatchNorm2d(self.layer.num_features, affine=False, momentum=1.0).double()

    def forward(self, input):
        self.norm(input)
        running_mean = ((1 - self.alpha) * self.layer.running_mean + self.alpha * self.norm.running_mean)
        running_var = ((1 - self.alpha) * self.layer.running_var + self.alpha * self.norm.running_var)
        return F.batch_norm(input, running_mean, running_var, self.layer.weight, self.layer.bias,
                            False, 0, self.layer.eps)


class ReleaseEMABatchNorm(nn.Module):
    """methods/bn.py ``EMABatchNorm`` (lines 88-98): a train-mode forward, then eval."""

    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, x):
        self.model.train()
        self.model(x)
        self.model.eval()
        return self.model(x)


# --- helpers ---------------------------------------------------------------------------------

def stream(batches=4, shape=(5, 3, 4, C), seed=0):
    """A shifting test stream: each batch its own offset and scale per channel (float64)."""
    gen = torch.Generator().manual_seed(seed)
    out = []
    for i in range(batches):
        offset = torch.randn(shape[-1], generator=gen, dtype=torch.float64) * (1 + i)
        scale = torch.rand(shape[-1], generator=gen, dtype=torch.float64) + 0.5
        out.append(torch.randn(shape, generator=gen, dtype=torch.float64) * scale + offset)
    return out


def trained(name, seed=1):
    """The registry norm ``name`` (STATEFUL's options), float64, with source statistics and an
    affine that are not their initial values."""
    base = name.removesuffix("_image")
    norm = unnorm.build_norm(base, C, **STATEFUL[name]).double()
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in norm.parameters():
            param.add_(0.3 * torch.randn(param.shape, generator=gen, dtype=param.dtype))
        for stat in norm.eval_statistics:
            buffer = getattr(norm, stat)
            if stat == "running_mean":
                buffer.copy_(torch.randn(C, generator=gen, dtype=buffer.dtype))
            else:
                buffer.copy_(torch.rand(C, generator=gen, dtype=buffer.dtype) * 2 + 0.5)
    return norm.eval()


def torch_bn(norm):
    """torch's BatchNorm2d holding unnorm BN ``norm``'s statistics, affine and momentum."""
    bn = nn.BatchNorm2d(C, eps=norm.eps, momentum=1 - norm.momentum).double()
    with torch.no_grad():
        bn.weight.copy_(norm.weight)
        bn.bias.copy_(norm.bias)
        bn.running_mean.copy_(norm.running_mean)
        bn.running_var.copy_(norm.running_var)
    return bn.eval()


def nchw(x):
    return x.permute(0, 3, 1, 2)


def close(a, b, tol=1e-10):
    torch.testing.assert_close(a, b, rtol=tol, atol=tol)


# --- BN against the releases -----------------------------------------------------------------

@pytest.mark.parametrize("layout", ["maps", "tokens", "nchw"])
def test_unmix_is_the_release_unmix_tns_on_batch_norm(layout):
    """Outputs and component updates over a shifting stream, the components drawn as the
    release draws them (seeded); (B, H, W, C) maps, (B, N, C) tokens and NCHW maps through
    ``unnorm.ChannelsFirst``, a last batch smaller (the release corrects the momentum by the
    configured batch size: by each batch's here)."""
    norm = trained("bn")
    model = unnorm.ChannelsFirst(norm) if layout == "nchw" else norm
    torch.manual_seed(SEED)
    release = ReleaseUnMixTNS2d(torch_bn(norm), release_momentum(0.1, 5), K)
    batches = stream()
    batches[-1] = batches[-1][:2]
    if layout == "tokens":
        batches = [x.reshape(x.shape[0], -1, C) for x in batches]
    with unnorm.test_time(model, "unmix", components=K, seed=SEED) as adapted:
        start = adapted.state()["norm" if layout == "nchw" else ""]
        close(start["means"], release.running_means_mat)
        close(start["vars"], release.running_vars_mat)
        for x in batches:
            release.momentum = release_momentum(0.1, x.shape[0])
            if layout == "tokens":
                expected = release(x.transpose(1, 2).unsqueeze(-1)).squeeze(-1).transpose(1, 2)
            elif layout == "maps":
                expected = release(nchw(x)).permute(0, 2, 3, 1)
            else:
                x, expected = nchw(x), release(nchw(x))
            close(model(x), expected)
            now = adapted.state()["norm" if layout == "nchw" else ""]
            close(now["means"], release.running_means_mat)
            close(now["vars"], release.running_vars_mat)


def test_alpha_is_the_release_alpha_batch_norm():
    norm = trained("bn")
    release = ReleaseAlphaBatchNorm(torch_bn(norm), 0.3)
    with unnorm.test_time(norm, "alpha", alpha=0.3) as adapted:
        for x in stream():
            close(norm(x), release(nchw(x)).permute(0, 2, 3, 1))
        mix = adapted.fixed_statistics()
        close(mix["running_mean"], 0.7 * norm.running_mean + 0.3 * release.norm.running_mean)
        close(mix["running_var"], 0.7 * norm.running_var + 0.3 * release.norm.running_var)


def test_alpha_defaults_to_the_release_alpha():
    norm = trained("bn")
    release = ReleaseAlphaBatchNorm(torch_bn(norm), 0.1)
    x = stream(1)[0]
    with unnorm.test_time(norm, "alpha"):
        close(norm(x), release(nchw(x)).permute(0, 2, 3, 1))


def test_tbn_is_torch_batch_norm_in_training_mode():
    norm = trained("bn")
    with unnorm.test_time(norm, "tbn"):
        for x in stream():
            expected = F.batch_norm(nchw(x), None, None, norm.weight, norm.bias, training=True,
                                    eps=norm.eps).permute(0, 2, 3, 1)
            close(norm(x), expected)


def test_ema_is_the_release_ema_batch_norm():
    norm = trained("bn")
    release = ReleaseEMABatchNorm(nn.Sequential(torch_bn(norm)))
    with unnorm.test_time(norm, "ema") as adapted:
        for x in stream():
            close(norm(x), release(nchw(x)).permute(0, 2, 3, 1))
        fixed = adapted.fixed_statistics()
    close(fixed["running_mean"], release.model[0].running_mean)
    close(fixed["running_var"], release.model[0].running_var)


# --- every norm against float64 references of the definitions --------------------------------

def statistic_rows(norm, x):
    """The float64 rows a norm's statistics are over: PN-LS's after its layer-scale."""
    rows = x.reshape(-1, C)
    if getattr(norm, "layer_scale", False):
        g = rows.reshape(rows.shape[0], norm.group_num, -1)
        rows = (g / torch.sqrt(g.square().mean(-1, keepdim=True) + norm.eps)).reshape(rows.shape)
    return rows


def batch_reference(norm, x, running):
    """The batch's statistics by the definitions (docs/test_time.md): a mean and a variance
    (unbiased in BN's running convention), a second moment, or B0's variance."""
    rows = statistic_rows(norm, x)
    n = rows.shape[0]
    mean, var, second = rows.mean(0), rows.var(0, unbiased=False), rows.square().mean(0)
    unbiased = var * n / (n - 1)
    if norm.statistic_form == "second_moment":
        return {norm.eval_statistics[0]: second}
    if norm.statistic_form == "variance":
        return {"running_var": unbiased if running and norm.unbiased_running_var else var}
    return {"running_mean": mean, "running_var": unbiased if running else var}


def ema_reference(norm, kept, x):
    m = norm.momentum
    if norm.statistic_form == "moments" and getattr(norm, "estimate", False):
        rows = statistic_rows(norm, x)
        mean, var = rows.mean(0), rows.var(0, unbiased=False)
        return {"running_mean": m * kept["running_mean"] + (1 - m) * mean,
                "running_var": m * kept["running_var"]
                + (1 - m) * (var + (mean - kept["running_mean"]).square())}
    test = batch_reference(norm, x, running=norm.statistic_form != "second_moment")
    return {name: m * kept[name] + (1 - m) * test[name] for name in test}


def unmix_reference(norm, source, batches, k=K, seed=SEED, temperature=0.07, bs_max=64):
    """Per batch, each example's statistics by the definition: UnMix-TNS on the norm's source
    as a mean and a variance (a second moment is the variance about 0; B0's variance taken
    about 0), then the mixture's variance, or its second moment about 0 (no centring)."""
    form = norm.statistic_form
    if form == "moments":
        mean0, var0 = source["running_mean"], source["running_var"]
    else:
        var0 = source[norm.eval_statistics[0]]
        mean0 = torch.zeros_like(var0)
    torch.manual_seed(seed)
    noise = torch.randn(k, C, dtype=torch.float64)
    means = mean0 + math.sqrt(0.5 * k / (k - 1)) * var0.sqrt() * noise
    variances = 0.5 * var0.expand(k, C)
    out = []
    for x in batches:
        b = x.shape[0]
        rows = statistic_rows(norm, x).reshape(b, -1, C)
        mu, sigma2 = rows.mean(1), rows.var(1, unbiased=False)
        cos = (mu / mu.norm(dim=1, keepdim=True)) @ (means / means.norm(dim=1, keepdim=True)).T
        p = torch.softmax(cos / temperature, dim=1)[..., None]
        mix_mean = (1 - p) * means + p * mu[:, None]
        mix_var = (1 - p) * variances + p * sigma2[:, None]
        if form == "second_moment":
            stats = {norm.eval_statistics[0]: (mix_var + mix_mean**2).mean(1)}
        else:
            total = mix_var.mean(1) + (mix_mean**2).mean(1) - mix_mean.mean(1)**2
            stats = ({"running_mean": mix_mean.mean(1), "running_var": total}
                     if form == "moments" else {"running_var": total})
        out.append(stats)
        rate = 1 - norm.momentum ** (b / bs_max)
        means = means + rate * (p * (mu[:, None] - means)).mean(0)
        variances = variances + rate * (p * (sigma2[:, None] - variances)).mean(0)
    return out


def own_eval(norm, x, statistics):
    """The norm's own eval output on ``x`` with its buffers set to ``statistics`` (``norm``
    not adapted)."""
    copied = copy.deepcopy(norm).eval()
    with torch.no_grad():
        for name, value in statistics.items():
            getattr(copied, name).copy_(value)
    return copied(x)


@pytest.mark.parametrize("name", list(STATEFUL))
def test_each_mode_normalises_every_norm_by_its_reference_statistics(name):
    norm = trained(name)
    pristine = copy.deepcopy(norm)  # its own eval, for the references
    source = {stat: getattr(norm, stat).clone() for stat in norm.eval_statistics}
    batches = stream(3)
    for mode in ("source", "tbn", "alpha", "ema"):
        kept = dict(source)
        with unnorm.test_time(norm, mode, **({"alpha": 0.4} if mode == "alpha" else {})):
            for x in batches:
                if mode == "tbn":
                    expected = batch_reference(norm, x, running=False)
                elif mode == "alpha":
                    test = batch_reference(norm, x, running=True)
                    expected = {s: 0.4 * test[s] + 0.6 * source[s] for s in test}
                elif mode == "ema":
                    kept = expected = ema_reference(norm, kept, x)
                else:
                    expected = source
                close(norm.train()(x), own_eval(pristine, x, expected))  # train mode: the same
    with unnorm.test_time(norm, "unmix", components=K, seed=SEED):
        for x, expected in zip(batches, unmix_reference(norm, source, batches)):
            got = norm(x)
            for b in range(x.shape[0]):  # each example by its own statistics
                close(got[b:b + 1], own_eval(pristine, x[b:b + 1],
                                             {s: v[b] for s, v in expected.items()}))


def test_bcn_micro_batch_ema_is_its_own_running_update():
    norm = trained("bcn")
    norm.estimate = True
    pristine = copy.deepcopy(norm)
    kept = {stat: getattr(norm, stat).clone() for stat in norm.eval_statistics}
    with unnorm.test_time(norm, "ema"):
        for x in stream(3):
            kept = ema_reference(norm, kept, x)
            close(norm(x), own_eval(pristine, x, kept))


def test_every_norm_with_running_statistics_says_what_evaluation_reads():
    for name in STATEFUL:
        norm = unnorm.build_norm(name.removesuffix("_image"), C, **STATEFUL[name])
        assert norm.eval_statistics and norm.statistic_form in ("moments", "second_moment",
                                                                "variance"), name


# --- the model's state, resets, folding -------------------------------------------------------

def tiny_model(name, width=C):
    model = nn.Sequential(nn.Linear(4, width), nn.LayerNorm(width), nn.GELU(),
                          nn.Linear(width, width), nn.LayerNorm(width))
    unnorm.swap_norms(model, name.removesuffix("_image"), **STATEFUL[name])
    model.double()
    model.train()
    for x in stream(6, shape=(4, 5, 4)):  # trained statistics
        model(x).sum().backward()
    return model.eval()


@pytest.mark.parametrize("name", list(STATEFUL))
def test_the_model_state_is_untouched_by_adaptation_reset_and_exit(name):
    model = tiny_model(name)
    before = {key: value.clone() for key, value in model.state_dict().items()}
    x = stream(1, shape=(4, 5, 4))[0]
    reference = model(x)
    for mode in unnorm.TEST_TIME_MODES:
        with unnorm.test_time(model, mode) as adapted:
            for training in (True, False):
                model.train(training)
                model(x).sum().backward()
            adapted.reset()
            model(x)
        model.eval()
        for key, value in model.state_dict().items():
            assert torch.equal(value, before[key]), (mode, key)
        assert not any("forward" in m.__dict__ or "_normalize" in m.__dict__
                       for m in model.modules())
    assert torch.equal(model(x), reference)


def test_reset_repeats_the_stream_and_the_seed_decides_the_components():
    model = tiny_model("bn")
    batches = stream(3, shape=(4, 5, 4))
    with unnorm.test_time(model, "unmix", seed=7) as adapted:
        first = [model(x) for x in batches]
        adapted.reset()
        again = [model(x) for x in batches]
    for a, b in zip(first, again):
        assert torch.equal(a, b)
    with unnorm.test_time(model, "unmix", seed=8):
        assert not torch.equal(model(batches[0]), first[0])


def test_fixed_statistics_fold_where_they_are_fixed():
    model = tiny_model("bn")
    x = stream(1, shape=(4, 5, 4))[0]
    for mode in ("alpha", "ema"):
        with unnorm.test_time(model, mode) as adapted:
            if mode == "alpha":
                with pytest.raises(RuntimeError, match="no accepted test batch"):
                    adapted.fixed_statistics()
            adapted_out = model(x)  # alpha: this batch's mix; ema: moved by this batch
            frozen = adapted.fixed_copy()
        assert set(adapted.fixed_statistics()) == {"1.running_mean", "1.running_var",
                                                   "4.running_mean", "4.running_var"}
        close(frozen.eval()(x), adapted_out)
        close(adapted.fixed_copy().eval()(x), adapted_out)  # closed: the same copy
        affine = unnorm.to_affine(frozen[4])  # offline again: folds
        close(affine(frozen[:4](x)), adapted_out)
    for mode in ("tbn", "unmix"):
        with unnorm.test_time(model, mode) as adapted:
            model(x)
            with pytest.raises(RuntimeError, match="no fixed statistic to fold"):
                adapted.fixed_statistics()


@pytest.mark.parametrize("mode", ["tbn", "alpha", "ema", "unmix"])
def test_a_half_precision_model_adapts_in_float32(mode):
    """Statistics in float32 whatever the module dtype: a bfloat16 model's adapted statistics
    are the float32 model's on the same (bfloat16-rounded) input; its output keeps bfloat16."""
    model = tiny_model("bn").float()
    low = copy.deepcopy(model).bfloat16()
    x = stream(1, shape=(4, 5, 4))[0].bfloat16()
    with unnorm.test_time(model, mode) as full, unnorm.test_time(low, mode) as half:
        h = model[:1](x.float())  # the first norm sees the same input in both
        half_h = low[:1](x)
        torch.testing.assert_close(half_h.float(), h, rtol=1e-2, atol=1e-2)
        out = low[1](half_h)
        assert out.dtype == torch.bfloat16
        full_out = model[1](half_h.float())
        torch.testing.assert_close(out.float(), full_out, rtol=2e-2, atol=2e-2)
        for name, kept in half.state().items():
            for key, value in kept.items():
                assert value.dtype == torch.float32, (name, key)
                close(value, full.state()[name][key], tol=1e-6)


# --- bad batches ------------------------------------------------------------------------------

@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
@pytest.mark.parametrize("mode", ["alpha", "ema", "unmix"])
def test_a_non_finite_batch_leaves_the_adapted_statistics_as_they_were(mode, bad):
    model = tiny_model("un")
    batches = stream(3, shape=(4, 5, 4))
    poisoned = batches[1].clone()
    poisoned[0, 2, 1] = bad
    with unnorm.test_time(model, mode) as adapted:
        model(batches[0])
        before = adapted.state()
        model(poisoned)
        after = adapted.state()
        assert adapted.rejected() == {"1": 1, "4": 1}
        for norm in before:
            for key in before[norm]:
                assert torch.equal(after[norm][key], before[norm][key]), (norm, key)
        then = model(batches[2])
    with unnorm.test_time(model, mode) as clean:  # as if the bad batch had never come
        model(batches[0])
        close(model(batches[2]), then)
        assert clean.rejected() == {"1": 0, "4": 0}


# --- padding ----------------------------------------------------------------------------------

@pytest.mark.parametrize("mode", ["tbn", "unmix"])
def test_padded_positions_enter_no_statistic(mode):
    norm = trained("bn")
    x = stream(1, shape=(3, 5, C))[0]
    pad = torch.zeros(3, 5, dtype=torch.bool)
    pad[0, 3:] = True
    filled = x.clone()
    filled[pad] = 1e6
    with unnorm.test_time(norm, mode) as adapted:
        got = norm(filled, pad_mask=pad)
        state = adapted.state()
    valid = [x[0:1, :3], x[1:2], x[2:3]]
    if mode == "tbn":
        rows = torch.cat([v.reshape(-1, C) for v in valid])
        expected = (x - rows.mean(0)) / torch.sqrt(rows.var(0, unbiased=False) + norm.eps)
        close(got[~pad], (expected * norm.weight + norm.bias)[~pad])
        return
    assert torch.isfinite(state[""]["means"]).all()
    with unnorm.test_time(norm, mode) as alone:  # each example alone, from the same components
        for b, v in enumerate(valid):
            alone.reset()
            close(got[b, :v.shape[1]], norm(v)[0])


# --- refusals ---------------------------------------------------------------------------------

def test_a_causal_model_is_refused_by_name():
    model = nn.Sequential(unnorm.build_norm("bn", C, causal=True, positions=8))
    with pytest.raises(ValueError, match="causal norm"):
        unnorm.test_time(model, "tbn")

    class Attention(nn.Module):  # Hugging Face's attention of a decoder says is_causal
        is_causal = True
    decoder = nn.Sequential(Attention(), unnorm.build_norm("bn", C))
    with pytest.raises(ValueError, match="attends causally"):
        unnorm.test_time(decoder, "ema")


def test_the_project_language_model_is_refused():
    """plugins.lm's Llama with BN at every site: Hugging Face's attention says is_causal."""
    from plugins.lm.model import build_lm
    model = build_lm(dict(vocab_size=31, hidden_size=16, intermediate_size=24,
                          num_hidden_layers=1, num_attention_heads=2, context=8), {"name": "bn"})
    with pytest.raises(ValueError, match="attends causally"):
        unnorm.test_time(model, "tbn")


def test_a_fairseq_model_is_refused_without_importing_fairseq():
    fairseq_model = type("TransformerModel", (nn.Module,), {"__module__": "fairseq.models.transformer"})
    model = fairseq_model()
    model.norm = unnorm.build_norm("un", C)
    with pytest.raises(ValueError, match="fairseq.*time-first"):
        unnorm.test_time(model, "unmix")


def test_bad_calls_are_refused_naming_the_fix():
    norm = trained("bn")
    with pytest.raises(ValueError, match="mode must be one of"):
        unnorm.test_time(norm, "tent")
    with pytest.raises(ValueError, match="takes no option"):
        unnorm.test_time(norm, "tbn", alpha=0.1)
    with pytest.raises(ValueError, match="alpha"):
        unnorm.test_time(norm, "alpha", alpha=1.5)
    with pytest.raises(ValueError, match="nothing to adapt"):
        unnorm.test_time(nn.Sequential(nn.Linear(2, 2), unnorm.build_norm("ln", C)), "tbn")
    with pytest.raises(ValueError, match="one_position must be one of source, refuse"):
        unnorm.test_time(norm, "unmix", one_position="instance")
    with unnorm.test_time(norm, "unmix", one_position="refuse"):
        for rows in (torch.randn(4, C), torch.randn(4, 1, C)):  # one position each
            with pytest.raises(ValueError, match="more than one position.*one_position='source'"):
                norm(rows.double())
    one_position = [torch.randn(4, C).double(), torch.randn(4, 1, C).double()]
    as_trained = [norm.eval()(rows) for rows in one_position]
    with unnorm.test_time(norm, "unmix") as adapted:  # the release's UnMixTNS1d: the source
        for rows, expected in zip(one_position, as_trained):
            assert torch.equal(norm(rows), expected)
        assert adapted.at_source() == {"": 2}
        with pytest.raises(RuntimeError, match="already adapted"):
            unnorm.test_time(norm, "tbn")


def test_norms_left_as_trained_are_named():
    model = nn.Sequential(nn.BatchNorm1d(C), unnorm.build_norm("evonorm_b0", C, apply_act=False),
                          unnorm.build_norm("bn", C))
    with unnorm.test_time(model, "tbn") as adapted:
        assert list(adapted.norms) == ["2"]
        assert set(adapted.kept) == {"0", "1"}
        assert "torch's BatchNorm1d" in adapted.kept["0"]
