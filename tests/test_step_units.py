"""One unit for step counts: the norms count micro-batches (training forward/backward passes
of one replica), as the releases do; every count the project derives from a schedule written
in optimizer updates is converted with the gradient accumulation."""
from __future__ import annotations

from plugins.scale import effective_config, lr_warmup_steps, norm_steps_per_update
from test_vision import config


def _effective(*overrides):
    return effective_config(config(*overrides), overrides)


def test_wmt14_learning_rate_warmup_counts_accumulated_micro_batches():
    full = config("+exp=wmt14_un")
    assert full.recipe.train.update_freq == 16
    assert norm_steps_per_update(full) == 16
    assert lr_warmup_steps(full) == 10000 * 16
    assert norm_steps_per_update(config("+exp=swin_t_un")) == 1


def test_cpu_scaling_of_norm_steps_uses_micro_batches_on_both_sides():
    """UN's 4000-step warm-up sits at 4000 / 160000 of WMT14's learning-rate warm-up (in
    micro-batches); at scale=cpu (100 warm-up updates, update_freq 1) that is 2.5 -> 2 steps,
    not the 40 that counting updates would give."""
    cpu = _effective("+exp=wmt14_un", "scale=cpu")
    assert cpu.scale.norm_step_factor == 100 / 160000
    assert cpu.norm.warmup_iters == round(4000 * 100 / 160000)
    accumulated = _effective("+exp=wmt14_un", "scale=cpu", "recipe.cpu.train.update_freq=4")
    assert accumulated.recipe.train.update_freq == 4
    assert accumulated.norm.warmup_iters == round(4000 * 100 * 4 / 160000)
    iwslt = _effective("+exp=iwslt14_un", "scale=cpu")  # update_freq 1 on both sides
    assert iwslt.norm.warmup_iters == round(4000 * iwslt.recipe.train.warmup_updates / 6000)


def test_classification_scales_by_the_warmup_that_runs_per_update():
    """At scale=cpu the one-epoch warm-up is 1437 // 64 = 22 updates against Swin-T's 20 x
    1251 = 25020 (1,281,167 images at batch 1024); capping the epoch at 11 updates halves it."""
    cpu = _effective("+exp=swin_t_un", "scale=cpu")
    assert cpu.scale.norm_step_factor == 22 / 25020 and cpu.norm.warmup_iters == round(4000 * 22 / 25020)
    capped = _effective("+exp=swin_t_un", "scale=cpu", "scale.max_steps_per_epoch=11")
    assert capped.scale.norm_step_factor == 11 / 25020 and capped.norm.warmup_iters == 2


def test_a_norm_step_count_given_on_the_command_line_is_not_rescaled():
    cfg = _effective("+exp=wmt14_un", "scale=cpu", "norm.warmup_iters=30")
    assert cfg.norm.warmup_iters == 30
