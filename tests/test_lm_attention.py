"""The language model's attention options: qk-norm (Qwen 3's per-head RMSNorm is the
reference), the maximum attention logit (Hugging Face's eager attention is), Mix-LN's
initialisation and the z-loss."""
from __future__ import annotations

import math

import pytest
import torch
import transformers
from transformers import AutoModelForCausalLM

import unnorm
from plugins.lm import build_lm
from plugins.lm.attention import QKNormLinear, max_attention_logits
from plugins.lm.model import MIXLN_EMBEDDING_STD
from plugins.lm.trainer import z_loss
from test_lm_model import TINY, randomize_norms, token_ids


def test_pre_rms_with_qk_rms_is_qwen3():
    """Pre-RMSNorm Llama with ``qk_norm=rms`` is Qwen 3's decoder (a weight-only RMSNorm on each
    head's queries and keys before RoPE): the same logits from the same weights."""
    torch.manual_seed(0)
    ours = build_lm(TINY, {"name": "rms"}, qk_norm="rms", initializer_range=0.1)
    randomize_norms(ours)
    theirs = transformers.Qwen3ForCausalLM(transformers.Qwen3Config(
        vocab_size=TINY["vocab_size"], hidden_size=TINY["hidden_size"],
        intermediate_size=TINY["intermediate_size"], num_hidden_layers=TINY["num_hidden_layers"],
        num_attention_heads=TINY["num_attention_heads"],
        num_key_value_heads=TINY["num_attention_heads"],
        head_dim=TINY["hidden_size"] // TINY["num_attention_heads"],
        max_position_embeddings=TINY["context"], rms_norm_eps=ours.config.rms_norm_eps,
        tie_word_embeddings=False))
    state = {key.replace("q_proj.head_norm", "q_norm").replace("k_proj.head_norm", "k_norm"): value
             for key, value in ours.state_dict().items()}
    assert set(state) == set(theirs.state_dict())
    theirs.load_state_dict(state)
    ids = token_ids()
    torch.testing.assert_close(ours(ids).logits, theirs(ids).logits, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("placement", ["pre", "post", "peri", "mix"])
def test_qk_norm_is_on_every_layers_queries_and_keys(placement):
    model = build_lm(TINY, {"name": "ln"}, qk_norm="ln", norm_position=placement)
    head_dim = TINY["hidden_size"] // TINY["num_attention_heads"]
    for layer in model.model.layers:
        attention = layer.self_attn
        for proj in (attention.q_proj, attention.k_proj):
            assert isinstance(proj, QKNormLinear) and isinstance(proj.head_norm, unnorm.LayerNorm)
            assert proj.head_norm.weight.shape == (head_dim,)
        assert type(attention.v_proj) is torch.nn.Linear


def test_batch_statistics_qk_norm_pools_over_batch_heads_and_positions():
    """A BN qk-norm sees each head's queries as (B * heads, T, head_dim): its statistics are
    those of every (sequence, head, position)'s head_dim vector."""
    model = build_lm(TINY, {"name": "ln"}, qk_norm="bn")
    proj = model.model.layers[0].self_attn.q_proj
    x = torch.randn(3, 7, TINY["hidden_size"])
    y = torch.nn.functional.linear(x, proj.weight).view(3, 7, TINY["num_attention_heads"], -1)
    mean = y.mean(dim=(0, 1, 2))
    var = y.var(dim=(0, 1, 2), unbiased=False)
    expected = (y - mean) / torch.sqrt(var + proj.head_norm.eps)
    torch.testing.assert_close(proj(x), expected.reshape(3, 7, -1), rtol=1e-4, atol=1e-4)


def test_qk_norm_round_trips_through_hugging_face(tmp_path):
    torch.manual_seed(0)
    model = build_lm(TINY, {"name": "ln"}, qk_norm="bn")
    model.train()
    for _ in range(3):  # running statistics away from their initial values
        model(token_ids(seed=_))
    model.eval()
    model.save_pretrained(tmp_path)
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    assert loaded.config.qk_norm == "bn"
    ids = token_ids(seed=9)
    assert torch.equal(model(ids).logits, loaded(ids).logits)


def test_max_attention_logit_is_the_eager_attentions_largest_visible_logit(monkeypatch):
    """The probe's per-layer maximum equals the largest finite input of the softmax in Hugging
    Face's eager attention (masked pairs are -inf or dtype-min there), with qk-norm and RoPE."""
    torch.manual_seed(0)
    model = build_lm(TINY, {"name": "rms"}, qk_norm="ln", initializer_range=0.3).eval()
    model.set_attn_implementation("eager")
    randomize_norms(model)
    seen = []
    softmax = torch.nn.functional.softmax

    def recording(scores, *args, **kwargs):
        visible = scores[scores > torch.finfo(scores.dtype).min / 2]
        seen.append(visible.max().item())
        return softmax(scores, *args, **kwargs)

    ids = token_ids(batch=3, length=12)
    probed = max_attention_logits(model, ids)
    monkeypatch.setattr(torch.nn.functional, "softmax", recording)
    with torch.no_grad():
        model(ids)
    assert len(probed) == TINY["num_hidden_layers"]
    assert probed == pytest.approx(seen, rel=1e-5)


def test_max_attention_logit_of_a_compiled_model_is_the_eager_ones():
    torch.manual_seed(0)
    model = build_lm(TINY, {"name": "ln"}, qk_norm="ln").eval()
    ids = token_ids()
    eager = max_attention_logits(model, ids)
    for layer in model.model.layers:  # per block, as plugins.fsdp compiles a sharded model
        layer.compile(backend="aot_eager")
    with torch.no_grad():
        model(ids)  # traced before the probe's hooks exist
    assert max_attention_logits(model, ids) == eager


def test_max_attention_logit_refuses_training_mode():
    with pytest.raises(ValueError, match=r"model.eval\(\)"):
        max_attention_logits(build_lm(TINY, {"name": "bn"}), token_ids())


def test_mixln_init_draws_the_releases_embeddings_and_keeps_loaded_ones(tmp_path):
    wide = {**TINY, "vocab_size": 4000, "hidden_size": 64}
    torch.manual_seed(0)
    model = build_lm(wide, {"name": "ln"}, init="mixln", initializer_range=0.02)
    embedding = model.model.embed_tokens.weight
    assert embedding.std().item() == pytest.approx(MIXLN_EMBEDDING_STD, rel=0.02)
    assert embedding.mean().abs().item() < 0.01
    assert model.model.layers[0].mlp.up_proj.weight.std().item() == pytest.approx(0.02, rel=0.05)
    torch.manual_seed(0)
    default = build_lm(wide, {"name": "ln"}, initializer_range=0.02)
    assert default.model.embed_tokens.weight.std().item() == pytest.approx(0.02, rel=0.02)
    model.save_pretrained(tmp_path)
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path)
    assert loaded.config.init == "mixln"
    assert torch.equal(loaded.model.embed_tokens.weight, embedding)


def test_bad_attention_options_are_refused():
    with pytest.raises(ValueError, match="qk_norm must be null or a registry norm"):
        build_lm(TINY, {"name": "ln"}, qk_norm="layernorm")
    with pytest.raises(ValueError, match="init must be one of hf, mixln"):
        build_lm(TINY, {"name": "ln"}, init="xavier")


def test_z_loss_is_the_mean_squared_log_partition():
    logits = torch.randn(2, 5, 11, dtype=torch.float64) * 4
    expected = torch.log(torch.exp(logits).sum(-1)).pow(2).mean()
    torch.testing.assert_close(z_loss(logits.float()), expected.float())
    assert z_loss(logits.half()).dtype == torch.float32
    assert math.isfinite(z_loss(torch.full((1, 2, 3), 60.0, dtype=torch.bfloat16)).item())

