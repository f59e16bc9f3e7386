"""A Llama-style decoder with any unnorm norm at every norm site, in any placement.

``build_lm`` returns Hugging Face's ``LlamaForCausalLM`` built from a ``LlamaConfig`` (no
weights downloaded), its attention (RoPE, causal mask, KV cache), MLP and initialisation
untouched. Every norm site is ``unnorm.build_norm``; each decoder layer is a
``PlacedDecoderLayer`` that puts its norms where the placement says (x: the layer's input,
A: attention, M: the MLP):

- ``pre``  (GPT-2, Llama): ``h = x + A(N1(x)); y = h + M(N2(h))``, then a final norm. With
  ``rms`` this is Hugging Face's Llama itself: the same state-dict keys and logits.
- ``post`` (the original Transformer): ``h = N1(x + A(x)); y = N2(h + M(h))``. No final norm:
  the last layer's output is already normalised (fairseq's Post-LN decoder has none).
  Mix-LN's code keeps Llama's final norm for its Post-LN baseline: ``final_norm=True``.
- ``peri`` (Peri-LN, ICML 2025): ``h = x + N1o(A(N1i(x))); y = h + N2o(M(N2i(h)))``, then a
  final norm, and optionally a norm on the embeddings (``embedding_norm``).
- ``mix``  (Mix-LN, ICLR 2025): ``post`` in the first ``floor(mix_post_fraction * L)`` layers,
  ``pre`` after, and the final norm (pixeli99/MixLN: layer ``i < POST_NUM`` is Post-LN, and its
  Llama keeps ``self.norm`` whatever the layers).

In any placement, ``qk_norm`` (a registry name) puts a norm on each head's queries and keys
(``plugins.lm.attention``). ``init`` picks the initialisation: ``hf`` (Hugging Face's Llama:
every linear layer and the embeddings N(0, initializer_range)) or ``mixln`` (Mix-LN's release,
``peft_pretraining/modeling_llama.py``, ``_init_weights``: the embeddings N(0, 2/5), std 0.63
at every width, the linear layers as ``hf``; its scaled and Xavier initialisations mark layers
only in its ``scale_pre``, ``scale_post_pre`` and ``deeppost`` norm types, not in the Pre, Post
and Mix (``post_pre``) runs it reports).

Site names follow Hugging Face's Llama (``input_layernorm``, ``post_attention_layernorm``) and,
for the norms Llama lacks, Gemma 2's four-norm layer and Mix-LN's code
(``pre_feedforward_layernorm``, ``post_feedforward_layernorm``).

The releases' LLaMA recipes (on by default, ``dyt_llm_recipe``/``prepbn_llm_recipe``):

- DyT (jiachenzhu/DyT, ``other_tasks/LLaMA``): a weight-only DyT, alpha initialised per site
  from the model's width (the paper's Table 12: the attention sublayer's norms one value, every
  other norm a smaller one; replaces ``norm.alpha_init``), and a learnable scalar on the token
  embeddings initialised to sqrt(hidden_size).
- PRepBN (xinghaochen/SLAB, ``llama/modeling``): the hand-over starts from Llama's RMSNorm
  (weight only, ``rms_norm_eps``; replaces ``norm.eps``) instead of LayerNorm, and RepBN starts
  at zero (its BN weight, BN bias and alpha are zero-initialised), so training starts as
  Pre-RMSNorm Llama. SLAB counts its schedule in optimizer updates of 16 micro-batches; the
  norms here count micro-batches (docs/core.md, step units).

Batch-statistics norms (bn, mabn, pn, pn_ls, un, prepbn) see (B, T, C) activations and pool
over all B*T positions: the model takes packed sequences without padding, so no pad mask.

Hugging Face interchange: the model is an ``UnnormLlamaForCausalLM`` (a ``LlamaForCausalLM``
subclass) and its config an ``UnnormLlamaConfig`` (``model_type`` ``"unnorm_llama"``: a
``LlamaConfig`` plus the norm config and the placement options), registered with
``AutoConfig`` and ``AutoModelForCausalLM`` when this module is imported. So
``model.save_pretrained(dir)`` and ``AutoModelForCausalLM.from_pretrained(dir)`` rebuild the
same model, every norm's running state (its buffers) included; ``plugins.lm.export`` writes
a trained run, and a Pre-RMSNorm one as a stock ``LlamaForCausalLM`` checkpoint.
"""
# no ``from __future__ import annotations``: huggingface_hub's @strict checks the config's
# field types at run time, from the annotations as written
import math
from typing import Mapping, Optional

