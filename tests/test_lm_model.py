"""The Llama-style decoder (plugins/lm/model.py): Hugging Face's Llama in Pre-RMSNorm, each
placement against its formula written out by hand, Mix-LN's layer rule, the DyT and SLAB LLaMA
recipes, every norm at every site training, and the unnorm options the model needs."""
from __future__ import annotations

import copy
import math
from pathlib import Path

import pytest
import torch
import transformers
from omegaconf import OmegaConf
from transformers.models.llama.modeling_llama import LlamaRMSNorm

import unnorm
from plugins.lm import PLACEMENTS, build_lm, dyt_llm_alphas, layer_placements
from plugins.lm.model import NormedEmbedding

CONFIGS = Path(__file__).resolve().parents[1] / "configs"
TINY = dict(vocab_size=61, hidden_size=32, intermediate_size=48, num_hidden_layers=4,
            num_attention_heads=4, context=16)


def token_ids(batch=2, length=10, seed=0):
    return torch.randint(0, TINY["vocab_size"], (batch, length),
                         generator=torch.Generator().manual_seed(seed))


def config_norm(name: str) -> dict:
    """The norm's Hydra config (configs/norm), with a short PRepBN hand-over."""
    cfg = OmegaConf.to_container(OmegaConf.load(CONFIGS / "norm" / f"{name}.yaml"))
    if name == "prepbn":
        cfg["decay_iters"] = 4
    return cfg


@torch.no_grad()
def randomize_norms(model, seed=1):
    """Every norm parameter away from its initial value (so a misplaced norm shows)."""
    gen = torch.Generator().manual_seed(seed)
    for module in model.modules():
        if isinstance(module, unnorm.ChannelNorm):
            for param in module.parameters():
                param.copy_(1 + 0.3 * torch.randn(param.shape, generator=gen))


# ---- Pre-RMSNorm is Hugging Face's Llama ------------------------------------------------------

def test_pre_rms_is_hugging_faces_llama():
    torch.manual_seed(0)
    ours = build_lm(TINY, {"name": "rms"}, initializer_range=0.1)
    torch.manual_seed(0)
    theirs = transformers.LlamaForCausalLM(copy.deepcopy(ours.config))
    assert list(ours.state_dict()) == list(theirs.state_dict())
    for key, value in theirs.state_dict().items():  # same seed, same initial weights
        assert torch.equal(ours.state_dict()[key], value), key
    norms = [m for m in ours.modules() if isinstance(m, unnorm.RMSNorm)]
    assert len(norms) == 2 * TINY["num_hidden_layers"] + 1
    assert all(m.bias is None and m.eps == ours.config.rms_norm_eps for m in norms)

    ids = token_ids()
    randomize_norms(ours)
    theirs.load_state_dict(ours.state_dict())
    torch.testing.assert_close(ours(ids).logits, theirs(ids).logits, rtol=1e-6, atol=1e-6)


def test_pre_rms_in_bfloat16_is_hugging_faces_llama(monkeypatch):
    torch.manual_seed(0)
    ours = build_lm(TINY, {"name": "rms"}, initializer_range=0.1)
    theirs = transformers.LlamaForCausalLM(copy.deepcopy(ours.config))
    theirs.load_state_dict(ours.state_dict())
    ours.bfloat16(), theirs.bfloat16()
    ids = token_ids()
    assert torch.equal(ours(ids).logits, theirs(ids).logits)  # unit norm weights: bit for bit
    randomize_norms(ours)
    theirs.load_state_dict(ours.state_dict())
    assert not torch.equal(ours(ids).logits, theirs(ids).logits)
    # The one difference: Hugging Face rounds the normalised input to bf16 before the weight,
    # unnorm rounds once after it. With Hugging Face's norm rounding once, bit for bit again
    # (a bound on the two roundings' drift through the layers would depend on the CPU's kernels)

    def round_once(self, hidden_states):
        input_dtype = hidden_states.dtype
        hidden_states = hidden_states.to(torch.float32)
        variance = hidden_states.pow(2).mean(-1, keepdim=True)
        hidden_states = hidden_states * torch.rsqrt(variance + self.variance_epsilon)
        return (self.weight.float() * hidden_states).to(input_dtype)

    monkeypatch.setattr(LlamaRMSNorm, "forward", round_once)
    assert torch.equal(ours(ids).logits, theirs(ids).logits)


