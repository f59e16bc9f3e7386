"""Translation through fairseq (plugins/fairseq): real fairseq 0.12.2 runs in its Python 3.10
environment on the synthetic corpus, driven as users drive it. Needs ``.venv-fairseq``, which
``make test`` creates; skipped only where this machine has no Python 3.10 to make it from.
Checks that need fairseq itself run in that environment (tests/fairseq_checks.py)."""
from __future__ import annotations

import glob
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from hydra import compose, initialize_config_dir

import unnorm
from analysis.gns import run_gns
from plugins.checkpoints import UnsafeCheckpoint
from plugins.fairseq import launcher, synthetic
from plugins.fairseq.data import binarised_files, prepare
from plugins.fairseq.flags import NOT_IN_FAIRSEQ, OPTIONS, norm_flags, read_trained, trained_line
from plugins.norms import norm_kwargs
from plugins.runlog import FINISHED
from plugins.scale import effective_config
from test_vision import script_env

# one worker runs the module: its fixtures (shared runs) are made once
pytestmark = pytest.mark.xdist_group("fairseq")

ROOT = Path(__file__).resolve().parents[1]
ENV = Path(os.environ.get("UNNORM_FAIRSEQ_ENV") or ROOT / ".venv-fairseq")
META = {"task", "exp", "model", "data", "exp_data", "norm", "norm_options", "seed", "scale",
        "overrides", "steps", "run_dir"}


def config(*overrides):
    with initialize_config_dir(str(ROOT / "configs"), version_base="1.3"):
        return compose("train", overrides=list(overrides))


def _python310():
    candidates = sorted(glob.glob(os.path.expanduser("~/.pyenv/versions/3.10*/bin/python3.10")))
    for candidate in candidates + [shutil.which("python3.10")]:
        if candidate and subprocess.run([candidate, "-c", "import sys; assert sys.version_info[:2] == (3, 10)"],
                                        capture_output=True).returncode == 0:
            return candidate
    return None


@pytest.fixture(scope="session")
def fairseq_env() -> Path:
    if (ENV / "bin" / "fairseq-train").exists():
        return ENV
    if _python310() is None:
        pytest.skip("fairseq 0.12.2 needs Python 3.10 and this machine has none: install one "
                    "(pyenv install 3.10, apt install python3.10, or conda), then `make fairseq-env`")
    pytest.fail(f"no fairseq environment at {ENV}: run `make fairseq-env` (`make test` does)")


@pytest.fixture(scope="session")
def synthetic_data(fairseq_env, tmp_path_factory) -> Path:
    """The synthetic corpus, prepared once; every run of this module reads it."""
    root = tmp_path_factory.mktemp("data") / "synthetic_mt"
    previous = os.environ.get("SYNTHETIC_MT_DATA")
    os.environ["SYNTHETIC_MT_DATA"] = str(root)
    yield prepare(effective_config(config("+exp=iwslt14_ln", "scale=cpu")).data, fairseq_env)
    if previous is None:
        del os.environ["SYNTHETIC_MT_DATA"]
    else:
        os.environ["SYNTHETIC_MT_DATA"] = previous


def fairseq_python(*args, timeout=300):
    result = subprocess.run([str(ENV / "bin" / "python"), *args], cwd=ROOT, capture_output=True,
                            text=True, timeout=timeout,
                            env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)})
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return json.loads(result.stdout[result.stdout.index("{"):])


def update_losses(log: str) -> dict[int, tuple]:
    """Per-update (loss, nll_loss, gnorm) from fairseq's JSON log at --log-interval 1."""
    losses = {}
    for record in re.findall(r"\| train_inner \| (\{.*\})", log):
        stats = json.loads(record)
        losses[int(stats["num_updates"])] = (stats["loss"], stats["nll_loss"], stats["gnorm"])
    return losses


# ---- without fairseq: options, configs, corpus, error messages --------------------------------

def test_a_flag_for_every_norm_option():
    every_option = set().union(*(unnorm.option_names(name) for name in unnorm.available_norms()))
    assert set(OPTIONS) | set(NOT_IN_FAIRSEQ) == every_option
    assert norm_flags("bn", {"causal": False}) == ["--norm-type", "bn"]
    assert norm_flags("bcn", {"layout": "token", "groups": 8}) == ["--norm-type", "bcn",
                                                                   "--un-groups", "8"]
    with pytest.raises(ValueError, match=r"norm.layout=image .*time-first \(T, B, C\)"):
        norm_flags("evonorm_s0", {"layout": "image"})
    with pytest.raises(ValueError, match=r"norm.causal=True .*time-first \(T, B, C\).*llama_71m"):
        norm_flags("bn", {"causal": True})
    assert norm_flags("un", {"window_size": 4, "warmup_iters": 4000, "outlier_filtration": False,
                             "outlier_threshold": None}) == [
        "--norm-type", "un", "--un-window", "4", "--un-warmup", "4000",
        "--un-outlier-filtration", "false"]
    with pytest.raises(ValueError, match="no fairseq flag"):
        norm_flags("un", {"window": 4})


class _Env:
    def bin(self, name):
        return name

    def module(self, name):
        return ["python", "-m", name]


def test_experiments_give_the_papers_fairseq_commands(tmp_path):
    for data in ("iwslt14", "wmt14"):
        for norm in unnorm.available_norms():
            cfg = config(f"+exp={data}_{norm}")
            assert cfg.task == "translation" and cfg.norm.name == norm and cfg.data.name == data
    cfg = config("+exp=iwslt14_un", "seed=3")
    command = " ".join(launcher.train_command(cfg, _Env(), tmp_path, tmp_path / "checkpoints"))
    for part in ["--arch unnorm_transformer_iwslt_de_en", "--encoder-normalize-before",
                 "--decoder-normalize-before", "--share-all-embeddings", "--optimizer adam",
                 "--adam-betas (0.9,0.98)", "--lr 0.0007", "--lr-scheduler inverse_sqrt",
                 "--warmup-init-lr 1e-07", "--warmup-updates 6000", "--dropout 0.3",
                 "--attention-dropout 0.1", "--activation-dropout 0.1", "--weight-decay 0.0001",
                 "--criterion label_smoothed_cross_entropy", "--label-smoothing 0.1",
                 "--max-tokens 4096", "--max-update 100000", "--keep-last-epochs 10",
                 "--norm-type un", "--un-window 4", "--un-warmup 4000",
                 "--un-outlier-filtration false", "--seed 3", "--log-format json"]:
        assert part in command, part
    assert cfg.recipe.average_last == 10 and cfg.recipe.generate.beam == 5 and cfg.recipe.generate.remove_bpe
    wmt = config("+exp=wmt14_ln")
    assert wmt.recipe.average_last == 5 and wmt.data.source_lang == "en" and wmt.data.target_lang == "fr"
    assert "--arch unnorm_transformer_wmt_en_fr" in " ".join(launcher.train_command(wmt, _Env(), tmp_path, tmp_path))
    small = effective_config(config("+exp=iwslt14_un", "scale=cpu"))
    assert small.data.name == "synthetic_mt" and small.model.arch == "unnorm_transformer_tiny"
    # the norms' step counts shrink with the learning-rate warm-up (6000 -> 100 updates)
    assert small.norm.warmup_iters == round(4000 * 100 / 6000) and small.norm.outlier_filtration is False
    assert "--norm-pad-mask false" in " ".join(launcher.train_command(small, _Env(), tmp_path, tmp_path))
    # placement: fairseq's layer option (normalize_before); peri and mix are refused with the fix
    post = launcher.train_command(config("+exp=iwslt14_un", "model.norm_position=post"), _Env(),
                                  tmp_path, tmp_path)
    assert "--encoder-normalize-before" not in post and "--decoder-normalize-before" not in post
    with pytest.raises(ValueError, match="pre or post.*language-modelling"):
        launcher.train_command(config("+exp=iwslt14_un", "model.norm_position=peri"), _Env(),
                               tmp_path, tmp_path)


