"""Options every norm shares: the momentum convention (the paper's alpha, not torch's) and
whether a norm is offline."""
from __future__ import annotations

import warnings

import pytest
import torch

import unnorm

C = 8
#: the norms the project knows: offline (eval a fixed per-channel affine, foldable: the paper's
#: Table 1 and the rivals' releases) or online. A norm not listed declares itself
#: (``ChannelNorm.offline``, ``offline_for``: ``test_is_offline_is_what_the_built_norm_says``)
OFFLINE = {"bn", "mabn", "pn", "un", "prepbn"}
ONLINE = {"ln", "rms", "pn_ls", "nonorm", "dyt", "bcn", "evonorm_b0", "evonorm_s0", "scalenorm", "gn"}
# (norm, option) for every momentum a registry norm takes: an option named momentum* is an
# alpha, the weight of the old value
MOMENTA = [(name, option) for name in unnorm.available_norms()
           for option in unnorm.option_names(name) if option.startswith("momentum")]


def test_the_known_norms_momenta_are_found():
    """A momentum renamed away from momentum* would drop out of the tests below unnoticed."""
    assert {(name, option) for name, option in MOMENTA if name in OFFLINE | ONLINE} == {
        ("bn", "momentum"), ("mabn", "momentum"), ("pn", "momentum"), ("pn_ls", "momentum"),
        ("un", "momentum"), ("prepbn", "momentum"), ("pn", "momentum_bwd"),
        ("pn_ls", "momentum_bwd"), ("bcn", "momentum"), ("evonorm_b0", "momentum")}


@pytest.mark.parametrize("name,option", MOMENTA)
def test_torch_style_momentum_warns_with_the_equivalent_alpha(name, option):
    with pytest.warns(UserWarning, match=rf"{option}=0\.1 keeps 10% .*torch's BatchNorm momentum "
                                         r"0\.1 == alpha 0\.9.*pass 1 - 0\.1 = 0\.9"):
        norm = unnorm.build_norm(name, C, **{option: 0.1})
    assert getattr(norm, option) == 0.1  # warned, not refused: ablations set small values


@pytest.mark.parametrize("value", [0.9, 0.6, 0.5])
@pytest.mark.parametrize("name,option", MOMENTA)
def test_alpha_style_momentum_is_silent(name, option, value):
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert getattr(unnorm.build_norm(name, C, **{option: value}), option) == value


@pytest.mark.parametrize("value", [1.0, -0.1, float("nan"), "0.9", True])
@pytest.mark.parametrize("name,option", MOMENTA)
def test_momentum_outside_zero_one_is_refused(name, option, value):
    with pytest.raises(ValueError, match=rf"{option} \(alpha.*must be in \[0, 1\).*1 - m"):
        unnorm.build_norm(name, C, **{option: value})


def test_bn_momentum_is_the_weight_of_the_old_running_value():
    """alpha = 0.2 keeps 20% of the old running mean (torch's momentum 0.8), warning aside."""
    with pytest.warns(UserWarning):
        norm = unnorm.build_norm("bn", C, momentum=0.2)
    reference = torch.nn.BatchNorm1d(C, momentum=0.8)
    x = torch.randn(16, C) + 3.0
    norm(x.requires_grad_(True)).sum().backward()
    reference(x.detach())
    torch.testing.assert_close(norm.running_mean, reference.running_mean)
    torch.testing.assert_close(norm.running_var, reference.running_var)


@pytest.mark.parametrize("name", unnorm.available_norms())
def test_is_offline_is_what_the_built_norm_says(name):
    assert unnorm.is_offline(name) == unnorm.build_norm(name, C).offline
    for options in ({"causal": True, "positions": 4}, {"apply_act": False}):  # options that decide it
        if set(options) <= set(unnorm.option_names(name)):
            assert unnorm.is_offline(name, **options) == unnorm.build_norm(name, C, **options).offline


def test_offline_norms_are_those_with_a_fixed_inference_affine():
    offline = {name for name in unnorm.available_norms() if unnorm.is_offline(name)}
    assert OFFLINE | ONLINE <= set(unnorm.available_norms())
    assert offline & (OFFLINE | ONLINE) == OFFLINE
    for name in offline:  # eval output of each is x * scale + shift
        norm = unnorm.build_norm(name, C).eval()
        scale, shift = norm.inference_affine()
        x = torch.randn(4, C)
        torch.testing.assert_close(norm(x), x * scale + shift)
