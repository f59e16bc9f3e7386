"""The language model sharded with FSDP2 (``distributed=fsdp``, plugins/fsdp.py), on two gloo
processes on a CPU: it trains as DDP does and as one process with the whole batch (weights and
every norm buffer), keeps the norms' statistics in float32 under a half-precision parameter
policy, resumes exactly, and its sharded checkpoints load into any number of processes, for
evaluation and for folding. The recipes for several nodes compose (docs/language_modelling.md)."""
from __future__ import annotations

import json
import math
import os
import shutil
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

import unnorm
from plugins import fsdp
from plugins.checkpoints import load_checkpoint, load_model
from plugins.distributed import Distributed
from plugins.lm import trainer as lm_trainer
from plugins.lm.data import prepare_corpus
from plugins.lm.fold import fold_lm
from plugins.lm.model import build_lm
from plugins.lm.trainer import RANGES, train, validation_loss
from plugins.runlog import FINISHED
from plugins.scale import effective_config, micro_batches_per_update
from test_lm import TINY_MODEL, TINY_RECIPE, corpus_root  # noqa: F401 (a fixture)
from test_lm_split import assert_same_records
from test_vision import ROOT, config, free_port

pytestmark = pytest.mark.xdist_group("fsdp")  # one worker trains the module's shared runs

# 4 updates of 8 sequences: on 2 ranks 2 micro-batches of 2 each, on one process 2 of 4
TWO_RANKS = [*TINY_RECIPE, "recipe.micro_batch_size=2"]
SYNCED = {"ln": [], "un": ["norm.sync_stats=true", "norm.warmup_iters=2"], "bn": ["norm.sync_stats=true"]}
FOLDED = "un"  # the sharded run folded in one process (an offline norm)


def _overrides(root, norm, *extra):
    """``norm``'s tiny run; the gradient is clipped (its norm over every shard) at every update."""
    return [f"+exp=llama_71m_{norm}", "logger=none", "device=cpu", "scale.num_workers=0",
            f"data.root={root}", *TINY_MODEL, *SYNCED[norm], "recipe.clip_grad=0.05", *extra]


def _two_rank_runs(root, out: Path) -> dict:
    """name -> (overrides, run directory) of every run the two ranks train, in order."""
    runs = {}
    for norm in SYNCED:
        for kind in ("ddp", "fsdp"):
            runs[f"{norm}-{kind}"] = _overrides(root, norm, *TWO_RANKS, f"distributed={kind}")
    for kind in ("ddp", "fsdp"):  # per-replica statistics, made one before evaluating and saving
        runs[f"un-local-{kind}"] = [*_overrides(root, "un", *TWO_RANKS, f"distributed={kind}"),
                                    "norm.sync_stats=false"]
    for kind in ("ddp", "fsdp"):  # the norms' parameters alone trained (plugins/sam.py)
        runs[f"un-norm-only-{kind}"] = [*runs[f"un-{kind}"], "train_only=norm"]
    fsdp_un = runs["un-fsdp"]
    runs["un-checkpointed"] = [*fsdp_un, "distributed.activation_checkpointing=true"]
    runs["un-bf16"] = [*fsdp_un, "amp=bf16"]
    runs["un-fp16"] = [*fsdp_un, "amp=fp16"]
    runs["un-compiled"] = [*runs["un-local-fsdp"], "compile=true"]  # synced UN: refused
    runs["un-resumed"] = [*fsdp_un, f"resume={out / 'un-resumed'}"]  # after un-fsdp's epoch 1
    # the LLaMA-1B recipe's command at toy size (docs/language_modelling.md, "Several nodes")
    runs["rehearsal"] = ["+exp=llama_1b_un", "distributed=fsdp", "logger=none", "device=cpu",
                         "scale.num_workers=0", f"data.root={root}", *TINY_MODEL, *TWO_RANKS,
                         "norm.warmup_iters=2"]
    return {name: (overrides, out / name) for name, overrides in runs.items()}


