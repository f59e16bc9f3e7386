"""Reliability: no bad batch poisons a norm, no run record is lost or rewritten, every setting
is honoured or refused."""
from __future__ import annotations

import argparse
import json
import os
import tomllib
from pathlib import Path

import pytest
import torch
import yaml
from omegaconf import OmegaConf

import unnorm
from plugins.checkpoints import UnsafeCheckpoint, load_checkpoint
from plugins.runlog import FINISHED, LOCK_FILE
from plugins.scale import effective_config
from plugins.timm import model_from_config
from plugins.timm.trainer import classifier_prefix, train
from plugins.training import load_weights, run_task
from test_norms import SHAPE, STATEFUL, make_sequence, random_affine
from test_vision import QUICK, ROOT, config, run_script

C = SHAPE[-1]
PAD = torch.zeros(SHAPE[:-1], dtype=torch.bool)
PAD[1, 3:] = True


def build(name):
    norm = unnorm.build_norm(name, C, **STATEFUL[name])
    return random_affine(norm) if hasattr(norm, "bias") else norm


def train_step(norm, x, dy, pad=PAD):
    x = x.clone().requires_grad_(True)
    for p in norm.parameters():
        p.grad = None
    y = norm(x) if pad is None else norm(x, pad)
    y.backward(dy)
    return [y.detach(), x.grad] + [p.grad.clone() for p in norm.parameters()]


def state(norm):
    return {k: v.clone() for k, v in norm.state_dict().items() if not k.endswith("num_rejected")}


def bad_step(norm, kind, x, dy):
    """One training step that the norm must reject."""
    if kind == "nan_batch":
        x = x.clone()
        x[0, 0, 2] = float("nan")
    elif kind == "inf_gradient":
        dy = dy.clone()
        dy[0, 1, 3] = float("inf")
    elif kind == "empty_batch":
        return train_step(norm, x[:0], dy[:0], PAD[:0])
    elif kind == "empty_batch_unmasked":  # BN's fused kernel refuses no rows
        return train_step(norm, x[:0], dy[:0], None)
    elif kind == "all_padding":
        return train_step(norm, x, dy, torch.ones_like(PAD))
    return train_step(norm, x, dy)


@pytest.mark.parametrize("kind", ["nan_batch", "inf_gradient", "empty_batch", "empty_batch_unmasked",
                                  "all_padding"])
@pytest.mark.parametrize("name", list(STATEFUL))
def test_a_bad_step_changes_no_state_and_the_next_steps_train_as_without_it(name, kind):
    clean, hit = build(name), build(name)
    xs, dys = make_sequence(16)
    for t, (x, dy) in enumerate(zip(xs, dys)):
        if t == 9:  # after warm-up, with full windows
            before = state(hit)
            bad_step(hit, kind, x * 3, dy)
            after = state(hit)
            for key in before:
                assert torch.equal(after[key], before[key]), key
        want, got = train_step(clean, x, dy), train_step(hit, x, dy)
        for a, b in zip(want, got):
            torch.testing.assert_close(b, a, rtol=0, atol=0)
    for key, value in state(clean).items():
        torch.testing.assert_close(state(hit)[key], value, rtol=0, atol=0)
    assert int(hit.num_rejected) == 1 and int(clean.num_rejected) == 0


def test_rejections_are_counted_per_layer_and_tapped():
    model = torch.nn.Sequential(build("un"), build("bn"))
    xs, dys = make_sequence(3)
    with unnorm.record_statistics(model) as recorder:
        for t, (x, dy) in enumerate(zip(xs, dys)):
            x = x.clone().requires_grad_(True)
            if t == 1:
                x = x * float("nan")
            model(x).backward(dy)
        chunk = recorder.flush()
    for layer in ("0", "1"):
        assert chunk[layer]["rejected"].tolist() == [False, True, False]
    assert [int(m.num_rejected) for m in model] == [1, 1]


