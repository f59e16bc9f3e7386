"""Quick CPU checks of the T2T-ViT timm plugin: shapes, size, norm plumbing, gradients, Performer kernel."""
import pytest
import timm
import torch
import torch.nn as nn

from plugins.timm.t2t_vit import (
    PerformerAttention,
    T2TViT,
    orthogonal_random_features,
    performer_features,
)


def test_t2t_vit_14_shape_and_param_count():
    model = timm.create_model('t2t_vit_14').eval()
    num_params = sum(p.numel() for p in model.parameters())
    assert 21.0e6 <= num_params <= 22.0e6, num_params  # paper: 21.5M
    with torch.no_grad():
        assert model(torch.randn(1, 3, 224, 224)).shape == (1, 1000)


@pytest.mark.parametrize('img_size', [32, 64])
def test_tiny_shapes(img_size):
    model = timm.create_model('t2t_vit_tiny', img_size=img_size, num_classes=10).eval()
    x = torch.randn(2, 3, img_size, img_size)
    with torch.no_grad():
        tokens = model.forward_features(x)
        assert tokens.shape == (2, (img_size // 16) ** 2 + 1, model.num_features)
        assert model.forward_head(tokens, pre_logits=True).shape == (2, model.num_features)
        assert model(x).shape == (2, 10)
    model.reset_classifier(5)
    assert model.get_classifier().out_features == 5 and model.num_classes == 5


def test_every_norm_comes_from_norm_layer():
    class CountingLayerNorm(nn.LayerNorm):
        built = 0

        def __init__(self, num_features, device=None, dtype=None):
            super().__init__(num_features, device=device, dtype=dtype)
            CountingLayerNorm.built += 1

    depth = 4
    model = timm.create_model('t2t_vit_tiny', img_size=32, depth=depth, norm_layer=CountingLayerNorm)
    expected = 2 * 2 + 2 * depth + 1  # two T2T token layers, the blocks, the final norm
    assert CountingLayerNorm.built == expected
    norms = [m for m in model.modules() if isinstance(m, nn.LayerNorm)]
    assert len(norms) == expected and all(type(m) is CountingLayerNorm for m in norms)


def test_backward_gives_finite_gradients():
    model = timm.create_model('t2t_vit_tiny', img_size=32, num_classes=10, drop_path_rate=0.1)
    model(torch.randn(2, 3, 32, 32)).logsumexp(dim=-1).sum().backward()
    for name, p in model.named_parameters():
        assert p.grad is not None and torch.isfinite(p.grad).all(), name


def test_fixed_tensors_are_not_trainable():
    model = timm.create_model('t2t_vit_tiny', img_size=32)
    trainable = dict(model.named_parameters())
    assert 'pos_embed' not in trainable and not any(name.endswith('omega') for name in trainable)
    assert model.no_weight_decay() == {'cls_token', 'pos_embed'}


def test_performer_kernel_estimate_improves_with_more_features():
    generator = torch.Generator().manual_seed(0)
    dim = 8
    q = 0.3 * torch.randn(256, dim, generator=generator)
    k = 0.3 * torch.randn(256, dim, generator=generator)
    exact = torch.exp((q * k).sum(dim=-1))
    errors = []
    for num_features in (4, 64, 4096):
        omega = orthogonal_random_features(num_features, dim, generator=generator)
        estimate = (performer_features(q, omega) * performer_features(k, omega)).sum(dim=-1)
        errors.append(((estimate - exact).abs() / exact).mean().item())
    assert errors[0] > errors[1] > errors[2], errors
    assert errors[2] < 0.05, errors


def test_performer_attention_approximates_softmax_attention():
    torch.manual_seed(0)
    attn = PerformerAttention(dim=8, out_dim=8, kernel_ratio=512)  # 4096 random features
    q, k, v = (0.3 * torch.randn(3, 2, 16, 8)).unbind(0)
    exact = torch.softmax(q @ k.transpose(1, 2), dim=-1) @ v
    assert torch.allclose(attn.linear_attention(q, k, v), exact, atol=0.05)


def test_invalid_requests_fail_clearly():
    with pytest.raises(RuntimeError, match='No pretrained weights'):
        timm.create_model('t2t_vit_tiny', pretrained=True)
    with pytest.raises(ValueError, match='divisible by 16'):
        T2TViT(img_size=40)
    with pytest.raises(TypeError, match='unexpected'):
        T2TViT(img_size=32, drop_path=0.1)
    with pytest.raises(ValueError, match='does not match img_size'):
        timm.create_model('t2t_vit_tiny', img_size=32)(torch.randn(1, 3, 64, 64))


def test_token_transformers_replace_their_input_and_blocks_add_to_it():
    """T2T's token layers change the width, so their attention's output (residual inside, on the
    value path) replaces x; the backbone's blocks add both branches to x."""
    model = timm.create_model('t2t_vit_tiny', img_size=32).eval()
    token_layer, block = model.tokens_to_token.layer2, model.blocks[0]
    tokens, features = torch.randn(2, 16, 32 * 3 * 3), torch.randn(2, 5, model.embed_dim)
    with torch.no_grad():
        attended = token_layer.attn(token_layer.norm1(tokens))
        torch.testing.assert_close(token_layer(tokens), attended + token_layer.mlp(token_layer.norm2(attended)))
        attended = features + block.attn(block.norm1(features))
        torch.testing.assert_close(block(features), attended + block.mlp(block.norm2(attended)))
