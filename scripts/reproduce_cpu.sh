#!/usr/bin/env bash
# CPU-scale mini-reproduction on the project's small data (about 40 min on 2 cores): every
# norm x both vision models on the embedded digits, UN's window-size and momentum sweeps,
# Mask R-CNN with LN and UN on generated shapes, then the tables and figures.
# Runs (with checkpoints and statistics) go to $OUT; their small files are copied to
# results/runs/cpu, which scripts/make_tables.py reads.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
OUT=${OUT:-runs/cpu_repro}
COMMON=(scale=cpu logger=none record_statistics=true)
if [ "${SKIP_TRAINING:-0}" != 1 ]; then
  exps=$(for m in swin_t t2t_vit_14; do for n in ln rms bn mabn pn pn_ls nonorm un; do
    printf "%s_%s," "$m" "$n"; done; done)
  $PY scripts/train.py -m "+exp=${exps%,}" "${COMMON[@]}" hydra.sweep.dir="$OUT/main"
  $PY scripts/train.py -m +exp=swin_t_un +sweep=window_size "${COMMON[@]}" hydra.sweep.dir="$OUT/window_size"
  $PY scripts/train.py -m +exp=swin_t_un +sweep=momentum "${COMMON[@]}" hydra.sweep.dir="$OUT/momentum"
  $PY scripts/train.py -m +exp=mask_rcnn_swin_t_ln,mask_rcnn_swin_t_un "${COMMON[@]}" \
    hydra.sweep.dir="$OUT/detection"
fi
rm -rf results/runs/cpu
for run in "$OUT"/*/*/; do
  dest="results/runs/cpu/$(basename "$(dirname "$run")")/$(basename "$run")"
  mkdir -p "$dest"
  cp "$run"/result.json "$run"/config.yaml "$run"/metrics.jsonl "$dest"/
done
$PY scripts/make_tables.py
for exp in swin_t_un swin_t_bn t2t_vit_14_un t2t_vit_14_ln; do
  $PY scripts/analyze_run.py "$(ls -d "$OUT"/main/*_"$exp"-cpu)" --out "results/analysis/$exp-cpu"
done
$PY scripts/cka.py "$(ls -d "$OUT"/main/*_t2t_vit_14_ln-cpu)" "$(ls -d "$OUT"/main/*_t2t_vit_14_un-cpu)" \
  --out results/analysis/cka_t2t_vit_14_ln_vs_un-cpu
$PY scripts/cka.py "$(ls -d "$OUT"/main/*_t2t_vit_14_ln-cpu)" "$(ls -d "$OUT"/main/*_t2t_vit_14_bn-cpu)" \
  --out results/analysis/cka_t2t_vit_14_ln_vs_bn-cpu
