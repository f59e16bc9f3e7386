"""fairseq checkpoints read without running their pickle (runs in fairseq's environment).

fairseq 0.12.2 loads checkpoints with ``torch.load``'s unsafe default of torch 2.5 (it
unpickles anything). So every checkpoint that fairseq is to load from outside the run goes
through ``plugins.checkpoints.load_checkpoint`` here first: the ``resume`` directory's
``checkpoint_last.pt`` is checked, and ``init_from`` is rewritten as ``<run>/init.pt`` from
what the safe load rebuilt (tensors and plain containers only), which fairseq then fine-tunes
from (``--finetune-from-model``). ``trust_checkpoint=true`` (``--trusted``) unpickles anything.

    python -m plugins.fairseq.checkpoints check --option resume CHECKPOINT [--trusted]
    python -m plugins.fairseq.checkpoints rejections --option resume CHECKPOINT [--trusted]
    python -m plugins.fairseq.checkpoints init --option init_from SOURCE TARGET \\
        [--reset-norm-steps] [--trusted] -- TRAIN_ARGS...

A refusal exits with ``REFUSALS``'s code and its message as the last line of stderr; the
launcher raises it again in the main environment.
"""
from __future__ import annotations

import argparse
import json
import sys

from plugins.checkpoints import UnsafeCheckpoint, load_checkpoint, save_atomic

# exit code -> the exception the launcher raises with the message
REFUSALS = {3: UnsafeCheckpoint, 4: ValueError}
# what fairseq's checkpoints hold besides tensors and plain containers: the model's options
# (``cfg["model"]`` of a model with command-line options, as ours); rebuilt attribute by attribute
FAIRSEQ_GLOBALS = (argparse.Namespace,)


def load(path, option: str, trusted: bool = False) -> dict:
    """A fairseq checkpoint of ours, read without running its pickle (``trusted``: with)."""
    try:
        state = load_checkpoint(path, trusted=trusted, opt_in="trust_checkpoint=true",
                                extra_globals=FAIRSEQ_GLOBALS)
    except UnsafeCheckpoint as error:
        raise UnsafeCheckpoint(f"{option}: {error}") from error
    if not isinstance(state, dict) or not isinstance(state.get("model"), dict):
        raise ValueError(f"{option}: {path} is not a fairseq checkpoint (no 'model' weights); pass "
                         "a translation run's checkpoints/checkpoint_last.pt (or checkpoint_avgN.pt)")
    return state


def build_model(train_args: list[str]):
    """The model fairseq-train builds from ``train_args`` (its command line)."""
    from fairseq import options, tasks
    from fairseq.dataclass.utils import convert_namespace_to_omegaconf

    args = options.parse_args_and_arch(options.get_training_parser(), train_args)
    cfg = convert_namespace_to_omegaconf(args)
    return tasks.setup_task(cfg.task).build_model(cfg.model)


def prepare_init(source: str, target: str, option: str, trusted: bool, reset_norm_steps: bool,
                 train_args: list[str]) -> None:
    """Write ``source``'s weights, loaded into the run's model, as ``target``; with
    ``reset_norm_steps`` the norms' step counters restart as ``unnorm.reset_steps`` does."""
    import unnorm

    state = load(source, option, trusted)
    model = build_model(train_args)
    own, theirs = model.state_dict(), state["model"]
    missing = sorted(set(own) - set(theirs))
    unexpected = sorted(set(theirs) - set(own))
    reshaped = [f"{k} {tuple(theirs[k].shape)} there, {tuple(own[k].shape)} here"
                for k in sorted(set(own) & set(theirs)) if theirs[k].shape != own[k].shape]
    if missing or unexpected or reshaped:
        raise ValueError(
            f"{option}: {source} does not fit this run's model: {len(missing)} tensors missing "
            f"{missing[:3]}, {len(unexpected)} unexpected {unexpected[:3]}, {len(reshaped)} of another "
            f"shape {reshaped[:3]}; fine-tune from a run with the same model and norm")
    model.load_state_dict(theirs, strict=True)
    if reset_norm_steps:
        unnorm.reset_steps(model)
    state["model"] = model.state_dict()
    state["last_optimizer_state"] = None  # fine-tuning resets the optimizer
    save_atomic(state, target)


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("action", choices=["check", "rejections", "init"])
    parser.add_argument("paths", nargs="+", help="the checkpoint (init: SOURCE TARGET)")
    parser.add_argument("--option", required=True, help="the setting that named the file")
    parser.add_argument("--trusted", action="store_true", help="trust_checkpoint=true")
    parser.add_argument("--reset-norm-steps", action="store_true")
    argv, train_args = (argv[:argv.index("--")], argv[argv.index("--") + 1:]) if "--" in argv else (argv, [])
    args = parser.parse_args(argv)
    try:
        if args.action == "init":
            prepare_init(*args.paths, args.option, args.trusted, args.reset_norm_steps, train_args)
        else:
            state = load(args.paths[0], args.option, args.trusted)
            if args.action == "rejections":
                print(json.dumps({k: int(v) for k, v in state["model"].items()
                                  if k.endswith(".num_rejected")}))
    except tuple(REFUSALS.values()) as error:
        code = next(code for code, kind in REFUSALS.items() if isinstance(error, kind))
        print(" ".join(str(error).split()), file=sys.stderr)
        raise SystemExit(code)


if __name__ == "__main__":
    main(sys.argv[1:])
