"""fairseq-train with loss scaling that the norms do not see (runs in fairseq's environment).

    python -m plugins.fairseq.train DATA --user-dir plugins/fairseq/unnorm_fairseq ...  (fairseq-train's flags)

Under ``--fp16`` fairseq multiplies the loss by a dynamic scale and skips an update whose
gradients overflowed (its ``DynamicLossScaler``; ``--amp``: torch's ``GradScaler``). UN, MABN
and PN would keep their gradient statistics in loss-scaled units, and every norm would keep
the state of a skipped update. This is fairseq-train with one change, its trainer's
``train_step``: each update runs inside an ``unnorm.LossScaleGuard``, which hands the norms
the update's loss scale (their statistics stay in unscaled units) and restores every norm's
state when fairseq takes no update (an overflow, or a batch that ran out of memory). fairseq
builds its trainer by the name ``fairseq_cli.train.Trainer``; every training process (one per
GPU) runs ``main`` below, which points that name at ``GuardedTrainer`` first.

With ``--record-gns RUN_DIR`` (the model's flag) the trainer also records the norms'
per-example gradient norms (``unnorm.gns``; a sentence is an example, and fairseq's criteria
backpropagate the sum of their losses) and writes each epoch's, as the other tasks' training
loop does (``plugins.runlog.save_gns``), to ``RUN_DIR/gns/epoch_XXXX.pt`` (rank 0): at the
start of the next epoch, and after training for the last one (also when it failed).

Training through the norms (the model's flags, ``plugins.fairseq.flags``), as the other tasks'
shared loop does it, with ``plugins.sam``:

* ``--train-only norm|norm+head`` freezes every other parameter (``plugins.sam.freeze_except``)
  before fairseq builds its optimizer, which takes the trainable ones only. The head is the
  decoder's output projection; where it is tied to an embedding (``--share-all-embeddings``,
  ``--share-decoder-input-output-embed``) ``norm+head`` is refused, naming the fix, rather
  than train the input embeddings too.
* ``--sam true`` (``--sam-rho``, ``--sam-only-norm``, ...: ``plugins.sam.SharpnessAware``)
  makes each update fairseq's forward and backward of its sample, then the second pass on the
  same sample at the perturbed weights (``SharpnessAware.perturbed_gradient``, which also keeps
  the norms' running state to one advance per update), then fairseq's clipping and optimizer
  step, which take the second pass's gradient. Both passes sit inside the update's
  ``LossScaleGuard``: a skipped update (an overflow in either pass under ``--fp16``) leaves the
  weights and every norm as they were. Under ``--fp16`` the perturbation moves the half-
  precision weights the forward uses (fairseq's float32 master copy is not touched, and the
  step reads the second pass's gradient when fairseq copies it there). More than one
  micro-batch per update (``--update-freq``) is refused: the ascent needs the whole update's
  gradient first.

``--agc LAMBDA`` (the model's flag; ``recipe.agc``, the normalizer-free baseline's clipping)
clips adaptively where fairseq clips by the global norm (``clip_grad_norm``): timm's
``adaptive_clip_grad`` on the parameters fairseq's optimizer steps, their gradients as fairseq's
own clipping sees them (summed over the update's micro-batches and replicas, divided by its
tokens). fairseq's gradient norm is still computed, unclipped, for its logs and its check for
non-finite gradients. It is refused with ``--clip-norm`` (two clippings of one step), under
``--fp16``/``--amp`` (whose optimizers step a float32 copy, or unscale, after the point where this
clips) and with ``--ddp-backend fully_sharded`` (whose flat shards have no output units).

With ``--record-scale-invariance RUN_DIR`` (``record_scale_invariance=true``) rank 0 writes
``RUN_DIR/scale_invariance.json`` before the run's first update: the weights the model is
exactly scale-invariant in at its start, found as the other tasks' trainers find them
(``plugins.training.invariance_at_start``: ``unnorm.scale_invariance`` on a float64 copy) on
the first ``PROBE_EXAMPLES`` sentences of the first batch, the decoder's logits being what the
criterion reads. A resumed run (updates taken) writes none, and one already there is kept.

With ``--record-updates`` (``record_updates=true``) each epoch's ``train`` statistics in
fairseq's log gain ``updates``, what the other tasks' loop writes per epoch
(``plugins.optim.UpdateRecord``: each param group's effective step ||dw|| / ||w||, AdamP's and
SGDP's projections), which the launcher puts into that epoch's ``metrics.jsonl`` row. It
measures every optimizer step fairseq takes (under ``--fp16``, of the float32 master weights);
an update skipped before its step (an ``--fp16`` overflow) is left out, as the GNS records
leave it out, while a step ``--amp``'s scaler skips counts as 0, as in the other tasks. It is
refused with ``--ddp-backend fully_sharded`` (flat shards of the weights).

With ``--record-landscape K --landscape-dir RUN_DIR`` (``record_landscape=K``) every K-th
update probes the loss landscape along its gradient (``plugins.landscape``): fairseq's
gradient as its clipping receives it (summed over the update's micro-batches, divided by
its tokens), the loss the criterion's sum over them divided by the same count (nats per
token, not fairseq's logged base 2), each step size's point the update's forward and
backward of its samples again, from fairseq's seed for the update (its dropout masks).
Each row is appended to ``RUN_DIR/landscape.jsonl`` at once; a resumed run probes the
updates it trains again anew (``analysis.landscape`` keeps a step's last row). Refused, by
name, under ``--fp16``/``--amp``/``--bf16`` (fairseq's optimizers step a float32 copy the
probe does not step along), on more than one process (the probe would have to repeat
fairseq's reduction of the sample sizes) and with ``--sam``.

The trainer prints the perturbed set's size and share, and what it trains as one
``plugins.fairseq.flags.TRAINED`` line, which the launcher records in ``result.json``
(``trainable_parameters``, ``sam_perturbed_parameters``).
"""
from __future__ import annotations

