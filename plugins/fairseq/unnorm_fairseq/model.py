"""fairseq's Transformer with any norm of ``unnorm`` in place of its LayerNorms.

fairseq 0.12.2 has no hook for the norm class, so the layers are fairseq's own, subclassed to
replace their norms after construction (norms draw no random numbers, so every other weight
is initialised as in the stock model), and the encoder and decoder replace their final norm.
fairseq calls a norm as ``norm(x)``; the encoder and decoder therefore hand every norm of
their stack the padding mask of the batch in flight (``unnorm.PadMaskFeed``), so padding stays out
of batch statistics. ``--norm-pad-mask false`` hands none, as the UN release's fairseq fork
does (its layers call the norm without a mask, so padding enters UN's statistics). With
``--norm-type ln`` the model computes exactly what the stock model does. PowerNorm's
layer-scale (``pn_ls``) groups by the attention heads of the norm's block unless
``--un-group-num`` says otherwise. Under ``--fp16``/``--amp`` (fairseq casts the model; the
norms keep float32 statistics) training must run through ``plugins.fairseq.train``, which
keeps fairseq's loss scaling away from the norms' statistics; fairseq-train is refused there.
So is ``--record-gns RUN_DIR`` (the norms' per-example gradient norms, ``unnorm.gns``), which
that trainer records; it is registered here, with the norms' flags, so that every command line
of this model (``plugins.fairseq.checkpoints`` rebuilds it from the training flags) takes it.
So are ``--sam true`` with its ``--sam-*`` options (sharpness-aware updates, SAM-ON),
``--train-only norm|norm+head`` (``plugins.fairseq.flags``), ``--agc`` (adaptive gradient
clipping), ``--record-scale-invariance RUN_DIR`` and ``--record-updates``, which that trainer
applies or records; fairseq-train, which would ignore them, is refused with them.
``--weight-standardization PATTERN ...`` (with ``--ws-eps``, ``--ws-eps-form``,
``--ws-gamma``: ``plugins.model_options.standardize_layers``) standardises the linear layers
the patterns name; ``--ws-eps-form scaled`` with ``--agc`` and ``--norm-type nonorm`` is the
normalizer-free baseline (``ws=nf``). fairseq's self-attention hands its projections' weights
to ``F.multi_head_attention_forward`` rather than calling them, which would skip a
standardised projection's standardisation: such an attention takes fairseq's own path that
calls them (``skip_embed_dim_check``, whose only other effect is to skip a shape assertion).
"""
from __future__ import annotations

from typing import Optional

import torch
from fairseq.models import register_model, register_model_architecture
from fairseq.models.transformer import (
    TransformerConfig,
    TransformerDecoderBase,
    TransformerEncoderBase,
    TransformerModel,
    transformer_iwslt_de_en,
    transformer_wmt_en_de,
)
from fairseq.modules.transformer_layer import (
    TransformerDecoderLayerBase,
    TransformerEncoderLayerBase,
)
from torch import nn

import unnorm
from plugins.fairseq.flags import OPTIONS, SAM_OPTIONS, boolean, dest
from plugins.model_options import WS_OPTIONS, standardize_layers
from plugins.sam import TRAIN_ONLY
from unnorm.ws import EPS_FORMS, SCALED, StandardizedWeight

#: the model options of Weight Standardization, each a flag of its own name (--ws-eps, ...)
WS_KEYS = ("weight_standardization", *WS_OPTIONS)
EMBEDDINGS = ["encoder.embed_tokens", "decoder.embed_tokens"]
HEAD = ["decoder.output_projection"]
PROJECTIONS = ("q_proj", "k_proj", "v_proj", "out_proj")


def call_standardized_projections(model: nn.Module) -> None:
    """Make every fairseq attention with a standardised projection call its projections (the
    module docstring says why)."""
    for module in model.modules():
        if any(isinstance(getattr(module, name, None), StandardizedWeight) for name in PROJECTIONS):
            module.skip_embed_dim_check = True


def options_from_args(cfg) -> dict:
    """The ``--un-*`` options that are set (an unset one leaves the norm's default)."""
    return {option: getattr(cfg, dest(option)) for option in OPTIONS
            if getattr(cfg, dest(option), None) is not None}


