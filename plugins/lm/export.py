"""A trained language model as a Hugging Face checkpoint (a ``save_pretrained`` folder).

``export_run(run_dir, out)`` rebuilds a run's model from its ``config.yaml`` and ``last.pt``
and writes it with ``save_pretrained``: an ``UnnormLlamaForCausalLM`` (``model_type``
``"unnorm_llama"``) that ``AutoModelForCausalLM.from_pretrained(out)`` loads, with every norm
and its running state, wherever ``plugins.lm`` has been imported (the import registers it).

``stock=True`` writes a stock ``LlamaForCausalLM`` checkpoint (``model_type`` ``"llama"``)
that plain transformers loads without this project. Only a model that is Hugging Face's Llama
can be written so: ``norm=rms`` without a bias, every layer in Pre placement, the final norm,
nothing on the embeddings; the norms' eps becomes ``rms_norm_eps``. Anything else is refused
with every setting that is not stock named (``stock_blockers``).

Each export loads what it wrote back (with ``AutoModelForCausalLM``, or transformers'
``LlamaForCausalLM`` for a stock one) and checks that its eval-mode logits equal the run's
model's on random tokens. The run's tokenizer, when its prepared data is still where the run
found it (checked against the hash the run recorded), is saved beside the weights as a
``PreTrainedTokenizerFast``, and its end-of-text token becomes the config's ``eos_token_id``.
"""
from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Optional, Union

import torch
from omegaconf import OmegaConf
from torch import nn
from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM
from transformers.initialization import no_init_weights

import unnorm
from plugins.runlog import CONFIG_FILE
from plugins.checkpoints import read_checkpoint

from .model import LM_OPTIONS, build_lm, lm_options

CHECKPOINT = "last.pt"
#: config keys that are this project's (``UnnormLlamaConfig``'s), or that name the class
_OWN_KEYS = {"norm", *LM_OPTIONS, "model_type", "architectures", "transformers_version",
             "_name_or_path"}
_CHECK_TOKENS = (2, 16)  # the logits check: 2 random sequences of up to 16 tokens


def stock_blockers(model: nn.Module) -> list[str]:
    """What keeps a ``build_lm`` model from being Hugging Face's ``LlamaForCausalLM``: one
    line per setting, named as the run's option; empty when the model is stock Llama."""
    config = model.config
    if not isinstance(model, LlamaForCausalLM):
        return [f"{type(model).__name__} is not a Llama: build it with plugins.lm.build_lm"]
    norm = dict(getattr(config, "norm", None) or {"name": "rms"})
    options = lm_options(config)
    blockers = []
    if norm["name"] != "rms":
        blockers.append(f"norm={norm['name']}: stock Llama's norms are RMSNorms (norm=rms)")
    elif norm.get("bias"):
        blockers.append("norm.bias=true: Llama's RMSNorm has a weight only (norm.bias=false)")
    decoder = model.model
    placed = {}
    for index, layer in enumerate(decoder.layers):
        placed.setdefault(getattr(layer, "placement", "pre"), []).append(index)
    others = {kind: layers for kind, layers in placed.items() if kind != "pre"}
    if others:
        where = "; ".join(f"layer{'s' if len(layers) > 1 else ''} "
                          f"{', '.join(map(str, layers))} in {kind}"
                          for kind, layers in others.items())
        blockers.append(f"model.norm_position={options['norm_position']} ({where}): stock Llama "
                        "is Pre-LN (model.norm_position=pre)")
    if isinstance(decoder.norm, nn.Identity):
        why = ("model.final_norm=false" if options["final_norm"] is False
               else f"model.final_norm=null: none in {options['norm_position']} placement")
        blockers.append(f"no final norm ({why}): stock Llama has one")
    if type(decoder.embed_tokens) is not nn.Embedding:
        what = [name for name, on in (("model.embedding_norm=true (a norm)",
                                       getattr(decoder.embed_tokens, "norm", None) is not None),
                                      ("DyT's LLaMA recipe (a learnable scale)",
                                       getattr(decoder.embed_tokens, "scale", None) is not None))
                if on]
        blockers.append(f"{' and '.join(what) or type(decoder.embed_tokens).__name__} on the "
                        "token embeddings: stock Llama has none")
    eps = {module.eps for module in model.modules() if isinstance(module, unnorm.ChannelNorm)}
    if len(eps) > 1:
        blockers.append(f"the norms' eps differ ({sorted(eps)}): stock Llama has one rms_norm_eps")
    if not blockers:  # what the options do not say (a converted model's biases, say)
        with torch.device("meta"):
            stock = LlamaForCausalLM(stock_config(model))
        ours, theirs = model.state_dict(), stock.state_dict()
        extra, missing = sorted(set(ours) - set(theirs)), sorted(set(theirs) - set(ours))
        shapes = sorted(k for k in set(ours) & set(theirs) if ours[k].shape != theirs[k].shape)
        for label, keys in (("state stock Llama has no place for", extra),
                            ("stock Llama state this model lacks", missing),
                            ("tensors of another shape than stock Llama's", shapes)):
            if keys:
                blockers.append(f"{label}: {', '.join(keys[:6])}"
                                f"{f' and {len(keys) - 6} more' if len(keys) > 6 else ''}")
    return blockers


