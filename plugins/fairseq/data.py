"""Translation data: fairseq's binarised data under a data config's ``root``.

IWSLT14 and WMT14 are prepared once by the user (``scripts/prepare_iwslt14.sh``; see
docs/translation.md for WMT14). The synthetic corpus is generated on first use and goes through the same
joint BPE and ``fairseq-preprocess --joined-dictionary`` (``scripts/bpe_binarize.sh``).
"""
from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

from plugins.generated import MANIFEST, generating, verify_manifest, write_manifest

from .synthetic import write_corpus

REPO = Path(__file__).resolve().parents[2]


def binarised_files(root: Path, source: str, target: str) -> list[Path]:
    """What fairseq-train and fairseq-generate read from ``root``."""
    files = [root / f"dict.{source}.txt", root / f"dict.{target}.txt"]
    for split in ("train", "valid", "test"):
        files += [root / f"{split}.{source}-{target}.{lang}.{ext}"
                  for lang in (source, target) for ext in ("bin", "idx")]
    return files


def prepare(data_cfg, fairseq_env: Path) -> Path:
    """The binarised data of ``data_cfg``. The synthetic corpus is generated on first use
    (complete once its manifest, written last, is there) and verified against its manifest
    each time it is opened; IWSLT14 and WMT14 are the user's to prepare."""
    root = Path(data_cfg.root).resolve()
    if data_cfg.get("synthetic"):
        with generating(root):
            if not (root / MANIFEST).exists():
                _generate_synthetic(data_cfg, root, fairseq_env)
        verify_manifest(root, f"rm -r {root} (the next run generates it again)")
        return root
    missing = [p for p in binarised_files(root, data_cfg.source_lang, data_cfg.target_lang)
               if not p.exists()]
    if missing:
        raise FileNotFoundError(
            f"data {data_cfg.name}: {root} lacks fairseq's binarised data ({missing[0].name} "
            f"and {len(missing) - 1} more); prepare it with: {data_cfg.prepare}")
    return root


def _generate_synthetic(data_cfg, root: Path, fairseq_env: Path) -> None:
    source, target = data_cfg.source_lang, data_cfg.target_lang
    staging = root.with_name(root.name + ".tmp")  # renamed when complete: a kill leaves no half
    shutil.rmtree(staging, ignore_errors=True)
    write_corpus(staging / "tok", source_lang=source, target_lang=target, **data_cfg.synthetic)
    subprocess.run(["bash", str(REPO / "scripts" / "bpe_binarize.sh"), str(staging / "tok"),
                    str(staging), source, target, str(data_cfg.bpe_tokens)],
                   env={**os.environ, "FAIRSEQ_ENV": str(fairseq_env)}, check=True,
                   stdout=subprocess.DEVNULL)
    write_manifest(staging)
    shutil.rmtree(root, ignore_errors=True)
    os.replace(staging, root)
