"""Inference speed and memory of folded UN against LN and the no-norm limit (paper Table 8),
and the training-step cost of every norm, measured side by side in one run.

    python scripts/benchmark.py                                  # GPU if present, else CPU
    python scripts/benchmark.py --batch 512 --img-size 224       # the paper's setting (GPU)
    python scripts/benchmark.py --models swin_t --no-compile --rounds 5
    python scripts/benchmark.py --models mask_rcnn_swin_t --det-batch 2   # Table 8's COCO row
    python scripts/benchmark.py --models llama_71m --batch 4      # the LM, 256-token sequences

Inference variants, per model: ``ln``; ``un`` (unfolded); ``un_folded`` (every UN folded into
its linear consumer or a frozen affine); ``prepbn_folded`` (PRepBN's RepBN, folded alike);
``dyt`` (DyT with its weight and bias folded away, ``tanh(alpha x)`` left); ``no_norm`` (every
norm removed: what folding can reach at best). Each runs eager and, unless --no-compile,
under ``torch.compile`` (classifiers; Mask R-CNN runs eager: torchvision's detectors have
data-dependent control flow). Mask R-CNN (Swin-T + FPN, torchvision) takes ``--det-batch``
COCO-sized 640x480 images, which it resizes to 800 px on the short side as in evaluation;
every box is scored as a detection (``box_score_thresh`` 0), so each variant keeps 100 per image
and runs the mask head on them: with random weights the default threshold lets the detections,
and so the time, depend on the variant's weights, not its norms. The JSON records each
variant's proposals and detections, and the run stops if they differ.
LLaMA-71M (``plugins.lm``; throughput in sequences of ``--lm-context`` tokens) adds
``rms_converted`` and ``crms_converted``: the Pre-LN model converted exactly into Pre-RMSNorm
and Pre-CRMSNorm (``plugins.lm.convert``), beside ``ln``; its folds are ``plugins.lm.fold``'s.
Training: one optimizer step of every norm's classifier, compiled unless --no-compile (LN
compiled is the baseline), the norms past their warm-ups. Rounds interleave the variants in
a shuffled order so drift affects all alike. The JSON keeps every round's time; a ratio is
the median of per-round ratios (variant and baseline timed in the same round), with the
bootstrap 95% interval of that median (``paired_ratio``). The noise check (``noise_check``)
fails, with a warning, when the no-norm limit measures slower than LN beyond that interval.
Peak memory: GPU max allocated, or on CPU the peak RSS during inference of a fresh subprocess
per variant (weights and activations on top of the loaded libraries). The RSS varies from one
process to the next (by up to ~10% for LLaMA-71M), so each variant is probed in
``--memory-rounds`` fresh processes, in a shuffled order per round, and its ratio to LN's is
paired by round like the times.
"""
from __future__ import annotations

import argparse
import ctypes
import ctypes.util
import functools
import gc
import json
import os
import platform
import random
import shlex
import statistics
import subprocess
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

import project_env  # noqa: F401  (first: the project's Python, whatever `python` ran this)

import numpy as np
import torch
from omegaconf import OmegaConf

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import unnorm  # noqa: E402

MODELS = {"swin_t": "swin_tiny_patch4_window7_224", "t2t_vit_14": "t2t_vit_14",
          "mask_rcnn_swin_t": "configs/model/faster_rcnn_swin_t.yaml",  # + masks, as mask_rcnn_swin_t.yaml
          "llama_71m": "configs/model/llama_71m.yaml"}
DETECTORS = {"mask_rcnn_swin_t"}
LMS = {"llama_71m"}
LM_VOCAB = 32000  # LLaMA's tokenizer, as Mix-LN trains on C4
VARIANT_NORMS = {"ln": "ln", "un": "un", "un_folded": "un", "prepbn_folded": "prepbn",
                 "dyt": "dyt", "no_norm": "nonorm", "rms_converted": "ln", "crms_converted": "ln"}
