"""Checks of training through the norms in translation (``plugins.fairseq.train``: ``--sam``,
``--train-only``) that need fairseq, run by tests/test_fairseq.py with the Python of
fairseq's environment:

    .venv-fairseq/bin/python tests/fairseq_sam_checks.py update DATA_BIN
    .venv-fairseq/bin/python tests/fairseq_sam_checks.py refusals DATA_BIN
    .venv-fairseq/bin/python tests/fairseq_sam_checks.py fp16 DATA_BIN
    .venv-fairseq/bin/python tests/fairseq_sam_checks.py run RUN_DIR

Each prints a JSON summary (the tests assert on it). The expectations are computed here from
the model, the criterion and autograd, not from plugins.sam.
"""
import contextlib
import copy
import json
import sys

import torch
from fairseq import options, tasks, utils
from fairseq.dataclass.utils import convert_namespace_to_omegaconf

import unnorm
from fairseq_checks import fp16_trainer, norm_buffers, overflow_in_head, setup
from plugins.fairseq.checkpoints import load
from plugins.fairseq.train import GuardedTrainer
from plugins.sam import norm_parameters

SGD = ("--optimizer", "sgd", "--lr", "0.1", "--lr-scheduler", "fixed", "--criterion",
       "label_smoothed_cross_entropy", "--label-smoothing", "0.1")
SAM_ON = ("--sam", "true", "--sam-rho", "0.5", "--sam-only-norm", "true")
RHO, LR = 0.5, 0.1


def trainer_for(data: str, norm: str, *flags: str, shared: bool = True):
    """fairseq's trainer of plugins.fairseq.train for the tiny model (float32, CPU, dropout 0;
    ``shared``: every embedding and the output projection one matrix), and test batches."""
    cfg, task, batches = setup(data, norm, *flags)
    if not shared:
        args = options.parse_args_and_arch(options.get_training_parser(), [
            data, "--user-dir", cfg.common.user_dir, "--task", "translation", "--arch",
            "unnorm_transformer_tiny", "--norm-type", norm, "--encoder-normalize-before",
            "--decoder-normalize-before", "--dropout", "0", "--cpu", "--seed", "1", *flags])
        cfg = convert_namespace_to_omegaconf(args)
    torch.manual_seed(1)
    model = task.build_model(cfg.model)
    return GuardedTrainer(cfg, task, model, task.build_criterion(cfg.criterion)), batches


def affine(model) -> dict:
    """Every norm layer's weight and bias, by name: what SAM-ON perturbs, found here by type."""
    return {f"{name}.{key}": p for name, module in model.named_modules()
            if isinstance(module, unnorm.ChannelNorm)
            for key, p in module.named_parameters(recurse=False) if key in ("weight", "bias")}


def gradients(model, criterion, sample):
    """Every parameter's gradient of the summed loss (as fairseq backpropagates it), and the
    sample size fairseq divides it by."""
    model.train()
    model.zero_grad(set_to_none=True)
    loss, sample_size, _ = criterion(model, sample)
    loss.backward()
    return {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}, sample_size


def sam_on_step(start, criterion, sample) -> tuple[dict, dict, dict]:
    """SAM-ON's SGD update of ``start`` on ``sample``, written out, with the plain update as
    the control: g1 at w, eps = rho g1 / ||g1|| over the norms' affine, g2 at w + eps from the
    norms' state at the update's start, w' = w - lr g2 / sample_size (float32). Returns the
    expected weights, the plain update's, and the first pass's model (its norms' state)."""
    first = copy.deepcopy(start).float()
    g1, sample_size = gradients(first, criterion, sample)
    perturbed = copy.deepcopy(start).float()
    norms = affine(perturbed)
    scale = RHO / torch.stack([g1[name].norm() for name in norms]).norm()
    with torch.no_grad():
        for name, p in norms.items():
            p.add_(g1[name] * scale)
    g2, _ = gradients(perturbed, criterion, sample)
    # parameters without a gradient (fairseq's unused fast-path copies) do not move
    weights = {name: p.detach().float() for name, p in start.named_parameters()}
    expected = {name: w - LR * g2.get(name, 0 * w) / sample_size for name, w in weights.items()}
    plain = {name: w - LR * g1.get(name, 0 * w) / sample_size for name, w in weights.items()}
    return expected, plain, first


def off_by(weights: dict, expected: dict, start: dict) -> float:
    """How far ``weights`` are from ``expected``, relative to the expected update: both
    as the norm over every parameter (single tensors with no expected step, such as the
    attention's key biases, would make a per-tensor ratio rounding over zero)."""
    distance = torch.stack([(weights[k].float() - expected[k]).norm() for k in expected]).norm()
    step = torch.stack([(expected[k] - start[k].float()).norm() for k in expected]).norm()
    return (distance / step).item()


