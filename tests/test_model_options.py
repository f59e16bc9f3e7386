"""The trainers' layer options and composable experiments (issue 33): Weight Standardization
(``model.weight_standardization``, ``ws=transformer``) in classification and both detection
backends, SepNorm (``model.class_norm``) on T2T-ViT and Hugging Face models, what folding,
conversion and initialising from a run do with them, and ``+exp=<model> norm=<name>``.
References are written from the formulas (WS: each output unit's weights standardised over its
fan-in) and from tufts-ml/SepNorm's module (``ReleaseSepNorm``)."""
from __future__ import annotations

import copy
import json
import math
import sys

import pytest
import torch
import torch.nn.functional as F
from omegaconf import OmegaConf

import unnorm
from plugins.checkpoints import load_checkpoint
from hydra_plugins.unnorm_experiments import open_norm_settings
from plugins.model_options import standardized_layers
from plugins.scale import effective_config
from plugins.timm import model_from_config
from plugins.timm.trainer import train
from plugins.training import load_weights
from test_bcn_evonorm import ReleaseSepNorm
from test_records import TIMES, KillAt, SimulatedKill
from test_vision import QUICK, ROOT, config

EXP = ROOT / "configs" / "exp"
T2T_BLOCKS = 4  # t2t_vit_tiny, the scale=cpu T2T-ViT
T2T_WIDTH = 64


def built(*overrides: str) -> tuple:
    """The scale=cpu config of ``overrides`` and the classifier the trainer builds from it."""
    cfg = effective_config(config(*overrides, "scale=cpu"), overrides)
    return cfg, model_from_config(cfg)


def reference_ws(weight: torch.Tensor, eps: float = 1e-5, form: str = "var") -> torch.Tensor:
    """Weight Standardization from its formula: each output unit's fan-in centred, then divided
    by sqrt(unbiased var + eps) (the BCN release) or by (unbiased std + eps) (the WS README)."""
    rows = weight.detach().double().reshape(weight.shape[0], -1)
    centred = rows - rows.mean(dim=1, keepdim=True)
    if form == "var":
        scale = torch.sqrt(centred.var(dim=1, keepdim=True) + eps)
    else:
        scale = centred.std(dim=1, keepdim=True) + eps
    return (centred / scale).reshape(weight.shape).to(weight.dtype)


def standardized_names(model) -> list[str]:
    return sorted(standardized_layers(model))


# --- composable experiments ---------------------------------------------------------------------

def composed(*overrides: str) -> dict:
    return OmegaConf.to_container(config(*overrides), resolve=True)


def with_norm(base: dict, setting: str, norm: str) -> dict:
    """``base`` (a composed ``+exp=<setting> ...``) with the norm group ``norm``: that norm's
    config, and the experiment named after it."""
    norm_config = OmegaConf.load(ROOT / "configs" / "norm" / f"{norm}.yaml")
    return {**copy.deepcopy(base), "norm": OmegaConf.to_container(norm_config),
            "exp_name": f"{setting}_{norm}"}


#: the experiment files that fix their norm: the setting each builds on, with which groups,
#: and the values it changes there (the release's UN for translation; the ablations' base)
SPECIAL_CASES = {
    "iwslt14_un": ("iwslt14", ["norm=un"], {"norm.outlier_filtration": False,
                                            "model.norm_pad_mask": False}),
    "wmt14_un": ("wmt14", ["norm=un"], {"norm.outlier_filtration": False,
                                        "model.norm_pad_mask": False}),
    "mask_rcnn_swin_t_1x_un": ("mask_rcnn_swin_t", ["norm=un", "recipe=detection_1x"],
                               {"exp_name": "mask_rcnn_swin_t_1x_un"}),
}


def test_the_experiment_files_are_one_per_setting_and_the_special_cases():
    settings = ["faster_rcnn_swin_t", "gin_cluster", "gin_freesolv", "gin_pattern",
                "graph_transformer_cluster", "graph_transformer_freesolv",
                "graph_transformer_pattern", "iwslt14", "llama_130m", "llama_1b", "llama_71m",
                "mask_rcnn_swin_t", "sentiment", "swin_t", "swin_t_cifar10", "swin_t_cifar100",
                "t2t_vit_14", "t2t_vit_14_cifar10", "t2t_vit_14_cifar100", "wmt14"]
    assert open_norm_settings() == settings
    assert sorted(path.stem for path in EXP.glob("*.yaml")) == sorted([*settings, *SPECIAL_CASES])