def test_training_steps_read_nothing_back_from_the_device_even_when_rejected(monkeypatch):
    norms = [build(name) for name in STATEFUL]
    xs, dys = make_sequence(6)

    def refuse(*args, **kwargs):
        raise AssertionError("device-to-host read in a training step")
    for method in ("item", "__bool__", "__int__", "__float__", "tolist"):
        monkeypatch.setattr(torch.Tensor, method, refuse)
    for norm in norms:
        for t, (x, dy) in enumerate(zip(xs, dys)):
            bad_step(norm, "nan_batch", x, dy) if t == 3 else train_step(norm, x, dy)
    monkeypatch.undo()
    assert all(int(n.num_rejected) == 1 for n in norms)


# --- every setting honoured or refused -----------------------------------------------------------

def test_bad_norm_inputs_and_options_are_refused_naming_the_fix():
    norm = unnorm.build_norm("ln", 4)
    with pytest.raises(TypeError, match="floating-point.*x.float"):
        norm(torch.tensor([[1, 2, 3, 4]]))
    for mask in (torch.zeros(2, 3), torch.zeros(2, 3, dtype=torch.long)):
        with pytest.raises(TypeError, match="bool"):
            unnorm.build_norm("bn", 4)(torch.randn(2, 3, 4), mask)
    for name in ("ln", "bn", "un", "prepbn"):
        for eps in (0, -1, float("nan")):
            with pytest.raises(ValueError, match="eps"):
                unnorm.build_norm(name, 4, eps=eps)
    with pytest.raises(ValueError, match="momentum"):
        unnorm.build_norm("bn", 4, momentum=1.5)
    plain = torch.nn.Sequential(torch.nn.Linear(4, 4))
    with pytest.raises(ValueError, match="unknown norm 'foo'"):
        unnorm.swap_norms(plain, "foo")
    with pytest.raises(ValueError, match="no option.*windows"):
        unnorm.swap_norms(plain, "un", windows=3)


@pytest.mark.parametrize("name", ["un", "mabn"])
def test_a_state_dict_of_another_window_size_names_window_size(name):
    saved = unnorm.build_norm(name, C, window_size=6).state_dict()
    with pytest.raises(ValueError, match="window_size=6"):
        unnorm.build_norm(name, C, window_size=4).load_state_dict(saved)


def test_checkpoints_from_before_the_rejection_counter_still_load():
    """State dicts written before ``num_rejected`` existed load (it starts at 0)."""
    for name in STATEFUL:
        old = {k: v for k, v in build(name).state_dict().items() if k != "num_rejected"}
        norm = unnorm.build_norm(name, C, **STATEFUL[name])
        norm.load_state_dict(old)
        assert int(norm.num_rejected) == 0


def test_scale_cpu_supplies_defaults_only_for_what_the_command_line_left_unset():
    given = ["+exp=swin_t_un", "scale=cpu", "recipe.lr=1e4", "norm.warmup_iters=7",
             "model.img_size=40"]
    cfg = effective_config(config(*given), given)
    assert cfg.recipe.lr == 1e4 and cfg.norm.warmup_iters == 7 and cfg.model.img_size == 40
    assert cfg.recipe.batch_size == 64 and cfg.data.name == "digits"  # the cpu defaults
    unset = effective_config(config("+exp=swin_t_un", "scale=cpu"), ["+exp=swin_t_un", "scale=cpu"])
    assert unset.recipe.lr == 2e-3 and unset.model.img_size == 32


# --- run records ---------------------------------------------------------------------------------

def _files(path: Path) -> dict[str, bytes]:
    """The run's files, without the folder's lock (which names the last run to hold it)."""
    return {str(p.relative_to(path)): p.read_bytes() for p in sorted(path.rglob("*"))
            if p.is_file() and p.name != LOCK_FILE}


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory):
    run = tmp_path_factory.mktemp("finished")
    result = train(config("+exp=swin_t_un", *QUICK, "recipe.epochs=2"), run)
    assert result["status"] in FINISHED and (run / "previous.pt").exists()
    return run


def test_resuming_or_requeueing_a_finished_run_changes_nothing(finished_run):
    before = _files(finished_run)
    proc = run_script("scripts/train.py", "+exp=swin_t_un", *QUICK, "recipe.epochs=2",
                      f"resume={finished_run}")
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "has finished (status ok); nothing to do" in proc.stdout
    again = train(config("+exp=swin_t_un", *QUICK, "recipe.epochs=2"), finished_run)  # a requeue
    assert again == json.loads((finished_run / "result.json").read_text())
    assert _files(finished_run) == before


