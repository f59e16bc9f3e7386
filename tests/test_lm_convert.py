"""Pre-LN -> Pre-RMSNorm -> Pre-CRMSNorm for the Llama-style decoder (plugins/lm/convert.py):
the converted models' logits, and their greedy generation through the KV cache, equal the
unconverted Pre-LN model's; the stream is zero-mean (and one narrower); the shifts land in
biases on q/k (before RoPE), v, gate, up and the head; every other model is refused unchanged."""
from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import unnorm
from plugins.lm import build_lm
from plugins.lm.convert import to_pre_crms, to_pre_rms

TINY = dict(vocab_size=97, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
            num_attention_heads=2, context=16, initializer_range=0.1)
CONVERSIONS = {"rms": to_pre_rms, "crms": to_pre_crms}
CONVERTED_NORM = {"rms": unnorm.RMSNorm, "crms": unnorm.CompressedRMSNorm}
NORM_SITES = ["model.layers.0.input_layernorm", "model.layers.0.post_attention_layernorm",
              "model.layers.1.input_layernorm", "model.layers.1.post_attention_layernorm",
              "model.norm"]
READERS = {"q_proj", "k_proj", "v_proj", "gate_proj", "up_proj", "lm_head"}


def pre_ln(**overrides) -> nn.Module:
    """A tiny Pre-LN decoder in eval mode, every LayerNorm's gain and shift random (a fresh one
    has unit gains and zero shifts, which would leave the folds nothing to carry)."""
    torch.manual_seed(0)
    model = build_lm({**TINY, **overrides}, {"name": "ln"})
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, unnorm.LayerNorm):
                module.weight.mul_(1 + 0.5 * torch.randn(module.weight.shape, generator=generator))
                module.bias.copy_(0.5 * torch.randn(module.bias.shape, generator=generator))
    return model.eval()


def token_ids(batch=3, length=16, seed=2):
    return torch.randint(0, TINY["vocab_size"], (batch, length),
                         generator=torch.Generator().manual_seed(seed))


@pytest.fixture(scope="module")
def model():
    return pre_ln()


def _converted(model: nn.Module, target: str, dtype=torch.float32) -> nn.Module:
    return CONVERSIONS[target](copy.deepcopy(model).to(dtype))


@pytest.mark.parametrize("dtype, tolerance", [(torch.float64, 1e-10), (torch.float32, 1e-5)])
@pytest.mark.parametrize("target", ["rms", "crms"])
def test_converted_logits_equal_the_pre_ln_models(model, target, dtype, tolerance):
    original = copy.deepcopy(model).to(dtype)
    ids = token_ids()
    with torch.no_grad():
        want = original(ids).logits
        got = _converted(model, target, dtype)(ids).logits
    assert got.dtype == dtype
    assert (got - want).abs().max() <= tolerance * want.abs().max()


@pytest.mark.parametrize("target", ["rms", "crms"])
def test_every_norm_site_converts_and_its_shift_becomes_its_readers_bias(model, target):
    converted = _converted(model, target)
    norms = {name: type(m) for name, m in converted.named_modules()
             if isinstance(m, (unnorm.ChannelNorm, nn.LayerNorm))}
    assert norms == dict.fromkeys(NORM_SITES, CONVERTED_NORM[target])
    assert all(converted.get_submodule(name).bias is None for name in NORM_SITES)
    biased = {name.rsplit(".", 2)[-2] for name, param in converted.named_parameters()
              if name.endswith("bias") and param.abs().min() > 0}
    assert biased == READERS  # o_proj and down_proj stay without one, as in Llama


def _stream(model: nn.Module, ids: torch.Tensor) -> list[torch.Tensor]:
    """The stream where each norm reads it (both norms of each layer, then the final one)."""
    seen = []
    hooks = [model.get_submodule(name).register_forward_pre_hook(
        lambda module, args: seen.append(args[0])) for name in NORM_SITES]
    with torch.no_grad():
        model(ids)
    for hook in hooks:
        hook.remove()
    assert len(seen) == len(NORM_SITES)
    return seen


def test_pre_rms_stream_is_the_pre_ln_streams_zero_mean_part(model):
    ids = token_ids()
    original = _stream(copy.deepcopy(model).double(), ids)
    got = _stream(_converted(model, "rms", torch.float64), ids)
    for got_x, original_x in zip(got, original):
        torch.testing.assert_close(got_x, original_x - original_x.mean(-1, keepdim=True),
                                   rtol=1e-10, atol=1e-10)
    assert min(x.mean(-1).abs().max() for x in original) > 0.01  # centring had work to do


