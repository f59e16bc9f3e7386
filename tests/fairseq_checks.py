"""Checks of the fairseq plugin that need fairseq, run by tests/test_fairseq.py with the Python
of fairseq's environment (the main one cannot import fairseq):

    .venv-fairseq/bin/python tests/fairseq_checks.py padding DATA_BIN
    .venv-fairseq/bin/python tests/fairseq_checks.py same-weights CHECKPOINT_A CHECKPOINT_B
    .venv-fairseq/bin/python tests/fairseq_checks.py precision DATA_BIN
    .venv-fairseq/bin/python tests/fairseq_checks.py groups DATA_BIN
    .venv-fairseq/bin/python tests/fairseq_checks.py skipped-update DATA_BIN
    .venv-fairseq/bin/python tests/fairseq_checks.py loss-scale DATA_BIN
    .venv-fairseq/bin/python tests/fairseq_checks.py norm-state CHECKPOINT
    .venv-fairseq/bin/python tests/fairseq_checks.py gns DATA_BIN RUN_DIR
    .venv-fairseq/bin/python tests/fairseq_checks.py nf DATA_BIN
    .venv-fairseq/bin/python tests/fairseq_checks.py updates DATA_BIN
    .venv-fairseq/bin/python tests/fairseq_checks.py landscape DATA_BIN

Each prints a JSON summary (the tests assert on it) and exits non-zero, with the reason, when
a check cannot be made.
"""
import copy
import json
import sys
import tempfile
from contextlib import nullcontext
from pathlib import Path

import torch
from fairseq import options, tasks
from fairseq.dataclass.utils import convert_namespace_to_omegaconf
from fairseq.logging import metrics

from timm.utils.agc import adaptive_clip_grad

import unnorm
from plugins.fairseq.checkpoints import load
from plugins.fairseq.flags import UPDATES
from plugins.fairseq.train import (GuardedTrainer, adaptive_clipping, landscape_every,
                                   recording_updates)
from plugins.runlog import SCALE_INVARIANCE_FILE
from unnorm.ws import StandardizedWeight

USER_DIR = str(Path(__file__).resolve().parents[1] / "plugins" / "fairseq" / "unnorm_fairseq")
EXTRA_PAD = 3   # padding columns added to source (left) and target (right)
STEPS = 4       # training steps per norm: UN's warm-up of 2 is followed by its window phase


def setup(data: str, norm: str, *flags: str):
    """fairseq's config and task for the tiny model with ``norm`` (and more ``flags``), and
    the test set's first batches of 12 sentences."""
    args = options.parse_args_and_arch(options.get_training_parser(), [
        data, "--user-dir", USER_DIR, "--task", "translation", "--arch", "unnorm_transformer_tiny",
        "--norm-type", norm, "--encoder-normalize-before", "--decoder-normalize-before",
        "--share-all-embeddings", "--dropout", "0", "--cpu", "--seed", "1"]
        + (["--un-warmup", "2"] if norm in ("un", "mabn", "pn", "pn_ls") else [])
        # 64 channels: the default 32 groups leave two a group per token, whose standardisation
        # is a sign that magnifies the batch statistics' rounding (more padding, other sums)
        + (["--un-groups", "8"] if norm in ("bcn", "evonorm_s0") else []) + list(flags))
    cfg = convert_namespace_to_omegaconf(args)
    task = tasks.setup_task(cfg.task)
    task.load_dataset("test")
    dataset = task.dataset("test")
    batches = [dataset.collater([dataset[i] for i in range(start, start + 12)]) for start in range(0, 96, 12)]
    return cfg, task, batches


def build(data: str, norm: str, *flags: str):
    cfg, task, batches = setup(data, norm, *flags)
    torch.manual_seed(1)
    return task.build_model(cfg.model), batches[0]["net_input"], task.source_dictionary.pad()


def pad_more(net_input: dict, pad: int) -> dict:
    """The batch with EXTRA_PAD more padding: sources are left-padded, targets right-padded."""
    src, prev = net_input["src_tokens"], net_input["prev_output_tokens"]
    return {"src_tokens": torch.cat([src.new_full((len(src), EXTRA_PAD), pad), src], 1),
            "src_lengths": net_input["src_lengths"],
            "prev_output_tokens": torch.cat([prev, prev.new_full((len(prev), EXTRA_PAD), pad)], 1)}


