"""Hugging Face interchange of the Llama-style decoder (plugins/lm/model.py, plugins/lm/export.py,
scripts/export_hf.py): save_pretrained -> AutoModelForCausalLM.from_pretrained rebuilds the
model, every norm's state and the placement included, with equal eval-mode logits; a
Pre-RMSNorm model saves as a stock Llama checkpoint that plain transformers loads in a process
that never imports this project; anything else asked to be stock is refused by name."""
from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoConfig, AutoModelForCausalLM

import unnorm
from plugins.checkpoints import load_checkpoint
from plugins.lm import UnnormLlamaConfig, UnnormLlamaForCausalLM, build_lm
from plugins.lm.convert import to_pre_rms
from plugins.lm.export import export_run, save_hf, stock_blockers
from plugins.lm.trainer import train
from plugins.runlog import FINISHED
from test_lm import TINY_MODEL, TINY_RECIPE, corpus_root  # noqa: F401 (a fixture)
from test_vision import ROOT, config, script_env

TINY = dict(vocab_size=61, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
            num_attention_heads=4, context=16, initializer_range=0.1)
STEPS = 3


def token_ids(batch=3, length=12, seed=0):
    return torch.randint(0, TINY["vocab_size"], (batch, length),
                         generator=torch.Generator().manual_seed(seed))


def trained(norm: dict, steps: int = STEPS, **options) -> UnnormLlamaForCausalLM:
    """A tiny model after ``steps`` AdamW updates on random tokens (every weight and every
    running statistic away from its initial value), in eval mode."""
    torch.manual_seed(0)
    model = build_lm(TINY, norm, **options).train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for step in range(steps):
        ids = token_ids(seed=step + 1)
        logits = model(input_ids=ids[:, :-1]).logits
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), ids[:, 1:].flatten())
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    return model.eval()


def logits(model, ids):
    with torch.no_grad():
        return model(input_ids=ids).logits


def assert_same_state(loaded, model):
    """Every parameter and buffer (non-persistent ones included) equal, in the same dtype."""
    for kind in ("named_parameters", "named_buffers"):
        ours, theirs = dict(getattr(model, kind)()), dict(getattr(loaded, kind)())
        assert ours.keys() == theirs.keys(), ours.keys() ^ theirs.keys()
        for name, value in ours.items():
            assert theirs[name].dtype == value.dtype, name
            assert torch.equal(theirs[name], value), name


# ---- save_pretrained -> from_pretrained -------------------------------------------------------

ROUND_TRIPS = {  # id: (norm config, build options)
    "ln-pre": ({"name": "ln"}, {}),
    "un-pre": ({"name": "un", "warmup_iters": 2, "window_size": 2}, {}),
    "un-post": ({"name": "un", "warmup_iters": 2, "window_size": 2}, {"norm_position": "post"}),
    "ln-peri": ({"name": "ln"}, {"norm_position": "peri", "embedding_norm": True}),
    "causal-bn-mix": ({"name": "bn", "causal": True}, {"norm_position": "mix",
                                                        "mix_post_fraction": 0.5}),
    "nonorm-pre": ({"name": "nonorm"}, {}),  # NoNorm's weight is a non-persistent buffer
    "dyt-pre": ({"name": "dyt"}, {}),  # DyT's LLaMA recipe: a learnable embedding scale
}


@pytest.mark.parametrize("case", ROUND_TRIPS)
def test_save_pretrained_and_auto_from_pretrained_give_the_same_model(case, tmp_path):
    norm, options = ROUND_TRIPS[case]
    model = trained(norm, **options)
    model.save_pretrained(tmp_path)
    saved = json.loads((tmp_path / "config.json").read_text())
    assert saved["model_type"] == "unnorm_llama" and saved["norm"] == norm
    assert saved["architectures"] == ["UnnormLlamaForCausalLM"]
    assert isinstance(AutoConfig.from_pretrained(tmp_path), UnnormLlamaConfig)

    loaded = AutoModelForCausalLM.from_pretrained(tmp_path)
    assert type(loaded) is UnnormLlamaForCausalLM and not loaded.training
    assert ([layer.placement for layer in loaded.model.layers]
            == [layer.placement for layer in model.model.layers])
    assert_same_state(loaded, model)
    ids = token_ids(seed=99)
    torch.testing.assert_close(logits(loaded, ids), logits(model, ids), rtol=0, atol=0)


def test_un_running_state_round_trips_after_training(tmp_path):
    """UN's running state after three updates: the step counters count them (int64), the
    running variance and the windows have moved from their initial values, and all of it is
    what from_pretrained loads."""
    norm = {"name": "un", "warmup_iters": 2, "window_size": 2}
    model = trained(norm)
    fresh = build_lm(TINY, norm)
    norms = {n: m for n, m in model.named_modules() if isinstance(m, unnorm.UnifiedNorm)}
    assert len(norms) == 2 * TINY["num_hidden_layers"] + 1
    for name, module in norms.items():
        assert module.num_iters.dtype == torch.int64 and int(module.num_iters) == STEPS, name
        initial = fresh.get_submodule(name)
        assert not torch.equal(module.running_var, initial.running_var), name
        assert not torch.equal(module.fwd_buffer, initial.fwd_buffer), name
    model.save_pretrained(tmp_path)
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path)
    for name, module in norms.items():
        theirs = loaded.get_submodule(name)
        for buffer in ("num_iters", "num_skipped", "num_rejected", "running_var", "fwd_buffer",
                       "bwd_buffer", "ema_grad"):
            ours = getattr(module, buffer)
            assert getattr(theirs, buffer).dtype == ours.dtype, (name, buffer)
            assert torch.equal(getattr(theirs, buffer), ours), (name, buffer)


