"""fairseq flags for the options of ``unnorm``'s norms and for training through them, shared
by the model plugin and ``plugins.fairseq.train`` (fairseq's Python 3.10 environment) and the
launcher (the main one); it imports neither framework.

Every option of ``unnorm.build_norm`` has one flag, named as in the UN release
(``--un-win``/``--un-warmup`` there): ``--un-window``, ``--un-warmup``, ``--un-momentum``, ...
A flag left unset gives the norm its own default.

``sam=`` (``configs/sam/*.yaml``) is ``--sam true`` and a flag per option of
``plugins.sam.SharpnessAware`` (``--sam-rho``, ``--sam-only-norm``, ...); ``train_only=`` is
``--train-only``. ``plugins.fairseq.train`` applies them and prints what it trains as one
``TRAINED`` line of its log, which the launcher reads into ``result.json``.
"""
from __future__ import annotations

import json
import re
from typing import Any, Mapping, Optional


def boolean(text: str) -> bool:
    """argparse type of a boolean flag value (``--un-outlier-filtration false``)."""
    value = str(text).lower()
    if value not in ("true", "false", "1", "0", "yes", "no"):
        raise ValueError(f"expected true or false, got {text!r}")
    return value in ("true", "1", "yes")


# unnorm option -> (flag, argparse type)
OPTIONS = {
    "window_size": ("--un-window", int),
    "warmup_iters": ("--un-warmup", int),
    "momentum": ("--un-momentum", float),
    "momentum_bwd": ("--un-momentum-bwd", float),
    "eps": ("--un-eps", float),
    "outlier_filtration": ("--un-outlier-filtration", boolean),
    "outlier_threshold": ("--un-outlier-threshold", float),
    "outlier_var_per_channel": ("--un-outlier-var-per-channel", boolean),
    "fwd_gm": ("--un-fwd-gm", boolean),
    "bwd_am": ("--un-bwd-am", boolean),
    "bwd_ema": ("--un-bwd-ema", boolean),
    "grad_compensation": ("--un-grad-compensation", boolean),
    "compensation_start": ("--un-compensation-start", int),
    "group_num": ("--un-group-num", int),
    "padded_in_backward": ("--un-padded-in-backward", boolean),
    "alpha_init": ("--un-alpha-init", float),
    "decay_iters": ("--un-decay-iters", int),
    "r0": ("--un-r0", float),
    "sync_stats": ("--un-sync-stats", boolean),
    "bias": ("--un-bias", boolean),
    "start_norm": ("--un-start-norm", str),
    "groups": ("--un-groups", int),
    "group_eps": ("--un-group-eps", float),
    "estimate": ("--un-estimate", boolean),
    "apply_act": ("--un-apply-act", boolean),
    "unbiased_running_var": ("--un-unbiased-running-var", boolean),
}


#: unnorm options fairseq's layers cannot honour: refused when set, otherwise left out.
#: ``causal`` needs batch-first (B, T, C) input; fairseq's layers pass time-first (T, B, C)
#: and its encoder is not causal
NOT_IN_FAIRSEQ = {"causal": "the causal option of BN/PRepBN needs batch-first (B, T, C) input, "
                            "and fairseq's layers pass time-first (T, B, C) (its encoder is not "
                            "causal either); use it in the language-modelling decoder "
                            "(+exp=llama_71m_<norm>)",
                 "positions": "positions sizes the per-position statistics of causal BN/PRepBN, "
                              "which translation does not offer",
                 "layout": "layout='image' pools each example's positions of batch-first input "
                           "(B, ..., C), and fairseq's layers pass time-first (T, B, C); "
                           "translation takes the per-token statistics (layout='token')"}
#: the value of a ``NOT_IN_FAIRSEQ`` option that asks for nothing fairseq lacks (else: falsy)
FAIRSEQ_KEEPS = {"layout": "token"}


def _flag_value(value: Any) -> str:
    """How a flag's value is written (booleans as ``true``/``false``)."""
    return str(value).lower() if isinstance(value, bool) else str(value)