def build_norm(cfg, dim: int, heads: int) -> nn.Module:
    """The norm ``--norm-type`` names, with its options, for a block of ``heads`` attention
    heads: PowerNorm's layer-scale groups by them when ``--un-group-num`` is unset, as its
    release does (4 groups in IWSLT's model, 8 in WMT's)."""
    options = options_from_args(cfg)
    if cfg.norm_type == "pn_ls" and options.get("group_num") is None:
        options["group_num"] = heads
    return unnorm.build_norm(cfg.norm_type, dim, **options)


class UnnormEncoderLayer(TransformerEncoderLayerBase):
    def __init__(self, cfg, return_fc: bool = False):
        super().__init__(cfg, return_fc=return_fc)
        heads = cfg.encoder.attention_heads
        self.self_attn_layer_norm = build_norm(cfg, self.embed_dim, heads)
        self.final_layer_norm = build_norm(cfg, self.embed_dim, heads)
        self.can_use_fastpath = False  # BetterTransformer reads LayerNorm parameters directly


class UnnormDecoderLayer(TransformerDecoderLayerBase):
    def __init__(self, cfg, no_encoder_attn: bool = False):
        super().__init__(cfg, no_encoder_attn=no_encoder_attn)
        heads = cfg.decoder.attention_heads
        self.self_attn_layer_norm = build_norm(cfg, self.embed_dim, heads)
        if self.encoder_attn_layer_norm is not None:
            self.encoder_attn_layer_norm = build_norm(cfg, self.embed_dim, heads)
        self.final_layer_norm = build_norm(cfg, self.embed_dim, heads)


class UnnormTransformerEncoder(TransformerEncoderBase):
    def __init__(self, cfg, dictionary, embed_tokens):
        super().__init__(cfg, dictionary, embed_tokens)
        if self.layer_norm is not None:
            self.layer_norm = build_norm(cfg, embed_tokens.embedding_dim, cfg.encoder.attention_heads)
        self.pad_feed = unnorm.PadMaskFeed(self, cfg.norm_pad_mask)

    def build_encoder_layer(self, cfg):
        return UnnormEncoderLayer(cfg, return_fc=self.return_fc)

    def forward(self, src_tokens, src_lengths: Optional[torch.Tensor] = None,
                return_all_hiddens: bool = False, token_embeddings: Optional[torch.Tensor] = None):
        with self.pad_feed.batch(src_tokens.eq(self.padding_idx).t()):  # time-first x
            return super().forward(src_tokens, src_lengths, return_all_hiddens, token_embeddings)


class UnnormTransformerDecoder(TransformerDecoderBase):
    def __init__(self, cfg, dictionary, embed_tokens, no_encoder_attn: bool = False):
        super().__init__(cfg, dictionary, embed_tokens, no_encoder_attn=no_encoder_attn)
        if self.layer_norm is not None:
            self.layer_norm = build_norm(cfg, self.embed_dim, cfg.decoder.attention_heads)
        self.pad_feed = unnorm.PadMaskFeed(self, cfg.norm_pad_mask)

    def build_decoder_layer(self, cfg, no_encoder_attn: bool = False):
        return UnnormDecoderLayer(cfg, no_encoder_attn=no_encoder_attn)

    def extract_features(self, prev_output_tokens, encoder_out, incremental_state=None,
                         full_context_alignment: bool = False, alignment_layer=None,
                         alignment_heads=None):
        # incremental decoding feeds the last position only, as the base class does
        tokens = prev_output_tokens if incremental_state is None else prev_output_tokens[:, -1:]
        with self.pad_feed.batch(tokens.eq(self.padding_idx).t()):  # time-first x
            return super().extract_features(prev_output_tokens, encoder_out, incremental_state,
                                            full_context_alignment, alignment_layer,
                                            alignment_heads)


