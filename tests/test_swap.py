"""``unnorm.swap_norms`` on the norms of Hugging Face and timm models, tiny and random.

Every expectation is the host model's own output before the swap."""
import pytest
import timm
import torch
import transformers as hf
from timm.layers import LayerNorm2d
from torch import nn
from transformers.models.mamba2.modeling_mamba2 import MambaRMSNormGated

import unnorm

TOKENS = torch.arange(12).reshape(2, 6) % 50
IMAGES = torch.linspace(-2, 2, 2 * 3 * 32 * 32).reshape(2, 3, 32, 32).sin()
TEXT = dict(vocab_size=50, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
            num_attention_heads=2, num_key_value_heads=1)


def _logits(model):
    return model(TOKENS).logits


def _images(model):
    return model(_pixels(model))


def _pixels(model):
    """IMAGES in the model's dtype: the fold's probe runs it on float64 copies."""
    return IMAGES.to(next(model.parameters()).dtype)


# name: (build the model, run it to (..., classes), its norm classes, the like-for-like norm)
MODELS = {
    "bert": (lambda: hf.BertModel(hf.BertConfig(
        vocab_size=50, hidden_size=16, num_hidden_layers=2, num_attention_heads=2,
        intermediate_size=32), add_pooling_layer=False),
             lambda model: model(TOKENS).last_hidden_state, {"LayerNorm"}, "ln"),
    "gpt2": (lambda: hf.GPT2LMHeadModel(hf.GPT2Config(vocab_size=50, n_embd=16, n_layer=2,
                                                       n_head=2, n_positions=16)),
             _logits, {"LayerNorm"}, "ln"),
    "hf_vit": (lambda: hf.ViTForImageClassification(hf.ViTConfig(
        image_size=32, patch_size=8, hidden_size=16, num_hidden_layers=2, num_attention_heads=2,
        intermediate_size=32, num_labels=3)),
               lambda model: model(_pixels(model)).logits, {"LayerNorm"}, "ln"),
    "llama": (lambda: hf.LlamaForCausalLM(hf.LlamaConfig(**TEXT)), _logits,
              {"LlamaRMSNorm"}, "rms"),
    "qwen2": (lambda: hf.Qwen2ForCausalLM(hf.Qwen2Config(**TEXT)), _logits,
              {"Qwen2RMSNorm"}, "rms"),
    "gemma": (lambda: hf.GemmaForCausalLM(hf.GemmaConfig(**TEXT, head_dim=8)), _logits,
              {"GemmaRMSNorm"}, "rms"),
    "t5": (lambda: hf.T5ForConditionalGeneration(hf.T5Config(
        vocab_size=50, d_model=16, d_kv=8, d_ff=32, num_layers=1, num_heads=2)),
           lambda model: model(TOKENS, decoder_input_ids=TOKENS).logits, {"T5LayerNorm"}, "rms"),
    "timm_vit": (lambda: timm.models.vision_transformer.VisionTransformer(
        img_size=32, patch_size=8, embed_dim=16, depth=2, num_heads=2, num_classes=3),
                 _images, {"LayerNorm"}, "ln"),
    "timm_swin": (lambda: timm.models.swin_transformer.SwinTransformer(
        img_size=32, patch_size=4, window_size=4, embed_dim=16, depths=(1, 1),
        num_heads=(1, 2), num_classes=3), _images, {"LayerNorm"}, "ln"),
    "timm_convnext": (lambda: timm.models.convnext.ConvNeXt(  # LayerNorm2d and LayerNorm
        depths=(1, 1, 1, 1), dims=(8, 8, 16, 16), conv_mlp=False, num_classes=3), _images,
                      {"LayerNorm", "LayerNorm2d"}, "ln"),
}


def _build(key):
    torch.manual_seed(0)
    build, run, classes, like = MODELS[key]
    return build(), run, classes, like


def _host_norms(model, classes):
    """The model's own norms (unnorm's LayerNorm has one of their names)."""
    return {n: m for n, m in model.named_modules()
            if type(m).__name__ in classes and not isinstance(m, unnorm.ChannelNorm)}


@torch.no_grad()
def _random_affines(norms):
    """Affines far from their initial ones (Gemma's w = 0), so carrying them is seen."""
    for module in norms.values():
        module.weight.uniform_(-0.5, 1.5)
        if getattr(module, "bias", None) is not None:
            module.bias.uniform_(-0.5, 0.5)