def check_update(data: str) -> dict:
    """One SAM-ON update of fairseq's trainer (UN, plain SGD at lr 0.1, no clipping) against
    SAM-ON written out (``sam_on_step``), and against the plain update (the control); the
    norms' state after it against the first pass's alone (the same forward at w); then the
    step counters after 3 updates; then an update whose second pass runs out of memory, from
    which fairseq recovers by dropping the update: the weights (perturbed when it failed) and
    the norms as they were."""
    trainer, batches = trainer_for(data, "un", *SGD, *SAM_ON)
    model, sample = trainer.get_model(), batches[0]
    start = copy.deepcopy(model)
    expected, plain, first = sam_on_step(start, trainer.criterion, sample)
    trainer.train_step([sample])
    weights, before = dict(model.named_parameters()), dict(start.named_parameters())
    after, first_pass = norm_buffers(model), norm_buffers(first)
    summary = {
        "updates": trainer.get_num_updates(),
        "perturbed": sorted(trainer.sam.perturbed) == sorted(affine(model)),
        "vs_sam": off_by(weights, expected, before),
        "vs_plain": off_by(weights, plain, before),
        "norm_state_as_first_pass": all(torch.equal(after[k], first_pass[k]) for k in after),
        "norm_state_buffers": len(after)}
    for batch in batches[1:3]:
        trainer.train_step([batch])
    summary["updates_after"] = trainer.get_num_updates()
    summary["num_iters"] = sorted({int(v) for k, v in norm_buffers(model).items() if k.endswith("num_iters")})
    # the second pass runs out of memory: fairseq drops the update and goes on
    weights, buffers = copy.deepcopy(model.state_dict()), norm_buffers(model)
    calls = []

    def out_of_memory(module, args):
        calls.append(1)
        if len(calls) == 2:
            raise RuntimeError("CUDA out of memory (raised by the check)")

    handle = model.register_forward_pre_hook(out_of_memory)
    summary["oom_returned"] = trainer.train_step([batches[3]])
    handle.remove()
    summary["oom"] = {"forwards": len(calls), "updates": trainer.get_num_updates(),
                      "weights_unchanged": all(torch.equal(v, model.state_dict()[k]) for k, v in weights.items()),
                      "norms_unchanged": all(torch.equal(buffers[k], v) for k, v in norm_buffers(model).items())}
    return summary


def trained(trainer) -> dict:
    model = trainer.get_model()
    return {"trainable": sum(p.numel() for p in model.parameters() if p.requires_grad),
            "perturbed": None if trainer.sam is None else sum(p.numel() for p in trainer.sam.perturbed.values()),
            "norms": sum(p.numel() for p in norm_parameters(model).values()),
            "affine": sum(p.numel() for p in affine(model).values()),
            "all": sum(p.numel() for p in model.parameters()),
            "head": sum(p.numel() for p in model.decoder.output_projection.parameters()),
            "optimized": sum(p.numel() for p in trainer.optimizer.params)}


def refusal(data: str, *flags: str) -> str:
    try:
        trainer_for(data, "un", *SGD, *flags)
    except ValueError as error:
        return str(error)
    return "accepted"


def check_refusals(data: str) -> dict:
    """What each setting trains (and fairseq's optimizer holds), and what is refused: SAM
    over two micro-batches per update, norm+head with the head tied to the embeddings, and
    the flags without plugins.fairseq.train (a training forward of the model alone)."""
    summary = {}
    for name, flags in (("sam", ("--sam", "true", "--sam-rho", "0.05")), ("sam_on", SAM_ON),
                        ("norm", ("--train-only", "norm")),
                        ("norm+head", ("--train-only", "norm+head", *SAM_ON))):
        trainer, _ = trainer_for(data, "un", *SGD, *flags, shared=name != "norm+head")
        summary[name] = trained(trainer)
    summary["update_freq_2"] = refusal(data, *SAM_ON, "--update-freq", "2")
    summary["tied_head"] = refusal(data, "--train-only", "norm+head")
    cfg, task, batches = setup(data, "un", *SGD, *SAM_ON)
    model = task.build_model(cfg.model).train()
    try:
        model(**batches[0]["net_input"])  # as fairseq-train's criterion would call it
        summary["fairseq_train"] = "trained"
    except RuntimeError as error:
        summary["fairseq_train"] = str(error)
    return summary


