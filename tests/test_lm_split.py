"""A language-model run's records do not depend on how an update is split: the same run trained
as one batch of 16 sequences and as 4 accumulated micro-batches of 4 records the same
metrics.jsonl rows and result.json, field by field. The probes (the attention-logit probe, the
future-leak probe and ``val_loss_train_mode``) run on one fixed set of validation windows,
``recipe.probe_sequences`` (configs/recipe/lm_c4.yaml), not on a micro-batch. Two replicas
against one process: tests/test_lm_fsdp.py, with the same comparison (``assert_same_records``).
"""
from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import torch
from omegaconf import OmegaConf

from plugins.checkpoints import load_checkpoint
from plugins.lm.attention import max_attention_logits
from plugins.lm.data import prepare_corpus
from plugins.lm.model import build_lm
from plugins.lm.trainer import train
from plugins.runlog import FINISHED
from test_lm import TINY_MODEL, corpus_root  # noqa: F401 (a fixture)
from test_vision import config

#: float32's unit roundoff
UNIT_ROUNDOFF = 2.0 ** -24

#: what a record may legitimately change with the split, by name, and why
SPLIT_FIELDS = {
    "time": "when the row was written",
    "epoch_time_s": "a timing",
    "tokens_per_s": "a timing",
    "seconds": "a timing (the scale-invariance probe's)",
    "finished": "when the run ended",
    "run_dir": "where the run was written",
    "accumulate": "the split itself: micro-batches per update",
    "micro_batch_size": "the split itself: sequences per forward",
    "world_size": "the split itself: replicas",
    "overrides": "the command line, which chose the split",
}

SEQUENCES, CONTEXT = 16, 16  # per update; TINY_MODEL's model.context
#: a fixed probe set that is neither run's micro-batch nor the batch
PROBES = 8
RUN = ["logger=none", "device=cpu", "scale.num_workers=0", *TINY_MODEL,
       f"recipe.batch_size={SEQUENCES}", "recipe.eval_tokens=512",
       "recipe.interval_eval_tokens=256", f"recipe.probe_sequences={PROBES}"]


def split_tolerance(terms: int) -> float:
    """The tolerance for the records of two runs that differ only in how an update is split,
    derived, not tuned: the split reorders float32 sums (an update's loss and each weight's
    gradient over its tokens, a validation batch's loss), and a float32 sum of ``terms``
    terms moves by at most gamma_(terms-1) = (terms-1)u / (1-(terms-1)u) <= terms * u of the
    sum of their magnitudes (recursive summation, Higham, *Accuracy and Stability of
    Numerical Algorithms*, 2nd ed., section 4.2; u = 2^-24). ``terms``: the longest such sum
    behind a record, an update's tokens. Applied relative to a value, or to 1 below 1 in size
    (an attention logit, a logit change near 0: signed sums, whose magnitudes' sum the value
    does not bound). The weights' own float32 differences reach the records through the
    updates; measured, the records stay 70-200x inside it (8e-8 against 1.5e-5 for 256 tokens
    here, 1.1e-7 against 7.6e-6 for two ranks in tests/test_lm_fsdp.py)."""
    return terms * UNIT_ROUNDOFF


def read_records(run: Path) -> tuple[list[dict], dict]:
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return rows, json.loads((run / "result.json").read_text())


def assert_same_records(want: Path, got: Path, terms: int,
                        also_skip: dict[str, str] | None = None) -> list[str]:
    """Every field of ``got``'s records (each metrics.jsonl row, and result.json with its
    metrics) is ``want``'s: the same fields; ints, bools and strings equal; floats within
    ``split_tolerance(terms)`` (``val_ppl``, ``exp(val_loss)``, as its log). Left out by
    name: ``SPLIT_FIELDS`` and ``also_skip`` (name: why). Returns the fields compared."""
    skip = {**SPLIT_FIELDS, **(also_skip or {})}
    rtol = split_tolerance(terms)
    (want_rows, want_result), (got_rows, got_result) = read_records(want), read_records(got)
    assert len(got_rows) == len(want_rows) > 0, (want, got)
    compared = []
    for index, (w, g) in enumerate(zip(want_rows, got_rows)):
        compared += _compare(w, g, rtol, skip, f"metrics.jsonl row {index + 1}")
    compared += _compare(want_result, got_result, rtol, skip, "result.json")
    return compared


def _compare(want: dict, got: dict, rtol: float, skip: dict, where: str) -> list[str]:
    assert want.keys() == got.keys(), (where, sorted(set(want) ^ set(got)))
    compared = []
    for key in want:
        if key in skip:
            continue
        if key == "val_ppl":
            _same(math.log(want[key]), math.log(got[key]), rtol, f"{where}: log {key}")
        elif isinstance(want[key], dict) and key == "metrics":
            compared += [f"metrics.{k}" for k in _compare(want[key], got[key], rtol, skip,
                                                          f"{where} metrics")]
        else:
            _same(want[key], got[key], rtol, f"{where}: {key}", skip)
        compared.append(key)
    return compared