def scramble_padding(model) -> dict:
    """Hooks every norm to put noise at its input's pad positions; counts the masks seen."""
    seen = {"calls": 0, "with_mask": 0}

    def hook(module, args, kwargs):
        seen["calls"] += 1
        mask = kwargs.get("pad_mask")
        if mask is None or mask.shape != args[0].shape[:-1]:
            return None
        seen["with_mask"] += 1
        noisy = torch.where(mask[..., None], 10 * torch.randn_like(args[0]), args[0])
        return (noisy,) + args[1:], kwargs

    for module in model.modules():
        if isinstance(module, unnorm.ChannelNorm):
            module.register_forward_pre_hook(hook, with_kwargs=True)
    return seen


def forward(model, net_input: dict, feed_masks: bool = True):
    """Encoder output (B, S, C) and decoder logits (B, T, V); a training step also backward."""
    if not feed_masks:
        model.encoder.pad_feed.batch = model.decoder.pad_feed.batch = lambda mask: nullcontext()
    encoder_out = model.encoder(net_input["src_tokens"], src_lengths=net_input["src_lengths"])
    logits, _ = model.decoder(net_input["prev_output_tokens"], encoder_out=encoder_out)
    if model.training:
        logits.float().logsumexp(-1).sum().backward()
    return encoder_out["encoder_out"][0].transpose(0, 1).detach(), logits.detach()


def compare(reference, other, src_valid, tgt_valid, shift: int) -> float:
    """Largest difference at valid positions, relative to the reference's largest value there
    (``other`` has ``shift`` more source columns): float rounding scales with the values, and
    an offline norm evaluated before its statistics settle (PRepBN) has large ones."""
    (enc_a, logits_a), (enc_b, logits_b) = reference, other
    enc_b, logits_b = enc_b[:, shift:], logits_b[:, :logits_a.shape[1]]
    return max(((a - b)[valid].abs().max() / a[valid].abs().max()).item()
               for a, b, valid in ((enc_a, enc_b, src_valid), (logits_a, logits_b, tgt_valid)))


#: in float64 rounding leaves 1e-16 of the outputs, and the worst-conditioned norm here (gn:
#: two channels a group a token, whose variance can be near 0 and is divided by sqrt(eps))
#: amplifies it to about 1e-12 through the model; a norm that reads padding moves them by
#: 1e-3 or more (the control). In float32 that floor was 5e-4 for gn on one CPU, 2e-7 for the
#: others: a float32 test passes or fails with the CPU's rounding, not with the norms.
PADDING_TOLERANCE = 1e-9


def check_padding(data: str) -> dict:
    """Padding amount and pad values change nothing at valid positions, for every norm, over
    training steps (batch statistics, windows) and in eval, the model in float64; without the
    masks BN would change."""
    summary = {}
    for norm in unnorm.available_norms():
        model, net_input, pad = build(data, norm)
        model = model.double()
        src_valid, tgt_valid = net_input["src_tokens"].ne(pad), net_input["prev_output_tokens"].ne(pad)
        if src_valid.all() or tgt_valid.all():
            raise SystemExit("the test batch has no padding to check with")
        plain, padded, scrambled = model, copy.deepcopy(model), copy.deepcopy(model)
        seen = scramble_padding(scrambled)
        diffs = {"more_padding": 0.0, "scrambled_padding": 0.0}
        for mode in ["train"] * STEPS + ["eval"]:
            for m in (plain, padded, scrambled):
                m.train(mode == "train")
            reference = forward(plain, net_input)
            diffs["more_padding"] = max(diffs["more_padding"], compare(
                reference, forward(padded, pad_more(net_input, pad)), src_valid, tgt_valid, EXTRA_PAD))
            diffs["scrambled_padding"] = max(diffs["scrambled_padding"], compare(
                reference, forward(scrambled, net_input), src_valid, tgt_valid, 0))
        summary[norm] = {**diffs, **seen}
        if seen["with_mask"] != seen["calls"] or not seen["calls"]:
            raise SystemExit(f"{norm}: {seen['with_mask']} of {seen['calls']} norm calls got the pad mask")
        if max(diffs.values()) > PADDING_TOLERANCE:
            raise SystemExit(f"{norm}: padding changed outputs at valid positions: {diffs}")
    model, net_input, pad = build(data, "bn")
    model = model.double()
    unmasked = copy.deepcopy(model)
    control = compare(forward(model, net_input), forward(unmasked, pad_more(net_input, pad), feed_masks=False),
                      net_input["src_tokens"].ne(pad), net_input["prev_output_tokens"].ne(pad), EXTRA_PAD)
    summary["bn_without_masks"] = control
    if control < 1e-3:
        raise SystemExit(f"control: BN without pad masks should see the padding, changed {control}")
    return summary