def _killed_after_epoch_1(run: Path, killed: Path) -> None:
    """``killed`` as a kill right after ``run``'s first checkpoint leaves it: its previous.pt
    as last.pt, the sharded directory it names, the first epoch's records."""
    killed.mkdir()
    shutil.copy(run / "config.yaml", killed / "config.yaml")
    shutil.copy(run / "previous.pt", killed / "last.pt")
    named = load_checkpoint(killed / "last.pt", unshard=False)["sharded"]["dir"]
    shutil.copytree(run / named, killed / named)
    (killed / "metrics.jsonl").write_text((run / "metrics.jsonl").read_text().splitlines()[0] + "\n")


def _rank(rank, ports, runs, one_process, out):
    """Rank ``rank`` of two (gloo, as under torchrun): trains ``runs`` in turn, then loads each
    of the ``one_process`` checkpoints into a model sharded over both ranks and evaluates it."""
    os.environ.update(MASTER_ADDR="127.0.0.1", RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE="2")
    torch.set_num_threads(1)
    for number, (name, (overrides, run_dir)) in enumerate(runs.items()):
        os.environ["MASTER_PORT"] = str(ports[number])
        if name == "un-resumed" and rank == 0:  # rank 1 waits for rank 0 in the process group
            _killed_after_epoch_1(runs["un-fsdp"][1], run_dir)
        train(config(*overrides), run_dir)
    os.environ["MASTER_PORT"] = str(ports[-1])
    world = Distributed("cpu")
    losses = {}
    for name, path in one_process.items():
        model, windows = _checkpoint_and_windows(path)
        fsdp.shard(model, model.model.layers, world, amp=False)
        load_model(model, path)
        losses[name] = validation_loss(model.eval(), windows, EVAL_BATCH, world, torch.no_grad)
    world.close()
    torch.save(losses, Path(out) / f"evaluated{rank}.pt")


EVAL_BATCH, EVAL_WINDOWS = 3, 31  # uneven shards: rank 0 takes 6 batches, rank 1 5 (lockstep)


def _checkpoint_and_windows(path: Path):
    """A new model of the run whose checkpoint is ``path`` (weights not loaded), and the
    first ``EVAL_WINDOWS`` validation windows of its data."""
    cfg = OmegaConf.create(load_checkpoint(path, unshard=False)["config"])
    corpus = prepare_corpus(cfg.data)
    windows = torch.utils.data.Subset(corpus.windows("validation", cfg.model.context),
                                      range(EVAL_WINDOWS))
    return build_lm(cfg.model, cfg.norm, vocab_size=corpus.vocab_size), windows


class ReplicaOrder(torch.utils.data.Sampler):
    """The two ranks' training order for one process with micro-batches twice theirs: each
    micro-batch is rank 0's micro-batch then rank 1's (``DistributedSampler``, as the trainer's)."""

    def __init__(self, dataset, seed: int, micro_batch: int, world: int = 2):
        self.samplers = [torch.utils.data.DistributedSampler(dataset, world, rank, seed=seed,
                                                             drop_last=True) for rank in range(world)]
        self.micro = micro_batch

    def set_epoch(self, epoch: int) -> None:
        for sampler in self.samplers:
            sampler.set_epoch(epoch)

    def __iter__(self):
        orders = [list(sampler) for sampler in self.samplers]
        for start in range(0, len(orders[0]) - self.micro + 1, self.micro):
            for order in orders:
                yield from order[start:start + self.micro]

    def __len__(self):
        return len(self.samplers[0]) // self.micro * self.micro * len(self.samplers)


