"""The one training entry: ``python scripts/train.py +exp=swin_t_un [scale=cpu] [key=value ...]``.

Multirun sweeps: ``python scripts/train.py -m +exp=swin_t_un norm.window_size=2,4,6``.
Several GPUs: ``torchrun --nproc_per_node=8 scripts/train.py +exp=...``.
"""
from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import project_env  # noqa: F401  (first: the project's Python, whatever `python` ran this)

import hydra
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig, OmegaConf

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # plugins/ from a plain checkout

from plugins.runlog import RESULT_FILE, run_folder_suffix  # noqa: E402

SUFFIX = run_folder_suffix()  # once: Hydra may resolve hydra.run.dir more than once
OmegaConf.register_new_resolver("run_suffix", lambda: SUFFIX)


@hydra.main(config_path="../configs", config_name="train", version_base="1.3")
def main(cfg: DictConfig) -> float:
    """Train one run; a launch refused before its run wrote anything leaves no folder (Hydra
    makes one for every launch, a resume's too)."""
    hydra_cfg = HydraConfig.get()
    launched = Path(hydra_cfg.runtime.output_dir)
    hydra_own = {".hydra", f"{hydra_cfg.job.name}.log"}  # what Hydra writes before the job
    try:
        return run(cfg)
    except BaseException:
        try:
            if {path.name for path in launched.iterdir()} <= hydra_own:
                shutil.rmtree(launched)
        except OSError:  # another replica of the launch removed it first
            pass
        raise


def run(cfg: DictConfig) -> float:
    from plugins.fsdp import STRATEGIES, check_distributed  # fairseq and mmdetection too
    sharding = cfg.task == "language_modelling"
    check_distributed(cfg, STRATEGIES if sharding else ("ddp",), activation_checkpointing=sharding)
    if cfg.task == "classification":
        from plugins.timm.trainer import CHECKPOINT, train
        metric = "top1"
    elif cfg.task == "translation":
        from plugins.fairseq.launcher import CHECKPOINT, train
        metric = "bleu"
    elif cfg.task == "detection" and cfg.model.backend == "torchvision":
        from plugins.torchvision.trainer import CHECKPOINT, train
        metric = "bbox_AP"
    elif cfg.task == "detection" and cfg.model.backend == "mmdet":
        from plugins.mmdet.runner import CHECKPOINT, train
        metric = "bbox_AP"
    elif cfg.task == "language_modelling":
        from plugins.lm.trainer import CHECKPOINT, train
        metric = "val_loss"
    elif cfg.task == "graph":
        from plugins.graph.trainer import CHECKPOINT, train
        metric = "acc" if cfg.data.name.startswith("sbm_") else "mae"
    elif cfg.task == "text_classification":
        from plugins.text.trainer import CHECKPOINT, train
        metric = "val_acc"
    elif cfg.task == "detection":
        raise ValueError(f"unknown detection backend {cfg.model.backend!r}; choose "
                         "model.backend=torchvision or model.backend=mmdet")
    else:
        raise ValueError(f"unknown task {cfg.task!r}; this checkout trains: classification, "
                         "translation, detection, language_modelling, graph, text_classification")
    out_dir = Path(cfg.resume) if cfg.resume else Path(HydraConfig.get().runtime.output_dir)
    if cfg.resume and not any((out_dir / name).exists() for name in (CHECKPOINT, RESULT_FILE)):
        raise FileNotFoundError(f"resume={cfg.resume}: no {CHECKPOINT} there; pass the run "
                                "directory of the run to continue (runs/<exp>/<time>)")
    result = train(cfg, out_dir, HydraConfig.get().overrides.task)
    print(json.dumps({k: result[k] for k in ("status", "exp", "norm", "metrics", "fail_step",
                                            "fail_reason", "run_dir")}, indent=2))
    return result["metrics"].get(metric, float("nan"))


def check_experiments(args: list[str]) -> None:
    """Refuse a mistyped ``+exp=`` before Hydra starts, naming the closest names; Hydra would
    list every experiment (~150) around its one-line error. Globs and ranges are Hydra's."""
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.core.override_parser.types import ValueType

    from hydra_plugins.unnorm_experiments import check_experiment
    parser = OverridesParser.create()
    for arg in args:
        if arg.lstrip("+").partition("=")[0].partition("@")[0] != "exp":
            continue
        override = parser.parse_override(arg)
        if override.value_type == ValueType.ELEMENT:
            names = [override.get_value_element_as_str()]
        elif override.value_type in (ValueType.CHOICE_SWEEP, ValueType.SIMPLE_CHOICE_SWEEP):
            names = list(override.sweep_string_iterator())
        else:
            continue
        for name in names:
            check_experiment(name)


if __name__ == "__main__":
    try:
        check_experiments(sys.argv[1:])
    except ValueError as error:
        sys.exit(str(error))
    main()