def stock_config(model: nn.Module) -> LlamaConfig:
    """The model's ``LlamaConfig`` without this project's keys, ``rms_norm_eps`` the norms'."""
    values = {k: v for k, v in model.config.to_dict().items() if k not in _OWN_KEYS}
    eps = {module.eps for module in model.modules() if isinstance(module, unnorm.ChannelNorm)}
    if len(eps) == 1:
        values["rms_norm_eps"] = float(eps.pop())
    return LlamaConfig(**values)


def as_stock_llama(model: nn.Module) -> LlamaForCausalLM:
    """A ``build_lm`` Pre-RMSNorm model as transformers' own ``LlamaForCausalLM`` (its
    weights copied, its dtype and device); ValueError naming every setting that is not
    stock (``stock_blockers``)."""
    blockers = stock_blockers(model)
    if blockers:
        raise ValueError("not a stock Llama, so no stock checkpoint: " + "; ".join(blockers)
                         + ". Export without --stock (stock=False): the checkpoint then loads "
                         "with AutoModelForCausalLM wherever plugins.lm is imported")
    weight = model.lm_head.weight
    with no_init_weights():  # every weight is copied below
        stock = LlamaForCausalLM(stock_config(model))
    stock.to(device=weight.device, dtype=weight.dtype)
    stock.load_state_dict(model.state_dict(), strict=True)
    stock.generation_config = model.generation_config
    return stock.train(model.training)


def save_hf(model: nn.Module, out: Union[str, Path], stock: bool = False) -> dict:
    """Write ``model`` (a ``build_lm`` model) to ``out`` with ``save_pretrained`` (as stock
    Llama for ``stock=True``, refused unless the model is one), then load it back and check
    its eval-mode logits; returns ``{"out", "model_type", "max_logit_difference"}``."""
    out = Path(out)
    saved = as_stock_llama(model) if stock else model
    saved.save_pretrained(out)
    loader = LlamaForCausalLM if stock else AutoModelForCausalLM
    loaded = loader.from_pretrained(out).to(model.lm_head.weight.device)
    ids = torch.randint(0, model.config.vocab_size, (_CHECK_TOKENS[0],
                        min(_CHECK_TOKENS[1], model.config.max_position_embeddings)),
                        generator=torch.Generator().manual_seed(0)).to(loaded.device)
    was_training = model.training
    with torch.no_grad():
        expected = model.eval()(input_ids=ids).logits.float()
        got = loaded.eval()(input_ids=ids).logits.float()
    model.train(was_training)
    difference = (got - expected).abs().max().item()
    if not torch.allclose(got, expected, rtol=1e-5, atol=1e-5):
        raise RuntimeError(f"{out}: the loaded model's logits differ from the model's by up to "
                           f"{difference:.3g}; the folder is not a faithful copy")
    return {"out": str(out), "model_type": saved.config.model_type,
            "max_logit_difference": difference}


