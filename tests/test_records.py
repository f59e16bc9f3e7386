"""Run records that a kill cannot corrupt: a kill at every step of an epoch's save (each file
write and rename, torn writes included), then a resume, leaves the records and weights of the
uninterrupted run; in the shared loop and in every trainer on it."""
from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf
from timm.scheduler import create_scheduler_v2

import unnorm
from plugins.checkpoints import load_checkpoint
from plugins.distributed import Distributed
from plugins.loop import EpochLoop
from plugins.runlog import FINISHED, LOCK_FILE, RunDirectory, RunFolderInUse

ROOT = Path(__file__).resolve().parents[1]
C, SAMPLES, UPDATES, EPOCHS = 6, 48, 3, 2
TIMES = ("time", "epoch_time_s", "tokens_per_s")  # differ between any two runs


class SimulatedKill(BaseException):
    """A kill: nothing after it runs (not an Exception, so no handler of ours catches it)."""


class KillAt:
    """Counts the save's file operations (``torch.save``, ``os.replace``, ``os.link``, a
    metrics row's append); the ``at``-th one is torn (a file half written, a rename not done)
    and the process "dies". ``at=None`` only counts; ``at=(name, k)``: the k-th of that name
    (``"append_row"``), wherever generated data adds operations before it."""

    def __init__(self, monkeypatch, at=None):
        self.at, self.count, self.names = at, 0, []
        save, replace, link, append = torch.save, os.replace, os.link, RunDirectory.append_row

        def torn_save(obj, path, *args, **kwargs):
            save(obj, path, *args, **kwargs)
            Path(path).write_bytes(Path(path).read_bytes()[:100])

        def torn_append(run, row):
            append(run, row[: len(row) // 2])

        def counted(real, torn):
            def operation(*args, **kwargs):
                self.count += 1
                self.names.append(real.__name__)
                if self.at in (self.count, (real.__name__, self.names.count(real.__name__))):
                    if torn is not None:
                        torn(*args, **kwargs)
                    raise SimulatedKill(f"killed at file operation {self.count}")
                return real(*args, **kwargs)
            return operation

        monkeypatch.setattr(torch, "save", counted(save, torn_save))
        monkeypatch.setattr(os, "replace", counted(replace, None))
        monkeypatch.setattr(os, "link", counted(link, None))
        monkeypatch.setattr(RunDirectory, "append_row", counted(append, torn_append))


def _cfg():
    return OmegaConf.create({
        "exp_name": "records", "seed": 0, "norm_sync": "reduce", "record_statistics": True,
        "record_gns": True, "trust_checkpoint": False, "logger": {"name": "none"},
        "scale": {"num_workers": 0},
        "collapse": {"loss_multiple": 5.0, "ema": 0.9, "min_steps": 50, "check_every": 2}})


def _loop_run(run_dir: Path) -> dict:
    """Two epochs of a linear-UN-linear regression through the shared loop, resumed from the
    run's checkpoint if it has one (statistics and GNS recorded: every record is written)."""
    torch.manual_seed(0)
    data = torch.utils.data.TensorDataset(torch.randn(SAMPLES, 5, C), torch.randn(SAMPLES, 5, 1))
    model = torch.nn.Sequential(torch.nn.Linear(C, C),
                                unnorm.build_norm("un", C, warmup_iters=2, window_size=2),
                                torch.nn.Linear(C, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    scheduler, _ = create_scheduler_v2(optimizer, sched="cosine", num_epochs=EPOCHS,
                                       warmup_epochs=0, step_on_epochs=False,
                                       updates_per_epoch=UPDATES)
    loop = EpochLoop(_cfg(), run_dir, Distributed("cpu"), RunDirectory(run_dir), model,
                     optimizer, scheduler, None)
    init = loop.resume("scratch")

    def forward(batch):
        x, y = batch
        return torch.nn.functional.mse_loss(model(x), y)

    return loop.fit(model, data, 8, None, UPDATES, EPOCHS, forward=forward,
                    evaluate=lambda epoch: {"val": model[0].weight.sum().item()}, meta={},
                    init=init)


def records(run_dir: Path) -> dict:
    """Everything a run leaves that analysis reads, without what differs between any two runs
    (wall-clock times): metrics rows, result metrics, statistics and GNS files, weights."""
    rows = [{k: v for k, v in json.loads(line).items() if k not in TIMES}
            for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    result = json.loads((run_dir / "result.json").read_text())
    files = sorted(str(p.relative_to(run_dir)) for p in run_dir.rglob("*")
                   if p.is_file() and p.suffix != ".tmp" and p.name != "run.lock")
    tensors = {name: load_checkpoint(run_dir / name) for name in files
               if name.startswith(("stats/", "gns/"))}
    for name in ("last.pt", "previous.pt"):
        if (run_dir / name).exists():
            tensors[name] = load_checkpoint(run_dir / name)["model"]
    return {"rows": rows, "status": result["status"], "steps": result["steps"],
            "metrics": {k: v for k, v in result["metrics"].items() if k not in TIMES},
            "files": files, "tensors": tensors}


def assert_same_records(got: dict, want: dict) -> None:
    tensors = got.pop("tensors"), want.pop("tensors")
    assert got == want
    torch.testing.assert_close(tensors[0], tensors[1], rtol=0, atol=0)


def test_a_kill_at_any_file_operation_of_the_loop_then_a_resume_gives_the_uninterrupted_run(
        tmp_path, monkeypatch):
    with monkeypatch.context() as counting:
        counter = KillAt(counting)
        _loop_run(tmp_path / "whole")
    want = records(tmp_path / "whole")
    assert [row["epoch"] for row in want["rows"]] == [1, 2] and counter.count >= 10
    for at in range(1, counter.count + 1):
        run_dir = tmp_path / f"killed_at_{at}"
        with monkeypatch.context() as killing, pytest.raises(SimulatedKill):
            KillAt(killing, at)
            _loop_run(run_dir)
        if (run_dir / "result.json").exists():  # killed after the end: nothing left to do
            continue
        rows = (run_dir / "metrics.jsonl").read_text() if (run_dir / "metrics.jsonl").exists() else ""
        committed = load_checkpoint(run_dir / "last.pt")["epoch"] + 1 if (run_dir / "last.pt").exists() else 0
        assert all(json.loads(line)["epoch"] <= committed for line in rows.splitlines()
                   if line.endswith("}")), f"a row before its checkpoint (kill at {at})"
        result = _loop_run(run_dir)
        assert result["status"] in FINISHED
        assert_same_records(records(run_dir), dict(want, tensors=dict(want["tensors"]))), at


# --- every trainer on the loop: the two kinds of point a kill can hit --------------------------

def _trainer_run(task: str, tmp_path: Path):
    """``(train, config)`` of a two-epoch run of ``task``'s trainer."""
    from test_vision import config

    two_epochs = ["scale=cpu", "logger=none", "recipe.epochs=2", "scale.max_steps_per_epoch=2"]
    if task == "classification":
        from plugins.timm.trainer import train
        return train, config("+exp=swin_t_un", *two_epochs)
    if task == "detection":
        from plugins.torchvision.trainer import train
        from test_detection import _data
        return train, config("+exp=faster_rcnn_swin_t_un", *two_epochs,
                             *_data(tmp_path, train=8, val=2))
    from plugins.lm.data import prepare_tokens
    from plugins.lm.trainer import train
    from test_lm_data import tiny_corpus, tiny_documents
    documents = tiny_documents(120, words=200)
    corpus = prepare_tokens(tmp_path / "lm", tiny_corpus(documents), lambda: documents,
                            vocab_size=300, min_frequency=2, valid_fraction=0.2)
    return train, _lm_config(corpus)


def _lm_config(corpus: Path):
    """A two-evaluation LM run of the tiny model on the prepared data at ``corpus``."""
    from test_lm import TINY_MODEL, TINY_RECIPE
    from test_vision import config
    return config("+exp=llama_71m_un", "logger=none", "device=cpu", "scale.num_workers=0",
                  f"data.root={corpus}", "norm.warmup_iters=2", *TINY_MODEL, *TINY_RECIPE)


@pytest.mark.parametrize("task", [pytest.param("classification", marks=pytest.mark.slow),
                                  pytest.param("detection", marks=pytest.mark.slow),
                                  "language_modelling"])
def test_every_trainer_resumes_a_kill_in_its_save_to_the_uninterrupted_run(task, tmp_path,
                                                                          monkeypatch):
    train, cfg = _trainer_run(task, tmp_path)
    want = train(cfg, tmp_path / "whole")
    run_dir = tmp_path / "killed"
    with monkeypatch.context() as killing, pytest.raises(SimulatedKill):
        KillAt(killing, ("append_row", 1))  # after epoch 1's checkpoint: the doubled row
        train(cfg, run_dir)
    assert "\n" not in (run_dir / "metrics.jsonl").read_text()  # epoch 1's row half written
    got = train(cfg, run_dir)
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [row["epoch"] for row in rows] == [1, 2]
    assert got["steps"] == want["steps"] and got["status"] == want["status"]
    for key, value in want["metrics"].items():
        if key not in TIMES:
            assert got["metrics"][key] == pytest.approx(value, rel=1e-5, abs=1e-7), key
    torch.testing.assert_close(load_checkpoint(run_dir / "last.pt")["model"],
                               load_checkpoint(tmp_path / "whole" / "last.pt")["model"],
                               rtol=1e-5, atol=1e-6)


# --- one run per folder ---------------------------------------------------------------------------

HOLD = ("import sys, time; from pathlib import Path; from plugins.runlog import run_folder_lock\n"
        "with run_folder_lock(Path(sys.argv[1])):\n    print('held', flush=True); time.sleep(120)")


def _holder(run_dir: Path) -> subprocess.Popen:
    """Another process that holds ``run_dir`` as a run does."""
    holder = subprocess.Popen([sys.executable, "-c", HOLD, str(run_dir)], cwd=ROOT,
                              stdout=subprocess.PIPE, text=True)
    assert holder.stdout.readline().strip() == "held"
    return holder


def test_a_second_run_into_a_held_folder_is_refused_and_a_dead_holder_blocks_nothing(tmp_path):
    train, cfg = _trainer_run("language_modelling", tmp_path)  # the cheapest on run_task
    run_dir = tmp_path / "run"
    holder = _holder(run_dir)
    try:
        with pytest.raises(RunFolderInUse, match=rf"{run_dir} is in use by another run .*"
                                                 rf"\"pid\": {holder.pid}.*hydra\.run\.dir"):
            train(cfg, run_dir)
        assert sorted(p.name for p in run_dir.iterdir()) == [LOCK_FILE]  # nothing else written
    finally:
        holder.send_signal(signal.SIGKILL)  # dies holding it
        holder.wait()
    assert train(cfg, run_dir)["status"] in FINISHED


FOLDER = ("import sys; sys.path.insert(0, 'scripts'); import train  # its resolvers\n"
          "from hydra import compose, initialize_config_dir\n"
          "with initialize_config_dir(sys.argv[1], version_base='1.3'):\n"
          "    print(compose('train', ['+exp=swin_t_un'], return_hydra_config=True).hydra.run.dir)")


def test_default_run_folders_of_runs_started_together_differ():
    """scripts/train.py's default hydra.run.dir, in two processes started at once."""
    runs = [subprocess.Popen([sys.executable, "-c", FOLDER, str(ROOT / "configs")], cwd=ROOT,
                             stdout=subprocess.PIPE, text=True) for _ in range(2)]
    folders = [run.communicate()[0].strip() for run in runs]
    assert all(folder.startswith("runs/swin_t_un-full/20") for folder in folders), folders
    assert folders[0] != folders[1], folders


def test_a_resume_onto_other_data_is_refused_naming_what_differs(tmp_path, monkeypatch):
    """The run's data record (the corpus, its splits' hashes) is in every checkpoint: a resume
    whose prepared data differs (rebuilt from other documents) is refused, writing nothing."""
    from plugins.lm.data import prepare_tokens
    from test_lm_data import tiny_corpus, tiny_documents

    train, cfg = _trainer_run("language_modelling", tmp_path)
    run_dir = tmp_path / "killed"
    with monkeypatch.context() as killing, pytest.raises(SimulatedKill):
        KillAt(killing, ("append_row", 1))  # after epoch 1's checkpoint
        train(cfg, run_dir)
    documents = tiny_documents(121, words=200)  # one document more
    other = prepare_tokens(tmp_path / "other", tiny_corpus(documents), lambda: documents,
                           vocab_size=300, min_frequency=2, valid_fraction=0.2)
    shutil.rmtree(cfg.data.root)  # the data swapped in place: the options stay the same
    shutil.copytree(other, cfg.data.root)
    before = {p: p.read_bytes() for p in run_dir.iterdir() if p.name != LOCK_FILE}
    with pytest.raises(ValueError, match=rf"refusing to resume {run_dir}: its data differs from "
                                         r"what the run trained on: .*sha256"):
        train(cfg, run_dir)
    assert {p: p.read_bytes() for p in run_dir.iterdir() if p.name != LOCK_FILE} == before