@pytest.mark.parametrize("setting", open_norm_settings())
def test_every_setting_composes_with_every_registry_norm_by_name(setting):
    """``+exp=<setting>_<norm>`` and ``+exp=<setting> norm=<norm>`` are ``+exp=<setting>``
    with that norm's config, named after it, for every registry norm."""
    base = composed(f"+exp={setting}")
    for norm in unnorm.available_norms():
        name = f"{setting}_{norm}"
        want = with_norm(base, setting, norm)
        assert composed(f"+exp={setting}", f"norm={norm}") == want, name
        if name not in SPECIAL_CASES:
            assert composed(f"+exp={name}") == want, name


@pytest.mark.parametrize("name", SPECIAL_CASES)
def test_a_special_case_is_its_setting_with_what_it_changes(name):
    setting, groups, changes = SPECIAL_CASES[name]
    want = OmegaConf.create(composed(f"+exp={setting}", *groups))
    for key, value in changes.items():
        assert OmegaConf.select(want, key) != value, f"{name} changes nothing at {key}"
        OmegaConf.update(want, key, value)
    assert composed(f"+exp={name}") == OmegaConf.to_container(want)


def _dotted(node, prefix: str = "") -> set[str]:
    """The dotted keys a config file sets (its defaults list aside)."""
    if not isinstance(node, dict):
        return {prefix[:-1]}
    return {key for name, value in node.items() if not (name == "defaults" and not prefix)
            for key in _dotted(value, f"{prefix}{name}.")}


def test_no_experiment_sets_what_the_cpu_scale_replaces():
    """Hydra merges an experiment's own values after every group, the scale's variants
    included: an experiment's value would beat scale=cpu's. So experiments leave what the
    variants set (and the data, which scale=cpu replaces whole) to the groups: a schedule of
    their own is a recipe file (configs/recipe/lm_c4_llama_130m.yaml)."""
    scaled = {"data"}
    for group in ("model", "recipe"):
        for path in (ROOT / "configs" / "scale" / group).glob("*.yaml"):
            scaled |= _dotted(OmegaConf.to_container(OmegaConf.load(path)), f"{group}.")
    assert {"recipe.max_steps", "model.hidden_size", "recipe.train.lr"} <= scaled
    for path in EXP.glob("*.yaml"):
        own = _dotted(OmegaConf.to_container(OmegaConf.load(path)))
        clash = sorted(key for key in own for other in scaled
                       if f"{key}.".startswith(f"{other}.") or f"{other}.".startswith(f"{key}."))
        assert not clash, f"configs/exp/{path.name} sets {clash}, which scale=cpu's variants set"


@pytest.mark.parametrize("exp, backend, targets, residual", [
    ("t2t_vit_14", None, ["blocks.*.attn.qkv", "blocks.*.mlp.fc1"],
     ["blocks.*.attn.proj", "blocks.*.mlp.fc2"]),
    ("swin_t", None, ["layers.*.blocks.*.attn.qkv", "layers.*.blocks.*.mlp.fc1"],
     ["layers.*.blocks.*.attn.proj", "layers.*.blocks.*.mlp.fc2"]),
    ("faster_rcnn_swin_t", "torchvision", ["backbone.body.layers.*.blocks.*.attn.qkv",
                                          "backbone.body.layers.*.blocks.*.mlp.fc1"],
     ["backbone.body.layers.*.blocks.*.attn.proj", "backbone.body.layers.*.blocks.*.mlp.fc2"]),
    ("mask_rcnn_swin_t", "mmdet", ["backbone.stages.*.blocks.*.attn.w_msa.qkv",
                                   "backbone.stages.*.blocks.*.ffn.layers.0.0"],
     ["backbone.stages.*.blocks.*.attn.w_msa.proj", "backbone.stages.*.blocks.*.ffn.layers.1"])])