import torch
import transformers
from huggingface_hub.dataclasses import strict
from omegaconf import OmegaConf
from torch import nn
from transformers import AutoConfig, AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM
from transformers import initialization as hf_init
from transformers.models.llama.modeling_llama import LlamaDecoderLayer

import unnorm
from plugins.norms import norm_kwargs

from .attention import add_qk_norm

PLACEMENTS = ("pre", "post", "peri", "mix")

#: each layer placement's norm sites, in the order the forward applies them
LAYER_SITES = {
    "pre": ("input_layernorm", "post_attention_layernorm"),
    "post": ("post_attention_layernorm", "post_feedforward_layernorm"),
    "peri": ("input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm",
             "post_feedforward_layernorm"),
}
#: the sites inside the attention sublayer (its input norm, Peri-LN's output norm, Post-LN's
#: add-and-norm): DyT's "attention" alpha; every other site gets its "other" alpha
ATTENTION_SITES = {
    "pre": {"input_layernorm"},
    "post": {"post_attention_layernorm"},
    "peri": {"input_layernorm", "post_attention_layernorm"},
}
#: DyT's LLaMA alpha initialisation by model width, (width, attention, other): the paper's
#: Table 12 (1024-8192; depth has no effect there) and its LLaMA-2 13B (5120) setting; a model
#: takes the row of the first width at or above its own, the last row beyond 8192
DYT_LLM_ALPHAS = ((1024, 1.0, 1.0), (2048, 1.0, 0.5), (4096, 0.8, 0.2), (5120, 0.6, 0.15),
                  (8192, 0.2, 0.05))

#: the build options that are not LlamaConfig fields
LM_OPTIONS = {"norm_position": "pre", "mix_post_fraction": 0.25, "embedding_norm": False,
              "final_norm": None, "dyt_llm_recipe": True, "prepbn_llm_recipe": True,
              "qk_norm": None, "init": "hf"}
INITS = ("hf", "mixln")
#: Mix-LN's release draws its token embeddings with this std at every width
MIXLN_EMBEDDING_STD = math.sqrt(2 / 5)
#: keys of a Hydra model config that are no model fields: its name, the width the scale
#: switch scales groups by, and ``cpu``, the scale variant that ``config.yaml`` recorded inside
#: the model before Hydra composed it (``plugins.runlog.RETIRED_KEYS``)
_LABELS = {"name", "width", "cpu"}
#: keys of the layer options the trainer applies to the built model (``plugins.model_options``)
_LAYER_OPTIONS = {"weight_standardization", "ws_eps", "ws_eps_form", "ws_gamma", "nf_targets"}
_ALIASES = {"context": "max_position_embeddings"}
_LLAMA_EXTRA = {"rope_theta"}  # legacy LlamaConfig keyword, taken into rope_parameters


def build_lm(model_cfg: Mapping, norm_cfg: Mapping, **overrides) -> "UnnormLlamaForCausalLM":
    """Hugging Face's ``LlamaForCausalLM`` with every norm site built from ``norm_cfg``.

    ``model_cfg`` (a Hydra ``model`` config or a dict; ``overrides`` win) holds LlamaConfig
    fields (vocab_size, hidden_size, intermediate_size, num_hidden_layers, num_attention_heads,
    rope_theta, rms_norm_eps, ...; ``context`` is ``max_position_embeddings``) and the
    placement options: ``norm_position`` (pre | post | peri | mix), ``mix_post_fraction``
    (0.25), ``embedding_norm`` (false), ``final_norm`` (null: as the placement says),
    ``dyt_llm_recipe`` and ``prepbn_llm_recipe`` (true), ``qk_norm`` (null, or a registry
    norm on each head's queries and keys) and ``init`` (``hf`` or ``mixln``). ``name``, ``width`` and a
    recorded ``cpu`` variant are labels, no fields (``_LABELS``); the layer options
    (``model.weight_standardization``...) are the trainer's (``_LAYER_OPTIONS``).

    The norms' ``eps`` is ``rms_norm_eps`` where the norm config leaves it unset; ``rms`` has
    no bias (Llama's RMSNorm); PN with layer-scale and ``group_num: null`` groups by the
    attention heads.

    Returns an ``UnnormLlamaForCausalLM`` (a ``LlamaForCausalLM``) whose ``config`` (an
    ``UnnormLlamaConfig``) carries the norm config and the options, so ``save_pretrained`` /
    ``AutoModelForCausalLM.from_pretrained`` rebuild it.
    """
    options, llama = _split_options({**_plain(model_cfg), **overrides})
    return UnnormLlamaForCausalLM(UnnormLlamaConfig(**llama, **options, norm=_plain(norm_cfg)))