def test_bfloat16_load_keeps_running_statistics_float32_and_counters_integer(tmp_path):
    """from_pretrained(dtype=bfloat16) builds the model in bf16, as .to(bfloat16) would leave
    it: weights bf16, the norms' running statistics float32 (exactly as saved) and their
    counters int64."""
    model = trained({"name": "un", "warmup_iters": 2, "window_size": 2})
    model.save_pretrained(tmp_path)
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.bfloat16)
    norm, ours = loaded.model.layers[0].input_layernorm, model.model.layers[0].input_layernorm
    assert norm.weight.dtype == loaded.lm_head.weight.dtype == torch.bfloat16
    for buffer in ("running_var", "fwd_buffer", "bwd_buffer", "ema_grad"):
        assert getattr(norm, buffer).dtype == torch.float32, buffer
        assert torch.equal(getattr(norm, buffer), getattr(ours, buffer)), buffer
    assert norm.num_iters.dtype == torch.int64 and int(norm.num_iters) == STEPS


def test_norm_state_missing_from_the_checkpoint_takes_its_built_value(tmp_path):
    """A norm buffer the folder lacks is not left uninitialised: it takes the value a new
    model's norm starts with (UN's running variance: ones; its rejected-call count: 0)."""
    model = trained({"name": "un", "warmup_iters": 2, "window_size": 2})
    model.save_pretrained(tmp_path)
    weights = load_file(tmp_path / "model.safetensors")
    site = "model.layers.1.input_layernorm"
    dropped = [f"{site}.running_var", f"{site}.num_rejected"]
    save_file({k: v for k, v in weights.items() if k not in dropped},
              tmp_path / "model.safetensors", metadata={"format": "pt"})
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path)
    norm = loaded.get_submodule(site)
    assert torch.equal(norm.running_var, torch.ones(TINY["hidden_size"]))
    assert norm.num_rejected.dtype == torch.int64 and int(norm.num_rejected) == 0
    assert torch.equal(norm.fwd_buffer, model.get_submodule(site).fwd_buffer)  # loaded


# ---- the stock Llama checkpoint ----------------------------------------------------------------

STOCK_LOADER = textwrap.dedent("""
    import sys
    import torch
    import transformers

    results = {}
    for folder in sys.argv[2:]:
        model = transformers.LlamaForCausalLM.from_pretrained(folder).eval()
        auto = transformers.AutoModelForCausalLM.from_pretrained(folder)
        with torch.no_grad():
            logits = model(input_ids=torch.load(sys.argv[1])).logits
        results[folder] = {"logits": logits, "auto": type(auto).__name__}
    results["own_modules"] = sorted(name for name in sys.modules
                                    if name.split(".")[0] in ("unnorm", "plugins"))
    torch.save(results, sys.argv[1] + ".out")
""")


def test_pre_rms_exports_as_a_stock_llama_that_plain_transformers_loads(tmp_path):
    """Pre-RMSNorm models (untied and tied head; norm eps 1e-2, not Llama's default 1e-6, so a
    lost eps shows) saved with stock=True load with transformers' own LlamaForCausalLM and
    AutoModelForCausalLM in a process that imports nothing of this project, with equal
    logits."""
    models = {"untied": trained({"name": "rms", "eps": 1e-2}),
              "tied": trained({"name": "rms", "eps": 1e-2}, tie_word_embeddings=True)}
    ids = token_ids(seed=7)
    for name, model in models.items():
        summary = save_hf(model, tmp_path / name, stock=True)
        assert summary["model_type"] == "llama"
        saved = json.loads((tmp_path / name / "config.json").read_text())
        assert saved["model_type"] == "llama" and saved["architectures"] == ["LlamaForCausalLM"]
        assert saved["rms_norm_eps"] == 1e-2 and "norm" not in saved
        assert "norm_position" not in saved and saved["tie_word_embeddings"] == (name == "tied")
    torch.save(ids, tmp_path / "ids.pt")
    folders = [str(tmp_path / name) for name in models]
    done = subprocess.run([sys.executable, "-c", STOCK_LOADER, str(tmp_path / "ids.pt"), *folders],
                          cwd=tmp_path, capture_output=True, text=True, timeout=300,
                          env=script_env())
    assert done.returncode == 0, done.stderr[-3000:]
    results = torch.load(tmp_path / "ids.pt.out")
    assert results["own_modules"] == []
    for name, model in models.items():
        result = results[str(tmp_path / name)]
        assert result["auto"] == "LlamaForCausalLM"
        torch.testing.assert_close(result["logits"], logits(model, ids))


