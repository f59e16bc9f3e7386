"""Translation with fairseq, driven from the main environment: ``train(cfg, out_dir, overrides)``.

fairseq 0.12.2 runs in its own Python 3.10 environment (``.venv-fairseq``, or the prefix in
``UNNORM_FAIRSEQ_ENV``); this module imports nothing of it. It prepares the data if needed,
then runs there, as subprocesses: ``plugins.fairseq.train`` (fairseq-train with the norms'
loss-scale guard; JSON log; checkpoints in ``<run>/checkpoints``, so a rerun with
``resume=<run>`` continues from fairseq's own ``checkpoint_last.pt``), the average of the last
epoch checkpoints, ``fairseq-generate`` (beam search, BPE removed, sacrebleu) and
``fairseq-score`` (fairseq's tokenised BLEU, the paper's metric). Training losses read from
the log feed the collapse test of the vision runs and the run's logger; a collapse, or
fairseq stopping on NaN/Inf, ends the run as ``status: FAIL``.

Settings of ``configs/train.yaml``, as translation takes them:

* ``amp: true`` trains in half precision on CUDA with fairseq's ``--fp16`` (the model cast to
  float16, the norms' statistics kept in float32, fairseq's dynamic loss scaler, which the
  norms do not see: ``plugins.fairseq.train``); off CUDA it does nothing, as
  ``plugins.precision.amp_context``. fairseq 0.12.2 has no bfloat16 on GPUs (its ``--bf16``
  implies ``--tpu``), so that flag is refused.
* Step units: the norms count micro-batches (one forward/backward), as the releases do, so
  every count derived from the run's length is in updates x ``update_freq``. The recipe's
  ``update_freq`` is per GPU for ``recipe.gpus`` GPUs; on another number of GPUs the
  launcher keeps GPUs x update_freq (the tokens of one update) as the recipe has it, unless
  the command line sets ``recipe.train.update_freq``.
* ``init_from`` fine-tunes from a translation run's checkpoint (``reset_norm_steps`` restarts
  UN/MABN/PN step counters as ``unnorm.reset_steps`` does); ``logger`` receives fairseq's
  records; ``compile``, ``record_statistics`` and ``scale.max_steps_per_epoch`` are refused.
* ``record_gns`` records the norms' per-example (per-sentence) gradient norms in
  ``<run>/gns/epoch_XXXX.pt`` as the other tasks do (``plugins.fairseq.train``); fairseq
  batches by tokens, so an epoch's ``batch_size`` there is its mean sentences per micro-batch,
  and the updates fairseq skips (overflows) are left out.
* ``sam=sam|sam_on|asam|asam_on`` and ``train_only=norm|norm+head`` train through the norms
  as the other tasks do (``plugins.sam``, applied by ``plugins.fairseq.train``: ``--sam true
  --sam-rho ...``, ``--train-only``); ``result.json`` records ``trainable_parameters`` (every
  run) and ``sam_perturbed_parameters``. SAM with more than one micro-batch per update, and
  ``norm+head`` with the output projection tied to the embeddings (the recipes'
  ``share_all_embeddings``), are refused, naming the fix.
* ``record_scale_invariance`` records, in ``result.json``'s ``scale_invariant``, the weights
  the model is exactly scale-invariant in at its start, as the other tasks do (found by
  ``plugins.fairseq.train``); ``record_updates`` adds each epoch's effective steps and
  AdamP/SGDP projections (``plugins.optim.UpdateRecord``, measured there) to that epoch's
  ``kind: train`` row of ``metrics.jsonl``; ``record_landscape=k`` probes every k-th
  update's loss landscape into the run folder's ``landscape.jsonl`` (``plugins.landscape``,
  measured there; float32 on one process); ``ws=nf`` and ``recipe.agc`` are the
  normalizer-free baseline (the model's ``--weight-standardization`` and ``--agc``).
* ``optimizer=<name>`` is fairseq's optimizer of that algorithm with every option stated
  (``optimizer_flags``: ``adamw`` fairseq's adam, whose decay is decoupled; ``adamp`` and
  ``sgdp`` the release's, registered by the user dir); optimizer flags in ``recipe.train``
  and an option fairseq's optimizer lacks are refused.
* Checkpoints given from outside (``init_from``, the ``resume`` directory's) are read without
  running their pickle (``plugins.fairseq.checkpoints``) before fairseq loads them;
  ``trust_checkpoint=true`` is the opt-in for files that need more.
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

from plugins.landscape import landscape_interval
from plugins.model_options import WS_OPTIONS, as_patterns
from plugins.norms import fit_norm_to_run, norm_kwargs
from plugins.optim import optimizer_options
from plugins.runlog import (METRICS_FILE, TRANSLATION_CHANCE, CollapseDetector, RunDirectory,
                            TrainingCollapsed, record_collapse, recorded_scale_invariance,
                            rejected_steps, run_folder_lock, run_logger, run_meta)
from plugins.scale import command_line_values, effective_config, norm_steps_per_update
from plugins.precision import check_amp

from .checkpoints import REFUSALS
from .data import prepare
from .flags import UPDATES, norm_flags, read_trained, sam_flags, train_only_flags

REPO = Path(__file__).resolve().parents[2]
USER_DIR = Path(__file__).resolve().parent / "unnorm_fairseq"
CHECKPOINT = "checkpoints/checkpoint_last.pt"  # what resume= looks for in a run directory
INIT = "init.pt"  # init_from as fairseq starts from it (read safely, counters reset if asked)
# fairseq's own ways of stopping on a numerical failure
FAIRSEQ_FAILURES = ("Minimum loss scale reached", "gradients are Nan/Inf", "FloatingPointError")
# fairseq-train's precision flags; amp (but false) chooses one itself
PRECISION_FLAGS = ("fp16", "bf16", "amp", "memory_efficient_fp16", "memory_efficient_bf16")
TPU_ONLY_FLAGS = ("bf16", "memory_efficient_bf16")  # fairseq 0.12.2: --bf16 implies --tpu
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

    def module(self, name: str) -> list[str]:
        """The command that runs one of this checkout's modules there (``plugins.fairseq.train``)."""
        return [self.bin("python"), "-m", name]

    @property
    def environ(self) -> dict:
        # this checkout's unnorm and plugins first, whatever the environment installed; one
        # OpenMP thread unless asked otherwise (as torchrun does): spinning threads that share
        # cores with anything else slow a small model several times over
        path = os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))
        return {"OMP_NUM_THREADS": "1", **os.environ, "PYTHONUNBUFFERED": "1", "PYTHONPATH": path}


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


