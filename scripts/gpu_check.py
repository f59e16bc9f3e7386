"""The checks of a lent GPU, in order of value within a time budget: the CUDA tests, Table 8 on
Swin-T (inference), compiled bf16 training steps, the LM's norms, every norm per layer, every
norm's training step in whole models, and where a norm's step spends its time.

    python scripts/gpu_check.py --out-dir $OUT                 # on the GPU machine, 420 s
    python scripts/gpu_check.py --dry-run --out-dir /tmp/gpu   # every step at toy size, CPU

A GPU lent to this project comes for about 15 minutes, start-up included, and does not come
back: every step runs in a subprocess with the budget that is left as its timeout, each
writes its JSON into --out-dir the moment it finishes, and ``gpu_check.json`` (the device, its
driver, torch, CUDA, the commit, and each step's status and seconds) is rewritten after every
step, so a cut run still returns what it measured. A step that would outlast the budget is
stopped ("cut"); those after it are "not started". Everything the steps print goes to
``gpu_check.log``. The machine's tree has no ``.git``: ``--commit`` names what it is, and the
benchmarks record it (``benchmark.COPIED_TREE_COMMIT``). ``docs/efficiency.md#on-a-gpu`` says
how to run it on a lent machine and where its files are committed.
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SUMMARY = "gpu_check.json"
LOG = "gpu_check.log"
SWIN_VARIANTS = ["ln", "un", "un_folded", "prepbn_folded", "no_norm"]  # Table 8's, and UN's
# on the CPU: the same steps at toy size (a batch of one or two, two rounds, one warm-up; the
# models eager, since compiling Swin-T alone takes minutes here and tests/test_compile.py
# compiles; each model with LN, the no-norm limit and one more variant), without the CPU's
# peak-RSS probe: it runs six fresh processes a model, most of the rehearsal's time, and a
# GPU reads its allocator's count instead (tests/test_benchmark.py runs the probe)
TOY = ["--device", "cpu", "--rounds", "2", "--warmup", "1"]
TOY_MODEL = [*TOY, "--batch", "1", "--train-batch", "2", "--img-size", "64", "--batches", "1",
             "--lm-context", "16", "--memory-rounds", "0", "--no-compile"]


def steps(out_dir: Path, dry_run: bool) -> list[tuple[str, list[str], str | None]]:
    """``(name, arguments after python, the JSON it writes in out_dir)``, in order of value.
    Seconds on an H200 (2026-11-28): tests 37-45, Swin-T inference 185 and training 230 (mostly
    compiling), the LM 40, each eager norms step about 20, the compiled one 103 (every norm),
    the models' eager training steps about 45 a model, the profile 13."""
    def benchmark(out, *args, toy_variant=None):
        toy = [*TOY_MODEL, *(["--variants", toy_variant] if toy_variant else [])]
        return ["scripts/benchmark.py", *args, "--out", str(out_dir / out), *(toy if dry_run else [])]

    def norms(dtype, compiled=False):
        name = f"norms_{dtype}{'_compiled' * compiled}"
        out = f"norms_cuda_{dtype}{'_compiled' * compiled}.json"
        return (name, ["scripts/bench_norms.py", "--shapes", "tokens", "--dtype", dtype,
                       "--out", str(out_dir / out), *([] if compiled else ["--no-compile"]),
                       *([*TOY, "--norms", "ln", "un", "rms"] if dry_run
                         else ["--batch-scale", "8"])], out)
    return [
        ("tests", ["-m", "pytest", "-q", "-p", "no:cacheprovider", "-k", "cuda",
                   "tests/test_compile.py", "tests/test_scale_path.py",
                   "--junitxml", str(out_dir / "tests_cuda.xml")], "tests_cuda.xml"),
        ("swin_t_inference", benchmark("inference_cuda.json", "--models", "swin_t", "--parts",
                                       "inference", "--variants", *SWIN_VARIANTS,
                                       toy_variant="un_folded"),
         "inference_cuda.json"),
        ("swin_t_training", benchmark("training_cuda.json", "--models", "swin_t", "--parts",
                                      "training", "--train-norms", "ln", "un"),
         "training_cuda.json"),
        # eager, as Pre-CRMSNorm's paper measured it; compiling the LM's variants takes minutes
        ("llama_71m", benchmark("inference_cuda_llama.json", "--models", "llama_71m", "--parts",
                                "inference", "--variants", "ln", "rms_converted",
                                "crms_converted", "un_folded", "--batch", "128", "--no-compile",
                                toy_variant="crms_converted"),
         "inference_cuda_llama.json"),
        norms("bfloat16"),
        norms("float32"),
        norms("bfloat16", compiled=True),
        # every norm's training step in whole models, eager under bf16 autocast (issue 51)
        ("models_training_eager",
         ["scripts/benchmark.py", "--parts", "training", "--no-compile", "--rounds", "7",
          "--batches", "3", "--train-batch", "64", "--memory-rounds", "0",
          "--out", str(out_dir / "training_cuda_norms_eager.json"),
          *([*TOY_MODEL, "--models", "llama_71m", "--train-norms", "ln", "un"] if dry_run
            else ["--models", "swin_t", "t2t_vit_14", "llama_71m"])],
         "training_cuda_norms_eager.json"),
        # host time against device time and kernels per step: whether a norm is launch-bound
        ("profile_norms", ["scripts/profile_norms.py", *(
            ["--device", "cpu", "--shape", "2", "8", "16", "--norms", "ln", "un", "--steps", "2"]
            if dry_run else [])], None),
    ]


