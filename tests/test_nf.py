"""The normalizer-free baseline (``norm=nonorm ws=nf recipe.agc=...``): Scaled WS held to timm's
``ScaledStdConv2d`` (forward and backward, its linear form to a 1x1 convolution), and adaptive
gradient clipping through the training loop's step held to timm's ``adaptive_clip_grad``,
under a loss scale too; AGC with ``recipe.clip_grad`` or in translation refused by name."""
from __future__ import annotations

import copy
import re

import pytest
import torch
from omegaconf import OmegaConf
from timm.layers import ScaledStdConv2d
from timm.utils.agc import adaptive_clip_grad
from torch import nn

import unnorm
from plugins.loop import optimizer_step
from plugins.optim import check_clipping
from plugins.timm.models import model_from_config
from plugins.timm.trainer import train as classification_train
from test_vision import QUICK, config


def _timm_pair(groups: int, gamma: float):
    """timm's ScaledStdConv2d with random gains, and ours holding its parameters (float64)."""
    torch.manual_seed(0)
    reference = ScaledStdConv2d(6, 8, 3, groups=groups, gamma=gamma).double()
    with torch.no_grad():
        reference.gain.uniform_(0.5, 2.0)
    ours = nn.Sequential(nn.Conv2d(6, 8, 3, padding=1, groups=groups)).double()
    unnorm.standardize_weights(ours, "0", eps=1e-6, eps_form="scaled", gamma=gamma)
    ours[0].load_state_dict(reference.state_dict())
    return reference, ours[0]


@pytest.mark.parametrize("groups", [1, 2])
def test_scaled_ws_convolution_is_timms_forward_and_backward(groups):
    reference, ours = _timm_pair(groups, gamma=1.7139588594436646)
    x = torch.randn(2, 6, 5, 5, dtype=torch.float64, requires_grad=True)
    want, got = reference(x), ours(x)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    grad = torch.randn_like(want)
    want_grads = torch.autograd.grad(want, [x, reference.weight, reference.gain, reference.bias],
                                     grad)
    got_grads = torch.autograd.grad(got, [x, ours.weight, ours.gain, ours.bias], grad)
    for name, g, w in zip(("input", "weight", "gain", "bias"), got_grads, want_grads):
        torch.testing.assert_close(g, w, rtol=1e-10, atol=1e-12, msg=lambda m: f"{name}: {m}")


def test_scaled_ws_linear_is_timms_1x1_convolution():
    torch.manual_seed(0)
    reference = ScaledStdConv2d(6, 8, 1, gamma=1.7).double()
    with torch.no_grad():
        reference.gain.uniform_(0.5, 2.0)
    ours = nn.Sequential(nn.Linear(6, 8)).double()
    unnorm.standardize_weights(ours, "0", eps=1e-6, eps_form="scaled", gamma=1.7)
    ours[0].load_state_dict({"weight": reference.weight.reshape(8, 6), "bias": reference.bias,
                             "gain": reference.gain.reshape(8, 1)})
    x = torch.randn(4, 6, dtype=torch.float64)
    torch.testing.assert_close(ours(x), reference(x[:, :, None, None]).flatten(1),
                               rtol=1e-12, atol=1e-12)


def test_scaled_ws_of_half_weights_computes_in_float32():
    half = nn.Sequential(nn.Linear(16, 8)).bfloat16()
    full = nn.Sequential(nn.Linear(16, 8))
    full.load_state_dict({k: v.float() for k, v in half.state_dict().items()})
    for model in (half, full):
        unnorm.standardize_weights(model, "0", eps=1e-6, eps_form="scaled", gamma=1.7)
    with torch.no_grad():
        half[0].gain.fill_(1.25)  # exact in bfloat16
        full[0].gain.fill_(1.25)  # exact in bfloat16
    torch.testing.assert_close(half[0].standardized_weight(),
                               full[0].standardized_weight().bfloat16(), rtol=0, atol=0)


