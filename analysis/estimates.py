"""How far UN's estimated statistics sit from each batch's own, over a recorded run.

UN normalises with estimates instead of the batch's statistics: forward, the geometric mean of
a window of second moments instead of s_t; backward, an EMA (alpha) of window means of the
gradient statistic instead of q_t = mean(g z). This module replays those estimates from a run
recorded with ``record_statistics=true`` (the recorded s_t, q_t and outlier skips, the run's
options, the spec's rules) and measures, per step, their relative distance from the batch's
own statistic, averaged over layers. A large backward distance has two causes that the
cosines tell apart: lag (statistics that drift faster than the EMA's memory of about
1 / (1 - alpha) steps; consecutive q_t agree) or noise (q_t changes from batch to batch,
consecutive q_t are unrelated, and their average is small beside any one of them).

    python -m analysis.estimates RUN_DIR [--out DIR]     # estimates.json and estimates.png
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np
from matplotlib.figure import Figure

from .statistics import load_run_info, load_statistics


def replay(act: np.ndarray, grad: np.ndarray, skip: np.ndarray, window: int, warmup: int,
           alpha: float) -> tuple[np.ndarray, np.ndarray]:
    """UN's forward statistic v_t and gradient estimate psi_t at every step, as the spec
    computes them from the recorded s_t (``act``), q_t (``grad``) and skip flags (defaults:
    fwd_gm, bwd_am, bwd_ema on; one window size for both directions)."""
    steps, channels = act.shape
    fwd, bwd = np.zeros((window, channels)), np.zeros((window, channels))
    ema = np.zeros(channels)
    v, psi = np.empty_like(act), np.empty_like(grad)
    running = np.ones(channels)
    for index in range(steps):
        t = index + 1
        slot = t % window
        fwd[slot] = running if skip[index] else act[index]
        averaging = t > window and t >= warmup and not skip[index]
        v[index] = np.exp(np.log(fwd).mean(axis=0)) if averaging else act[index]
        running = alpha * running + (1 - alpha) * v[index]
        bwd[slot] = ema if skip[index] else grad[index]
        m = bwd.mean(axis=0) if averaging else grad[index]
        ema = alpha * ema + (1 - alpha) * m
        psi[index] = m if skip[index] else ema
    return v, psi


def relative_distance(estimate: np.ndarray, batch: np.ndarray) -> np.ndarray:
    """Per step, ||estimate - batch|| / ||batch|| over channels."""
    return np.linalg.norm(estimate - batch, axis=1) / np.maximum(np.linalg.norm(batch, axis=1), 1e-30)


def cosine(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Per step, the cosine between two per-channel vectors."""
    norms = np.linalg.norm(a, axis=1) * np.linalg.norm(b, axis=1)
    return (a * b).sum(axis=1) / np.maximum(norms, 1e-30)


def estimate_distances(run_dir: Path) -> dict:
    """Per-step forward and backward distances, averaged over the run's UN layers, and what
    tells lag from noise: the gradient estimate's size and cosine against the batch's q_t,
    and the cosine between consecutive batches' q_t (about 0: q_t is mostly noise, and an
    average of it is small and unrelated to any one batch's)."""
    info = load_run_info(run_dir)
    options = info.get("norm_options", {})
    if info.get("norm") != "un":
        raise ValueError(f"{run_dir} is a {info.get('norm')} run: the replay follows UN's rules")
    window = options.get("window_size", 4)
    if not isinstance(window, int):
        raise ValueError(f"window_size {window!r}: the replay takes one window for both directions")
    forward, backward, size, agreement, consecutive = [], [], [], [], []
    for values in load_statistics(run_dir).values():
        act, grad = values["act"].double().numpy(), values["grad"].double().numpy()
        skip = values["skip"].numpy().astype(bool)
        v, psi = replay(act, grad, skip, window, options.get("warmup_iters", 4000),
                        options.get("momentum", 0.9))
        forward.append(relative_distance(v, act))
        backward.append(relative_distance(psi, grad))
        size.append(np.linalg.norm(psi, axis=1) / np.maximum(np.linalg.norm(grad, axis=1), 1e-30))
        agreement.append(cosine(psi, grad))
        consecutive.append(np.concatenate([[np.nan], cosine(grad[1:], grad[:-1])]))
    mean = {name: np.mean(series, axis=0) for name, series in
            [("forward", forward), ("backward", backward), ("backward_size", size),
             ("backward_cosine", agreement), ("batch_to_batch_cosine", consecutive)]}
    late = len(mean["forward"]) // 4  # past warm-up and window fill: the last three quarters
    return {"run": str(run_dir), "window": window, "warmup_iters": options.get("warmup_iters"),
            "momentum": options.get("momentum"), "layers": len(forward),
            "last_three_quarters": {name: float(np.nanmean(series[late:]))
                                    for name, series in mean.items()},
            **{name: [None if np.isnan(x) else float(x) for x in series]
               for name, series in mean.items()}}


def plot_distances(distances: dict, path: Path, lr: list[float]) -> Path:
    fig = Figure(figsize=(7, 4))
    ax = fig.add_subplot()
    steps = np.arange(1, len(distances["forward"]) + 1)
    ax.plot(steps, distances["forward"], label="forward: |v - s_t| / |s_t|", color="tab:blue")
    ax.plot(steps, distances["backward"], label="backward: |psi - q_t| / |q_t|", color="tab:red")
    ax.set_yscale("log")
    ax.set_xlabel("training step")
    ax.set_ylabel("relative distance (mean over layers)")
    if lr:
        twin = ax.twinx()
        twin.plot(np.linspace(1, steps[-1], len(lr)), lr, color="grey", linestyle=":", label="lr")
        twin.set_ylabel("learning rate (end of each epoch)", color="grey")
    ax.set_title(f"UN's estimates vs the batch's statistics: {Path(distances['run']).name}", fontsize=9)
    ax.legend(fontsize=7, loc="upper right")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=150)
    return path


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("run_dir", type=Path, help="a UN run recorded with record_statistics=true")
    parser.add_argument("--out", type=Path, default=None, help="default: RUN_DIR/analysis")
    args = parser.parse_args(argv)
    out = args.out or args.run_dir / "analysis"
    distances = estimate_distances(args.run_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "estimates.json").write_text(json.dumps(distances, indent=1) + "\n")
    metrics = args.run_dir / "metrics.jsonl"
    lr = [json.loads(line)["lr"] for line in metrics.read_text().splitlines()] if metrics.exists() else []
    plot_distances(distances, out / "estimates.png", lr)
    print(json.dumps(distances["last_three_quarters"], indent=1))
    print(f"wrote {out / 'estimates.json'} and {out / 'estimates.png'}")


if __name__ == "__main__":
    main()
