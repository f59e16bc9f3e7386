"""The gradient noise scale of a run from its norms' per-example gradient norms (``record_gns=true``).

McCandlish et al. (2018, App. A): from the gradient norms of two batch sizes of the same step,
here B_small = 1 (per-example gradients g_i) and B_big = B (the micro-batch), with
|G_small|^2 = mean_i |g_i|^2 and |G_big|^2 = |mean_i g_i|^2,

    |G|^2     ~ (B |G_big|^2 - |G_small|^2) / (B - 1)
    tr(Sigma) ~ (|G_small|^2 - |G_big|^2) / (1 - 1/B)

are unbiased, and B_simple = tr(Sigma) / |G|^2. One step's estimates are noisy (|G|^2 can come
out negative), so, as nanoGNS does, each is smoothed by an EMA and B_simple is the ratio of the
two smoothed values. Gray et al. (2024) found the norms' affine parameters alone predict the
whole model's GNS; the sums here run over those parameters of every norm.

    python -m analysis.gns RUN_DIR [--out DIR] [--ema 0.95]     # gns.json and gns.png
    python -m analysis.gns RUN_DIR... --out DIR      # each run in DIR/<name>/, DIR/summary.md
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np
import torch
from matplotlib.figure import Figure
from scipy.signal import lfilter

from unnorm.gns import cat_padded

from .plots import run_title, save_figure
from .statistics import PathLike, epoch_files, load_run_info

BATCH_KEYS = ("batch_size", "accumulate", "replicas")


def load_gns(run_dir: PathLike) -> dict:
    """``{"layers": {layer: {"example_sq": (S, B), "batch_sq": (S,), "examples": (S,)}},
    "batch_size", "accumulate", "replicas"}`` over all epochs: S records, one per micro-batch.
    Refuses epochs whose layers or batch settings differ (concatenating them would mix runs).
    A run batched by tokens (translation) records as ``batch_size`` its epoch's mean examples
    per micro-batch, a float that differs between epochs: the run's is their mean over records."""
    parts: dict[str, dict[str, list[torch.Tensor]]] = {}
    batch, means = None, []
    for path in epoch_files(run_dir, "gns", "record_gns"):
        epoch = torch.load(path, map_location="cpu", weights_only=True)
        settings = {key: epoch[key] for key in BATCH_KEYS}
        if isinstance(settings["batch_size"], float):
            means.append((settings["batch_size"], len(next(iter(epoch["layers"].values()))["batch_sq"])))
            settings["batch_size"] = "mean"
        if parts and (set(epoch["layers"]) != set(parts) or settings != batch):
            raise ValueError(f"{path}: its layers or batch settings ({settings}) differ from the "
                             f"earlier epochs' ({batch}); were two runs written to one directory?")
        batch = settings
        for layer, values in epoch["layers"].items():
            for key, tensor in values.items():
                parts.setdefault(layer, {}).setdefault(key, []).append(tensor)
    if means:
        batch["batch_size"] = sum(size * records for size, records in means) / sum(r for _, r in means)
    return {"layers": {layer: {key: cat_padded(chunks) for key, chunks in values.items()}
                       for layer, values in parts.items()}, **batch}