# language models only: plugins.lm.convert's conversions
CONVERTED = {"rms_converted": "to_pre_rms", "crms_converted": "to_pre_crms"}
PARTS = ("inference", "training")
FOLDED = {"un_folded", "prepbn_folded", "dyt"}
# past every warm-up (PRepBN: inside its hand-over, where training computes LN and BN)
STEADY = {"un": {"warmup_iters": 0, "outlier_filtration": True, "compensation_start": 0},
          "mabn": {"warmup_iters": 0, "window_size": 4, "compensation_start": 0},
          "pn": {"warmup_iters": 0}, "pn_ls": {"warmup_iters": 0},
          "prepbn": {"warmup_iters": 0, "decay_iters": 10 ** 9}}
COCO_IMAGE = (480, 640)  # a typical COCO image; the detector resizes it to 800 x 1066
# every box a detection, 100 per image (torchvision's detections_per_img) in every variant
EQUAL_DETECTIONS = {"box_score_thresh": 0.0}
BOOTSTRAP = 10_000  # resamples of the per-round ratios
# default --rounds on a CPU. Measured on the 2-core CPU under load: 3 paired rounds passed
# the noise check; 15 bounded no-norm/LN within +-1% (Swin-T) to +-3% (T2T-ViT-14), and
# resolving the ~2% effects claimed asks for more
CPU_ROUNDS = 20
CPU_MEMORY_ROUNDS = 5  # fresh processes per variant for its peak RSS
SPREAD = "bootstrap 95% interval (2.5-97.5 percentiles) of the median of per-round ratios"


# Each framework is imported when a model of it is measured: transformers' import is half of
# this script's, which every memory probe of a vision model would pay, and timm's (torchvision's
# with it), like the run skeleton's, is most of an eager bench_norms.py's, which measures neither.
def build_lm(*args, **kwargs):
    from plugins.lm import build_lm
    return build_lm(*args, **kwargs)


def create_classifier(*args, **kwargs):
    from plugins.timm import create_classifier
    return create_classifier(*args, **kwargs)


def build(model: str, variant: str, img_size: int, device: torch.device) -> torch.nn.Module:
    """An eval-mode model of the variant. Its weights are random: speed does not depend on
    them, except a detector's post-processing, held equal by ``EQUAL_DETECTIONS``."""
    norm = VARIANT_NORMS[variant]
    options = STEADY.get(norm, {})
    if model in DETECTORS:
        from plugins.torchvision.detectors import build_detector
        config = OmegaConf.load(ROOT / MODELS[model])
        config.masks = True
        config.detector_kwargs = EQUAL_DETECTIONS
        net = build_detector(config, {"name": norm, **options}, num_classes=81)
    elif model in LMS:
        net = build_lm(OmegaConf.load(ROOT / MODELS[model]), {"name": norm, **options},
                       vocab_size=LM_VOCAB, use_cache=False)  # a forward pass, no KV cache
    else:
        net = create_classifier(MODELS[model], {"name": norm, **options}, 1000, img_size)
    net.eval()
    if variant in CONVERTED:
        from plugins.lm import convert
        getattr(convert, CONVERTED[variant])(net)
    elif variant in FOLDED:  # proved on one small input: random weights fold as trained ones
        generator = torch.Generator().manual_seed(0)
        if model in LMS:
            from plugins.lm.fold import fold_lm
            fold_lm(net, probe=torch.randint(0, LM_VOCAB, (1, 16), generator=generator))
        else:
            from plugins.timm import fold_model
            from plugins.torchvision.detectors import fold_detector
            images = torch.randn(1, 3, img_size, img_size, generator=generator)
            (fold_detector if model in DETECTORS else fold_model)(net, probe=images)
    elif variant == "no_norm":
        for name, module in list(net.named_modules()):
            if isinstance(module, unnorm.ChannelNorm):
                unnorm.replace_module(net, name, unnorm.FoldedNorm())
    return net.to(device)


