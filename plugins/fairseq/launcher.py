"""Translation with fairseq, driven from the main environment: ``train(cfg, out_dir, overrides)``.

fairseq 0.12.2 runs in its own Python 3.10 environment (``.venv-fairseq``, or the prefix in
``UNNORM_FAIRSEQ_ENV``); this module imports nothing of it. It prepares the data if needed,
then runs fairseq's executables there as subprocesses: ``fairseq-train`` (JSON log; checkpoints
in ``<run>/checkpoints``, so a rerun with ``resume=<run>`` continues from fairseq's own
``checkpoint_last.pt``), the average of the last epoch checkpoints, ``fairseq-generate`` (beam
search, BPE removed, sacrebleu) and ``fairseq-score`` (fairseq's tokenised BLEU, the paper's
metric). Training losses read from the log feed the collapse test of the vision runs; a
collapse, or fairseq stopping on NaN/Inf, ends the run as ``status: FAIL``.
"""
from __future__ import annotations

import json
import math
import os
import re
import subprocess
from collections import deque
from pathlib import Path
from typing import Mapping, Optional, Sequence

import torch
from omegaconf import DictConfig, OmegaConf

from plugins.norms import fit_norm_to_run, norm_options
from plugins.runlog import (METRICS_FILE, CollapseDetector, RunDirectory, TrainingCollapsed,
                            record_collapse, rejected_steps)
from plugins.scale import effective_config

from .data import prepare
from .flags import norm_flags

REPO = Path(__file__).resolve().parents[2]
USER_DIR = Path(__file__).resolve().parent / "unnorm_fairseq"
CHECKPOINT = "checkpoints/checkpoint_last.pt"  # what resume= looks for in a run directory
# fairseq's own ways of stopping on a numerical failure
FAIRSEQ_FAILURES = ("Minimum loss scale reached", "gradients are Nan/Inf", "FloatingPointError")
_LOG_RECORD = re.compile(r"\| (train_inner|train|valid) \| (\{.*\})\s*$")
_BLEU = re.compile(r"BLEU4? = ([0-9.]+)")


class FairseqEnv:
    """The Python 3.10 environment holding fairseq, sacrebleu and subword-nmt."""

    def __init__(self):
        self.prefix = Path(os.environ.get("UNNORM_FAIRSEQ_ENV") or REPO / ".venv-fairseq")
        if not (self.prefix / "bin" / "fairseq-train").exists():
            raise FileNotFoundError(
                f"no fairseq environment at {self.prefix}: translation runs fairseq 0.12.2 in a "
                "Python 3.10 environment. Create it with `make fairseq-env` (needs python3.10, "
                "e.g. `pyenv install 3.10`), or on a cluster `conda env create -f "
                "environment-fairseq.yml` and export UNNORM_FAIRSEQ_ENV=<its prefix>")

    def bin(self, name: str) -> str:
        return str(self.prefix / "bin" / name)

    @property
    def environ(self) -> dict:
        # torch >= 2.6 loads checkpoints weights-only, which fairseq's checkpoints do not pass;
        # one OpenMP thread unless asked otherwise (as torchrun does): spinning threads that
        # share cores with anything else slow a small model several times over
        return {"OMP_NUM_THREADS": "1", **os.environ, "PYTHONUNBUFFERED": "1",
                "TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD": "1"}


def fairseq_flags(options: Mapping) -> list[str]:
    """``{max_tokens: 4096, share_all_embeddings: true}`` -> ``--max-tokens 4096 --share-all-embeddings``;
    false or null leaves a flag out."""
    flags: list[str] = []
    for key, value in options.items():
        flag = "--" + key.replace("_", "-")
        if value is True:
            flags.append(flag)
        elif value is not None and value is not False:
            flags += [flag, str(value)]
    return flags


def _container(node: Optional[DictConfig]) -> dict:
    return {} if node is None else OmegaConf.to_container(node, resolve=True)


def train_command(cfg: DictConfig, env: FairseqEnv, data: Path, save_dir: Path) -> list[str]:
    command = [env.bin("fairseq-train"), str(data), "--user-dir", str(USER_DIR),
               "--task", "translation", "--source-lang", cfg.data.source_lang,
               "--target-lang", cfg.data.target_lang, "--arch", cfg.model.arch,
               *norm_flags(cfg.norm.name, norm_options(cfg.norm)), "--seed", str(cfg.seed),
               "--save-dir", str(save_dir), "--keep-last-epochs", str(cfg.recipe.average_last),
               "--log-format", "json", "--num-workers", str(cfg.scale.num_workers)]
    if cfg.model.normalize_before:
        command += ["--encoder-normalize-before", "--decoder-normalize-before"]
    command += ["--norm-pad-mask", str(bool(cfg.model.norm_pad_mask)).lower()]
    train = _container(cfg.recipe.train)
    train["lr"] = train["lr"] * cfg.lr_multiple
    command += fairseq_flags(_container(cfg.model.args)) + fairseq_flags(train)
    return command + (["--cpu"] if cfg.device == "cpu" else [])