def test_pre_crms_stream_is_one_narrower_and_holds_the_first_coordinates(model):
    ids = token_ids()
    d = TINY["hidden_size"]
    original = _stream(copy.deepcopy(model).double(), ids)
    converted = _converted(model, "crms", torch.float64)
    for got_x, original_x in zip(_stream(converted, ids), original):
        want = (original_x - original_x.mean(-1, keepdim=True))[..., :-1]
        torch.testing.assert_close(got_x, want, rtol=1e-10, atol=1e-10)
    assert converted.model.embed_tokens.weight.shape == (TINY["vocab_size"], d - 1)
    for layer in converted.model.layers:
        assert layer.self_attn.o_proj.weight.shape == (d - 1, d)  # heads x head_dim stays d
        assert layer.mlp.down_proj.weight.shape == (d - 1, TINY["intermediate_size"])
        assert layer.self_attn.q_proj.in_features == layer.mlp.up_proj.in_features == d - 1
    assert converted.lm_head.in_features == converted.config.hidden_size == d - 1
    assert converted.config.head_dim == d // TINY["num_attention_heads"]


def _q_k_and_logits(model: nn.Module, ids: torch.Tensor, position_ids: torch.Tensor):
    """The last layer's q and k projections (before RoPE) and the logits."""
    attention = model.model.layers[-1].self_attn
    projections = {}
    hooks = [getattr(attention, name).register_forward_hook(
        lambda module, args, out, name=name: projections.__setitem__(name, out))
        for name in ("q_proj", "k_proj")]
    with torch.no_grad():
        logits = model(ids, position_ids=position_ids).logits
    for hook in hooks:
        hook.remove()
    return projections, logits


@pytest.mark.parametrize("target", ["rms", "crms"])
def test_biased_q_and_k_pass_through_rope_exactly_at_any_positions(model, target):
    """q and k take the shift as a bias before RoPE rotates them: the projections equal the
    Pre-LN model's, and so do the logits at positions with gaps (which RoPE sees)."""
    ids = token_ids(batch=1, length=6)
    gaps = torch.tensor([[0, 2, 3, 7, 8, 13]])
    original = copy.deepcopy(model).double()
    converted = _converted(model, target, torch.float64)
    assert converted.model.layers[-1].self_attn.q_proj.bias.abs().min() > 0
    want_q_k, want = _q_k_and_logits(original, ids, gaps)
    got_q_k, got = _q_k_and_logits(converted, ids, gaps)
    torch.testing.assert_close(got_q_k, want_q_k, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-10)
    with torch.no_grad():
        assert not torch.allclose(original(ids).logits, want)  # the gaps matter


@pytest.mark.parametrize("target", ["rms", "crms"])
def test_converted_model_generates_through_its_kv_cache_as_the_original(model, target):
    prompt = token_ids(batch=2, length=5)
    options = dict(max_new_tokens=6, do_sample=False, use_cache=True, output_scores=True,
                   return_dict_in_generate=True, pad_token_id=0)
    original = copy.deepcopy(model)
    converted = _converted(model, target)
    want, got = original.generate(prompt, **options), converted.generate(prompt, **options)
    assert want.sequences.shape == (2, 11)
    assert torch.equal(got.sequences, want.sequences)
    for got_scores, want_scores in zip(got.scores, want.scores, strict=True):
        torch.testing.assert_close(got_scores, want_scores, rtol=1e-5, atol=1e-5)


NOT_PRE = r"model\.layers\.0 is in {} placement.*norm_position=pre"
REFUSALS = {  # mix: half of 2 layers are Post-LN (the default 0.25 would leave both Pre-LN)
    "post": (dict(norm_position="post"), NOT_PRE.format("post")),
    "peri": (dict(norm_position="peri"), NOT_PRE.format("peri")),
    "mix": (dict(norm_position="mix", mix_post_fraction=0.5), NOT_PRE.format("post")),
    "no_final_norm": (dict(final_norm=False), r"no final norm.*final_norm=null"),
    "embedding_norm": (dict(embedding_norm=True), r"NormedEmbedding.*embedding_norm=false"),
    "tied": (dict(tie_word_embeddings=True), r"tied.*tie_word_embeddings=false"),
}


@pytest.mark.parametrize("target", ["rms", "crms"])
@pytest.mark.parametrize("case", sorted(REFUSALS))
def test_a_model_that_is_not_pre_ln_is_refused_unchanged(case, target):
    overrides, message = REFUSALS[case]
    model = pre_ln(**overrides)
    before = {key: value.clone() for key, value in model.state_dict().items()}
    with pytest.raises(ValueError, match=message):
        CONVERSIONS[target](model)
    after = model.state_dict()
    assert before.keys() == after.keys() and all(torch.equal(before[k], after[k]) for k in before)


@pytest.mark.parametrize("target", ["rms", "crms"])
@pytest.mark.parametrize("norm, kind", [("rms", "RMSNorm"), ("un", "UnifiedNorm")])
def test_another_norm_is_refused_naming_norm_ln(norm, kind, target):
    model = build_lm(TINY, {"name": norm})
    with pytest.raises(ValueError, match=rf"model\.layers\.0\.input_layernorm is {kind}, not a "
                                         r"LayerNorm.*norm=ln"):
        CONVERSIONS[target](model)
    assert type(model.model.layers[0].input_layernorm).__name__ == kind