def test_the_transformer_preset_names_each_blocks_qkv_and_fc1(exp, backend, targets, residual):
    """ws=transformer: the layers reading each block's norms; ws=residual: the layers writing
    its residual stream (attention output, fc2)."""
    more = [f"model.backend={backend}"] if backend else []
    assert config(f"+exp={exp}", *more).model.weight_standardization is None
    assert config(f"+exp={exp}", "ws=transformer", *more).model.weight_standardization == targets
    assert config(f"+exp={exp}", "ws=residual", *more).model.weight_standardization == residual
    given = config(f"+exp={exp}_bn", "model.weight_standardization=[a.*,b]").model
    assert given.weight_standardization == ["a.*", "b"]


# --- Weight Standardization -------------------------------------------------------------------

@pytest.mark.parametrize("form", ["var", "std"])
def test_the_trainers_classifier_standardises_the_named_layers_by_the_formula(form):
    cfg, model = built("+exp=t2t_vit_14", "norm=bcn", "ws=transformer", f"model.ws_eps_form={form}",
                       "model.ws_eps=1e-4")
    want = sorted(f"blocks.{i}.{layer}" for i in range(T2T_BLOCKS) for layer in ("attn.qkv", "mlp.fc1"))
    assert standardized_names(model) == want
    # in float64: in float32 the layer's standardised weights and the reference's differ by
    # their rounding, and the products by another CPU's (on an AVX2 one a third of 1e-5); in
    # float64 64 products of 1.1e-16 stay under 1e-13, and another eps or form is 10% away
    x = torch.randn(2, 5, T2T_WIDTH, dtype=torch.float64)
    for name in want:
        layer = copy.deepcopy(model.get_submodule(name)).double()
        expected = F.linear(x, reference_ws(layer.weight, 1e-4, form), layer.bias)
        torch.testing.assert_close(layer(x), expected, rtol=1e-7, atol=1e-7)
    assert model(torch.randn(2, 3, 32, 32)).shape == (2, 10)
    _, swin = built("+exp=swin_t", "ws=transformer")
    assert standardized_names(swin) == sorted(f"layers.{s}.blocks.{b}.{layer}" for s in range(4)
                                              for b in range(2) for layer in ("attn.qkv", "mlp.fc1"))


@pytest.mark.parametrize("overrides, refused", [
    (["+exp=t2t_vit_14", "model.weight_standardization=[head]"],
     "'head' matches head, the model's classifier / predictor head"),
    (["+exp=t2t_vit_14", "model.weight_standardization=[tokens_to_token.*]"],
     r"tokens_to_token\.layer1\.attn\.qkv.*the model's embedding.*ws=transformer: \['blocks"),
    (["+exp=swin_t", "model.weight_standardization=[patch_embed.proj]"],
     r"the model's embedding.*ws=transformer: \['layers\.\*\.blocks"),
    (["+exp=t2t_vit_14", "model.weight_standardization=[blocks.*.attn.qkv,nothing]"],
     "pattern 'nothing' matches no plain nn.Linear or nn.Conv2d of the model; its layers: blocks"),
    (["+exp=t2t_vit_14", "ws=transformer", "model.ws_eps_form=sqrt"],
     "model.ws_eps_form.*eps_form must be one of 'var', 'std', 'biased_var'")])
def test_the_classifier_refuses_the_embedding_the_head_and_patterns_that_match_nothing(
        overrides, refused):
    with pytest.raises(ValueError, match=rf"^model.weight_standardization.*{refused}"):
        built(*overrides)


