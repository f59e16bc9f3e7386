"""T2T-ViT (Yuan et al., "Tokens-to-Token ViT", ICCV 2021), registered with timm.

Written from the paper. ViT's hard 16x16 patch split cannot model local structure
(edges, lines) inside or across patches; T2T-ViT instead tokenises progressively:
overlapping soft splits (``nn.Unfold``) let every token aggregate its neighbours,
and light "token transformers" between the splits model those neighbourhoods,
while the token count shrinks 4x, 2x, 2x (16x overall). The backbone is then a
deep-narrow ViT. Only the Performer T2T stem is implemented; it is what the
paper's T2T-ViT-14 and T2T-ViT-7 use.

Every normalisation layer is built as ``norm_layer(dim)`` and receives
channels-last ``(B, N, C)`` input, so any drop-in replacement can be swapped in.
"""
import math
from functools import partial
from typing import Callable, Optional, Tuple, Union

import torch
import torch.nn as nn
import torch.nn.functional as F
from timm.data import IMAGENET_DEFAULT_MEAN, IMAGENET_DEFAULT_STD
from timm.layers import DropPath, Mlp, to_2tuple, trunc_normal_
from timm.models import build_model_with_cfg, generate_default_cfgs, register_model

__all__ = [
    'T2TViT',
    'TokensToToken',
    'PerformerAttention',
    'Block',
    'Attention',
    'orthogonal_random_features',
    'performer_features',
    'sinusoid_position_embedding',
]

NormLayer = Callable[[int], nn.Module]


def orthogonal_random_features(num_features: int, dim: int, generator: Optional[torch.Generator] = None) -> torch.Tensor:
    """Draw a ``(num_features, dim)`` projection whose rows are each marginally N(0, I).

    Rows are orthogonal within blocks of ``dim`` rows, which lowers the variance of
    the kernel estimate compared with i.i.d. Gaussian rows (Performer, Choromanski
    et al. 2021); row lengths are drawn from the chi distribution so the
    estimate of exp(q . k) stays unbiased.
    """
    blocks = []
    for start in range(0, num_features, dim):
        q, r = torch.linalg.qr(torch.randn(dim, dim, generator=generator))
        # Sign fix makes q Haar-distributed, i.e. directions uniform on the sphere.
        q = q * torch.sign(torch.diagonal(r)).unsqueeze(0)
        blocks.append(q.T[: num_features - start])
    directions = torch.cat(blocks)
    lengths = torch.randn(num_features, dim, generator=generator).norm(dim=1, keepdim=True)
    return directions * lengths


def performer_features(x: torch.Tensor, omega: torch.Tensor) -> torch.Tensor:
    """Positive random features phi(x) = exp(omega x - |x|^2 / 2) / sqrt(m).

    For rows of omega drawn from N(0, I), E[phi(q) . phi(k)] = exp(q . k), so
    softmax attention can be computed in time linear in the number of tokens.
    """
    sq_norm_half = x.pow(2).sum(dim=-1, keepdim=True) / 2
    return torch.exp(x @ omega.T - sq_norm_half) / math.sqrt(omega.shape[0])