def load_run(run: Union[str, Path], trusted: bool = False):
    """``(model, cfg, checkpoint)`` of a run directory (or its ``last.pt``): the model built
    from the run's ``config.yaml`` (else the config the checkpoint keeps), with the weights
    and norm state of ``last.pt``, in eval mode."""
    run = Path(run)
    path = run / CHECKPOINT if run.is_dir() else run
    if not path.exists():
        raise FileNotFoundError(f"no checkpoint at {path}: pass a run directory "
                                f"(runs/<exp>/<time>) or its {CHECKPOINT}")
    state = read_checkpoint(path, "export", trusted=trusted)
    config_file = path.parent / CONFIG_FILE
    if config_file.exists():
        cfg = OmegaConf.load(config_file)
    elif state.get("config") is not None:
        cfg = OmegaConf.create(state["config"])
    else:
        raise FileNotFoundError(f"no {CONFIG_FILE} beside {path} and no config in it")
    if cfg.get("task") != "language_modelling":
        raise ValueError(f"{path.parent} is a {cfg.get('task')} run; only language-modelling "
                         "runs export to Hugging Face (python scripts/train.py +exp=llama_...)")
    weights = state["model"]
    with torch.random.fork_rng(devices=[]):  # the weights are the checkpoint's
        model = build_lm(cfg.model, cfg.norm,
                         vocab_size=weights["model.embed_tokens.weight"].shape[0])
    model.load_state_dict(weights)
    return model.eval(), cfg, state


def run_tokenizer(cfg, state: dict):
    """The run's tokenizer as a ``PreTrainedTokenizerFast``, or ``(None, why)``: its
    ``tokenizer.json`` in the run's prepared data, checked against the hash the run
    recorded."""
    from tokenizers import Tokenizer
    from transformers import PreTrainedTokenizerFast

    from .data import CORPORA, END_OF_TEXT, prepared_dir

    recorded = ((state.get("data") or {}).get("tokenizer") or {}).get("sha256")
    data = cfg.data
    if data.get("corpus"):
        if data.corpus not in CORPORA:
            return None, f"unknown corpus {data.corpus}"
        root = prepared_dir(Path(str(data.root)), CORPORA[data.corpus].record(),
                            data.tokenizer.vocab_size, data.tokenizer.min_frequency,
                            data.valid_fraction)
    else:
        root = Path(str(data.root))
    path = root / "tokenizer.json"
    if not path.exists():
        return None, f"no {path} (the run's prepared data is not here)"
    tokenizer = Tokenizer.from_file(str(path))
    if hashlib.sha256(tokenizer.to_str().encode("utf-8")).hexdigest() != recorded:
        return None, f"{path} is not the tokenizer the run recorded (its sha256 differs)"
    if tokenizer.token_to_id(END_OF_TEXT) is None:
        return None, f"{path} has no {END_OF_TEXT} token"
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token=END_OF_TEXT), None


def export_run(run: Union[str, Path], out: Optional[Union[str, Path]] = None, *,
               stock: bool = False, tokenizer: bool = True, trusted: bool = False) -> dict:
    """Write a trained run (its directory or ``last.pt``) as a Hugging Face checkpoint at
    ``out`` (default: ``hf/`` in the run directory); ``stock``: as transformers' own
    ``LlamaForCausalLM``, refused with the reasons unless the model is one. Returns
    ``save_hf``'s summary plus ``tokenizer`` (saved, or why not)."""
    model, cfg, state = load_run(run, trusted)
    if stock:
        as_stock_llama(model)  # refused before anything is written
    found, why = run_tokenizer(cfg, state) if tokenizer else (None, "not asked for")
    if found is not None:  # generation stops at the tokenizer's end of text
        for config in (model.config, model.generation_config):
            config.eos_token_id, config.bos_token_id = found.eos_token_id, None
    run = Path(run)
    out = Path(out) if out is not None else (run if run.is_dir() else run.parent) / "hf"
    summary = save_hf(model, out, stock=stock)
    if found is not None:
        found.save_pretrained(out)
    return {**summary, "tokenizer": "saved" if found is not None else f"not saved: {why}",
            "norm": cfg.norm.name, "norm_position": cfg.model.norm_position}