def check_same_weights(path_a: str, path_b: str) -> dict:
    """Two checkpoints hold bitwise identical model weights under the same names (but for
    fairseq's ``_float_tensor``, an uninitialised buffer kept only for its dtype and device).
    They are read as the project reads fairseq's checkpoints: without running their pickle."""
    a, b = ({k: v for k, v in load(path, "same-weights")["model"].items()
             if not k.endswith("._float_tensor")} for path in (path_a, path_b))
    if set(a) != set(b):
        raise SystemExit(f"different parameters: {sorted(set(a) ^ set(b))[:10]}")
    different = [k for k in a if not torch.equal(a[k], b[k])]
    if different:
        raise SystemExit(f"{len(different)} tensors differ, e.g. {different[:5]}")
    return {"tensors": len(a), "identical": True}


def norm_buffers(model) -> dict:
    """Every buffer of every norm with running state, by name (copies)."""
    return {f"{name}.{key}": value.detach().clone() for name, module in model.named_modules()
            if isinstance(module, unnorm.GuardedNorm)
            for key, value in module.named_buffers(recurse=False)}


def relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).abs().max() / b.float().abs().max().clamp_min(1e-12)).item()


# the norms with running state
STATEFUL = [name for name in unnorm.available_norms() if unnorm.has_running_state(name)]


def check_precision(data: str) -> dict:
    """Each norm with running state in the plugin's model, cast as fairseq's --fp16 / --bf16 cast it
    (``model.half()`` / ``.bfloat16()``: fairseq's own flags need CUDA for training), against
    the float32 model with the same (rounded) weights on the same batches: training steps
    (forward and backward; the weights stay, so the norms' state is what moves: warm-up,
    windows, EMAs) and then eval. Reports the largest relative differences of the encoder
    output and logits, of the norms' floating-point buffers after training, and their dtypes."""
    summary = {}
    for norm in STATEFUL:
        model, net_input, _ = build(data, norm)
        for dtype in (torch.float16, torch.bfloat16):
            cast = copy.deepcopy(model).to(dtype)
            reference = copy.deepcopy(model)
            with torch.no_grad():
                for mine, theirs in zip(reference.parameters(), cast.parameters()):
                    mine.copy_(theirs.float())
            outputs = {"train": 0.0, "eval": 0.0}
            for mode in ["train"] * STEPS + ["eval"]:
                cast.train(mode == "train"), reference.train(mode == "train")
                got, want = forward(cast, net_input), forward(reference, net_input)
                outputs[mode] = max(outputs[mode], *(relative(g, w) for g, w in zip(got, want)))
                if got[1].dtype != dtype:
                    raise SystemExit(f"{norm} {dtype}: logits came back as {got[1].dtype}")
            buffers, wanted = norm_buffers(cast), norm_buffers(reference)
            floating = [k for k, v in wanted.items() if v.is_floating_point()]
            summary[f"{norm}/{str(dtype)[6:]}"] = {
                **outputs,
                "buffers": max((relative(buffers[k], wanted[k]) for k in floating), default=0.0),
                "buffer_dtypes": sorted({str(buffers[k].dtype)[6:] for k in floating}),
                "steps": max((int(v) for k, v in buffers.items() if k.endswith("num_iters")), default=None)}
    return summary