def test_torchvision_detectors_standardise_backbone_layers_and_convolutions():
    from plugins.torchvision.detectors import build_detector

    overrides = ["+exp=mask_rcnn_swin_t", "norm=bn", "scale=cpu", "model.ws_eps_form=std",
                 "model.weight_standardization=[backbone.body.layers.*.blocks.*.mlp.fc1,"
                 "backbone.fpn.layer_blocks.*]"]
    cfg = effective_config(config(*overrides), overrides)
    detector = build_detector(cfg.model, cfg.norm, num_classes=3)
    names = standardized_names(detector)
    assert len(names) == 8 + 4 and "backbone.body.layers.3.blocks.1.mlp.fc1" in names
    # in float64: an output sums 576 products of unit-scale standardised weights (|y| up to
    # 100), which float32 rounds 2e-5 apart in two summation orders; float64's bound, 576 x
    # 1.1e-16 x sum|x w| (~4e2), is 3e-11: 1e-7 holds it, and the "var" form is 0.25 away
    conv = copy.deepcopy(detector.get_submodule("backbone.fpn.layer_blocks.0.0")).double()
    x = torch.randn(2, conv.in_channels, 9, 9, dtype=torch.float64)
    torch.testing.assert_close(conv(x), F.conv2d(x, reference_ws(conv.weight, form="std"),
                                                 conv.bias, padding=1), rtol=1e-7, atol=1e-7)
    for head in ("rpn.head.*", "roi_heads.box_predictor.cls_score", "backbone.body.patch_embed.*"):
        bad = [*overrides[:-1], f"model.weight_standardization=[{head}]"]
        cfg = effective_config(config(*bad), bad)
        with pytest.raises(ValueError, match="predictor head|embedding"):
            build_detector(cfg.model, cfg.norm, num_classes=3)


@pytest.mark.parametrize("exp, blocks", [("t2t_vit_14", T2T_BLOCKS), ("swin_t", 8)])
def test_the_residual_preset_standardises_each_blocks_output_layers(exp, blocks):
    _, model = built(f"+exp={exp}", "norm=bn", "ws=residual")
    names = standardized_names(model)
    assert len(names) == 2 * blocks and all(n.endswith(("attn.proj", "mlp.fc2")) for n in names)


def test_mmdet_detectors_standardise_the_ffn_layers_mmcv_wraps(tmp_path):
    """mmdet's FFN linear layers are mmcv's ``Linear``: made torch's own (the same layer on
    this torch), then standardised like the rest, through the runner."""
    from mmcv.cnn import Linear
    from test_mmdet import _settings_config

    from plugins.mmdet.runner import UnnormRunner, mmdet_config, standardize_detector
    from plugins.distributed import Distributed

    cfg = _settings_config(tmp_path, "norm=bn", "ws=transformer", exp="mask_rcnn_swin_t")
    runner = UnnormRunner.from_cfg(mmdet_config(cfg, tmp_path / "run", Distributed("cpu")))
    detector = runner.model
    names = standardized_names(detector)
    assert len(names) == 2 * 8 and "backbone.stages.0.blocks.0.ffn.layers.0.0" in names
    assert not any(type(m) is Linear for name, m in detector.named_modules() if name in names)
    # in float64, as the classifier's layers above (float32 came within a third of its bound)
    fc1 = copy.deepcopy(detector.get_submodule("backbone.stages.2.blocks.1.ffn.layers.0.0")).double()
    x = torch.randn(3, fc1.in_features, dtype=torch.float64)
    torch.testing.assert_close(fc1(x), F.linear(x, reference_ws(fc1.weight), fc1.bias),
                               rtol=1e-7, atol=1e-7)
    fresh = copy.deepcopy(detector)
    with pytest.raises(ValueError, match="rpn_head.rpn_cls, rpn_head.rpn_reg, the model's classifier"):
        standardize_detector(fresh, {"weight_standardization": ["rpn_head.*"]})
    # ws=residual: each backbone block's attention output and fc2, in mmdet's names
    residual = standardized_names(UnnormRunner.from_cfg(mmdet_config(
        _settings_config(tmp_path, "norm=bn", "ws=residual", exp="mask_rcnn_swin_t"),
        tmp_path / "residual", Distributed("cpu"))).model)
    assert len(residual) == 2 * 8 and {"backbone.stages.3.blocks.1.attn.w_msa.proj",
                                        "backbone.stages.3.blocks.1.ffn.layers.1"} <= set(residual)


# --- SepNorm ----------------------------------------------------------------------------------