def test_cfg_job_prints_what_runs_but_the_norms_computed_options():
    """scale=cpu is Hydra composition: ``--cfg job`` prints the model, data and recipe that
    run, command-line values included; what differs is only what plugins/scale.py computes
    from the paper's setting (the norms' step counts, recorded with their factor) and the
    paper's setting itself, which the run drops."""
    from plugins.runlog import config_differences

    argv = ["+exp=swin_t_un", "scale=cpu", "recipe.lr=5e-3", "model.img_size=40"]
    proc = run_script("scripts/train.py", *argv, "--cfg", "job", "--resolve")
    assert proc.returncode == 0, proc.stderr[-2000:]
    printed = yaml.safe_load(proc.stdout)
    runs = OmegaConf.to_container(effective_config(config(*argv), argv), resolve=True)
    assert printed["recipe"]["lr"] == 5e-3 and printed["model"]["img_size"] == 40
    assert printed["data"]["name"] == "digits" and printed["recipe"]["batch_size"] == 64
    assert {diff.split(" ")[0] for diff in config_differences(printed, runs)} == {
        "norm.warmup_iters", "norm.compensation_start", "scale.norm_step_factor", "paper"}


def test_a_run_recorded_before_hydra_composed_the_scale_continues(tmp_path):
    """A committed run from before issue 45: its config.yaml holds the scale's variants
    inside the model and recipe (``model.cpu``, ``recipe.cpu``) and ``scale.data``, and its
    command line spelled ``recipe.cpu.micro_batch_size=2``. Requeued with that command line in
    today's spelling, it is the same run (finished: nothing to do, its records untouched)."""
    import shutil

    from analysis.runs import current_spelling

    source = ROOT / "results" / "runs" / "cpu" / "micro_batch" / "swin_t_bcn_wsres-mb2-s0"
    stored = yaml.safe_load((source / "config.yaml").read_text())
    assert {"cpu"} <= set(stored["model"]) & set(stored["recipe"]) and "data" in stored["scale"]
    record = json.loads((source / "result.json").read_text())
    assert "recipe.cpu.micro_batch_size=2" in record["overrides"]
    run = tmp_path / "run"
    shutil.copytree(source, run)
    before = _files(run)
    overrides = [current_spelling(item) for item in record["overrides"]]
    assert train(config(*overrides), run, overrides) == record
    assert _files(run) == before


def test_an_added_key_only_the_new_config_has_is_no_difference():
    """model.nf_targets (issue 49) reaches a run only through model.weight_standardization,
    which every record holds: a record without it continues; one that holds it is compared."""
    from plugins.runlog import config_differences

    new = {"model": {"nf_targets": ["blocks.*"], "weight_standardization": None}}
    assert config_differences({"model": {"weight_standardization": None}}, new) == []
    assert config_differences({"model": {"nf_targets": ["x"], "weight_standardization": None}},
                              new) == ["model.nf_targets (['x'] -> ['blocks.*'])"]
    assert config_differences({"model": {}}, {"model": {"ws_gamma": 1.7}}) == [
        "model.ws_gamma (None -> 1.7)"]  # not an added key: compared


@pytest.fixture
def interrupted_run(finished_run, tmp_path):
    """A copy of the run as if killed after its last checkpoint (no result.json yet)."""
    run = tmp_path / "run"
    run.mkdir()
    for name, data in _files(finished_run).items():
        if name != "result.json":
            (run / name).write_bytes(data)
    return run


def test_a_resume_with_other_options_is_refused_and_writes_nothing(interrupted_run):
    before = _files(interrupted_run)
    with pytest.raises(ValueError, match=r"norm\.momentum \(0\.9 -> 0\.5\)"):
        train(config("+exp=swin_t_un", *QUICK, "recipe.epochs=2", "norm.momentum=0.5",
                     f"resume={interrupted_run}"), interrupted_run)
    with pytest.raises(ValueError, match="norm.name"):
        train(config("+exp=swin_t_ln", *QUICK, "recipe.epochs=2", f"resume={interrupted_run}"),
              interrupted_run)
    assert _files(interrupted_run) == before