def check_fp16(data: str) -> dict:
    """SAM-ON and SAM under --fp16 (FP16Optimizer, loss scale 64): two updates, then a third
    whose head gradient overflows in both passes, which fairseq skips. Reports whether the
    model's half-precision weights, fairseq's float32 master weights and every norm's buffers
    came out of it as they went in, the scale, and the step counters (one per update taken)."""
    torch.Tensor.cuda = lambda tensor, *args, **kwargs: tensor  # as fairseq_checks' fp16 checks
    # a taken update: fairseq's float32 master weights step with the second pass's gradient
    cfg, task, batches = setup(data, "un", "--fp16", "--fp16-no-flatten-grads", "--fp16-init-scale",
                               "64", *SGD, *SAM_ON)
    torch.manual_seed(1)
    model = task.build_model(cfg.model)
    trainer = GuardedTrainer(cfg, task, model, task.build_criterion(cfg.criterion))
    model = trainer.get_model()
    start = copy.deepcopy(model)  # the half-precision weights, as the master copy holds them
    expected, plain, _ = sam_on_step(start, trainer.criterion, batches[0])
    trainer.train_step([batches[0]])
    names = [name for name, p in model.named_parameters() if p.requires_grad]
    master = dict(zip(names, trainer.optimizer.fp32_params))
    before = dict(start.named_parameters())
    summary = {"step": {"vs_sam": off_by(master, expected, before), "vs_plain": off_by(master, plain, before),
                        "updates": trainer.get_num_updates()}}
    for name, flags in (("sam_on", SAM_ON), ("sam", ("--sam", "true", "--sam-rho", "0.05"))):
        trainer, batches = fp16_trainer(data, "un", "--fp16-init-scale", "64", *flags)
        model = trainer.get_model()
        for batch in batches[:2]:
            trainer.train_step([batch])
        weights = {k: v.detach().clone() for k, v in model.state_dict().items() if not k.endswith("_float_tensor")}
        master = [p.detach().clone() for p in trainer.optimizer.fp32_params]
        buffers, scale = norm_buffers(model), trainer.optimizer.scaler.loss_scale
        handle = overflow_in_head(model)
        trainer.train_step([batches[2]])
        handle.remove()
        now = {k: v for k, v in model.state_dict().items() if not k.endswith("_float_tensor")}
        summary[name] = {
            "updates": trainer.get_num_updates(), "scale": [scale, trainer.optimizer.scaler.loss_scale],
            "half": str(next(model.parameters()).dtype),
            "weights_unchanged": all(torch.equal(weights[k], now[k]) for k in weights),
            "master_unchanged": all(torch.equal(a, b) for a, b in zip(master, trainer.optimizer.fp32_params)),
            "norms_unchanged": all(torch.equal(buffers[k], v) for k, v in norm_buffers(model).items()),
            "num_iters": sorted({int(v) for k, v in norm_buffers(model).items() if k.endswith("num_iters")})}
        trainer.train_step([batches[3]])  # and the next update is taken
        summary[name]["updates_then"] = trainer.get_num_updates()
        summary[name]["num_iters_then"] = sorted({int(v) for k, v in norm_buffers(model).items()
                                                  if k.endswith("num_iters")})
        summary[name]["finite"] = all(torch.isfinite(p).all().item() for p in model.parameters())
    return summary


def check_run(run_dir: str) -> dict:
    """A launcher run's last checkpoint against the model its training command initialises
    (fairseq-train's seeding, then the task and model): which parameters equal their
    initialisation bitwise and which changed, the norms' parameter count of that model
    (plugins.sam.norm_parameters) and the norms' step counters."""
    command = open(f"{run_dir}/train_command.txt").read().split()
    args = options.parse_args_and_arch(options.get_training_parser(),
                                       command[command.index("plugins.fairseq.train") + 1:])
    cfg = convert_namespace_to_omegaconf(args)
    utils.set_torch_seed(cfg.common.seed)
    model = tasks.setup_task(cfg.task).build_model(cfg.model)
    state = load(f"{run_dir}/checkpoints/checkpoint_last.pt", "run")["model"]
    norms = set(norm_parameters(model))
    same = {name: torch.equal(state[name], p.detach()) for name, p in model.named_parameters()}
    return {"norm_parameters": sum(p.numel() for p in norm_parameters(model).values()),
            "parameters": sum(p.numel() for p in model.parameters()),
            "others_unchanged": all(same[name] for name in same if name not in norms),
            "others": sum(name not in norms for name in same),
            "norms_changed": [name for name in sorted(norms) if same[name]] == [],
            "norms": len(norms),
            "num_iters": sorted({int(v) for k, v in state.items() if k.endswith(".num_iters")})}


CHECKS = {"update": check_update, "refusals": check_refusals, "fp16": check_fp16, "run": check_run}

if __name__ == "__main__":
    check, *paths = sys.argv[1:]
    with contextlib.redirect_stdout(sys.stderr):  # the trainer's own lines: stdout is the summary's
        summary = CHECKS[check](*paths)
    print(json.dumps(summary, indent=1))