def add_shared_options(parser: argparse.ArgumentParser, norms_flag: str,
                       rounds: tuple[int, int], warmup: int, norms_help: str | None = None,
                       out_help: str | None = None) -> None:
    """The options of both benchmarks (this one and bench_norms.py): the norms to measure, the
    timed rounds (``rounds``: the GPU's and the CPU's default) and the untimed warm-up calls
    before them, the device, compiling, the JSON written. Parse with ``parse_shared``."""
    parser.add_argument(norms_flag, nargs="+", default=unnorm.available_norms(),
                        choices=unnorm.available_norms(), help=norms_help)
    parser.add_argument("--rounds", type=int, default=None,
                        help=f"timed rounds (default: GPU {rounds[0]}, CPU {rounds[1]})")
    parser.set_defaults(default_rounds=rounds)
    parser.add_argument("--warmup", type=int, default=warmup)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--compile", action=argparse.BooleanOptionalAction, default=True)
    parser.add_argument("--out", type=Path, default=None, help=out_help)


def parse_shared(parser: argparse.ArgumentParser) -> argparse.Namespace:
    """The arguments, with the device's default rounds; fewer than 2 rounds have no spread."""
    args = parser.parse_args()
    gpu_rounds, cpu_rounds = args.default_rounds
    default = gpu_rounds if args.device.startswith("cuda") else cpu_rounds
    args.rounds = default if args.rounds is None else args.rounds
    if args.rounds < 2:
        parser.error(f"--rounds {args.rounds}: a ratio's spread needs at least 2 rounds "
                     f"(the default on this device is {default})")
    return args


COPIED_TREE_COMMIT = "UNNORM_GIT_COMMIT"


def context() -> dict:
    """What a record's times depend on besides the code: the commit (``git_dirty``: tracked
    files outside results/ differ from it), the date, the CPUs and torch's threads. The 1, 5 and
    15-minute load averages are taken at the start (``load_before``: others' load) and after
    the last timed round (``load_after``, which includes this benchmark's own threads). A copied
    tree (a lent GPU machine's) is the commit its copier names in ``UNNORM_GIT_COMMIT``, and
    ``git_dirty`` is then unknown: the ``.git`` such a copy carries can be older than the
    files (one reported the session's first commit, dirty, for a tree that was a later one)."""
    named = os.environ.get(COPIED_TREE_COMMIT)
    if named:
        commit = {"git_commit": named, "git_dirty": None}
    else:
        def git(*command):
            return subprocess.run(["git", *command], cwd=ROOT, capture_output=True, text=True)
        head = git("rev-parse", "HEAD")
        known = head.returncode == 0
        commit = {"git_commit": head.stdout.strip() if known else None,
                  "git_dirty": bool(git("status", "--porcelain", "--untracked-files=no", "--",
                                        ".", ":!results").stdout.strip()) if known else None}
    return {**commit,
            "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
            "cpu_count": os.cpu_count(), "torch_threads": torch.get_num_threads(),
            "load_before": list(os.getloadavg()), "load_after": None}


def command() -> str:
    return shlex.join(["python", *sys.argv])


def ln_first(norms: list[str]) -> list[str]:
    """``norms`` with LN first, added if missing: the baseline every ratio is taken to."""
    return ["ln", *(norm for norm in norms if norm != "ln")]


def compile_side_by_side() -> None:
    """Compiled variants share their modules' forward code, and dynamo counts each one's graph
    as a recompile of that code: past its limit (8) it would run the rest eager, silently.
    Lift the limit for the variants a benchmark holds at once, and make reaching it an error
    (the trainers' ``no_eager_fallback``), for the rest of the process."""
    from plugins.training import no_eager_fallback  # the run skeleton: what eager runs skip
    no_eager_fallback(recompile_limit=256, accumulated_recompile_limit=4096).__enter__()


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_batches(fn, batches: int, device: torch.device) -> float:
    synchronize(device)
    start = time.perf_counter()
    for _ in range(batches):
        fn()
    synchronize(device)
    return time.perf_counter() - start


def measured_rounds(measures: dict, rounds: int) -> dict:
    """Each measure's value, one per round: every round calls all the measures in a fresh
    shuffled order, so drift affects all alike and a round's values pair."""
    values = {key: [] for key in measures}
    order = list(measures)
    for _ in range(rounds):
        random.shuffle(order)
        for key in order:
            values[key].append(measures[key]())
    return values