@pytest.mark.parametrize("key", MODELS)
def test_like_for_like_swap_leaves_the_outputs_unchanged(key):
    model, run, classes, like = _build(key)
    hosts = _host_norms(model, classes)
    _random_affines(hosts)
    model.eval()
    with torch.no_grad():
        before = run(model)
    assert unnorm.swap_norms(model, like) == len(hosts) > 0
    assert not _host_norms(model, classes)
    with torch.no_grad():
        torch.testing.assert_close(run(model), before, rtol=1e-4, atol=1e-5)
    for name, host in hosts.items():
        new = model.get_submodule(name)
        new = new.norm if isinstance(new, unnorm.ChannelsFirst) else new
        offset = 1.0 if key == "gemma" else 0.0  # Gemma scales by 1 + w
        torch.testing.assert_close(new.weight, host.weight + offset)
        assert (new.bias is None) == (getattr(host, "bias", None) is None)


def test_convnext_keeps_its_channels_first_norms_channels_first():
    model, _, _, _ = _build("timm_convnext")
    nchw = [n for n, m in model.named_modules() if isinstance(m, LayerNorm2d)]
    unnorm.swap_norms(model, "un")
    assert nchw and all(isinstance(model.get_submodule(n), unnorm.ChannelsFirst) for n in nchw)


@pytest.mark.parametrize("name", ["un", "bn", "dyt"])
@pytest.mark.parametrize("key", MODELS)
def test_swapped_norms_train_and_offline_ones_fold(key, name):
    model, run, classes, _ = _build(key)
    count = len(_host_norms(model, classes))
    options = {"warmup_iters": 2, "window_size": 2} if name == "un" else {}
    assert unnorm.swap_norms(model, name, **options) == count
    model.train()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    with torch.no_grad():
        out = run(model)
    targets = torch.randint(out.shape[-1], out.shape[:-1], generator=torch.Generator().manual_seed(1))
    losses = []
    for _ in range(6):
        loss = nn.functional.cross_entropy(run(model).flatten(0, -2), targets.flatten())
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    assert losses[-1] < losses[0]
    if unnorm.is_offline(name):
        _assert_folding_keeps_the_eval_output(model.eval(), run)


@torch.no_grad()
def _assert_folding_keeps_the_eval_output(model, run):
    """Every swapped norm becomes its inference affine: the model's eval output stays."""
    before = run(model)
    plan = {n: [] for n, m in model.named_modules() if isinstance(m, unnorm.ChannelNorm)}
    assert unnorm.fold_norms(model, plan, probe=run) == len(plan) > 0
    torch.testing.assert_close(run(model), before, rtol=1e-4, atol=1e-5)


def _with_unknown_norms():
    """A LayerNorm beside two norms swap_norms cannot translate: Mamba2's gated RMSNorm (its
    forward takes a gate) and timm's SimpleNorm (x / std(x), uncentred)."""
    return nn.Sequential(nn.LayerNorm(8), MambaRMSNormGated(8, group_size=8),
                         timm.layers.SimpleNorm(8), nn.BatchNorm1d(8), nn.GroupNorm(2, 8))


def test_an_unrecognised_norm_is_refused_by_name_and_nothing_is_swapped():
    model = _with_unknown_norms()
    with pytest.raises(ValueError, match="(?s)1 .*MambaRMSNormGated.*gate.*2 .*SimpleNorm") as error:
        unnorm.swap_norms(model, "un")
    assert "0 (" not in str(error.value)  # the LayerNorm is recognised, not listed
    assert type(model[0]) is nn.LayerNorm


def test_exclude_leaves_named_norms_and_batch_and_group_norms_are_kept():
    model = _with_unknown_norms()
    assert unnorm.swap_norms(model, "un", exclude=["1", "2"]) == 1
    assert isinstance(model[0], unnorm.UnifiedNorm)
    assert [type(m) for m in model[1:]] == [MambaRMSNormGated, timm.layers.SimpleNorm,
                                           nn.BatchNorm1d, nn.GroupNorm]


def test_include_swaps_only_the_matched_norms():
    model, run, classes, _ = _build("llama")
    hosts = _host_norms(model, classes)
    matched = {n for n in hosts if n.endswith(".input_layernorm")}
    assert unnorm.swap_norms(model, "un", include="*.input_layernorm") == len(matched) == 2
    swapped = {n for n, m in model.named_modules() if isinstance(m, unnorm.UnifiedNorm)}
    assert swapped == matched
    assert set(_host_norms(model, classes)) == set(hosts) - matched
    assert unnorm.swap_norms(model, "bn", exclude=["model.norm"]) == len(hosts) - 3
    assert type(model.model.norm).__name__ == "LlamaRMSNorm"


def test_a_pattern_matching_no_norm_is_refused():
    model, _, _, _ = _build("llama")
    with pytest.raises(ValueError, match="include pattern '\\*.input_layer_norm' matches no norm"):
        unnorm.swap_norms(model, "un", include=["*.input_layer_norm"])