#: fairseq's optimizer for each of ``plugins.optim``'s, and its flag for each option (None:
#: fairseq's has none, so only false passes): fairseq's adam decays weights decoupled, as
#: AdamW; adamp and sgdp are the release's (the user dir's)
FAIRSEQ_OPTIMIZERS = {
    "adamw": ("adam", {"betas": "adam_betas", "eps": "adam_eps"}),
    "sgd": ("sgd", {"momentum": "momentum", "nesterov": None}),
    "adamp": ("adamp", {"betas": "adam_betas", "eps": "adam_eps", "delta": "delta",
                        "wd_ratio": "wd_ratio", "nesterov": "nesterov"}),
    "sgdp": ("sgdp", {"momentum": "momentum", "nesterov": "nesterov", "eps": "eps",
                      "delta": "delta", "wd_ratio": "wd_ratio"}),
}
#: recipe.train keys that would choose the optimizer or its options past ``optimizer``
OPTIMIZER_FLAGS = {"optimizer"} | {flag for _, flags in FAIRSEQ_OPTIMIZERS.values()
                                   for flag in flags.values() if flag}


def optimizer_flags(cfg: DictConfig) -> list[str]:
    """fairseq-train's flags for the run's ``optimizer``, every option stated: ``--optimizer
    adam --adam-betas (0.9,0.98) --adam-eps 1e-08``. An option fairseq's optimizer lacks (SGD's
    Nesterov momentum) and optimizer flags in ``recipe.train`` are refused."""
    name, options = optimizer_options(cfg.optimizer)
    set_twice = sorted(OPTIMIZER_FLAGS & set(cfg.recipe.train))
    if set_twice:
        raise ValueError(f"recipe.train.{set_twice[0]}: translation's optimizer and its options "
                         f"come from optimizer=<name> (configs/optimizer; this run's: {name}); "
                         f"drop recipe.train.{set_twice[0]} and set optimizer=... or "
                         "optimizer.<option>=...")
    fairseq_name, flags = FAIRSEQ_OPTIMIZERS[name]
    for key, value in options.items():
        if flags[key] is None and value:
            raise ValueError(f"optimizer={name} with {key}={value}: fairseq's {fairseq_name} has "
                             f"no {key}; set optimizer.{key}=false for translation")
    if "betas" in options:
        options["betas"] = "({},{})".format(*options["betas"])
    return ["--optimizer", fairseq_name] + fairseq_flags(
        {flags[key]: value for key, value in options.items() if flags[key]})