def norm_plan(config: "UnnormLlamaConfig") -> tuple[list[str], "_NormFactory"]:
    """Each layer's placement and the norm factory of ``config``; a wrong placement, norm
    name or norm option is refused here, before any weight is built."""
    if not isinstance(config.norm, Mapping):
        raise ValueError("the model config needs a norm config (norm={'name': ..., options}); "
                         "build the model with plugins.lm.build_lm")
    options = lm_options(config)
    kinds = layer_placements(options["norm_position"], config.num_hidden_layers,
                             options["mix_post_fraction"])
    return kinds, _NormFactory(dict(config.norm), config, options)


def place_norms(model: LlamaForCausalLM, config: "UnnormLlamaConfig",
                plan: Optional[tuple[list[str], "_NormFactory"]] = None) -> None:
    """Put the norms of ``config`` (its norm config, in its placement; ``norm_plan``) into a
    freshly built ``LlamaForCausalLM``, in place: each decoder layer becomes a
    ``PlacedDecoderLayer``, the final norm is the placement's (or none), and DyT's scale and
    Peri-LN's embedding norm wrap the token embedding."""
    kinds, factory = plan or norm_plan(config)
    options = lm_options(config)
    placement = options["norm_position"]
    decoder = model.model
    for index, kind in enumerate(kinds):
        decoder.layers[index] = PlacedDecoderLayer(decoder.layers[index], config, kind, factory)
        if options["qk_norm"] is not None:
            add_qk_norm(decoder.layers[index].self_attn, lambda _: factory.build("qk_norm"))
    final_norm = options["final_norm"]
    if final_norm is None:
        final_norm = placement != "post"
    decoder.norm = factory.build("norm") if final_norm else nn.Identity()
    scale = math.sqrt(config.hidden_size) if factory.dyt_recipe else None
    norm = factory.build("embedding_norm") if options["embedding_norm"] else None
    if scale is not None or norm is not None:
        decoder.embed_tokens = NormedEmbedding(decoder.embed_tokens, scale, norm)


def lm_options(config: LlamaConfig) -> dict:
    """The placement options (``LM_OPTIONS``) a config carries; a plain ``LlamaConfig``
    carries none and is Pre placement with its defaults."""
    return {key: getattr(config, key, default) for key, default in LM_OPTIONS.items()}


@strict
class UnnormLlamaConfig(LlamaConfig):
    """``LlamaConfig`` plus what ``build_lm`` puts into the model: ``norm``, the run's norm
    config (``name`` and its options, as ``configs/norm`` gives them), and the placement
    options of ``LM_OPTIONS``. Saved in ``config.json`` by ``save_pretrained``."""

    model_type = "unnorm_llama"

    norm: dict | None = None
    norm_position: str = "pre"
    mix_post_fraction: float | int = 0.25
    embedding_norm: bool = False
    final_norm: bool | None = None
    dyt_llm_recipe: bool = True
    prepbn_llm_recipe: bool = True
    qk_norm: str | None = None
    init: str = "hf"


