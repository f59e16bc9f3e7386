"""The shift benchmark (plugins/timm/shift.py, scripts/evaluate.py): each corruption against
CIFAR-10-C's published formula and constants, the test streams against UnMix-TNS's
construction, and the entry point end to end on a trained run."""
from __future__ import annotations

import importlib.util
import io
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf
from PIL import Image

import unnorm
from plugins.timm import model_from_config
from plugins.timm.data import DigitsDataset, build_datasets
from plugins.timm.shift import (CORRUPTIONS, DIRICHLET_CONCENTRATION, ShiftedSet, corrupt,
                                evaluate_stream, parse_shift, stream_order)
from plugins.timm.trainer import train

ROOT = Path(__file__).resolve().parents[1]

# hendrycks/robustness ImageNet-C/create_c/make_cifar_c.py (commit 8190fe32), typed from the
# release, not imported from the module under test
GAUSSIAN = [0.04, 0.06, .08, .09, .10]
SHOT = [500, 250, 100, 75, 50]
IMPULSE = [.01, .02, .03, .05, .07]
SPECKLE = [.06, .1, .12, .16, .2]
BLUR = [.4, .6, 0.7, .8, 1]
DEFOCUS = [(0.3, 0.4), (0.4, 0.5), (0.5, 0.6), (1, 0.2), (1.5, 0.1)]
CONTRAST = [.75, .5, .4, .3, 0.15]
BRIGHTNESS = [.05, .1, .15, .2, .3]
JPEG = [80, 65, 58, 50, 40]
PIXELATE = [0.95, 0.9, 0.85, 0.75, 0.65]
SEVERITIES = [1, 2, 3, 4, 5]


def grey(value=0.5, size=256):
    return np.full((size, size, 3), value)


def rng(seed=0):
    return np.random.default_rng(seed)


@pytest.mark.parametrize("severity", SEVERITIES)
def test_additive_and_multiplicative_noise_have_the_release_scale(severity):
    """x + N(0, c) and x + x N(0, c) on a grey 0.5 image (no clipping within 5 sigma)."""
    x = grey()
    for name, scale in (("gaussian_noise", GAUSSIAN[severity - 1]),
                        ("speckle_noise", 0.5 * SPECKLE[severity - 1])):
        noise = CORRUPTIONS[name](x, severity, rng(severity)) - x
        assert abs(noise.mean()) < 4 * scale / np.sqrt(noise.size)
        assert noise.std() == pytest.approx(scale, rel=0.02)


@pytest.mark.parametrize("severity", SEVERITIES)
def test_shot_noise_is_poisson_over_c(severity):
    c, x = SHOT[severity - 1], grey(0.25)
    out = CORRUPTIONS["shot_noise"](x, severity, rng(severity))
    counts = out * c
    assert np.allclose(counts, np.round(counts))  # Poisson counts over c
    assert out.mean() == pytest.approx(0.25, abs=4 * np.sqrt(0.25 / c / out.size))
    assert out.var() == pytest.approx(0.25 / c, rel=0.03)  # Poisson: var = mean, over c^2


@pytest.mark.parametrize("severity", SEVERITIES)
def test_impulse_noise_replaces_a_fraction_c_by_salt_or_pepper(severity):
    c, x = IMPULSE[severity - 1], grey()
    out = CORRUPTIONS["impulse_noise"](x, severity, rng(severity))
    changed = out != 0.5
    assert set(np.unique(out[changed])) <= {0.0, 1.0}
    assert changed.mean() == pytest.approx(c, abs=4 * np.sqrt(c * (1 - c) / x.size))
    assert (out[changed] == 1).mean() == pytest.approx(0.5, abs=4 * np.sqrt(0.25 / changed.sum()))


@pytest.mark.parametrize("severity", SEVERITIES)
def test_gaussian_blur_of_a_point_is_the_sampled_gaussian(severity):
    sigma, x = BLUR[severity - 1], np.zeros((32, 32, 3))
    x[16, 16] = 1
    out = CORRUPTIONS["gaussian_blur"](x, severity, rng())
    radius = int(4 * sigma + 0.5)  # scikit-image / scipy: truncate=4
    k = np.exp(-np.arange(-radius, radius + 1) ** 2 / (2 * sigma ** 2))
    k /= k.sum()
    expected = np.zeros((32, 32))
    expected[16 - radius:17 + radius, 16 - radius:17 + radius] = np.outer(k, k)
    for channel in range(3):
        np.testing.assert_allclose(out[:, :, channel], expected, atol=1e-12)