def _container(node: Optional[DictConfig]) -> dict:
    return {} if node is None else OmegaConf.to_container(node, resolve=True)


def check_settings(cfg: DictConfig) -> None:
    """Refuse, naming the fix, every setting translation cannot honour."""
    for option in ("record_statistics", "compile"):
        if cfg[option]:
            raise ValueError(f"{option}=true is supported by classification and torchvision "
                             "detection; drop it for translation (fairseq trains the model)")
    if cfg.scale.max_steps_per_epoch:
        raise ValueError("scale.max_steps_per_epoch: fairseq's epochs always cover the whole "
                         "corpus; shorten a translation run with recipe.train.max_update (or "
                         "max_epoch) instead")
    if cfg.reset_norm_steps and not cfg.init_from:
        raise ValueError("reset_norm_steps=true restarts the step counters of the weights that "
                         "init_from loads; set init_from=<a translation run>/checkpoints/"
                         "checkpoint_last.pt, or drop reset_norm_steps")
    chosen = [key for key in PRECISION_FLAGS if cfg.recipe.train.get(key)]
    tpu_only = [key for key in TPU_ONLY_FLAGS if key in chosen]
    if tpu_only:
        raise ValueError(f"recipe.train.{tpu_only[0]}: fairseq 0.12.2's --bf16 implies --tpu "
                         "(torch_xla), which this project does not run; on GPUs train in half "
                         "precision with amp=auto (fairseq's --fp16)")
    if cfg.amp and chosen:
        raise ValueError(f"amp={cfg.amp} picks fairseq's precision itself (--fp16 on CUDA), and "
                         f"recipe.train sets {', '.join(chosen)} too; set amp=false to train "
                         "with the recipe's flag")


def fairseq_device(cfg: DictConfig) -> str:
    """``cuda`` or ``cpu``, as ``device`` (auto: CUDA when visible) resolves on this machine."""
    if cfg.device not in ("auto", "cpu", "cuda"):
        raise ValueError(f"device={cfg.device}: choose auto, cpu or cuda")
    if cfg.device == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("device=cuda but no CUDA device is visible; use device=cpu")
    return "cuda" if cfg.device != "cpu" and torch.cuda.is_available() else "cpu"


def replicas(cfg: DictConfig, device: str) -> int:
    """The processes fairseq trains with: one per visible GPU (its default), one on CPU."""
    if device == "cpu":
        return 1
    return int(cfg.recipe.train.get("distributed_world_size") or torch.cuda.device_count())