class UnnormLlamaForCausalLM(LlamaForCausalLM):
    """Hugging Face's ``LlamaForCausalLM`` with the norms and placement of its
    ``UnnormLlamaConfig`` (``place_norms``). The same state-dict keys as Llama for the
    attention, MLP, embedding and head; each norm's state (weights, running statistics, step
    counters: persistent buffers) under its site's name."""

    config_class = UnnormLlamaConfig
    _no_split_modules = ["PlacedDecoderLayer"]

    def __init__(self, config: UnnormLlamaConfig):
        plan = norm_plan(config)
        super().__init__(config)  # Hugging Face's weights and initialisation, RNG included
        place_norms(self, config, plan)

    @torch.no_grad()
    def initialize_weights(self) -> None:
        """Hugging Face's initialisation of what it did not load (``from_pretrained``), then
        this project's norms: their state that was not loaded (a non-persistent buffer such
        as NoNorm's weight, or a key the checkpoint lacks) takes the value ``build_lm`` gives
        it, copied from a new norm of the same site; loaded state is left alone (Hugging
        Face's ``init`` functions skip a tensor it loaded). Hugging Face dispatches the base
        model's modules to ``LlamaModel._init_weights``, so the norms are done here."""
        super().initialize_weights()
        if lm_options(self.config)["init"] == "mixln":  # a loaded embedding is left alone
            hf_init.normal_(self.model.embed_tokens.weight, 0.0, MIXLN_EMBEDDING_STD)
        factory = None
        for module in self.modules():
            if isinstance(module, NormedEmbedding) and module.scale is not None:
                hf_init.constant_(module.scale, math.sqrt(self.config.hidden_size))
            site = getattr(module, "_lm_site", None)
            own = [*module.parameters(recurse=False), *module.buffers(recurse=False)]
            if site is None or all(getattr(t, "_is_hf_initialized", False) for t in own):
                continue
            if factory is None:
                factory = _NormFactory(dict(self.config.norm), self.config,
                                       lm_options(self.config))
            with torch.random.fork_rng(devices=[]):
                fresh = factory.build(*site)
            state = {**dict(fresh.named_parameters(recurse=False)),
                     **dict(fresh.named_buffers(recurse=False))}
            for name, tensor in [*module.named_parameters(recurse=False),
                                 *module.named_buffers(recurse=False)]:
                if state.get(name) is not None:
                    hf_init.copy_(tensor, state[name].to(tensor.device, tensor.dtype))


def layer_placements(placement: str, num_layers: int, mix_post_fraction: float = 0.25) -> list[str]:
    """Each decoder layer's placement: ``mix`` is Mix-LN's ``post`` for the first
    ``floor(fraction * L)`` layers (its code: layer ``i < POST_NUM``) and ``pre`` after."""
    if placement not in PLACEMENTS:
        raise ValueError(f"norm_position must be one of {', '.join(PLACEMENTS)}, got {placement!r}")
    if placement != "mix":
        return [placement] * num_layers
    if isinstance(mix_post_fraction, bool) or not (
            isinstance(mix_post_fraction, (int, float)) and 0 <= mix_post_fraction <= 1):
        raise ValueError(f"mix_post_fraction (the share of Post-LN layers, Mix-LN's alpha) must be "
                         f"in [0, 1], got {mix_post_fraction!r}; Mix-LN uses 0.25")
    post_layers = math.floor(mix_post_fraction * num_layers + 1e-9)  # 0.29 * 100 is 28.99...
    return ["post"] * post_layers + ["pre"] * (num_layers - post_layers)


def dyt_llm_alphas(hidden_size: int) -> tuple[float, float]:
    """DyT's LLaMA alpha initialisation for a model of this width: (attention, other)."""
    for width, attention, other in DYT_LLM_ALPHAS:
        if hidden_size <= width:
            return attention, other
    return DYT_LLM_ALPHAS[-1][1:]


