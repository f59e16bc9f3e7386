"""Norms at test time: a trained model's norm statistics re-estimated on the test stream
(docs/test_time.md).

``unnorm.test_time(model, mode, **options)`` makes every unnorm norm with running statistics
normalise by statistics of the mode's choosing, in train and eval mode alike, until
``close()``; the model's own buffers, parameters and modules are never written. The modes:

- ``source``: the running statistics as trained.
- ``tbn``: the test batch's own statistics (Nado et al. 2020; Schneider et al. 2020), as a
  training call computes them (variance biased), committing nothing.
- ``alpha``: ``alpha * test + (1 - alpha) * source`` per statistic (You, Li and Zhao 2021,
  arXiv:2110.04065), the test estimate the batch's alone in the running buffer's convention
  (BN: variance unbiased); ``alpha`` 0.1, as devavratTomar/unmixtns
  ``tta_experiments/methods/bn.py`` ``AlphaBatchNorm`` (lines 54-79) with ``conf.py``'s
  ``BN.ALPHA`` (line 108).
- ``ema``: a copy of the running statistics that each test batch moves by the norm's own
  training update (its ``momentum``), then normalises by: the release's ``EMABatchNorm``
  (``bn.py`` lines 82-98: a train-mode forward, then an eval-mode one).
- ``unmix``: UnMix-TNS (Tomar et al., ICLR 2024), as ``tta_experiments/unmixtns.py``
  (commit 8e12b9f): K components (16, ``conf.py`` line 253) started from the source
  statistics with noise (lines 43-54), each example's instance statistics mixed with them by
  the softmax of their means' cosine similarity at temperature 0.07 (lines 78-100), the
  components moved with momentum ``1 - (1 - m) ** (B / batch_size_max)`` (lines 158-161:
  m torch's BatchNorm momentum, ``1 - momentum`` here; ``batch_size_max`` 64, ``conf.py``
  line 254), B each batch's examples.

What each mode estimates depends on what the norm keeps (``GuardedNorm.statistic_form``): a
mean and a variance (BN, PRepBN's RepBN, BCN's BN part), a second moment about 0 (UN, MABN,
PN: E[x^2], which they divide by without centring), or a variance alone (EvoNorm-B0). Batch
statistics pool every valid position of the batch; unmix's instance statistics pool each
example's positions: input is batch-first, ``(B, N, C)`` tokens or ``(B, H, W, C)`` maps.
"""
from __future__ import annotations

import copy
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from .base import (ChannelNorm, GuardedNorm, channel_sum_sq, sequence_kind, upcast,
                   zero_padding)
from .simple import batch_moments

#: each mode's options and their defaults (the releases')
MODES = {
    "source": {},
    "tbn": {},
    "alpha": {"alpha": 0.1},
    "ema": {},
    "unmix": {"components": 16, "temperature": 0.07, "batch_size_max": 64, "seed": 0,
              "one_position": "source"},
}
#: what unmix does with input of one position per example, whose instance variance is 0:
#: ``source`` normalises it by the source statistics, as the release's ``UnMixTNS1d`` does
#: (``unmixtns.py`` lines 126-139); ``refuse`` raises
UNMIX_ONE_POSITION = ("source", "refuse")
#: the release's share of the source variance given to the spread of the components' means
#: (``unmixtns.py`` line 44, ``coeff``)
UNMIX_SPREAD = 0.5


def test_time(model: nn.Module, mode: str, **options) -> "AdaptedNorms":
    """Adapt the norms of ``model`` to the test stream by ``mode`` (``MODES``); returns the
    ``AdaptedNorms`` in force, a context manager that restores the model on exit."""
    return AdaptedNorms(model, mode, **options)


test_time.__test__ = False  # a library function, not a test (pytest collects test_*)