def fit_update_freq(cfg: DictConfig, overrides: Sequence[str], world: int) -> DictConfig:
    """``cfg`` with ``update_freq`` for ``world`` GPUs: the recipe's ``update_freq`` is per GPU
    for ``recipe.gpus`` GPUs (WMT14: 16 on 8), and an update keeps its tokens (GPUs x
    update_freq micro-batches) on any other number. An ``update_freq`` set on the command
    line (``overrides``) is kept as given."""
    if "recipe.train.update_freq" in command_line_values(cfg, overrides):
        return cfg
    recipe = cfg.recipe
    micro_batches = recipe.train.update_freq * recipe.gpus
    if micro_batches % world:
        raise ValueError(
            f"recipe {recipe.name} updates on {micro_batches} micro-batches ({recipe.train.update_freq} "
            f"per GPU on {recipe.gpus} GPUs), which {world} GPUs cannot share evenly: train on a "
            f"number of GPUs that divides {micro_batches} (CUDA_VISIBLE_DEVICES), or set "
            "recipe.train.update_freq (per GPU) yourself")
    cfg = cfg.copy()
    cfg.recipe.train.update_freq = micro_batches // world
    return cfg


#: fairseq's flags that make the output projection (train_only=norm+head's head) an embedding
TIED_HEAD_FLAGS = ("share_all_embeddings", "share_decoder_input_output_embed")


def check_training_through_norms(cfg: DictConfig) -> None:
    """Refuse, naming the fix, SAM over an update of several micro-batches, and norm+head
    where the head is the embeddings (``update_freq`` as the GPUs make it)."""
    sam = (cfg.get("sam") or {}).get("name", "none")
    micro_batches = max(int(value) for value in str(cfg.recipe.train.update_freq).split(","))
    if sam != "none" and micro_batches > 1:
        raise ValueError(f"sam with update_freq {micro_batches} ({micro_batches} micro-batches per "
                         "update) is not defined here: SAM's ascent needs the whole update's "
                         "gradient before its second pass. Use one micro-batch per update "
                         "(recipe.train.update_freq=1; more tokens per batch with "
                         "recipe.train.max_tokens, memory allowing), or sam=none")
    flags = {**_container(cfg.recipe.train), **_container(cfg.model.args)}
    tied = [flag for flag in TIED_HEAD_FLAGS if flags.get(flag)]
    if cfg.train_only == "norm+head" and tied:
        raise ValueError(f"train_only=norm+head: {' and '.join(tied)} ties the output projection "
                         "(the head) to the embeddings, so training it would train the input "
                         "embeddings too; untie it (" + ", ".join(
                             f"{'recipe.train' if flag in cfg.recipe.train else 'model.args'}.{flag}=false"
                             for flag in tied) + ") or use train_only=norm")


def run_length(cfg: DictConfig) -> int:
    """The run's length in norm steps (micro-batches): updates x micro-batches per update
    (0 when the recipe sets no ``max_update``)."""
    return (cfg.recipe.train.max_update or 0) * norm_steps_per_update(cfg)


def check_precision(cfg: DictConfig, device: str) -> None:
    """Refuse an ``amp`` fairseq cannot train in on ``device``: it has bf16 only on TPUs, and
    fp16 only on CUDA (other values: as ``plugins.precision.autocast_dtype`` says)."""
    check_amp(cfg.amp)
    if cfg.amp == "bf16":
        raise ValueError("amp=bf16: fairseq 0.12.2's --bf16 implies --tpu (torch_xla), which this "
                         "project does not run; on GPUs use amp=auto or amp=fp16 (fairseq's --fp16)")
    if cfg.amp == "fp16" and device != "cuda":
        raise ValueError("amp=fp16: fairseq trains in fp16 on CUDA only; on a CPU use amp=auto or "
                         "amp=false (float32); the other tasks' trainers rehearse autocast on a CPU")
    if cfg.recipe.get("agc") is not None and precision_flags(cfg, device):
        raise ValueError(f"recipe.agc={cfg.recipe.agc} with amp={cfg.amp} on {device}: fairseq's "
                         "--fp16 optimizer steps a float32 copy of the weights that adaptive "
                         "clipping does not reach (plugins.fairseq.train); set amp=false to train "
                         "in float32, or recipe.agc=null")