def release_sepnorm(token_norm: torch.nn.Module, class_norm: unnorm.BatchNorm) -> ReleaseSepNorm:
    """tufts-ml/SepNorm's module around ``token_norm``, its BatchNorm1d holding ``class_norm``'s
    affine (torch's momentum 0.1 is our 0.9)."""
    release = ReleaseSepNorm(token_norm.num_features).float()
    release.tok_norm_layer = token_norm
    with torch.no_grad():
        release.cls_norm_layer.weight.copy_(class_norm.weight)
        release.cls_norm_layer.bias.copy_(class_norm.bias)
    return release


@pytest.mark.parametrize("sites", ["all", "final"])
def test_class_norm_through_the_trainer_is_bn_on_the_class_token_and_the_runs_norm_on_the_rest(sites):
    """T2T-ViT with ``model.class_norm=bn``: at the chosen sites (every norm the class token
    passes, or the final one; never the tokens-to-token stem, which has no class token), the
    model computes what the release's SepNorm (BatchNorm1d on the class token, the run's LN on
    the rest) computes, in training and in eval."""
    torch.manual_seed(0)
    _, ours = built("+exp=t2t_vit_14", "norm=ln", "model.class_norm=bn", f"model.class_norm_sites={sites}")
    torch.manual_seed(0)
    _, reference = built("+exp=t2t_vit_14", "norm=ln")
    want = ["norm"] + ([f"blocks.{i}.norm{j}" for i in range(T2T_BLOCKS) for j in (1, 2)]
                       if sites == "all" else [])
    separated = [name for name, m in ours.named_modules() if isinstance(m, unnorm.SeparateClassNorm)]
    assert sorted(separated) == sorted(want)
    generator = torch.Generator().manual_seed(1)
    for name in want:
        class_norm = ours.get_submodule(name).class_norm
        assert isinstance(class_norm, unnorm.BatchNorm)
        with torch.no_grad():
            class_norm.weight.copy_(1 + 0.3 * torch.randn(T2T_WIDTH, generator=generator))
            class_norm.bias.copy_(0.3 * torch.randn(T2T_WIDTH, generator=generator))
        unnorm.replace_module(reference, name, release_sepnorm(reference.get_submodule(name), class_norm))
    for step in range(3):  # the same stochastic depth in both (the model's drop_path_rate)
        images = torch.randn(4, 3, 32, 32, generator=generator)
        outputs = []
        for model in (ours, reference):
            torch.manual_seed(step)
            outputs.append(model(images))
        torch.testing.assert_close(*outputs, rtol=1e-4, atol=1e-5)
    ours.eval(), reference.eval()
    images = torch.randn(4, 3, 32, 32, generator=generator)
    torch.testing.assert_close(ours(images), reference(images), rtol=1e-4, atol=1e-5)