import sys
from pathlib import Path

import torch
from fairseq import options
from fairseq.dataclass.utils import convert_namespace_to_omegaconf
from fairseq.distributed import utils as distributed_utils
from fairseq.logging import metrics
from fairseq.logging.meters import MetersDict
from fairseq.trainer import Trainer
from fairseq_cli import train as fairseq_train
from timm.utils.agc import adaptive_clip_grad

import unnorm
from plugins.fairseq.flags import UPDATES, sam_entry, trained_line
from plugins.landscape import LandscapeRecorder, probe_update
from plugins.optim import UpdateRecord
from plugins.runlog import (PROBE_EXAMPLES, SCALE_INVARIANCE_FILE, RunDirectory, save_gns,
                            write_scale_invariance)
from plugins.sam import configured, freeze_except, trained_parameters

FLUSH_EVERY = 100  # updates between moving the GNS records off the device


def loss_scale(optimizer) -> float:
    """What fairseq multiplies the loss by in the coming update: its ``DynamicLossScaler``'s
    scale (``--fp16``), the ``GradScaler``'s (``--amp``), else 1."""
    scaler = getattr(optimizer, "scaler", None)
    if scaler is None:
        return 1.0
    return scaler.get_scale() if hasattr(scaler, "get_scale") else scaler.loss_scale


