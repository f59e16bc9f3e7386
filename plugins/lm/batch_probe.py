"""Which positions and channels make the batch statistics of a causal language model.

A batch-statistics norm in training mode standardises by the statistics of the batch it sees;
in eval mode by its running statistics. When a few positions or channels carry most of the
pooled second moment (the UN paper's "extreme outliers"), the batch's statistic is theirs and
its running EMA is noisy; in training an outsized row's own weight in the batch statistic bounds
its standardised value (by sqrt(rows - 1)), while in eval mode it is divided by a running scale
that may never have seen such a row. ``probe_run`` measures, for one trained run:

- the per-position next-token loss in eval mode (running statistics) and in training mode (a
  copy: batch statistics, which see the future unless the norm is causal), and the windows
  eval mode scores worst (a mean carried by a few windows is a rare-input failure);
- for every norm of the model (by module path; LN too, so runs compare), on the inputs the
  training-mode copy's forward gives it: each position's and each channel's share of the
  pooled centred second moment, and for a norm with running statistics the running variance
  (and mean) against the batch's, per channel.

A causal norm (``norm.causal=true``) standardises position t by the positions ``<= t`` only,
so no single pooled statistic is the one it uses; the pooled shares still say which positions
would dominate a pooled statistic (what non-causal BN uses), and its per-position running
statistics are also compared with each prefix's (``running.per_position``).

Everything runs on copies or in eval mode: a training-mode forward commits the norms' running
state, so the model passed in is left as it was (tested).
"""
from __future__ import annotations

import math
from contextlib import contextmanager
from typing import Iterator, Optional

import torch
from torch import nn

import unnorm

from .leak import training_copy
from .trainer import next_token_loss

#: the quantiles reported for a per-channel ratio
QUANTILES = {"min": 0.0, "p05": 0.05, "median": 0.5, "p95": 0.95, "max": 1.0}
#: the windows eval mode scores worst, reported one by one
WORST = 5
#: the buffers that are a running second moment, centred or not
VARIANCE_BUFFERS = ("running_var", "running_phi")


def norm_modules(model: nn.Module) -> dict[str, nn.Module]:
    """Every ``unnorm`` norm of the model by module path, in module order: the sites the
    probe hooks, whatever the placement or norm."""
    return {name: module for name, module in model.named_modules()
            if isinstance(module, unnorm.ChannelNorm)}


def running_statistics(module: nn.Module) -> Optional[dict]:
    """The module's running statistics, ``{"var", "mean", "centred"}`` (float32 copies), or
    None when it keeps none (LN, RMS, DyT). ``var`` is ``running_var`` (BN, MABN, UN,
    PRepBN) or PN's ``running_phi``; it is a centred variance only when a ``running_mean``
    goes with it (BN, PRepBN), else a second moment about zero (UN, MABN, PN), and is
    compared with the batch's statistic of the same kind."""
    for name in VARIANCE_BUFFERS:
        var = getattr(module, name, None)
        if isinstance(var, torch.Tensor):
            mean = getattr(module, "running_mean", None)
            return {"var": var.detach().float().clone(),
                    "mean": None if mean is None else mean.detach().float().clone(),
                    "centred": mean is not None, "buffer": name}
    return None


def quantiles(values: torch.Tensor) -> dict[str, float]:
    """``QUANTILES`` of every value (float64), for a ratio pooled over batches and channels."""
    flat = values.detach().double().flatten()
    flat = flat[torch.isfinite(flat)]
    if flat.numel() == 0:
        return {key: float("nan") for key in QUANTILES}
    return {key: torch.quantile(flat, q).item() for key, q in QUANTILES.items()}


def centred_energy(x: torch.Tensor) -> torch.Tensor:
    """``(T, C)``: sum over the batch of ``(x - mean_c)^2``, the mean over batch and positions
    (the pooled statistic's centre); its total is the pooled centred second moment."""
    x = x.double()
    return (x - x.mean(dim=(0, 1))).square().sum(dim=0)