def _same(want: Any, got: Any, rtol: float, what: str, skip=()) -> None:
    """``got`` is ``want`` within ``rtol`` where a float, exactly otherwise; a nested field
    named in ``skip`` (``scale_invariant.seconds``) is not compared."""
    if isinstance(want, float) and not isinstance(got, bool) and isinstance(got, (int, float)):
        assert math.isclose(got, want, rel_tol=rtol, abs_tol=rtol), (what, want, got)
    elif isinstance(want, (list, tuple)):
        assert isinstance(got, (list, tuple)) and len(got) == len(want), (what, want, got)
        for index, (w, g) in enumerate(zip(want, got)):
            _same(w, g, rtol, f"{what}[{index}]", skip)
    elif isinstance(want, dict):
        assert isinstance(got, dict) and want.keys() == got.keys(), (what, want, got)
        for key in want:
            if key not in skip:
                _same(want[key], got[key], rtol, f"{what}.{key}", skip)
    else:
        assert type(got) is type(want) and got == want, (what, want, got)


def _both_ways(root, tmp_path: Path, *overrides: str) -> dict[int, Path]:
    """The run trained with micro-batches of 16 (one per update) and of 4 (four accumulated)."""
    runs = {}
    for micro in (SEQUENCES, 4):
        runs[micro] = tmp_path / f"micro{micro}"
        result = train(config(*overrides, f"data.root={root}", *RUN,
                              f"recipe.micro_batch_size={micro}"), runs[micro])
        assert result["status"] in FINISHED and result["accumulate"] == SEQUENCES // micro, result
    return runs


def _first_windows(run: Path, count: int) -> tuple[torch.nn.Module, torch.Tensor]:
    """``run``'s final model (eval mode) and its first ``count`` validation windows' inputs."""
    saved = load_checkpoint(run / "last.pt")
    cfg = OmegaConf.create(saved["config"])
    corpus = prepare_corpus(cfg.data)
    model = build_lm(cfg.model, cfg.norm, vocab_size=corpus.vocab_size)
    model.load_state_dict(saved["model"])
    windows = corpus.windows("validation", cfg.model.context)
    return model.eval(), torch.stack([windows[i][0] for i in range(count)])


def test_pre_ln_records_the_same_in_one_batch_and_in_four_micro_batches(corpus_root, tmp_path):  # noqa: F811
    """Pre-LN, 4 updates of 16 sequences (validating every 2): one micro-batch of 16 or four
    of 4 end at the same weights (float32 accumulation order apart), and every recorded field
    agrees within the float32 summation bound of an update's 256 tokens; the attention-logit
    probe is the first 8 validation windows' (recomputed here from last.pt)."""
    runs = _both_ways(corpus_root, tmp_path, "+exp=llama_71m", "norm=ln", "recipe.max_steps=4",
                      "recipe.warmup_steps=2", "recipe.eval_every=2")
    compared = assert_same_records(runs[SEQUENCES], runs[4], terms=SEQUENCES * CONTEXT)
    assert {"max_attn_logit", "max_attn_logit_per_layer", "val_loss", "train_loss",
            "metrics.max_attn_logit_per_layer", "metrics.future_logit_change",
            "metrics.leaks_future", "lr_per_update"} <= set(compared)
    model, inputs = _first_windows(runs[4], PROBES)
    recorded = read_records(runs[4])[1]["metrics"]["max_attn_logit_per_layer"]
    assert max_attention_logits(model, inputs) == recorded


def test_training_mode_probes_record_the_same_in_one_batch_and_in_four_micro_batches(
        corpus_root, tmp_path):  # noqa: F811
    """BN, whose training-mode statistics see later tokens, trained one update at learning
    rate 0 (the warm-up's first): both ways end at the initial weights, so the future-leak
    probe and ``val_loss_train_mode`` (training-mode statistics of batches of the probe set,
    over the validation windows) must agree. What follows BN's micro-batches is left out by
    name: the training loss (each micro-batch's statistics: what training is), and eval mode's
    scores (its running statistics took one EMA step or four)."""
    runs = _both_ways(corpus_root, tmp_path, "+exp=llama_71m", "norm=bn", "recipe.max_steps=1",
                      "recipe.warmup_steps=1", "recipe.eval_every=1")
    states = [load_checkpoint(run / "last.pt")["model"] for run in runs.values()]
    for key, value in states[0].items():
        if "running" not in key and "num_batches" not in key:
            assert torch.equal(states[1][key], value), key
    follows_micro_batches = {
        "train_loss": "training-mode statistics of each micro-batch",
        **{key: "eval mode: running statistics after 1 or 4 EMA steps" for key in
           ("val_loss", "val_ppl", "max_attn_logit", "max_attn_logit_per_layer")}}
    compared = assert_same_records(runs[SEQUENCES], runs[4], terms=SEQUENCES * CONTEXT,
                                   also_skip=follows_micro_batches)
    assert {"metrics.leaks_future", "metrics.future_logit_change",
            "metrics.val_loss_train_mode", "lr_per_update"} <= set(compared)
    rows, result = read_records(runs[4])
    assert rows[-1]["lr_per_update"] == [0.0] and result["metrics"]["leaks_future"]