def check_groups(data: str) -> dict:
    """PowerNorm's layer-scale groups of every norm of the model, with --un-group-num unset
    (encoder and decoder of 4 and 2 heads) and set to 1."""
    summary = {}
    for name, flags in (("unset", ["--encoder-attention-heads", "4", "--decoder-attention-heads", "2"]),
                        ("set_to_1", ["--un-group-num", "1"])):
        model, _, _ = build(data, "pn_ls", *flags)
        summary[name] = {key: module.group_num for key, module in model.named_modules()
                         if isinstance(module, unnorm.PowerNorm)}
    return summary


def check_sepnorm(data: str) -> dict:
    """``unnorm.separate_class_norms`` on the plugin's Transformer (time-first, no class
    token): its refusal, and how many norms it wrapped before it (none)."""
    model, _, _ = build(data, "ln")
    try:
        unnorm.separate_class_norms(model, "bn")
        refused = None
    except ValueError as error:
        refused = str(error)
    return {"refused": refused,
            "wrapped": sum(isinstance(m, unnorm.SeparateClassNorm) for m in model.modules())}


CONTROLS = ("un", "prepbn")  # the norms also run without the guard: the checks can fail


def fp16_trainer(data: str, norm: str, *flags: str):
    """fairseq's trainer of plugins.fairseq.train, with --fp16 (FP16Optimizer and its
    DynamicLossScaler; the model cast to half), on the CPU (where fairseq's flattened fp32
    copy of the weights would ask CUDA for its device: unflattened); and the batches."""
    cfg, task, batches = setup(data, norm, "--fp16", "--fp16-no-flatten-grads", "--optimizer",
                               "adam", "--lr", "1e-3",
                               "--criterion", "label_smoothed_cross_entropy",
                               "--label-smoothing", "0.1", *flags)
    torch.manual_seed(1)
    model = task.build_model(cfg.model)
    return GuardedTrainer(cfg, task, model, task.build_criterion(cfg.criterion)), batches


def overflow_in_head(model):
    """An inf in the gradient of the output projection's weight (the shared embedding): a
    head weight's gradient, which reaches no norm; returns the hook's handle."""
    def overflow(grad):
        grad = grad.clone()
        grad[0, 0] = float("inf")
        return grad
    return model.decoder.output_projection.weight.register_hook(overflow)


def unguarded_training(data: str) -> str:
    """What a training forward of the model built for --fp16 says when no trainer guards its
    norms (fairseq-train's own)."""
    cfg, task, batches = setup(data, "un", "--fp16")
    model = task.build_model(cfg.model).half().train()
    try:
        model(**batches[0]["net_input"])  # as fairseq's criterion calls it
    except RuntimeError as refusal:
        return str(refusal)
    return "trained"


def check_skipped_update(data: str) -> dict:
    """Each norm with running state, trained by fairseq under --fp16 for three updates; the
    fourth update's head weight gradient overflows and fairseq skips it. Reports whether the
    norms' buffers came out of it exactly as they went in, with the guard and, as the
    control (``CONTROLS``), with the norms left as the update made them (what fairseq-train
    did, which now refuses: ``fairseq_train``)."""
    # fairseq's overflow branch puts a zero grad norm on CUDA; on this CPU it stays here
    torch.Tensor.cuda = lambda tensor, *args, **kwargs: tensor
    summary = {"fairseq_train": unguarded_training(data)}
    for norm in STATEFUL:
        for guarded in (True, False) if norm in CONTROLS else (True,):
            trainer, batches = fp16_trainer(data, norm, "--fp16-init-scale", "64")
            if not guarded:
                trainer.guard.end_update = lambda skipped: None
            for batch in batches[:3]:
                trainer.train_step([batch])
            before, scale = norm_buffers(trainer.get_model()), trainer.optimizer.scaler.loss_scale
            handle = overflow_in_head(trainer.get_model())
            trainer.train_step([batches[3]])
            handle.remove()
            after = norm_buffers(trainer.get_model())
            summary[f"{norm}/{'guarded' if guarded else 'control'}"] = {
                "updates": trainer.get_num_updates(),
                "scale": [scale, trainer.optimizer.scaler.loss_scale],
                "steps_before": max((int(v) for k, v in before.items() if k.endswith("num_iters")), default=None),
                "unchanged": all(torch.equal(before[k], after[k]) for k in before),
                "changed": sorted(k for k in before if not torch.equal(before[k], after[k]))[:3]}
    return summary