class PlacedDecoderLayer(LlamaDecoderLayer):
    """Hugging Face's Llama decoder layer (its attention and MLP, taken over from ``layer``)
    with its norms where ``placement`` puts them (see the module's docstring)."""

    def __init__(self, layer: LlamaDecoderLayer, config: LlamaConfig, placement: str,
                 factory: "_NormFactory"):
        if placement not in LAYER_SITES:
            raise ValueError(f"a layer's placement is one of {', '.join(LAYER_SITES)}, "
                             f"got {placement!r}")
        with torch.device("meta"):  # the parts are taken over from ``layer``: build nothing
            super().__init__(config, layer.self_attn.layer_idx)
        self.self_attn, self.mlp = layer.self_attn, layer.mlp
        del self.input_layernorm, self.post_attention_layernorm
        self.placement = placement
        for site in LAYER_SITES[placement]:
            setattr(self, site, factory.build(site, placement))
        owned = {"self_attn", "mlp", *LAYER_SITES[placement]}  # anything else: built on meta
        left = [name for name, _ in [*self.named_parameters(), *self.named_buffers()]
                if name.split(".")[0] not in owned]
        if left:
            raise RuntimeError(f"transformers' LlamaDecoderLayer has state this adapter does not "
                               f"take over from the built layer: {', '.join(left)}; update "
                               f"PlacedDecoderLayer for transformers {transformers.__version__}")

    def extra_repr(self) -> str:
        return f"placement={self.placement}"

    def forward(self, hidden_states: torch.Tensor, attention_mask: Optional[torch.Tensor] = None,
                position_ids: Optional[torch.LongTensor] = None, past_key_values=None,
                use_cache: Optional[bool] = False,
                position_embeddings: Optional[tuple[torch.Tensor, torch.Tensor]] = None,
                **kwargs) -> torch.Tensor:
        def attention(x):
            return self.self_attn(hidden_states=x, attention_mask=attention_mask,
                                  position_ids=position_ids, past_key_values=past_key_values,
                                  use_cache=use_cache, position_embeddings=position_embeddings,
                                  **kwargs)[0]

        x = hidden_states
        if self.placement == "post":
            h = self.post_attention_layernorm(x + attention(x))
            return self.post_feedforward_layernorm(h + self.mlp(h))
        if self.placement == "peri":
            h = x + self.post_attention_layernorm(attention(self.input_layernorm(x)))
            return h + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(h)))
        h = x + attention(self.input_layernorm(x))
        return h + self.mlp(self.post_attention_layernorm(h))


class NormedEmbedding(nn.Embedding):
    """Llama's token embedding, then DyT's learnable scalar ``scale`` and Peri-LN's embedding
    ``norm`` (either may be absent). An ``nn.Embedding`` holding the same ``weight``, so the
    state-dict key and a tied head stay Llama's (as Gemma 3's scaled embedding does); inputs
    given as ``inputs_embeds`` bypass it."""

    def __init__(self, embedding: nn.Embedding, scale: Optional[float], norm: Optional[nn.Module]):
        super().__init__(embedding.num_embeddings, embedding.embedding_dim, embedding.padding_idx,
                         _weight=embedding.weight)
        self.weight = embedding.weight  # the parameter itself: ties and optimizers keep it
        self.scale = None if scale is None else nn.Parameter(
            torch.full((1,), scale, device=embedding.weight.device, dtype=embedding.weight.dtype))
        self.norm = norm

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        embeds = super().forward(input_ids)
        if self.scale is not None:
            embeds = embeds * self.scale
        return embeds if self.norm is None else self.norm(embeds)