def precision_flags(cfg: DictConfig, device: str) -> list[str]:
    """``amp=auto`` or ``amp=fp16`` on CUDA: fairseq's ``--fp16`` (its loss scaler); float32
    otherwise (``check_precision`` refused the rest)."""
    return ["--fp16"] if cfg.amp and device == "cuda" else []


#: fairseq's Transformer layers have two placements, a layer option each; Peri- and Mix-LN
#: are the language-modelling task's (plugins/lm)
PLACEMENT_FLAGS = {"pre": ["--encoder-normalize-before", "--decoder-normalize-before"], "post": []}


def placement_flags(position: str) -> list[str]:
    if position not in PLACEMENT_FLAGS:
        raise ValueError(f"model.norm_position={position!r}: fairseq's Transformer layer places "
                         f"its norms {' or '.join(PLACEMENT_FLAGS)} (normalize_before); peri and mix "
                         "are placements of the language-modelling decoder (+exp=llama_71m_<norm>)")
    return PLACEMENT_FLAGS[position]


def standardization_flags(model: DictConfig) -> list[str]:
    """``model.weight_standardization`` (fnmatch patterns of fairseq's layer names; ``ws=nf``:
    ``model.nf_targets``) and its options as the model's flags; none when it is null."""
    patterns = model.get("weight_standardization")
    if patterns is None:
        return []
    flags = ["--weight-standardization", *as_patterns(patterns)]
    for key in WS_OPTIONS:
        if model.get(key) is not None:
            flags += [f"--{key.replace('_', '-')}", str(model[key])]
    return flags


def train_command(cfg: DictConfig, env: FairseqEnv, data: Path, save_dir: Path,
                  device: str = "cpu") -> list[str]:
    command = [*env.module("plugins.fairseq.train"), str(data), "--user-dir", str(USER_DIR),
               "--task", "translation", "--source-lang", cfg.data.source_lang,
               "--target-lang", cfg.data.target_lang, "--arch", cfg.model.arch,
               *norm_flags(cfg.norm.name, norm_kwargs(cfg.norm)), "--seed", str(cfg.seed),
               "--save-dir", str(save_dir), "--keep-last-epochs", str(cfg.recipe.average_last),
               "--log-format", "json", "--num-workers", str(cfg.scale.num_workers)]
    command += placement_flags(cfg.model.norm_position)
    command += ["--norm-pad-mask", str(bool(cfg.model.norm_pad_mask)).lower()]
    if cfg.record_gns:  # into the run directory, whose checkpoints/ fairseq saves to
        command += ["--record-gns", str(save_dir.parent)]
    if cfg.get("record_scale_invariance"):
        command += ["--record-scale-invariance", str(save_dir.parent)]
    if cfg.get("record_updates"):
        command += ["--record-updates"]
    if landscape_interval(cfg.get("record_landscape")):
        command += ["--record-landscape", str(cfg.record_landscape), "--landscape-dir",
                    str(save_dir.parent)]
    command += sam_flags(_container(cfg.get("sam"))) + train_only_flags(cfg.train_only)
    command += standardization_flags(cfg.model)
    if cfg.recipe.get("agc") is not None:
        command += ["--agc", str(cfg.recipe.agc)]
    train = _container(cfg.recipe.train)
    train["lr"] = train["lr"] * cfg.lr_multiple
    command += optimizer_flags(cfg)
    command += fairseq_flags(_container(cfg.model.args)) + fairseq_flags(train)
    command += precision_flags(cfg, device)
    if cfg.init_from:
        command += ["--finetune-from-model", str(save_dir.parent / INIT)]
    # one process on CPU: fairseq would otherwise spawn one per GPU it sees
    return command + (["--cpu", "--distributed-world-size", "1"] if device == "cpu" else [])