def test_baking_scaled_ws_keeps_the_function_and_drops_the_gain():
    _, layer = _timm_pair(1, gamma=1.7)
    model = nn.Sequential(layer)
    x = torch.randn(2, 6, 5, 5, dtype=torch.float64)
    want = model(x)
    assert unnorm.bake_standardized_weights(model) == 1
    assert type(model[0]) is nn.Conv2d and "0.gain" not in model.state_dict()
    torch.testing.assert_close(model(x), want, rtol=1e-12, atol=1e-12)


def test_gamma_is_scaled_ws_s_alone():
    with pytest.raises(ValueError, match="gamma is Scaled WS's"):
        unnorm.standardize_weights(nn.Sequential(nn.Linear(4, 4)), "0", gamma=1.7)


def test_ws_nf_standardises_the_stem_and_blocks_not_the_head():
    model = model_from_config(config("+exp=swin_t_nonorm", *QUICK, "ws=nf"))
    scaled = {name for name, m in model.named_modules()
              if isinstance(m, unnorm.ScaledStandardizedLinear | unnorm.ScaledStandardizedConv2d)}
    plain = {name for name, m in model.named_modules()
             if type(m) in (nn.Linear, nn.Conv2d)}
    assert "patch_embed.proj" in scaled and "layers.0.blocks.0.mlp.fc2" in scaled
    assert plain == {"head.fc"}


def _clipped_step(scaler, agc: float):
    """(the parameters after the loop's step with AGC, those after timm's AGC on the
    unscaled gradients then the same step)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 4))
    reference = copy.deepcopy(model)
    x, y = torch.randn(32, 8), torch.randn(32, 4)
    loss = lambda net: 1e3 * (net(x) - y).square().mean()  # large enough to clip
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    (scaler.scale(loss(model)) if scaler is not None else loss(model)).backward()
    optimizer_step(optimizer, scaler, None, model.parameters(), agc=agc)
    loss(reference).backward()
    grads = [p.grad.clone() for p in reference.parameters()]
    adaptive_clip_grad(reference.parameters(), agc)
    assert any(not torch.equal(g, p.grad) for g, p in zip(grads, reference.parameters()))
    torch.optim.SGD(reference.parameters(), lr=0.1).step()
    return list(model.parameters()), list(reference.parameters())


@pytest.mark.parametrize("scaled", [False, True])
def test_agc_in_the_loop_clips_as_timm_does(scaled):
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 10) if scaled else None
    got, want = _clipped_step(scaler, agc=0.01)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-7)


def test_agc_with_clip_grad_is_refused_by_name(tmp_path):
    # Swin-T's recipe clips by the norm (clip_grad 5.0)
    with pytest.raises(ValueError, match=re.escape(
            "recipe.agc=0.01 and recipe.clip_grad=5.0 both clip the gradients")):
        classification_train(config("+exp=swin_t_nonorm", *QUICK, "recipe.agc=0.01"),
                             tmp_path / "run")
    with pytest.raises(ValueError, match=re.escape("recipe.agc must be null or > 0, got 0")):
        classification_train(config("+exp=t2t_vit_14_nonorm", *QUICK, "recipe.agc=0"),
                             tmp_path / "run")


def test_agc_in_translation_replaces_fairseqs_clipping_and_is_refused_beside_it():
    """fairseq's trainer clips there (plugins.fairseq.train; tests/test_fairseq.py runs it)."""
    check_clipping(OmegaConf.create({"task": "translation",
                                     "recipe": {"agc": 0.01, "train": {"clip_norm": 0.0}}}))
    cfg = OmegaConf.create({"task": "translation", "recipe": {"agc": 0.01, "train": {"clip_norm": 0.1}}})
    with pytest.raises(ValueError, match=re.escape(
            "recipe.agc=0.01 and recipe.train.clip_norm=0.1 both clip the gradients")):
        check_clipping(cfg)