def machine() -> dict:
    """The device, its driver, torch and CUDA: what every figure of the run depends on."""
    import torch
    info = {"torch": torch.__version__, "cuda": torch.version.cuda,
            "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
            "driver": None}
    try:
        info["driver"] = subprocess.run(
            ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
            capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        pass
    return info


def run_step(argv: list[str], timeout: float, log) -> tuple[str, int | None]:
    """``(status, return code)``: "passed" (0), "failed" (another code), or "cut" when the
    timeout stopped it (its whole process group: compile workers included)."""
    process = subprocess.Popen([sys.executable, *argv], cwd=ROOT, stdout=log,
                               stderr=subprocess.STDOUT, start_new_session=True)
    try:
        code = process.wait(timeout=max(timeout, 0))
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        process.wait()
        return "cut", None
    return ("passed" if code == 0 else "failed"), code


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out-dir", type=Path, required=True)
    parser.add_argument("--budget", type=float, default=420.0, help="seconds for all the steps")
    parser.add_argument("--commit", default=None,
                        help="the commit the copied tree is (default: the environment's, "
                             "benchmark.COPIED_TREE_COMMIT, else git's)")
    parser.add_argument("--only", nargs="+", default=None, help="run these steps alone")
    parser.add_argument("--dry-run", action="store_true",
                        help="every step at toy size on the CPU, to rehearse the run")
    args = parser.parse_args()
    plan = steps(args.out_dir, args.dry_run)
    names = [name for name, _, _ in plan]
    if args.only and not set(args.only) <= set(names):
        parser.error(f"--only {' '.join(args.only)}: the steps are {', '.join(names)}")
    if args.budget <= 0:
        parser.error(f"--budget {args.budget}: the steps' seconds must be positive")
    import torch  # after the arguments: a refused command line is answered at once
    if not args.dry_run and not torch.cuda.is_available():
        sys.exit("no CUDA device: these checks measure a GPU (use --dry-run to rehearse on a CPU)")
    sys.path.insert(0, str(ROOT / "scripts"))
    from benchmark import COPIED_TREE_COMMIT, context  # the benchmarks' own record of the commit
    if args.commit:
        os.environ[COPIED_TREE_COMMIT] = args.commit
    args.out_dir.mkdir(parents=True, exist_ok=True)
    summary = {"started": datetime.now(timezone.utc).isoformat(timespec="seconds"),
               "dry_run": args.dry_run, "budget_s": args.budget,
               **{key: context()[key] for key in ("git_commit", "git_dirty")}, **machine(),
               "command": " ".join(["python", *sys.argv]), "steps": []}
    start = time.monotonic()
    with open(args.out_dir / LOG, "a") as log:
        for name, argv, out in plan:
            if args.only and name not in args.only:
                continue
            left = args.budget - (time.monotonic() - start)
            record = {"name": name, "argv": argv, "out": out}
            if left <= 0:
                record["status"] = "not started"
            else:
                print(f"== {name} ({left:.0f} s left): {' '.join(argv)}", file=log, flush=True)
                began = time.monotonic()
                record["status"], record["returncode"] = run_step(argv, left, log)
                record["seconds"] = round(time.monotonic() - began, 1)
                record["wrote"] = out is not None and (args.out_dir / out).exists()
            print(f"{name}: {record['status']} {record.get('seconds', '')}", flush=True)
            summary["steps"].append(record)
            (args.out_dir / SUMMARY).write_text(json.dumps(summary, indent=2))
    failed = [s["name"] for s in summary["steps"] if s["status"] == "failed"]
    if failed:
        sys.exit(f"failed: {', '.join(failed)} (their output is in {args.out_dir / LOG})")


if __name__ == "__main__":
    main()
