"""A shift benchmark on a run's own test split: ImageNet-C's corruptions at 32 px, test
streams (i.i.d., label-sorted, Dirichlet non-i.i.d.) and test-time normalization over them.

The corruptions follow CIFAR-10-C, whose severity constants are set for 32 px images:
hendrycks/robustness ``ImageNet-C/create_c/make_cifar_c.py`` (commit 8190fe32; the line of
each constant is cited at its entry). They act on an ``(H, W, 3)`` float image in [0, 1],
as the release does after ``np.array(x) / 255.``; the result is stored as the release stores
it, ``np.uint8(x * 255)``. The Dirichlet stream is UnMix-TNS's (devavratTomar/unmixtns
``tta_experiments/datasets/data_loading.py`` ``sort_by_dirichlet``, commit 8e12b9f0).
"""
from __future__ import annotations

import copy
import io
from typing import Callable

import cv2
import numpy as np
import torch
from matplotlib.colors import hsv_to_rgb, rgb_to_hsv
from PIL import Image
from scipy.ndimage import gaussian_filter
from torchvision import transforms

import unnorm

IMAGE_SIZE = 32  # the size CIFAR-10-C's constants are set for
SEVERITIES = range(1, 6)
STREAMS = ("iid", "sorted", "dirichlet")
# TEST.DELTA_DIRICHLET for CIFAR-10-C (10 classes, as the digits): unmixtns
# tta_experiments/run.sh line 11 and conf.py line 284
DIRICHLET_CONCENTRATION = 0.1
DIRICHLET_MIN_CHUNK = 10  # sort_by_dirichlet's min_size_thresh (data_loading.py line 313)
DIRICHLET_ATTEMPTS = 10_000  # the release gives up after 120 s; a count is reproducible


def _pil(x: np.ndarray) -> Image.Image:
    return Image.fromarray(np.uint8(np.round(x * 255)))


def gaussian_noise(x, severity, rng):
    c = [0.04, 0.06, .08, .09, .10][severity - 1]  # make_cifar_c.py line 131
    return np.clip(x + rng.normal(size=x.shape, scale=c), 0, 1)


def shot_noise(x, severity, rng):
    c = [500, 250, 100, 75, 50][severity - 1]  # line 138
    return np.clip(rng.poisson(x * c) / c, 0, 1)


def impulse_noise(x, severity, rng):
    """scikit-image's ``random_noise(mode='s&p', amount=c)`` as the release calls it: each
    value (each channel apart) is replaced with probability c, by 1 or 0 alike."""
    c = [.01, .02, .03, .05, .07][severity - 1]  # line 145
    flipped = rng.random(x.shape) < c
    salted = rng.random(x.shape) < 0.5
    return np.where(flipped, salted.astype(x.dtype), x)


def speckle_noise(x, severity, rng):
    c = [.06, .1, .12, .16, .2][severity - 1]  # line 152
    return np.clip(x + x * rng.normal(size=x.shape, scale=c), 0, 1)


def gaussian_blur(x, severity, rng):
    """scikit-image's ``gaussian(sigma=c, multichannel=True)``: scipy's filter over the two
    spatial axes, which it wraps (mode 'nearest', truncate 4)."""
    c = [.4, .6, 0.7, .8, 1][severity - 1]  # line 159
    return np.clip(gaussian_filter(x, sigma=(c, c, 0), mode="nearest", truncate=4.0), 0, 1)


def disk(radius: float, alias_blur: float) -> np.ndarray:
    """The release's antialiased disk kernel (make_cifar_c.py lines 34-46)."""
    if radius <= 8:
        grid, ksize = np.arange(-8, 8 + 1), (3, 3)
    else:
        grid, ksize = np.arange(-radius, radius + 1), (5, 5)
    xs, ys = np.meshgrid(grid, grid)
    aliased = np.array((xs ** 2 + ys ** 2) <= radius ** 2, dtype=np.float32)
    aliased /= np.sum(aliased)
    return cv2.GaussianBlur(aliased, ksize=ksize, sigmaX=alias_blur)


def defocus_blur(x, severity, rng):
    c = [(0.3, 0.4), (0.4, 0.5), (0.5, 0.6), (1, 0.2), (1.5, 0.1)][severity - 1]  # line 184
    kernel = disk(radius=c[0], alias_blur=c[1])
    channels = [cv2.filter2D(x[:, :, d], -1, kernel) for d in range(x.shape[2])]
    return np.clip(np.stack(channels, axis=2), 0, 1)


def contrast(x, severity, rng):
    c = [.75, .5, .4, .3, 0.15][severity - 1]  # line 334
    means = np.mean(x, axis=(0, 1), keepdims=True)
    return np.clip((x - means) * c + means, 0, 1)