@pytest.mark.parametrize("severity", SEVERITIES)
def test_defocus_blur_of_a_point_is_an_antialiased_disk(severity):
    """The disk {X^2 + Y^2 <= r^2} normalised, blurred by a 3-tap Gaussian of the release's
    alias_blur (OpenCV's kernel: exp(-k^2 / 2 s^2), normalised)."""
    radius, alias = DEFOCUS[severity - 1]
    grid = np.arange(-8, 9)
    xs, ys = np.meshgrid(grid, grid)
    disk = ((xs ** 2 + ys ** 2) <= radius ** 2).astype(float)
    disk /= disk.sum()
    taps = np.exp(-np.array([1.0, 0.0, 1.0]) / (2 * alias ** 2))
    taps /= taps.sum()
    kernel = np.zeros_like(disk)
    for i in range(-1, 2):
        for j in range(-1, 2):
            kernel += taps[i + 1] * taps[j + 1] * np.roll(np.roll(disk, i, 0), j, 1)
    x = np.zeros((32, 32, 3))
    x[16, 16] = 1
    out = CORRUPTIONS["defocus_blur"](x, severity, rng())
    expected = np.zeros((32, 32))
    expected[8:25, 8:25] = kernel
    np.testing.assert_allclose(out[:, :, 0], expected, atol=1e-6)  # the kernel is float32


@pytest.mark.parametrize("severity", SEVERITIES)
def test_contrast_and_brightness_closed_forms(severity):
    x = rng(1).random((32, 32, 3))
    c = CONTRAST[severity - 1]
    mean = x.reshape(-1, 3).mean(axis=0)
    np.testing.assert_allclose(CORRUPTIONS["contrast"](x, severity, rng()), (x - mean) * c + mean,
                               atol=1e-12)
    # HSV value + b: each pixel scaled by min(V + b, 1) / V; grey pixels: min(x + b, 1)
    b, value = BRIGHTNESS[severity - 1], x.max(axis=2, keepdims=True)
    np.testing.assert_allclose(CORRUPTIONS["brightness"](x, severity, rng()),
                               x * np.minimum(value + b, 1) / value, atol=1e-12)
    g = np.repeat(rng(2).random((32, 32, 1)), 3, axis=2)
    np.testing.assert_allclose(CORRUPTIONS["brightness"](g, severity, rng()),
                               np.minimum(g + b, 1), atol=1e-12)


@pytest.mark.parametrize("severity", SEVERITIES)
def test_jpeg_uses_the_release_quality(severity):
    """Through libjpeg's quality scaling of its base luminance table (first entry 16)."""
    quality = JPEG[severity - 1]
    scale = 5000 // quality if quality < 50 else 200 - 2 * quality
    original = Image.fromarray(np.uint8(rng(3).random((32, 32, 3)) * 255))
    out = CORRUPTIONS["jpeg_compression"](np.asarray(original) / 255, severity, rng())
    buffer = io.BytesIO()
    original.save(buffer, "JPEG", quality=quality)
    assert Image.open(buffer).quantization[0][0] == (16 * scale + 50) // 100
    np.testing.assert_array_equal(np.uint8(np.round(out * 255)), np.asarray(Image.open(buffer)))


def box_matrix(size_in: int, size_out: int) -> np.ndarray:
    """Pillow's BOX resampling as a matrix: output i averages the inputs whose centres fall in
    its box of width max(scale, 1) (an upscale: the nearest input)."""
    scale, weights = size_in / size_out, np.zeros((size_out, size_in))
    for i in range(size_out):
        centre, half = (i + 0.5) * scale, max(scale, 1) / 2
        weights[i] = [centre - half <= j + 0.5 < centre + half for j in range(size_in)]
    return weights / weights.sum(axis=1, keepdims=True)


@pytest.mark.parametrize("severity", SEVERITIES)
def test_pixelate_is_box_down_to_the_release_size_and_back(severity):
    size = int(32 * PIXELATE[severity - 1])
    x = np.uint8(rng(5).random((32, 32, 3)) * 255).astype(np.float64)
    down, up = box_matrix(32, size), box_matrix(size, 32)
    small = np.round(np.einsum("ij,jkc,lk->ilc", down, x, down))  # stored as 8 bits
    expected = np.einsum("ij,jkc,lk->ilc", up, small, up) / 255
    out = CORRUPTIONS["pixelate"](x / 255, severity, rng())
    np.testing.assert_allclose(out, expected, atol=1.01 / 255)  # Pillow's fixed-point sums


