"""The future leak of batch statistics in a causal model, measured.

BN, PN, MABN, UN and PRepBN pool their training-mode statistics over every position of the
batch, so the output at position t depends on later tokens: the model can read the future it
is asked to predict. Evaluation normalises with running statistics and leaks nothing, so a
leaking model's training loss understates what it has learned. Both probes run on copies: a
training-mode forward commits the norms' running state, and the model must not see them.
"""
from __future__ import annotations

import copy

import torch
from torch import nn

LEAK_TOLERANCE = 1e-5  # relative logit change above float noise


@torch.no_grad()
def future_leak(model: nn.Module, inputs: torch.Tensor) -> dict:
    """Whether training-mode logits at positions ``<= t`` (t the middle of the window) change
    when every token after ``t`` changes: ``{"leaks", "max_logit_change"}``, the change
    relative to the logits' scale."""
    inputs = inputs.to(next(model.parameters()).device)
    cut = inputs.shape[1] // 2
    changed = inputs.clone()
    changed[:, cut + 1:] = (inputs[:, cut + 1:] + 1) % model.config.vocab_size
    before, after = (_training_logits(model, ids)[:, :cut + 1] for ids in (inputs, changed))
    change = ((after - before).abs().max() / before.abs().max().clamp_min(1e-12)).item()
    return {"leaks": change > LEAK_TOLERANCE, "max_logit_change": change}


def training_copy(model: nn.Module) -> nn.Module:
    """A copy of ``model`` in training mode, whose norms may commit running state freely and
    compute alone: their batch statistics are not summed over data-parallel replicas
    (``sync_stats`` off), so a probe on the copy is what one process computes on its inputs,
    on every replica, and runs no collective."""
    trained = copy.deepcopy(model).train()
    for module in trained.modules():
        if getattr(module, "sync_stats", False):
            module.sync_stats = False
    return trained


def _training_logits(model: nn.Module, inputs: torch.Tensor) -> torch.Tensor:
    """Training-mode logits of a copy of ``model``, under a fixed seed (dropout, if any)."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        return training_copy(model)(input_ids=inputs).logits.float()
