"""A small synthetic German-like -> English-like parallel corpus, so translation runs anywhere.

The toy grammar has what makes translation more than word substitution, and each source
sentence has exactly one translation, so BLEU measures learning (copying the source scores
near zero: the two vocabularies share only the comma):

* Noun phrases ``DET [ADJ] NOUN`` agree in gender (m/f/n) and case (nominative subject,
  accusative object, dative after ``mit``): ``der alte hund`` / ``den alten hund`` /
  ``dem alten hund`` -> ``the old dog``; ``ein alter hund`` / ``einen alten hund`` -> ``an old
  dog`` (English picks ``a``/``an`` by the next word's sound).
* Four clause types with German word order: main clause ``S V O`` -> ``S V O``; verb-second
  after an adverb ``heute V S O`` -> ``today S V O``; verb-final subordinate clause
  ``ich glaube , dass S O V`` -> ``i think that S V O``; perfect with the participle last
  ``S hat O PARTICIPLE`` -> ``S has PARTICIPLE O`` (``hat`` is also a main verb, "has": only
  the sentence's last word tells them apart).
* An optional ``mit`` phrase ("with") after the object.

Tokens are lower-cased and space-separated (already "tokenised"); the files then go through
the same BPE and binarisation as IWSLT14 (``plugins.fairseq.data``).

    python -m plugins.fairseq.synthetic OUT_DIR [--train 4000 --valid 300 --test 300 --seed 0]
"""
from __future__ import annotations

import argparse
import random
from pathlib import Path

# noun: (gender, English)
NOUNS = {
    "hund": ("m", "dog"), "mann": ("m", "man"), "vogel": ("m", "bird"), "tisch": ("m", "table"),
    "apfel": ("m", "apple"), "lehrer": ("m", "teacher"), "schluessel": ("m", "key"),
    "katze": ("f", "cat"), "frau": ("f", "woman"), "blume": ("f", "flower"),
    "lampe": ("f", "lamp"), "schule": ("f", "school"), "tasche": ("f", "bag"), "eule": ("f", "owl"),
    "kind": ("n", "child"), "haus": ("n", "house"), "buch": ("n", "book"),
    "pferd": ("n", "horse"), "auto": ("n", "car"), "bild": ("n", "picture"), "ei": ("n", "egg"),
}
ADJECTIVES = {  # stems: an attributive adjective always carries an ending
    "gross": "big", "klein": "small", "alt": "old", "jung": "young", "rot": "red",
    "blau": "blue", "schnell": "fast", "mued": "tired", "leer": "empty", "teur": "expensive",
}
# verb: (3rd person singular, participle, English present, English participle)
VERBS = [
    ("sieht", "gesehen", "sees", "seen"), ("mag", "gemocht", "likes", "liked"),
    ("findet", "gefunden", "finds", "found"), ("hat", "gehabt", "has", "had"),
    ("kauft", "gekauft", "buys", "bought"), ("malt", "gemalt", "paints", "painted"),
    ("hoert", "gehoert", "hears", "heard"), ("traegt", "getragen", "carries", "carried"),
    ("sucht", "gesucht", "seeks", "sought"), ("holt", "geholt", "fetches", "fetched"),
]
ADVERBS = {"heute": "today", "jetzt": "now", "morgens": "in the morning", "oft": "often"}

# (definite, case) -> article by gender; then the adjective ending after it.
ARTICLES = {
    (True, "nom"): {"m": "der", "f": "die", "n": "das"},
    (True, "acc"): {"m": "den", "f": "die", "n": "das"},
    (True, "dat"): {"m": "dem", "f": "der", "n": "dem"},
    (False, "nom"): {"m": "ein", "f": "eine", "n": "ein"},
    (False, "acc"): {"m": "einen", "f": "eine", "n": "ein"},
    (False, "dat"): {"m": "einem", "f": "einer", "n": "einem"},
}
ENDINGS = {  # weak endings after the definite article, mixed after the indefinite one
    (True, "nom"): {"m": "e", "f": "e", "n": "e"},
    (True, "acc"): {"m": "en", "f": "e", "n": "e"},
    (True, "dat"): {"m": "en", "f": "en", "n": "en"},
    (False, "nom"): {"m": "er", "f": "e", "n": "es"},
    (False, "acc"): {"m": "en", "f": "e", "n": "es"},
    (False, "dat"): {"m": "en", "f": "en", "n": "en"},
}


