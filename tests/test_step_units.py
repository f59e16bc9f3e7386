"""One unit for step counts: the norms count micro-batches (training forward/backward passes
of one replica), as the releases do; every count the project derives from a schedule written
in optimizer updates is converted with the gradient accumulation."""
from __future__ import annotations

import math

import pytest

from plugins.scale import effective_config, lr_warmup_steps, norm_steps_per_update
from test_vision import config
from unnorm.base import forgetting_steps

NO_FLOOR = "scale.warmup_init_weight=null"  # the scaling alone, without the warm-up floor


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
    not the 40 that counting updates would give (the scaling alone: the warm-up floor off)."""
    cpu = _effective("+exp=wmt14_un", "scale=cpu", NO_FLOOR)
    assert cpu.scale.norm_step_factor == 100 / 160000
    assert cpu.norm.warmup_iters == round(4000 * 100 / 160000)
    accumulated = _effective("+exp=wmt14_un", "scale=cpu", "recipe.train.update_freq=4", NO_FLOOR)
    assert accumulated.recipe.train.update_freq == 4
    assert accumulated.norm.warmup_iters == round(4000 * 100 * 4 / 160000)
    iwslt = _effective("+exp=iwslt14_un", "scale=cpu")  # update_freq 1 on both sides
    assert iwslt.norm.warmup_iters == round(4000 * iwslt.recipe.train.warmup_updates / 6000)


def test_classification_scales_by_the_warmup_that_runs_per_update():
    """At scale=cpu the one-epoch warm-up is 1437 // 64 = 22 updates against Swin-T's 20 x
    1251 = 25020 (1,281,167 images at batch 1024); capping the epoch at 11 updates halves it."""
    cpu = _effective("+exp=swin_t_un", "scale=cpu", NO_FLOOR)
    assert cpu.scale.norm_step_factor == 22 / 25020 and cpu.norm.warmup_iters == round(4000 * 22 / 25020)
    capped = _effective("+exp=swin_t_un", "scale=cpu", "scale.max_steps_per_epoch=11", NO_FLOOR)
    assert capped.scale.norm_step_factor == 11 / 25020 and capped.norm.warmup_iters == 2


def test_a_norm_step_count_given_on_the_command_line_is_not_rescaled():
    cfg = _effective("+exp=wmt14_un", "scale=cpu", "norm.warmup_iters=30")
    assert cfg.norm.warmup_iters == 30


@pytest.mark.parametrize("exp, alpha", [("swin_t_un", 0.9), ("t2t_vit_14_mabn", 0.9),
                                        ("llama_71m_un", 0.9), ("t2t_vit_14_pn", 0.9),
                                        ("swin_t_un", 0.95)])
def test_a_scaled_warmup_ends_only_once_its_averages_have_forgotten_their_initial_values(exp, alpha):
    """The floor: alpha^n <= 1% of the initial value left, n the warm-up (44 at alpha 0.9,
    90 at 0.95), where the scaling alone gives 4 to 36 steps; the averages it waits for are
    every momentum option (PN's forward and backward ones)."""
    scaled = _effective(f"+exp={exp}", "scale=cpu", NO_FLOOR, f"norm.momentum={alpha}")
    cfg = _effective(f"+exp={exp}", "scale=cpu", f"norm.momentum={alpha}")
    n = cfg.norm.warmup_iters
    assert scaled.norm.warmup_iters < n
    assert alpha ** n <= 0.01 < alpha ** (n - 1)
    if "momentum_bwd" in cfg.norm:
        slow = _effective(f"+exp={exp}", "scale=cpu", "norm.momentum_bwd=0.95")
        assert slow.norm.warmup_iters == math.ceil(math.log(0.01) / math.log(0.95)) == 90


def test_the_warmup_floor_keeps_the_papers_count_a_given_one_and_a_norm_without_warmup():
    """Never longer than at full scale (alpha 0.999 would need 4603 > UN's 4000), a warm-up
    long enough already stays (IWSLT14's 67), the command line's stays, PRepBN's 0 (no batch
    phase to end) stays 0, and a norm without a warm-up gets none."""
    assert _effective("+exp=swin_t_un", "scale=cpu", "norm.momentum=0.999").norm.warmup_iters == 4000
    assert _effective("+exp=iwslt14_un", "scale=cpu").norm.warmup_iters == round(4000 * 100 / 6000)
    assert _effective("+exp=swin_t_un", "scale=cpu", "norm.warmup_iters=5").norm.warmup_iters == 5
    assert _effective("+exp=llama_71m_prepbn", "scale=cpu").norm.warmup_iters == 0
    assert "warmup_iters" not in _effective("+exp=swin_t_bn", "scale=cpu").norm
    assert _effective("+exp=swin_t_un").norm.warmup_iters == 4000  # full scale: as the paper


def test_forgetting_steps_is_the_closed_form():
    assert [forgetting_steps(a, 0.01) for a in (0.0, 0.5, 0.9, 0.98)] == [1, 7, 44, 228]
    assert forgetting_steps(0.1, 0.01) == 2  # exactly 0.1^2: no float round-up to 3
    with pytest.raises(ValueError, match="init_weight"):
        forgetting_steps(0.9, 0.0)


@pytest.mark.parametrize("weight", ["0", "1", "1.5"])
def test_a_warmup_init_weight_outside_0_1_is_refused_by_name(weight):
    with pytest.raises(ValueError, match=r"scale.warmup_init_weight must be null or in \(0, 1\)"):
        _effective("+exp=swin_t_un", "scale=cpu", f"scale.warmup_init_weight={weight}")


@pytest.mark.parametrize("exp, norm, groups", [("llama_71m_ln", "bcn", 4), ("iwslt14_ln", "bcn", 4),
                                               ("t2t_vit_14_ln", "evonorm_s0", 5),
                                               ("swin_t_ln", "evonorm_s0", 11)])
def test_a_grouped_norm_keeps_the_full_scales_channels_a_group(exp, norm, groups):
    """32 groups at the full model's width w are w / 32 channels a group: at the CPU width the
    groups are as many as keep that (LM: 64 / (512 / 32) = 4), not 32 groups of two."""
    full = _effective(f"+exp={exp}", f"norm={norm}")
    cpu = _effective(f"+exp={exp}", f"norm={norm}", "scale=cpu")
    assert full.norm.groups == 32 and cpu.model.width < full.model.width
    assert cpu.norm.groups == round(cpu.model.width / (full.model.width / 32)) == groups
    assert _effective(f"+exp={exp}", f"norm={norm}", "scale=cpu", "norm.groups=32").norm.groups == 32
    off = _effective(f"+exp={exp}", f"norm={norm}", "scale=cpu", "scale.scale_norm_groups=false")
    assert off.norm.groups == 32


def test_the_lm_norms_get_the_scaled_groups_sixteen_channels_each():
    from plugins.lm.model import build_lm
    from unnorm.bcn import BatchChannelNorm
    cfg = _effective("+exp=llama_71m_ln", "norm=bcn", "scale=cpu")
    model = build_lm(cfg.model, cfg.norm, vocab_size=32)
    norms = [m for m in model.modules() if isinstance(m, BatchChannelNorm)]
    assert norms and {(m.num_features // m.groups) for m in norms} == {512 // 32}


def test_a_model_without_a_width_is_refused_naming_the_fix():
    from omegaconf import OmegaConf
    from plugins.scale import effective_config
    cfg = config("+exp=llama_71m_ln", "norm=bcn", "scale=cpu")
    OmegaConf.set_struct(cfg, False)
    del cfg.model["width"]
    with pytest.raises(ValueError, match="no `width`.*norm.groups"):
        effective_config(cfg, ["scale=cpu"])