def position_shares(x: torch.Tensor) -> torch.Tensor:
    """Each position's share of the pooled centred second moment of ``(B, T, C)`` input: how
    much of a pooled statistic one position makes (uniform: 1/T)."""
    energy = centred_energy(x).sum(dim=1)
    return energy / energy.sum().clamp_min(1e-300)


def channel_shares(x: torch.Tensor) -> torch.Tensor:
    """Each channel's share of the pooled centred second moment (uniform: 1/C): a channel
    far above it is an outlier channel, whose scale the others' normalisation does not see."""
    energy = centred_energy(x).sum(dim=0)
    return energy / energy.sum().clamp_min(1e-300)


def batch_statistics(x: torch.Tensor, centred: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """``(mean, var)`` per channel over ``(B, T)``: the unbiased variance as the running one
    is kept (BN), or the second moment about zero (mean 0) for a norm that does not centre."""
    rows = x.double().reshape(-1, x.shape[-1])
    if not centred:
        return torch.zeros_like(rows[0]), rows.square().mean(dim=0)
    return rows.mean(dim=0), rows.var(dim=0, correction=1)


def prefix_statistics(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(mean, var)``, each ``(T, C)``: position t's over every sequence's positions
    ``<= t``, the variance unbiased, the statistic causal BN trains position t with."""
    x = x.double()
    count = x.shape[0] * torch.arange(1, x.shape[1] + 1, dtype=x.dtype).unsqueeze(1)
    mean = x.sum(dim=0).cumsum(dim=0) / count
    second = x.square().sum(dim=0).cumsum(dim=0) / count
    return mean, (second - mean.square()).clamp_min(0) * count / (count - 1).clamp_min(1)


def running_against_batch(x: torch.Tensor, running: dict) -> dict[str, torch.Tensor]:
    """Per channel, the running variance over the batch's (``var_ratio``) and the running
    mean's distance from the batch's in batch standard deviations (``mean_shift``); per
    position too for per-position (causal) running statistics, against each prefix's. Below
    1, a ratio means eval mode divides by less than the batch's scale (outputs grow)."""
    length = x.shape[1]
    var, mean = running["var"], running["mean"]
    per_position = var.dim() == 2
    whole_var = var[length - 1] if per_position else var  # the last prefix is the whole batch
    batch_mean, batch_var = batch_statistics(x, running["centred"])
    out = {"var_ratio": whole_var.double() / batch_var.clamp_min(1e-30)}
    if mean is not None:
        whole_mean = mean[length - 1] if per_position else mean
        out["mean_shift"] = ((whole_mean.double() - batch_mean).abs()
                             / batch_var.clamp_min(1e-30).sqrt())
    if per_position:
        prefix_mean, prefix_var = prefix_statistics(x)
        out["position_var_ratio"] = var[:length].double() / prefix_var.clamp_min(1e-30)
        if mean is not None:
            out["position_mean_shift"] = ((mean[:length].double() - prefix_mean).abs()
                                          / prefix_var.clamp_min(1e-30).sqrt())
    return out


class LayerRecord:
    """What the probe keeps of one norm's inputs over the batches: per-batch shares and
    ratios (small tensors), never the activations."""

    def __init__(self, running: Optional[dict]):
        self.running = running
        self.positions: list[torch.Tensor] = []
        self.channels: list[torch.Tensor] = []
        self.ratios: dict[str, list[torch.Tensor]] = {}
        self.rms = {"train": [], "eval": []}
        self.absmax = {"train": 0.0, "eval": 0.0}
        self.shape: Optional[tuple] = None

    def add_training(self, x: torch.Tensor) -> None:
        """One training-mode batch's input ``(B, T, C)``."""
        self.shape = tuple(x.shape)
        self.positions.append(position_shares(x))
        self.channels.append(channel_shares(x))
        if self.running is not None:
            for key, value in running_against_batch(x, self.running).items():
                self.ratios.setdefault(key, []).append(value)
        self._magnitude("train", x)

    def _magnitude(self, mode: str, x: torch.Tensor) -> None:
        self.rms[mode].append(x.double().square().mean().item())
        self.absmax[mode] = max(self.absmax[mode], x.abs().max().item())

    def add_eval(self, x: torch.Tensor) -> None:
        """One eval-mode batch's input: its size only (where eval mode's stream grows)."""
        self._magnitude("eval", x)

    def summary(self) -> dict:
        """The layer's JSON: mean shares over batches, the largest and where, against
        uniform; the running/batch ratios' quantiles over batches and channels."""
        if not self.positions:
            return {"probed": False, "shape": self.shape}
        positions = torch.stack(self.positions)  # (batches, T)
        channels = torch.stack(self.channels)    # (batches, C)
        length, width = positions.shape[1], channels.shape[1]
        mean_positions, mean_channels = positions.mean(dim=0), channels.mean(dim=0)
        top = max(1, math.ceil(0.01 * width))
        top_share = channels.sort(dim=1, descending=True).values[:, :top].sum(dim=1)
        out = {
            "probed": True, "shape": list(self.shape),
            "position_share": {
                "per_position": mean_positions.tolist(), "uniform": 1 / length,
                "max": mean_positions.max().item(), "argmax": int(mean_positions.argmax()),
                "max_over_uniform": mean_positions.max().item() * length,
                "max_single_batch": positions.max().item(),
                "argmax_single_batch": int(positions.max(dim=0).values.argmax()),
                "batch_of_max_single": int(positions.max(dim=1).values.argmax())},
            "channel_share": {
                "uniform": 1 / width, "max": mean_channels.max().item(),
                "argmax": int(mean_channels.argmax()),
                "max_over_uniform": mean_channels.max().item() * width,
                "max_single_batch": channels.max().item(),
                "top_1pct_channels": top, "top_1pct_share": top_share.mean().item(),
                "top_1pct_over_uniform": top_share.mean().item() * width / top},
            "input_rms": {mode: math.sqrt(sum(v) / len(v)) if v else None
                          for mode, v in self.rms.items()},
            "input_absmax": dict(self.absmax),
        }
        if self.running is None:
            out["running"] = None
        else:
            out["running"] = {"buffer": self.running["buffer"], "centred": self.running["centred"],
                              "per_position": self.running["var"].dim() == 2,
                              **{key: quantiles(torch.stack(values))
                                 for key, values in self.ratios.items()}}
            if "position_var_ratio" in self.ratios:  # which position eval mode scales worst
                ratio = torch.stack(self.ratios["position_var_ratio"]).median(dim=0).values
                out["running"]["position_var_ratio_median_per_position"] = (
                    ratio.median(dim=1).values.tolist())
        return out


@contextmanager
def captured(model: nn.Module, records: dict[str, LayerRecord], mode: str) -> Iterator[None]:
    """Forward pre-hooks on the model's norms (named as ``records``) handing each one's
    ``(B, T, C)`` input, as float32, to its record (``mode``: "train" or "eval")."""
    handles = []
    modules = norm_modules(model)
    for name, record in records.items():
        def hook(module, args, kwargs, record=record):
            x = args[0] if args else kwargs["x"]
            if x.dim() == 3:  # (B, T, C); a qk-norm's per-head input is not probed
                x = x.detach().float()
                if mode == "train":
                    record.add_training(x)
                else:
                    record.add_eval(x)
        handles.append(modules[name].register_forward_pre_hook(hook, with_kwargs=True))
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()


@torch.no_grad()
def window_losses(model: nn.Module, batches: list[tuple[torch.Tensor, torch.Tensor]]
                  ) -> torch.Tensor:
    """``(windows, T)``: the next-token loss (nats) of every window at every position, with the
    model in the mode it is in (the trainer's ``next_token_loss``, unreduced)."""
    device = next(model.parameters()).device
    losses = []
    for inputs, targets in batches:
        inputs, targets = inputs.to(device), targets.to(device)
        loss = next_token_loss(model(input_ids=inputs).logits, targets, "none")
        losses.append(loss.double().reshape(targets.shape).cpu())
    return torch.cat(losses)


def batches_of(windows, count: int, batch_size: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The first ``count`` windows in batches of ``batch_size``, in order (the trainer's
    validation batches, as its loader makes them)."""
    subset = torch.utils.data.Subset(windows, range(min(count, len(windows))))
    return list(torch.utils.data.DataLoader(subset, batch_size=batch_size))


def loss_summary(losses: torch.Tensor) -> dict:
    """A ``(windows, T)`` loss's mean, its per-position mean (every position weighs alike:
    equal-length windows) and its median window."""
    return {"mean": losses.mean().item(), "per_position": losses.mean(dim=0).tolist(),
            "median_window": losses.mean(dim=1).median().item()}


def worst_windows(eval_loss: torch.Tensor, train_loss: torch.Tensor, top: int = WORST) -> dict:
    """The windows eval mode scores worst: a mean dominated by a few windows is a rare-input
    failure (an outlier the running statistics never saw), not a shift of every window."""
    per_window = eval_loss.mean(dim=1)
    order = per_window.argsort(descending=True)[:top]
    total = per_window.sum()
    return {"eval_over_train_mode_by_1_nat": int((per_window - train_loss.mean(dim=1) > 1).sum()),
            "share_of_eval_total": (per_window[order].sum() / total).item() if total > 0 else None,
            "worst": [{"window": int(i), "eval": per_window[i].item(),
                       "train_mode": train_loss[i].mean().item(),
                       "worst_position": int(eval_loss[i].argmax()),
                       "positions_over_20_nats": int((eval_loss[i] > 20).sum())}
                      for i in order.tolist()]}


def probe_model(model: nn.Module, batches: list[tuple[torch.Tensor, torch.Tensor]]) -> dict:
    """The probe of an eval-mode ``model`` on ``batches``: per-position loss in eval mode and
    in training mode (on a copy), and every norm's ``LayerRecord`` summary. The model's
    parameters and buffers are untouched (its mode too)."""
    was_training = model.training
    model.eval()
    names = list(norm_modules(model))
    records = {name: LayerRecord(running_statistics(module))
               for name, module in norm_modules(model).items()}
    with captured(model, records, "eval"):
        eval_loss = window_losses(model, batches)
    copy = training_copy(model)  # a training-mode forward commits running state
    with torch.random.fork_rng(devices=[]), captured(copy, records, "train"):
        torch.manual_seed(0)  # dropout, if any, as the leak probe draws it
        train_loss = window_losses(copy, batches)
    model.train(was_training)
    return {"windows": sum(inputs.shape[0] for inputs, _ in batches),
            "batch_size": batches[0][0].shape[0], "context": batches[0][0].shape[1],
            "loss": {"eval": loss_summary(eval_loss), "train_mode": loss_summary(train_loss)},
            "windows_worst_in_eval": worst_windows(eval_loss, train_loss),
            "layer_order": names,
            "layers": {name: records[name].summary() for name in names}}


def probe_run(model: nn.Module, cfg, windows: Optional[int] = None) -> dict:
    """``probe_model`` on a run's model (``plugins.lm.export.load_run``) over its first
    ``windows`` validation windows (None: every window its final ``val_loss`` scored, as the
    trainer takes them: a mean carried by rare windows needs them all), in micro-batches of
    the run's ``recipe.micro_batch_size`` (what its training-mode statistics pooled over)."""
    from .data import prepare_corpus

    valid = prepare_corpus(cfg.data).windows("validation", cfg.model.context)
    if windows is None:
        windows = cfg.recipe.eval_tokens // cfg.model.context
    batches = batches_of(valid, windows, int(cfg.recipe.micro_batch_size))
    return {"norm": cfg.norm.name, "causal": bool(cfg.norm.get("causal", False)),
            **probe_model(model, batches)}
