"""fairseq optimizers ``adamp`` and ``sgdp``: the release's AdamP and SGDP (clovaai/AdamP, the
PyPI package ``adamp``; Heo et al., ICLR 2021), which fairseq 0.12.2 lacks and whose
environment has no timm. Their flags are the release's arguments (``--delta``,
``--wd-ratio``, ``--nesterov``; AdamP's betas and eps spelt as fairseq's adam spells them);
the launcher states every one (``plugins.fairseq.launcher.optimizer_flags``). No ``from
__future__ import annotations``: fairseq's omegaconf 2.0 reads the dataclasses' field types.
"""

import ast
from collections.abc import Collection
from dataclasses import dataclass, field
from typing import Any, List

from adamp import SGDP, AdamP
from fairseq.dataclass import FairseqDataclass
from fairseq.optim import FairseqOptimizer, register_optimizer
from omegaconf import II


def _lr(cfg) -> float:
    return cfg.lr[0] if isinstance(cfg.lr, Collection) else cfg.lr


@dataclass
class AdamPConfig(FairseqDataclass):
    adam_betas: Any = field(default="(0.9, 0.999)", metadata={"help": "betas"})
    adam_eps: float = field(default=1e-8, metadata={"help": "epsilon"})
    weight_decay: float = field(default=0.0, metadata={"help": "weight decay"})
    delta: float = field(default=0.1, metadata={"help": "cosine threshold of scale invariance"})
    wd_ratio: float = field(default=0.1, metadata={"help": "weight decay ratio on projected weights"})
    nesterov: bool = field(default=False, metadata={"help": "Nesterov momentum"})
    lr: List[float] = II("optimization.lr")


@register_optimizer("adamp", dataclass=AdamPConfig)
class FairseqAdamP(FairseqOptimizer):
    def __init__(self, cfg: AdamPConfig, params):
        super().__init__(cfg)
        self._optimizer = AdamP(params, **self.optimizer_config)

    @property
    def optimizer_config(self) -> dict:
        """The release's arguments (fairseq overrides a checkpoint's with these on load)."""
        cfg = self.cfg
        betas = ast.literal_eval(cfg.adam_betas) if isinstance(cfg.adam_betas, str) else cfg.adam_betas
        return {"lr": _lr(cfg), "betas": tuple(betas), "eps": cfg.adam_eps,
                "weight_decay": cfg.weight_decay, "delta": cfg.delta, "wd_ratio": cfg.wd_ratio,
                "nesterov": cfg.nesterov}


@dataclass
class SGDPConfig(FairseqDataclass):
    momentum: float = field(default=0.0, metadata={"help": "momentum"})
    weight_decay: float = field(default=0.0, metadata={"help": "weight decay"})
    nesterov: bool = field(default=False, metadata={"help": "Nesterov momentum"})
    eps: float = field(default=1e-8, metadata={"help": "epsilon"})
    delta: float = field(default=0.1, metadata={"help": "cosine threshold of scale invariance"})
    wd_ratio: float = field(default=0.1, metadata={"help": "weight decay ratio on projected weights"})
    lr: List[float] = II("optimization.lr")


@register_optimizer("sgdp", dataclass=SGDPConfig)
class FairseqSGDP(FairseqOptimizer):
    def __init__(self, cfg: SGDPConfig, params):
        super().__init__(cfg)
        self._optimizer = SGDP(params, **self.optimizer_config)

    @property
    def optimizer_config(self) -> dict:
        """The release's arguments (fairseq overrides a checkpoint's with these on load)."""
        cfg = self.cfg
        return {"lr": _lr(cfg), "momentum": cfg.momentum, "weight_decay": cfg.weight_decay,
                "nesterov": cfg.nesterov, "eps": cfg.eps, "delta": cfg.delta,
                "wd_ratio": cfg.wd_ratio}
