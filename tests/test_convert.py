"""Pre-LN -> Pre-RMSNorm -> Pre-CRMSNorm (Jiang et al., NeurIPS 2023): each conversion leaves
a model's eval outputs as they were, checked against the unconverted model and against
hand-written formulas for the norm and the writers."""
from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import unnorm
from plugins.scale import effective_config
from plugins.timm import create_classifier, model_from_config
from plugins.timm.convert import to_pre_crms, to_pre_rms
from test_vision import config

CONVERSIONS = {"rms": to_pre_rms, "crms": to_pre_crms}
CONVERTED_NORM = {"rms": unnorm.RMSNorm, "crms": unnorm.CompressedRMSNorm}


def _classifier(exp: str) -> nn.Module:
    overrides = [f"+exp={exp}", "scale=cpu"]
    return model_from_config(effective_config(config(*overrides), overrides))


@torch.no_grad()
def _randomise(model: nn.Module, seed: int = 0) -> nn.Module:
    """Every bias, norm affine and class token away from its initial value, so that each
    fold and centring has something to carry (a fresh model has zero biases, unit gains)."""
    generator = torch.Generator().manual_seed(seed)
    for name, param in model.named_parameters():
        noise = torch.randn(param.shape, generator=generator, dtype=param.dtype)
        if name.endswith("bias") or name == "cls_token":
            param.add_(0.5 * noise)
        elif param.dim() == 1:  # norm gains
            param.mul_(1 + 0.5 * noise)
    return model


@pytest.fixture(scope="module")
def models():
    return {exp: _randomise(_classifier(f"{exp}_ln")).eval() for exp in ("t2t_vit_14", "swin_t")}


def test_compressed_rms_norm_is_the_rms_norm_of_the_full_vector():
    generator = torch.Generator().manual_seed(0)
    full = torch.randn(5, 7, 12, generator=generator, dtype=torch.float64)
    full = full - full.mean(-1, keepdim=True)
    norm = unnorm.CompressedRMSNorm(11, eps=1e-3).double()
    with torch.no_grad():
        norm.weight.copy_(torch.randn(11, generator=generator))
    rms = full / torch.sqrt(full.square().mean(-1, keepdim=True) + 1e-3)
    torch.testing.assert_close(norm(full[..., :-1]), rms[..., :-1] * norm.weight,
                               rtol=1e-12, atol=1e-12)
    half = norm.float()(full[..., :-1].half())
    assert half.dtype == torch.float16 and norm.bias is None
    torch.testing.assert_close(half.float(), (rms[..., :-1] * norm.weight.double()).float(),
                               rtol=2e-3, atol=2e-3)


@pytest.mark.parametrize("kind", ["linear", "conv", "embedding", "tensor"])
def test_writers_write_the_zero_mean_part_and_compress_to_its_first_coordinates(kind):
    torch.manual_seed(0)
    if kind == "linear":
        writer, inputs = nn.Linear(5, 6).double(), torch.randn(4, 5, dtype=torch.float64)
        nn.init.normal_(writer.bias)
    elif kind == "conv":
        writer, inputs = nn.Conv2d(3, 6, 2).double(), torch.randn(2, 3, 4, 4, dtype=torch.float64)
        nn.init.normal_(writer.bias)
    elif kind == "embedding":
        writer, inputs = nn.Embedding(9, 6).double(), torch.tensor([[0, 3, 8], [1, 1, 2]])
    else:
        writer, inputs = nn.Parameter(torch.randn(1, 3, 6, dtype=torch.float64)), None

    def written(module):  # the stream's axis last
        out = module if inputs is None else module(inputs)
        return out.movedim(1, -1) if kind == "conv" else out

    before = written(writer).detach()
    want = before - before.mean(-1, keepdim=True)
    torch.testing.assert_close(written(unnorm.center_writer(writer)).detach(), want)
    compressed = unnorm.compress_writer(writer)
    assert isinstance(compressed, type(writer))
    torch.testing.assert_close(written(compressed).detach(), want[..., :-1])


@pytest.mark.parametrize("layer_norm", [unnorm.LayerNorm, nn.LayerNorm], ids=["unnorm", "torch"])
def test_a_layer_norm_and_its_readers_convert_exactly_on_zero_mean_input(layer_norm):
    torch.manual_seed(0)
    d = 8
    norm = layer_norm(d, eps=1e-4).double()
    nn.init.normal_(norm.weight)
    nn.init.normal_(norm.bias)
    readers = [nn.Linear(d, 5).double(), nn.Linear(d, 3, bias=False).double()]
    stream = torch.randn(6, d, dtype=torch.float64)
    stream = stream - stream.mean(-1, keepdim=True)
    want = [reader(norm(stream)) for reader in readers]

    rms_readers = copy.deepcopy(readers)
    rms = unnorm.to_rms_norm(copy.deepcopy(norm), rms_readers)
    assert isinstance(rms, unnorm.RMSNorm) and rms.bias is None
    torch.testing.assert_close([r(rms(stream)) for r in rms_readers], want)

    crms = unnorm.to_compressed_rms_norm(norm, readers)
    assert [r.in_features for r in readers] == [d - 1, d - 1]
    torch.testing.assert_close([r(crms(stream[:, :-1])) for r in readers], want)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("target", ["rms", "crms"])