@pytest.mark.parametrize("name", sorted(set(CORRUPTIONS) - {"pixelate"}))
def test_severity_is_monotone_on_the_digits(name):
    """The mean change of the test digits grows with severity (pixelate's box sizes 30, 28,
    27, 24, 20 px alias unevenly on 32 px digits, so it is checked above instead)."""
    digits = DigitsDataset(False, 32)
    images = [np.asarray(digits.images[i], dtype=np.float64) / 255 for i in range(12)]
    change = [np.mean([np.abs(CORRUPTIONS[name](x, s, rng(i)) - x).mean()
                       for i, x in enumerate(images)]) for s in SEVERITIES]
    assert all(a < b for a, b in zip(change, change[1:])), change


def test_corrupt_stores_as_the_release_and_refuses_other_sizes():
    image = Image.fromarray(np.uint8(rng(4).random((32, 32, 3)) * 255))
    x = np.asarray(image) / 255
    stored = corrupt(image, "contrast", 2, rng())
    np.testing.assert_array_equal(np.asarray(stored), np.uint8(CORRUPTIONS["contrast"](x, 2, rng()) * 255))
    with pytest.raises(ValueError, match="32 px"):
        corrupt(image.resize((64, 64)), "contrast", 2, rng())


def test_bad_shifts_and_streams_are_refused_by_name():
    assert parse_shift("none") == ("none", 0) and parse_shift("defocus_blur:5") == ("defocus_blur", 5)
    for text, match in (("fish:3", "unknown corruption 'fish'"), ("snow:2", "Wand"),
                        ("contrast:0", "1 to 5"), ("contrast:6", "1 to 5"), ("contrast", "1 to 5"),
                        ("contrast:two", "1 to 5")):
        with pytest.raises(ValueError, match=match):
            parse_shift(text)
    with pytest.raises(ValueError, match="unknown stream 'shuffled'"):
        stream_order([0, 1], "shuffled", 0)


def digits_config(*overrides):
    with initialize_config_dir(str(ROOT / "configs"), version_base="1.3"):
        return compose("train", overrides=["scale=cpu", "logger=none", *overrides])


def test_shifted_set_corrupts_before_the_trainers_normalisation():
    cfg = digits_config("+exp=t2t_vit_14_bn")
    _, test_set = build_datasets(cfg.data, cfg.recipe.aug, 32)
    clean = ShiftedSet(test_set, "none", 0, seed=0)
    for i in (0, 7):
        assert torch.equal(clean[i][0], test_set[i][0]) and clean[i][1] == test_set[i][1]
    shifted = ShiftedSet(test_set, "contrast", 5, seed=0)
    pixels = np.asarray(test_set.images[7], dtype=np.float64) / 255  # already 32 px: crop is identity
    stored = np.uint8(CORRUPTIONS["contrast"](pixels, 5, rng()) * 255) / 255
    expected = torch.tensor((stored - 0.5) / 0.5, dtype=torch.float32).permute(2, 0, 1)
    torch.testing.assert_close(shifted[7][0], expected)
    noisy = ShiftedSet(test_set, "gaussian_noise", 3, seed=1)
    assert torch.equal(noisy[3][0], noisy[3][0])  # example i's noise is its own, seeded


