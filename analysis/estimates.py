"""How far UN's estimated statistics sit from each batch's own, over a recorded run.

UN normalises with estimates instead of the batch's statistics: forward, the geometric mean of
a window of second moments instead of s_t; backward, an EMA (alpha) of window means of the
gradient statistic instead of q_t = mean(g z). This module replays those estimates from a run
recorded with ``record_statistics=true`` and measures, per step, their relative distance from
the batch's own statistic, averaged over layers. A large backward distance has two causes that
the cosines tell apart: lag (statistics that drift faster than the EMA's memory of about
1 / (1 - alpha) steps; consecutive q_t agree) or noise (q_t changes from batch to batch,
consecutive q_t are unrelated, and their average is small beside any one of them).

The replay is unnorm's own update: a ``UnifiedNorm`` built with the run's ``norm_options``
steps through the recorded s_t, q_t, outlier skips and rejected steps
(``UnifiedNorm.replay_step``), so every ablation switch is replayed as it trained. What the
replay needs is written to a small ``inputs.npz`` (float32, ``--channels`` evenly spaced
channels per layer: UN's estimates are per channel, and its one decision across channels, the
outlier skip, comes from the record) that is committed with the results; the distances are
over those channels, and re-derive from that file alone:

    python -m analysis.estimates RUN_DIR [--out DIR]           # DIR/inputs.npz, estimates.json, .png
    python -m analysis.estimates --from DIR/inputs.npz         # the same json and png from the file
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np
import torch
from matplotlib.figure import Figure

from unnorm import build_norm
from unnorm.unified import UnifiedNorm

from .statistics import load_run_info, load_statistics

#: UN's options the replay honours. The replaying layer is built with all of them; those of
#: the outlier test act through the recorded skip flags, grad_compensation and
#: compensation_start through the recorded q_t (g = dy w r), sync_stats through the recorded
#: (replica-summed) s_t and q_t. Any other option is refused.
REPLAYED_OPTIONS = ("window_size", "warmup_iters", "momentum", "eps", "fwd_gm", "bwd_am", "bwd_ema",
                    "outlier_filtration", "outlier_threshold", "outlier_var_per_channel",
                    "grad_compensation", "compensation_start", "sync_stats")
CHANNELS = 32  # per layer in inputs.npz: 264 steps of the CPU Swin-T's 21 layers take 1.3 MB
LAYER_KEYS = ("act", "grad", "skip", "rejected", "channels")


def replaying_layer(num_features: int, options: dict) -> UnifiedNorm:
    """A UN layer with the run's options, refusing one the replay does not know."""
    unknown = sorted(set(options) - set(REPLAYED_OPTIONS))
    if unknown:
        raise ValueError(f"norm option(s) {', '.join(unknown)}: the replay does not know how they "
                         "change UN's estimates; say how in analysis/estimates.py REPLAYED_OPTIONS "
                         "before replaying this run")
    return build_norm("un", num_features, **options)


def replay(act: np.ndarray, grad: np.ndarray, skip: np.ndarray, rejected: np.ndarray,
           options: dict) -> tuple[np.ndarray, np.ndarray, UnifiedNorm]:
    """UN's forward statistic v_t and gradient estimate psi_t at every recorded step (NaN at a
    rejected step, which normalised by the inference statistic), and the layer that replayed
    them, its state now the run's. ``act``/``grad``: the recorded s_t, q_t (float32, (T, C));
    ``skip``/``rejected``: the recorded flags (bool, (T,))."""
    norm = replaying_layer(act.shape[1], options)
    skip, rejected = np.asarray(skip, dtype=bool), np.asarray(rejected, dtype=bool)
    one_slot = norm.fwd_buffer.shape[0] == 1  # always skips
    if (one_slot or not norm.outlier_filtration) and (skip != one_slot).any():
        raise ValueError(f"the recorded outlier skips contradict the options (outlier_filtration="
                         f"{norm.outlier_filtration}, forward window {norm.fwd_buffer.shape[0]}): "
                         "pass the run's own norm_options")
    act, grad = (np.ascontiguousarray(a, dtype=np.float32) for a in (act, grad))  # as trained
    v, psi = np.empty_like(act), np.empty_like(grad)
    recorded = [torch.from_numpy(a) for a in (act, grad, skip, ~rejected)]
    for step, (s, q, skipped, clean) in enumerate(zip(*recorded)):
        v_t, psi_t = norm.replay_step(s, q, skipped, clean)
        v[step], psi[step] = v_t.numpy(), psi_t.numpy()
    v[rejected] = psi[rejected] = np.nan
    return v, psi, norm