def test_the_normalizer_free_baseline_gives_its_fairseq_flags(tmp_path):
    """ws=nf and recipe.agc reach fairseq as the model's flags (plugins.fairseq.train applies
    --agc); a plain pattern list too, and nothing when weight_standardization is null."""
    cfg = config("+exp=iwslt14_nonorm", "ws=nf", "recipe.agc=0.01")
    command = " ".join(launcher.train_command(cfg, _Env(), tmp_path, tmp_path / "checkpoints"))
    assert ("--weight-standardization encoder.layers.* decoder.layers.* --ws-eps 1e-06 "
            "--ws-eps-form scaled --ws-gamma 1.0 --agc 0.01") in command
    assert command.startswith("python -m plugins.fairseq.train")
    plain = config("+exp=wmt14_ln", "model.weight_standardization=[encoder.layers.*.fc1]")
    command = launcher.train_command(plain, _Env(), tmp_path, tmp_path)
    assert command[command.index("--weight-standardization") + 1] == "encoder.layers.*.fc1"
    assert "--ws-eps-form" not in command and "--agc" not in command
    stock = launcher.train_command(config("+exp=iwslt14_ln"), _Env(), tmp_path, tmp_path)
    assert "--weight-standardization" not in stock and "--agc" not in stock


def test_adaptive_clipping_under_fairseqs_fp16_is_refused_before_anything_runs(gpus):
    gpus(1)
    with pytest.raises(ValueError, match=re.escape("set amp=false to train in float32")):
        launcher.run_config(config("+exp=iwslt14_nonorm", "ws=nf", "recipe.agc=0.01"))
    launcher.run_config(config("+exp=iwslt14_nonorm", "ws=nf", "recipe.agc=0.01", "amp=false"))


@pytest.fixture
def gpus(monkeypatch):
    """Pretend this machine has ``gpus(n)`` CUDA devices (the launcher only asks)."""
    def pretend(count: int):
        monkeypatch.setattr(torch.cuda, "is_available", lambda: count > 0)
        monkeypatch.setattr(torch.cuda, "device_count", lambda: count)
    return pretend


@pytest.mark.parametrize("overrides, error, fix", [
    (["compile=true"], ValueError, "drop it for translation"),
    (["record_statistics=true"], ValueError, "drop it for translation"),
    (["scale.max_steps_per_epoch=5"], ValueError, "recipe.train.max_update"),
    (["reset_norm_steps=true"], ValueError, "set init_from="),
    (["recipe.agc=0.01", "recipe.train.clip_norm=0.1"], ValueError,
     "recipe.train.clip_norm=0.0 for adaptive clipping"),
    (["+recipe.train.fp16=true"], ValueError, "set amp=false"),
    (["amp=false", "+recipe.train.bf16=true"], ValueError, "implies --tpu"),
    (["amp=bf16"], ValueError, "amp=bf16: fairseq 0.12.2's --bf16 implies --tpu"),
    (["amp=fp16"], ValueError, "amp=fp16: fairseq trains in fp16 on CUDA only; on a CPU use amp=auto"),
    (["amp=true"], ValueError, "amp=True: choose amp=auto"),
    (["device=cuda"], RuntimeError, "use device=cpu"),
])
def test_settings_translation_cannot_honour_are_refused(overrides, error, fix, gpus, tmp_path,
                                                         monkeypatch):
    """Refused before anything runs (no fairseq environment needed), naming the fix."""
    gpus(0)
    monkeypatch.setenv("UNNORM_FAIRSEQ_ENV", str(tmp_path / "none"))
    with pytest.raises(error, match=re.escape(fix)):
        launcher.train(config("+exp=iwslt14_un", "scale=cpu", *overrides), tmp_path / "run", overrides)
    assert not (tmp_path / "run").exists()


def test_amp_trains_in_half_precision_on_cuda_only(gpus, tmp_path):
    """amp=auto (the default): fairseq's --fp16 on a GPU (its loss scaler, which
    plugins.fairseq.train keeps from the norms); on CPU nothing, as
    plugins.precision.amp_context. Training runs through plugins.fairseq.train."""
    def command(*overrides):
        cfg, device, _ = launcher.run_config(config("+exp=iwslt14_un", *overrides))
        return launcher.train_command(cfg, _Env(), tmp_path, tmp_path / "checkpoints", device)

    gpus(0)
    on_cpu = command()
    assert on_cpu[:3] == ["python", "-m", "plugins.fairseq.train"]
    assert not set(on_cpu) & {"--fp16", "--bf16", "--amp"} and on_cpu[-3:] == ["--cpu", "--distributed-world-size", "1"]
    gpus(1)
    assert "--fp16" in command() and "--cpu" not in command()
    assert "--fp16" in command("amp=fp16")
    assert not set(command("amp=false")) & {"--fp16", "--bf16", "--amp"}
    assert "--amp" in command("amp=false", "+recipe.train.amp=true")


def test_update_freq_keeps_the_tokens_of_an_update_on_any_number_of_gpus(gpus):
    """WMT14's update is 4096 tokens x 16 micro-batches x 8 GPUs: update_freq follows the GPUs
    fairseq trains on; IWSLT14's is one micro-batch (the release's single GPU). An
    update_freq set on the command line is kept."""
    def update_freq(exp, *overrides):
        cfg, _, world = launcher.run_config(config(f"+exp={exp}", *overrides), overrides)
        return cfg.recipe.train.update_freq, world

    for count, expected in ((8, 16), (4, 32), (1, 128)):
        gpus(count)
        assert update_freq("wmt14_un") == (expected, count)
    gpus(0)
    assert update_freq("wmt14_un") == (128, 1) and update_freq("iwslt14_un") == (1, 1)
    assert update_freq("wmt14_un", "scale=cpu") == (1, 1)
    gpus(3)
    with pytest.raises(ValueError, match="3 GPUs cannot share evenly"):
        update_freq("wmt14_un")
    assert update_freq("wmt14_un", "recipe.train.update_freq=5") == (5, 3)
    gpus(2)
    with pytest.raises(ValueError, match="set recipe.train.update_freq"):
        update_freq("iwslt14_un")
    assert update_freq("iwslt14_un", "+recipe.train.distributed_world_size=1") == (1, 1)