# ---- placements against their formulas --------------------------------------------------------

def attention(layer, x, rope):
    return layer.self_attn(hidden_states=x, position_embeddings=rope, attention_mask=None)[0]


def reference_logits(model, ids, kinds, final_norm=True, embedding_norm=False):
    """The papers' formulas, layer by layer, from the model's own submodules."""
    decoder = model.model
    x = torch.nn.functional.embedding(ids, decoder.embed_tokens.weight)
    if embedding_norm:
        x = decoder.embed_tokens.norm(x)
    rope = decoder.rotary_emb(x, torch.arange(ids.shape[1])[None])
    for layer, kind in zip(decoder.layers, kinds):
        A, M = (lambda h: attention(layer, h, rope)), layer.mlp
        if kind == "pre":
            h = x + A(layer.input_layernorm(x))
            x = h + M(layer.post_attention_layernorm(h))
        elif kind == "post":
            h = layer.post_attention_layernorm(x + A(x))
            x = layer.post_feedforward_layernorm(h + M(h))
        else:  # peri: each sublayer's input and output normalised, the residual untouched
            h = x + layer.post_attention_layernorm(A(layer.input_layernorm(x)))
            x = h + layer.post_feedforward_layernorm(M(layer.pre_feedforward_layernorm(h)))
    if final_norm:
        x = decoder.norm(x)
    return model.lm_head(x)


@pytest.mark.parametrize("placement, kinds, final_norm", [
    ("pre", ["pre"] * 4, True),
    ("post", ["post"] * 4, False),
    ("peri", ["peri"] * 4, True),
    ("mix", ["post", "post", "pre", "pre"], True),
])
def test_placements_follow_their_formulas(placement, kinds, final_norm):
    torch.manual_seed(0)
    model = build_lm(TINY, {"name": "ln"}, norm_position=placement, mix_post_fraction=0.5,
                     embedding_norm=placement == "peri", initializer_range=0.1)
    randomize_norms(model)
    assert [layer.placement for layer in model.model.layers] == kinds
    assert isinstance(model.model.norm, unnorm.LayerNorm) == final_norm
    ids = token_ids()
    expected = reference_logits(model, ids, kinds, final_norm, embedding_norm=placement == "peri")
    torch.testing.assert_close(model(ids).logits, expected, rtol=1e-5, atol=1e-5)


def test_post_keeps_a_final_norm_when_asked():
    """Mix-LN's Post-LN baseline keeps Llama's final norm; the original Post-LN has none."""
    model = build_lm(TINY, {"name": "ln"}, norm_position="post", final_norm=True)
    randomize_norms(model)
    ids = token_ids()
    torch.testing.assert_close(model(ids).logits, reference_logits(model, ids, ["post"] * 4))


@pytest.mark.parametrize("placement", ["post", "peri", "mix"])
def test_cached_decoding_matches_the_whole_sequence(placement):
    model = build_lm(TINY, {"name": "ln"}, norm_position=placement, mix_post_fraction=0.5).eval()
    ids = token_ids()
    with torch.no_grad():
        whole = model(ids).logits[:, -1]
        prefix = model(ids[:, :-1], use_cache=True)
        step = model(ids[:, -1:], past_key_values=prefix.past_key_values).logits[:, -1]
    torch.testing.assert_close(step, whole, rtol=1e-5, atol=1e-5)


def test_mix_follows_mixln_layer_rule():
    """pixeli99/MixLN: layer i is Post-LN when i < POST_NUM (its scripts: LLaMA-71M's 12 layers
    with 3, LLaMA-1B's 24 with 6: a quarter), Pre-LN after; floor(0.25 L) between."""
    for layers, post_num in ((12, 3), (24, 6), (32, 8), (6, 1), (7, 1), (3, 0)):
        assert layer_placements("mix", layers, 0.25) == [
            "post" if i < post_num else "pre" for i in range(layers)]
    assert layer_placements("mix", 4, 1.0) == ["post"] * 4
    model = build_lm({**TINY, "num_hidden_layers": 12}, {"name": "rms"}, norm_position="mix")
    for i, layer in enumerate(model.model.layers):
        sites = {name for name, _ in layer.named_children()} - {"self_attn", "mlp"}
        assert sites == ({"post_attention_layernorm", "post_feedforward_layernorm"} if i < 3
                         else {"input_layernorm", "post_attention_layernorm"})
    assert isinstance(model.model.norm, unnorm.RMSNorm)  # Mix-LN's Llama keeps its final norm