def check_loss_scale(data: str) -> dict:
    """UN, MABN and PN trained by fairseq under --fp16 from loss scales 4 and 512 on the same
    batches, three updates of two micro-batches (as --update-freq 2 hands them): the largest relative difference
    of their gradient statistics (windows, EMAs) between the two, with the guard and, as
    the control (UN), with the norms told no scale; and the norms' step counts."""
    summary = {}
    for norm in ("un", "mabn", "pn"):
        for guarded in (True, False) if norm in CONTROLS else (True,):
            grad_stats = []
            for scale in ("4", "512"):
                trainer, batches = fp16_trainer(data, norm, "--fp16-init-scale", scale,
                                                "--fp16-scale-window", "1000")
                if not guarded:
                    trainer.guard.begin_update = lambda _, guard=trainer.guard: type(guard).begin_update(guard, 1.0)
                for first in range(0, 6, 2):
                    trainer.train_step(batches[first:first + 2])
                buffers = norm_buffers(trainer.get_model())
                grad_stats.append({k: v for k, v in buffers.items()
                                   if k.endswith(("bwd_buffer", "ema_grad"))})
            summary[f"{norm}/{'guarded' if guarded else 'control'}"] = {
                "difference": max(relative(grad_stats[1][k], grad_stats[0][k]) for k in grad_stats[0]),
                "updates": trainer.get_num_updates(),
                "steps": max(int(v) for k, v in buffers.items() if k.endswith("num_iters"))}
    return summary


def check_norm_state(path: str) -> dict:
    """The norms' step counters in a checkpoint of a run (read safely)."""
    state = load(path, "norm-state")["model"]
    return {"num_iters": sorted({int(v) for k, v in state.items() if k.endswith(".num_iters")})}


TRAIN_FLAGS = ("--optimizer", "adam", "--lr", "1e-3", "--criterion", "label_smoothed_cross_entropy",
               "--label-smoothing", "0.1")


def sentence_gradients(model, criterion, sample) -> dict:
    """Per norm, each sentence's gradient ``(B, P)`` of its own loss (its tokens' summed
    label-smoothed loss) w.r.t. the norm's weight and bias, through one batch forward."""
    model.train()
    losses, _ = criterion.compute_loss(model, model(**sample["net_input"]), sample, reduce=False)
    per_sentence = losses.view(len(sample["target"]), -1).sum(dim=1)
    norms = {name: [module.weight, module.bias] for name, module in model.named_modules()
             if isinstance(module, unnorm.ChannelNorm)}
    params = [p for pair in norms.values() for p in pair]
    rows = [torch.autograd.grad(loss, params, retain_graph=True) for loss in per_sentence]
    grads, start = {}, 0
    for name in norms:
        grads[name] = torch.stack([torch.cat([g.flatten() for g in row[start:start + 2]]) for row in rows])
        start += 2
    return grads