class AdaptedNorms:
    """The adapted norms of one model: ``norms`` (module name -> norm), ``kept`` (module name
    -> why a norm-like module is left as trained). The adaptation's statistics live here, not
    in the model: ``reset()`` returns them to the start (unmix's components drawn again from
    ``seed``), ``fixed_statistics()``/``fixed_copy()`` give them to a model for folding where
    they are fixed, ``rejected()`` counts the batches whose statistics were not finite (they
    leave the statistics as they were), and ``close()`` (or leaving the ``with`` block)
    gives every norm back its own forward."""

    def __init__(self, model: nn.Module, mode: str, **options):
        if mode not in MODES:
            raise ValueError(f"mode must be one of {', '.join(MODES)}, got {mode!r}")
        unknown = sorted(set(options) - set(MODES[mode]))
        if unknown:
            raise ValueError(f"mode {mode!r} takes no option(s) {', '.join(unknown)}; its options: "
                             f"{', '.join(MODES[mode]) or 'none'}")
        self.mode, self.options = mode, {**MODES[mode], **options}
        _check_options(self.options)
        _refuse(model)
        self.model = model
        self.norms, self.kept = {}, {}
        for name, module in model.named_modules():
            if isinstance(module, GuardedNorm) and module.eval_statistics:
                self.norms[name] = module
            elif isinstance(module, GuardedNorm):
                self.kept[name] = ("evaluation reads no statistic (eval_statistics is empty: "
                                   "an affine, as EvoNorm-B0 with apply_act=False)")
            elif isinstance(module, nn.modules.batchnorm._NormBase) and module.track_running_stats:
                self.kept[name] = (f"torch's {type(module).__name__}, not an unnorm norm: adapt it "
                                   "with its own tools, or build the model with unnorm's bn")
        if not self.norms:
            raise ValueError("the model has no unnorm norm with running statistics (bn, mabn, pn, "
                             "pn_ls, un, prepbn, bcn, evonorm_b0): nothing to adapt; swap them in "
                             "first (unnorm.swap_norms(model, 'bn'))")
        for name, norm in self.norms.items():
            if "_normalize" in norm.__dict__:
                raise RuntimeError(f"{name} is already adapted by another unnorm.test_time: close "
                                   "that one first")
        self._adaptations = [_Adaptation(self, norm) for norm in self.norms.values()]
        self.reset()
        for adaptation in self._adaptations:
            adaptation.install()
        self.closed = False

    def reset(self) -> None:
        """Return the adapted statistics to their start (unmix: the components drawn again
        from ``seed``, so a reset stream repeats)."""
        generator = torch.Generator().manual_seed(self.options.get("seed", 0))
        for adaptation in self._adaptations:
            adaptation.reset(generator)

    def state(self) -> dict[str, dict[str, torch.Tensor]]:
        """Per norm, what the adaptation keeps now: unmix's components (``means``, ``vars``,
        (K, C)), alpha's latest mix, ema's running copy, the source's statistics; tbn keeps
        nothing."""
        return {name: {key: value.clone() for key, value in a.kept_state().items()}
                for name, a in zip(self.norms, self._adaptations)}

    def rejected(self) -> dict[str, int]:
        """Per norm, the batches whose statistics were not finite (or had no valid row): they
        left the adapted statistics as they were."""
        return {name: int(a.num_rejected) for name, a in zip(self.norms, self._adaptations)}

    def at_source(self) -> dict[str, int]:
        """Per norm, unmix's calls whose input had one position per example and was normalised
        by the source statistics (``one_position='source'``); only the norms with any."""
        return {name: a.num_at_source for name, a in zip(self.norms, self._adaptations)
                if a.num_at_source}

    def fixed_statistics(self) -> dict[str, torch.Tensor]:
        """The adapted statistics as state-dict entries (``<norm>.running_var``, ...), where
        they are fixed: ``source``; ``alpha``, the latest accepted batch's mix; ``ema``, now.
        ``tbn`` and ``unmix`` normalise each batch (unmix: each example) by its own statistics:
        there is nothing fixed to fold."""
        if self.mode in ("tbn", "unmix"):
            raise RuntimeError(f"mode {self.mode!r} normalises each batch by statistics of that "
                               "batch: no fixed statistic to fold; use 'ema' or 'alpha', or keep "
                               "the adaptation running")
        statistics = {}
        for name, adaptation in zip(self.norms, self._adaptations):
            if self.mode == "alpha" and not bool(adaptation.seen):
                raise RuntimeError(f"{name} has seen no accepted test batch: alpha's test estimate "
                                   "is the latest batch's; run one first")
            prefix = f"{name}." if name else ""
            statistics.update({prefix + stat: value.clone()
                               for stat, value in adaptation.fixed().items()})
        return statistics

    def fixed_copy(self) -> nn.Module:
        """A copy of the model, with its own forwards, whose norms hold ``fixed_statistics()``:
        its eval is each norm's own (an offline norm's, an affine that folds:
        ``unnorm.fold_norms``)."""
        statistics = self.fixed_statistics()
        installed = [] if self.closed else self._adaptations
        for adaptation in installed:
            adaptation.uninstall()
        try:
            frozen = copy.deepcopy(self.model)
        finally:
            for adaptation in installed:
                adaptation.install()
        frozen.load_state_dict(statistics, strict=False)
        return frozen

    def close(self) -> None:
        """Give every norm back its own forward; the model is as it was before."""
        if not self.closed:
            for adaptation in self._adaptations:
                adaptation.uninstall()
            self.closed = True

    def __enter__(self) -> "AdaptedNorms":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _check_options(options: dict) -> None:
    alpha = options.get("alpha", 0.0)
    if isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or not 0.0 <= alpha <= 1.0:
        raise ValueError(f"alpha (the test batch's weight) must be in [0, 1], got {alpha!r}; the "
                         "release's is 0.1")
    for name in ("components", "batch_size_max"):
        value = options.get(name, 1)
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be a positive int, got {value!r}")
    temperature = options.get("temperature", 1.0)
    if isinstance(temperature, bool) or not isinstance(temperature, (int, float)) or not temperature > 0:
        raise ValueError(f"temperature must be a positive number, got {temperature!r}; the "
                         "release's is 0.07")
    if not isinstance(options.get("seed", 0), int):
        raise ValueError(f"seed must be an int, got {options['seed']!r}")
    if options.get("one_position", "source") not in UNMIX_ONE_POSITION:
        raise ValueError(f"one_position must be one of {', '.join(UNMIX_ONE_POSITION)}, got "
                         f"{options['one_position']!r}; the release's UnMixTNS1d is 'source'")


