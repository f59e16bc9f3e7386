"""Average the weights of a run's last N epoch checkpoints (runs in fairseq's environment).

fairseq's ``scripts/average_checkpoints.py`` does this, but its PyPI package does not ship its
``scripts/``. This follows it: the N highest-numbered ``checkpoint<epoch>.pt``, floating-point
tensors averaged, integer ones (the norms' step counters) floor-averaged, everything else from
the newest checkpoint; the optimizer state is dropped (generation does not read it). The
checkpoints are read without running their pickle (``plugins.fairseq.checkpoints``).

    python -m plugins.fairseq.average_checkpoints --inputs DIR --num-epoch-checkpoints N --output OUT [--trusted]
"""
import argparse
import re
from pathlib import Path

from plugins.checkpoints import save_atomic
from plugins.fairseq.checkpoints import load


def last_epoch_checkpoints(directory: Path, count: int) -> list:
    numbered = []
    for path in Path(directory).iterdir():
        match = re.fullmatch(r"checkpoint(\d+)\.pt", path.name)
        if match:
            numbered.append((int(match.group(1)), path))
    if len(numbered) < count:
        raise SystemExit(f"{directory} has {len(numbered)} epoch checkpoints, fewer than the "
                         f"{count} to average; train more epochs or average fewer")
    return [path for _, path in sorted(numbered)[-count:]]


def average(paths: list, trusted: bool = False) -> dict:
    total, newest = None, None
    for path in paths:
        state = load(path, "averaging the last checkpoints", trusted)
        model = state["model"]
        if total is None:
            total = {k: v.double() if v.is_floating_point() else v.clone() for k, v in model.items()}
        else:
            for key, value in model.items():
                total[key] += value
        newest = state
    averaged = {}
    for key, value in total.items():
        reference = newest["model"][key]
        averaged[key] = ((value / len(paths)).to(reference.dtype) if reference.is_floating_point()
                         else value // len(paths))
    newest["model"] = averaged
    newest["last_optimizer_state"] = None
    return newest


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--inputs", type=Path, required=True, help="the checkpoint directory")
    parser.add_argument("--num-epoch-checkpoints", type=int, required=True)
    parser.add_argument("--output", type=Path, required=True)
    parser.add_argument("--trusted", action="store_true", help="trust_checkpoint=true")
    args = parser.parse_args()
    paths = last_epoch_checkpoints(args.inputs, args.num_epoch_checkpoints)
    save_atomic(average(paths, args.trusted), args.output)
    print(f"averaged {', '.join(p.name for p in paths)} -> {args.output}")


if __name__ == "__main__":
    main()