def check_gns(data: str, run_dir: str) -> dict:
    """The trainer's --record-gns records of one update (LN, dropout 0) against each
    sentence's gradient by autograd, with the norms handed the pad mask and without: the
    largest relative differences of |g_i|^2 and |mean_i g_i|^2 over every norm, the
    examples; the same for each micro-batch of an update of two (--update-freq 2); then under
    --fp16 (loss scale 64), two updates and a skipped third: the steps kept, and the first
    step against the float32 trainer's."""
    summary = {}
    for mask in ("true", "false"):
        cfg, task, batches = setup(data, "ln", "--norm-pad-mask", mask, "--record-gns", run_dir, *TRAIN_FLAGS)
        torch.manual_seed(1)
        model = task.build_model(cfg.model)
        reference, criterion = copy.deepcopy(model), task.build_criterion(cfg.criterion)
        reference.record_gns = None  # recorded by no trainer: autograd's reference
        trainer = GuardedTrainer(cfg, task, model, criterion)
        sample = batches[0]
        trainer.train_step([sample])
        records = trainer.gns.recorder.flush()
        exact = sentence_gradients(reference, criterion, sample)
        summary[f"mask_{mask}"] = {
            "layers": sorted(records) == sorted(exact) and len(exact),
            "example_sq": max(relative(records[k]["example_sq"][0], g.square().sum(1)) for k, g in exact.items()),
            "batch_sq": max(relative(records[k]["batch_sq"][0], g.mean(0).square().sum()) for k, g in exact.items()),
            "examples": sorted({records[k]["examples"].item() for k in exact}),
            "sentences": sample["nsentences"], "padded": bool(sample["net_input"]["src_tokens"].eq(1).any())}
        if mask == "true":
            float32 = records
    # update_freq 2: an update of two micro-batches records each, against its own sentences
    cfg, task, batches = setup(data, "ln", "--update-freq", "2", "--record-gns", run_dir, *TRAIN_FLAGS)
    torch.manual_seed(1)
    model = task.build_model(cfg.model)
    reference, criterion = copy.deepcopy(model), task.build_criterion(cfg.criterion)
    reference.record_gns = None
    trainer = GuardedTrainer(cfg, task, model, criterion)
    trainer.train_step(batches[:2])
    records = trainer.gns.recorder.flush()
    exact = [sentence_gradients(reference, criterion, batch) for batch in batches[:2]]
    summary["update_freq_2"] = {
        "updates": trainer.get_num_updates(),
        "examples": records[next(iter(records))]["examples"].tolist(),
        "sentences": [batch["nsentences"] for batch in batches[:2]],
        "example_sq": max(relative(records[k]["example_sq"][i, :len(g)], g.square().sum(1))
                          for i, micro in enumerate(exact) for k, g in micro.items()),
        "batch_sq": max(relative(records[k]["batch_sq"][i], g.mean(0).square().sum())
                        for i, micro in enumerate(exact) for k, g in micro.items())}
    torch.Tensor.cuda = lambda tensor, *args, **kwargs: tensor  # as check_skipped_update
    trainer, batches = fp16_trainer(data, "ln", "--record-gns", run_dir, "--fp16-init-scale", "64")
    for batch in batches[:2]:
        trainer.train_step([batch])
    handle = overflow_in_head(trainer.get_model())
    trainer.train_step([batches[2]])
    handle.remove()
    records = trainer.gns.recorder.flush()
    summary["fp16"] = {
        "updates": trainer.get_num_updates(),
        "steps": sorted({len(values["batch_sq"]) for values in records.values()}),
        "examples": records[next(iter(records))]["examples"].tolist(),
        "sentences": [batch["nsentences"] for batch in batches[:2]],
        "vs_float32": max(relative(records[k]["example_sq"][0], float32[k]["example_sq"][0]) for k in records)}
    return summary


NF_FLAGS = ("--weight-standardization", "encoder.layers.*", "decoder.layers.*", "--ws-eps", "1e-6",
            "--ws-eps-form", "scaled", "--ws-gamma", "1.0")


def gradients(params) -> list:
    """Copies of the parameters' gradients (None where there is none)."""
    return [None if p.grad is None else p.grad.clone() for p in params]