def _converted_pre_ln():
    return to_pre_rms(build_lm(TINY, {"name": "ln"}).eval())


REFUSALS = {  # id: (model, what the refusal must name)
    "ln": (lambda: build_lm(TINY, {"name": "ln"}), ["norm=ln"]),
    "un": (lambda: build_lm(TINY, {"name": "un"}), ["norm=un"]),
    "rms-bias": (lambda: build_lm(TINY, {"name": "rms", "bias": True}), ["norm.bias=true"]),
    "rms-post": (lambda: build_lm(TINY, {"name": "rms"}, norm_position="post"),
                 ["model.norm_position=post (layers 0, 1 in post)",
                  "no final norm (model.final_norm=null: none in post placement)"]),
    "rms-mix": (lambda: build_lm(TINY, {"name": "rms"}, norm_position="mix",
                                 mix_post_fraction=0.5),
                ["model.norm_position=mix (layer 0 in post)"]),
    "rms-peri": (lambda: build_lm(TINY, {"name": "rms"}, norm_position="peri",
                                  embedding_norm=True),
                 ["model.norm_position=peri", "model.embedding_norm=true"]),
    "rms-no-final-norm": (lambda: build_lm(TINY, {"name": "rms"}, final_norm=False),
                          ["no final norm (model.final_norm=false)"]),
    "dyt": (lambda: build_lm(TINY, {"name": "dyt"}), ["norm=dyt", "DyT's LLaMA recipe"]),
    "converted-pre-ln": (_converted_pre_ln, ["norm=ln"]),
}


@pytest.mark.parametrize("case", REFUSALS)
def test_a_model_that_is_not_stock_llama_is_refused_by_name(case, tmp_path):
    build, named = REFUSALS[case]
    model = build()
    with pytest.raises(ValueError, match="not a stock Llama") as refused:
        save_hf(model, tmp_path / "out", stock=True)
    for setting in named:
        assert setting in str(refused.value), (setting, str(refused.value))
    assert not (tmp_path / "out").exists()  # refused before anything is written


def test_stock_blockers_sees_state_the_options_do_not_name():
    """A Pre-RMSNorm model given a bias Llama has no place for is not stock, whatever its
    options say."""
    model = build_lm(TINY, {"name": "rms"})
    assert stock_blockers(model) == []
    model.lm_head.bias = torch.nn.Parameter(torch.zeros(TINY["vocab_size"]))
    assert stock_blockers(model) == ["state stock Llama has no place for: lm_head.bias"]


# ---- a trained run, through scripts/export_hf.py -------------------------------------------------

def test_a_trained_run_exports_with_its_norm_state_and_tokenizer(
        corpus_root, tmp_path):  # noqa: F811 (the fixture)
    """A UN run of four updates (eight micro-batches) exported by the script: the folder
    loads with AutoModelForCausalLM holding last.pt's tensors exactly (UN's step counters at
    8), its tokenizer is the run's; a stock export is refused naming the norm, writing
    nothing."""
    from transformers import AutoTokenizer
    from tokenizers import Tokenizer

    run = tmp_path / "run"
    cfg = config("+exp=llama_71m_un", "logger=none", "device=cpu", "scale.num_workers=0",
                 f"data.root={corpus_root}", *TINY_MODEL, *TINY_RECIPE, "norm.warmup_iters=2")
    assert train(cfg, run)["status"] in FINISHED
    out = tmp_path / "hf"
    done = subprocess.run([sys.executable, "scripts/export_hf.py", str(run), "--out", str(out)],
                          cwd=ROOT, capture_output=True, text=True, timeout=300, env=script_env())
    assert done.returncode == 0, done.stderr[-3000:]
    summary = json.loads(done.stdout[done.stdout.index("{"):])
    assert summary["model_type"] == "unnorm_llama" and summary["tokenizer"] == "saved"
    assert summary["norm"] == "un" and summary["norm_position"] == "pre"

    loaded = AutoModelForCausalLM.from_pretrained(out)
    state = load_checkpoint(run / "last.pt")["model"]
    assert loaded.state_dict().keys() == state.keys()
    for key, value in state.items():
        assert loaded.state_dict()[key].dtype == value.dtype, key
        assert torch.equal(loaded.state_dict()[key], value), key
    counters = [int(v) for k, v in loaded.state_dict().items() if k.endswith("num_iters")]
    assert counters == [8] * 5

    text = "def forward(self, hidden_states):\n    return hidden_states"
    theirs = Tokenizer.from_file(str(corpus_root / "tokenizer.json"))
    tokenizer = AutoTokenizer.from_pretrained(out)
    assert tokenizer(text)["input_ids"] == theirs.encode(text).ids
    end = json.loads((corpus_root / "meta.json").read_text())["tokenizer"]["end_of_text_id"]
    assert tokenizer.eos_token_id == loaded.config.eos_token_id == end

    with pytest.raises(ValueError, match="not a stock Llama, so no stock checkpoint: norm=un"):
        export_run(run, tmp_path / "stock", stock=True)
    assert not (tmp_path / "stock").exists()