def timed_rounds(runners: dict, rounds: int, device: torch.device, batches: int = 1) -> dict:
    """Each runner's seconds for ``batches`` calls, one per round (``measured_rounds``)."""
    return measured_rounds({key: functools.partial(time_batches, fn, batches, device)
                            for key, fn in runners.items()}, rounds)


def paired_ratio(numerator: list[float], denominator: list[float]) -> dict:
    """``{"median", "lo", "hi"}`` of the per-round ratios ``numerator[r] / denominator[r]``:
    both were timed in round r, so drift between rounds cancels. lo and hi bound the bootstrap
    95% interval of the median; unlike the interquartile range it narrows as rounds are added,
    so it tells whether a run resolves an effect. Seeded: a record reproduces its intervals."""
    if len(numerator) != len(denominator) or not numerator:
        raise ValueError(f"paired ratios need as many rounds on each side, at least one: "
                         f"got {len(numerator)} and {len(denominator)}")
    ratios = np.asarray(numerator, dtype=np.float64) / np.asarray(denominator, dtype=np.float64)
    resampled = np.random.default_rng(0).choice(ratios, (BOOTSTRAP, len(ratios)))
    lo, hi = np.percentile(np.median(resampled, axis=1), [2.5, 97.5])
    return {"median": float(np.median(ratios)), "lo": float(lo), "hi": float(hi)}


def interval(ratio: dict, digits: int = 3) -> str:
    """``median [lo, hi]``, as the tables print a ratio."""
    return f"{ratio['median']:.{digits}f} [{ratio['lo']:.{digits}f}, {ratio['hi']:.{digits}f}]"


def noise_check(name: str, ln_s: list[float], limit_s: list[float]) -> dict:
    """Removing the norm cannot slow a model down, so the no-norm limit's throughput ratio to
    LN (per round, LN's seconds over the limit's) must reach 1.0 within its interval; if it
    does not, the noise exceeds the effects the run would report."""
    ratio = paired_ratio(ln_s, limit_s)
    return {"name": name, "limit_vs_ln_throughput": ratio,
            "status": "passed" if ratio["hi"] >= 1.0 else "failed"}


def noise_verdict(checks: list[dict], rounds: int) -> str:
    """Prints every check, warns about each failed one; ``"failed"`` if any failed."""
    print(f"noise check: the no-norm limit's throughput / LN's, {SPREAD}; it must reach 1.0")
    for check in checks:
        print(f"  {check['name']}: {interval(check['limit_vs_ln_throughput'])} {check['status']}")
    failed = [check["name"] for check in checks if check["status"] == "failed"]
    if failed:
        print(f"WARNING: the no-norm limit measured slower than LN beyond its spread "
              f"({', '.join(failed)}): the noise exceeds the effects, so no ratio of this run "
              f"resolves a few per cent. "
              f"Re-run with more --rounds (this run: {rounds}) or on a quieter machine "
              f"(load averages before and after are in the JSON's context).", file=sys.stderr)
    return "failed" if failed else "passed"