class EpochGNS:
    """The GNS records of one training process, saved per epoch as ``save_gns`` saves them.

    Time-first (T, B, C) input: the sentences are on axis 1; the loss is their summed losses
    (``loss_multiplier`` 1: fairseq divides the gradients by the token count only after the
    backward, and accumulates micro-batches without dividing). A record's ``examples`` are
    its micro-batch's sentences (every sentence has a valid row on each side), which vary with
    fairseq's batches of tokens: an epoch's ``batch_size`` is their mean over its records."""

    def __init__(self, model, run_dir: str, update_freq, replicas: int, writer: bool):
        self.recorder = unnorm.record_gns(model, example_dim=1, loss_multiplier=1.0, reduction="sum")
        self.run = RunDirectory(Path(run_dir), writer=writer)
        self.update_freq, self.replicas = list(update_freq), replicas
        self.epoch, self.chunks, self.updates = None, [], 0

    def end_update(self, skipped: bool) -> None:
        """Count a taken update. A skipped one's records (an overflow, an out-of-memory
        batch) are dropped by the trainer's ``LossScaleGuard``."""
        if skipped:
            return
        self.updates += 1
        if self.updates % FLUSH_EVERY == 0:
            self.chunks.append(self.recorder.flush())

    def begin_epoch(self, epoch: int) -> None:
        self.save()
        self.epoch = epoch

    def save(self) -> None:
        """Write the current epoch's records (nothing before the first epoch or if none)."""
        first = next(iter(self.recorder.layers))
        chunks = [chunk for chunk in self.chunks + [self.recorder.flush()] if chunk.get(first)]
        self.chunks = []
        if self.epoch is None or not chunks or not self.run.writer:
            return
        examples = torch.cat([chunk[first]["examples"] for chunk in chunks])
        save_gns(self.run, self.epoch - 1, chunks, {
            "batch_size": examples.double().mean().item(), "replicas": self.replicas,
            "accumulate": self.update_freq[min(self.epoch, len(self.update_freq)) - 1]})


def adaptive_clipping(cfg):
    """``--agc``'s clipping factor (None: fairseq's own clipping), refused where it cannot be
    what it says (the module docstring)."""
    agc = getattr(cfg.model, "agc", None)
    if agc is None:
        return None
    if agc <= 0:
        raise ValueError(f"--agc {agc}: the clipping factor must be positive (NF-Nets: 0.01 to "
                         "0.16), or leave --agc out")
    if cfg.optimization.clip_norm:
        raise ValueError(f"--agc {agc} and --clip-norm {cfg.optimization.clip_norm} both clip the "
                         "gradients: set --clip-norm 0 (recipe.train.clip_norm=0.0) for adaptive "
                         "clipping, or drop --agc (recipe.agc=null)")
    half = [flag for flag in ("fp16", "memory_efficient_fp16", "amp", "bf16")
            if getattr(cfg.common, flag, False)]
    if half:
        raise ValueError(f"--agc with --{half[0].replace('_', '-')}: fairseq's half-precision "
                         "optimizers step a float32 copy of the weights (or unscale) after the "
                         "point where --agc clips; train in float32 (amp=false) or drop --agc")
    if cfg.distributed_training.ddp_backend == "fully_sharded":
        raise ValueError("--agc with --ddp-backend fully_sharded: the shards are flat, with no "
                         "output units to clip by; use another --ddp-backend or drop --agc")
    return agc


def recording_updates(cfg) -> bool:
    """Whether ``--record-updates`` is on, refused where it cannot measure the weights."""
    if not getattr(cfg.model, "record_updates", False):
        return False
    if cfg.distributed_training.ddp_backend == "fully_sharded":
        raise ValueError("--record-updates with --ddp-backend fully_sharded: each process steps "
                         "a flat shard of the weights, whose norms are not the param groups'; use "
                         "another --ddp-backend, or drop --record-updates (record_updates=false)")
    return True


def landscape_every(cfg) -> int:
    """``--record-landscape``'s updates between probes (0: off), refused where the probe
    cannot step along fairseq's gradient (the module docstring)."""
    every = getattr(cfg.model, "record_landscape", 0) or 0
    if not every:
        return 0
    half = [flag for flag in ("fp16", "memory_efficient_fp16", "amp", "bf16")
            if getattr(cfg.common, flag, False)]
    why = (f"--{half[0].replace('_', '-')}: fairseq's half-precision optimizers step a float32 "
           "copy of the weights, apart from the ones the probe would step" if half else
           f"{cfg.distributed_training.distributed_world_size} processes: the probe runs on one"
           if cfg.distributed_training.distributed_world_size > 1 else
           "--sam: its second pass replaces the gradient the probe steps along"
           if getattr(cfg.model, "sam", False) else
           "no --landscape-dir to write landscape.jsonl into"
           if not getattr(cfg.model, "landscape_dir", None) else None)
    if why is not None:
        raise ValueError(f"--record-landscape (record_landscape={every}) is not available in the "
                         f"fairseq backend with {why}; train in float32 (amp=false) on one "
                         "process without sam, or record_landscape=0")
    return every