def test_hugging_face_vit_and_bert_take_sepnorm_through_swap_norms_and_separate_class_norms():
    """A small ViT and BERT built from their configs: every LayerNorm swapped to unnorm's ``ln``
    (``unnorm.swap_norms``), then each given BN for its [CLS] token
    (``unnorm.separate_class_norms``): the model computes what the release's SepNorm at every
    norm computes."""
    from transformers import BertConfig, BertModel, ViTConfig, ViTModel

    width = 16
    small = dict(hidden_size=width, num_hidden_layers=2, num_attention_heads=2,
                 intermediate_size=32, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    generator = torch.Generator().manual_seed(0)
    cases = [(ViTModel(ViTConfig(image_size=16, patch_size=8, **small)),
              lambda: {"pixel_values": torch.randn(4, 3, 16, 16, generator=generator)}),
             (BertModel(BertConfig(vocab_size=40, max_position_embeddings=12, **small)),
              lambda: {"input_ids": torch.randint(1, 40, (4, 7), generator=generator)})]
    for model, inputs in cases:
        assert unnorm.swap_norms(model, "ln") > 0
        reference = copy.deepcopy(model)
        norms = [name for name, m in model.named_modules() if isinstance(m, unnorm.LayerNorm)]
        assert unnorm.separate_class_norms(model, "bn") == len(norms)
        for name in norms:
            release = release_sepnorm(reference.get_submodule(name), model.get_submodule(name).class_norm)
            unnorm.replace_module(reference, name, release)
        for mode in ("train", "eval"):
            getattr(model, mode)(), getattr(reference, mode)()
            batch = inputs()
            torch.testing.assert_close(model(**batch).last_hidden_state,
                                       reference(**batch).last_hidden_state, rtol=1e-4, atol=1e-5)


def test_separate_class_norms_refuses_a_causal_hugging_face_decoder():
    """A Llama's first token starts its text: refused by what its attention says (causal),
    before any norm is wrapped; BERT's attention is not causal (the test above)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    model = LlamaForCausalLM(LlamaConfig(vocab_size=40, hidden_size=16, intermediate_size=32,
                                         num_hidden_layers=1, num_attention_heads=2))
    unnorm.swap_norms(model, "rms")
    with pytest.raises(ValueError, match="attends causally.*unnorm.swap_norms"):
        unnorm.separate_class_norms(model, "bn")
    assert not any(isinstance(m, unnorm.SeparateClassNorm) for m in model.modules())


@pytest.mark.parametrize("overrides, refused", [
    (["+exp=swin_t", "model.class_norm=bn"], "swin_t has no class token.*t2t_vit_14"),
    (["+exp=t2t_vit_14", "model.class_norm=bn", "model.class_norm_sites=last"],
     "class_norm_sites must be all .* or final"),
    (["+exp=t2t_vit_14", "model.class_norm=group"], "model.class_norm: unknown norm 'group'"),
    (["+exp=faster_rcnn_swin_t", "+model.class_norm=bn"], "detection model .* no class token.*norm="),
    (["+exp=iwslt14", "+model.class_norm=bn"], "translation model .* no class token"),
    (["+exp=llama_71m_ln", "+model.class_norm=bn"], "language_modelling model .* no class token"),
])
def test_models_without_the_option_refuse_it_naming_the_alternative(overrides, refused):
    with pytest.raises(ValueError, match=refused):
        built(*overrides)


# --- folding, conversion, initialising from a run --------------------------------------------

def test_the_fold_script_bakes_weight_standardisation_and_freezes_sepnorm_exactly(tmp_path, capsys):
    """A BN run with standardised fc1 layers and BN on the class token: scripts/fold.py bakes
    the standardised weights, folds the block norms and makes SepNorm's two norms frozen
    affines; the folded model computes what the run's model computes."""
    sys.path.insert(0, str(ROOT / "scripts"))
    from fold import load_folded, main

    train(config("+exp=t2t_vit_14", "norm=bn", "model.class_norm=bn",
                 "model.weight_standardization=[blocks.*.mlp.fc1]", *QUICK), tmp_path)
    main([str(tmp_path)])
    assert "kept 0 whole (weight-standardised layers baked first: 4)" in capsys.readouterr().out
    saved = load_checkpoint(tmp_path / "last.pt")
    run = model_from_config(OmegaConf.create(saved["config"]))
    run.load_state_dict(saved["model"])
    folded = load_folded(tmp_path / "folded.pt")
    assert not standardized_names(folded) and not any(
        isinstance(m, unnorm.ChannelNorm) for m in folded.modules())
    assert {type(m.class_norm) for m in folded.modules()
            if isinstance(m, unnorm.SeparateClassNorm)} == {unnorm.ChannelAffine}
    images = torch.randn(4, 3, 32, 32)
    with torch.no_grad():
        want, got = run.eval()(images), folded(images)
    assert (got - want).abs().max() <= 1e-5 * want.abs().max()


def test_the_fold_script_judges_a_norm_by_the_options_it_was_built_with(tmp_path, capsys):
    """EvoNorm-S0 without its activation (``norm.apply_act=false``) is an affine: the script
    folds it, where the name alone (an online norm by default) would refuse it."""
    sys.path.insert(0, str(ROOT / "scripts"))
    from fold import load_folded, main

    train(config("+exp=t2t_vit_14", "norm=evonorm_s0", "norm.apply_act=false", *QUICK), tmp_path)
    assert not unnorm.is_foldable("evonorm_s0")
    main([str(tmp_path)])
    assert "kept 0 whole" in capsys.readouterr().out
    assert not any(isinstance(m, unnorm.ChannelNorm) for m in load_folded(tmp_path / "folded.pt").modules())


def test_conversion_to_pre_rms_refuses_standardised_layers_until_baked():
    from plugins.timm.convert import to_pre_rms

    _, model = built("+exp=t2t_vit_14", "norm=ln", "ws=transformer")
    # in float64: with unit-scale standardised weights the float32 model was 1e-6 to 4e-6 of
    # its largest output from the converted one (random weights; AVX2 kernels the larger),
    # up to 70 float32 roundings (6e-8); that gain on float64's 1.1e-16 is 8e-15, and 1e-12
    # (tests/test_convert.py's float64 bound) leaves over 100 times that
    model.eval().double()
    with pytest.raises(ValueError, match=r"blocks\.0\.attn\.qkv, blocks\.0\.mlp\.fc1, .*"
                                         r"weight-standardised.*bake_standardized_weights"):
        to_pre_rms(model)
    images = torch.randn(3, 3, 32, 32, dtype=torch.float64)
    with torch.no_grad():
        want = model(images)
        assert unnorm.bake_standardized_weights(model) == 2 * T2T_BLOCKS
        got = to_pre_rms(model)(images)
    assert (got - want).abs().max() <= 1e-12 * want.abs().max()


def test_init_from_keeps_what_standardised_layers_compute_or_refuses(tmp_path):
    """``init_from`` a run with standardised qkv and fc1: into a run standardising the same
    layers, raw weights; into a plain run, the standardised weights (the same outputs either
    way); a run standardising layers the source trained plain is refused, naming them."""
    def classifier(*overrides):
        return built("+exp=t2t_vit_14", "norm=bn", *overrides)

    source_cfg, source = classifier("ws=transformer")
    path = tmp_path / "last.pt"
    torch.save({"model": source.state_dict(), "config": OmegaConf.to_container(source_cfg)}, path)
    images = torch.randn(4, 3, 32, 32)
    with torch.no_grad():
        want = source.eval()(images)
    qkv = source.blocks[0].attn.qkv.weight
    for overrides, loaded in ((["ws=transformer"], qkv), ([], reference_ws(qkv))):
        _, model = classifier(*overrides)
        load_weights(model, str(path), reset_steps=False)
        torch.testing.assert_close(model.blocks[0].attn.qkv.weight, loaded, rtol=1e-6, atol=1e-6)
        with torch.no_grad():
            torch.testing.assert_close(model.eval()(images), want, rtol=1e-5, atol=1e-6)
    _, model = classifier("model.weight_standardization=[blocks.*.mlp.fc1,blocks.*.attn.proj]")
    with pytest.raises(ValueError, match=r"init_from: .*blocks\.0\.attn\.proj was a plain layer there"):
        load_weights(model, str(path), reset_steps=False)
    _, model = classifier("ws=transformer", "model.ws_eps=1e-3")
    with pytest.raises(ValueError, match="set model.ws_eps, model.ws_eps_form and model.ws_gamma as that run did"):
        load_weights(model, str(path), reset_steps=False)


def test_the_mmdet_conversion_bakes_standardised_weights_unless_the_detector_standardises():
    from plugins.mmdet import convert_checkpoint, timm_to_mmdet

    overrides = ["+exp=swin_t", "norm=bn", "ws=transformer"]
    cfg, classifier = built(*overrides)
    saved = {"model": classifier.state_dict(), "config": OmegaConf.to_container(cfg)}
    raw = timm_to_mmdet(classifier.state_dict())
    qkv = "backbone.stages.1.blocks.0.attn.w_msa.qkv"
    plain = convert_checkpoint(saved, reset_steps=False)
    torch.testing.assert_close(plain[f"{qkv}.weight"], reference_ws(raw[f"{qkv}.weight"]))
    assert torch.equal(plain["backbone.stages.1.blocks.0.attn.w_msa.proj.weight"],
                       raw["backbone.stages.1.blocks.0.attn.w_msa.proj.weight"])
    standardized = {f"backbone.stages.{s}.blocks.{b}.{layer}": (1e-5, "var") for s in range(4)
                    for b in range(2) for layer in ("attn.w_msa.qkv", "ffn.layers.0.0")}
    kept = convert_checkpoint(saved, reset_steps=False, standardized=standardized)
    assert all(torch.equal(kept[key], raw[key]) for key in raw)
    with pytest.raises(ValueError, match=r"w_msa\.proj was a plain layer there"):
        convert_checkpoint(saved, reset_steps=False,
                           standardized={"backbone.stages.0.blocks.0.attn.w_msa.proj": (1e-5, "var")})


# --- training through the trainer: the loss falls, a kill and a resume change nothing ---------

# three epochs of 12 updates at a flat learning rate, without label smoothing: enough for the
# mean training loss to fall clearly at CPU scale, in a few seconds a run
TRAIN = ["+exp=t2t_vit_14", "scale=cpu", "logger=none", "recipe.epochs=3",
         "scale.max_steps_per_epoch=12", "recipe.warmup_epochs=0", "recipe.batch_size=32",
         "recipe.lr_batch=32", "recipe.min_lr=2e-3", "recipe.label_smoothing=0"]


@pytest.mark.parametrize("overrides, layers, steps_per_epoch", [
    # BCN's groups as the CPU rule scales them (docs/core.md); fc1 standardised (with
    # ws=transformer's qkv too it learns more slowly than a test of seconds can show)
    (["norm=bcn", "model.weight_standardization=[blocks.*.mlp.fc1]"],
     {unnorm.StandardizedLinear: T2T_BLOCKS, unnorm.BatchChannelNorm: 2 * T2T_BLOCKS + 5}, 12),
    # EvoNorm-S0 is still at chance after 36 updates here (with 4 groups of 16, 8 of 8 or 32
    # of 2 alike), and learns by 120
    (["norm=evonorm_s0"], {unnorm.EvoNormS0: 2 * T2T_BLOCKS + 5}, 40),
    # EvoNorm-B0 likewise: at chance after 36 updates (train loss 2.297), learning by 120 (2.05)
    (["norm=evonorm_b0"], {unnorm.EvoNormB0: 2 * T2T_BLOCKS + 5}, 40),
    (["norm=ln", "model.class_norm=bn"],
     {unnorm.SeparateClassNorm: 2 * T2T_BLOCKS + 1, unnorm.BatchNorm: 2 * T2T_BLOCKS + 1}, 12)],
    ids=["bcn+ws", "evonorm_s0", "evonorm_b0", "class_norm=bn"])
def test_t2t_vit_trains_with_the_new_options_and_resumes_a_kill_to_the_same_run(
        overrides, layers, steps_per_epoch, tmp_path, monkeypatch, capsys):
    cfg = config(*TRAIN, *overrides, f"scale.max_steps_per_epoch={steps_per_epoch}")
    want = train(cfg, tmp_path / "whole")
    rows = [json.loads(line) for line in (tmp_path / "whole" / "metrics.jsonl").read_text().splitlines()]
    assert want["steps"] == 3 * steps_per_epoch
    assert rows[-1]["train_loss"] < math.log(10) - 0.05  # below chance on the 10 digits: it learned
    saved = load_checkpoint(tmp_path / "whole" / "last.pt")
    model = model_from_config(OmegaConf.create(saved["config"]))
    model.load_state_dict(saved["model"])
    assert {kind: sum(type(m) is kind for m in model.modules()) for kind in layers} == layers

    run_dir = tmp_path / "killed"
    with monkeypatch.context() as killing, pytest.raises(SimulatedKill):
        KillAt(killing, ("append_row", 1))  # after epoch 1's checkpoint
        train(cfg, run_dir)
    capsys.readouterr()
    got = train(cfg, run_dir)
    assert f"resuming {run_dir} at epoch 1, step {steps_per_epoch}" in capsys.readouterr().out
    assert got["steps"] == want["steps"] and got["status"] == want["status"]
    for key, value in want["metrics"].items():
        if key not in TIMES:
            assert got["metrics"][key] == pytest.approx(value, rel=1e-5, abs=1e-7), key
    torch.testing.assert_close(load_checkpoint(run_dir / "last.pt")["model"], saved["model"],
                               rtol=1e-5, atol=1e-6)