def machine(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    name = platform.processor() or platform.machine()
    try:
        name = next(line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo")
                    if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    return f"{name}, {torch.get_num_threads()} threads"


def variants(model: str, chosen: list[str]) -> list[str]:
    """The ``chosen`` inference variants that ``model`` has: the conversions exist for the
    language model. LN and the no-norm limit are always measured: every ratio's baselines."""
    return [v for v in VARIANT_NORMS
            if (v in chosen or v in ("ln", "no_norm")) and (v not in CONVERTED or model in LMS)]


def inputs(model: str, args, device: torch.device) -> torch.Tensor:
    if model in LMS:
        return torch.randint(0, LM_VOCAB, (args.batch, args.lm_context), device=device)
    if model in DETECTORS:
        return torch.rand(args.det_batch, 3, *COCO_IMAGE, device=device)
    return torch.randn(args.batch, 3, args.img_size, args.img_size, device=device)


def detector_work(net: torch.nn.Module, images: torch.Tensor) -> dict:
    """The post-processing a detector's call does, per image: the proposals its RPN keeps and
    the detections it returns (each through the box and mask heads)."""
    proposals = []
    hook = net.rpn.register_forward_hook(
        lambda module, inputs, out: proposals.append([len(boxes) for boxes in out[0]]))
    try:
        with torch.inference_mode():
            detections = [len(found["boxes"]) for found in net(images)]
    finally:
        hook.remove()
    return {"proposals": proposals[0], "detections": detections}


def check_equal_work(work: dict) -> None:
    """Timing variants that post-process different numbers of boxes would compare the boxes,
    not the norms."""
    for model in {model for model, _ in work}:
        done = {variant: w for (m, variant), w in work.items() if m == model}
        if len({json.dumps(w, sort_keys=True) for w in done.values()}) > 1:
            raise RuntimeError(f"{model}: the variants post-process different numbers of boxes "
                               f"({done}), so their times would not compare the norms; keep "
                               f"EQUAL_DETECTIONS in build()")


def inference(args, device) -> list[dict]:
    images = {model: inputs(model, args, device) for model in args.models}
    runners, work = {}, {}
    for model in args.models:
        for variant in variants(model, args.variants):
            net = build(model, variant, args.img_size, device)
            if model in DETECTORS:
                work[(model, variant)] = detector_work(net, images[model])
            modes = {"eager": net}
            if args.compile and model not in DETECTORS:
                modes["compile"] = torch.compile(net)
            for mode, fn in modes.items():
                runners[(model, variant, mode)] = fn
    check_equal_work(work)
    print(f"warming up {len(runners)} runners (compiling where asked)...", flush=True)
    memory = {}
    with torch.inference_mode():
        for key, fn in runners.items():
            if device.type == "cuda":
                torch.cuda.reset_peak_memory_stats(device)
                base = torch.cuda.memory_allocated(device)
            for _ in range(args.warmup):
                fn(images[key[0]])
            if device.type == "cuda":
                synchronize(device)
                memory[key] = (torch.cuda.max_memory_allocated(device) - base) / 2**20
        calls = {key: functools.partial(fn, images[key[0]]) for key, fn in runners.items()}
        times = timed_rounds(calls, args.rounds, device, args.batches)
    if device.type == "cpu" and args.memory_rounds:
        probes = {(model, variant, "eager"): functools.partial(cpu_peak_rss, model, variant, args)
                  for model in args.models for variant in variants(model, args.variants)}
        print(f"probing peak RSS in {args.memory_rounds} rounds of {len(probes)} fresh "
              f"processes...", flush=True)
        memory = measured_rounds(probes, args.memory_rounds)
    elif device.type != "cpu":  # the allocator's count: one measurement is exact
        memory = {key: [mb] for key, mb in memory.items()}
    rows = []
    for (model, variant, mode), seconds in times.items():
        batch = len(images[model])
        # throughput ratios: per round, the baseline's seconds over the variant's
        row = {"model": model, "variant": variant, "mode": mode, "batch": batch,
               "round_s": seconds,
               "images_per_s": batch * args.batches / statistics.median(seconds),
               "vs_ln": paired_ratio(times[(model, "ln", mode)], seconds),
               "vs_no_norm": paired_ratio(times[(model, "no_norm", mode)], seconds),
               "peak_mem_mb": None}
        if (model, variant, mode) in memory:
            peaks = memory[(model, variant, mode)]
            row.update(peak_mem_mb=statistics.median(peaks), peak_mem_mb_rounds=peaks)
            if len(peaks) > 1:  # the variant's peak over LN's, paired by round
                row["mem_vs_ln"] = paired_ratio(peaks, memory[(model, "ln", mode)])
        if (model, variant) in work:
            row["work"] = work[(model, variant)]
        rows.append(row)
    return rows


def cpu_peak_rss(model: str, variant: str, args) -> float:
    """Peak resident memory of a fresh process running the variant's inference (MB)."""
    probe = subprocess.run(
        [sys.executable, __file__, "--rss-probe", model, variant, "--batch", str(args.batch),
         "--det-batch", str(args.det_batch), "--img-size", str(args.img_size),
         "--lm-context", str(args.lm_context)],
        capture_output=True, text=True, check=True)
    return json.loads(probe.stdout.strip().splitlines()[-1])["peak_rss_mb"]


def rss_probe(model: str, variant: str, args) -> None:
    """Peak RSS while running inference: the kernel's high-water mark is reset first
    (``/proc/self/clear_refs``), so the import-time peak of torch's libraries does not mask it,
    after the heap freed since (building, folding) is handed back to the kernel: kept, it
    would count in some processes and not others."""
    net = build(model, variant, args.img_size, torch.device("cpu"))
    images = inputs(model, args, torch.device("cpu"))
    gc.collect()
    ctypes.CDLL(ctypes.util.find_library("c")).malloc_trim(0)
    Path("/proc/self/clear_refs").write_text("5")
    with torch.inference_mode():
        for _ in range(3):
            net(images)
    status = Path("/proc/self/status").read_text()
    peak_kb = int(next(line.split()[1] for line in status.splitlines() if line.startswith("VmHWM")))
    print(json.dumps({"peak_rss_mb": peak_kb / 1024}))


def training(args, device) -> list[dict]:
    """Time of one optimizer step per norm (random labels), interleaved, and its ratio to LN's
    (step time over LN's, per round); the model compiled unless --no-compile."""
    images = torch.randn(args.train_batch, 3, args.img_size, args.img_size, device=device)
    labels = torch.randint(0, 1000, (args.train_batch,), device=device)
    tokens = torch.randint(0, LM_VOCAB, (args.train_batch, args.lm_context), device=device)
    steps = {}
    for model in [m for m in args.models if m not in DETECTORS]:
        for norm in args.train_norms:
            options = {"name": norm, **STEADY.get(norm, {})}
            net = (build_lm(OmegaConf.load(ROOT / MODELS[model]), options, vocab_size=LM_VOCAB,
                            use_cache=False)
                   if model in LMS else create_classifier(MODELS[model], options, 1000, args.img_size))
            net = net.to(device).train()
            optimizer = torch.optim.AdamW(net.parameters(), lr=1e-4)
            run = torch.compile(net) if args.compile else net

            def loss_of(run, model=model):
                if model in LMS:
                    return run(input_ids=tokens, labels=tokens).loss
                return torch.nn.functional.cross_entropy(run(images), labels)

            def step(run=run, optimizer=optimizer, loss_of=loss_of):
                optimizer.zero_grad(set_to_none=True)
                with torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda"):
                    loss = loss_of(run)
                loss.backward()
                optimizer.step()
            print(f"warming up the training step of {model} with {norm}...", flush=True)
            for _ in range(args.warmup):
                step()
            steps[(model, norm)] = step
    times = timed_rounds(steps, args.rounds, device)
    mode = "compile" if args.compile else "eager"
    return [{"model": model, "norm": norm, "mode": mode, "round_s": seconds,
             "step_ms": 1e3 * statistics.median(seconds),
             "vs_ln": paired_ratio(seconds, times[(model, "ln")])}
            for (model, norm), seconds in times.items()]


def noise_checks(inference_rows, training_rows) -> list[dict]:
    """The no-norm limit against LN: every model's inference in every mode, and its training
    step where ``nonorm`` was among the timed norms."""
    rows = [((r["model"], r["mode"], "inference"), r["variant"], r["round_s"])
            for r in inference_rows]
    rows += [((r["model"], r["mode"], "training step"), r["norm"], r["round_s"])
             for r in training_rows]
    ln = {key: seconds for key, name, seconds in rows if name == "ln"}
    return [noise_check(" ".join(key), ln[key], seconds) for key, name, seconds in rows
            if name in ("no_norm", "nonorm")]


def report(inference_rows, training_rows) -> str:
    ci = "median [95% bootstrap CI]"
    lines = [f"| model | variant | mode | images (LM: sequences)/s | vs LN, {ci} "
             f"| vs no-norm, {ci} | peak MB (median) | peak MB vs LN, {ci} |",
             "|---|---|---|---:|---:|---:|---:|---:|"]
    for r in inference_rows:
        mem = f"{r['peak_mem_mb']:.0f}" if r["peak_mem_mb"] is not None else "-"
        mem_ratio = interval(r["mem_vs_ln"]) if "mem_vs_ln" in r else "-"
        lines.append(f"| {r['model']} | {r['variant']} | {r['mode']} | {r['images_per_s']:.1f} | "
                     f"{interval(r['vs_ln'])} | {interval(r['vs_no_norm'])} | {mem} | {mem_ratio} |")
    lines += ["", f"| model | norm | mode | train step ms | vs LN, {ci} |",
              "|---|---|---|---:|---:|"]
    for r in training_rows:
        lines.append(f"| {r['model']} | {r['norm']} | {r['mode']} | {r['step_ms']:.1f} | "
                     f"{interval(r['vs_ln'])} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    parser.add_argument("--batch", type=int, default=None, help="inference batch (GPU 512, CPU 8)")
    parser.add_argument("--det-batch", type=int, default=2, help="Mask R-CNN inference batch")
    parser.add_argument("--train-batch", type=int, default=None, help="GPU 128, CPU 4")
    parser.add_argument("--img-size", type=int, default=224)
    parser.add_argument("--lm-context", type=int, default=256, help="LM sequence length (Mix-LN's)")
    parser.add_argument("--batches", type=int, default=None, help="timed batches per round")
    parser.add_argument("--parts", nargs="+", default=list(PARTS), choices=list(PARTS),
                        help="inference of the variants, training steps of the norms, or both")
    parser.add_argument("--variants", nargs="+", default=list(VARIANT_NORMS),
                        choices=list(VARIANT_NORMS),
                        help="inference variants (LN and the no-norm limit always)")
    add_shared_options(parser, "--train-norms", rounds=(7, CPU_ROUNDS), warmup=3,
                       norms_help="norms whose training step is timed (LN always, as the baseline)")
    parser.add_argument("--memory-rounds", type=int, default=CPU_MEMORY_ROUNDS,
                        help="CPU: fresh processes per variant for its peak RSS, 0 for none "
                             "(gpu_check's rehearsal; GPU: one measurement, exact)")
    parser.add_argument("--rss-probe", nargs=2, metavar=("MODEL", "VARIANT"), help=argparse.SUPPRESS)
    args = parse_shared(parser)
    args.train_norms = ln_first(args.train_norms)
    device = torch.device(args.device)
    gpu = device.type == "cuda"
    args.batch = args.batch or (512 if gpu else 8)
    args.train_batch = args.train_batch or (128 if gpu else 4)
    args.batches = args.batches or (10 if gpu else 2)
    if args.rss_probe:
        return rss_probe(*args.rss_probe, args)
    if not gpu and args.memory_rounds != 0 and args.memory_rounds < 2:
        parser.error(f"--memory-rounds {args.memory_rounds}: a memory ratio's spread needs at "
                     f"least 2 rounds (default {CPU_MEMORY_ROUNDS}; 0: no memory probe)")
    run_context = context()
    compile_side_by_side()
    if gpu:
        torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = True
    inference_rows = inference(args, device) if "inference" in args.parts else []
    training_rows = training(args, device) if "training" in args.parts else []
    run_context["load_after"] = list(os.getloadavg())
    table = report(inference_rows, training_rows)
    print(table)
    checks = noise_checks(inference_rows, training_rows)
    verdict = noise_verdict(checks, args.rounds)
    out = args.out or ROOT / "results" / "benchmarks" / f"inference_{device.type}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({
        "device": machine(device), "torch": torch.__version__,
        "cuda": torch.version.cuda if gpu else None, "batch": args.batch,
        "det_batch": args.det_batch,
        "train_batch": args.train_batch, "img_size": args.img_size, "lm_context": args.lm_context,
        "rounds": args.rounds, "batches_per_round": args.batches,
        "memory_rounds": None if gpu else args.memory_rounds, "command": command(),
        "context": run_context, "spread": SPREAD, "noise_check": verdict, "noise_checks": checks,
        "inference": inference_rows, "training": training_rows, "table": table}, indent=2))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
