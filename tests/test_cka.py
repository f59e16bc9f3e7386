"""Linear CKA (analysis/cka.py) against a direct float64 transcription of the published formulas,
and end to end on the features of tiny models (plugins/timm/features.py)."""
import math
from contextlib import closing

import pytest
import timm
import torch
from timm.models.swin_transformer import SwinTransformer

import plugins.timm  # noqa: F401  (registers t2t_vit_tiny)
from analysis.cka import ESTIMATORS, MinibatchCKA, cka_matrix, linear_cka, plot_cka_heatmap
from plugins.timm.features import block_names, layer_features, paired_layer_features

BATCH = 10  # the minibatch estimator's batch size in these tests


# Reference: Kornblith et al. (2019) and Song et al. (2012), written out with explicit matrices.

def ref_gram(x):
    x = x.reshape(x.shape[0], -1).double()
    return x @ x.T


def ref_hsic_biased(k, l):
    n = k.shape[0]
    h = torch.eye(n, dtype=torch.float64) - torch.ones(n, n, dtype=torch.float64) / n
    return torch.trace(k @ h @ l @ h) / (n - 1) ** 2


def ref_hsic_unbiased(k, l):
    n = k.shape[0]
    k_t = k - torch.diag(torch.diag(k))
    l_t = l - torch.diag(torch.diag(l))
    one = torch.ones(n, dtype=torch.float64)
    term1 = torch.trace(k_t @ l_t)
    term2 = (one @ k_t @ one) * (one @ l_t @ one) / ((n - 1) * (n - 2))
    term3 = 2.0 / (n - 2) * (one @ k_t @ l_t @ one)
    return (term1 + term2 - term3) / (n * (n - 3))


def ref_cka(x, y, estimator, batch_size=BATCH):
    hsic = ref_hsic_biased if estimator == "biased" else ref_hsic_unbiased
    chunks = list(zip(x.split(batch_size), y.split(batch_size))) if estimator == "minibatch" else [(x, y)]
    kl = kk = ll = 0.0
    for xb, yb in chunks:
        k, l = ref_gram(xb), ref_gram(yb)
        kl, kk, ll = kl + hsic(k, l), kk + hsic(k, k), ll + hsic(l, l)
    return (kl / torch.sqrt(kk * ll)).item()


def ref_cka_feature_form(x, y):
    """Kornblith et al.'s feature-space form, with centred features."""
    x = x.reshape(x.shape[0], -1).double()
    y = y.reshape(y.shape[0], -1).double()
    x, y = x - x.mean(0), y - y.mean(0)
    return (torch.linalg.norm(y.T @ x) ** 2 / (torch.linalg.norm(x.T @ x) * torch.linalg.norm(y.T @ y))).item()


@pytest.fixture
def data():
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(40, 3, 5, generator=gen)
    # y partly a linear map of x, so CKA is far from both 0 and 1.
    y = x.flatten(1) @ torch.randn(15, 7, generator=gen) + 2.0 * torch.randn(40, 7, generator=gen)
    return x.double(), y.double()  # exact transforms: the invariance tests compare to 1e-12


def cka(x, y, estimator):
    return linear_cka(x, y, estimator, batch_size=BATCH).item()


@pytest.mark.parametrize("estimator", ESTIMATORS)
def test_identity(data, estimator):
    x, _ = data
    assert cka(x, x, estimator) == pytest.approx(1.0, abs=1e-12)


@pytest.mark.parametrize("estimator", ESTIMATORS)
def test_invariant_to_orthogonal_transform_and_isotropic_scaling(data, estimator):
    x, y = data
    q, _ = torch.linalg.qr(torch.randn(7, 7, dtype=torch.float64, generator=torch.Generator().manual_seed(1)))
    assert cka(x, 3.7 * (y @ q), estimator) == pytest.approx(cka(x, y, estimator), abs=1e-10)
    assert cka(0.01 * x, y, estimator) == pytest.approx(cka(x, y, estimator), abs=1e-12)


@pytest.mark.parametrize("estimator", ESTIMATORS)
def test_matches_reference(data, estimator):
    x, y = data
    value = cka(x, y, estimator)
    assert 0.2 < value < 0.9
    assert value == pytest.approx(ref_cka(x, y, estimator), abs=1e-10)
    if estimator == "biased":
        assert value == pytest.approx(ref_cka_feature_form(x, y), abs=1e-10)


def test_estimators_differ(data):
    """Guards against the estimators silently sharing one code path."""
    x, y = data
    values = {estimator: cka(x, y, estimator) for estimator in ESTIMATORS}
    assert len({round(v, 6) for v in values.values()}) == 3, values


def test_minibatch_over_one_batch_is_debiased(data):
    x, y = data
    accumulator = MinibatchCKA(1, 1)
    accumulator.update([x], [y])
    debiased = linear_cka(x, y, "debiased")
    assert accumulator.compute()[0, 0].item() == pytest.approx(debiased.item(), abs=1e-12)
    assert linear_cka(x, y).item() == pytest.approx(debiased.item(), abs=1e-12)