def relative_distance(estimate: np.ndarray, batch: np.ndarray) -> np.ndarray:
    """Per step, ||estimate - batch|| / ||batch|| over channels."""
    return np.linalg.norm(estimate - batch, axis=1) / np.maximum(np.linalg.norm(batch, axis=1), 1e-30)


def cosine(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Per step, the cosine between two per-channel vectors."""
    norms = np.linalg.norm(a, axis=1) * np.linalg.norm(b, axis=1)
    return (a * b).sum(axis=1) / np.maximum(norms, 1e-30)


def learning_rates(metrics: Path) -> tuple[np.ndarray, bool]:
    """The rate of every optimizer update where metrics.jsonl has ``lr_per_update``, else each
    epoch's last rate; and whether they are per update."""
    rows = [json.loads(line) for line in metrics.read_text().splitlines()] if metrics.exists() else []
    if rows and all("lr_per_update" in row for row in rows):
        return np.array([lr for row in rows for lr in row["lr_per_update"]], dtype=np.float64), True
    return np.array([row["lr"] for row in rows], dtype=np.float64), False


def collect_inputs(run_dir: Path, channels: int = CHANNELS) -> dict:
    """What the replay and the figure need from a run: per UN layer, the recorded s_t and q_t of
    ``channels`` evenly spaced channels (float32), the skip and rejected flags; the run's norm
    options and learning rates."""
    info = load_run_info(run_dir)
    options = info.get("norm_options", {})
    if info.get("norm") != "un":
        raise ValueError(f"{run_dir} is a {info.get('norm')} run: the replay follows UN's rules")
    # the replay starts from a new layer and changes it only by the recorded steps
    if info.get("init", "scratch") != "scratch":
        raise ValueError(f"{run_dir} started from {info['init']}: its UN state before step 1 was "
                         "that checkpoint's, which the record does not hold; replay a run "
                         "trained from scratch")
    if info.get("world_size", 1) > 1 and not options.get("sync_stats"):
        raise ValueError(f"{run_dir} ran on {info['world_size']} replicas with their own "
                         "statistics: norm_sync changed rank 0's UN state at every evaluation, "
                         "which the record does not hold; replay a one-process run or one "
                         "trained with norm.sync_stats=true")
    if channels < 1:
        raise ValueError(f"channels must be >= 1 (per layer), got {channels}")
    layers, num_features = {}, {}
    for name, values in load_statistics(run_dir).items():
        if "rejected" not in values:
            raise ValueError(f"{run_dir}: layer {name} recorded no rejected flags; record the run "
                             "again with this unnorm (record_statistics=true)")
        size = values["act"].shape[1]
        kept = np.linspace(0, size - 1, min(channels, size)).round().astype(np.int64)
        layers[name] = {"act": values["act"].float().numpy()[:, kept],
                        "grad": values["grad"].float().numpy()[:, kept],
                        "skip": values["skip"].numpy().astype(bool),
                        "rejected": values["rejected"].numpy().astype(bool), "channels": kept}
        num_features[name] = size
    lr, per_update = learning_rates(Path(run_dir) / "metrics.jsonl")
    return {"run": str(run_dir), "norm_options": options,
            "num_features": num_features, "lr_per_update": per_update, "lr": lr, "layers": layers}


def save_inputs(inputs: dict, path: Path) -> Path:
    meta = {key: inputs[key] for key in ("run", "norm_options", "num_features", "lr_per_update")}
    arrays = {f"{layer}/{key}": values[key] for layer, values in inputs["layers"].items()
              for key in LAYER_KEYS}
    path.parent.mkdir(parents=True, exist_ok=True)
    np.savez_compressed(path, meta=np.array(json.dumps(meta)), lr=inputs["lr"], **arrays)
    return path


def load_inputs(path: Path) -> dict:
    with np.load(path, allow_pickle=False) as data:
        meta = json.loads(str(data["meta"]))
        layers = {layer: {key: data[f"{layer}/{key}"] for key in LAYER_KEYS}
                  for layer in meta["num_features"]}
        return {**meta, "lr": data["lr"], "layers": layers}


def estimate_distances(inputs: dict) -> dict:
    """Per-step forward and backward distances, averaged over the run's UN layers, and what
    tells lag from noise: the gradient estimate's size and cosine against the batch's q_t,
    and the cosine between consecutive batches' q_t (about 0: q_t is mostly noise, and an
    average of it is small and unrelated to any one batch's). A step that a layer rejected
    is NaN."""
    forward, backward, size, agreement, consecutive = [], [], [], [], []
    for values in inputs["layers"].values():
        v, psi, _ = replay(values["act"], values["grad"], values["skip"], values["rejected"],
                           inputs["norm_options"])
        v, psi, act, grad = (a.astype(np.float64) for a in (v, psi, values["act"], values["grad"]))
        forward.append(relative_distance(v, act))
        backward.append(relative_distance(psi, grad))
        size.append(np.linalg.norm(psi, axis=1) / np.maximum(np.linalg.norm(grad, axis=1), 1e-30))
        agreement.append(cosine(psi, grad))
        consecutive.append(np.concatenate([[np.nan], cosine(grad[1:], grad[:-1])]))
    mean = {name: np.mean(series, axis=0) for name, series in
            [("forward", forward), ("backward", backward), ("backward_size", size),
             ("backward_cosine", agreement), ("batch_to_batch_cosine", consecutive)]}
    late = len(mean["forward"]) // 4  # past warm-up and window fill: the last three quarters
    return {"run": inputs["run"], "norm_options": inputs["norm_options"], "layers": len(forward),
            "channels": {"replayed": sum(len(values["channels"]) for values in inputs["layers"].values()),
                         "of": sum(inputs["num_features"].values())},
            "last_three_quarters": {name: float(np.nanmean(series[late:]))
                                    for name, series in mean.items()},
            **{name: [None if np.isnan(x) else float(x) for x in series]
               for name, series in mean.items()}}


def plot_distances(distances: dict, path: Path, lr: np.ndarray, lr_per_update: bool) -> Path:
    fig = Figure(figsize=(7, 4))
    ax = fig.add_subplot()
    steps = np.arange(1, len(distances["forward"]) + 1)
    ax.plot(steps, distances["forward"], label="forward: |v - s_t| / |s_t|", color="tab:blue")
    ax.plot(steps, distances["backward"], label="backward: |psi - q_t| / |q_t|", color="tab:red")
    ax.set_yscale("log")
    ax.set_xlabel("training step")
    ax.set_ylabel("relative distance (mean over layers)")
    if len(lr):
        twin = ax.twinx()  # rate k ends at step k * T / len(lr) (micro-batches per update alike)
        twin.plot(np.arange(1, len(lr) + 1) * len(steps) / len(lr), lr, color="grey",
                  linestyle=":", label="lr")
        twin.set_ylabel(f"learning rate ({'each update' if lr_per_update else 'end of each epoch'})",
                        color="grey")
    ax.set_title(f"UN's estimates vs the batch's statistics: {Path(distances['run']).name}", fontsize=9)
    ax.legend(fontsize=7, loc="upper right")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=150)
    return path


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("run_dir", type=Path, nargs="?",
                        help="a UN run recorded with record_statistics=true")
    source.add_argument("--from", dest="inputs", type=Path,
                        help="an inputs.npz this module wrote: re-derive from it alone")
    parser.add_argument("--out", type=Path, default=None,
                        help="default: RUN_DIR/analysis, or the folder of --from")
    parser.add_argument("--channels", type=int, default=CHANNELS,
                        help=f"channels kept per layer in inputs.npz (default {CHANNELS})")
    args = parser.parse_args(argv)
    if args.inputs is None:
        out = args.out or args.run_dir / "analysis"
        inputs_path = save_inputs(collect_inputs(args.run_dir, args.channels), out / "inputs.npz")
    else:
        out, inputs_path = args.out or args.inputs.parent, args.inputs
    inputs = load_inputs(inputs_path)  # both ways derive from the file, so it reproduces them
    distances = estimate_distances(inputs)
    out.mkdir(parents=True, exist_ok=True)
    (out / "estimates.json").write_text(json.dumps(distances, indent=1) + "\n")
    plot_distances(distances, out / "estimates.png", inputs["lr"], inputs["lr_per_update"])
    print(json.dumps(distances["last_three_quarters"], indent=1))
    print(f"wrote {out / 'estimates.json'} and {out / 'estimates.png'} from {inputs_path}")


if __name__ == "__main__":
    main()
