"""Folding the Llama-style decoder's offline norms (plugins/lm/fold.py): after a few training
steps (running statistics away from their start), the folded model's eval logits equal the
unfolded model's in every placement, and each norm went where the placement says."""
from __future__ import annotations

import copy

import pytest
import torch

import unnorm
from plugins.lm import build_lm
from plugins.lm.fold import fold_lm, fold_plan

TINY = dict(vocab_size=53, hidden_size=16, intermediate_size=24, num_hidden_layers=4,
            num_attention_heads=2, context=12, initializer_range=0.05)
# PN within its warm-up (batch statistics; running_phi moves all the same): past it, its backward
# grew the gradient ~10x per norm in Post-/Peri-LN here and the third step overflowed
OPTIONS = {"un": {"warmup_iters": 1, "window_size": 2}, "bn": {}, "pn": {"warmup_iters": 100},
           "mabn": {"warmup_iters": 1, "window_size": 2}, "dyt": {},
           "prepbn": {"decay_iters": 1}}


def trained(norm: str, placement: str) -> torch.nn.Module:
    """A float64 model, its norms' parameters random, after three small SGD steps in training
    mode (running statistics away from their start), then in eval mode."""
    torch.manual_seed(0)
    model = build_lm({**TINY, "norm_position": placement, "embedding_norm": placement == "peri",
                      "prepbn_llm_recipe": False}, {"name": norm, **OPTIONS[norm]}).double()
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, unnorm.ChannelNorm):
                for param in module.parameters():
                    param.mul_(1 + 0.3 * torch.randn_like(param)).add_(0.1 * torch.randn_like(param))
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    generator = torch.Generator().manual_seed(1)
    for _ in range(3):
        ids = torch.randint(0, TINY["vocab_size"], (4, TINY["context"]), generator=generator)
        model(input_ids=ids, labels=ids).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    return model.eval()


@pytest.mark.parametrize("placement", ["pre", "post", "peri", "mix"])
@pytest.mark.parametrize("norm", list(OPTIONS))
def test_folded_logits_equal_the_unfolded_models(norm, placement):
    model = trained(norm, placement)
    ids = torch.randint(0, TINY["vocab_size"], (3, TINY["context"]),
                        generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        want = model(input_ids=ids).logits
        assert want.isfinite().all()
        folded = copy.deepcopy(model)
        counts = fold_lm(folded, probe=ids)
        got = folded(input_ids=ids).logits
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-10)
    layers = TINY["num_hidden_layers"]  # mix: one Post-LN layer of four
    into_linears = {"pre": 2 * layers + 1, "post": 0, "peri": 2 * layers + 1, "mix": 2 * (layers - 1) + 1}
    assert counts["folded"] == into_linears[placement]
    left = [m for m in folded.modules() if isinstance(m, unnorm.ChannelNorm)]
    assert len(left) == counts["kept"] and all(isinstance(m, unnorm.DynamicTanh) for m in left)


def test_the_plan_follows_each_placement():
    model = build_lm({**TINY, "norm_position": "mix", "mix_post_fraction": 0.5}, {"name": "bn"})
    plan = fold_plan(model)
    assert plan["model.layers.0.post_attention_layernorm"] == []  # Post-LN: the stream itself
    assert plan["model.layers.0.post_feedforward_layernorm"] == []
    assert plan["model.layers.2.input_layernorm"] == [
        "model.layers.2.self_attn.q_proj", "model.layers.2.self_attn.k_proj",
        "model.layers.2.self_attn.v_proj"]
    assert plan["model.layers.2.post_attention_layernorm"] == [
        "model.layers.2.mlp.gate_proj", "model.layers.2.mlp.up_proj"]  # Pre-LN: the MLP's input
    assert plan["model.norm"] == ["lm_head"]
    peri = fold_plan(build_lm({**TINY, "norm_position": "peri", "embedding_norm": True}, {"name": "bn"}))
    assert peri["model.layers.0.post_attention_layernorm"] == []  # an output norm: added to the stream
    assert peri["model.layers.0.pre_feedforward_layernorm"] == [
        "model.layers.0.mlp.gate_proj", "model.layers.0.mlp.up_proj"]
    assert peri["model.embed_tokens.norm"] == []


def test_online_norms_and_tied_heads_are_refused():
    with pytest.raises(ValueError, match="online|offline|fold"):
        fold_lm(build_lm(TINY, {"name": "ln"}).eval(), probe=None)
    with pytest.raises(ValueError, match="tie_word_embeddings=false"):
        fold_lm(build_lm({**TINY, "tie_word_embeddings": True}, {"name": "bn"}).eval(), probe=None)


def test_a_plan_that_misses_a_norm_is_refused_before_anything_folds():
    model = build_lm(TINY, {"name": "bn"}).eval()
    plan = fold_plan(model)
    del plan["model.norm"]
    before = copy.deepcopy(model.state_dict())
    with pytest.raises(RuntimeError, match=r"plan misses \['model.norm'\]"):
        unnorm.fold_by_plan(model, plan, probe=None)
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())

