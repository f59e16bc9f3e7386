"""The model options that change a built model's layers, shared by the trainers.

- ``model.weight_standardization``: Weight Standardization (Qiao et al.; the BCN release's
  ``imagenet/models/layers.py``) on the ``nn.Linear``/``nn.Conv2d`` layers these ``fnmatch``
  patterns name (``unnorm.standardize_weights``), with ``model.ws_eps`` and
  ``model.ws_eps_form``. Every task (translation: fairseq's layer names, whose attentions then
  call their projections: ``plugins.fairseq.unnorm_fairseq.model``). A
  pattern reaching the model's embedding or its classifier / predictor head is refused: the
  release pairs each standardised layer with a norm, and those layers have none.
  ``model.ws_eps_form=scaled`` (``ws=nf``) is NF-Nets' Scaled WS instead, with
  ``model.ws_gamma``: the normalizer-free baseline, which standardises the stem (the patch
  embedding) too, as NF-Nets do every convolution; the heads stay plain.
- ``model.class_norm``: SepNorm (tufts-ml/SepNorm): the class token normalised by this
  registry norm, the other tokens by the run's ``norm``, at ``model.class_norm_sites``
  (``all``: every norm the class token passes, as the release replaces "the normalization
  layer"; ``final``: the last norm only, the one the head reads). Models with a class token
  only (T2T-ViT).

A layer standardised in one run and loaded by another (``init_from``, the mmdet backbone
conversion) keeps its function: ``carry_standardization``.
"""
from __future__ import annotations

import fnmatch
from typing import Mapping, Optional, Sequence

import torch
from torch import nn

import unnorm
from unnorm.ws import SCALED, StandardizedWeight, scaled_standardized, standardized

CLASS_NORM_SITES = ("all", "final")
WS_OPTIONS = {"ws_eps": "eps", "ws_eps_form": "eps_form",  # model.<key>: standardize_weights'
              "ws_gamma": "gamma"}


def as_patterns(value) -> list[str]:
    """A pattern option's value (one pattern or a list) as a list."""
    return [value] if isinstance(value, str) else list(value)


def check_model_options(cfg) -> None:
    """Refuse, before anything runs, a layer option the run's task does not have (SepNorm
    needs a class token: classification), and a ``model.class_norm_sites`` that is neither
    ``all`` nor ``final``."""
    model = cfg.model
    class_norm = model.get("class_norm")
    if class_norm is not None and cfg.task != "classification":
        raise ValueError(
            f"model.class_norm={class_norm}: SepNorm normalises a class token on its own, and the "
            f"{cfg.task} model {model.name} has no class token (Swin's detection backbone, the "
            "language model and fairseq's Transformer carry none); drop model.class_norm and give "
            "every token the run's norm (norm=<name>). SepNorm trains T2T-ViT "
            f"(+exp=t2t_vit_14 model.class_norm={class_norm}), or a Hugging Face ViT/BERT "
            "through unnorm.separate_class_norms")
    if class_norm is not None and model.get("class_norm_sites", "all") not in CLASS_NORM_SITES:
        raise ValueError(f"model.class_norm_sites must be all (every norm the class token passes, "
                         f"the release's) or final (the last norm only), got "
                         f"{model.class_norm_sites!r}")


def standardize_layers(model: nn.Module, model_cfg: Mapping, *, embedding: Sequence[str],
                       head: Sequence[str]) -> int:
    """Weight-standardise the layers of the built ``model`` that ``model_cfg``'s
    ``weight_standardization`` names (None: none); ``embedding`` and ``head`` are the module
    name prefixes no pattern may reach. Returns how many layers."""
    value = model_cfg.get("weight_standardization")
    if value is None:
        return 0
    patterns = as_patterns(value)
    layers = [name for name, module in model.named_modules()
              if isinstance(module, (nn.Linear, nn.Conv2d))]
    targets = model_cfg.get("ws_targets")
    example = f", e.g. ws=transformer: {as_patterns(targets)}" if targets else ""
    plain = {"classifier / predictor head": head}
    if model_cfg.get("ws_eps_form") != SCALED:  # NF-Nets standardise the stem as well
        plain["embedding"] = embedding
    for pattern in patterns:
        for part, prefixes in plain.items():
            reached = [name for name in layers if fnmatch.fnmatchcase(name, pattern)
                       and any(name == p or name.startswith(p + ".") for p in prefixes)]
            if reached:
                raise ValueError(
                    f"model.weight_standardization: {pattern!r} matches {', '.join(reached)}, the "
                    f"model's {part}: the release standardises the layers it pairs with a norm, "
                    f"not the embedding or the head. Name the blocks' layers instead{example}")
    options = {option: model_cfg[key] for key, option in WS_OPTIONS.items() if key in model_cfg}
    try:
        return unnorm.standardize_weights(model, include=patterns, **options)
    except ValueError as error:
        raise ValueError(f"model.weight_standardization (model.ws_eps, model.ws_eps_form): "
                         f"{error}") from error