def _refuse(model: nn.Module) -> None:
    """Refuse a causal model (its norms would see later tokens) and fairseq's (time-first)."""
    for name, module in model.named_modules():
        if isinstance(module, ChannelNorm) and getattr(module, "causal", False):
            raise ValueError(f"{name or type(model).__name__} is a causal norm (causal=True): "
                             "test batch statistics pool every position, so each token would see "
                             "later ones; evaluate it with its trained per-position statistics")
    found = sequence_kind(model)
    if found is None:
        return
    where, kind = found
    if kind == "causal":
        raise ValueError(f"{where} attends causally (a language model): test batch statistics "
                         "pool every position, so each token would see later ones; evaluate it "
                         "with its trained statistics")
    raise ValueError(f"{where} is fairseq's: fairseq passes time-first (T, B, C) tokens, whose "
                     "batch and instance statistics test-time adaptation would take over the "
                     "wrong axes; evaluate it with its trained statistics")


class _Adaptation:
    """One norm's adapted statistics and its installed forward."""

    def __init__(self, owner: AdaptedNorms, norm: GuardedNorm):
        self.owner, self.norm, self.form = owner, norm, norm.statistic_form
        self.names = norm.eval_statistics
        self.source = {name: upcast(getattr(norm, name)).detach().clone() for name in self.names}
        self.examples: Optional[int] = None  # of the call under way; None: one position each
        self.shape: tuple = ()
        self.num_rejected = torch.zeros((), dtype=torch.long, device=self.source[self.names[0]].device)
        self.num_at_source = 0  # unmix's calls with one position per example

    # --- installing -------------------------------------------------------------------------

    def install(self) -> None:
        """Route the norm's calls here: its forward (its own checks, then ``_normalize``) with
        the batch's example count noted, and its ``_normalize``."""
        norm, own_forward = self.norm, type(self.norm).forward.__get__(self.norm)

        def forward(x: torch.Tensor, pad_mask: Optional[torch.Tensor] = None) -> torch.Tensor:
            self.examples = x.shape[0] if x.shape[:-1].numel() > x.shape[0] else None
            self.shape = tuple(x.shape)
            return own_forward(x, pad_mask)
        norm.forward, norm._normalize = forward, self.normalize

    def uninstall(self) -> None:
        del self.norm.forward, self.norm._normalize

    # --- state ------------------------------------------------------------------------------

    def reset(self, generator: torch.Generator) -> None:
        self.num_rejected.zero_()
        mode = self.owner.mode
        if mode in ("alpha", "ema"):
            self.current = {name: value.clone() for name, value in self.source.items()}
            self.seen = torch.zeros((), dtype=torch.bool, device=self.num_rejected.device)
        if mode == "unmix":
            self.means, self.vars = self._components(generator)

    def _source_moments(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The source as a mean and a variance: a second moment is the variance about 0, and
        B0, which keeps no mean, is taken to be centred at 0 (docs/test_time.md)."""
        if self.form == "moments":
            return self.source[self.names[0]], self.source[self.names[1]]
        variance = self.source[self.names[0]]
        return torch.zeros_like(variance), variance

    def _components(self, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
        """UnMix-TNS's K components (``unmixtns.py`` lines 38-54): the source mean plus noise
        of variance ``coeff K / (K - 1)`` times the source variance, each variance ``1 - coeff``
        times it, so that the mixture starts at the source statistics (coeff 0 at K = 1)."""
        k = self.owner.options["components"]
        mean, var = self._source_moments()
        coeff = UNMIX_SPREAD if k > 1 else 0.0
        noise = torch.randn((k, mean.shape[0]), generator=generator, dtype=mean.dtype).to(mean.device)
        spread = (coeff * k / (k - 1)) ** 0.5 if k > 1 else 0.0
        return mean + spread * var.sqrt() * noise, (1 - coeff) * var.repeat(k, 1)

    def kept_state(self) -> dict[str, torch.Tensor]:
        mode = self.owner.mode
        if mode == "unmix":
            return {"means": self.means, "vars": self.vars}
        return {} if mode == "tbn" else self.fixed()

    def fixed(self) -> dict[str, torch.Tensor]:
        return self.source if self.owner.mode == "source" else self.current

    # --- a call -----------------------------------------------------------------------------

    def normalize(self, rows: torch.Tensor, valid: Optional[torch.Tensor]) -> torch.Tensor:
        rows = self.norm._statistic_input(upcast(rows))
        mode = self.owner.mode
        if mode == "source":
            statistics = self.source
        elif mode == "tbn":
            statistics, _ = self._batch(rows, valid, running=False)
        elif mode == "unmix":
            statistics = self._unmix(rows, valid)
        else:
            statistics = self._alpha_or_ema(rows, valid)
        return self.norm._evaluate(rows, valid, statistics)

    def _batch(self, rows, valid, running: bool):
        """The batch's statistics over its valid rows, and their count: as a training call
        takes them (the variance biased), or ``running`` in the running buffer's convention
        (BN: unbiased, as torch's; B0: its ``unbiased_running_var``)."""
        if self.form == "second_moment":
            total, count = channel_sum_sq(rows, valid)
            return {self.names[0]: total / count.clamp_min(1)}, count
        _, mean, var, count = batch_moments(rows, valid)
        unbiased = self.form == "moments" or self.norm.unbiased_running_var
        if running and unbiased:
            var = var * count / (count - 1).clamp_min(1)
        if self.form == "variance":
            return {self.names[0]: var}, count
        return dict(zip(self.names, (mean, var))), count

    def _alpha_or_ema(self, rows, valid) -> dict[str, torch.Tensor]:
        """alpha: the mix of this batch's estimate with the source; ema: the running copy moved
        by this batch with the norm's own update. A batch without finite statistics leaves
        what is kept as it was (its output is what its statistics give)."""
        with torch.no_grad():
            if self.owner.mode == "alpha":
                test, count = self._batch(rows, valid, running=True)
                alpha = self.owner.options["alpha"]
                new = {name: alpha * test[name] + (1 - alpha) * self.source[name]
                       for name in self.names}
            elif self.form == "second_moment":
                test, count = self._batch(rows, valid, running=False)
                momentum, name = self.norm.momentum, self.names[0]
                new = {name: momentum * self.current[name] + (1 - momentum) * test[name]}
            else:  # the norm's own running update (BN's unbiased EMA, EstBN's, B0's)
                _, mean, var, count = batch_moments(rows, valid)
                new = self.norm._running_update(self.current, mean, var, count)
            ok = (count > 0).all() & torch.stack([torch.isfinite(v).all() for v in new.values()]).all()
            self._keep(ok)
            self.current = {name: torch.where(ok, value, self.current[name]).to(self.current[name].dtype)
                            for name, value in new.items()}
        return new

    def _keep(self, ok: torch.Tensor) -> None:
        self.num_rejected.add_((~ok).long())
        self.seen = self.seen | ok

    def _unmix(self, rows, valid) -> dict[str, torch.Tensor]:
        """``UnMixTNS2d.forward`` (``unmixtns.py`` lines 77-122) on batch-first rows, its
        statistics per example (``(B, C)``, broadcast to the example's rows)."""
        if self.examples is None:
            if self.owner.options["one_position"] == "source":  # UnMixTNS1d
                self.num_at_source += 1
                return self.source
            raise ValueError(f"{type(self.norm).__name__}: unmix takes instance statistics over "
                             "each example's positions and needs batch-first input with more "
                             "than one position, (B, N, C) tokens or (B, H, W, C) maps; got "
                             f"{self.shape} (one position's variance is 0). Use tbn, alpha or "
                             "ema for such input, or one_position='source' (the release's "
                             "UnMixTNS1d)")
        examples, temperature = self.examples, self.owner.options["temperature"]
        inst_mean, inst_var, count = instance_moments(rows, valid, examples)
        old_means, old_vars = self.means.to(rows.dtype), self.vars.to(rows.dtype)  # float64 input
        with torch.no_grad():
            sim = F.normalize(inst_mean, dim=1) @ F.normalize(old_means, dim=1).T  # (B, K)
            probs = torch.softmax(sim / temperature, dim=1).unsqueeze(-1)  # (B, K, 1)
        mean_mat = (1 - probs) * old_means + probs * inst_mean.unsqueeze(1)  # (B, K, C)
        var_mat = (1 - probs) * old_vars + probs * inst_var.unsqueeze(1)
        with torch.no_grad():
            momentum = 1 - self.norm.momentum ** (examples / self.owner.options["batch_size_max"])
            means = old_means + momentum * (probs * (inst_mean.unsqueeze(1) - old_means)).mean(0)
            variances = old_vars + momentum * (probs * (inst_var.unsqueeze(1) - old_vars)).mean(0)
            ok = ((count > 0).all() & torch.isfinite(means).all()
                  & torch.isfinite(variances).all())
            self.num_rejected.add_((~ok).long())
            self.means = torch.where(ok, means, old_means).to(self.means.dtype)
            self.vars = torch.where(ok, variances, old_vars).to(self.vars.dtype)
        if self.form == "second_moment":  # the mixture's E[x^2], about 0
            per_example = {self.names[0]: (var_mat + mean_mat.square()).mean(1)}
        else:
            mean = mean_mat.mean(1)
            var = var_mat.mean(1) + mean_mat.square().mean(1) - mean.square()
            per_example = (dict(zip(self.names, (mean, var))) if self.form == "moments"
                           else {self.names[0]: var})
        return {name: value.unsqueeze(1).expand(examples, rows.shape[0] // examples, -1)
                .reshape(rows.shape) for name, value in per_example.items()}


def instance_moments(rows: torch.Tensor, valid: Optional[torch.Tensor], examples: int):
    """Each example's per-channel mean and biased variance over its valid positions, ``(B,
    C)``, and its count of them ``(B, 1)``; ``rows`` are ``examples`` batch-first examples of
    equal length. Differentiable, as the release's."""
    seqs = rows.reshape(examples, -1, rows.shape[-1])
    if valid is None:
        return seqs.mean(1), seqs.var(1, unbiased=False), torch.full(
            (examples, 1), float(seqs.shape[1]), device=rows.device)
    weight = valid.reshape(examples, -1, 1).to(rows.dtype)
    seqs = zero_padding(rows, valid).reshape(seqs.shape)
    count = weight.sum(1)
    mean = seqs.sum(1) / count.clamp_min(1)
    var = ((seqs - mean.unsqueeze(1)).square() * weight).sum(1) / count.clamp_min(1)
    return mean, var, count
