"""Linear CKA between the layers of two models (the paper's Fig. 6), from their features.

This module never runs a model: it reads per-batch layer features (plugins/timm/features.py
collects them from timm classifiers; scripts/cka.py composes the two).

Three estimators of linear CKA (Kornblith et al. 2019), all computed from centred Gram
matrices of per-example flattened features, in float64:

- ``biased``: full batch, HSIC_0 = tr(KHLH) / (n-1)^2 with H = I - 11^T/n. Equals the feature
  form ||Y^T X||_F^2 / (||X^T X||_F ||Y^T Y||_F) on centred features, but the Gram form costs
  n^2 d instead of d^2, which matters for wide activations (Swin's first stage: 301k values).
- ``debiased``: full batch, the unbiased HSIC_1 of Song et al. (2012).
- ``minibatch`` (default): Nguyen, Raghu & Kornblith (2021). HSIC_1 is unbiased, so its
  average over equal-size minibatches estimates the same population HSIC, and
  CKA = sum HSIC_1(K, L) / sqrt(sum HSIC_1(K, K) * sum HSIC_1(L, L)) needs only one batch of
  activations in memory at a time: the only choice for ImageNet-size evaluation sets.

HSIC_1 is computed as <U(K), U(L)>_F / (n(n-3)), where U is the U-centring of Szekely & Rizzo
(2014); this equals Song et al.'s term-by-term formula (checked in tests/test_cka.py) and turns
all layer pairs into one matrix product of flattened centred Grams.
"""
from __future__ import annotations

from pathlib import Path
from typing import Iterable, Sequence

import torch

ESTIMATORS = ("minibatch", "biased", "debiased")
MIN_BATCH = 4  # HSIC_1 divides by n(n-3)
NO_BATCHES = "no batches of features to compare (an empty loader, or max_batches=0)"


def _check_estimator(estimator: str) -> None:
    if estimator not in ESTIMATORS:
        raise ValueError(f"unknown CKA estimator {estimator!r}; choose one of {', '.join(ESTIMATORS)}")


def centred_gram(x: torch.Tensor, unbiased: bool) -> torch.Tensor:
    """Centred linear Gram matrix of ``x`` (n examples, any trailing shape), float64.

    ``unbiased=False``: H K H (through centred features, which is the same and cheaper).
    ``unbiased=True``: the U-centred Gram, whose Frobenius products give HSIC_1.
    """
    x = x.reshape(x.shape[0], -1).to(torch.float64)
    n = x.shape[0]
    if not unbiased:
        x = x - x.mean(dim=0, keepdim=True)
        return x @ x.T
    if n < MIN_BATCH:
        raise ValueError(f"the unbiased HSIC needs at least {MIN_BATCH} examples, got {n}")
    gram = x @ x.T
    gram.fill_diagonal_(0)
    row_means = gram.sum(dim=1) / (n - 2)
    total = gram.sum() / ((n - 1) * (n - 2))
    gram = gram - row_means[:, None] - row_means[None, :] + total
    return gram.fill_diagonal_(0)


def _flat_grams(features: Sequence[torch.Tensor], unbiased: bool) -> torch.Tensor:
    """(layers, n*n) stack of centred Grams: HSIC for all layer pairs is then one matmul."""
    return torch.stack([centred_gram(f, unbiased).flatten() for f in features])


def _normalise(cross: torch.Tensor, self_a: torch.Tensor, self_b: torch.Tensor) -> torch.Tensor:
    return cross / torch.sqrt(self_a[:, None] * self_b[None, :])


def _full_batch_cka(features_a: Sequence[torch.Tensor], features_b: Sequence[torch.Tensor],
                    estimator: str) -> torch.Tensor:
    """(len(features_a), len(features_b)) CKA from full-batch features (biased or debiased)."""
    unbiased = estimator == "debiased"
    grams_a = _flat_grams(features_a, unbiased)
    grams_b = _flat_grams(features_b, unbiased)
    # HSIC's normalisation (1/(n-1)^2 or 1/(n(n-3))) cancels in CKA.
    return _normalise(grams_a @ grams_b.T, grams_a.pow(2).sum(1), grams_b.pow(2).sum(1))