def test_run_length_options_count_micro_batches(gpus):
    """PRepBN's hand-over ends at 80% of the run in norm steps (micro-batches): 0.8 x
    max_update x update_freq, with update_freq as the GPUs make it."""
    for count, update_freq in ((8, 16), (2, 64)):
        gpus(count)
        cfg, _, _ = launcher.run_config(config("+exp=wmt14_prepbn"))
        assert cfg.recipe.train.update_freq == update_freq
        assert cfg.norm.decay_iters == round(0.8 * 50000 * update_freq)
    gpus(0)
    cfg, _, _ = launcher.run_config(config("+exp=iwslt14_prepbn", "scale=cpu", "recipe.train.update_freq=3"),
                                    ["recipe.train.update_freq=3"])
    assert cfg.recipe.train.update_freq == 3 and cfg.norm.decay_iters == round(0.8 * 336 * 3)


def test_synthetic_corpus_has_agreement_and_reordering():
    splits = synthetic.generate(500, 50, 50, seed=7)
    assert splits == synthetic.generate(500, 50, 50, seed=7) != synthetic.generate(500, 50, 50, seed=8)
    sources = [{source for source, _ in splits[name]} for name in ("train", "valid", "test")]
    assert sum(map(len, sources)) == 600 == len(set().union(*sources))  # distinct, disjoint
    participles = {v[1]: v[3] for v in synthetic.VERBS}
    presents = {v[0]: v[2] for v in synthetic.VERBS}
    for source, target in splits["train"]:
        words, english = source.split(), target.split()
        if words[:4] == ["ich", "glaube", ",", "dass"]:   # verb-final -> SVO
            assert english[:3] == ["i", "think", "that"] and presents[words[-1]] in english
        elif words[-1] in participles:                    # participle last -> "has <participle>"
            assert participles[words[-1]] == english[english.index("has") + 1]
        for article, following in zip(english, english[1:]):
            if article in ("a", "an"):
                assert article == ("an" if following[0] in "aeiou" else "a")
    assert any(word == "den" for source, _ in splits["train"] for word in source.split())


def test_missing_environment_or_data_names_the_fix(tmp_path, monkeypatch):
    monkeypatch.setenv("UNNORM_FAIRSEQ_ENV", str(tmp_path / "none"))
    with pytest.raises(FileNotFoundError, match="make fairseq-env"):
        launcher.FairseqEnv()
    iwslt = config("+exp=iwslt14_un", f"data.root={tmp_path}").data
    with pytest.raises(FileNotFoundError, match="prepare_iwslt14.sh"):
        prepare(iwslt, tmp_path / "none")


def test_the_synthetic_corpus_is_checked_against_its_manifest(tmp_path):
    """The generated corpus (here its files, as bpe_binarize.sh leaves them) is opened only
    if it is what its manifest records; a changed file is refused naming the rebuild."""
    from plugins.generated import write_manifest
    synthetic = config("+exp=iwslt14_un", "scale=cpu")
    data = effective_config(synthetic).data
    root = tmp_path / "synthetic_mt"
    root.mkdir()
    for path in binarised_files(root, data.source_lang, data.target_lang):
        path.write_bytes(path.name.encode() * 10)
    write_manifest(root)
    data.root = str(root)
    assert prepare(data, tmp_path / "no_env_needed") == root.resolve()
    damaged = binarised_files(root, data.source_lang, data.target_lang)[3]
    damaged.write_bytes(damaged.read_bytes()[::-1])
    with pytest.raises(ValueError, match=rf"{damaged.resolve()} does not hash to the sha256 "
                                         rf"manifest.json records.*rm -r {root.resolve()}"):
        prepare(data, tmp_path / "no_env_needed")


# ---- with fairseq --------------------------------------------------------------------------

@pytest.fixture(scope="module")
def learned(synthetic_data, tmp_path_factory) -> dict:
    """The CPU-scale run of UN (through the launcher, as scripts/train.py calls it). LN's
    training is stock fairseq's, update for update (``test_ln_is_the_stock_transformer``)."""
    runs = {}
    for norm in ("un",):
        out = tmp_path_factory.mktemp(norm) / "run"
        overrides = ["scale=cpu", "device=cpu", "logger=none"]
        runs[norm] = launcher.train(config(f"+exp=iwslt14_{norm}", *overrides), out, overrides)
    return runs


@pytest.mark.slow
@pytest.mark.parametrize("norm", ["un"])
def test_a_few_hundred_updates_learn_to_translate(norm, learned, synthetic_data):
    result = learned[norm]
    assert result["status"] in FINISHED and set(META) <= set(result), result
    assert result["task"] == "translation" and result["norm"] == norm and result["scale"] == "cpu"
    assert result["data"] == "synthetic_mt" and result["exp_data"] == "iwslt14"
    assert 200 <= result["steps"] <= 500 and result["metrics"]["num_updates"] == result["steps"]
    copy = subprocess.run([str(ENV / "bin" / "sacrebleu"), str(synthetic_data / "tok" / "test.en"),
                           "-i", str(synthetic_data / "tok" / "test.de"), "-b"],
                          capture_output=True, text=True, check=True)
    copy_bleu = float(copy.stdout.strip())
    metrics = result["metrics"]
    assert metrics["bleu"] > copy_bleu + 40 and metrics["bleu_tokenized"] > copy_bleu + 40, (metrics, copy_bleu)
    assert metrics["valid_loss"] < 4 and metrics["train_loss"] < 4
    run = Path(result["run_dir"])
    assert json.loads((run / "result.json").read_text())["metrics"] == metrics
    assert (run / "checkpoints" / "checkpoint_avg3.pt").exists()
    assert len((run / "test.hyp").read_text().splitlines()) == 300


def test_ln_is_the_stock_transformer(synthetic_data, tmp_path):
    """--norm-type ln reproduces stock transformer_iwslt_de_en (pre-norm): every update's loss,
    and bitwise the weights after 40 updates with dropout on."""
    common = [str(synthetic_data), "--user-dir", str(launcher.USER_DIR), "--task", "translation",
              "--encoder-normalize-before", "--decoder-normalize-before", "--encoder-layers", "2",
              "--decoder-layers", "2", "--encoder-embed-dim", "64", "--decoder-embed-dim", "64",
              "--encoder-ffn-embed-dim", "128", "--decoder-ffn-embed-dim", "128",
              "--share-all-embeddings", "--optimizer", "adam", "--adam-betas", "(0.9,0.98)",
              "--lr", "2e-3", "--lr-scheduler", "inverse_sqrt", "--warmup-updates", "20",
              "--dropout", "0.3", "--attention-dropout", "0.1", "--activation-dropout", "0.1",
              "--weight-decay", "1e-4", "--criterion", "label_smoothed_cross_entropy",
              "--label-smoothing", "0.1", "--max-tokens", "1024", "--max-update", "40",
              "--log-format", "json", "--log-interval", "1", "--cpu", "--num-workers", "0",
              "--seed", "3", "--no-epoch-checkpoints"]
    losses = {}
    for name, arch in (("stock", ["--arch", "transformer_iwslt_de_en"]),
                       ("ours", ["--arch", "unnorm_transformer_iwslt_de_en", "--norm-type", "ln"])):
        done = subprocess.run([str(ENV / "bin" / "fairseq-train"), *common, *arch,
                               "--save-dir", str(tmp_path / name)], capture_output=True, text=True,
                              env={**os.environ, "OMP_NUM_THREADS": "1"})
        assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
        losses[name] = update_losses(done.stdout + done.stderr)
    assert len(losses["stock"]) == 40 and losses["stock"] == losses["ours"]
    same = fairseq_python("tests/fairseq_checks.py", "same-weights",
                          str(tmp_path / "stock" / "checkpoint_last.pt"),
                          str(tmp_path / "ours" / "checkpoint_last.pt"))
    assert same["identical"] and same["tensors"] > 100


