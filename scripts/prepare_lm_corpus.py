"""Token shards of a public web corpus for full-scale language modelling, written once on your
machine, which the LM task memory-maps (plugins/lm/data.py; configs/data/lm_c4.yaml).

    # C4 as Mix-LN trains on it: allenai/c4 'en' json.gz shards and T5-base's tokenizer
    python scripts/prepare_lm_corpus.py c4 --input data/raw/c4/en --tokenizer models/t5-base \\
        --train-tokens 2.7e9 --out data/c4
    # the same, streamed from the Hugging Face Hub (needs `pip install datasets`)
    python scripts/prepare_lm_corpus.py c4 --hf --tokenizer t5-base --train-tokens 2.7e9 --out data/c4
    # FineWeb (sample-10BT parquet files) or OpenWebText with a byte-level BPE trained here
    python scripts/prepare_lm_corpus.py fineweb --input data/raw/fineweb --vocab-size 32768 --out data/fineweb

Documents are read in file order (files sorted by name), each encoded as the tokenizer does
(T5's appends ``</s>``, the BPE trained here ``<|endoftext|>``) and concatenated into
``<split>_<k>.bin`` shards. C4 has its own validation shards; FineWeb and OpenWebText
(parquet or JSON-lines files under --input) have one split, so a document is validation when
the hash of its text falls under ``--valid-fraction``. Each split stops after the document
that reaches its token budget. ``meta.json`` records the source, the files read, a sha256 of
each split's documents, the tokenizer (and its sha256; a copy is saved as ``tokenizer.json``)
and the token counts. The directory appears only when complete.

Mix-LN (as GaLore) does not pack: it truncates or pads each document to 256 tokens and masks
the padding. These shards pack documents into one stream, so every window is full.
"""
from __future__ import annotations

import argparse
import gzip
import itertools
import json
import math
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator, Optional

import project_env  # noqa: F401  (first: the project's Python, whatever `python` ran this)

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from plugins.generated import generating  # noqa: E402
from plugins.lm.data import (FORMAT, Document, SplitWriter, in_validation, publish,  # noqa: E402
                             token_dtype, tokenizer_record, train_tokenizer, write_meta)


@dataclass(frozen=True)
class Source:
    hf_name: str                 # the dataset on the Hugging Face Hub
    hf_config: Optional[str]
    train_globs: tuple[str, ...]     # the files of each split under --input
    validation_globs: tuple[str, ...]    # none: validation is split off train by hash
    hf_validation_split: Optional[str]


ANY_FILES = ("**/*.parquet", "**/*.jsonl", "**/*.jsonl.gz", "**/*.json.gz")
SOURCES = {
    "c4": Source("allenai/c4", "en", ("c4-train.*.json.gz",), ("c4-validation.*.json.gz",), "validation"),
    "fineweb": Source("HuggingFaceFW/fineweb", "sample-10BT", ANY_FILES, (), None),
    "openwebtext": Source("Skylion007/openwebtext", None, ANY_FILES, (), None),
}
TEXT_FIELD = "text"


def _json_lines(path: Path) -> Iterator[str]:
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt", encoding="utf-8") as lines:
        for line in lines:
            if line.strip():
                yield json.loads(line)[TEXT_FIELD]


def _parquet(path: Path) -> Iterator[str]:
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise SystemExit(f"{path.name}: reading parquet files needs pyarrow, which the project does "
                         f"not install: pip install pyarrow") from None
    for batch in pq.ParquetFile(path).iter_batches(columns=[TEXT_FIELD]):
        yield from batch.column(0).to_pylist()


def file_documents(files: list[Path]) -> Iterator[str]:
    """The texts of JSON-lines (``.json``, ``.jsonl``, optionally ``.gz``) or parquet files."""
    for path in files:
        yield from (_parquet(path) if path.suffix == ".parquet" else _json_lines(path))


