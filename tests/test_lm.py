"""Language-modelling training end to end (plugins/lm/trainer.py) on a tiny prepared corpus:
records, gradient accumulation in micro-batches, and the future leak of batch statistics."""
from __future__ import annotations

import json
import math
from collections import Counter

import numpy as np
import pytest
import torch

from plugins.checkpoints import load_checkpoint
from plugins.lm.data import prepare_tokens
from plugins.lm.leak import future_leak
from plugins.lm.model import build_lm
from plugins.lm.trainer import train
from plugins.runlog import FINISHED
from test_lm_data import tiny_corpus, tiny_documents
from test_vision import config

TINY_MODEL = ["model.hidden_size=32", "model.intermediate_size=64", "model.num_hidden_layers=2",
              "model.num_attention_heads=2", "model.context=16"]
TINY_RECIPE = ["recipe.max_steps=4", "recipe.warmup_steps=1", "recipe.batch_size=8",
               "recipe.micro_batch_size=4", "recipe.eval_every=2", "recipe.eval_tokens=512",
               "recipe.interval_eval_tokens=256"]


@pytest.fixture(scope="module")
def corpus_root(tmp_path_factory):
    documents = tiny_documents(120, words=200)
    return prepare_tokens(tmp_path_factory.mktemp("lm"), tiny_corpus(documents), lambda: documents,
                          vocab_size=300, min_frequency=2, valid_fraction=0.2)