@register_model("unnorm_transformer")
class UnnormTransformerModel(TransformerModel):
    """fairseq's ``transformer`` with ``--norm-type <any unnorm norm>``."""

    loss_scaled = False  # built for --fp16/--amp training (build_model)
    record_gns = None  # --record-gns: the run directory plugins.fairseq.train records into
    needs_trainer = False  # --sam true, --train-only other than all, --agc or a record's flag
    trainer_applies = False  # set by plugins.fairseq.train, which applies them

    @classmethod
    def add_args(cls, parser):
        super().add_args(parser)
        parser.add_argument("--norm-type", choices=unnorm.available_norms(), default="ln",
                            help="the norm of every layer (unnorm.build_norm)")
        parser.add_argument("--norm-pad-mask", type=boolean, default=True, metavar="BOOL",
                            help="hand the norms the batch's padding mask (false: none, as "
                                 "the UN release's fairseq fork)")
        parser.add_argument("--record-gns", metavar="RUN_DIR", default=None,
                            help="record the norms' per-example gradient norms into "
                                 "RUN_DIR/gns/epoch_XXXX.pt (training with plugins.fairseq.train)")
        for option, (flag, kind) in OPTIONS.items():
            default = ("the attention heads of the norm's block" if option == "group_num"
                       else "the norm's default")
            parser.add_argument(flag, type=kind, default=None, metavar=option.upper(),
                                help=f"the norm's {option} (unset: {default})")
        parser.add_argument("--record-scale-invariance", metavar="RUN_DIR", default=None,
                            help="record the weights the model is exactly scale-invariant in at "
                                 "its start into RUN_DIR/scale_invariance.json (training with "
                                 "plugins.fairseq.train)")
        parser.add_argument("--record-updates", action="store_true",
                            help="record each epoch's effective steps and AdamP/SGDP projections "
                                 "in its train statistics (plugins.optim.UpdateRecord; training "
                                 "with plugins.fairseq.train)")
        parser.add_argument("--record-landscape", type=int, default=0, metavar="K",
                            help="every K-th update, the loss landscape along its gradient into "
                                 "--landscape-dir's landscape.jsonl (plugins.landscape; training "
                                 "with plugins.fairseq.train, float32, one process)")
        parser.add_argument("--landscape-dir", metavar="RUN_DIR", default=None,
                            help="the run directory --record-landscape writes landscape.jsonl into")
        parser.add_argument("--sam", type=boolean, default=False, metavar="BOOL",
                            help="sharpness-aware updates (plugins.sam; training with "
                                 "plugins.fairseq.train, one micro-batch per update)")
        for option, (flag, kind) in SAM_OPTIONS.items():
            parser.add_argument(flag, type=kind, default=None, metavar=option.upper(),
                                help=f"SAM's {option} (unset: plugins.sam.SharpnessAware's default)")
        parser.add_argument("--train-only", choices=TRAIN_ONLY, default="all",
                            help="freeze every parameter but the norms' (norm+head: and the "
                                 "output projection's) at its initialisation (plugins.fairseq.train)")
        parser.add_argument("--weight-standardization", nargs="+", default=None, metavar="PATTERN",
                            help="standardise the weights of the nn.Linear layers these fnmatch "
                                 "patterns name (plugins.model_options.standardize_layers)")
        parser.add_argument("--ws-eps", type=float, default=None, help="Weight Standardization's eps")
        parser.add_argument("--ws-eps-form", choices=[*EPS_FORMS, SCALED], default=None,
                            help="where eps enters (unnorm.ws); scaled: NF-Nets' Scaled WS")
        parser.add_argument("--ws-gamma", type=float, default=None,
                            help="Scaled WS's gamma (unset: 1)")
        parser.add_argument("--agc", type=float, default=None, metavar="LAMBDA",
                            help="adaptive gradient clipping with this clipping factor (timm's "
                                 "adaptive_clip_grad) in place of --clip-norm (plugins.fairseq.train)")

    @classmethod
    def build_model(cls, args, task):
        unnorm.norm_layer(args.norm_type, **options_from_args(args))  # a wrong option fails first
        for unsupported in ("layernorm_embedding", "checkpoint_activations", "offload_activations"):
            if getattr(args, unsupported, False):
                raise ValueError(f"unnorm_transformer does not support --{unsupported.replace('_', '-')}")
        model = super().build_model(args, task)
        standardization = {key: getattr(args, key) for key in WS_KEYS
                           if getattr(args, key, None) is not None}
        if standardize_layers(model, standardization, embedding=EMBEDDINGS, head=HEAD):
            call_standardized_projections(model)
        model.loss_scaled = bool(getattr(args, "fp16", False) or getattr(args, "amp", False))
        model.record_gns = getattr(args, "record_gns", None)
        model.needs_trainer = (bool(getattr(args, "sam", False))
                               or getattr(args, "train_only", "all") != "all"
                               or getattr(args, "agc", None) is not None
                               or bool(getattr(args, "record_scale_invariance", None))
                               or bool(getattr(args, "record_updates", False))
                               or bool(getattr(args, "record_landscape", 0)))
        return model

    def forward(self, *args, **kwargs):
        if self.training and self.loss_scaled:
            self._require_loss_scale_guard()
        if self.training and self.record_gns and not any(
                module._gns is not None for module in self.modules() if isinstance(module, unnorm.ChannelNorm)):
            raise RuntimeError("--record-gns: nothing records the norms' gradients; train with "
                               "`python -m plugins.fairseq.train` (fairseq-train's flags), which does")
        if self.training and self.needs_trainer and not self.trainer_applies:
            raise RuntimeError("--sam/--train-only/--agc/--record-scale-invariance/--record-updates/"
                               "--record-landscape: "
                               "nothing applies them (fairseq-train would train every parameter "
                               "with plain updates and record nothing); train with `python -m "
                               "plugins.fairseq.train` (fairseq-train's flags), which does")
        return super().forward(*args, **kwargs)

    def _require_loss_scale_guard(self) -> None:
        """fairseq-train scales the loss under --fp16/--amp without telling the norms; only
        ``plugins.fairseq.train`` does (``unnorm.LossScaleGuard``)."""
        unguarded = [name for name, module in self.named_modules()
                     if isinstance(module, unnorm.GuardedNorm) and module.loss_scale is None]
        if unguarded:
            raise RuntimeError(
                f"--fp16/--amp scale the loss, and {len(unguarded)} norms ({unguarded[0]}, ...) "
                "would keep statistics in scaled units and the state of skipped updates: train "
                "with `python -m plugins.fairseq.train` (fairseq-train's flags; it guards them) "
                "instead of fairseq-train")

    @classmethod
    def build_encoder(cls, args, src_dict, embed_tokens):
        return UnnormTransformerEncoder(TransformerConfig.from_namespace(args), src_dict, embed_tokens)

    @classmethod
    def build_decoder(cls, args, tgt_dict, embed_tokens):
        cfg = TransformerConfig.from_namespace(args)
        return UnnormTransformerDecoder(cfg, tgt_dict, embed_tokens, no_encoder_attn=cfg.no_cross_attention)


