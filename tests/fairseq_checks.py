"""Checks of the fairseq plugin that need fairseq, run by tests/test_fairseq.py with the Python
of fairseq's environment (the main one cannot import fairseq):

    .venv-fairseq/bin/python tests/fairseq_checks.py padding DATA_BIN
    .venv-fairseq/bin/python tests/fairseq_checks.py same-weights CHECKPOINT_A CHECKPOINT_B

Each prints a JSON summary and exits non-zero, with the reason, when a check fails.
"""
import copy
import json
import sys
from contextlib import nullcontext
from pathlib import Path

import torch
from fairseq import options, tasks
from fairseq.dataclass.utils import convert_namespace_to_omegaconf

import unnorm

USER_DIR = str(Path(__file__).resolve().parents[1] / "plugins" / "fairseq" / "unnorm_fairseq")
EXTRA_PAD = 3   # padding columns added to source (left) and target (right)
STEPS = 4       # training steps per norm: UN's warm-up of 2 is followed by its window phase


def build(data: str, norm: str):
    args = options.parse_args_and_arch(options.get_training_parser(), [
        data, "--user-dir", USER_DIR, "--task", "translation", "--arch", "unnorm_transformer_tiny",
        "--norm-type", norm, "--encoder-normalize-before", "--decoder-normalize-before",
        "--share-all-embeddings", "--dropout", "0", "--cpu", "--seed", "1"]
        + (["--un-warmup", "2"] if norm in ("un", "mabn", "pn", "pn_ls") else []))
    cfg = convert_namespace_to_omegaconf(args)
    task = tasks.setup_task(cfg.task)
    task.load_dataset("test")
    dataset = task.dataset("test")
    batch = dataset.collater([dataset[i] for i in range(12)])
    torch.manual_seed(1)
    return task.build_model(cfg.model), batch["net_input"], task.source_dictionary.pad()


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


def check_padding(data: str) -> dict:
    """Padding amount and pad values change nothing at valid positions, for every norm, over
    training steps (batch statistics, windows) and in eval; without the masks BN would change."""
    summary = {}
    for norm in unnorm.available_norms():
        model, net_input, pad = build(data, norm)
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
        if max(diffs.values()) > 1e-4:
            raise SystemExit(f"{norm}: padding changed outputs at valid positions: {diffs}")
    model, net_input, pad = build(data, "bn")
    unmasked = copy.deepcopy(model)
    control = compare(forward(model, net_input), forward(unmasked, pad_more(net_input, pad), feed_masks=False),
                      net_input["src_tokens"].ne(pad), net_input["prev_output_tokens"].ne(pad), EXTRA_PAD)
    summary["bn_without_masks"] = control
    if control < 1e-3:
        raise SystemExit(f"control: BN without pad masks should see the padding, changed {control}")
    return summary


def check_same_weights(path_a: str, path_b: str) -> dict:
    """Two checkpoints hold bitwise identical model weights under the same names (but for
    fairseq's ``_float_tensor``, an uninitialised buffer kept only for its dtype and device)."""
    a, b = ({k: v for k, v in torch.load(path, map_location="cpu", weights_only=False)["model"].items()
             if not k.endswith("._float_tensor")} for path in (path_a, path_b))
    if set(a) != set(b):
        raise SystemExit(f"different parameters: {sorted(set(a) ^ set(b))[:10]}")
    different = [k for k in a if not torch.equal(a[k], b[k])]
    if different:
        raise SystemExit(f"{len(different)} tensors differ, e.g. {different[:5]}")
    return {"tensors": len(a), "identical": True}


if __name__ == "__main__":
    check, *paths = sys.argv[1:]
    result = {"padding": check_padding, "same-weights": check_same_weights}[check](*paths)
    print(json.dumps(result, indent=1))