def step_norms(layers: dict) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per record: ``(|G_small|^2, |G_big|^2, B)`` over the affine parameters of ``layers``."""
    examples = [values["examples"].double().numpy() for values in layers.values()]
    if any(len(e) != len(examples[0]) or not np.array_equal(e, examples[0]) for e in examples):
        raise ValueError("the layers' records disagree on the steps or their examples: every "
                         "norm must record once per micro-batch (a norm used twice per step, or "
                         "one skipped in some steps, cannot be summed with the others)")
    count = examples[0]
    with np.errstate(invalid="ignore", divide="ignore"):
        small = sum(values["example_sq"].double().sum(dim=1).numpy() for values in layers.values()) / count
    big = sum(values["batch_sq"].double().numpy() for values in layers.values())
    return small, big, count


def unbiased_estimates(small_sq, big_sq, batch) -> tuple[np.ndarray, np.ndarray]:
    """``(|G|^2, tr(Sigma))`` estimates from B_small = 1 and B_big = ``batch`` (App. A)."""
    small_sq, big_sq, batch = (np.asarray(a, dtype=np.float64) for a in (small_sq, big_sq, batch))
    with np.errstate(invalid="ignore", divide="ignore"):
        return ((batch * big_sq - small_sq) / (batch - 1),
                (small_sq - big_sq) / (1 - 1 / batch))


def ema(values, alpha: float) -> np.ndarray:
    """Exponential moving average from zero, debiased (divided by 1 - alpha^t)."""
    values = np.asarray(values, dtype=np.float64)
    steps = np.arange(1, len(values) + 1)
    return lfilter([1 - alpha], [1, -alpha], values) / (1 - alpha ** steps)


def noise_scale(small_sq, big_sq, batch, alpha: float = 0.95) -> dict:
    """B_simple over training from per-record norms: records that are non-finite or have
    fewer than two examples (no B_big > B_small) are left out, the rest smoothed in order.
    B_simple is NaN where the smoothed |G|^2 is not positive."""
    if not 0 <= alpha < 1:
        raise ValueError(f"the EMA's alpha (weight of the old value) must be in [0, 1), got {alpha}")
    small_sq, big_sq, batch = (np.asarray(a, dtype=np.float64) for a in (small_sq, big_sq, batch))
    finite, enough = np.isfinite(small_sq) & np.isfinite(big_sq), batch >= 2
    used = finite & enough
    g2, trace = unbiased_estimates(small_sq[used], big_sq[used], batch[used])
    smooth_g2, smooth_trace = ema(g2, alpha), ema(trace, alpha)
    with np.errstate(invalid="ignore", divide="ignore"):
        b_simple = np.where(smooth_g2 > 0, smooth_trace / smooth_g2, np.nan)
    return {"record": np.flatnonzero(used), "small_sq": small_sq[used], "big_sq": big_sq[used],
            "examples": batch[used], "g2": g2, "tr_sigma": trace, "ema_g2": smooth_g2,
            "ema_tr_sigma": smooth_trace, "b_simple": b_simple,
            "dropped": {"non_finite": int((~finite & enough).sum()),
                        "fewer_than_two_examples": int((~enough).sum())}}


def _last(values: np.ndarray) -> float | None:
    return _plain(values[-1:])[0] if len(values) else None


def _plain(values: np.ndarray) -> list:
    """Floats for JSON, None where not finite (JSON has no NaN)."""
    return [float(v) if np.isfinite(v) else None for v in np.asarray(values, dtype=np.float64)]


def run_gns(run_dir: PathLike, alpha: float = 0.95) -> dict:
    """What ``gns.json`` holds: the whole model's series and final values, each layer's final
    B_simple, and the batch sizes to compare B_simple with."""
    records = load_gns(run_dir)
    layers = records["layers"]
    whole = noise_scale(*step_norms(layers), alpha)
    per_layer = {name: _last(noise_scale(*step_norms({name: values}), alpha)["b_simple"])
                 for name, values in layers.items()}
    update_batch = records["batch_size"] * records["accumulate"] * records["replicas"]
    series = {key: _plain(whole[key]) for key in
              ("small_sq", "big_sq", "examples", "g2", "tr_sigma", "ema_g2", "ema_tr_sigma",
               "b_simple")}
    return {"run": str(run_dir), "ema": alpha, "records": int(len(next(iter(layers.values()))["batch_sq"])),
            "used": int(len(whole["record"])), "dropped": whole["dropped"],
            "batch": {key: records[key] for key in BATCH_KEYS} | {"update": update_batch},
            "final": {"b_simple": _last(whole["b_simple"]), "g2": _last(whole["ema_g2"]),
                      "tr_sigma": _last(whole["ema_tr_sigma"])},
            "layers": per_layer,
            "series": {"record": whole["record"].tolist(),
                       "update": (whole["record"] // records["accumulate"] + 1).tolist(), **series}}


def plot_gns(result: dict, info: dict, path: PathLike) -> Path:
    """B_simple over training, with the run's batch per update as a horizontal line."""
    series = result["series"]
    fig = Figure(figsize=(6.4, 4.0), layout="constrained")
    ax = fig.subplots()
    accumulate = result["batch"]["accumulate"]
    updates = (np.asarray(series["record"]) + 1) / accumulate
    b_simple = np.array([np.nan if v is None else v for v in series["b_simple"]])
    ax.plot(updates, b_simple, color="tab:blue", linewidth=1.2,
            label=f"$B_{{simple}}$ (EMA {result['ema']} of each estimate)")
    ax.axhline(result["batch"]["update"], color="tab:red", linestyle="--",
               label=f"batch per update ({_batch_text(result['batch']['update'])})")
    if np.nanmin(b_simple, initial=np.inf) > 0:
        ax.set_yscale("log")
    ax.set_xlabel("optimizer update" + (f" ({accumulate} micro-batches each)" if accumulate > 1 else ""))
    ax.set_ylabel("gradient noise scale $B_{simple}$")
    ax.set_title(f"Gradient noise scale from the norms' affine parameters\n{run_title(info)}",
                 fontsize=10)
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    return save_figure(fig, path)