def hf_documents(source: Source, split: str) -> Iterator[str]:
    """The texts of ``split`` of the source's Hub dataset, streamed by ``datasets``."""
    try:
        import datasets
    except ImportError:
        raise SystemExit("--hf streams the corpus with the Hugging Face `datasets` library, which "
                         "the project does not install: pip install datasets (or download the "
                         "files and pass --input)") from None
    for row in datasets.load_dataset(source.hf_name, source.hf_config, split=split, streaming=True):
        yield row[TEXT_FIELD]


def input_files(directory: Path, patterns: tuple[str, ...]) -> list[Path]:
    """The files under ``directory`` matching any of ``patterns``, sorted by path."""
    files = sorted({p for pattern in patterns for p in Path(directory).glob(pattern) if p.is_file()},
                   key=lambda p: p.relative_to(directory).as_posix())
    if not files:
        raise SystemExit(f"no files matching {' or '.join(patterns)} under {directory}; pass the "
                         f"directory that holds them as --input")
    return files


def load_tokenizer(name: str, end_token: Optional[str]):
    """A tokenizer from a ``tokenizer.json`` (or a directory with one, such as a saved
    t5-base), else from the Hub by name; documents must end or start with a special token
    (T5 appends ``</s>``), or ``end_token`` is appended to each."""
    from tokenizers import Tokenizer, processors

    path = Path(name)
    if path.is_dir():
        path = path / "tokenizer.json"
    if path.is_file():
        tokenizer = Tokenizer.from_file(str(path))
    elif Path(name).exists():
        raise SystemExit(f"{name} holds no tokenizer.json; save the tokenizer with "
                         f"transformers' AutoTokenizer.from_pretrained(...).save_pretrained({name!r})")
    else:
        tokenizer = Tokenizer.from_pretrained(name)
    tokenizer.no_truncation()
    tokenizer.no_padding()
    if end_token is not None:
        end_id = tokenizer.token_to_id(end_token)
        if end_id is None:
            raise SystemExit(f"--end-token {end_token!r} is not in the tokenizer's vocabulary")
        tokenizer.post_processor = processors.TemplateProcessing(single=f"$A {end_token}",
                                                                 special_tokens=[(end_token, end_id)])
    elif not any(tokenizer.encode("boundary").special_tokens_mask):
        raise SystemExit(f"tokenizer {name} marks no document boundary (no special token in an "
                         f"encoding); pass --end-token, e.g. --end-token '<|endoftext|>'")
    return tokenizer


def write_splits(directory: Path, streams: dict[str, Callable[[], Iterator[str]]],
                 valid_fraction: float, tokenizer, budgets: dict[str, float], shard_tokens: int) -> dict:
    """Each split's shards: from its own stream, or, for a source with a train stream only,
    from one pass over it, a document going to validation when the hash of its text says so."""
    dtype = token_dtype(tokenizer.get_vocab_size())
    writers = {split: SplitWriter(directory, split, tokenizer, dtype, budgets[split], shard_tokens)
               for split in ("train", "validation")}
    added = dict.fromkeys(writers, 0)

    def add(split: str, text: str) -> None:
        writers[split].add(Document(f"{split}/{added[split]}", text))  # its place in the split
        added[split] += 1
        if added[split] % 10_000 == 0:
            print("\r" + ", ".join(f"{name}: {w.tokens:,} tokens" for name, w in writers.items()),
                  end="", flush=True)

    if "validation" not in streams:
        for text in streams["train"]():
            if all(w.full for w in writers.values()):
                break
            split = "validation" if in_validation(text, valid_fraction) else "train"
            if not writers[split].full:
                add(split, text)
    else:
        for split, stream in streams.items():
            for text in stream():
                if writers[split].full:
                    break
                add(split, text)
    print()
    return {split: writer.record() for split, writer in writers.items()}