def run_training(command: Sequence[str], env: FairseqEnv, run: RunDirectory,
                 detector: CollapseDetector, logger) -> int:
    """Run fairseq-train, copying its output to ``train.log``, its epoch records to
    ``metrics.jsonl`` and every record to ``logger`` (``train_inner/...`` for the per-update
    ones, at fairseq's ``log_interval``), and watching its losses; returns the last update
    logged.

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
                    logger.log({f"train_inner/{k}": float(v) for k, v in stats.items()}, step=update)
                else:  # an epoch's (--record-updates: with the updates' record, as it is)
                    updates = stats.pop(f"{kind}_{UPDATES}", {})
                    stats = {k: float(v) for k, v in stats.items()}
                    run.log(kind=kind, **stats, **updates)
                    logger.log(stats, step=int(stats[f"{kind}_num_updates"]))
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


def evaluate(cfg: DictConfig, env: FairseqEnv, data: Path, run: RunDirectory, device: str) -> dict:
    """Average the last epoch checkpoints, translate the test set with beam search, score it."""
    checkpoints = (run.path / "checkpoints").resolve()
    averaged = checkpoints / f"checkpoint_avg{cfg.recipe.average_last}.pt"
    _run([*env.module("plugins.fairseq.average_checkpoints"), "--inputs", str(checkpoints),
          "--num-epoch-checkpoints", str(cfg.recipe.average_last), "--output", str(averaged),
          *(["--trusted"] if cfg.trust_checkpoint else [])], env)
    command = [env.bin("fairseq-generate"), str(data), "--user-dir", str(USER_DIR),
               "--task", "translation", "--source-lang", cfg.data.source_lang,
               "--target-lang", cfg.data.target_lang, "--path", str(averaged),
               "--gen-subset", "test", "--scoring", "sacrebleu",
               *fairseq_flags(_container(cfg.recipe.generate))]
    output = _run(command + (["--cpu"] if device == "cpu" else []), env,
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


def run_config(cfg: DictConfig, overrides: Sequence[str] = ()) -> tuple[DictConfig, str, int]:
    """The run's configuration as it trains on this machine, with its device and number of
    processes: the scale applied, the settings checked, ``update_freq`` for the GPUs there
    are, and the norm fitted to the run's length in norm steps."""
    cfg = effective_config(cfg, overrides)
    check_settings(cfg)
    device = fairseq_device(cfg)
    check_precision(cfg, device)
    world = replicas(cfg, device)
    cfg = fit_update_freq(cfg, overrides, world)
    check_training_through_norms(cfg)
    return fit_norm_to_run(cfg, run_length(cfg)), device, world


def train(cfg: DictConfig, out_dir: Path, overrides: Sequence[str] = ()) -> dict:
    """Train, average, translate and score one run, holding its folder (``run_folder_lock``)
    once its settings pass; returns the ``result.json`` content."""
    meta = {"exp_data": cfg.paper.data.name, "overrides": list(overrides)}  # as tables group runs
    cfg, device, world = run_config(cfg, overrides)
    with run_folder_lock(Path(out_dir)):
        return _train(cfg, out_dir, meta, device, world)