def output_projection(model):
    """The head of ``--train-only norm+head``: the decoder's output projection, refused where
    it is an embedding's weight too (training it would train the input embeddings)."""
    decoder = getattr(model, "decoder", None)
    head = getattr(decoder, "output_projection", None)
    if head is None:
        raise ValueError("--train-only norm+head: the decoder has no output projection (an "
                         "adaptive softmax?) to train as the head; use --train-only norm")
    embeddings = [module.weight for module in (getattr(getattr(model, "encoder", None), "embed_tokens", None),
                                               getattr(decoder, "embed_tokens", None))
                  if module is not None]
    if any(head.weight is weight for weight in embeddings):
        raise ValueError("--train-only norm+head: the output projection (the head) is tied to an "
                         "embedding (--share-all-embeddings or --share-decoder-input-output-embed), "
                         "so training it would train the input embeddings too; drop those flags "
                         "(recipe.train.share_all_embeddings=false) or use --train-only norm")
    return head


class GuardedTrainer(Trainer):
    """fairseq's ``Trainer`` with every update inside an ``unnorm.LossScaleGuard``, the
    norms' per-example gradient norms recorded per epoch with ``--record-gns``, and the
    model's ``--train-only``, ``--sam`` and ``--agc`` applied."""

    def __init__(self, cfg, task, model, criterion, quantizer=None):
        super().__init__(cfg, task, model, criterion, quantizer)
        self.guard = unnorm.LossScaleGuard(self.get_model())  # cast and on its device by now
        run_dir = getattr(cfg.model, "record_gns", None)
        # every process records its own micro-batches, rank 0 writes its own (as the other
        # tasks' loop): fairseq pads only the later ranks' shards with dummy batches
        self.gns = EpochGNS(self.get_model(), run_dir, cfg.optimization.update_freq,
                            self.data_parallel_world_size,
                            self.is_data_parallel_master) if run_dir else None
        self._updating = self._second_pass_due = False
        self.agc = adaptive_clipping(cfg)
        self.invariance_dir = getattr(cfg.model, "record_scale_invariance", None)
        self.updates = None  # --record-updates: an UpdateRecord from the first epoch on
        self.record_updates = recording_updates(cfg)
        self.sam = self._train_through_the_norms(cfg, self.get_model())
        self.landscape, self._probe, self._epoch = self._record_landscape(cfg), None, 1

    def _record_landscape(self, cfg):
        """``--record-landscape``'s recorder (or None); the task's ``train_step`` keeps each
        probed update's losses and token counts (``_probe``)."""
        every = landscape_every(cfg)
        if not every:
            return None
        model = self.get_model()
        self.landscape_run = RunDirectory(Path(cfg.model.landscape_dir),
                                          writer=self.is_data_parallel_master)
        self._plain_train_step = task_step = self.task.train_step

        def kept(*args, **kwargs):
            outputs = task_step(*args, **kwargs)
            if self._probe is not None:
                self._probe[2].append((outputs[0].detach(), outputs[1]))
            return outputs
        self.task.train_step = kept
        return LandscapeRecorder(every, model, [p for p in model.parameters() if p.requires_grad],
                                 next(model.parameters()).device)

    def _probe_landscape(self) -> None:
        """The update's landscape along the gradient fairseq is about to clip (the module
        docstring), appended to ``landscape.jsonl``."""
        probe, samples, outputs = self._probe
        self._probe = None

        def evaluate() -> torch.Tensor:
            self._set_seed()  # fairseq's seed of the update: its dropout masks
            total, tokens = 0.0, 0
            for sample in samples:
                sample, dummy = self._prepare_sample(sample)
                loss, size, _ = self._plain_train_step(
                    sample=sample, model=self.model, criterion=self.criterion,
                    optimizer=self.optimizer, update_num=self.get_num_updates(), ignore_grad=dummy)
                total, tokens = total + loss.detach(), tokens + size
            self.optimizer.multiply_grads(1.0 / float(tokens))
            return total / float(tokens)

        loss = sum(value for value, _ in outputs) / float(sum(size for _, size in outputs))
        probe_update(self.landscape, probe, evaluate, loss, step=self.get_num_updates(),
                     epoch=self._epoch, lr=self.get_lr())
        self.landscape.write(self.landscape_run)

    def _train_through_the_norms(self, cfg, model):
        """``--train-only``'s freeze (fairseq builds its optimizer, of the trainable
        parameters, on first use: later), and ``--sam``'s ``SharpnessAware`` (or None), whose
        second pass follows the first forward and backward of each update (``_forward_backward``
        in place of the task's ``train_step``). Prints what trains (rank 0)."""
        train_only = getattr(cfg.model, "train_only", "all") or "all"
        freeze_except(model, train_only, output_projection(model) if train_only == "norm+head" else None)
        entry = sam_entry(cfg.model)
        micro_batches = max(cfg.optimization.update_freq)
        if entry is not None and micro_batches > 1:
            raise ValueError(f"--sam with --update-freq {micro_batches} ({micro_batches} micro-batches "
                             "per update) is not defined here: SAM's ascent needs the whole update's "
                             "gradient before its second pass. Use one micro-batch per update "
                             "(recipe.train.update_freq=1, --update-freq 1; more tokens per batch "
                             "with max_tokens, memory allowing), or sam=none")
        sam = configured(entry, model, announce=self.is_data_parallel_master)
        if sam is not None:
            self._task_train_step = self.task.train_step
            self.task.train_step = self._forward_backward
        model.trainer_applies = True
        if self.is_data_parallel_master:  # on stderr, which the launcher logs with stdout
            print(trained_line(trained_parameters(model, sam)), file=sys.stderr, flush=True)
        return sam

    def _forward_backward(self, *args, **kwargs):
        """The task's ``train_step`` (one forward and backward of a sample) under SAM: the
        update's first is followed by the second pass, on the same sample at the perturbed
        weights; fairseq's optimizer then steps with its gradient. Returns the first pass's
        loss and logging outputs (fairseq's NaN detector reruns the step without SAM)."""
        outputs = self._task_train_step(*args, **kwargs)
        if self._second_pass_due:
            self._second_pass_due = False
            self.sam.perturbed_gradient(lambda: self._task_train_step(*args, **kwargs))
        return outputs

    def clip_grad_norm(self, clip_norm):
        """fairseq's clipping by the global norm, or with ``--agc`` its unclipped norm and
        the adaptive clipping (the module docstring); a due landscape probe first, along the
        gradient as it comes here."""
        if self._probe is not None:
            self._probe_landscape()
        if self.agc is None:
            return super().clip_grad_norm(clip_norm)
        grad_norm = super().clip_grad_norm(0.0)  # 0: fairseq computes the norm, clips nothing
        adaptive_clip_grad(self.optimizer.params, self.agc)
        return grad_norm

    def begin_epoch(self, epoch):
        """Also saves the previous epoch's GNS records (fairseq calls this before each epoch's
        first update, and nothing at an epoch's end) and, with ``--record-updates``, has the
        epoch's statistics carry its record of the updates (``_record_updates``)."""
        self._epoch = epoch
        if self.gns:
            self.gns.begin_epoch(epoch)
        if self.record_updates:
            self._record_updates()
        super().begin_epoch(epoch)

    def _record_updates(self) -> None:
        """``--record-updates`` (the module docstring): every optimizer step fairseq takes
        measured by an ``UpdateRecord`` (around the task's ``optimizer_step``), whose epoch's
        record becomes the ``UPDATES`` entry of fairseq's ``train`` statistics. A derived meter
        of that aggregator holds it: fairseq reads it once, to log the epoch's statistics, and
        keeps no state of it in checkpoints (a resume rebuilds the aggregator, so it is added
        again where it is missing). Called inside fairseq's ``train`` aggregator."""
        if self.updates is None:  # the optimizer exists by now (a resume's loaded)
            self.updates = UpdateRecord(self.optimizer.optimizer)
            optimizer_step = self.task.optimizer_step

            def measured(*args, **kwargs):
                with self.updates.step():
                    return optimizer_step(*args, **kwargs)
            self.task.optimizer_step = measured
        epoch = metrics.get_meters("train")
        if UPDATES not in epoch:
            epoch.add_meter(UPDATES, MetersDict._DerivedMeter(lambda meters: self.updates.flush()),
                            priority=1000)  # after fairseq's own

    def finish(self) -> None:
        """Save the last epoch's GNS records (fairseq_cli.train.main has returned or failed)."""
        if self.gns:
            self.gns.save()

    def train_step(self, samples, raise_oom=False):
        """One update (with ``--sam``: both passes); the norms' state is restored, and its GNS
        records dropped, if fairseq takes none. fairseq retries an overflowed ``--amp`` update
        by calling ``train_step`` again from within: the attempt in progress was skipped."""
        if self._updating:
            self._end_update(True)
        if self.invariance_dir:
            self._record_scale_invariance(samples)
        self.guard.begin_update(loss_scale(self.optimizer))
        if self.sam is not None:
            self.sam.new_update()
            self._second_pass_due = True
        self._updating = True
        updates = self.get_num_updates()
        if self.landscape is not None and self.landscape.due(updates):
            self._probe = (self.landscape.start(), samples, [])  # before the first forward
        try:
            return super().train_step(samples, raise_oom)
        finally:
            self._probe = None
            if self._updating:
                self._end_update(self.get_num_updates() == updates)

    def _record_scale_invariance(self, samples) -> None:
        """``scale_invariance.json`` at the run's start (the module docstring); a dummy batch
        (no sentences) waits for the next."""
        sample = samples[0] if samples else None
        if not sample or "net_input" not in sample:
            return
        run_dir, self.invariance_dir = Path(self.invariance_dir), None  # once per process
        if (run_dir / SCALE_INVARIANCE_FILE).exists() or self.get_num_updates() \
                or not self.is_data_parallel_master:
            return
        model = self.get_model()
        device = next(model.parameters()).device
        net_input = {key: value[:PROBE_EXAMPLES].to(device)
                     for key, value in sample["net_input"].items()}
        write_scale_invariance(run_dir, model, lambda copy: copy(**net_input)[0],
                               examples=len(net_input["src_tokens"]), seed=self.cfg.common.seed)

    def _end_update(self, skipped: bool) -> None:
        self.guard.end_update(skipped)
        if self.gns:
            self.gns.end_update(skipped)
        self._updating = False


def main(cfg) -> None:
    """fairseq-train's ``main`` with the guarded trainer (in every training process), which
    saves its last epoch's GNS records when training ends."""
    trainers = []

    def build(*args, **kwargs) -> GuardedTrainer:
        trainers.append(GuardedTrainer(*args, **kwargs))
        return trainers[-1]

    fairseq_train.Trainer = build
    try:
        fairseq_train.main(cfg)
    finally:
        for trainer in trainers:
            trainer.finish()


def cli_main() -> None:
    args = options.parse_args_and_arch(options.get_training_parser())
    cfg = convert_namespace_to_omegaconf(args)
    for option in ("profile", "use_plasma_view"):
        if getattr(cfg.common, option):
            raise SystemExit(f"--{option.replace('_', '-')} is not supported here; run fairseq-train "
                             "for it (without the norms' loss-scale guard)")
    distributed_utils.call_main(cfg, main)


if __name__ == "__main__":
    cli_main()