class _NormFactory:
    """Builds the norm of each site from the run's norm config and the model."""

    def __init__(self, norm_cfg: dict, config: LlamaConfig, options: dict):
        if "name" not in norm_cfg:
            raise ValueError("the norm config needs a name (one of "
                             f"{', '.join(unnorm.available_norms())})")
        self.name = norm_cfg["name"]
        self.hidden = config.hidden_size
        self.options = norm_kwargs(norm_cfg)
        unnorm.norm_layer(self.name, **self.options)  # a wrong name or option fails here, first
        if self.options.get("layout", "token") != "token":
            raise ValueError(f"norm.layout={self.options['layout']!r} pools each sequence's "
                             "statistics over all its positions, later tokens included: a causal "
                             "language model must not see them. Use norm.layout=token (each "
                             "token's own channels; the default)")
        if "eps" in unnorm.option_names(self.name):
            self.options.setdefault("eps", config.rms_norm_eps)
        if self.name == "rms":
            self.options.setdefault("bias", False)  # Llama's RMSNorm: a weight only
        if self.options.get("causal") and self.options.get("positions") is None:
            self.options["positions"] = config.max_position_embeddings  # per-position statistics
        if self.name == "pn_ls" and self.options.get("group_num") is None:
            self.options["group_num"] = config.num_attention_heads
        self.head_dim = config.hidden_size // config.num_attention_heads
        self.qk_name = options["qk_norm"]
        self.qk_options = {}
        if self.qk_name is not None:  # the registry's defaults, and the model's eps
            if self.qk_name not in unnorm.available_norms():
                raise ValueError(f"qk_norm must be null or a registry norm "
                                 f"({', '.join(unnorm.available_norms())}), got {self.qk_name!r}")
            if "eps" in unnorm.option_names(self.qk_name):
                self.qk_options["eps"] = config.rms_norm_eps
            if self.qk_name == "rms":
                self.qk_options["bias"] = False  # Qwen 3's and OLMo 2's: a weight only
        self.dyt_recipe = self.name == "dyt" and options["dyt_llm_recipe"]
        self.prepbn_recipe = self.name == "prepbn" and options["prepbn_llm_recipe"]
        if self.dyt_recipe:
            self.options["bias"] = False
            self.dyt_alphas = dyt_llm_alphas(self.hidden)
        if self.prepbn_recipe:  # both of SLAB's norms take Llama's rms_norm_eps
            self.options.update(start_norm="rms", bias=False, eps=config.rms_norm_eps)

    def build(self, site: str, placement: Optional[str] = None) -> nn.Module:
        """The norm at ``site`` (a layer's site within ``placement``, or ``norm``/
        ``embedding_norm``/``qk_norm``: each head's queries or keys)."""
        if site == "qk_norm":
            norm = unnorm.build_norm(self.qk_name, self.head_dim, **self.qk_options)
            norm._lm_site = (site, placement)
            return norm
        options = dict(self.options)
        if self.dyt_recipe:
            attention, other = self.dyt_alphas
            in_attention = site in ATTENTION_SITES.get(placement, ())
            options["alpha_init"] = attention if in_attention else other
        norm = unnorm.build_norm(self.name, self.hidden, **options)
        if self.prepbn_recipe:  # SLAB's LLaMA RepBN starts at zero
            with torch.no_grad():
                for param in (norm.bn_weight, norm.bn_bias, norm.alpha):
                    param.zero_()
        norm._lm_site = (site, placement)  # UnnormLlamaForCausalLM.initialize_weights
        return norm


def _plain(cfg: Mapping) -> dict:
    return dict(cfg) if isinstance(cfg, dict) else OmegaConf.to_container(cfg, resolve=True)


def _split_options(values: dict) -> tuple[dict, dict]:
    """(the placement options with their defaults, the LlamaConfig keywords)."""
    options = {key: values.pop(key, default) for key, default in LM_OPTIONS.items()}
    for label in _LABELS | _LAYER_OPTIONS:
        values.pop(label, None)
    for alias, field in _ALIASES.items():
        if alias in values:
            if field in values and values[field] != values[alias]:
                raise ValueError(f"model.{alias} ({values[alias]}) and model.{field} "
                                 f"({values[field]}) disagree; set one")
            values[field] = values.pop(alias)
    fields = set(LlamaConfig().to_dict()) | _LLAMA_EXTRA
    unknown = sorted(set(values) - fields)
    if unknown:
        raise ValueError(f"model config key(s) {', '.join(unknown)} are neither LlamaConfig "
                         f"fields nor LM options ({', '.join(LM_OPTIONS)}, "
                         f"{', '.join(_ALIASES)})")
    for flag in ("embedding_norm", "dyt_llm_recipe", "prepbn_llm_recipe"):
        if not isinstance(options[flag], bool):
            raise ValueError(f"{flag} must be true or false, got {options[flag]!r}")
    if options["init"] not in INITS:
        raise ValueError(f"init must be one of {', '.join(INITS)} (Hugging Face's Llama, or "
                         f"Mix-LN's release), got {options['init']!r}")
    if options["final_norm"] not in (None, True, False):
        raise ValueError(f"final_norm must be null (as the placement says), true or false, got "
                         f"{options['final_norm']!r}")
    return options, values


AutoConfig.register(UnnormLlamaConfig.model_type, UnnormLlamaConfig, exist_ok=True)
AutoModelForCausalLM.register(UnnormLlamaConfig, UnnormLlamaForCausalLM, exist_ok=True)
