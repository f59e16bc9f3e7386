#!/usr/bin/env bash
# Joint BPE (subword-nmt) and fairseq binarisation with a joined dictionary: the last steps of
# scripts/prepare_iwslt14.sh, shared with the synthetic corpus (plugins/fairseq/data.py).
#
#   scripts/bpe_binarize.sh TOK_DIR OUT_DIR SRC TGT MERGES
#
# TOK_DIR holds tokenised, lower-cased {train,valid,test}.{SRC,TGT}. OUT_DIR receives the BPE
# codes (code), the BPE'd text (bpe/) and fairseq's data (dict.SRC.txt, train.SRC-TGT.SRC.bin,
# ...). The tools come from fairseq's environment: FAIRSEQ_ENV, else .venv-fairseq.
set -euo pipefail
if [ $# -ne 5 ]; then sed -n '5p' "$0" >&2; exit 2; fi
tok=$1 out=$2 src=$3 tgt=$4 merges=$5
bin=${FAIRSEQ_ENV:-$(cd "$(dirname "$0")/.." && pwd)/.venv-fairseq}/bin
[ -x "$bin/fairseq-preprocess" ] || { echo "no fairseq environment at $bin/..: run make fairseq-env" >&2; exit 1; }

mkdir -p "$out/bpe"
cat "$tok/train.$src" "$tok/train.$tgt" | "$bin/subword-nmt" learn-bpe -s "$merges" > "$out/code"
for lang in "$src" "$tgt"; do
    for split in train valid test; do
        "$bin/subword-nmt" apply-bpe -c "$out/code" < "$tok/$split.$lang" > "$out/bpe/$split.$lang"
    done
done
"$bin/fairseq-preprocess" --source-lang "$src" --target-lang "$tgt" --joined-dictionary \
    --trainpref "$out/bpe/train" --validpref "$out/bpe/valid" --testpref "$out/bpe/test" \
    --destdir "$out" --workers "${WORKERS:-2}"