def run_training(command: Sequence[str], env: FairseqEnv, run: RunDirectory,
                 detector: CollapseDetector) -> int:
    """Run fairseq-train, copying its output to ``train.log`` and its epoch records to
    ``metrics.jsonl`` and watching its losses; returns the last update logged.

    Raises ``TrainingCollapsed`` (after stopping fairseq) on a collapse or on fairseq's own
    numerical failure, ``RuntimeError`` on any other failure.
    """
    update, failure = 0, None
    tail: deque = deque(maxlen=60)
    with open(run.path / "train.log", "a") as log:
        process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                   text=True, env=env.environ)
        try:
            for line in process.stdout:
                log.write(line)
                tail.append(line)
                failure = failure or next((m for m in FAIRSEQ_FAILURES if m in line), None)
                record = _LOG_RECORD.search(line)
                if record is None:
                    continue
                kind, stats = record.group(1), json.loads(record.group(2))
                if kind == "train_inner":
                    update = int(stats["num_updates"])
                    detector.update(update, torch.tensor(float(stats["loss"])))
                else:
                    run.log(kind=kind, **{k: float(v) for k, v in stats.items()})
            detector.check()
        finally:
            if process.poll() is None:  # a collapse, or the launcher interrupted: stop fairseq
                process.terminate()
                try:
                    process.wait(timeout=60)
                except subprocess.TimeoutExpired:
                    process.kill()
            process.wait()
    if process.returncode != 0:
        if failure:
            raise TrainingCollapsed(update + 1, f"fairseq stopped: {failure}")
        raise RuntimeError(f"fairseq-train failed (exit {process.returncode}); the end of "
                           f"{run.path / 'train.log'}:\n{''.join(tail)}")
    return update


def _last_records(run: RunDirectory) -> dict:
    """The last ``train`` and ``valid`` epoch records of the run, across resumes."""
    last: dict = {}
    path = run.path / METRICS_FILE
    for line in path.read_text().splitlines() if path.exists() else []:
        record = json.loads(line)
        last[record["kind"]] = record
    return last


def _run(command: Sequence[str], env: FairseqEnv, output: Optional[Path] = None) -> str:
    result = subprocess.run(command, capture_output=True, text=True, env=env.environ)
    if output is not None:
        output.write_text(result.stdout + result.stderr)
    if result.returncode != 0:
        raise RuntimeError(f"{Path(command[0]).name} failed (exit {result.returncode}):\n"
                           f"{(result.stdout + result.stderr)[-4000:]}")
    return result.stdout + result.stderr


def evaluate(cfg: DictConfig, env: FairseqEnv, data: Path, run: RunDirectory) -> dict:
    """Average the last epoch checkpoints, translate the test set with beam search, score it."""
    checkpoints = (run.path / "checkpoints").resolve()
    averaged = checkpoints / f"checkpoint_avg{cfg.recipe.average_last}.pt"
    _run([env.bin("python"), str(Path(__file__).parent / "average_checkpoints.py"),
          "--inputs", str(checkpoints), "--num-epoch-checkpoints", str(cfg.recipe.average_last),
          "--output", str(averaged)], env)
    command = [env.bin("fairseq-generate"), str(data), "--user-dir", str(USER_DIR),
               "--task", "translation", "--source-lang", cfg.data.source_lang,
               "--target-lang", cfg.data.target_lang, "--path", str(averaged),
               "--gen-subset", "test", "--scoring", "sacrebleu",
               *fairseq_flags(_container(cfg.recipe.generate))]
    output = _run(command + (["--cpu"] if cfg.device == "cpu" else []), env,
                  run.path / "generate-test.txt")
    bleu = _BLEU.findall(output)
    if not bleu:
        raise RuntimeError(f"no BLEU in {run.path / 'generate-test.txt'}")
    hypotheses, references = _generated(output)
    (run.path / "test.hyp").write_text("".join(h + "\n" for h in hypotheses))
    (run.path / "test.ref").write_text("".join(r + "\n" for r in references))
    scored = _run([env.bin("fairseq-score"), "--sys", str(run.path / "test.hyp"),
                   "--ref", str(run.path / "test.ref")], env)
    return {"bleu": float(bleu[-1]), "bleu_tokenized": float(_BLEU.findall(scored)[-1])}