@pytest.mark.parametrize("norm", ["ln", "un"])
def test_a_short_run_records_what_it_trained(norm, corpus_root, tmp_path):
    """Four updates of two micro-batches: the run records validation loss over the whole set
    at the end (a part before), the corpus and tokenizer, the accumulation, and whether the
    norm's batch statistics see later tokens (UN's do, LN's do not); UN counts micro-batches."""
    cfg = config(f"+exp=llama_71m_{norm}", "logger=none", "device=cpu", "scale.num_workers=0",
                 f"data.root={corpus_root}",
                 *TINY_MODEL, *TINY_RECIPE, "norm.warmup_iters=2" if norm == "un" else "seed=0")
    result = train(cfg, tmp_path / "run")
    assert result["status"] in FINISHED and result["task"] == "language_modelling", result
    assert result["steps"] == 4 and result["accumulate"] == 2 and result["norm_position"] == "pre"
    assert result["corpus"]["tokenizer"]["vocab_size"] == 300 and result["corpus"]["name"] == "tiny"
    metrics = result["metrics"]
    assert metrics["val_tokens"] == 512 and 0 < metrics["val_loss"] < math.log(300) + 1
    epochs = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [e["val_tokens"] for e in epochs] == [256, 512] and epochs[-1]["tokens"] == 4 * 8 * 16
    assert metrics["leaks_future"] == (norm == "un") and metrics["future_logit_change"] >= 0
    assert ("val_loss_train_mode" in metrics) == (norm == "un")
    state = load_checkpoint(tmp_path / "run" / "last.pt")["model"]
    counters = [int(v) for k, v in state.items() if k.endswith("num_iters")]
    assert counters == ([8] * len(counters) if norm == "un" else [])
    assert norm == "ln" or len(counters) == 2 * 2 + 1  # two sites per layer and the final norm
    # the loss of the training tokens' add-one unigram on the 512 validation targets
    meta = json.loads((corpus_root / "meta.json").read_text())
    tokens = {split: np.concatenate([np.fromfile(corpus_root / f, dtype=meta["dtype"])
                                     for f in meta["splits"][split]["files"]])
              for split in ("train", "validation")}
    counts = Counter(tokens["train"].tolist())
    windows = [tokens["validation"][i * 16 + 1:(i + 1) * 16 + 1] for i in range(512 // 16)]
    targets = np.concatenate(windows) if len(meta["splits"]["validation"]["files"]) == 1 else None
    assert targets is not None, "the expectation reads one validation shard"
    unigram = -np.mean([math.log((counts[t] + 1) / (len(tokens["train"]) + 300)) for t in targets])
    # no better than chance: perplexity within 1.5x of that unigram model's
    assert result["chance"]["threshold"] == pytest.approx(unigram - math.log(1.5), rel=1e-9)
    assert result["status"] == ("chance" if math.exp(metrics["val_loss"]) >= math.exp(unigram) / 1.5
                                else "ok")


def test_a_run_records_the_max_attention_logit_with_qk_norm_and_z_loss(corpus_root, tmp_path):
    cfg = config("+exp=llama_71m_ln", "logger=none", "device=cpu", "scale.num_workers=0",
                 f"data.root={corpus_root}", *TINY_MODEL, *TINY_RECIPE, "model.qk_norm=ln",
                 "recipe.z_loss=1e-4")
    result = train(cfg, tmp_path / "run")
    assert result["status"] in FINISHED, result
    epochs = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    for epoch in epochs:
        per_layer = epoch["max_attn_logit_per_layer"]
        assert len(per_layer) == 2 and epoch["max_attn_logit"] == max(per_layer) > 0
    with pytest.raises(ValueError, match="recipe.z_loss"):
        train(config("+exp=llama_71m_ln", "logger=none", f"data.root={corpus_root}",
                     *TINY_MODEL, *TINY_RECIPE, "recipe.z_loss=-1"), tmp_path / "bad")


@pytest.mark.parametrize("norm", ["bn", "pn", "mabn", "prepbn", "un"])
def test_batch_statistics_see_the_future_and_per_position_norms_do_not(norm):
    """The probe changes every token after the middle one: training-mode logits before it move
    for every norm that pools statistics over positions, not for LN/RMS/DyT."""
    # PRepBN: RepBN alone from the first step, not zero-initialised (SLAB's LLaMA starts it at
    # zero, so it pools nothing before training)
    handed_over = (["norm.r0=0.0", "norm.decay_iters=10", "model.prepbn_llm_recipe=false"]
                   if norm == "prepbn" else [])
    cfg = config(f"+exp=llama_71m_{norm}", *TINY_MODEL, *handed_over)
    inputs = torch.randint(0, 300, (4, 16), generator=torch.Generator().manual_seed(0))
    assert future_leak(build_lm(cfg.model, cfg.norm, vocab_size=300), inputs)["leaks"]
    for online in ("ln", "rms", "dyt"):
        cfg = config(f"+exp=llama_71m_{online}", *TINY_MODEL)
        assert not future_leak(build_lm(cfg.model, cfg.norm, vocab_size=300), inputs)["leaks"]
    if norm in ("bn", "prepbn"):  # their causal option pools over positions <= t only
        cfg = config(f"+exp=llama_71m_{norm}", *TINY_MODEL, *handed_over, "norm.causal=true")
        assert not future_leak(build_lm(cfg.model, cfg.norm, vocab_size=300), inputs)["leaks"]


@pytest.mark.slow
def test_the_scale_path_runs_on_a_cpu_with_two_replicas_and_accumulation(corpus_root, tmp_path):
    """The GPU scale path rehearsed on a CPU, 2 gloo replicas x 2 accumulated micro-batches
    per update: amp=bf16 autocasts (its weights differ from float32's) and amp=fp16 trains
    with unnorm.GradScaler (its scale in last.pt); both train as float32 does, and UN counts
    every micro-batch alike."""
    import torch.multiprocessing as mp
    from test_vision import free_port, train_as_replica

    base = ["+exp=llama_71m_un", "logger=none", "device=cpu", "scale.num_workers=0",
            f"data.root={corpus_root}", "norm.warmup_iters=2", *TINY_MODEL, *TINY_RECIPE,
            "recipe.micro_batch_size=2"]  # 8 sequences per update: 2 replicas x 2 x 2
    runs = [([*base, f"amp={amp}"], str(tmp_path / amp)) for amp in ("false", "bf16", "fp16")]
    mp.start_processes(train_as_replica, args=(free_port(), runs, train), nprocs=2, start_method="spawn")
    results = {amp: json.loads((tmp_path / amp / "result.json").read_text())
               for amp in ("false", "bf16", "fp16")}
    for amp, result in results.items():
        assert result["status"] in FINISHED and result["world_size"] == 2, amp
        assert result["accumulate"] == 2 and result["steps"] == 4, amp
        saved = load_checkpoint(tmp_path / amp / "last.pt")
        counters = {int(v) for k, v in saved["model"].items() if k.endswith("num_iters")}
        assert counters == {8}, amp  # 4 updates x 2 micro-batches on each replica
        assert (saved["scaler"] is not None) == (amp == "fp16"), amp
        if amp != "false":
            float32 = load_checkpoint(tmp_path / "false" / "last.pt")["model"]
            assert any(not torch.equal(saved["model"][k], v) for k, v in float32.items()), \
                f"{amp}: trained exactly as float32 (no autocast)"
            want, got = results["false"]["metrics"], result["metrics"]
            assert got["val_loss"] == pytest.approx(want["val_loss"], abs=0.05), amp
    assert 0 < load_checkpoint(tmp_path / "fp16" / "last.pt")["scaler"]["scale"] < math.inf