def brightness(x, severity, rng):
    """HSV's value raised by c (the release converts with scikit-image, whose HSV is
    matplotlib's)."""
    c = [.05, .1, .15, .2, .3][severity - 1]  # line 342
    hsv = rgb_to_hsv(x)
    hsv[:, :, 2] = np.clip(hsv[:, :, 2] + c, 0, 1)
    return np.clip(hsv_to_rgb(hsv), 0, 1)


def jpeg_compression(x, severity, rng):
    c = [80, 65, 58, 50, 40][severity - 1]  # line 364
    buffer = io.BytesIO()
    _pil(x).save(buffer, "JPEG", quality=c)
    return np.asarray(Image.open(buffer), dtype=np.float64) / 255


def pixelate(x, severity, rng):
    c = [0.95, 0.9, 0.85, 0.75, 0.65][severity - 1]  # line 374
    small = _pil(x).resize((int(IMAGE_SIZE * c), int(IMAGE_SIZE * c)), Image.BOX)
    return np.asarray(small.resize((IMAGE_SIZE, IMAGE_SIZE), Image.BOX), dtype=np.float64) / 255


Corruption = Callable[[np.ndarray, int, np.random.Generator], np.ndarray]
CORRUPTIONS: dict[str, Corruption] = {f.__name__: f for f in (
    gaussian_noise, shot_noise, impulse_noise, speckle_noise, gaussian_blur, defocus_blur,
    contrast, brightness, jpeg_compression, pixelate)}
# CIFAR-10-C's others, and why they are not here
NOT_HERE = {
    "motion_blur": "ImageMagick's motion blur through Wand (not installed)",
    "snow": "ImageMagick's motion blur through Wand (not installed)",
    "frost": "the release's frost photographs (not generated here)",
    "saturate": "the digits are grey: saturation 0, so it changes nothing",
    "glass_blur": "not yet", "zoom_blur": "not yet", "fog": "not yet",
    "elastic_transform": "not yet", "spatter": "not yet"}


def parse_shift(text: str) -> tuple[str, int]:
    """``'none'`` or ``'<corruption>:<severity>'``, refused by name when unknown."""
    if text == "none":
        return "none", 0
    name, _, severity = text.partition(":")
    if name not in CORRUPTIONS:
        why = f" ({NOT_HERE[name]})" if name in NOT_HERE else ""
        raise ValueError(f"unknown corruption {name!r}{why}; choose none or one of "
                         f"{', '.join(CORRUPTIONS)}, as <corruption>:<severity 1-5>")
    if not severity.isdigit() or int(severity) not in SEVERITIES:
        raise ValueError(f"shift {text!r}: the severity must be 1 to 5, as in "
                         f"{name}:3")
    return name, int(severity)


def corrupt(image: Image.Image, name: str, severity: int, rng: np.random.Generator) -> Image.Image:
    """One 8-bit RGB image corrupted in [0, 1] and stored as the release does."""
    x = np.asarray(image, dtype=np.float64) / 255
    if x.shape != (IMAGE_SIZE, IMAGE_SIZE, 3):
        raise ValueError(f"the corruptions' constants are CIFAR-10-C's, for {IMAGE_SIZE} px RGB "
                         f"images; this image is {x.shape}: evaluate a run with model.img_size=32")
    return Image.fromarray(np.uint8(CORRUPTIONS[name](x, severity, rng) * 255))


class ShiftedSet(torch.utils.data.Dataset):
    """A run's test split corrupted between its evaluation transform's geometric part and its
    ``ToTensor`` + ``Normalize``: ImageNet-C corrupts the cropped image, before the model's
    normalisation. Example i's noise is drawn from ``(seed, i)``, so every stream, batch size
    and mode sees the same corrupted images."""

    def __init__(self, dataset, name: str, severity: int, seed: int):
        steps = list(dataset.transform.transforms)
        cut = next((i for i, t in enumerate(steps) if isinstance(t, transforms.ToTensor)), None)
        if cut is None:
            raise ValueError(f"the evaluation transform has no ToTensor to corrupt before: {steps}")
        self.dataset = copy.copy(dataset)
        self.dataset.transform = None  # this set applies it, in two parts
        self.name, self.severity, self.seed = name, severity, seed
        self.before = transforms.Compose(steps[:cut])
        self.after = transforms.Compose(steps[cut:])
        self.targets = list(dataset.targets)

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, index):
        image, target = self.dataset[index]
        image = self.before(image.convert("RGB"))
        if self.name != "none":
            image = corrupt(image, self.name, self.severity,
                            np.random.default_rng([self.seed, index]))
        return self.after(image), target