def separate_class_token(model: nn.Module, model_cfg: Mapping,
                         sites: Optional[Mapping[str, Sequence[str]]]) -> int:
    """SepNorm on the built ``model`` as ``model_cfg`` says (``class_norm`` None: nothing);
    ``sites`` maps ``all``/``final`` to the ``fnmatch`` patterns of those norms, None for a
    model without a class token (refused). Returns how many norms."""
    class_norm = model_cfg.get("class_norm")
    if class_norm is None:
        return 0
    name = model_cfg.get("name", type(model).__name__)
    if sites is None:
        raise ValueError(
            f"model.class_norm={class_norm}: {name} has no class token (Swin pools its last map's "
            "tokens by their mean), so SepNorm has nothing to separate; drop model.class_norm and "
            "give every token the run's norm (norm=<name>), or train a model with a class token: "
            f"T2T-ViT (+exp=t2t_vit_14 model.class_norm={class_norm})")
    chosen = model_cfg.get("class_norm_sites", "all")
    try:
        return unnorm.separate_class_norms(model, class_norm, include=list(sites[chosen]))
    except ValueError as error:  # an unknown norm: the error lists the registry's
        raise ValueError(f"model.class_norm: {error}") from error


def standardized_layers(model: nn.Module) -> dict[str, tuple]:
    """Every weight-standardised layer of ``model``: its eps and eps form (and gamma, for
    Scaled WS), by name."""
    return {name: (module.ws_eps, module.ws_form)
            + ((module.ws_gamma,) if module.ws_form == SCALED else ())
            for name, module in model.named_modules() if isinstance(module, StandardizedWeight)}


def standardized_in_run(model_cfg: Mapping, model: nn.Module,
                        weights: Mapping) -> dict[str, tuple]:
    """The layers of ``model`` (named as in the run) that a run of ``model_cfg`` standardised,
    among those whose weight ``weights`` holds, with that run's eps and eps form
    (``standardized_layers``' form)."""
    value = model_cfg.get("weight_standardization")
    if value is None:
        return {}
    form = (model_cfg.get("ws_eps", StandardizedWeight.ws_eps),
            model_cfg.get("ws_eps_form", StandardizedWeight.ws_form))
    if form[1] == SCALED:
        form += (model_cfg.get("ws_gamma") or 1.0,)
    return {name: form for name, module in model.named_modules()
            if isinstance(module, (nn.Linear, nn.Conv2d)) and f"{name}.weight" in weights
            and any(fnmatch.fnmatchcase(name, p) for p in as_patterns(value))}


@torch.no_grad()
def carry_standardization(weights: dict, source: Mapping[str, tuple], target: Mapping[str, tuple],
                          origin: str) -> dict:
    """``weights`` (a state dict in the loading model's names) of a model whose layers
    ``source`` standardised, made to compute the same in a model that standardises
    ``target`` (both ``standardized_layers``' form, in the loading model's names): a layer
    standardised in both keeps its raw weight (the same eps and form, or refused), one
    standardised only in the source gets its standardised weight (a plain layer then computes
    what it computed; a Scaled WS layer's gain goes into it). A layer standardised only in the loading model is refused: its plain
    weight, standardised there, would compute another function. ``origin`` names the weights
    in errors. Returns ``weights``, changed in place."""
    for name in sorted(set(target) - set(source)):
        if f"{name}.weight" in weights:
            raise ValueError(
                f"{origin}: {name} was a plain layer there and this run standardises its weight "
                "(model.weight_standardization), which would change what it computes; "
                "standardise the same layers in both runs, or none")
    for name, form in source.items():
        key = f"{name}.weight"
        if key not in weights:
            continue
        if name not in target and form[1] == SCALED:
            eps, _, gamma = form
            weights[key] = scaled_standardized(weights[key], weights.pop(f"{name}.gain"), gamma,
                                               eps)
        elif name not in target:
            weights[key] = standardized(weights[key], *form)
        elif target[name] != form:
            raise ValueError(f"{origin}: {name} was standardised with eps, form {form} there and "
                             f"is {target[name]} here; set model.ws_eps, model.ws_eps_form and "
                             "model.ws_gamma as that run did")
    return weights