class MinibatchCKA:
    """Running sums of HSIC_1 for every (layer of A, layer of B) pair, batch by batch.

    Batches must all have the size of the first: the minibatch estimator averages HSIC_1
    estimates of equal weight, and mixing batch sizes would weigh batches unequally.
    """

    def __init__(self, num_a: int, num_b: int, device: torch.device | str | None = None):
        self.cross = torch.zeros(num_a, num_b, dtype=torch.float64, device=device)
        self.self_a = torch.zeros(num_a, dtype=torch.float64, device=device)
        self.self_b = torch.zeros(num_b, dtype=torch.float64, device=device)
        self.batch_size: int | None = None
        self.batches = 0

    def update(self, features_a: Sequence[torch.Tensor], features_b: Sequence[torch.Tensor]) -> None:
        """Add one batch: a feature tensor (batch first) per layer of A and per layer of B."""
        if len(features_a) != len(self.self_a) or len(features_b) != len(self.self_b):
            raise ValueError(f"expected {len(self.self_a)} and {len(self.self_b)} layers, "
                             f"got {len(features_a)} and {len(features_b)}")
        sizes = {f.shape[0] for f in (*features_a, *features_b)}
        if len(sizes) != 1:
            raise ValueError(f"layers disagree on the batch size: {sorted(sizes)}")
        size = sizes.pop()
        if size < MIN_BATCH:
            raise ValueError(f"batch of {size} examples: the minibatch CKA estimator needs at least "
                             f"{MIN_BATCH} per batch (use a larger batch size)")
        if self.batch_size is None:
            self.batch_size = size
        elif size != self.batch_size:
            raise ValueError(f"batch of {size} examples after batches of {self.batch_size}: the "
                             "minibatch CKA estimator needs equal-size batches (drop the last "
                             "batch, e.g. DataLoader(..., drop_last=True))")
        scale = 1.0 / (size * (size - 3))
        grams_a = _flat_grams(features_a, unbiased=True)
        grams_b = _flat_grams(features_b, unbiased=True)
        self.cross += scale * (grams_a @ grams_b.T).to(self.cross.device)
        self.self_a += scale * grams_a.pow(2).sum(1).to(self.self_a.device)
        self.self_b += scale * grams_b.pow(2).sum(1).to(self.self_b.device)
        self.batches += 1

    def compute(self) -> torch.Tensor:
        """The (num_a, num_b) CKA matrix over the batches seen so far."""
        if not self.batches:
            raise RuntimeError("no batches accumulated: call update() first")
        return _normalise(self.cross, self.self_a, self.self_b)


def linear_cka(x: torch.Tensor, y: torch.Tensor, estimator: str = "minibatch",
               batch_size: int | None = None) -> torch.Tensor:
    """Linear CKA of two representations of the same n examples (batch first), float64 scalar.

    ``minibatch`` splits the examples, in order, into batches of ``batch_size`` (default: one
    batch of all n, which makes it the debiased estimator).
    """
    _check_estimator(estimator)
    if x.shape[0] != y.shape[0]:
        raise ValueError(f"x and y must hold the same examples: {x.shape[0]} vs {y.shape[0]} rows")
    if estimator != "minibatch":
        return _full_batch_cka([x], [y], estimator)[0, 0]
    batch_size = batch_size or x.shape[0]
    if x.shape[0] % batch_size:
        raise ValueError(f"{x.shape[0]} examples do not split into equal batches of {batch_size}; "
                         "pick a batch_size that divides them")
    accumulator = MinibatchCKA(1, 1, device=x.device)
    for xb, yb in zip(x.split(batch_size), y.split(batch_size)):
        accumulator.update([xb], [yb])
    return accumulator.compute()[0, 0]


def cka_matrix(batches: Iterable[tuple[Sequence[torch.Tensor], Sequence[torch.Tensor]]],
               estimator: str = "minibatch") -> torch.Tensor:
    """CKA between every layer of A and every layer of B, float64 on the CPU.

    Each item of ``batches`` holds one batch's features (batch first, on one device): a tensor
    per layer of A and one per layer of B (e.g. ``plugins.timm.features.paired_layer_features``).
    ``minibatch`` holds one batch at a time and needs equal-size batches; ``biased`` and
    ``debiased`` keep every feature (on the CPU) until the end, so use them on small sets.
    """
    _check_estimator(estimator)
    if estimator == "minibatch":
        accumulator = None
        for features_a, features_b in batches:
            if accumulator is None:
                accumulator = MinibatchCKA(len(features_a), len(features_b), features_a[0].device)
            accumulator.update(features_a, features_b)
        if accumulator is None:
            raise ValueError(NO_BATCHES)
        return accumulator.compute().cpu()
    kept = [([f.flatten(1).cpu() for f in features_a], [f.flatten(1).cpu() for f in features_b])
            for features_a, features_b in batches]
    if not kept:
        raise ValueError(NO_BATCHES)
    layers_a, layers_b = zip(*kept)
    return _full_batch_cka([torch.cat(layer) for layer in zip(*layers_a)],
                           [torch.cat(layer) for layer in zip(*layers_b)], estimator)


def plot_cka_heatmap(matrix: torch.Tensor, names_a: Sequence[str], names_b: Sequence[str],
                     label_a: str, label_b: str, path: str | Path, title: str | None = None) -> Path:
    """Heatmap in the style of the paper's Fig. 6: layers of A along x, of B along y, origin at
    the lower left, colour scale fixed to [0, 1] so figures compare across model pairs."""
    from matplotlib.figure import Figure  # Agg canvas, no pyplot state: safe on headless machines

    values = torch.as_tensor(matrix, dtype=torch.float64).cpu().numpy()
    if values.shape != (len(names_a), len(names_b)):
        raise ValueError(f"matrix is {values.shape}, names give ({len(names_a)}, {len(names_b)})")
    fig = Figure(figsize=(5.2, 4.4), layout="constrained")
    ax = fig.subplots()
    image = ax.imshow(values.T, origin="lower", cmap="magma", vmin=0.0, vmax=1.0,
                      interpolation="nearest", aspect="equal")
    step_a, step_b = max(1, len(names_a) // 12), max(1, len(names_b) // 12)
    ax.set_xticks(range(0, len(names_a), step_a))
    ax.set_yticks(range(0, len(names_b), step_b))
    ax.set_xlabel(f"{label_a}: layer")
    ax.set_ylabel(f"{label_b}: layer")
    ax.set_title(title or f"Linear CKA: {label_a} vs {label_b}", fontsize=10)
    fig.colorbar(image, ax=ax, label="CKA", ticks=[0, 0.25, 0.5, 0.75, 1.0])
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=150)
    return path