@pytest.mark.parametrize("exp", ["t2t_vit_14", "swin_t"])
def test_pre_ln_classifier_converts_with_equal_eval_outputs(models, exp, target, dtype):
    model = copy.deepcopy(models[exp]).to(dtype)
    images = torch.randn(3, 3, 32, 32, generator=torch.Generator().manual_seed(1), dtype=dtype)
    with torch.no_grad():
        want = model(images)
        got = CONVERSIONS[target](model)(images)
    tolerance = 1e-12 if dtype == torch.float64 else 1e-5
    assert (got - want).abs().max() <= tolerance * want.abs().max()


def _stream_widths(model: nn.Module, names: list[str]) -> dict[str, int]:
    widths = {}
    hooks = [model.get_submodule(name).register_forward_hook(
        lambda module, args, out, name=name: widths.__setitem__(name, out.shape[-1]))
        for name in names]
    with torch.no_grad():
        model(torch.zeros(1, 3, 32, 32))
    for hook in hooks:
        hook.remove()
    return widths


@pytest.mark.parametrize("target", ["rms", "crms"])
def test_t2t_vit_converts_its_backbone_and_keeps_its_token_layers(models, target):
    model = CONVERSIONS[target](copy.deepcopy(models["t2t_vit_14"]))
    norms = {name: type(m) for name, m in model.named_modules()
             if isinstance(m, unnorm.ChannelNorm)}
    stem = {name for name in norms if name.startswith("tokens_to_token.")}
    assert stem == {f"tokens_to_token.layer{i}.norm{j}" for i in (1, 2) for j in (1, 2)}
    assert {norms[name] for name in stem} == {unnorm.LayerNorm}
    assert {norms[name] for name in set(norms) - stem} == {CONVERTED_NORM[target]}
    assert all(model.get_submodule(name).bias is None for name in set(norms) - stem)
    assert model.blocks[0].attn.qkv.bias is not None  # it took the shift of norm1
    d = models["t2t_vit_14"].embed_dim
    width = d - 1 if target == "crms" else d
    blocks = [f"blocks.{i}" for i in range(len(model.blocks))]
    assert set(_stream_widths(model, blocks + ["tokens_to_token"]).values()) == {width}
    assert model.pos_embed.shape[-1] == model.cls_token.shape[-1] == width
    assert model.num_features == model.head.in_features == width


@pytest.mark.parametrize("target", ["rms", "crms"])
def test_swin_converts_its_last_stage_only(models, target):
    model = CONVERSIONS[target](copy.deepcopy(models["swin_t"]))
    norms = {name: type(m) for name, m in model.named_modules()
             if isinstance(m, unnorm.ChannelNorm)}
    last = f"layers.{len(model.layers) - 1}.blocks."
    converted = {name for name in norms if name.startswith(last)} | {"norm"}
    assert len(converted) == 2 * len(model.layers[-1].blocks) + 1
    assert {norms[name] for name in converted} == {CONVERTED_NORM[target]}
    assert {norms[name] for name in set(norms) - converted} == {unnorm.LayerNorm}
    widths = _stream_widths(model, [f"layers.{i}" for i in range(len(model.layers))])
    original = [stage.blocks[-1].norm2.num_features for stage in models["swin_t"].layers]
    assert list(widths.values()) == original[:-1] + [original[-1] - (target == "crms")]


def test_swin_padding_its_windows_keeps_the_shift_and_cannot_compress():
    """Windows of 3 on a 4x4 map pad after norm1: the padded tokens must not see its shift."""
    model = create_classifier("swin_tiny_patch4_window7_224", {"name": "ln"}, 10, 32,
                              embed_dim=16, depths=[1, 1], num_heads=[1, 2], window_size=3)
    model = _randomise(model).eval()
    images = torch.randn(2, 3, 32, 32, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = model(images)
    with pytest.raises(ValueError, match=r"layers\.1\.blocks\.0\.norm1 has no linear reader.*"
                                         "Pre-RMSNorm"):
        to_pre_crms(model)
    with torch.no_grad():
        got = to_pre_rms(model)(images)
    assert model.layers[1].blocks[0].norm1.bias.any()
    assert (got - want).abs().max() <= 1e-5 * want.abs().max()


@pytest.mark.parametrize("target", ["rms", "crms"])
def test_a_model_without_layer_norms_is_refused_unchanged(target):
    model = _classifier("t2t_vit_14_bn")
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(ValueError,
                       match=r"blocks\.0\.norm1 is BatchNorm, not a LayerNorm.*norm=ln"):
        CONVERSIONS[target](model)
    after = model.state_dict()
    assert before.keys() == after.keys()
    assert all(torch.equal(before[k], after[k]) for k in before)