@pytest.mark.parametrize("name", ["ln", "un", "bcn"])
def test_norm_layer_builds_timm_vits_norms(name):
    """timm's ViT passes ``norm_layer`` through ``get_norm_layer``, which unbinds a partial's
    keywords and drops its positional arguments (a partial of build_norm lost the name)."""
    model = timm.models.vision_transformer.VisionTransformer(
        img_size=16, patch_size=8, embed_dim=16, depth=1, num_heads=2, num_classes=3,
        norm_layer=unnorm.norm_layer(name))
    kinds = {type(module) for module in model.modules() if isinstance(module, unnorm.ChannelNorm)}
    assert kinds == {type(unnorm.build_norm(name, 16))} and len(
        [m for m in model.modules() if isinstance(m, unnorm.ChannelNorm)]) == 3
    assert model(torch.randn(2, 3, 16, 16)).shape == (2, 3)


def test_options_left_unset_are_the_modules_defaults_where_docs_core_says_they_differ():
    """swap_norms (any build_norm) gives an option left unset the module's default; the
    'Options' paragraph of docs/core.md names every norm and option where that differs from
    the training config (configs/norm/<name>.yaml), and names nothing else."""
    from pathlib import Path

    import yaml

    from plugins.norms import norm_kwargs

    root = Path(__file__).resolve().parents[1]
    docs = (root / "docs" / "core.md").read_text().split("- **Options.**")[1].split("\n- **")[0]
    model = nn.Sequential(nn.Linear(8, 8), nn.LayerNorm(8))
    unnorm.swap_norms(model, "un")
    assert model[1].outlier_filtration is unnorm.default_options("un")["outlier_filtration"] is False
    differing = {}
    for name in unnorm.available_norms():
        config = norm_kwargs(yaml.safe_load((root / "configs" / "norm" / f"{name}.yaml").read_text()))
        defaults = unnorm.default_options(name)
        differing[name] = sorted(key for key, value in config.items() if defaults[key] != value)
    for name in unnorm.available_norms():
        assert (f"`{name}` (" in docs) == bool(differing[name]), name
        assert all(f"`{option}`" in docs for option in differing[name]), (name, differing[name])


TRAINER_GIVEN = {"prepbn": {"total_steps": 1000}, "pn_ls": {"group_num": 2}}  # what a run sets


@pytest.mark.parametrize("name", unnorm.available_norms())
def test_trainer_norm_options_are_what_a_composed_run_builds_its_norms_with(name):
    """``plugins.norms.trainer_norm_options``: the norm config of ``+exp=swin_t_<name>`` as
    Hydra composes it for scripts/train.py (name and run-length keys aside; PRepBN's hand-over
    ends at ``decay_end`` of the run's steps)."""
    from hydra import compose, initialize_config_dir
    from omegaconf import OmegaConf

    from plugins.norms import CONFIGS, trainer_norm_options

    given = TRAINER_GIVEN.get(name, {})
    options = trainer_norm_options(name, **given)
    norm_overrides = [f"norm.{key}={value}" for key, value in given.items() if key != "total_steps"]
    with initialize_config_dir(config_dir=str(CONFIGS), version_base="1.3"):
        composed = compose("train", overrides=[f"+exp=swin_t_{name}", *norm_overrides])
    want = OmegaConf.to_container(composed.norm, resolve=True)
    assert want.pop("name") == name
    if "decay_end" in want:
        want["decay_iters"] = round(want.pop("decay_end") * given["total_steps"]) - want["warmup_iters"]
    assert options == want
    model = nn.Sequential(nn.Linear(8, 8), nn.LayerNorm(8))
    assert unnorm.swap_norms(model, name, **options) == 1


def test_trainer_norm_options_differ_from_the_modules_defaults_and_refuse_what_a_run_sets():
    from plugins.norms import trainer_norm_options

    options = trainer_norm_options("un")
    assert options["outlier_filtration"] is True
    assert unnorm.default_options("un")["outlier_filtration"] is False
    model = nn.Sequential(nn.Linear(8, 8), nn.LayerNorm(8))
    unnorm.swap_norms(model, "un", **options)
    assert model[1].outlier_filtration is True
    assert trainer_norm_options("prepbn", decay_iters=500)["decay_iters"] == 500
    with pytest.raises(ValueError, match="decay_iters follows the run's length.*pass total_steps"):
        trainer_norm_options("prepbn")
    with pytest.raises(ValueError, match="pn_ls's group_num is null.*pass group_num"):
        trainer_norm_options("pn_ls")
    with pytest.raises(ValueError, match="no trainer config for norm 'lnn'.*choose one of"):
        trainer_norm_options("lnn")