def main(argv: Optional[list[str]] = None) -> None:
    parser = argparse.ArgumentParser(description=" ".join(__doc__.split("\n\n")[0].split()),
                                     formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    parser.add_argument("source", choices=sorted(SOURCES))
    where = parser.add_mutually_exclusive_group(required=True)
    where.add_argument("--input", type=Path, help="directory of the source's files")
    where.add_argument("--hf", action="store_true", help="stream the source from the Hub (datasets)")
    parser.add_argument("--out", type=Path, required=True)
    tok = parser.add_mutually_exclusive_group(required=True)
    tok.add_argument("--tokenizer", help="tokenizer.json, a directory with one, or a Hub name (t5-base)")
    tok.add_argument("--vocab-size", type=int, help="train a byte-level BPE of this size on train")
    parser.add_argument("--min-frequency", type=int, default=2)
    parser.add_argument("--tokenizer-documents", type=int, default=500_000,
                        help="the BPE is trained on the first this many train documents")
    parser.add_argument("--end-token", help="append this token to each document")
    parser.add_argument("--train-tokens", type=float, default=math.inf)
    parser.add_argument("--valid-tokens", type=float, default=10e6,
                        help="Mix-LN evaluates on 10M tokens of C4's validation split")
    parser.add_argument("--valid-fraction", type=float, default=0.001,
                        help="sources without a validation split: the share of documents held out")
    parser.add_argument("--shard-tokens", type=int, default=250_000_000)
    args = parser.parse_args(argv)

    source = SOURCES[args.source]
    if args.hf:
        origin = {"hf_dataset": source.hf_name, "hf_config": source.hf_config}
        streams = {"train": lambda: hf_documents(source, "train")}
        if source.hf_validation_split:
            streams["validation"] = lambda: hf_documents(source, source.hf_validation_split)
    else:
        files = {"train": input_files(args.input, source.train_globs)}
        if source.validation_globs:
            files["validation"] = input_files(args.input, source.validation_globs)
        origin = {"input": str(args.input.resolve()),
                  "files": {split: [p.relative_to(args.input).as_posix() for p in paths]
                            for split, paths in files.items()}}
        streams = {split: (lambda paths=paths: file_documents(paths)) for split, paths in files.items()}
    split_rule, train_texts = "the source's validation split", streams["train"]
    if "validation" not in streams:
        split_rule = f"validation: sha256(text)[:8] / 2**64 < {args.valid_fraction}"
        train_texts = lambda: (t for t in streams["train"]() if not in_validation(t, args.valid_fraction))  # noqa: E731

    if args.tokenizer:
        tokenizer = load_tokenizer(args.tokenizer, args.end_token)
        tokenizer_info = {**tokenizer_record(tokenizer, args.tokenizer), "trained_on": "pretrained"}
    else:
        tokenizer = train_tokenizer(itertools.islice(train_texts(), args.tokenizer_documents),
                                    args.vocab_size, args.min_frequency)
        tokenizer_info = {**tokenizer_record(tokenizer, f"bpe{args.vocab_size}"),
                          "trained_on": f"the first {args.tokenizer_documents} train documents",
                          "min_frequency": args.min_frequency}

    def build(directory: Path) -> None:
        tokenizer.save(str(directory / "tokenizer.json"))
        splits = write_splits(directory, streams, args.valid_fraction, tokenizer,
                              {"train": args.train_tokens, "validation": args.valid_tokens},
                              args.shard_tokens)
        write_meta(directory, {
            "format": FORMAT, "dtype": token_dtype(tokenizer.get_vocab_size()).name, "splits": splits,
            "split_rule": split_rule, "corpus": {"name": args.source, **origin},
            "tokenizer": tokenizer_info})

    with generating(args.out):
        if (args.out / "meta.json").exists():
            raise SystemExit(f"{args.out} is already prepared; remove it or choose another --out")
        publish(args.out, build)
    meta = json.loads((args.out / "meta.json").read_text())
    print(f"wrote {args.out}: " + ", ".join(f"{split} {part['tokens']:,} tokens in "
                                            f"{part['documents']:,} documents"
                                            for split, part in meta["splits"].items()))


if __name__ == "__main__":
    main()