def test_resuming_a_finished_run_with_other_options_is_refused(finished_run):
    """Nothing would run, so the changed option would be dropped without a word."""
    before = _files(finished_run)
    with pytest.raises(ValueError, match=r"refusing to resume .*norm\.momentum \(0\.9 -> 0\.5\)"):
        train(config("+exp=swin_t_un", *QUICK, "recipe.epochs=2", "norm.momentum=0.5",
                     f"resume={finished_run}"), finished_run)
    assert _files(finished_run) == before


def test_a_damaged_checkpoint_names_the_file_and_the_fallback(interrupted_run):
    last = interrupted_run / "last.pt"
    last.write_bytes(last.read_bytes()[:1000])
    before = _files(interrupted_run)
    with pytest.raises(ValueError, match=rf"{last} is not a readable checkpoint.*previous\.pt"):
        train(config("+exp=swin_t_un", *QUICK, "recipe.epochs=2", f"resume={interrupted_run}"),
              interrupted_run)
    assert _files(interrupted_run) == before
    (interrupted_run / "previous.pt").replace(last)  # the fix the message names
    result = train(config("+exp=swin_t_un", *QUICK, "recipe.epochs=2",
                          f"resume={interrupted_run}"), interrupted_run)
    assert result["status"] in FINISHED and result["steps"] == 6


def test_the_recorded_config_is_what_ran(tmp_path):
    proc = run_script("scripts/train.py", "+exp=swin_t_un", *QUICK, "recipe.lr=0.01",
                      "norm.warmup_iters=2", f"hydra.run.dir={tmp_path}")
    assert proc.returncode == 0, proc.stderr[-2000:]
    recorded = yaml.safe_load((tmp_path / "config.yaml").read_text())
    assert recorded["recipe"]["lr"] == 0.01 and recorded["norm"]["warmup_iters"] == 2
    assert json.loads((tmp_path / "result.json").read_text())["metrics"]["lr"] < 0.01


def test_files_that_are_not_checkpoints_are_refused_naming_the_option(tmp_path):
    text = tmp_path / "notes.txt"
    text.write_text("not a checkpoint")
    with pytest.raises(ValueError, match="init_from: .*notes.txt is not a readable checkpoint"):
        train(config("+exp=swin_t_un", *QUICK, f"init_from={text}"), tmp_path / "a")


def _checkpoint_model(run: Path, *overrides: str):
    """The model of ``run``'s config, with ``overrides`` (dotted keys) changed."""
    cfg = OmegaConf.create(load_checkpoint(run / "last.pt")["config"])
    for override in overrides:
        key, value = override.split("=")
        OmegaConf.update(cfg, key, yaml.safe_load(value))
    return model_from_config(cfg)


def test_init_from_names_every_tensor_that_does_not_fit(finished_run, tmp_path):
    """Only the classifier, named as such, may stay new; any other tensor of another shape is
    refused by name, and a norm's windows of another length by the norm's own check."""
    last = finished_run / "last.pt"
    saved = load_checkpoint(last)["model"]
    model = _checkpoint_model(finished_run, "data.num_classes=5")  # another task's classes
    head = classifier_prefix(model)
    with pytest.raises(ValueError, match=rf"{head}weight \(10, \d+\) there, \(5, \d+\) here"):
        load_weights(model, str(last), reset_steps=False)
    described = load_weights(model, str(last), reset_steps=False, resizable=[head])
    assert described == f"{last} (new: ['{head}bias', '{head}weight'])"
    loaded = model.state_dict()
    assert all(torch.equal(loaded[k], v) for k, v in saved.items() if not k.startswith(head))

    widened = dict(saved)
    key = next(k for k in saved if k.endswith("mlp.fc1.weight"))
    widened[key] = torch.zeros(saved[key].shape[0] + 1, saved[key].shape[1])
    other = tmp_path / "other.pt"
    torch.save({"model": widened}, other)
    with pytest.raises(ValueError, match=rf"{key} \({saved[key].shape[0] + 1}, "):
        load_weights(_checkpoint_model(finished_run), str(other), False, resizable=[head])

    with pytest.raises(ValueError, match="norm.window_size=4"):  # UN's own check
        load_weights(_checkpoint_model(finished_run, "norm.window_size=6"), str(last), False,
                     resizable=[head])