def test_the_normalizer_free_baseline_in_fairseq(synthetic_data):
    """Scaled WS on every encoder and decoder layer with no norm: the model computes what a
    copy with the standardised weights baked into plain layers computes, which fairseq's fast
    self-attention path reads directly (allowed again, that path reads the raw weights: the
    control); fairseq's optimizer steps with timm's adaptive clipping of the gradients its
    clipping received, and fairseq's logged norm stays the unclipped one; without --agc
    nothing is clipped (the control); the settings it cannot honour are refused by name."""
    summary = fairseq_python("tests/fairseq_checks.py", "nf", str(synthetic_data))
    # 2+2 layers: 6 projections in an encoder layer, 10 in a decoder layer
    assert summary["standardized"] == 2 * 6 + 2 * 10
    assert summary["calling"] == summary["attentions"] == 2 + 2 * 2
    # float32 rounding of the same sums in two orders (fused and unfused attention): at most
    # about u * K per layer (u = 6e-8, K <= 256 terms per product), 4 layers: ~6e-5
    assert summary["vs_baked"] < 1e-4
    assert summary["fast_path_control"] > 0.01
    clipped = summary["agc=0.01"]
    assert clipped["updates"] == 2 and clipped["clipped"] > 0
    assert max(clipped["vs_timm"]) == 0.0  # the same function on the same tensors
    # fairseq's float32 norm of per-tensor norms against float64: blocked sums of 3.5e5 squares
    # round to about u * log2(3.5e5) ~ 1e-6
    assert max(clipped["grad_norm_vs_unclipped"]) < 1e-5
    control = summary["agc=None"]
    assert control["clipped"] == 0 and min(control["vs_timm"]) > 0.01
    # the trainer's record at the start: each Scaled WS layer standardises its output units'
    # weights, so scaling one unit's raw weights changes nothing (a closed form)
    invariant = summary["scale_invariant"]
    assert invariant["counts"]["row"] == summary["standardized"] and invariant["examples"] == 12
    assert all(name.startswith(("encoder.layers.", "decoder.layers.")) for name in invariant["row"])
    refusals = summary["refusals"]
    assert "set --clip-norm 0" in refusals["clip_norm"]
    assert "train in float32" in refusals["fp16"] and "must be positive" in refusals["zero"]


def test_the_trainer_records_each_epochs_updates(synthetic_data):
    """--record-updates (record_updates=true) in plugins.fairseq.train, two updates of the
    tiny model with Scaled WS on every stack layer: the epoch's record in fairseq's train
    statistics holds the mean over its updates of ||w_after - w_before|| / ||w_before||, each
    computed from copies of every trainable weight around the update (fairseq's one param
    group); the release's AdamP projects, at least the 32 standardised (row-invariant) layers
    per update, fairseq's adam never; refused, naming the fix, with fully sharded weights."""
    summary = fairseq_python("tests/fairseq_checks.py", "updates", str(synthetic_data))
    for name in ("adamp", "adam"):
        trained = summary[name]
        record = trained["record"]
        assert trained["updates"] == 2 and record["param_groups"] == [
            {"weight_decay": 0.0, "parameters": trained["parameters"]}]
        # the record's norms are float32 sums of each tensor's squares: 2e-6 of them seen here
        assert record["effective_step"] == [pytest.approx(sum(trained["steps"]) / 2, rel=2e-5)]
    projected = summary["adamp"]["record"]["projection"]
    assert projected["tensors"] >= 2 * 6 + 2 * 10 and projected["channels"] > 0
    assert summary["adam"]["record"]["projection"] == {"tensors": 0, "channel_view": 0,
                                                       "tensor_view": 0, "channels": 0}
    assert "drop --record-updates (record_updates=false)" in summary["fully_sharded"]


def test_the_trainer_records_the_landscape_and_trains_as_without(synthetic_data):
    """--record-landscape 1 (record_landscape=1) in plugins.fairseq.train: three updates of
    the tiny model with UN and dropout train bit for bit as without it (weights, every
    buffer, losses), with a row per update at fairseq's rate; refused, by backend and reason,
    under --fp16, with --sam and without a run directory."""
    summary = fairseq_python("tests/fairseq_checks.py", "landscape", str(synthetic_data))
    assert summary["same_state"] and summary["same_losses"]
    rows = summary["rows"]
    assert [row["step"] for row in rows] == [0, 1, 2]
    assert all(len(row["losses"]) == 8 and row["grad_norm"] > 0 and row["lr"] > 0 for row in rows)
    refusals = summary["refusals"]
    assert all("not available in the fairseq backend" in refusals[name] for name in refusals)
    assert "--fp16" in refusals["fp16"] and "--sam" in refusals["sam"]
    assert "--landscape-dir" in refusals["no_dir"]


def test_each_epoch_row_of_a_translation_run_holds_its_updates(learned):
    """record_updates=true (the default) through the launcher: fairseq's log carries each
    epoch's record, which becomes that epoch's ``kind: train`` row of metrics.jsonl, with one
    param group of every trainable parameter (as the trainer reports it), a step of a
    fraction of the weights, and no projection (fairseq's adam); the validation rows have none."""
    result = learned["un"]
    run = Path(result["run_dir"])
    assert "--record-updates" in (run / "train_command.txt").read_text().split()
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    epochs = [row for row in rows if row["kind"] == "train"]
    assert len(epochs) == result["metrics"]["epoch"] >= 2
    for row in epochs:
        assert row["param_groups"] == [{"weight_decay": pytest.approx(1e-4),
                                        "parameters": result["trainable_parameters"]}]
        assert 0 < row["effective_step"][0] < 0.1 and len(row["effective_step"]) == 1
        assert set(row["projection"].values()) == {0}
    assert all("effective_step" not in row for row in rows if row["kind"] == "valid")