def dest(option: str) -> str:
    """The attribute argparse stores ``option``'s flag under (``un_window``)."""
    return OPTIONS[option][0][2:].replace("-", "_")


def norm_flags(name: str, options: dict) -> list[str]:
    """``--norm-type NAME`` and a flag per option that is set (None = the norm's default)."""
    unknown = sorted(set(options) - set(OPTIONS) - set(NOT_IN_FAIRSEQ))
    if unknown:
        raise ValueError(f"no fairseq flag for norm option(s) {', '.join(unknown)}")
    for option, why in NOT_IN_FAIRSEQ.items():
        if options.get(option) and options[option] != FAIRSEQ_KEEPS.get(option):
            raise ValueError(f"norm.{option}={options[option]} is not available in translation: {why}")
    flags = ["--norm-type", name]
    for option, value in options.items():
        if value is not None and option not in NOT_IN_FAIRSEQ:
            flags += [OPTIONS[option][0], _flag_value(value)]
    return flags


#: ``plugins.sam.SharpnessAware``'s options (``configs/sam/*.yaml`` but ``name``) -> (flag,
#: argparse type); an unset one takes SharpnessAware's default
SAM_OPTIONS = {
    "rho": ("--sam-rho", float),
    "adaptive": ("--sam-adaptive", boolean),
    "elementwise": ("--sam-elementwise", boolean),
    "only_norm": ("--sam-only-norm", boolean),
    "eta": ("--sam-eta", float),
    "normalize_bias": ("--sam-normalize-bias", boolean),
}


def sam_flags(chosen: Optional[Mapping]) -> list[str]:
    """``sam=``'s entry as flags: ``--sam true --sam-rho 0.5 --sam-only-norm true ...``;
    none for ``sam=none``."""
    if not chosen or chosen.get("name", "none") == "none":
        return []
    unknown = sorted(set(chosen) - set(SAM_OPTIONS) - {"name"})
    if unknown:
        raise ValueError(f"no fairseq flag for sam option(s) {', '.join(unknown)}")
    flags = ["--sam", "true"]
    for option, value in chosen.items():
        if option != "name" and value is not None:
            flags += [SAM_OPTIONS[option][0], _flag_value(value)]
    return flags


def sam_entry(args) -> Optional[dict]:
    """The ``sam`` entry (``name`` and the options that are set) the parsed flags ask for,
    as ``plugins.sam.configured`` takes it; None without ``--sam true``."""
    if not getattr(args, "sam", False):
        return None
    options = {option: getattr(args, flag[2:].replace("-", "_"), None)
               for option, (flag, _) in SAM_OPTIONS.items()}
    if options["rho"] is None:
        raise ValueError("--sam true needs --sam-rho (the radius of the perturbation; "
                         "configs/sam/*.yaml give the recipes' values)")
    return {"name": "sam", **{key: value for key, value in options.items() if value is not None}}


def train_only_flags(train_only: str) -> list[str]:
    """``--train-only norm|norm+head``; none for ``all``."""
    return [] if train_only == "all" else ["--train-only", train_only]


#: the entry of fairseq's end-of-epoch ``train`` statistics (logged as ``train_updates``) that
#: holds ``--record-updates``' record of the epoch (``plugins.optim.UpdateRecord``)
UPDATES = "updates"
#: what plugins.fairseq.train prints of what it trains (``plugins.sam.trained_parameters``)
TRAINED = "unnorm trained parameters: "
_TRAINED_LINE = re.compile(re.escape(TRAINED) + r"(\{.*\})\s*$", re.MULTILINE)


def trained_line(record: dict) -> str:
    return TRAINED + json.dumps(record, sort_keys=True)


def read_trained(log: str) -> dict:
    """The last ``TRAINED`` record of a training log (empty when it has none)."""
    found = _TRAINED_LINE.findall(log)
    return json.loads(found[-1]) if found else {}