def release_sort_by_dirichlet(delta_dirichlet, samples):
    """devavratTomar/unmixtns tta_experiments/datasets/data_loading.py ``sort_by_dirichlet``
    (commit 8e12b9f0), lines 302-345 as released (its 120 s limit left out): the reference."""
    N = len(samples)
    samples_sorted = []
    class_labels = np.array([val[1] for val in samples])
    num_classes = int(np.max(class_labels) + 1)
    dirichlet_numchunks = num_classes
    min_size = -1
    min_size_thresh = 10
    while min_size < min_size_thresh:
        idx_batch = [[] for _ in range(dirichlet_numchunks)]
        idx_batch_cls = [[] for _ in range(dirichlet_numchunks)]
        for k in range(num_classes):
            idx_k = np.where(class_labels == k)[0]
            np.random.shuffle(idx_k)
            proportions = np.random.dirichlet(np.repeat(delta_dirichlet, dirichlet_numchunks))
            proportions = np.array([p * (len(idx_j) < N / dirichlet_numchunks) for p, idx_j in zip(proportions, idx_batch)])
            proportions = proportions / proportions.sum()
            proportions = (np.cumsum(proportions) * len(idx_k)).astype(int)[:-1]
            idx_batch = [idx_j + idx.tolist() for idx_j, idx in zip(idx_batch, np.split(idx_k, proportions))]
            min_size = min([len(idx_j) for idx_j in idx_batch])
            for idx_j, idx in zip(idx_batch_cls, np.split(idx_k, proportions)):
                idx_j.append(idx)
    for chunk in idx_batch_cls:
        cls_seq = list(range(num_classes))
        np.random.shuffle(cls_seq)
        for cls in cls_seq:
            idx = chunk[cls]
            samples_sorted.extend([samples[i] for i in idx])
    return samples_sorted


@pytest.mark.parametrize("seed", [0, 1, 2020])
def test_streams_are_permutations_with_their_order(seed):
    labels = np.array(DigitsDataset(False, 8).targets)
    orders = {stream: stream_order(labels, stream, seed) for stream in ("iid", "sorted", "dirichlet")}
    for order in orders.values():
        assert sorted(order.tolist()) == list(range(len(labels)))  # each example exactly once
    assert (np.diff(labels[orders["sorted"]]) >= 0).all()
    assert np.array_equal(orders["iid"], stream_order(labels, "iid", seed))
    assert not np.array_equal(orders["iid"], stream_order(labels, "iid", seed + 1))
    state = np.random.get_state()
    np.random.seed(seed)
    release = release_sort_by_dirichlet(DIRICHLET_CONCENTRATION, [(i, y) for i, y in enumerate(labels)])
    np.random.set_state(state)
    assert orders["dirichlet"].tolist() == [i for i, _ in release]
    switches = {s: (np.diff(labels[o]) != 0).sum() for s, o in orders.items()}
    assert switches["sorted"] == 9 and switches["dirichlet"] < switches["iid"] / 3


class Leaky(torch.nn.Module):
    """A model whose forward writes its own buffer: the evaluation must catch it."""

    def __init__(self):
        super().__init__()
        self.register_buffer("calls", torch.zeros(()))

    def forward(self, x):
        self.calls += 1
        return torch.zeros(len(x), 10)


def test_evaluation_checks_the_state_and_refuses_a_model_with_nothing_to_adapt():
    data = torch.utils.data.TensorDataset(torch.randn(6, 3, 32, 32), torch.zeros(6, dtype=torch.long))
    with pytest.raises(RuntimeError, match="changed the model's state: \\['calls'\\]"):
        evaluate_stream(Leaky(), data, np.arange(6), 2, "source")
    ln = model_from_config(digits_config("+exp=t2t_vit_14_ln"))
    with pytest.raises(ValueError, match="nothing to adapt.*test_time=source evaluates every norm"):
        evaluate_stream(ln, data, np.arange(6), 2, "tbn")
    assert evaluate_stream(ln, data, np.arange(6), 4, "source")["examples"] == 6


def evaluate_script():
    """scripts/evaluate.py as a module, loaded in this process."""
    sys.path.insert(0, str(ROOT / "scripts"))
    spec = importlib.util.spec_from_file_location("evaluate_script", ROOT / "scripts" / "evaluate.py")
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    return script


def test_all_at_a_severity_is_every_corruption_once(capsys):
    script = evaluate_script()
    args = script.parse_args(["run", "--shift", "all:5", "contrast:5", "none"])
    assert args.shifts == [(name, 5) for name in CORRUPTIONS] + [("none", 0)]
    with pytest.raises(SystemExit):
        script.parse_args(["run", "--shift", "all:6"])
    assert "the severity must be 1 to 5" in capsys.readouterr().err


def evaluate(*args):
    """scripts/evaluate.py as a user runs it, in its own process."""
    return subprocess.run([sys.executable, "scripts/evaluate.py", *map(str, args)], cwd=ROOT,
                          capture_output=True, text=True, timeout=300)