@register_model_architecture("unnorm_transformer", "unnorm_transformer_iwslt_de_en")
def unnorm_transformer_iwslt_de_en(args):
    """IWSLT14 De-En: 6+6 layers, width 512, FFN 1024, 4 heads (fairseq's transformer_iwslt_de_en)."""
    transformer_iwslt_de_en(args)


@register_model_architecture("unnorm_transformer", "unnorm_transformer_wmt_en_fr")
def unnorm_transformer_wmt_en_fr(args):
    """WMT14 En-Fr: Vaswani et al.'s base, 6+6 layers, width 512, FFN 2048, 8 heads."""
    transformer_wmt_en_de(args)


@register_model_architecture("unnorm_transformer", "unnorm_transformer_tiny")
def unnorm_transformer_tiny(args):
    """CPU-sized: 2+2 layers, width 64, FFN 256, 4 heads."""
    for side in ("encoder", "decoder"):
        setattr(args, f"{side}_embed_dim", getattr(args, f"{side}_embed_dim", 64))
        setattr(args, f"{side}_ffn_embed_dim", getattr(args, f"{side}_ffn_embed_dim", 256))
        setattr(args, f"{side}_attention_heads", getattr(args, f"{side}_attention_heads", 4))
        setattr(args, f"{side}_layers", getattr(args, f"{side}_layers", 2))
    transformer_iwslt_de_en(args)