def _one_process(monkeypatch, overrides, run_dir) -> dict:
    """A run in this process with the whole batch of both ranks, in their order."""
    def plan(train_set, batch_size, max_steps, world, seed):
        assert world.world == 1
        return batch_size, ReplicaOrder(train_set, seed, batch_size // 2), None

    with monkeypatch.context() as patch:
        patch.setattr(lm_trainer, "epoch_plan", plan)
        return train(config(*overrides), run_dir)


@pytest.fixture(scope="module")
def runs(corpus_root, tmp_path_factory):  # noqa: F811 (the fixture)
    """Every run: the two ranks' (``_two_rank_runs``) and one process's with the whole batch
    (per norm, plain; and UN sharded over a group of one), with the two ranks' evaluations of
    the one-process checkpoints. ``{"dir": {name: path}, "evaluated": [per rank]}``."""
    out = tmp_path_factory.mktemp("fsdp")
    monkeypatch = pytest.MonkeyPatch()
    dirs = {}
    for norm in SYNCED:
        dirs[f"{norm}-1"] = out / f"{norm}-1"
        _one_process(monkeypatch, _overrides(corpus_root, norm, *TINY_RECIPE), dirs[f"{norm}-1"])
    dirs["un-fsdp-1"] = out / "un-fsdp-1"
    _one_process(monkeypatch, _overrides(corpus_root, "un", *TINY_RECIPE, "distributed=fsdp"),
                 dirs["un-fsdp-1"])
    two = _two_rank_runs(corpus_root, out)
    one_process = {name: dirs[name] / "last.pt" for name in ("un-1", "un-fsdp-1")}
    ports = [free_port() for _ in range(len(two) + 1)]  # a rendezvous per run, then one to evaluate
    mp.start_processes(_rank, args=(ports, two, one_process, str(out)), nprocs=2,
                       start_method="spawn")
    dirs.update({name: run_dir for name, (_, run_dir) in two.items()})
    return {"dir": dirs, "evaluated": [torch.load(out / f"evaluated{r}.pt") for r in range(2)]}


def _result(run: Path) -> dict:
    return json.loads((run / "result.json").read_text())


def _state(run: Path) -> dict:
    return load_checkpoint(run / "last.pt")["model"]


#: UN's gradient statistics: in the units of the loss each rank backpropagates, its own
#: micro-batch's mean, which is (ranks) x its share of the whole batch's mean
GRADIENT_STATISTICS = ("bwd_buffer", "ema_grad")


def assert_same_state(want: dict, got: dict, what: str, rtol=1e-4, atol=1e-5,
                      ranks: int = 1) -> None:
    """Every weight and every norm buffer (running statistics, windows, counters); ``got``
    from ``ranks`` ranks against one process's ``want``: its gradient statistics are
    ``ranks`` times one process's."""
    assert want.keys() == got.keys(), what
    for key, value in want.items():
        if key.endswith(GRADIENT_STATISTICS):
            value = value * ranks
        torch.testing.assert_close(got[key], value, rtol=rtol, atol=atol, msg=f"{what}: {key}")


@pytest.mark.slow
@pytest.mark.parametrize("norm", list(SYNCED))
def test_sharded_training_equals_ddp_and_one_process_with_the_whole_batch(norm, runs):
    """LN, and UN and BN with synced statistics: FSDP on two ranks, DDP on two ranks and one
    process with both ranks' micro-batches end with the same weights and norm state (UN's
    gradient statistics in each rank's loss units: twice one process's), and record the same
    losses; the two strategies probe the future leak alike."""
    one, ddp, sharded = (runs["dir"][f"{norm}-{kind}"] for kind in ("1", "ddp", "fsdp"))
    results = {kind: _result(run) for kind, run in (("1", one), ("ddp", ddp), ("fsdp", sharded))}
    assert all(r["status"] in FINISHED and r["steps"] == 4 and r["accumulate"] == 2
               for r in results.values()), results
    assert results["fsdp"]["world_size"] == results["ddp"]["world_size"] == 2
    want = _state(one)
    assert_same_state(want, _state(ddp), f"{norm}: ddp against one process", ranks=2)
    assert_same_state(want, _state(sharded), f"{norm}: fsdp against one process", ranks=2)
    assert_same_state(_state(ddp), _state(sharded), f"{norm}: fsdp against ddp")
    assert (norm == "un") == any(key.endswith(GRADIENT_STATISTICS) for key in want)
    if norm != "ln":
        assert any("running" in key or "fwd_buffer" in key for key in want), "no norm state compared"
        assert any(not torch.equal(v, build_lm_state(norm)[k]) for k, v in want.items()
                   if "running" in k or "buffer" in k), "the norm state never moved"
    for key in ("train_loss", "val_loss"):
        for kind in ("ddp", "fsdp"):
            assert results[kind]["metrics"][key] == pytest.approx(results["1"]["metrics"][key],
                                                                  rel=1e-5), (kind, key)
    leaks = {kind: results[kind]["metrics"] for kind in ("ddp", "fsdp")}
    assert leaks["fsdp"]["leaks_future"] == leaks["ddp"]["leaks_future"] == (norm != "ln")
    for key in ("future_logit_change", "val_loss_train_mode"):
        assert (key in leaks["fsdp"]) == (key in leaks["ddp"]) == (key == "future_logit_change"
                                                                    or norm != "ln"), key
        if key in leaks["ddp"]:
            assert leaks["fsdp"][key] == pytest.approx(leaks["ddp"][key], rel=1e-4, abs=1e-9), key


def build_lm_state(norm: str) -> dict:
    """A new model's state (what training starts from), for ``norm``."""
    cfg = config(f"+exp=llama_71m_{norm}", *TINY_MODEL, *SYNCED[norm])
    torch.manual_seed(0)  # as the trainer seeds rank 0 (seed=0), whose weights every rank takes
    return build_lm(cfg.model, cfg.norm, vocab_size=300).state_dict()


#: the longest float32 sum behind a record: an update's tokens (its loss, each weight's
#: gradient), summed over micro-batches and ranks in another order than one process's
UPDATE_TOKENS = 8 * 16  # TINY_RECIPE's recipe.batch_size x TINY_MODEL's model.context


@pytest.mark.slow
@pytest.mark.parametrize("norm", list(SYNCED))
def test_two_ranks_record_every_field_as_one_process_does(norm, runs):
    """Every field of the records (each metrics.jsonl row, result.json) of FSDP and DDP on two
    ranks is one process's with both ranks' micro-batches, within float32's summation bound
    (tests/test_lm_split.py's ``assert_same_records``; the fields that name the split or time
    it are left out by name): every rank probes the same fixed windows, the training-mode
    probes (the future leak, ``val_loss_train_mode``) as one process computes them."""
    for kind in ("ddp", "fsdp"):
        compared = assert_same_records(runs["dir"][f"{norm}-1"], runs["dir"][f"{norm}-{kind}"],
                                       terms=UPDATE_TOKENS)
        assert {"max_attn_logit_per_layer", "metrics.future_logit_change"} <= set(compared)
        assert ("metrics.val_loss_train_mode" in compared) == (norm != "ln"), kind


@pytest.mark.slow
def test_per_replica_statistics_are_made_one_as_under_ddp(runs):
    """UN with each rank's own statistics: FSDP and DDP average the ranks' norm state before
    each evaluation and save alike, and train alike."""
    assert_same_state(_state(runs["dir"]["un-local-ddp"]), _state(runs["dir"]["un-local-fsdp"]),
                      "per-replica UN: fsdp against ddp")
    assert _result(runs["dir"]["un-local-fsdp"])["metrics"]["val_loss"] == pytest.approx(
        _result(runs["dir"]["un-local-ddp"])["metrics"]["val_loss"], rel=1e-5)


@pytest.mark.slow
def test_training_the_norms_alone_shards_as_ddp_trains_it(runs):
    """``train_only=norm``: every other parameter keeps its initialisation, on both ranks."""
    ddp, sharded = (_state(runs["dir"][f"un-norm-only-{kind}"]) for kind in ("ddp", "fsdp"))
    assert_same_state(ddp, sharded, "norm-only UN: fsdp against ddp")
    start = build_lm_state("un")
    frozen = [k for k in start if k.endswith("proj.weight") or "embed" in k or "lm_head" in k]
    assert frozen and all(torch.equal(sharded[k], start[k]) for k in frozen)
    assert not torch.equal(sharded["model.norm.weight"], start["model.norm.weight"])
    assert _result(runs["dir"]["un-norm-only-fsdp"])["trainable_parameters"] == sum(
        v.numel() for k, v in start.items() if k.endswith(("layernorm.weight", "layernorm.bias",
                                                           "norm.weight", "norm.bias")))


@pytest.mark.slow
def test_a_sharded_run_over_a_group_of_one_trains_as_the_plain_one(runs):
    assert _result(runs["dir"]["un-fsdp-1"])["world_size"] == 1
    assert_same_state(_state(runs["dir"]["un-1"]), _state(runs["dir"]["un-fsdp-1"]),
                      "fsdp on one process against the plain model")


@pytest.mark.slow
def test_activation_checkpointing_and_compiled_blocks_train_as_eager(runs):
    """Each decoder layer recomputed in the backward (the norms replay, committing each step
    once), or each compiled (UN with per-replica statistics): the same weights and norm state
    as the eager sharded run."""
    want = _state(runs["dir"]["un-fsdp"])
    assert {int(v) for k, v in want.items() if k.endswith("num_iters")} == {8}  # 4 x 2 micro-batches
    assert_same_state(want, _state(runs["dir"]["un-checkpointed"]), "checkpointed against eager")
    assert_same_state(_state(runs["dir"]["un-local-fsdp"]), _state(runs["dir"]["un-compiled"]),
                      "compiled against eager")


@pytest.mark.slow
def test_half_precision_parameters_keep_the_norm_statistics_in_float32(runs):
    """bf16 and fp16 parameter policies (fp16 with the sharded, norm-guarded scaler): every
    norm buffer is float32 at every rank's save, training changed the weights as the half
    dtype rounds them, and the loss follows float32's."""
    float32 = _state(runs["dir"]["un-fsdp"])
    want = _result(runs["dir"]["un-fsdp"])["metrics"]["val_loss"]
    for amp in ("bf16", "fp16"):
        run = runs["dir"][f"un-{amp}"]
        saved = load_checkpoint(run / "last.pt")
        buffers = {k: v for k, v in saved["model"].items() if "layernorm" in k or "model.norm" in k}
        floating = {k: v.dtype for k, v in buffers.items() if v.is_floating_point()}
        assert floating and set(floating.values()) == {torch.float32}, (amp, floating)
        assert all(v.dtype == torch.float32 for v in saved["model"].values() if v.is_floating_point())
        assert any(not torch.equal(v, float32[k]) for k, v in saved["model"].items()), amp
        assert _result(run)["metrics"]["val_loss"] == pytest.approx(want, abs=0.05), amp
        assert (saved["scaler"] is not None) == (amp == "fp16"), amp
    assert 0 < load_checkpoint(runs["dir"]["un-fp16"] / "last.pt")["scaler"]["scale"] < math.inf


@pytest.mark.slow
def test_a_killed_sharded_run_resumes_as_if_uninterrupted(runs):
    """Resumed from its first epoch's sharded checkpoint (model, optimizer, schedule, RNG,
    norm state), the run ends where the uninterrupted one did."""
    whole, resumed = runs["dir"]["un-fsdp"], runs["dir"]["un-resumed"]
    assert_same_state(_state(whole), _state(resumed), "resumed against uninterrupted",
                      rtol=1e-6, atol=1e-7)
    for key in ("val_loss", "train_loss"):
        assert _result(resumed)["metrics"][key] == pytest.approx(_result(whole)["metrics"][key], rel=1e-6)
    epochs = [json.loads(line)["epoch"] for line in (resumed / "metrics.jsonl").read_text().splitlines()]
    assert epochs == [1, 2]


@pytest.mark.slow
def test_sharded_checkpoints_keep_two_saves_and_name_their_directories(runs):
    run = runs["dir"]["un-fsdp"]
    last, previous = (load_checkpoint(run / name, unshard=False) for name in ("last.pt", "previous.pt"))
    assert last["model"] is None and last["optimizer"] is None and last["sharded"]["world_size"] == 2
    assert last["sharded"]["dir"] == "sharded/step_00000004"
    assert previous["sharded"]["dir"] == "sharded/step_00000002"
    assert sorted(p.name for p in (run / "sharded").iterdir()) == ["step_00000002", "step_00000004"]
    assert (run / last["sharded"]["dir"] / ".metadata").exists()


@pytest.mark.slow
def test_a_two_rank_checkpoint_evaluates_and_folds_in_one_process(runs, corpus_root):  # noqa: F811
    """The sharded run's last.pt read whole into one process without a process group: its
    validation loss is the one the two ranks recorded, and its folded logits equal its own."""
    run = runs["dir"][f"{FOLDED}-fsdp"]
    saved = load_checkpoint(run / "last.pt")
    cfg = OmegaConf.create(saved["config"])
    corpus = prepare_corpus(cfg.data)
    model = build_lm(cfg.model, cfg.norm, vocab_size=corpus.vocab_size)
    model.load_state_dict(saved["model"])
    model.eval()
    windows = torch.utils.data.Subset(corpus.windows("validation", cfg.model.context),
                                      range(cfg.recipe.eval_tokens // cfg.model.context))
    got = validation_loss(model, windows, 4, Distributed("cpu"), torch.no_grad)
    assert got["val_loss"] == pytest.approx(_result(run)["metrics"]["val_loss"], rel=1e-6)
    assert got["val_tokens"] == 512
    inputs = windows[0][0][None]
    with torch.no_grad():
        before = model(input_ids=inputs).logits
        done = fold_lm(model, probe=inputs)
        after = model(input_ids=inputs).logits
    assert done["folded"] > 0
    torch.testing.assert_close(after, before, rtol=1e-4, atol=1e-4)


@pytest.mark.slow
def test_one_process_checkpoints_evaluate_on_two_sharded_ranks(runs):
    """A plain checkpoint and a sharded one written by one process, each loaded into a model
    sharded over two ranks (DCP reshards the latter), evaluated on shards of unequal length:
    both ranks get the validation loss one process gets from the same checkpoint."""
    for name in ("un-1", "un-fsdp-1"):
        path = runs["dir"][name] / "last.pt"
        model, windows = _checkpoint_and_windows(path)
        model.load_state_dict(load_checkpoint(path)["model"])
        want = validation_loss(model.eval(), windows, EVAL_BATCH, Distributed("cpu"), torch.no_grad)
        for rank in range(2):
            got = runs["evaluated"][rank][name]
            assert got["val_tokens"] == want["val_tokens"] == EVAL_WINDOWS * 16, name
            assert got["val_loss"] == pytest.approx(want["val_loss"], rel=1e-6), (name, rank)


@pytest.mark.slow
def test_the_llama_1b_recipe_rehearses_at_toy_size_on_two_ranks(runs):
    result = _result(runs["dir"]["rehearsal"])
    assert result["status"] in FINISHED and result["world_size"] == 2 and result["model"] == "llama_1b"
    assert load_checkpoint(runs["dir"]["rehearsal"] / "last.pt", unshard=False)["sharded"]


# --- fast: refusals and the recipes' composition ----------------------------------------------------

def test_options_that_do_not_shard_are_refused_by_name(tmp_path, monkeypatch):
    base = ["+exp=llama_71m_un", "logger=none", "device=cpu", "distributed=fsdp"]
    with pytest.raises(ValueError, match="sam=sam with distributed=fsdp"):
        train(config(*base, "sam=sam"), tmp_path / "sam")
    with pytest.raises(ValueError, match="compile=true with distributed.activation_checkpointing"):
        train(config(*base, "compile=true", "distributed.activation_checkpointing=true"), tmp_path / "c")
    with pytest.raises(ValueError, match="classification trains with ddp only"):
        fsdp.check_distributed(config("+exp=swin_t_un", "distributed=fsdp"))
    with pytest.raises(ValueError, match="activation_checkpointing=true: classification"):
        fsdp.check_distributed(config("+exp=swin_t_un", "distributed.activation_checkpointing=true"))
    with pytest.raises(ValueError, match="distributed.strategy='zero3'"):
        fsdp.check_distributed(config(*base, "distributed.strategy=zero3"), fsdp.STRATEGIES)
    monkeypatch.setenv("WORLD_SIZE", "2")  # compiled UN with synced statistics: allowed
    for strategy in fsdp.STRATEGIES:      # (tests/test_sync.py, compiled against eager)
        assert fsdp.check_distributed(config(*base, "compile=true", "norm.sync_stats=true",
                                             f"distributed={strategy}"), fsdp.STRATEGIES) == strategy


def _llama_parameters(vocab: int, hidden: int, intermediate: int, layers: int) -> int:
    """Llama (RMSNorm, as GaLore and Mix-LN count it) with an untied head: two norms per layer
    and a final one."""
    per_layer = 4 * hidden * hidden + 3 * hidden * intermediate + 2 * hidden
    return 2 * vocab * hidden + layers * per_layer + hidden


RECIPES = {  # docs/language_modelling.md, "Several nodes": the SLURM launch of each recipe
    "llama_130m": (["+exp=llama_130m_rms", "distributed=fsdp", "recipe.micro_batch_size=32"],
                   _llama_parameters(32000, 768, 2048, 12)),
    "llama_1b": (["+exp=llama_1b_rms", "distributed=fsdp"], _llama_parameters(32000, 2048, 5461, 24)),
}


@pytest.mark.parametrize("recipe", RECIPES)
def test_the_two_node_recipes_compose_into_a_sharded_model_of_the_published_size(recipe):
    """Each recipe's command composes with the 2 x 8-GPU SLURM launcher, divides its 512
    sequences per update over 16 ranks without accumulation, and builds (on the meta device)
    the model of GaLore's and Mix-LN's config."""
    overrides, parameters = RECIPES[recipe]
    with initialize_config_dir(str(ROOT / "configs"), version_base="1.3"):
        cfg = compose("train", overrides=[*overrides, "hydra/launcher=slurm_2x8"],
                      return_hydra_config=True)
    launcher = cfg.hydra.launcher
    assert (launcher.nodes, launcher.gpus_per_node, launcher.tasks_per_node) == (2, 8, 8)
    assert "submitit" in launcher._target_.lower()
    OmegaConf.set_struct(cfg, False)
    del cfg["hydra"]
    cfg = effective_config(cfg, overrides, RANGES)
    assert cfg.distributed.strategy == "fsdp" and cfg.recipe.batch_size == 512
    assert micro_batches_per_update(cfg.recipe, world_size=2 * 8) == 1
    assert fsdp.check_distributed(cfg, fsdp.STRATEGIES) == "fsdp"
    with torch.device("meta"):
        model = build_lm(cfg.model, cfg.norm, vocab_size=32000)
    assert sum(p.numel() for p in model.parameters()) == parameters
    assert len(model.model.layers) == cfg.model.num_hidden_layers
    assert all(isinstance(m, unnorm.ChannelNorm) for m in (model.model.norm,))