def evaluate_here(capsys, *args) -> tuple[int, str, str]:
    """scripts/evaluate.py's ``main`` in this process (a process of its own starts in tens of
    seconds): its exit code, stdout and stderr, a ``sys.exit`` message counted as stderr."""
    script = evaluate_script()
    code, message = 0, ""
    try:
        script.main([str(arg) for arg in args])
    except SystemExit as exit:
        code, message = (1, exit.code) if isinstance(exit.code, str) else (exit.code, "")
    out = capsys.readouterr()
    return code, out.out, out.err + message


@pytest.mark.slow
def test_evaluate_records_beside_a_trained_run_and_refuses_bad_settings(tmp_path, capsys):
    run = tmp_path / "bn"
    train(digits_config("+exp=t2t_vit_14_bn", "recipe.epochs=1", "scale.max_steps_per_epoch=4"), run)
    weights = torch.load(run / "last.pt", weights_only=False)["model"]
    records = run / "test_time"
    for setting in (["--test-time", "unmix", "--shift", "gaussian_noise:3", "--stream", "dirichlet",
                     "--batch", "16"],
                    ["--test-time", "tbn", "--shift", "contrast:5", "--stream", "sorted", "--batch", "1"],
                    ["--stream", "iid", "--batch", "64"], ["--stream", "iid", "--batch", "64"]):
        code, out, err = evaluate_here(capsys, run, *setting)
        assert code == 0 and "top-1" in out, err
    names = sorted(p.name for p in records.iterdir())
    assert names == ["source_none_iid_b64_s0.2.json", "source_none_iid_b64_s0.json",
                     "tbn_contrast-5_sorted_b1_s0.json", "unmix_gaussian_noise-3_dirichlet_b16_s0.json"]
    record = json.loads((records / "unmix_gaussian_noise-3_dirichlet_b16_s0.json").read_text())
    assert record["examples"] == 360 and record["norm"] == "bn" and record["seed"] == 0
    assert record["concentration"] == 0.1 and record["options"] == unnorm.TEST_TIME_MODES["unmix"]
    assert record["adapted_norms"] > 0 and len(record["git_commit"]) >= 40
    assert 0 <= record["top1"] <= 100 and record["correct"] == round(record["top1"] * 3.6)
    twice = [json.loads((records / n).read_text())["top1"] for n in names[:2]]
    assert twice[0] == twice[1]  # seeded: the same setting scores the same
    trained = json.loads((run / "result.json").read_text())["metrics"]["top1"]
    assert twice[0] == pytest.approx(trained, abs=1e-4)  # the trainer's split and normalisation
    after = torch.load(run / "last.pt", weights_only=False)["model"]
    assert all(torch.equal(weights[k], after[k]) for k in weights)
    grid = ["--test-time", "source", "tbn", "--shift", "none", "contrast:5", "--stream", "iid",
            "sorted", "--missing"]  # every combination once; what has a record is skipped
    code, out, err = evaluate_here(capsys, run, *grid)
    assert code == 0 and out.count("wrote") == 7, err  # source_none_iid_b64_s0 was recorded
    names = sorted(p.name for p in records.iterdir())
    assert len(names) == 4 + 7 and "tbn_contrast-5_sorted_b64_s0.json" in names
    assert evaluate_here(capsys, run, *grid)[1].count("wrote") == 0
    for refused, message in ((["--shift", "fog:2"], "unknown corruption 'fog'"),
                             (["--shift", "contrast:6"], "1 to 5"),
                             (["--stream", "shuffled"], "invalid choice: 'shuffled'"),
                             (["--batch", "65"], "1 to 64"),
                             (["--test-time", "tent"], "invalid choice: 'tent'")):
        code, _, err = evaluate_here(capsys, run, *refused)
        assert code != 0 and message in err, err
    assert sorted(p.name for p in records.iterdir()) == names  # a refusal writes nothing
    ln = tmp_path / "ln"
    ln.mkdir()
    cfg = digits_config("+exp=t2t_vit_14_ln")
    torch.save({"model": model_from_config(cfg).state_dict(),
                "config": OmegaConf.to_container(cfg, resolve=True)}, ln / "last.pt")
    code, _, err = evaluate_here(capsys, ln, "--test-time", "ema")
    assert code != 0 and "this run's norm ln" in err and "nothing to adapt" in err
    assert not (ln / "test_time").exists()
    proc = evaluate(ln)  # as a user runs it; source evaluates every norm
    assert proc.returncode == 0 and "top-1" in proc.stdout, proc.stderr