# ---- the releases' LLaMA recipes --------------------------------------------------------------

def dyt_alphas(model) -> dict[str, float]:
    return {name: m.alpha.item() for name, m in model.named_modules()
            if isinstance(m, unnorm.DynamicTanh)}


def test_dyt_llm_alpha_table_is_the_papers():
    assert dyt_llm_alphas(64) == dyt_llm_alphas(1024) == (1.0, 1.0)
    assert dyt_llm_alphas(2048) == (1.0, 0.5)
    assert dyt_llm_alphas(4096) == (0.8, 0.2)      # LLaMA-2 7B
    assert dyt_llm_alphas(5120) == (0.6, 0.15)     # LLaMA-2 13B
    assert dyt_llm_alphas(8192) == (0.2, 0.05)     # LLaMA-2 34B, 70B
    assert dyt_llm_alphas(16384) == (0.2, 0.05)


@pytest.mark.parametrize("placement, attention_sites", [
    ("pre", {"input_layernorm"}),
    ("peri", {"input_layernorm", "post_attention_layernorm"}),
])
def test_dyt_llm_recipe_initialisation(placement, attention_sites):
    wide = dict(vocab_size=16, hidden_size=2048, intermediate_size=8, num_hidden_layers=1,
                num_attention_heads=16, context=8)
    model = build_lm(wide, {"name": "dyt", "alpha_init": 0.5}, norm_position=placement)
    alphas = dyt_alphas(model)
    assert len(alphas) == (2 if placement == "pre" else 4) + 1  # the layer's and the final norm
    for name, alpha in alphas.items():  # width 2048: attention 1.0, every other norm 0.5
        in_attention = name.startswith("model.layers") and name.rsplit(".", 1)[-1] in attention_sites
        assert alpha == (1.0 if in_attention else 0.5), name
    assert all(m.bias is None for m in model.modules() if isinstance(m, unnorm.DynamicTanh))
    embedding = model.model.embed_tokens
    assert isinstance(embedding, NormedEmbedding) and embedding.norm is None
    assert embedding.scale.item() == pytest.approx(math.sqrt(2048))
    ids = torch.tensor([[1, 2, 3]])
    torch.testing.assert_close(embedding(ids), embedding.weight[ids] * math.sqrt(2048))


def test_dyt_without_the_recipe_is_the_vision_dyt():
    model = build_lm(TINY, {"name": "dyt", "alpha_init": 0.3}, dyt_llm_recipe=False)
    assert dyt_alphas(model) and all(a == pytest.approx(0.3) for a in dyt_alphas(model).values())
    assert all(m.bias is not None for m in model.modules() if isinstance(m, unnorm.DynamicTanh))
    assert type(model.model.embed_tokens) is torch.nn.Embedding


def test_prepbn_llm_recipe_starts_as_llama():
    """SLAB's LLaMA PRepBN: RMSNorm (weight only) handing over to a RepBN that starts at zero,
    so its first training step is Pre-RMSNorm Llama's forward."""
    model = build_lm(TINY, config_norm("prepbn"), initializer_range=0.1)
    norms = [m for m in model.modules() if isinstance(m, unnorm.ProgressiveRepBN)]
    assert len(norms) == 2 * TINY["num_hidden_layers"] + 1
    for norm in norms:
        assert norm.start_norm == "rms" and norm.bias is None
        assert not (norm.bn_weight.any() or norm.bn_bias.any() or norm.alpha.any())
    llama = transformers.LlamaForCausalLM(copy.deepcopy(model.config))
    missing, _ = llama.load_state_dict(model.state_dict(), strict=False)  # RepBN's state aside
    assert not missing
    ids = token_ids()
    torch.testing.assert_close(model.train()(ids).logits, llama(ids).logits, rtol=1e-5, atol=1e-5)