@pytest.mark.slow
def test_a_normalizer_free_translation_run(synthetic_data, tmp_path):
    """ws=nf with recipe.agc and norm=nonorm through the launcher, as scripts/train.py runs it:
    fairseq trains it (a short run: that it runs, not what it learns), and result.json holds
    the scale-invariance record."""
    overrides = ["scale=cpu", "device=cpu", "logger=none", "ws=nf", "recipe.agc=0.01",
                 "recipe.train.max_update=84", "recipe.train.max_epoch=2", "recipe.average_last=2"]
    result = launcher.train(config("+exp=iwslt14_nonorm", *overrides), tmp_path / "run", overrides)
    assert result["status"] in FINISHED and result["steps"] == 84, result  # 2 epochs of 42
    assert "--agc 0.01" in (tmp_path / "run" / "train_command.txt").read_text()
    assert result["scale_invariant"]["counts"]["row"] == 2 * 6 + 2 * 10  # as the check above


def test_padding_is_excluded_from_every_norm(synthetic_data):
    """Through the whole model, for every norm, over training steps and in eval: more padding,
    or noise at pad positions, changes no output at valid positions (see fairseq_checks.py)."""
    summary = fairseq_python("tests/fairseq_checks.py", "padding", str(synthetic_data))
    assert set(unnorm.available_norms()) <= set(summary)
    assert summary["bn_without_masks"] > 1e-3  # the check would see leaking padding


# norms with running state, and those among them without a step counter
STATEFUL = [name for name in unnorm.available_norms() if unnorm.has_running_state(name)]
UNCOUNTED = [name for name in STATEFUL
             if not isinstance(unnorm.build_norm(name, 8), unnorm.StepCounted)]


def test_half_precision_keeps_float32_statistics_and_follows_float32(synthetic_data):
    """Each norm with running state in the plugin's model, cast as fairseq's --fp16 / --bf16
    cast it: statistics buffers stay float32 (UN and MABN crashed, PN, BN and PRepBN kept
    half-precision EMAs), and four training steps and eval follow the float32 model to the
    cast's rounding (the gradient statistics, means of g * z, to a few percent)."""
    summary = fairseq_python("tests/fairseq_checks.py", "precision", str(synthetic_data))
    for norm in STATEFUL:
        for dtype, outputs, statistics in (("float16", 5e-3, 3e-2), ("bfloat16", 2e-2, 5e-2)):
            result = summary[f"{norm}/{dtype}"]
            assert result["buffer_dtypes"] == ["float32"], (norm, dtype, result)
            assert result["buffers"] < statistics, (norm, dtype, result)
            assert result["train"] < outputs, (norm, dtype, result)
            # RepBN's eval adds alpha * x to BN's output: the residual stream grows tenfold
            # over the layers, and its rounding with it
            assert result["eval"] < (10 * outputs if norm == "prepbn" else outputs), (norm, dtype, result)
            assert result["steps"] == (None if norm in UNCOUNTED else 4), (norm, result)


def test_separate_class_norms_refuses_fairseqs_time_first_layers(synthetic_data):
    summary = fairseq_python("tests/fairseq_checks.py", "sepnorm", str(synthetic_data))
    assert "fairseq's layers pass time-first (T, B, C)" in summary["refused"]
    assert summary["wrapped"] == 0


def test_pn_ls_groups_by_the_attention_heads_of_its_block(synthetic_data):
    """group_num unset (configs/norm/pn_ls.yaml: null): each norm's layer-scale has as many
    groups as its block has attention heads (encoder 4, decoder 2 here), as PowerNorm's
    release; --un-group-num forces one value."""
    for data in ("iwslt14", "wmt14"):
        cfg = config(f"+exp={data}_pn_ls")
        assert cfg.norm.group_num is None and "--un-group-num" not in norm_flags("pn_ls", norm_kwargs(cfg.norm))
    summary = fairseq_python("tests/fairseq_checks.py", "groups", str(synthetic_data))
    unset = summary["unset"]
    assert len(unset) == 2 * 2 + 3 * 2 + 2  # layers' norms and the stacks' final norms
    assert unset == {name: 4 if name.startswith("encoder") else 2 for name in unset}
    assert set(summary["set_to_1"].values()) == {1}


def test_a_skipped_fp16_update_leaves_every_norm_as_it_was(synthetic_data):
    """fairseq's --fp16 trainer (plugins.fairseq.train) skips an update whose head weight's
    gradient overflowed (the inf reaches no norm): every norm's buffers come out of it
    exactly as they went in. The controls (UN, PRepBN: the norms as the update left them,
    what fairseq-train did) show that the update changed them; fairseq-train itself now
    refuses to train the plugin's model under --fp16."""
    summary = fairseq_python("tests/fairseq_checks.py", "skipped-update", str(synthetic_data))
    assert "train with `python -m plugins.fairseq.train`" in summary["fairseq_train"]
    for norm in STATEFUL:
        guarded = summary[f"{norm}/guarded"]
        assert guarded["updates"] == 3, (norm, guarded)  # fairseq skipped the 4th
        assert guarded["scale"] == [64, 32]  # and its scaler backed off
        assert guarded["steps_before"] == (None if norm in UNCOUNTED else 3)
        assert guarded["unchanged"], (norm, guarded)
    for norm in ("un", "prepbn"):
        control = summary[f"{norm}/control"]
        assert control["updates"] == 3 and not control["unchanged"], (norm, control)


def test_fairseqs_loss_scale_does_not_reach_the_norms(synthetic_data):
    """UN, MABN and PN trained under --fp16 from loss scales 4 and 512, two micro-batches per
    update: their gradient statistics agree (kept in unscaled units) to fp16's rounding of
    the gradients; the control, UN told no scale, is 128x apart. The norms count
    micro-batches: 6 steps in 3 updates."""
    summary = fairseq_python("tests/fairseq_checks.py", "loss-scale", str(synthetic_data))
    for norm in ("un", "mabn", "pn"):
        guarded = summary[f"{norm}/guarded"]
        assert guarded["difference"] < 5e-2, (norm, guarded)
        assert guarded["updates"] == 3 and guarded["steps"] == 6, (norm, guarded)
    assert summary["un/control"]["difference"] > 100  # psi in scaled units: 128x apart


def test_a_checkpoint_that_would_run_code_is_refused_as_init_from(synthetic_data, tmp_path):
    """init_from= a file whose pickle runs a command: refused, naming the file and the
    opt-in, before fairseq (whose torch.load would run it) sees it."""
    marker = tmp_path / "ran"
    evil = tmp_path / "evil.pt"
    torch.save({"model": {}, "payload": _RunsCommand(f"touch {marker}")}, evil)
    torch.load(evil, weights_only=False)
    assert marker.exists()  # the payload is live
    marker.unlink()
    overrides = ["+exp=iwslt14_un", "scale=cpu", "device=cpu", "logger=none", f"init_from={evil}"]
    with pytest.raises(UnsafeCheckpoint, match=rf"init_from: {re.escape(str(evil))} .*trust_checkpoint=true"):
        launcher.train(config(*overrides), tmp_path / "run", overrides)
    assert not marker.exists() and not (tmp_path / "run" / "train.log").exists()


