"""fairseq flags for the options of ``unnorm``'s norms, shared by the model plugin (fairseq's
Python 3.10 environment) and the launcher (the main one); it imports neither framework.

Every option of ``unnorm.build_norm`` has one flag, named as in the UN release
(``--un-win``/``--un-warmup`` there): ``--un-window``, ``--un-warmup``, ``--un-momentum``, ...
A flag left unset gives the norm its own default.
"""
from __future__ import annotations


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
}


#: unnorm options fairseq's layers cannot honour: refused when set, otherwise left out.
#: ``causal`` needs batch-first (B, T, C) input; fairseq's layers pass time-first (T, B, C)
#: and its encoder is not causal
NOT_IN_FAIRSEQ = {"causal": "the causal option of BN/PRepBN needs batch-first (B, T, C) input, "
                            "and fairseq's layers pass time-first (T, B, C) (its encoder is not "
                            "causal either); use it in the language-modelling decoder "
                            "(+exp=llama_71m_<norm>)",
                 "positions": "positions sizes the per-position statistics of causal BN/PRepBN, "
                              "which translation does not offer"}


def dest(option: str) -> str:
    """The attribute argparse stores ``option``'s flag under (``un_window``)."""
    return OPTIONS[option][0][2:].replace("-", "_")


def norm_flags(name: str, options: dict) -> list[str]:
    """``--norm-type NAME`` and a flag per option that is set (None = the norm's default)."""
    unknown = sorted(set(options) - set(OPTIONS) - set(NOT_IN_FAIRSEQ))
    if unknown:
        raise ValueError(f"no fairseq flag for norm option(s) {', '.join(unknown)}")
    for option, why in NOT_IN_FAIRSEQ.items():
        if options.get(option):
            raise ValueError(f"norm.{option}={options[option]} is not available in translation: {why}")
    flags = ["--norm-type", name]
    for option, value in options.items():
        if value is not None and option not in NOT_IN_FAIRSEQ:
            flags += [OPTIONS[option][0], str(value).lower() if isinstance(value, bool) else str(value)]
    return flags