def test_prepbn_without_the_recipe_starts_from_layernorm():
    model = build_lm(TINY, config_norm("prepbn"), prepbn_llm_recipe=False)
    norm = model.model.layers[0].input_layernorm
    assert norm.start_norm == "ln" and norm.bias is not None and norm.alpha.item() == 1.0


# ---- every norm at every site, every placement ------------------------------------------------

@pytest.mark.parametrize("placement", PLACEMENTS)
def test_every_norm_trains_at_every_site(placement):
    """One training step on packed (B, T) sequences: a finite loss, and a finite gradient for
    every norm parameter at every site (peri with its embedding norm)."""
    small = {**TINY, "hidden_size": 16, "intermediate_size": 24, "num_hidden_layers": 2}
    sites = {"pre": 2, "post": 2, "peri": 4, "mix": 2}[placement] * 2
    sites += (placement != "post") + (placement == "peri")
    ids = token_ids(batch=3, length=8)
    for name in unnorm.available_norms():
        torch.manual_seed(0)
        model = build_lm(small, config_norm(name), norm_position=placement,
                         mix_post_fraction=0.5, embedding_norm=placement == "peri").train()
        norms = {n: m for n, m in model.named_modules() if isinstance(m, unnorm.ChannelNorm)}
        assert len(norms) == sites, (name, sorted(norms))
        logits = model(ids[:, :-1]).logits
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), ids[:, 1:].flatten())
        assert torch.isfinite(loss), name
        loss.backward()
        for norm_name, norm in norms.items():
            for param_name, param in norm.named_parameters():
                assert param.grad is not None and torch.isfinite(param.grad).all(), (
                    name, placement, norm_name, param_name)


def test_pn_ls_groups_by_the_attention_heads():
    model = build_lm(TINY, config_norm("pn_ls"))
    groups = {m.group_num for m in model.modules() if isinstance(m, unnorm.PowerNorm)}
    assert groups == {TINY["num_attention_heads"]}


def test_norm_eps_is_the_models_unless_the_norm_config_sets_it():
    model = build_lm(TINY, {"name": "ln"}, rms_norm_eps=1e-6)
    assert model.model.norm.eps == 1e-6
    model = build_lm(TINY, {"name": "ln", "eps": 1e-3})
    assert model.model.norm.eps == 1e-3


def test_tied_embeddings_stay_tied_under_the_embedding_scale():
    model = build_lm(TINY, {"name": "dyt"}, tie_word_embeddings=True)
    assert model.lm_head.weight is model.model.embed_tokens.weight


def test_bad_model_configs_are_refused():
    with pytest.raises(ValueError, match="norm_position must be one of"):
        build_lm(TINY, {"name": "ln"}, norm_position="sandwich")
    with pytest.raises(ValueError, match="mix_post_fraction"):
        build_lm(TINY, {"name": "ln"}, norm_position="mix", mix_post_fraction=1.5)
    with pytest.raises(ValueError, match="hidden_sise"):
        build_lm({**TINY, "hidden_sise": 8}, {"name": "ln"})
    with pytest.raises(ValueError, match="disagree"):
        build_lm({**TINY, "max_position_embeddings": 32}, {"name": "ln"})
    with pytest.raises(ValueError, match="unknown norm"):
        build_lm(TINY, {"name": "layernorm"})
    with pytest.raises(ValueError, match="final_norm"):
        build_lm(TINY, {"name": "ln"}, final_norm="yes")
    for name in ("bcn", "evonorm_b0", "evonorm_s0"):  # pooled over later tokens
        with pytest.raises(ValueError, match="norm.layout=token"):
            build_lm(TINY, {**config_norm(name), "layout": "image"})


def test_hydra_model_config_builds_at_cpu_scale():
    """configs/model/llama_71m.yaml with its scale=cpu variant merged (Hydra's composition),
    and as a run's config.yaml recorded it before Hydra composed the scale (the variant kept
    inside the model as ``cpu``): both build the CPU testbed."""
    variant = OmegaConf.load(CONFIGS / "scale" / "model" / "cpu_llama_71m.yaml")
    composed = OmegaConf.merge(OmegaConf.load(CONFIGS / "model" / "llama_71m.yaml"), variant)
    for cfg in (composed, OmegaConf.merge(composed, {"cpu": variant})):
        model = build_lm(cfg, config_norm("ln"), vocab_size=64)
        assert model.config.max_position_embeddings == cfg.context == 128
        assert len(model.model.layers) == cfg.num_hidden_layers == 6


