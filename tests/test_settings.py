"""Every setting checked where it is read: a zero or negative count, size or rate, an
evaluation budget below one context, a context longer than the data, refused at the start
with the option's name and its valid range, in every trainer (never a zero division, a
scheduler's bare assertion, or a run that records nothing measured)."""
from __future__ import annotations

import re

import pytest

from plugins.lm.trainer import train as lm_train
from plugins.timm.trainer import train as classification_train
from plugins.torchvision.trainer import train as detection_train
from test_lm import TINY_MODEL, TINY_RECIPE
from test_vision import QUICK, config

LM = ["+exp=llama_71m_un", "logger=none", "device=cpu", "scale.num_workers=0", *TINY_MODEL,
      *TINY_RECIPE]  # context 16


@pytest.mark.parametrize("override, message", [
    ("recipe.micro_batch_size=0", "recipe.micro_batch_size must be >= 1, got 0"),
    ("recipe.eval_every=0", "recipe.eval_every must be >= 1, got 0"),
    ("recipe.max_steps=0", "recipe.max_steps must be >= 1, got 0"),
    ("recipe.batch_size=-8", "recipe.batch_size must be >= 1, got -8"),
    ("recipe.lr=-1", "recipe.lr must be > 0, got -1"),
    ("recipe.warmup_steps=-1", "recipe.warmup_steps must be >= 0, got -1"),
    ("recipe.min_lr_ratio=2", "recipe.min_lr_ratio must be in [0, 1], got 2"),
    ("recipe.clip_grad=0", "recipe.clip_grad must be null or > 0, got 0"),
    ("recipe.eval_tokens=8",
     "recipe.eval_tokens must be at least one context (model.context=16 tokens), got 8"),
    ("recipe.interval_eval_tokens=15",
     "recipe.interval_eval_tokens must be at least one context (model.context=16 tokens), got 15"),
    ("lr_multiple=0", "lr_multiple must be > 0, got 0"),
    ("collapse.check_every=0", "collapse.check_every must be >= 1, got 0"),
    ("recipe.lr=abc", "recipe.lr must be > 0, got 'abc'"),
    ("amp=true", "amp=True: choose amp=auto (autocast on a GPU"),
    ("amp=fp32", "amp='fp32': choose amp=auto"),
])
def test_language_modelling_refuses_a_bad_setting_by_name(override, message, tmp_path):
    with pytest.raises(ValueError, match=re.escape(message)):
        lm_train(config(*LM, "data.root=/nonexistent", override), tmp_path / "run")
    assert not (tmp_path / "run" / "config.yaml").exists()


def test_a_context_longer_than_the_data_names_the_context_and_the_split(tmp_path):
    from test_records import _trainer_run
    _, cfg = _trainer_run("language_modelling", tmp_path)
    root = cfg.data.root
    with pytest.raises(ValueError, match=rf"model.context 100000 is longer than the train data "
                                         rf"of tiny at {root} \(its longest shard holds \d+ tokens"):
        lm_train(config(*LM, f"data.root={root}", "model.context=100000",
                        "recipe.eval_tokens=100000", "recipe.interval_eval_tokens=100000"),
                 tmp_path / "run")


@pytest.mark.parametrize("override, message", [
    ("recipe.lr=-1", "recipe.lr must be > 0, got -1"),
    ("recipe.batch_size=0", "recipe.batch_size must be >= 1, got 0"),
    ("recipe.epochs=0", "recipe.epochs must be >= 1, got 0"),
    ("recipe.label_smoothing=1.0", "recipe.label_smoothing must be in [0, 1), got 1.0"),
    ("scale.max_steps_per_epoch=0", "scale.max_steps_per_epoch must be null or >= 1, got 0"),
])
def test_classification_refuses_a_bad_setting_by_name(override, message, tmp_path):
    with pytest.raises(ValueError, match=re.escape(message)):
        classification_train(config("+exp=swin_t_un", *QUICK, override), tmp_path / "run")


@pytest.mark.parametrize("override, message", [
    ("recipe.lr=0", "recipe.lr must be > 0, got 0"),
    ("recipe.eval_every=0", "recipe.eval_every must be >= 1, got 0"),
    ("recipe.warmup_iters=-5", "recipe.warmup_iters must be >= 0, got -5"),
])
def test_detection_refuses_a_bad_setting_by_name(override, message, tmp_path):
    with pytest.raises(ValueError, match=re.escape(message)):
        detection_train(config("+exp=faster_rcnn_swin_t_un", *QUICK, override), tmp_path / "run")
