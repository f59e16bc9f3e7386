"""PNAC and statistics figures of one run recorded with ``record_statistics=true``.

``python scripts/analyze_run.py RUN_DIR [--window 20] [--layer NAME --channel K] [--out DIR]``
writes pnac.csv, pnac.json, fig3_pnac.png, fig7_pnac_density.png, fig4_statistics.png and, for
runs whose norms flag outliers (UN, MABN, PN), fig5_outliers.png, outliers.json, outliers.csv.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import project_env  # noqa: F401  (first: the project's Python, whatever `python` ran this)

import numpy as np

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT))  # analysis/ from a plain checkout

from analysis import plots  # noqa: E402
from analysis.pnac import (KINDS, MIN_WINDOW, pnac_matrix, pnac_rows, write_pnac_csv,  # noqa: E402
                           write_pnac_json)
from analysis.statistics import (load_run_info, load_statistics, outlier_counts,  # noqa: E402
                                 write_outliers)


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("run_dir", type=Path, help="a run directory holding stats/epoch_*.pt")
    parser.add_argument("--window", type=int, default=20,
                        help="PNAC window T in steps (non-overlapping, >= 8; default 20)")
    parser.add_argument("--layer", help="norm layer for Fig. 4 (default: the first one)")
    parser.add_argument("--channel", type=int, default=0, help="channel for Fig. 4 (default 0)")
    parser.add_argument("--mean-window", type=int,
                        help="M for Fig. 4's sliding GM/AM (default: the run's UN window_size, else 4)")
    parser.add_argument("--out", type=Path,
                        help="output folder (default: results/analysis/<exp of the run>)")
    args = parser.parse_args(argv)
    if args.window < MIN_WINDOW:  # before loading: scipy's normaltest would refuse it later
        parser.error(f"--window must be at least {MIN_WINDOW} (normaltest needs {MIN_WINDOW} samples)")
    return args


def main(argv=None) -> None:
    args = parse_args(argv)
    stats = load_statistics(args.run_dir)
    info = load_run_info(args.run_dir)
    out = args.out or REPO_ROOT / "results" / "analysis" / info["exp"]
    out.mkdir(parents=True, exist_ok=True)

    layer = args.layer or next(iter(stats))
    if layer not in stats:
        raise SystemExit(f"--layer {layer!r} is not a recorded norm layer; choose one of: "
                         + ", ".join(stats))
    channels = stats[layer]["act"].shape[1]
    if not 0 <= args.channel < channels:
        raise SystemExit(f"--channel {args.channel} is out of range: {layer} has {channels} channels")
    steps = len(stats[layer]["act"])
    if steps < args.window:
        raise SystemExit(f"the run has {steps} recorded steps, fewer than one PNAC window of "
                         f"{args.window}; pass a smaller --window (>= 8)")

    rows = pnac_rows(stats, args.window)
    written = [out / "pnac.csv", out / "pnac.json"]
    write_pnac_csv(rows, written[0])
    write_pnac_json(rows, written[1], info, args.window)
    written.append(plots.plot_pnac_over_training(rows, info, out / "fig3_pnac.png"))
    written.append(plots.plot_pnac_density(rows, info, out / "fig7_pnac_density.png"))
    mean_window = args.mean_window or info.get("norm_options", {}).get("window_size") or 4
    written.append(plots.plot_statistics(stats[layer]["act"][:, args.channel],
                                         stats[layer]["grad"][:, args.channel], info,
                                         out / "fig4_statistics.png", layer, args.channel,
                                         mean_window))
    skips = {name: values["skip"] for name, values in stats.items() if "skip" in values}
    if skips:
        counts = outlier_counts(skips)
        write_outliers(counts, out / "outliers.json", out / "outliers.csv")
        written += [out / "outliers.json", out / "outliers.csv",
                    plots.plot_outliers(counts, info, out / "fig5_outliers.png")]

    print(f"{info['exp']}: {len(stats)} norm layers, {steps} steps, PNAC window {args.window}")
    for kind in KINDS:
        _, _, matrix = pnac_matrix(rows, kind)
        if matrix.size:
            print(f"  mean {kind} PNAC over layers: start {np.nanmean(matrix[:, 0]):.1f}%, "
                  f"end {np.nanmean(matrix[:, -1]):.1f}%")
    if skips:
        total = sum(values[-1] for values in counts["layers"].values())
        print(f"  outlier filtration: {total} skipped layer-steps over {len(skips)} layers")
    for path in written:
        print(f"  wrote {path}")


if __name__ == "__main__":
    main()