def _batch_text(batch: int | float) -> str:
    """A batch size as written: a mean one (batches of tokens) to a tenth."""
    return str(batch) if isinstance(batch, int) else f"{batch:.1f}"


def late_b_simple(result: dict) -> float | None:
    """The median B_simple over the second half of training's records: one number per run,
    past the EMAs' start-up."""
    values = np.array([np.nan if v is None else v for v in result["series"]["b_simple"]])
    late = values[len(values) // 2:]
    late = late[np.isfinite(late)]
    return float(np.median(late)) if len(late) else None


def summary(results: dict[str, dict]) -> str:
    """A markdown table: per run, the batch per update, B_simple late in training and their
    ratio (below 1: the batch is smaller than the noise scale, each step mostly noise)."""
    lines = ["| run | batch per update | B_simple (median, 2nd half) | batch / B_simple |",
             "|---|---:|---:|---:|"]
    for name, result in results.items():
        late, batch = late_b_simple(result), result["batch"]["update"]
        lines.append(f"| {name} | {_batch_text(batch)} | {'—' if late is None else f'{late:.0f}'} | "
                     f"{'—' if not late else f'{batch / late:.2f}'} |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("run_dirs", type=Path, nargs="+", help="runs trained with record_gns=true")
    parser.add_argument("--out", type=Path, default=None,
                        help="default: RUN_DIR/analysis; with several runs, OUT/<run name>/ each "
                             "and OUT/summary.md")
    parser.add_argument("--ema", type=float, default=0.95,
                        help="alpha of the EMAs of |G|^2 and tr(Sigma) (nanoGNS: 0.95)")
    args = parser.parse_args(argv)
    several = len(args.run_dirs) > 1
    if several and args.out is None:
        parser.error("several runs need --out (their summary goes there)")
    results = {}
    for run_dir in args.run_dirs:
        out = (args.out / run_dir.name if several else args.out) or run_dir / "analysis"
        result = results[run_dir.name] = run_gns(run_dir, args.ema)
        out.mkdir(parents=True, exist_ok=True)
        (out / "gns.json").write_text(json.dumps(result, indent=1) + "\n")
        plot_gns(result, load_run_info(run_dir), out / "gns.png")
        print(json.dumps({key: result[key] for key in ("final", "batch", "dropped")}, indent=1))
        print(f"wrote {out / 'gns.json'} and {out / 'gns.png'}")
    if several:
        (args.out / "summary.md").write_text(summary(results))
        print(summary(results))


if __name__ == "__main__":
    main()