def sinusoid_position_embedding(num_positions: int, dim: int) -> torch.Tensor:
    """Fixed sin/cos table of shape ``(1, num_positions, dim)``, as T2T-ViT uses instead of a learned one."""
    position = torch.arange(num_positions, dtype=torch.float64).unsqueeze(1)
    inv_freq = 10000.0 ** (-torch.arange(0, dim, 2, dtype=torch.float64) / dim)
    angles = position * inv_freq
    table = torch.zeros(num_positions, dim, dtype=torch.float64)
    table[:, 0::2] = torch.sin(angles)
    table[:, 1::2] = torch.cos(angles[:, : dim // 2])
    return table.float().unsqueeze(0)


class PerformerAttention(nn.Module):
    """Single-head linear attention used inside the T2T token transformers.

    Soft-split tokens are many (3136 at 224px) and wide (C * k * k), so softmax
    attention would dominate the stem's cost. The output width differs from the
    input width, so the residual is taken on the value path: ``v + proj(attn)``.
    """

    def __init__(self, dim: int, out_dim: int, kernel_ratio: float = 0.5, proj_drop: float = 0., eps: float = 1e-8):
        super().__init__()
        self.out_dim = out_dim
        self.eps = eps
        self.qkv = nn.Linear(dim, 3 * out_dim)
        self.proj = nn.Linear(out_dim, out_dim)
        self.proj_drop = nn.Dropout(proj_drop)
        # Fixed at init (not trained), but saved with the weights so a checkpoint reproduces the model.
        self.register_buffer('omega', orthogonal_random_features(int(out_dim * kernel_ratio), out_dim))

    def linear_attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """Approximate softmax(q k^T) v in O(N m d) via the random-feature kernel."""
        # exp features overflow in half precision, so the kernel sums run in fp32.
        with torch.autocast(device_type=q.device.type, enabled=False):
            omega = self.omega.float()
            q_feat = performer_features(q.float(), omega)  # (B, N, m)
            k_feat = performer_features(k.float(), omega)  # (B, N, m)
            kv = k_feat.transpose(1, 2) @ v.float()  # (B, m, d)
            normaliser = q_feat @ k_feat.sum(dim=1).unsqueeze(-1)  # (B, N, 1)
            out = (q_feat @ kv) / (normaliser + self.eps)
        return out.to(v.dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv(x).chunk(3, dim=-1)
        return v + self.proj_drop(self.proj(self.linear_attention(q, k, v)))


def _split_grid(size: Tuple[int, int], split: nn.Unfold) -> Tuple[int, int]:
    """Spatial grid of the patches an ``nn.Unfold`` (built with int arguments) extracts from ``size``."""
    return tuple((s + 2 * split.padding - split.kernel_size) // split.stride + 1 for s in size)


class TokensToToken(nn.Module):
    """Soft split -> token transformer -> re-structurise, twice, then a final soft split and projection.

    Maps ``(B, C, H, W)`` to ``(B, H/16 * W/16, embed_dim)`` tokens.
    """

    def __init__(
            self,
            in_chans: int = 3,
            embed_dim: int = 384,
            token_dim: int = 64,
            kernel_ratio: float = 0.5,
            drop_rate: float = 0.,
            norm_layer: NormLayer = nn.LayerNorm,
            act_layer: Callable[[], nn.Module] = nn.GELU,
    ):
        super().__init__()

        def token_transformer(dim: int) -> Block:
            """A token transformer from ``dim`` to ``token_dim`` channels: Performer attention, MLP ratio 1."""
            attn_layer = partial(PerformerAttention, dim, token_dim, kernel_ratio=kernel_ratio, proj_drop=drop_rate)
            return Block(
                dim, attn_layer, mlp_ratio=1.0, proj_drop=drop_rate, norm_layer=norm_layer, act_layer=act_layer,
                out_dim=token_dim, attn_residual=False,
            )

        self.split0 = nn.Unfold(kernel_size=7, stride=4, padding=2)
        self.layer1 = token_transformer(in_chans * 7 * 7)
        self.split1 = nn.Unfold(kernel_size=3, stride=2, padding=1)
        self.layer2 = token_transformer(token_dim * 3 * 3)
        self.split2 = nn.Unfold(kernel_size=3, stride=2, padding=1)
        self.proj = nn.Linear(token_dim * 3 * 3, embed_dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        grid = tuple(x.shape[-2:])
        for split, layer in ((self.split0, self.layer1), (self.split1, self.layer2)):
            x = split(x).transpose(1, 2)
            grid = _split_grid(grid, split)
            # Re-structurise the tokens into an image so the next soft split sees neighbours.
            x = layer(x).transpose(1, 2).unflatten(2, grid)
        return self.proj(self.split2(x).transpose(1, 2))


class Attention(nn.Module):
    """Multi-head softmax self-attention with a single fused ``qkv`` projection."""

    def __init__(self, dim: int, num_heads: int, qkv_bias: bool = False, attn_drop: float = 0., proj_drop: float = 0.):
        super().__init__()
        if dim % num_heads:
            raise ValueError(f'dim={dim} must be divisible by num_heads={num_heads}.')
        self.num_heads = num_heads
        self.head_dim = dim // num_heads
        self.attn_drop = attn_drop
        self.qkv = nn.Linear(dim, 3 * dim, bias=qkv_bias)
        self.proj = nn.Linear(dim, dim)
        self.proj_drop = nn.Dropout(proj_drop)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, N, _ = x.shape  # the heads' width, not the input's (one less in Pre-CRMSNorm)
        q, k, v = self.qkv(x).reshape(B, N, 3, self.num_heads, self.head_dim).permute(2, 0, 3, 1, 4).unbind(0)
        x = F.scaled_dot_product_attention(q, k, v, dropout_p=self.attn_drop if self.training else 0.)
        return self.proj_drop(self.proj(x.transpose(1, 2).reshape(B, N, -1)))


class Block(nn.Module):
    """Pre-norm Transformer block, ``x = x + attn(norm1(x)); x = x + mlp(norm2(x))``, with stochastic
    depth on both residual branches: the backbone's blocks (``Attention``) and T2T's token transformers.

    ``attn_layer()`` builds the attention from ``dim`` to ``out_dim`` (default ``dim``) channels.
    ``attn_residual=False`` is for an attention that changes the width and so carries its residual
    inside (``PerformerAttention``, on its value path): its output replaces ``x``.
    """

    def __init__(
            self,
            dim: int,
            attn_layer: Callable[[], nn.Module],
            mlp_ratio: float = 4.0,
            proj_drop: float = 0.,
            drop_path: float = 0.,
            norm_layer: NormLayer = nn.LayerNorm,
            act_layer: Callable[[], nn.Module] = nn.GELU,
            *,
            out_dim: Optional[int] = None,
            attn_residual: bool = True,
    ):
        super().__init__()
        out_dim = out_dim or dim
        self.attn_residual = attn_residual
        self.norm1 = norm_layer(dim)
        self.attn = attn_layer()
        self.drop_path1 = DropPath(drop_path) if drop_path > 0. else nn.Identity()
        self.norm2 = norm_layer(out_dim)
        self.mlp = Mlp(out_dim, int(out_dim * mlp_ratio), act_layer=act_layer, drop=proj_drop)
        self.drop_path2 = DropPath(drop_path) if drop_path > 0. else nn.Identity()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        attended = self.drop_path1(self.attn(self.norm1(x)))
        x = x + attended if self.attn_residual else attended
        return x + self.drop_path2(self.mlp(self.norm2(x)))


class T2TViT(nn.Module):
    """Tokens-to-Token ViT: Performer T2T stem, class token, fixed sinusoidal positions, ViT backbone."""

    def __init__(
            self,
            img_size: Union[int, Tuple[int, int]] = 224,
            in_chans: int = 3,
            num_classes: int = 1000,
            embed_dim: int = 384,
            depth: int = 14,
            num_heads: int = 6,
            mlp_ratio: float = 3.0,
            token_dim: int = 64,
            qkv_bias: bool = False,
            drop_rate: float = 0.,
            attn_drop_rate: float = 0.,
            drop_path_rate: float = 0.,
            norm_layer: Optional[NormLayer] = None,
            global_pool: str = 'token',
            *,
            kernel_ratio: float = 0.5,
            act_layer: Optional[Callable[[], nn.Module]] = None,
            **kwargs,
    ):
        super().__init__()
        # Reject rather than silently ignore, so a misspelt option cannot go unnoticed in an experiment.
        if kwargs:
            raise TypeError(f'T2TViT got unexpected arguments: {sorted(kwargs)}')
        if global_pool not in ('token', 'avg', ''):
            raise ValueError(f"global_pool must be 'token', 'avg' or '', got {global_pool!r}.")
        img_size = to_2tuple(img_size)
        if any(s % 16 for s in img_size):
            raise ValueError(f'img_size={img_size} must be divisible by 16 (the T2T stem downsamples 16x).')
        norm_layer = norm_layer or partial(nn.LayerNorm, eps=1e-6)
        act_layer = act_layer or nn.GELU

        self.num_classes = num_classes
        self.global_pool = global_pool
        self.num_features = self.head_hidden_size = self.embed_dim = embed_dim
        self.img_size = tuple(img_size)
        self.grid_size = tuple(s // 16 for s in img_size)
        self.num_patches = self.grid_size[0] * self.grid_size[1]

        self.tokens_to_token = TokensToToken(
            in_chans=in_chans, embed_dim=embed_dim, token_dim=token_dim, kernel_ratio=kernel_ratio,
            drop_rate=drop_rate, norm_layer=norm_layer, act_layer=act_layer,
        )
        self.cls_token = nn.Parameter(torch.zeros(1, 1, embed_dim))
        self.register_buffer('pos_embed', sinusoid_position_embedding(self.num_patches + 1, embed_dim))
        self.pos_drop = nn.Dropout(drop_rate)
        drop_path_rates = torch.linspace(0, drop_path_rate, depth).tolist()
        attention = partial(
            Attention, embed_dim, num_heads, qkv_bias=qkv_bias, attn_drop=attn_drop_rate, proj_drop=drop_rate,
        )
        self.blocks = nn.Sequential(*[
            Block(
                embed_dim, attention, mlp_ratio=mlp_ratio, proj_drop=drop_rate, drop_path=dpr,
                norm_layer=norm_layer, act_layer=act_layer,
            )
            for dpr in drop_path_rates
        ])
        self.norm = norm_layer(embed_dim)
        self.head = nn.Linear(embed_dim, num_classes) if num_classes > 0 else nn.Identity()

        trunc_normal_(self.cls_token, std=.02)
        self.apply(self._init_weights)

    @staticmethod
    def _init_weights(m: nn.Module) -> None:
        if isinstance(m, nn.Linear):
            trunc_normal_(m.weight, std=.02)
            if m.bias is not None:
                nn.init.zeros_(m.bias)
        elif isinstance(m, nn.LayerNorm):
            # weight/bias are None for elementwise_affine=False or bias=False.
            if m.weight is not None:
                nn.init.ones_(m.weight)
            if m.bias is not None:
                nn.init.zeros_(m.bias)

    @torch.jit.ignore
    def no_weight_decay(self) -> set:
        return {'cls_token', 'pos_embed'}

    @torch.jit.ignore
    def get_classifier(self) -> nn.Module:
        return self.head

    def reset_classifier(self, num_classes: int, global_pool: Optional[str] = None) -> None:
        if global_pool is not None:
            if global_pool not in ('token', 'avg', ''):
                raise ValueError(f"global_pool must be 'token', 'avg' or '', got {global_pool!r}.")
            self.global_pool = global_pool
        self.num_classes = num_classes
        self.head = nn.Linear(self.embed_dim, num_classes) if num_classes > 0 else nn.Identity()

    def forward_features(self, x: torch.Tensor) -> torch.Tensor:
        if tuple(x.shape[-2:]) != self.img_size:
            raise ValueError(
                f'Input size {tuple(x.shape[-2:])} does not match img_size={self.img_size}, '
                'which fixes the size of the position embedding.'
            )
        x = self.tokens_to_token(x)
        x = torch.cat((self.cls_token.expand(x.shape[0], -1, -1), x), dim=1)
        x = self.pos_drop(x + self.pos_embed)
        x = self.blocks(x)
        return self.norm(x)

    def forward_head(self, x: torch.Tensor, pre_logits: bool = False) -> torch.Tensor:
        if self.global_pool == 'avg':
            x = x[:, 1:].mean(dim=1)
        elif self.global_pool == 'token':
            x = x[:, 0]
        return x if pre_logits else self.head(x)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.forward_head(self.forward_features(x))


def _cfg(**kwargs):
    return {
        'num_classes': 1000,
        'input_size': (3, 224, 224),
        'fixed_input_size': True,
        'crop_pct': 0.9,
        'interpolation': 'bicubic',
        'mean': IMAGENET_DEFAULT_MEAN,
        'std': IMAGENET_DEFAULT_STD,
        'classifier': 'head',
        'paper_name': 'Tokens-to-Token ViT: Training Vision Transformers from Scratch on ImageNet',
        'paper_ids': 'arXiv:2101.11986',
        **kwargs,
    }


default_cfgs = generate_default_cfgs({
    't2t_vit_14': _cfg(),
    't2t_vit_7': _cfg(),
    't2t_vit_tiny': _cfg(),
})


def _create_t2t_vit(variant: str, pretrained: bool = False, **kwargs) -> T2TViT:
    if pretrained:
        raise RuntimeError(f'No pretrained weights are available for {variant}; create it with pretrained=False.')
    return build_model_with_cfg(T2TViT, variant, pretrained, **kwargs)


@register_model
def t2t_vit_14(pretrained: bool = False, **kwargs) -> T2TViT:
    """T2T-ViT-14 (paper: 21.5M params, 4.8G MACs at 224px)."""
    model_args = dict(embed_dim=384, depth=14, num_heads=6, mlp_ratio=3.0, token_dim=64)
    return _create_t2t_vit('t2t_vit_14', pretrained=pretrained, **dict(model_args, **kwargs))


@register_model
def t2t_vit_7(pretrained: bool = False, **kwargs) -> T2TViT:
    """T2T-ViT-7 (paper: 4.3M params, 1.1G MACs at 224px)."""
    model_args = dict(embed_dim=256, depth=7, num_heads=4, mlp_ratio=2.0, token_dim=64)
    return _create_t2t_vit('t2t_vit_7', pretrained=pretrained, **dict(model_args, **kwargs))


@register_model
def t2t_vit_tiny(pretrained: bool = False, **kwargs) -> T2TViT:
    """Not from the paper: a very small variant for fast CPU tests."""
    model_args = dict(embed_dim=64, depth=4, num_heads=2, mlp_ratio=2.0, token_dim=32)
    return _create_t2t_vit('t2t_vit_tiny', pretrained=pretrained, **dict(model_args, **kwargs))
