#!/usr/bin/env bash
# IWSLT14 De-En prepared as fairseq's examples/translation/prepare-iwslt14.sh does, from a copy
# of the raw corpus you already have (nothing is downloaded), with the same tools in Python:
#
#   scripts/prepare_iwslt14.sh RAW OUT
#
# RAW is de-en.tgz or the directory it unpacks to (train.tags.de-en.{de,en} and the
# IWSLT14.TED*.de-en.{de,en}.xml files). Steps: strip the TED tags, Moses tokenisation
# (sacremoses, escaping as tokenizer.perl), cleaning of the training pairs (1-175 tokens,
# length ratio <= 1.5, as clean-corpus-n.perl), lower-casing, every 23rd training pair to
# valid, test = dev2010 + dev2012 + tst2010-2012, joint BPE of 10k merges (subword-nmt) and
# fairseq-preprocess --joined-dictionary (scripts/bpe_binarize.sh). OUT then is the data root
# of configs/data/iwslt14.yaml (data/iwslt14, or export IWSLT14_DATA=OUT). The tools come from
# fairseq's environment: FAIRSEQ_ENV, else .venv-fairseq (make fairseq-env).
set -euo pipefail
if [ $# -ne 2 ]; then sed -n '5p' "$0" >&2; exit 2; fi
raw=$1 out=$2
here=$(cd "$(dirname "$0")" && pwd)
export FAIRSEQ_ENV=${FAIRSEQ_ENV:-$here/../.venv-fairseq}
bin=$FAIRSEQ_ENV/bin
[ -x "$bin/sacremoses" ] || { echo "no fairseq environment at $FAIRSEQ_ENV: run make fairseq-env" >&2; exit 1; }
src=de tgt=en lang=de-en
tmp=$out/tmp
mkdir -p "$tmp"

if [ -f "$raw" ]; then
    tar -xzf "$raw" -C "$tmp"
    orig=$tmp/$lang
else
    orig=$raw
fi
[ -f "$orig/train.tags.$lang.$src" ] || { echo "no train.tags.$lang.$src in $orig" >&2; exit 1; }

tokenize() { "$bin/sacremoses" -q -l "$1" -j "${WORKERS:-2}" tokenize -x; }
lowercase() { "$bin/python" -c 'import sys; sys.stdout.writelines(line.lower() for line in sys.stdin)'; }

echo "pre-processing train data..."
for l in $src $tgt; do
    grep -v '<url>' "$orig/train.tags.$lang.$l" | grep -v '<talkid>' | grep -v '<keywords>' |
        sed -e 's/<title>//g' -e 's/<\/title>//g' -e 's/<description>//g' -e 's/<\/description>//g' |
        tokenize $l > "$tmp/train.tags.$lang.tok.$l"
done
"$bin/python" - "$tmp/train.tags.$lang.tok" "$tmp/train.tags.$lang.clean" $src $tgt <<'EOF'
import sys  # clean-corpus-n.perl -ratio 1.5 CORPUS SRC TGT OUT 1 175
corpus, out, src, tgt = sys.argv[1:]
with open(f"{corpus}.{src}") as fs, open(f"{corpus}.{tgt}") as ft, \
        open(f"{out}.{src}", "w") as os_, open(f"{out}.{tgt}", "w") as ot:
    for a, b in zip(fs, ft):
        a, b = a.split(), b.split()
        if 1 <= len(a) <= 175 and 1 <= len(b) <= 175 and len(a) <= 1.5 * len(b) and len(b) <= 1.5 * len(a):
            os_.write(" ".join(a) + "\n")
            ot.write(" ".join(b) + "\n")
EOF
for l in $src $tgt; do
    lowercase < "$tmp/train.tags.$lang.clean.$l" > "$tmp/train.tags.$lang.$l"
done

echo "pre-processing valid/test data..."
for l in $src $tgt; do
    for o in "$orig"/IWSLT14.TED*.$l.xml; do
        f=$(basename "$o" .xml)
        grep '<seg id' "$o" | sed -e 's/<seg id="[0-9]*">\s*//g' -e 's/\s*<\/seg>\s*//g' -e "s/\’/\'/g" |
            tokenize $l | lowercase > "$tmp/$f"
    done
done

echo "creating train, valid, test..."
mkdir -p "$out/tok"
for l in $src $tgt; do
    awk '{if (NR%23 == 0)  print $0; }' "$tmp/train.tags.$lang.$l" > "$out/tok/valid.$l"
    awk '{if (NR%23 != 0)  print $0; }' "$tmp/train.tags.$lang.$l" > "$out/tok/train.$l"
    cat "$tmp/IWSLT14.TED.dev2010.$lang.$l" "$tmp/IWSLT14.TEDX.dev2012.$lang.$l" \
        "$tmp/IWSLT14.TED.tst2010.$lang.$l" "$tmp/IWSLT14.TED.tst2011.$lang.$l" \
        "$tmp/IWSLT14.TED.tst2012.$lang.$l" > "$out/tok/test.$l"
done
rm -rf "$tmp"

"$here/bpe_binarize.sh" "$out/tok" "$out" $src $tgt 10000
echo "IWSLT14 De-En ready in $out"