class _RunsCommand:
    def __init__(self, command):
        self.command = command

    def __reduce__(self):
        return os.system, (self.command,)


def test_fine_tuning_from_a_translation_run(learned, tmp_path, monkeypatch):
    """init_from= the UN run's checkpoint with reset_norm_steps=true and two micro-batches per
    update: training starts from its weights (the first loss is the trained model's), the
    norms' counters restart and count micro-batches (2 per update), and the run's logger
    receives fairseq's records."""
    logged = []

    class Recorder:
        def log(self, metrics, step):
            logged.append((step, metrics))

        def finish(self):
            pass

    monkeypatch.setattr(launcher, "run_logger", lambda *args, **kwargs: Recorder())
    source = Path(learned["un"]["run_dir"]) / "checkpoints" / "checkpoint_last.pt"
    overrides = ["+exp=iwslt14_un", "scale=cpu", "device=cpu", f"init_from={source}",
                 "reset_norm_steps=true", "recipe.train.update_freq=2", "recipe.train.max_epoch=1",
                 "recipe.average_last=1"]
    result = launcher.train(config(*overrides), tmp_path / "run", overrides)
    assert result["status"] in FINISHED and result["update_freq"] == 2 and result["init"] == str(source)
    assert result["steps"] == 21  # one epoch: 42 micro-batches
    state = fairseq_python("tests/fairseq_checks.py", "norm-state",
                           str(tmp_path / "run" / "checkpoints" / "checkpoint_last.pt"))
    assert state["num_iters"] == [2 * result["steps"]]  # not 336 + 42: the counters restarted
    scratch = update_losses((Path(learned["un"]["run_dir"]) / "train.log").read_text())
    tuned = update_losses((tmp_path / "run" / "train.log").read_text())
    first, untrained, trained = float(tuned[1][0]), float(scratch[1][0]), float(scratch[max(scratch)][0])
    assert first < untrained - 3 and first < trained + 0.5
    inner = {step: metrics for step, metrics in logged if "train_inner/loss" in metrics}
    assert sorted(inner) == list(range(1, 22)) and inner[1]["train_inner/loss"] == first
    valid = [metrics for _, metrics in logged if "valid_loss" in metrics]
    assert valid[-1]["valid_loss"] == result["metrics"]["valid_loss"]


@pytest.mark.slow
def test_resume_after_kill_continues_from_fairseqs_checkpoint(learned, tmp_path):
    """Killed after epoch 2, resumed with resume=<run dir>: fairseq restores checkpoint_last.pt
    and every later update's loss equals the uninterrupted run's (the UN run of ``learned``,
    whose first 3 epochs this shortened run repeats: nothing in them depends on the run's
    length). The default logger, wandb offline, logs both parts into one wandb run in the run
    directory."""
    epochs = 3
    args = [sys.executable, "scripts/train.py", "+exp=iwslt14_un", "scale=cpu", "device=cpu",
            f"recipe.train.max_epoch={epochs}", f"recipe.train.max_update={epochs * 42}"]
    run = tmp_path / "run"
    process = subprocess.Popen([*args, f"hydra.run.dir={run}"], cwd=ROOT, start_new_session=True,
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=script_env())
    deadline = time.time() + 120
    log = run / "train.log"
    while not (log.exists() and "(epoch 2 @" in log.read_text()) and time.time() < deadline:
        assert process.poll() is None, "the run ended before it could be killed"
        time.sleep(0.2)
    os.killpg(process.pid, signal.SIGKILL)
    process.wait()
    assert not (run / "result.json").exists()
    resumed = subprocess.run([*args, f"resume={run}"], cwd=ROOT, capture_output=True, text=True,
                             env=script_env())
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    result = json.loads((run / "result.json").read_text())
    assert result["status"] in FINISHED and result["steps"] == epochs * 42  # updates per epoch
    text = log.read_text()
    loaded = re.findall(r"Loaded checkpoint \S+ \(epoch (\d+) @ (\d+) updates\)", text)
    assert loaded and int(loaded[-1][0]) >= 2
    after = update_losses(text[text.rindex("Loaded checkpoint"):])
    reference = update_losses((Path(learned["un"]["run_dir"]) / "train.log").read_text())
    assert min(after) == int(loaded[-1][1]) + 1 and max(after) == result["steps"]
    assert after == {update: reference[update] for update in after}
    wandb_runs = {path.name for path in (run / "wandb").glob("offline-run-*/run-*.wandb")}
    assert len(wandb_runs) == 1 and len(list((run / "wandb").glob("offline-run-*"))) == 2


def test_gns_records_of_a_translation_run(synthetic_data, tmp_path):
    """record_gns=true, two epochs, the second cut short by max_update: gns/epoch_0001.pt
    (written when epoch 2 began) and epoch_0002.pt (after training) hold one record per
    update (update_freq 1) for every norm, each with its micro-batch's sentences (fairseq's
    ``bsz``; epoch 1's add up to the corpus), the epoch's mean sentences as batch_size; and
    analysis.gns reads them."""
    overrides = ["scale=cpu", "device=cpu", "logger=none", "record_gns=true",
                 "recipe.train.max_epoch=2", "recipe.train.max_update=63",
                 "recipe.average_last=1"]
    cfg = config("+exp=iwslt14_ln", *overrides)
    result = launcher.train(cfg, tmp_path, overrides)
    assert result["status"] in FINISHED and result["steps"] == 63
    assert f"--record-gns {tmp_path.resolve()}" in (tmp_path / "train_command.txt").read_text()
    sentences = [int(json.loads(record)["bsz"]) for record in
                 re.findall(r"\| train_inner \| (\{.*\})", (tmp_path / "train.log").read_text())]
    assert len(sentences) == 63
    files = sorted(p.name for p in (tmp_path / "gns").iterdir())
    assert files == ["epoch_0001.pt", "epoch_0002.pt"]
    for epoch, steps in ((1, range(42)), (2, range(42, 63))):
        saved = torch.load(tmp_path / "gns" / f"epoch_{epoch:04d}.pt", weights_only=True)
        counts = [sentences[step] for step in steps]
        assert saved["accumulate"] == 1 and saved["replicas"] == 1
        assert saved["batch_size"] == pytest.approx(sum(counts) / len(counts))
        assert len(saved["layers"]) == 2 * 2 + 2 * 3 + 2  # the tiny model's norms
        for values in saved["layers"].values():
            assert values["examples"].tolist() == counts and values["batch_sq"].shape == (len(counts),)
            assert values["example_sq"].shape == (len(counts), max(counts))
        if epoch == 1:
            assert sum(counts) == effective_config(cfg).data.synthetic.train
    gns = run_gns(tmp_path)
    assert gns["records"] == gns["used"] == 63 and gns["batch"]["update"] == pytest.approx(sum(sentences) / 63)
    assert all(small >= big > 0 for small, big in zip(gns["series"]["small_sq"], gns["series"]["big_sq"]))