def test_minibatch_all_pairs_match_pairwise(data):
    x, y = data
    layers_a, layers_b = [x, x.flatten(1)[:, :4]], [y, y[:, :2], x]
    accumulator = MinibatchCKA(2, 3)
    for start in range(0, 40, BATCH):
        accumulator.update([f[start:start + BATCH] for f in layers_a], [f[start:start + BATCH] for f in layers_b])
    expected = torch.tensor([[ref_cka(a, b, "minibatch") for b in layers_b] for a in layers_a],
                            dtype=torch.float64)
    torch.testing.assert_close(accumulator.compute(), expected, rtol=0, atol=1e-10)


def test_batch_size_errors(data):
    x, y = data
    accumulator = MinibatchCKA(1, 1)
    accumulator.update([x[:8]], [y[:8]])
    with pytest.raises(ValueError, match="equal-size batches"):
        accumulator.update([x[:6]], [y[:6]])
    with pytest.raises(ValueError, match="at least 4"):
        MinibatchCKA(1, 1).update([x[:3]], [y[:3]])
    with pytest.raises(ValueError, match="batch_size that divides"):
        linear_cka(x, y, batch_size=7)
    with pytest.raises(ValueError, match="unknown CKA estimator"):
        linear_cka(x, y, "kernel")
    for estimator in ESTIMATORS:
        with pytest.raises(ValueError, match="no batches"):
            cka_matrix([], estimator)


def tiny_t2t(seed):
    torch.manual_seed(seed)
    return timm.create_model("t2t_vit_tiny", num_classes=10, img_size=32)


def layer_cka(model_a, model_b, loader, estimator="minibatch"):
    """Composed as scripts/cka.py composes it: default layers, both models' features, the estimator."""
    names_a, names_b = block_names(model_a), block_names(model_b)
    features = paired_layer_features(model_a, model_b, loader, names_a, names_b,
                                     equal_batches=estimator == "minibatch")
    return cka_matrix(features, estimator), names_a, names_b


def test_cka_matrix_on_tiny_models(tmp_path):
    images = torch.randn(20, 3, 32, 32, generator=torch.Generator().manual_seed(0))
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(images, torch.zeros(20)), batch_size=8)
    model, other = tiny_t2t(0), tiny_t2t(1)
    model.train()
    for estimator in ("minibatch", "biased"):
        matrix, names_a, names_b = layer_cka(model, model, loader, estimator)
        assert names_a == names_b == [f"blocks.{i}" for i in range(4)]
        torch.testing.assert_close(matrix.diagonal(), torch.ones(4, dtype=torch.float64), rtol=0, atol=1e-9)
        assert torch.allclose(matrix, matrix.T, atol=1e-9)
    assert model.training, "paired_layer_features must restore the train/eval mode"

    # The full-batch estimators see all 20 examples, the short final batch included.
    matrix, _, _ = layer_cka(model, other, loader, "biased")
    with torch.no_grad(), layer_features(model, names_a) as out_a, layer_features(other, names_b) as out_b:
        model.eval()(images), other.eval()(images)
        expected = ref_cka(out_a[names_a[0]], out_b[names_b[3]], "biased")
    assert matrix[0, 3].item() == pytest.approx(expected, abs=1e-6)

    # The minibatch estimator drops the short final batch (4 of 20): the result is that of the two full batches.
    matrix, _, _ = layer_cka(model, other, loader)
    reference = MinibatchCKA(4, 4)
    with torch.no_grad(), layer_features(model, names_a) as out_a, layer_features(other, names_b) as out_b:
        for batch in images[:16].split(8):
            model.eval()(batch), other.eval()(batch)
            reference.update([out_a[n] for n in names_a], [out_b[n] for n in names_b])
    torch.testing.assert_close(matrix, reference.compute(), rtol=0, atol=1e-12)
    assert ((matrix > 0) & (matrix < 1)).all()

    path = plot_cka_heatmap(matrix, names_a, names_b, "seed 0", "seed 1", tmp_path / "cka.png")
    assert path.stat().st_size > 0


def test_short_batch_before_the_last_is_an_error():
    model = tiny_t2t(0).train()
    images = torch.randn(8, 3, 32, 32, generator=torch.Generator().manual_seed(0))
    names = block_names(model)
    features = paired_layer_features(model, model, [images, images[:4], images], names, names)
    with pytest.raises(ValueError, match="came before the last one"), closing(features):
        cka_matrix(features)
    assert model.training, "closing the features must restore the train/eval mode"


def test_swin_default_layers_are_its_blocks():
    model = SwinTransformer(img_size=32, patch_size=4, embed_dim=8, depths=(2, 1), num_heads=(1, 1),
                            window_size=4, num_classes=10)
    names = block_names(model)
    assert names == ["layers.0.blocks.0", "layers.0.blocks.1", "layers.1.blocks.0"]
    with torch.no_grad(), layer_features(model, names) as out:
        model.eval()(torch.randn(4, 3, 32, 32))
    assert [tuple(out[n].shape) for n in names] == [(4, 8, 8, 8), (4, 8, 8, 8), (4, 4, 4, 16)]
    assert not math.isnan(linear_cka(out[names[0]], out[names[2]]).item())
