"""Would UN's outlier filtration have fired before a run without it collapsed?

Reads a run recorded with ``record_statistics=true`` (a collapse keeps its statistics up to
the collapse) and replays every layer's recorded second moments s_t, all channels, through a
``UnifiedNorm`` built with the run's options and outlier filtration on: the first step at which
its bound (``am - gm > M * Var(sqrt(window))``, unnorm's own test) fires, per layer. Up to that
step the replay's window is the run's own, so the first firing is exactly what the filter would
have decided; after it the run would have differed. Reported beside the warm-up's end and the
collapse step.

    python -m analysis.collapse RUN_DIR [--out DIR]     # DIR/collapse.json
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Optional

import numpy as np
import torch

from .estimates import replaying_layer
from .statistics import load_run_info, load_statistics


def first_filtered_step(act: np.ndarray, options: dict) -> Optional[int]:
    """The first step (t, from 1) at which outlier filtration would skip, replaying the
    recorded s_t ``(T, C)`` of one layer; None if it never would (non-finite rows end it)."""
    norm = replaying_layer(act.shape[1], {**options, "outlier_filtration": True})
    clean = torch.tensor(True)
    for step, second_moment in enumerate(torch.from_numpy(np.ascontiguousarray(act, np.float32))):
        if not torch.isfinite(second_moment).all():
            return None
        norm.replay_step(second_moment, torch.zeros_like(second_moment), None, clean)
        if int(norm.num_skipped):
            return step + 1
    return None


def collapse_report(run_dir: Path) -> dict:
    """Per layer: the first step the filter would skip, and the step s_t first grew more than
    tenfold over its previous value; with the run's warm-up end and collapse step."""
    info = load_run_info(run_dir)
    options = info["norm_options"]
    layers = {}
    for name, records in load_statistics(run_dir).items():
        act = records["act"].double().numpy()
        growth = act[1:] / np.maximum(act[:-1], 1e-30)
        jumps = np.flatnonzero(np.nanmax(np.where(np.isfinite(growth), growth, np.inf), axis=1) > 10)
        layers[name] = {"first_filtered_step": first_filtered_step(act, options),
                        "first_tenfold_growth_step": int(jumps[0]) + 2 if len(jumps) else None,
                        "recorded_steps": int(act.shape[0])}
    filtered = [v["first_filtered_step"] for v in layers.values() if v["first_filtered_step"]]
    return {"run": str(run_dir), "status": info.get("status"), "fail_step": info.get("fail_step"),
            "warmup_iters": options["warmup_iters"], "window_size": options["window_size"],
            "first_filtered_step": min(filtered) if filtered else None,
            "layers_filtered_before_collapse": sum(
                1 for step in filtered if info.get("fail_step") is None or step < info["fail_step"]),
            "layers": layers}


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("run_dir", type=Path)
    parser.add_argument("--out", type=Path, default=None, help="default: the run folder")
    args = parser.parse_args(argv)
    out = args.out or args.run_dir
    out.mkdir(parents=True, exist_ok=True)
    report = collapse_report(args.run_dir)
    (out / "collapse.json").write_text(json.dumps(report, indent=2) + "\n")
    print(f"first filtered step {report['first_filtered_step']} (warm-up ends at "
          f"{report['warmup_iters']}, collapse at {report['fail_step']}): "
          f"{report['layers_filtered_before_collapse']} of {len(report['layers'])} layers "
          f"filtered before it; wrote {out / 'collapse.json'}")


if __name__ == "__main__":
    main()