def test_gns_records_each_sentences_gradient(synthetic_data, tmp_path):
    """plugins.fairseq.train's --record-gns on one update of the tiny model (LN, dropout 0,
    padded batch): every norm's |g_i|^2 and |mean_i g_i|^2 are those of each sentence's own
    summed token loss by autograd, with the norms handed the pad mask and without, and for
    each micro-batch of an update of two (update_freq 2); under --fp16 the loss scale is
    divided out (the float32 records to fp16's rounding) and an update fairseq skips leaves
    no records (see fairseq_checks.py)."""
    summary = fairseq_python("tests/fairseq_checks.py", "gns", str(synthetic_data), str(tmp_path))
    for mask in ("true", "false"):
        result = summary[f"mask_{mask}"]
        assert result["layers"] == 12 and result["padded"], result
        assert result["example_sq"] < 1e-5 and result["batch_sq"] < 1e-5, result
        assert result["examples"] == [result["sentences"]], result
    accumulated = summary["update_freq_2"]  # one record per micro-batch, each its own sentences
    assert accumulated["updates"] == 1 and accumulated["examples"] == accumulated["sentences"], accumulated
    assert accumulated["example_sq"] < 1e-5 and accumulated["batch_sq"] < 1e-5, accumulated
    fp16 = summary["fp16"]
    assert fp16["updates"] == 2 and fp16["steps"] == [2] and fp16["examples"] == fp16["sentences"]
    assert fp16["vs_float32"] < 5e-2, fp16


@pytest.mark.parametrize("overrides, reason", [
    (["+exp=iwslt14_un", "recipe.train.lr=100", "recipe.train.warmup_updates=1",
      "norm.warmup_iters=40"], "loss diverged"),
    (["+exp=iwslt14_nonorm", "recipe.train.lr=1e6", "recipe.train.warmup_updates=1",
      "collapse.min_steps=100000"], "fairseq stopped: gradients are Nan/Inf"),
])
def test_collapse_is_recorded_as_fail(overrides, reason, synthetic_data, tmp_path):
    result = launcher.train(config(*overrides, "scale=cpu", "device=cpu"), tmp_path, overrides)
    assert result["status"] == "FAIL" and reason in result["fail_reason"], result
    assert isinstance(result["fail_step"], int) and result["fail_step"] == result["steps"] > 0
    assert json.loads((tmp_path / "result.json").read_text())["status"] == "FAIL"
    assert not (tmp_path / "generate-test.txt").exists()


def test_iwslt14_preparation_script(fairseq_env, tmp_path):
    """scripts/prepare_iwslt14.sh on a small corpus in IWSLT14's raw layout (de-en.tgz)."""
    raw = tmp_path / "raw" / "de-en"
    raw.mkdir(parents=True)
    splits = synthetic.generate(460, 0, 50, seed=3)
    tests = ["IWSLT14.TED.dev2010", "IWSLT14.TEDX.dev2012", "IWSLT14.TED.tst2010",
             "IWSLT14.TED.tst2011", "IWSLT14.TED.tst2012"]
    for side, lang in ((0, "de"), (1, "en")):
        lines = ["<url>http://www.ted.com/talks/a.html</url>", "<talkid>1</talkid>",
                 "<title>Ein Titel</title>"]
        lines += [pair[side].capitalize() + "." for pair in splits["train"]]
        lines.append("Zu lang " * 200)  # dropped by cleaning (over 175 tokens)
        (raw / f"train.tags.de-en.{lang}").write_text("\n".join(lines) + "\n")
        for k, name in enumerate(tests):
            segments = "".join(f'<seg id="{i}"> {pair[side].capitalize()} it’s &amp; </seg>\n'
                               for i, pair in enumerate(splits["test"][10 * k:10 * k + 10], 1))
            (raw / f"{name}.de-en.{lang}.xml").write_text(f'<doc docid="1">\n{segments}</doc>\n')
    subprocess.run(["tar", "-czf", "de-en.tgz", "de-en"], cwd=raw.parent, check=True)
    out = tmp_path / "iwslt14"
    done = subprocess.run(["bash", "scripts/prepare_iwslt14.sh", str(raw.parent / "de-en.tgz"), str(out)],
                          cwd=ROOT, capture_output=True, text=True, env={**os.environ, "WORKERS": "1"})
    assert done.returncode == 0, done.stderr[-3000:]
    assert all(path.exists() for path in binarised_files(out, "de", "en"))
    train, valid = (out / "tok" / "train.en").read_text().splitlines(), (out / "tok" / "valid.en").read_text().splitlines()
    assert len(train) + len(valid) == 461 and len(valid) == 461 // 23  # title kept, long pair dropped
    assert all(line == line.lower() for line in train) and train[1].endswith(" .")
    test = (out / "tok" / "test.de").read_text().splitlines()
    assert len(test) == 50 and "it &apos; s &amp; amp ;" in test[0]  # Moses' splitting and escaping


# ---- training through the norms: sam= and train_only= (tests/fairseq_sam_checks.py) ---------

NORMS = 2 * 2 + 2 * 3 + 2  # the tiny model's norms: 2 per encoder layer, 3 per decoder layer, 2 final
WIDTH = 64


def test_sam_and_train_only_reach_fairseq_as_flags(tmp_path):
    """Each sam= entry becomes --sam true and a flag per option, train_only= --train-only;
    the defaults add nothing. What the trainer prints of what it trains is read back."""
    def command(*overrides):
        cfg, device, _ = launcher.run_config(config("+exp=iwslt14_un", "scale=cpu", "device=cpu", *overrides))
        return " ".join(launcher.train_command(cfg, _Env(), tmp_path, tmp_path / "checkpoints", device))

    plain = command()
    assert "--sam" not in plain and "--train-only" not in plain
    assert "--sam true --sam-rho 0.5 --sam-adaptive false --sam-only-norm true --train-only norm " in \
        command("sam=sam_on", "train_only=norm")
    assert ("--sam true --sam-rho 10.0 --sam-adaptive true --sam-elementwise true --sam-eta 0.0 "
            "--sam-normalize-bias true --sam-only-norm true") in command("sam=asam_on")
    assert "--sam true --sam-rho 0.2 --sam-adaptive false --sam-only-norm false" in command("sam=sam", "sam.rho=0.2")
    assert "--train-only norm+head" in command("train_only=norm+head", "recipe.train.share_all_embeddings=false")
    record = {"trainable_parameters": 5, "sam_perturbed_parameters": 2}
    log = f"x\n2026 | INFO | {trained_line({'trainable_parameters': 9})}\n{trained_line(record)}\nend\n"
    assert read_trained(log) == record and read_trained("no record") == {}