class _RunsCode:
    """Pickles into a call of ``os.system``: what a malicious checkpoint can hold."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


def test_a_checkpoint_that_would_run_code_is_refused_naming_the_file_and_the_opt_in(
        interrupted_run, tmp_path, monkeypatch):
    marker = tmp_path / "code_ran"
    evil = tmp_path / "evil.pt"
    torch.save({"model": {}, "payload": _RunsCode(marker)}, evil)
    with pytest.raises(UnsafeCheckpoint, match=rf"init_from: {evil} holds .*trust_checkpoint=true"):
        train(config("+exp=swin_t_un", *QUICK, f"init_from={evil}"), tmp_path / "a")
    (interrupted_run / "last.pt").write_bytes(evil.read_bytes())
    with pytest.raises(UnsafeCheckpoint, match=rf"resume: {interrupted_run / 'last.pt'} holds .*"
                                               "trust_checkpoint=true"):
        train(config("+exp=swin_t_un", *QUICK, "recipe.epochs=2", f"resume={interrupted_run}"),
              interrupted_run)
    monkeypatch.syspath_prepend(str(ROOT / "scripts"))
    import cka
    import fold
    for script, arguments in ((cka, [evil, evil]), (fold, [evil])):
        with pytest.raises(UnsafeCheckpoint, match=rf"{evil} holds .*--trust-checkpoint"):
            script.main([str(path) for path in arguments])
    assert not marker.exists()


def test_trusted_checkpoints_load_whatever_they_hold(finished_run, tmp_path):
    """The opt-in works: a checkpoint with a foreign object (an old run's argparse args)."""
    old = tmp_path / "old.pt"
    torch.save({**load_checkpoint(finished_run / "last.pt"), "args": argparse.Namespace(lr=0.1)}, old)
    model = _checkpoint_model(finished_run)
    with pytest.raises(UnsafeCheckpoint, match="trust_checkpoint=true"):
        load_weights(model, str(old), False)
    assert load_weights(model, str(old), False, trusted=True) == str(old)


def test_our_checkpoints_load_without_running_their_pickle(finished_run):
    """Everything a run saves (model, optimizer, timm's scheduler, collapse state, every
    replica's RNG states with numpy's, the config) loads with ``weights_only=True``."""
    state = load_checkpoint(finished_run / "last.pt")
    assert {"model", "optimizer", "scheduler", "collapse", "rng", "config"} <= state.keys()
    assert state["rng"][0]["numpy"][0] == "MT19937" and state["scheduler"]["t_initial"] > 0
    with pytest.raises(Exception, match="[Ww]eights.only"):  # numpy's types are allowed by name
        torch.load(finished_run / "last.pt", weights_only=True)


def test_compile_true_makes_a_fall_back_to_eager_an_error(tmp_path):
    """Past dynamo's recompile limit, compiled code would run eager without a word."""
    def recompiling(cfg, out_dir, world, meta):
        double = torch.compile(lambda x: 2 * x, dynamic=False, backend="eager")
        for size in range(1, 12):  # a new shape, a new graph, each call
            double(torch.ones(size))
        return {"status": "ok"}
    torch._dynamo.reset()
    with pytest.raises(RuntimeError, match="compile=true: dynamo reached its recompile limit.*"
                                           "compile=false"):
        run_task(recompiling, config("+exp=swin_t_un", "scale=cpu", "compile=true"), tmp_path)
    torch._dynamo.reset()
    assert run_task(recompiling, config("+exp=swin_t_un", "scale=cpu"), tmp_path) == {"status": "ok"}
    torch._dynamo.reset()


def test_the_package_metadata_uses_an_spdx_license():
    """``project.license`` as a table is what made pip print a deprecation warning."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert isinstance(project["project"]["license"], str)
    assert any(req.startswith("setuptools>=77") for req in project["build-system"]["requires"])
