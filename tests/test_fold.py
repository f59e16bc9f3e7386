"""Folding proves itself (``unnorm.fold_norms``/``fold_by_plan`` with ``probe``): a plan that
misses a reader of a norm's output is refused, naming the norm and where the reader shows,
with the model left as it was; a right plan folds. Tiny Hugging Face models, no downloads;
their offline norms get running statistics far from their start, so a missed reader shows."""
from __future__ import annotations

import pytest
import torch
import transformers as hf

import unnorm

TOKENS = torch.arange(16).reshape(2, 8) * 7 % 50
Q, K, V = (f"encoder.layer.0.attention.self.{name}" for name in ("query", "key", "value"))


def _with_statistics(model: torch.nn.Module, norm: str = "bn") -> torch.nn.Module:
    """``model``'s norms swapped for ``norm`` with random running statistics and affines, in eval."""
    torch.manual_seed(0)
    unnorm.swap_norms(model, norm)
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, unnorm.ChannelNorm):
                module.running_mean.normal_()
                module.running_var.uniform_(0.5, 2.0)
                module.weight.uniform_(0.5, 1.5)
                module.bias.normal_(0.0, 0.3)
    return model.eval()


def _bert() -> torch.nn.Module:
    torch.manual_seed(0)
    return _with_statistics(hf.BertModel(hf.BertConfig(
        vocab_size=50, hidden_size=16, num_hidden_layers=2, num_attention_heads=2,
        intermediate_size=32, max_position_embeddings=16)))


def _llama() -> torch.nn.Module:
    torch.manual_seed(0)
    return _with_statistics(hf.LlamaForCausalLM(hf.LlamaConfig(
        vocab_size=50, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=1, tie_word_embeddings=False)))


def _llama_plan(model: torch.nn.Module) -> dict[str, list[str]]:
    """Pre-LN: each layer's input norm feeds q, k, v; the MLP's feeds gate and up; the final
    norm the head."""
    plan = {"model.norm": ["lm_head"]}
    for index in range(len(model.model.layers)):
        layer = f"model.layers.{index}"
        plan[f"{layer}.input_layernorm"] = [f"{layer}.self_attn.{p}_proj" for p in "qkv"]
        plan[f"{layer}.post_attention_layernorm"] = [f"{layer}.mlp.{p}_proj" for p in ("gate", "up")]
    return plan


def _bert_plan(model: torch.nn.Module) -> dict[str, list[str]]:
    """Post-LN: every norm's output is the residual stream, so every norm becomes an affine."""
    return {name: [] for name, module in model.named_modules() if isinstance(module, unnorm.ChannelNorm)}


def _snapshot(model: torch.nn.Module):
    return ({name: value.clone() for name, value in model.state_dict().items()},
            [(name, module) for name, module in model.named_modules()])


def _assert_unchanged(model: torch.nn.Module, snapshot) -> None:
    state, modules = snapshot
    assert list(model.state_dict()) == list(state)
    for name, value in model.state_dict().items():
        assert torch.equal(value, state[name]), name
    assert [(name, id(module)) for name, module in model.named_modules()] == \
        [(name, id(module)) for name, module in modules]


def test_the_reported_bert_plan_is_refused_naming_the_residual_and_changes_nothing():
    """The report: embeddings.LayerNorm folded into layer 0's q, k, v, though the attention's
    add-and-norm also reads it (the residual), changed the outputs without a word."""
    model = _bert()
    with torch.no_grad():
        want = model(TOKENS).last_hidden_state
    snapshot = _snapshot(model)
    plan = {**_bert_plan(model), "embeddings.LayerNorm": [Q, K, V]}
    with pytest.raises(ValueError, match=r"folding embeddings\.LayerNorm into .*query.*: "
                                         r"encoder\.layer\.0\.attention\.output\.LayerNorm is the first "
                                         r"module whose output changes.*nothing was folded"):
        unnorm.fold_by_plan(model, plan, probe=TOKENS)
    _assert_unchanged(model, snapshot)
    with pytest.raises(ValueError, match=r"embeddings\.LayerNorm"):
        unnorm.fold_norms(model, {"embeddings.LayerNorm": [Q, K, V]}, probe=TOKENS)
    _assert_unchanged(model, snapshot)
    with torch.no_grad():
        assert torch.equal(model(TOKENS).last_hidden_state, want)


def test_a_norm_the_model_returns_cannot_fold_into_the_pooler():
    model = _bert()
    plan = {**_bert_plan(model), "encoder.layer.1.output.LayerNorm": ["pooler.dense"]}
    with pytest.raises(ValueError, match=r"the model returns encoder\.layer\.1\.output\.LayerNorm's output"):
        unnorm.fold_by_plan(model, plan, probe=TOKENS)


def test_a_layer_of_the_plan_that_does_not_read_the_norm_is_named():
    model = _llama()
    plan = _llama_plan(model)
    plan["model.layers.0.input_layernorm"].append("model.layers.0.self_attn.o_proj")
    with pytest.raises(ValueError, match=r"model\.layers\.0\.self_attn\.o_proj, a layer of the plan"):
        unnorm.fold_by_plan(model, plan, probe=TOKENS)


@pytest.mark.parametrize("build, plan, folded", [(_bert, _bert_plan, 0), (_llama, _llama_plan, 5)])
def test_a_right_plan_folds_and_keeps_the_outputs(build, plan, folded):
    model = build()
    with torch.no_grad():
        want = model(TOKENS)[0]
        counts = unnorm.fold_by_plan(model, plan(model), probe=TOKENS)
        got = model(TOKENS)[0]
    assert counts["folded"] == folded
    assert not any(isinstance(module, unnorm.ChannelNorm) for module in model.modules())
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)  # float32 rounding


def test_a_probe_that_cannot_check_is_refused_naming_the_fix():
    model = _bert()
    plan = _bert_plan(model)
    images = torch.randn(2, 3, 8, 8)
    with pytest.raises(RuntimeError, match="give it float64 inputs"):  # the copy is float64
        unnorm.fold_by_plan(torch.nn.Sequential(torch.nn.Conv2d(3, 4, 1)).eval(), {},
                           probe=lambda copy: copy(images))
    with pytest.raises(ValueError, match="returned no tensor"):
        unnorm.fold_by_plan(model, plan, probe=lambda copy: None)
    model.encoder.layer[0].attention.output.dropout.train()
    with pytest.raises(RuntimeError, match=r"encoder\.layer\.0\.attention\.output\.dropout is in "
                                           r"training mode.*model\.eval\(\)"):
        unnorm.fold_by_plan(model, plan, probe=TOKENS)