def stream_order(labels, stream: str, seed: int,
                 concentration: float = DIRICHLET_CONCENTRATION) -> np.ndarray:
    """The order in which the test examples arrive; each appears exactly once."""
    labels = np.asarray(labels)
    if stream == "iid":
        return np.random.default_rng(seed).permutation(len(labels))
    if stream == "sorted":  # the release's delta_dirichlet=0: a stable sort by label
        return np.argsort(labels, kind="stable")
    if stream == "dirichlet":
        return dirichlet_order(labels, concentration, np.random.RandomState(seed))
    raise ValueError(f"unknown stream {stream!r}; choose one of {', '.join(STREAMS)}")


def dirichlet_order(labels: np.ndarray, concentration: float,
                    random: np.random.RandomState) -> np.ndarray:
    """UnMix-TNS's ``sort_by_dirichlet`` (from NOTE): each class is split over as many chunks
    as classes by Dirichlet(concentration) proportions, a chunk taking no more once it holds
    N / chunks; redrawn until every chunk holds 10. The chunks follow in order, each one's
    classes in a shuffled order. ``random`` makes the release's calls in its order, so
    ``RandomState(s)`` gives the release's stream after ``np.random.seed(s)``."""
    if concentration <= 0:
        raise ValueError(f"the Dirichlet concentration must be > 0, got {concentration}; "
                         "stream=sorted is the release's 0")
    n, classes = len(labels), int(labels.max()) + 1
    chunks = classes
    for _ in range(DIRICHLET_ATTEMPTS):
        parts = [[] for _ in range(chunks)]
        by_class = [[] for _ in range(chunks)]
        for k in range(classes):
            idx_k = np.where(labels == k)[0]
            random.shuffle(idx_k)
            proportions = random.dirichlet(np.repeat(concentration, chunks))
            proportions = np.array([p * (len(part) < n / chunks)
                                    for p, part in zip(proportions, parts)])
            proportions = proportions / proportions.sum()
            cuts = (np.cumsum(proportions) * len(idx_k)).astype(int)[:-1]
            pieces = np.split(idx_k, cuts)
            parts = [part + piece.tolist() for part, piece in zip(parts, pieces)]
            for chunk, piece in zip(by_class, pieces):
                chunk.append(piece)
        if min(len(part) for part in parts) >= DIRICHLET_MIN_CHUNK:
            break
    else:
        raise ValueError(f"no Dirichlet stream with every chunk of {DIRICHLET_MIN_CHUNK} examples "
                         f"in {DIRICHLET_ATTEMPTS} draws at concentration {concentration}: "
                         "raise the concentration or the number of test examples")
    order = []
    for chunk in by_class:
        sequence = list(range(classes))
        random.shuffle(sequence)
        for k in sequence:
            order.extend(chunk[k].tolist())
    return np.array(order, dtype=np.int64)


def state_snapshot(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


@torch.no_grad()
def evaluate_stream(model: torch.nn.Module, dataset, order: np.ndarray, batch: int,
                    mode: str) -> dict:
    """Top-1 over ``dataset`` fed in ``order`` by batches of ``batch``, the norms following
    the stream under ``unnorm.test_time(model, mode)``; ``source`` is the model as trained
    (what test_time's source computes), so it runs for every norm. The model's state is
    checked bit for bit afterwards."""
    if batch < 1:
        raise ValueError(f"batch must be >= 1, got {batch}")
    before = state_snapshot(model)
    model.eval()
    loader = torch.utils.data.DataLoader(torch.utils.data.Subset(dataset, order.tolist()),
                                         batch_size=batch, shuffle=False)
    correct, seen, record = 0, 0, {}
    try:
        adapted = None if mode == "source" else unnorm.test_time(model, mode)
    except ValueError as error:
        raise ValueError(f"{error}; test_time=source evaluates every norm") from None
    try:
        for images, targets in loader:
            correct += (model(images).argmax(dim=1) == targets).sum().item()
            seen += len(targets)
        if adapted is not None:
            record = {"adapted_norms": len(adapted.norms), "kept": dict(adapted.kept),
                      "rejected_batches": adapted.rejected()}
            if mode == "unmix":
                record["one_position_at_source"] = adapted.at_source()
    finally:
        if adapted is not None:
            adapted.close()
    changed = [k for k, v in model.state_dict().items() if not torch.equal(v, before[k])]
    if changed:
        raise RuntimeError(f"the evaluation changed the model's state: {changed[:5]}")
    return {"top1": 100 * correct / seen, "correct": correct, "examples": seen, **record}