# ---- the unnorm options the model needs --------------------------------------------------------

def test_layernorm_without_bias_is_torchs():
    x = torch.randn(5, 7, 12, dtype=torch.float64, requires_grad=True)
    ours = unnorm.build_norm("ln", 12, bias=False).double()
    theirs = torch.nn.LayerNorm(12, bias=False).double()
    with torch.no_grad():
        ours.weight.copy_(torch.rand(12) + 0.5)
        theirs.weight.copy_(ours.weight)
    assert [n for n, _ in ours.named_parameters()] == ["weight"]
    dy = torch.randn_like(x)
    (gx_ours,) = torch.autograd.grad(ours(x), x, dy)
    (gx_theirs,) = torch.autograd.grad(theirs(x), x, dy)
    torch.testing.assert_close(ours(x), theirs(x))
    torch.testing.assert_close(gx_ours, gx_theirs)


def test_rmsnorm_without_bias_is_llamas():
    x = torch.randn(4, 9, 16)
    ours = unnorm.build_norm("rms", 16, bias=False, eps=1e-6)
    theirs = LlamaRMSNorm(16, eps=1e-6)
    with torch.no_grad():
        ours.weight.copy_(torch.rand(16) + 0.5)
        theirs.weight.copy_(ours.weight)
    torch.testing.assert_close(ours(x), theirs(x))


def test_dyt_without_bias_folds():
    norm = unnorm.build_norm("dyt", 8, alpha_init=0.7, bias=False)
    with torch.no_grad():
        norm.weight.copy_(torch.rand(8) + 0.5)
    x = torch.randn(3, 8)
    torch.testing.assert_close(norm(x), norm.weight * torch.tanh(0.7 * x))
    linear = torch.nn.Linear(8, 5, bias=False)
    expected = linear(norm(x))
    rest = unnorm.fold_into_linear(norm.eval(), [linear])
    torch.testing.assert_close(linear(rest(x)), expected)


def test_prepbn_can_start_from_rmsnorm():
    norm = unnorm.build_norm("prepbn", 8, decay_iters=3, start_norm="rms", bias=False, eps=1e-6)
    with torch.no_grad():
        norm.weight.copy_(torch.rand(8) + 0.5)
    x = torch.randn(6, 8)
    expected = x * torch.rsqrt(x.square().mean(-1, keepdim=True) + 1e-6) * norm.weight
    torch.testing.assert_close(norm(x), expected)  # step 1: the hand-over has not begun
    with pytest.raises(ValueError, match="start_norm"):
        unnorm.build_norm("prepbn", 8, start_norm="bn")


def test_causal_bn_evaluates_every_position_as_it_trains():
    """Causal BN keeps running statistics per position: after training, eval-mode and
    training-mode validation losses agree at every position (one whole-batch estimate
    standardised the early positions by the wrong statistics)."""
    torch.manual_seed(0)
    model = build_lm(TINY, {"name": "bn", "causal": True}, initializer_range=0.1)
    assert model.model.layers[0].input_layernorm.running_var.shape == (TINY["context"], 32)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    gen = torch.Generator().manual_seed(0)

    def per_position_loss(net, ids):
        logits = net(ids).logits[:, :-1]
        return torch.nn.functional.cross_entropy(
            logits.reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1),
            reduction="none").reshape(ids.shape[0], -1).mean(dim=0)

    for _ in range(40):
        loss = per_position_loss(model.train(), torch.randint(
            0, TINY["vocab_size"], (16, TINY["context"]), generator=gen)).mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    ids = torch.randint(0, TINY["vocab_size"], (64, TINY["context"]), generator=gen)
    with torch.no_grad():
        training_mode = per_position_loss(copy.deepcopy(model).train(), ids)
        eval_mode = per_position_loss(model.eval(), ids)
    torch.testing.assert_close(eval_mode, training_mode, rtol=0.02, atol=0)