@pytest.mark.parametrize("overrides, fix", [
    (["sam=sam_on", "recipe.train.update_freq=2"],
     "sam with update_freq 2 (2 micro-batches per update) is not defined here: SAM's ascent needs "
     "the whole update's gradient before its second pass. Use one micro-batch per update "
     "(recipe.train.update_freq=1"),
    (["train_only=norm+head"], "train_only=norm+head: share_all_embeddings ties the output "
     "projection (the head) to the embeddings, so training it would train the input embeddings "
     "too; untie it (recipe.train.share_all_embeddings=false) or use train_only=norm"),
])
def test_what_translation_cannot_train_through_the_norms_is_refused(overrides, fix, gpus, tmp_path,
                                                                   monkeypatch):
    """Before anything runs (no fairseq environment needed), naming the fix; WMT14's recipe on
    one GPU (128 micro-batches per update) with SAM likewise."""
    gpus(0)
    monkeypatch.setenv("UNNORM_FAIRSEQ_ENV", str(tmp_path / "none"))
    with pytest.raises(ValueError, match=re.escape(fix)):
        launcher.train(config("+exp=iwslt14_un", "scale=cpu", *overrides), tmp_path / "run", overrides)
    assert not (tmp_path / "run").exists()
    gpus(1)
    with pytest.raises(ValueError, match=re.escape("sam with update_freq 128")):
        launcher.run_config(config("+exp=wmt14_un", "sam=sam"))


def test_a_sam_update_is_sam_on_written_out(synthetic_data):
    """One SAM-ON update of the trainer (UN, SGD) is w - lr g(w + eps) / tokens with eps =
    rho g / ||g|| over the norms' affine, to float32 rounding, and not the plain update; the
    norms' state after it is bitwise the first pass's alone; 3 updates advance UN's step
    counter 3 times, not 6. A second pass that runs out of memory (fairseq drops the update
    and goes on) leaves the weights, perturbed when it failed, and the norms as they were."""
    summary = fairseq_python("tests/fairseq_sam_checks.py", "update", str(synthetic_data))
    assert summary["perturbed"] and summary["updates"] == 1, summary
    assert summary["vs_sam"] < 1e-5 and summary["vs_plain"] > 1e-2, summary
    assert summary["norm_state_as_first_pass"] and summary["norm_state_buffers"] > 0, summary
    assert summary["updates_after"] == 3 and summary["num_iters"] == [3], summary
    oom = summary["oom"]
    assert summary["oom_returned"] is None and oom["forwards"] == 2 and oom["updates"] == 3, summary
    assert oom["weights_unchanged"] and oom["norms_unchanged"], summary


def test_what_each_setting_trains_and_what_is_refused_in_fairseq(synthetic_data):
    """The perturbed and trainable sets, and what fairseq's optimizer holds: SAM every
    parameter, SAM-ON the norms' affine (12 norms of width 64, as norm_parameters finds them),
    train_only=norm the norms alone, norm+head (untied) the norms and the output projection.
    Refused by the trainer: SAM with --update-freq 2, norm+head with a tied head, and the
    flags where plugins.fairseq.train does not apply them (fairseq-train)."""
    summary = fairseq_python("tests/fairseq_sam_checks.py", "refusals", str(synthetic_data))
    norms = NORMS * 2 * WIDTH
    for name in ("sam", "sam_on", "norm", "norm+head"):
        assert summary[name]["norms"] == summary[name]["affine"] == norms, summary[name]
    assert summary["sam"]["perturbed"] == summary["sam"]["trainable"] == summary["sam"]["all"]
    assert summary["sam_on"]["perturbed"] == norms and summary["sam_on"]["trainable"] == summary["sam_on"]["all"]
    assert summary["norm"]["trainable"] == summary["norm"]["optimized"] == norms and summary["norm"]["perturbed"] is None
    head = summary["norm+head"]
    assert head["trainable"] == head["optimized"] == norms + head["head"] and head["perturbed"] == norms
    assert summary["update_freq_2"].startswith("--sam with --update-freq 2 (2 micro-batches per update)")
    assert "--update-freq 1" in summary["update_freq_2"]
    assert summary["tied_head"].startswith("--train-only norm+head: the output projection (the head) is tied")
    assert "recipe.train.share_all_embeddings=false" in summary["tied_head"]
    assert "train with `python -m plugins.fairseq.train`" in summary["fairseq_train"]


def test_sam_under_fp16_steps_the_master_weights_and_skips_an_overflow_whole(synthetic_data):
    """--fp16 (FP16Optimizer, half-precision model): a SAM-ON update moves fairseq's float32
    master weights by SAM-ON's update (to fp16's rounding of the gradients, 30x closer than
    to the plain update). An update whose head gradient overflows, under SAM-ON and SAM,
    is skipped with the weights (half and master) and every norm's buffers as they were;
    the next update is taken; UN counts one step per update taken."""
    summary = fairseq_python("tests/fairseq_sam_checks.py", "fp16", str(synthetic_data))
    step = summary["step"]
    assert step["updates"] == 1 and step["vs_sam"] < 2e-2 and step["vs_plain"] > 5 * 2e-2, step
    for name in ("sam_on", "sam"):
        result = summary[name]
        assert result["half"] == "torch.float16" and result["updates"] == 2 and result["scale"] == [64, 32], result
        assert result["weights_unchanged"] and result["master_unchanged"] and result["norms_unchanged"], result
        assert result["num_iters"] == [2] and result["updates_then"] == 3 and result["num_iters_then"] == [3], result
        assert result["finite"], result


@pytest.mark.slow
def test_a_translation_run_with_sam_on_trains_only_the_norms(synthetic_data, tmp_path):
    """python scripts/train.py +exp=iwslt14_un sam=sam_on train_only=norm scale=cpu, one epoch
    (42 updates; greedy translations of 4 tokens at most: the model learns little): it trains
    and records what it trained (the norms' parameters, as norm_parameters counts them on the
    run's model, both trainable and perturbed); every other parameter of the last checkpoint
    is bitwise its initialisation (the model the training command builds from its seed) and
    every norm parameter moved; UN counted one step per update."""
    run = tmp_path / "run"
    done = subprocess.run(
        [sys.executable, "scripts/train.py", "+exp=iwslt14_un", "sam=sam_on", "train_only=norm",
         "scale=cpu", "device=cpu", "logger=none", "recipe.train.max_epoch=1",
         "recipe.average_last=1", "recipe.generate.beam=1", "+recipe.generate.max_len_a=0",
         "+recipe.generate.max_len_b=4", f"hydra.run.dir={run}"],
        cwd=ROOT, capture_output=True, text=True, env=script_env())
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    result = json.loads((run / "result.json").read_text())
    assert result["status"] in FINISHED and result["steps"] == 42, result
    log = (run / "train.log").read_text()
    assert "SAM (only the norms) perturbs 1536 parameters, 100.00% of the trainable ones" in log
    checked = fairseq_python("tests/fairseq_sam_checks.py", "run", str(run))
    assert checked["norm_parameters"] == NORMS * 2 * WIDTH and checked["norms"] == NORMS * 2
    assert result["trainable_parameters"] == result["sam_perturbed_parameters"] == checked["norm_parameters"]
    assert checked["others_unchanged"] and checked["others"] > 0, checked
    assert checked["norms_changed"], checked
    assert checked["num_iters"] == [42], checked