def _train(cfg: DictConfig, out_dir: Path, meta: dict, device: str, world: int) -> dict:
    env = FairseqEnv()
    data = prepare(cfg.data, env.prefix)
    run = RunDirectory(Path(out_dir))
    resumed = (run.path / CHECKPOINT).exists()
    finished = run.begin(OmegaConf.to_yaml(cfg, resolve=True), resuming=resumed)
    if finished is not None:
        return finished
    trusted = bool(cfg.trust_checkpoint)
    command = train_command(cfg, env, data, (run.path / "checkpoints").resolve(), device)
    if resumed:  # fairseq unpickles checkpoint_last.pt: read it safely first
        checkpoint_tool(env, "check", "resume", str(run.path / CHECKPOINT), trusted=trusted)
    elif cfg.init_from:
        checkpoint_tool(env, "init", "init_from", str(Path(cfg.init_from).resolve()),
                        str((run.path / INIT).resolve()), trusted=trusted,
                        extra=["--reset-norm-steps"] * bool(cfg.reset_norm_steps)
                        + ["--", *command[len(env.module("plugins.fairseq.train")):]])
    meta = {**meta, **run_meta(cfg, "translation", world, run.path,
                               norm_pad_mask=bool(cfg.model.norm_pad_mask),
                               init=cfg.init_from or "scratch",
                               update_freq=cfg.recipe.train.update_freq,
                               chance=TRANSLATION_CHANCE)}
    print(f"{cfg.exp_name}: fairseq {cfg.model.arch} with {cfg.norm.name} on {cfg.data.name} "
          f"(scale {cfg.scale.name}, {world} {device} process(es), update_freq "
          f"{cfg.recipe.train.update_freq}{', resuming' if resumed else ''}); log: {run.path / 'train.log'}")
    (run.path / "train_command.txt").write_text(" ".join(command) + "\n")
    detector = CollapseDetector(**cfg.collapse)
    logger = run_logger(cfg, run.path)
    try:
        update = run_training(command, env, run, detector, logger)
    except TrainingCollapsed as collapse:
        return record_collapse(run, collapse, {"train_loss": detector.last_loss},
                               {**meta, **trained(run), **recorded_scale_invariance(run.path),
                                **norm_rejections(env, run, trusted)})
    finally:
        logger.finish()
    last = _last_records(run)
    train_stats, valid_stats = last.get("train", {}), last.get("valid", {})
    steps = int(train_stats.get("train_num_updates", update))
    metrics = {"train_loss": train_stats.get("train_loss", math.nan),
               "valid_loss": valid_stats.get("valid_loss", math.nan),
               "valid_nll_loss": valid_stats.get("valid_nll_loss", math.nan),
               "epoch": int(train_stats.get("epoch", 0)), "num_updates": steps,
               **evaluate(cfg, env, data, run, device)}
    print(f"{cfg.exp_name}: BLEU {metrics['bleu']:.2f} (tokenised {metrics['bleu_tokenized']:.2f}) "
          f"after {steps} updates")
    return run.write_result(status="ok", metrics=metrics,
                            meta={**meta, "steps": steps, **trained(run),
                                  **recorded_scale_invariance(run.path),
                                  **norm_rejections(env, run, trusted)})


def trained(run: RunDirectory) -> dict:
    """What the run trains, as ``plugins.fairseq.train`` printed it last (``trainable_parameters``,
    ``sam_perturbed_parameters`` with SAM)."""
    log = run.path / "train.log"
    return read_trained(log.read_text()) if log.exists() else {}


def checkpoint_tool(env: FairseqEnv, action: str, option: str, *paths: str, trusted: bool = False,
                    extra: Sequence[str] = ()) -> str:
    """Run ``plugins.fairseq.checkpoints ACTION`` in fairseq's environment; its refusals come
    back as they were raised there (``UnsafeCheckpoint``, ``ValueError``), naming ``option``."""
    command = [*env.module("plugins.fairseq.checkpoints"), action, "--option", option, *paths,
               *(["--trusted"] if trusted else []), *extra]
    result = subprocess.run(command, capture_output=True, text=True, env=env.environ)
    if result.returncode in REFUSALS:
        raise REFUSALS[result.returncode](result.stderr.strip().splitlines()[-1])
    if result.returncode != 0:
        raise RuntimeError(f"plugins.fairseq.checkpoints {action} failed (exit {result.returncode}):\n"
                           f"{(result.stdout + result.stderr)[-4000:]}")
    return result.stdout


def norm_rejections(env: FairseqEnv, run: RunDirectory, trusted: bool) -> dict:
    """``rejected_steps`` of the last checkpoint's norms (read in fairseq's environment)."""
    checkpoint = run.path / CHECKPOINT
    if not checkpoint.exists():
        return rejected_steps({})
    printed = checkpoint_tool(env, "rejections", "resume", str(checkpoint), trusted=trusted)
    return rejected_steps(json.loads(printed.strip().splitlines()[-1]))