def check_nf(data: str) -> dict:
    """The normalizer-free baseline in translation (--norm-type nonorm, Scaled WS, AGC).
    Standardisation: the model against a copy whose standardised weights are baked into plain
    layers, where fairseq's self-attention takes its fast path (the projections' weights handed
    to torch), and, as the control, the model with that fast path allowed again (it reads the
    raw weights). AGC: the gradients fairseq's optimizer steps with, against timm's
    adaptive_clip_grad applied to the gradients fairseq's clipping received, over two updates
    of GuardedTrainer; the control steps without --agc. The scale-invariance record that
    trainer writes before its first update. And the refusals."""
    model, net_input, _ = build(data, "nonorm", *NF_FLAGS)
    with torch.no_grad():  # gains away from 1, so a missed gain shows
        for name, parameter in model.named_parameters():
            if name.endswith(".gain"):
                parameter.uniform_(0.5, 1.5)
    model.train()
    attentions = [m for m in model.modules() if hasattr(m, "skip_embed_dim_check")]
    out = model(**net_input)[0]
    baked = copy.deepcopy(model)
    unnorm.bake_standardized_weights(baked)
    for module in baked.modules():
        if hasattr(module, "skip_embed_dim_check"):
            module.skip_embed_dim_check = False
    summary = {"standardized": sum(isinstance(m, StandardizedWeight) for m in model.modules()),
               "attentions": len(attentions),
               "calling": sum(m.skip_embed_dim_check for m in attentions),
               "vs_baked": relative(out, baked(**net_input)[0])}
    for module in attentions:
        module.skip_embed_dim_check = False
    summary["fast_path_control"] = relative(out, model(**net_input)[0])
    record_dir = tempfile.mkdtemp()
    for agc in ("0.01", None):
        flags = ["--optimizer", "adam", "--lr", "1e-3",
                 *(["--agc", agc, "--record-scale-invariance", record_dir] if agc else [])]
        cfg, task, batches = setup(data, "nonorm", *NF_FLAGS, *flags)
        torch.manual_seed(1)
        model = task.build_model(cfg.model)
        trainer = GuardedTrainer(cfg, task, model, task.build_criterion(cfg.criterion))
        seen = {"weights": [], "clipped_from": [], "stepped": [], "norms": []}
        fairseq_clip = type(trainer.optimizer).clip_grad_norm
        fairseq_step = type(trainer.optimizer).step

        def clip(self, max_norm, *args, **kwargs):
            seen["weights"].append([p.detach().clone() for p in self.params])
            seen["clipped_from"].append(gradients(self.params))
            norm = fairseq_clip(self, max_norm, *args, **kwargs)
            seen["norms"].append(float(norm))
            return norm

        def step(self, *args, **kwargs):
            seen["stepped"].append(gradients(self.params))
            return fairseq_step(self, *args, **kwargs)
        trainer.optimizer.clip_grad_norm = clip.__get__(trainer.optimizer)
        trainer.optimizer.step = step.__get__(trainer.optimizer)
        for batch in batches[:2]:
            trainer.train_step([batch])
        vs_timm, clipped, norms = [], 0, []
        for weights, before, after, norm in zip(seen["weights"], seen["clipped_from"],
                                                seen["stepped"], seen["norms"]):
            expected = [torch.nn.Parameter(w.clone()) for w in weights]
            for param, grad in zip(expected, before):
                param.grad = None if grad is None else grad.clone()
            adaptive_clip_grad(expected, 0.01)
            pairs = [(a, p.grad, b) for a, p, b in zip(after, expected, before) if b is not None]
            vs_timm.append(max(relative(a, e) for a, e, _ in pairs))
            clipped += sum(not torch.equal(a, b) for a, _, b in pairs)
            unclipped = torch.stack([b.double().norm() for _, _, b in pairs]).norm()
            norms.append(abs(norm - float(unclipped)) / float(unclipped))
        summary[f"agc={agc}"] = {"updates": trainer.get_num_updates(), "clipped": clipped,
                                 "tensors": len(pairs), "vs_timm": vs_timm,
                                 "grad_norm_vs_unclipped": norms}
    summary["scale_invariant"] = json.loads((Path(record_dir) / SCALE_INVARIANCE_FILE).read_text())
    refusals = {}
    for name, flags in (("clip_norm", ["--agc", "0.01", "--clip-norm", "0.1"]),
                        ("fp16", ["--agc", "0.01", "--fp16"]), ("zero", ["--agc", "0"])):
        try:
            adaptive_clipping(setup(data, "nonorm", *flags)[0])
            refusals[name] = None
        except ValueError as refusal:
            refusals[name] = str(refusal)
    summary["refusals"] = refusals
    return summary