def _indefinite(next_word: str) -> str:
    return "an" if next_word[0] in "aeiou" else "a"


def noun_phrase(rng: random.Random, case: str) -> tuple[list[str], list[str]]:
    """One ``DET [ADJ] NOUN`` in ``case``: (German tokens, English tokens)."""
    noun = rng.choice(sorted(NOUNS))
    gender, english_noun = NOUNS[noun]
    definite = rng.random() < 0.5
    adjective = rng.choice(sorted(ADJECTIVES)) if rng.random() < 0.6 else None
    source = [ARTICLES[definite, case][gender]]
    target_words = [english_noun]
    if adjective:
        source.append(adjective + ENDINGS[definite, case][gender])
        target_words.insert(0, ADJECTIVES[adjective])
    source.append(noun)
    article = "the" if definite else _indefinite(target_words[0])
    return source, [article] + target_words


def sentence_pair(rng: random.Random) -> tuple[str, str]:
    """One sentence of a random clause type and its translation."""
    subject, subject_en = noun_phrase(rng, "nom")
    obj, obj_en = noun_phrase(rng, "acc")
    verb, participle, verb_en, participle_en = rng.choice(VERBS)
    extra, extra_en = [], []
    if rng.random() < 0.3:
        companion, companion_en = noun_phrase(rng, "dat")
        extra, extra_en = ["mit"] + companion, ["with"] + companion_en
    kind = rng.randrange(4)
    if kind == 0:    # main clause: same order
        source = subject + [verb] + obj + extra
        target = subject_en + [verb_en] + obj_en + extra_en
    elif kind == 1:  # adverb first: the verb stays second, before the subject
        adverb = rng.choice(sorted(ADVERBS))
        source = [adverb, verb] + subject + obj + extra
        target = ADVERBS[adverb].split() + subject_en + [verb_en] + obj_en + extra_en
    elif kind == 2:  # subordinate clause: the verb goes last
        source = ["ich", "glaube", ",", "dass"] + subject + obj + extra + [verb]
        target = ["i", "think", "that"] + subject_en + [verb_en] + obj_en + extra_en
    else:            # perfect: auxiliary second, participle last
        source = subject + ["hat"] + obj + extra + [participle]
        target = subject_en + ["has", participle_en] + obj_en + extra_en
    return " ".join(source), " ".join(target)


def generate(train: int, valid: int, test: int, seed: int = 0) -> dict[str, list[tuple[str, str]]]:
    """Disjoint splits of distinct sentence pairs, deterministic in ``seed``."""
    rng = random.Random(seed)
    seen: set[str] = set()
    splits: dict[str, list[tuple[str, str]]] = {}
    for name, size in (("train", train), ("valid", valid), ("test", test)):
        pairs = []
        while len(pairs) < size:
            source, target = sentence_pair(rng)
            if source not in seen:
                seen.add(source)
                pairs.append((source, target))
        splits[name] = pairs
    return splits


def write_corpus(out_dir: Path, train: int = 4000, valid: int = 300, test: int = 300,
                 seed: int = 0, source_lang: str = "de", target_lang: str = "en") -> Path:
    """Write ``{train,valid,test}.{de,en}`` (one sentence per line) under ``out_dir``."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    for name, pairs in generate(train, valid, test, seed).items():
        for lang, side in ((source_lang, 0), (target_lang, 1)):
            (out_dir / f"{name}.{lang}").write_text("".join(pair[side] + "\n" for pair in pairs))
    return out_dir


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("out_dir", type=Path)
    parser.add_argument("--train", type=int, default=4000)
    parser.add_argument("--valid", type=int, default=300)
    parser.add_argument("--test", type=int, default=300)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    print(write_corpus(args.out_dir, args.train, args.valid, args.test, args.seed))


if __name__ == "__main__":
    main()