def _generated(output: str) -> tuple[list[str], list[str]]:
    """fairseq-generate's hypotheses and references (BPE removed), in test-set order."""
    lines: dict[str, dict[int, str]] = {"H": {}, "T": {}}
    for line in output.splitlines():
        kind, _, rest = line.partition("-")
        if kind in lines and rest[:1].isdigit():
            index, *fields = rest.split("\t")
            lines[kind][int(index)] = fields[-1] if fields else ""
    order = sorted(lines["T"])
    return [lines["H"][i] for i in order], [lines["T"][i] for i in order]


def train(cfg: DictConfig, out_dir: Path, overrides: Sequence[str] = ()) -> dict:
    """Train, average, translate and score one run; returns the ``result.json`` content."""
    meta = {"exp_data": cfg.data.name, "overrides": list(overrides)}
    cfg = effective_config(cfg, overrides)
    for option in ("record_statistics", "compile"):
        if cfg[option]:
            raise ValueError(f"{option}=true is supported by classification and torchvision "
                             "detection; drop it for translation (fairseq trains the model)")
    cfg = fit_norm_to_run(cfg, cfg.recipe.train.max_update or 0)
    env = FairseqEnv()
    data = prepare(cfg.data, env.prefix)
    run = RunDirectory(Path(out_dir))
    resumed = (run.path / CHECKPOINT).exists()
    finished = run.begin(OmegaConf.to_yaml(cfg, resolve=True), resuming=resumed)
    if finished is not None:
        return finished
    meta = {**meta, "task": "translation", "exp": cfg.exp_name, "model": cfg.model.name,
            "data": cfg.data.name, "norm": cfg.norm.name, "norm_options": norm_options(cfg.norm),
            "norm_pad_mask": bool(cfg.model.norm_pad_mask), "seed": cfg.seed,
            "scale": cfg.scale.name, "run_dir": str(run.path)}
    command = train_command(cfg, env, data, (run.path / "checkpoints").resolve())
    print(f"{cfg.exp_name}: fairseq {cfg.model.arch} with {cfg.norm.name} on {cfg.data.name} "
          f"(scale {cfg.scale.name}{', resuming' if resumed else ''}); log: {run.path / 'train.log'}")
    (run.path / "train_command.txt").write_text(" ".join(command) + "\n")
    detector = CollapseDetector(**cfg.collapse)
    try:
        update = run_training(command, env, run, detector)
    except TrainingCollapsed as collapse:
        return record_collapse(run, collapse, {"train_loss": detector.last_loss},
                               {**meta, **norm_rejections(env, run)})
    last = _last_records(run)
    train_stats, valid_stats = last.get("train", {}), last.get("valid", {})
    steps = int(train_stats.get("train_num_updates", update))
    metrics = {"train_loss": train_stats.get("train_loss", math.nan),
               "valid_loss": valid_stats.get("valid_loss", math.nan),
               "valid_nll_loss": valid_stats.get("valid_nll_loss", math.nan),
               "epoch": int(train_stats.get("epoch", 0)), "num_updates": steps,
               **evaluate(cfg, env, data, run)}
    print(f"{cfg.exp_name}: BLEU {metrics['bleu']:.2f} (tokenised {metrics['bleu_tokenized']:.2f}) "
          f"after {steps} updates")
    return run.write_result(status="ok", metrics=metrics,
                            meta={**meta, "steps": steps, **norm_rejections(env, run)})


def norm_rejections(env: FairseqEnv, run: RunDirectory) -> dict:
    """``rejected_steps`` of the last checkpoint's norms (read in fairseq's environment, whose
    checkpoints hold its own objects)."""
    checkpoint = run.path / CHECKPOINT
    if not checkpoint.exists():
        return rejected_steps({})
    script = ("import json, sys, torch; state = torch.load(sys.argv[1], map_location='cpu', "
              "weights_only=False)['model']; print(json.dumps({k: int(v) for k, v in state.items() "
              "if k.endswith('.num_rejected')}))")
    printed = _run([env.bin("python"), "-c", script, str(checkpoint)], env)
    return rejected_steps(json.loads(printed.strip().splitlines()[-1]))