def check_updates(data: str) -> dict:
    """``--record-updates`` in GuardedTrainer, as fairseq-train runs an epoch (inside its
    ``train`` aggregator): two updates of the tiny model whose stacks' layers all have Scaled
    WS (row-invariant weights), by the release's AdamP and by fairseq's adam. Reports the
    epoch's ``updates`` statistic and each update's effective step computed here from copies
    of the trainable weights before and after it; and the refusal under fully_sharded."""
    summary = {}
    for optimizer in (("adamp", "--delta", "0.1", "--wd-ratio", "0.1"), ("adam",)):
        metrics.reset()  # as fairseq-train's main does: one trainer's aggregators
        cfg, task, batches = setup(data, "nonorm", *NF_FLAGS, "--lr", "1e-3", "--record-updates",
                                   "--optimizer", *optimizer)
        torch.manual_seed(1)
        trainer = GuardedTrainer(cfg, task, task.build_model(cfg.model),
                                 task.build_criterion(cfg.criterion))
        weights = [p for p in trainer.get_model().parameters() if p.requires_grad]
        steps = []
        with metrics.aggregate("train"):
            trainer.begin_epoch(1)
            for batch in batches[:2]:
                before = [w.detach().double().clone() for w in weights]
                trainer.train_step([batch])
                moved = torch.stack([(w.detach().double() - b).norm() for w, b in zip(weights, before)])
                steps.append((moved.norm() / torch.stack([b.norm() for b in before]).norm()).item())
            record = metrics.get_smoothed_values("train")[UPDATES]
        summary[optimizer[0]] = {"record": record, "steps": steps,
                                 "updates": trainer.get_num_updates(),
                                 "parameters": sum(w.numel() for w in weights)}
    try:
        recording_updates(setup(data, "nonorm", "--record-updates", "--ddp-backend",
                                "fully_sharded")[0])
        summary["fully_sharded"] = None
    except ValueError as refusal:
        summary["fully_sharded"] = str(refusal)
    return summary


def check_landscape(data: str) -> dict:
    """``--record-landscape 1`` in GuardedTrainer: three updates of the tiny model with UN and
    dropout, against the same three without it. Reports whether the weights, every buffer and
    the losses came out bit for bit the same, the rows written, and the refusals."""
    runs = {}
    with tempfile.TemporaryDirectory() as run_dir:
        for name, flags in (("plain", ()), ("probed", ("--record-landscape", "1", "--landscape-dir",
                                                       run_dir))):
            cfg, task, batches = setup(data, "un", "--dropout", "0.1", "--optimizer", "adam",
                                       "--lr", "1e-3", *flags)
            torch.manual_seed(1)
            trainer = GuardedTrainer(cfg, task, task.build_model(cfg.model),
                                     task.build_criterion(cfg.criterion))
            trainer.begin_epoch(1)
            losses = [trainer.train_step([batch])["loss"] for batch in batches[:3]]
            runs[name] = (trainer.get_model().state_dict(), losses)
        rows = [json.loads(line) for line in (Path(run_dir) / "landscape.jsonl").read_text().splitlines()]
    (plain, plain_losses), (probed, probed_losses) = runs["plain"], runs["probed"]
    refusals = {}
    for name, flags in {"fp16": ("--fp16",), "sam": ("--sam", "true"),
                        "no_dir": ()}.items():
        try:
            landscape_every(setup(data, "ln", "--record-landscape", "2",
                                  *(() if name == "no_dir" else ("--landscape-dir", "x")), *flags)[0])
            refusals[name] = None
        except ValueError as refusal:
            refusals[name] = str(refusal)
    # fairseq's positions keep an uninitialised one-element tensor for its dtype only
    return {"same_state": all(torch.equal(value, probed[key]) for key, value in plain.items()
                              if not key.endswith("._float_tensor")),
            "same_losses": plain_losses == probed_losses, "losses": probed_losses,
            "rows": rows, "refusals": refusals}


CHECKS = {"landscape": check_landscape, "nf": check_nf, "padding": check_padding, "same-weights": check_same_weights,
          "precision": check_precision,
          "groups": check_groups, "sepnorm": check_sepnorm, "skipped-update": check_skipped_update,
          "loss-scale": check_loss_scale, "norm-state": check_norm_state, "gns": check_gns,
          "updates": check_updates}

if __name__ == "__main__":
    check, *paths = sys.argv[1:]
    print(json.dumps(CHECKS[check](*paths), indent=1))
