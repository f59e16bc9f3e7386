"""The mmdetection backend of ``scripts/train.py`` (``model.backend=mmdet``).

The paper's configs in ``configs/mmdet`` are filled from the Hydra config (norm, data,
schedule, optimizer, scale) and run by mmengine's Runner; the run directory gets the same
``config.yaml``, ``metrics.jsonl`` and ``result.json`` as the torchvision backend, with COCO
AP under the same names. Resume uses mmengine's own ``last_checkpoint``; a collapse (checked
by our detector on every iteration's loss) ends the run with ``status: FAIL``.

Conventions shared with the other trainers:

- Several processes (``torchrun``): one distributed training on the process group of
  ``plugins.distributed`` (gloo on CPU, nccl on GPU; mmengine's ``pytorch`` launcher), the
  global batch split over the replicas, the norms' buffers per replica; after each training
  epoch, before the checkpoint is saved and the model evaluated, the norms' state is made
  identical across replicas (``norm_sync``), so the recorded AP is the one the checkpoint
  gives. Rank 0 alone writes our records.
- Step units: an mmengine iteration is one batch, one training step of every norm (with
  ``accumulative_counts`` too), so the run's length in iterations is what
  ``fit_norm_to_run`` gets.
- ``device`` is honoured (mmengine alone would take any visible GPU); ``amp`` is bf16, or
  fp16 with a loss scaler the norms do not see (``unnorm.GradScaler``), on CUDA, as
  ``plugins.precision.amp_context`` decides, and autocast on a CPU is refused (mmengine's
  is GPU-only); ``optimizer`` is timm's optimizer of that name with its options
  (``plugins.optim``), as in the torchvision backend; ``scale.max_steps_per_epoch`` caps
  the batches of an epoch; ``logger`` as everywhere (``plugins.logger``).
- Training through the norms (``sam=sam|sam_on|asam|asam_on``, ``train_only=norm|norm+head``,
  ``plugins.sam``): the runner freezes the model (``freeze_except``; the head of
  ``norm+head`` is the ROI heads, ``roi_head``, as in the torchvision backend) before DDP
  and the optimizer see it, and SAM replaces the model's ``train_step`` with
  ``SharpnessAwareStep``; ``result.json`` records ``trainable_parameters`` (and
  ``sam_perturbed_parameters``). SAM with ``accumulative_counts`` > 1 is refused.
- ``record_scale_invariance`` and ``record_updates`` keep the other tasks' records
  (``UnnormRunHook``): ``result.json``'s ``scale_invariant``, from the training losses of a
  float64 copy on two training images before the first update, and each epoch's effective
  steps and AdamP/SGDP projections in ``metrics.jsonl``; ``record_statistics`` and
  ``record_gns`` are refused (the shared loop's taps). ``record_landscape=k`` probes every
  k-th update's landscape (``LandscapeStep``, ``plugins.landscape``; refused with SAM and
  with gradient accumulation).
- Checkpoints load with ``weights_only=True`` (``plugins.checkpoints``); mmengine's logged
  values (``HistoryBuffer``s, whose pickle calls ``getattr``) are saved as plain lists and
  rebuilt on resume. ``trust_checkpoint=true`` lifts that for files you trust (an mmengine
  checkpoint written without this backend).
"""
from __future__ import annotations

import fnmatch
import functools
import itertools
import json
import logging
import math
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator, Mapping, Sequence

import torch
import torch.distributed as dist
from mmdet.datasets.samplers import AspectRatioBatchSampler
from mmcv.cnn import Conv2d, Linear
from mmcv.ops.nms import NMSop
from mmdet.registry import DATA_SAMPLERS
from mmengine.config import Config
from mmengine.hooks import Hook
from mmengine.logging import HistoryBuffer, MMLogger
from mmengine.model import MMDistributedDataParallel, is_model_wrapper
from mmengine.registry import OPTIMIZERS
from mmengine.runner import Runner
from mmengine.runner.checkpoint import _load_checkpoint_to_model
from omegaconf import DictConfig, OmegaConf
from timm.utils.agc import adaptive_clip_grad

import unnorm
from plugins.checkpoints import load_checkpoint, read_checkpoint, save_atomic
from plugins.distributed import Distributed, per_replica_buffers
from plugins.model_options import as_patterns, standardize_layers, standardized_layers
from plugins.norms import norm_kwargs
from plugins.landscape import LandscapeRecorder, landscape_interval, probe_update, trained
from plugins.optim import UpdateRecord, create_optimizer, optimizer_options
from plugins.precision import autocast_dtype
from plugins.runlog import (DETECTION_CHANCE, DETECTION_PROBE_EXAMPLES, CollapseDetector,
                            RunDirectory, TrainingCollapsed, record_collapse,
                            recorded_scale_invariance, rejected_steps, run_logger, run_meta,
                            write_scale_invariance)
from plugins.sam import SharpnessAware, configured, freeze_except, trained_parameters
from plugins.training import begin_run, require_init, rngs_kept, run_task

from . import norm_cfg
from .convert import convert_checkpoint

CHECKPOINT = "last_checkpoint"  # mmengine's pointer to the newest checkpoint
CONFIGS = Path(__file__).resolve().parents[2] / "configs" / "mmdet"
TRUST_OPT_IN = "trust_checkpoint=true"
WS_KEYS = ("weight_standardization", "ws_eps", "ws_eps_form", "ws_gamma", "ws_targets",
           "ws_residual_targets")
MMCV_WRAPPERS = {Linear: torch.nn.Linear, Conv2d: torch.nn.Conv2d}
# The layers that predict the outputs (classes, boxes, masks, objectness): no norm pairs with
# them, so model.weight_standardization may not reach them.
PREDICTORS = ("roi_head.bbox_head.fc_cls", "roi_head.bbox_head.fc_reg",
              "roi_head.mask_head.conv_logits", "rpn_head.rpn_cls", "rpn_head.rpn_reg")
_COCO_NAMES = {"mAP": "AP", "mAP_50": "AP50", "mAP_75": "AP75", "mAP_s": "APs", "mAP_m": "APm",
               "mAP_l": "APl"}


def our_metrics(mm_metrics: dict) -> dict[str, float]:
    """mmdet's ``coco/bbox_mAP_50`` (a fraction) as our ``bbox_AP50`` (percent)."""
    ours = {}
    for key, value in mm_metrics.items():
        iou_type, _, name = key.removeprefix("coco/").partition("_")
        if name in _COCO_NAMES and value >= 0:
            ours[f"{iou_type}_{_COCO_NAMES[name]}"] = 100.0 * float(value)
    return ours


class SharpnessAwareStep:
    """A model's ``train_step(data, optim_wrapper)`` for SAM: mmengine's step (preprocess,
    forward in loss mode, ``parse_losses``, ``optim_wrapper.update_params``) with the update
    split open: the first backward through ``optim_wrapper.backward`` (an AmpOptimWrapper's
    loss scaler scales it), ``sam.perturbed_gradient`` around a second forward and backward
    of the same preprocessed batch at the perturbed weights, then ``optim_wrapper.step()``
    (clipping, and the scaler's step and update: ``unnorm.GradScaler`` returns every norm to
    the update's start when it skips) and ``zero_grad()``. The logged losses are the first
    (unperturbed) pass's. ``model`` is the runner's model, plain or DDP-wrapped: both passes
    run through it, so DDP averages both gradients.

    Installed by ``UnnormRunner`` as the model's ``train_step`` attribute, as mmengine's
    Runner installs a compiled ``train_step`` (``_maybe_compile``): the training loop and
    every hook keep mmengine's contract, for the plain detector and for DDP alike."""

    def __init__(self, model: torch.nn.Module, sam: SharpnessAware):
        self.model, self.sam = model, sam

    def __call__(self, data, optim_wrapper) -> dict:
        model, module = self.model, _unwrapped(self.model)
        self.sam.new_update()  # before the update's first forward: the norms' start is kept
        with optim_wrapper.optim_context(model):
            data = module.data_preprocessor(data, True)

        def loss():
            with optim_wrapper.optim_context(model):
                losses = model._run_forward(data, mode="loss")
            return module.parse_losses(losses)

        first, log_vars = loss()
        optim_wrapper.backward(first)
        self.sam.perturbed_gradient(lambda: optim_wrapper.backward(loss()[0]))
        optim_wrapper.step()
        optim_wrapper.zero_grad()
        return log_vars


class LandscapeStep:
    """A model's ``train_step`` for ``record_landscape``: mmengine's own on the updates not
    probed; on a probed one its step split open as ``SharpnessAwareStep`` splits it (one
    preprocessed batch, the backward through ``optim_wrapper.backward``), the landscape
    probed along the gradient it left (``plugins.landscape``: the same forward and backward
    at each step size, through the runner's model, plain or DDP-wrapped, as the update's),
    then ``optim_wrapper.step()`` and ``zero_grad()``. Each probe's row is appended to the run
    folder's ``landscape.jsonl`` at once (rank 0). Installed by ``UnnormRunHook`` before the
    first update."""

    def __init__(self, runner, recorder: LandscapeRecorder, run: RunDirectory, world: Distributed):
        self.runner, self.recorder, self.run, self.world = runner, recorder, run, world
        self.model = runner.model
        self.plain_step = runner.model.train_step

    def __call__(self, data, optim_wrapper) -> dict:
        runner, model, module = self.runner, self.model, _unwrapped(self.model)
        if not self.recorder.due(runner.iter):
            return self.plain_step(data, optim_wrapper)
        with optim_wrapper.optim_context(model):
            data = module.data_preprocessor(data, True)
        probe = self.recorder.start()

        def loss():
            with optim_wrapper.optim_context(model):
                losses = model._run_forward(data, mode="loss")
            return module.parse_losses(losses)

        def evaluate() -> torch.Tensor:
            total = loss()[0]
            optim_wrapper.backward(total)
            return self.world.mean(total.detach())

        first, log_vars = loss()
        optim_wrapper.backward(first)
        probe_update(self.recorder, probe, evaluate, self.world.mean(first.detach()),
                     step=runner.iter, epoch=runner.epoch + 1,
                     lr=optim_wrapper.param_groups[0]["lr"],
                     scaler=getattr(optim_wrapper, "loss_scaler", None))
        self.recorder.write(self.run)
        optim_wrapper.step()
        optim_wrapper.zero_grad()
        return log_vars


class _FrozenSkipped(logging.Filter):
    """Counts, and keeps out of the log, mmengine's warning for each frozen parameter its
    optimizer constructor leaves out (``train_only``: hundreds of lines)."""

    def __init__(self):
        super().__init__()
        self.count = 0

    def filter(self, record: logging.LogRecord) -> bool:
        if "is skipped since its requires_grad=False" in record.getMessage():
            self.count += 1
            return False
        return True


class UnnormRunner(Runner):
    """mmengine's Runner with the model on the run's device (``cfg.device``: mmengine alone
    takes any visible GPU), DDP that keeps the norms' buffers per replica, and checkpoints
    read by ``plugins.checkpoints.load_checkpoint`` (``cfg.trust_checkpoint``).

    Training through the norms (``cfg.train_only``, ``cfg.sam``: a ``configs/sam`` entry or
    None): the model is frozen before DDP wraps it and before the optimizer is built (in
    ``train()``; mmengine's constructor leaves the frozen parameters out, param-wise rules
    apply to the rest), and with SAM its ``train_step`` becomes ``SharpnessAwareStep``.
    ``sam`` is the run's ``SharpnessAware`` or None."""

    sam: SharpnessAware | None = None

    def wrap_model(self, model_wrapper_cfg, model):
        if model_wrapper_cfg is not None:
            raise ValueError("model_wrapper_cfg: the mmdet backend wraps the model itself (DDP "
                             "with per-replica norm buffers); drop it from the config")
        device = torch.device(self.cfg.device)
        model = model.to(device)
        standardize_detector(model, self.cfg.get("weight_standardization") or {})
        freeze_except(model, self.cfg.get("train_only", "all"),  # the torchvision backend's
                      head=getattr(model, "roi_head", None))     # head: its roi_heads
        self.sam = configured(self.cfg.get("sam"), model, announce=self.rank == 0)
        if self.distributed:
            model = MMDistributedDataParallel(
                module=model, device_ids=[device.index] if device.type == "cuda" else None,
                find_unused_parameters=self.cfg.get("find_unused_parameters", False),
                **per_replica_buffers())
        if self.sam is not None:
            model.train_step = SharpnessAwareStep(model, self.sam)
        return model

    def build_optim_wrapper(self, optim_wrapper):
        """mmengine's, with its per-parameter warnings for frozen parameters made one line,
        SAM with gradient accumulation refused, and clipping adaptively for ``recipe.agc``
        (``cfg.agc``): timm's ``adaptive_clip_grad`` as its clipping function, which it runs
        where it would clip by the norm (after an AmpOptimWrapper's unscale); its config names
        norm or value clipping only."""
        skipped = _FrozenSkipped()
        logger = MMLogger.get_current_instance()
        logger.addFilter(skipped)
        try:
            built = super().build_optim_wrapper(optim_wrapper)
        finally:
            logger.removeFilter(skipped)
        if skipped.count:
            self.logger.info(f"train_only={self.cfg.get('train_only')}: the optimizer leaves out "
                             f"{skipped.count} frozen parameter tensors")
        counts = getattr(built, "_accumulative_counts", 1)
        if self.sam is not None and counts > 1:
            raise ValueError(f"sam with gradient accumulation (optim_wrapper.accumulative_counts="
                             f"{counts}) is not defined here: SAM's ascent needs the whole "
                             "update's gradient before its second pass. Set accumulative_counts=1 "
                             "in the mmdet config's optim_wrapper (one batch per update), or "
                             "sam=none")
        if self.cfg.get("agc"):
            built.clip_func, built.clip_grad_kwargs = adaptive_clip_grad, {
                "clip_factor": self.cfg.agc}
        return built

    def load_checkpoint(self, filename, map_location="cpu", strict=False,
                        revise_keys=((r"^module.", ""),)):
        """mmengine's ``load_checkpoint`` (resume, ``load_from``), reading the file on the
        CPU without running its pickle (the model's and optimizer's ``load_state_dict``
        copy to their device)."""
        checkpoint = load_checkpoint(filename, trusted=self.cfg.trust_checkpoint,
                                     opt_in=TRUST_OPT_IN)
        self.call_hook("after_load_checkpoint", checkpoint=checkpoint)
        model = self.model.module if is_model_wrapper(self.model) else self.model
        checkpoint = _load_checkpoint_to_model(model, checkpoint, strict, revise_keys=revise_keys)
        self._has_loaded = True
        self.logger.info(f"Load checkpoint from {filename}")
        return checkpoint


@DATA_SAMPLERS.register_module(force=True)
class CappedAspectRatioBatchSampler(AspectRatioBatchSampler):
    """mmdet's aspect-ratio batches, at most ``max_batches`` of them per epoch
    (``scale.max_steps_per_epoch``); each epoch draws afresh from the shuffled sampler."""

    def __init__(self, sampler, batch_size: int, max_batches: int, drop_last: bool = False):
        super().__init__(sampler, batch_size, drop_last)
        self.max_batches = max_batches

    def __iter__(self):
        self._aspect_ratio_buckets = [[] for _ in range(2)]  # a capped epoch leaves a rest
        return itertools.islice(super().__iter__(), self.max_batches)

    def __len__(self) -> int:
        return min(super().__len__(), self.max_batches)


@OPTIMIZERS.register_module(name="TimmOptimizer", force=True)
def timm_optimizer(params, optimizer: dict, lr: float, weight_decay: float):
    """timm's optimizer of the run's ``optimizer`` config (``plugins.optim``), as the
    torchvision backend builds it; mmengine's param groups carry the decay rules."""
    return create_optimizer(params, optimizer, lr=lr, weight_decay=weight_decay)


def plain_logged_values(checkpoint: dict) -> None:
    """mmengine's message hub in ``checkpoint`` with its ``HistoryBuffer``s as plain lists,
    which load without running any pickle code (``rebuild_logged_values`` undoes it)."""
    scalars = checkpoint["message_hub"]["log_scalars"]
    for key, buffer in scalars.items():
        logged, counts = buffer.data
        scalars[key] = {"log_history": logged.tolist(), "count_history": counts.tolist(),
                        "max_length": buffer.max_length}


def rebuild_logged_values(checkpoint: dict) -> None:
    """The ``HistoryBuffer``s ``plain_logged_values`` stored as lists."""
    scalars = checkpoint.get("message_hub", {}).get("log_scalars", {})
    for key, plain in scalars.items():
        if isinstance(plain, dict):
            scalars[key] = HistoryBuffer(**plain)


def guard_loss_scaler(optim_wrapper, model: torch.nn.Module) -> None:
    """Put an ``unnorm.GradScaler`` (the norms keep their statistics in unscaled units and
    skip what the scaler skips) in place of an AmpOptimWrapper's enabled scaler, its state
    (scale, growth tracker) carried over."""
    scaler = getattr(optim_wrapper, "loss_scaler", None)
    if scaler is None or not scaler.is_enabled():
        return
    guarded = unnorm.GradScaler(model, scaler._device)
    guarded.load_state_dict(scaler.state_dict())
    optim_wrapper.loss_scaler = guarded


class UnnormRunHook(Hook):
    """Our conventions inside mmengine's loop: the collapse test on every iteration's loss
    (averaged over replicas), the norms' state made identical across replicas after each
    training epoch, metrics to ``metrics.jsonl`` and the logger, AMP's loss scaler kept
    away from the norms, and checkpoints that load without running pickle code.

    And the records the other tasks keep: with ``record_invariance`` the run folder's
    ``scale_invariance.json``, found before the first update (``record_scale_invariance``);
    with ``record_updates`` each epoch's ``plugins.optim.UpdateRecord`` of the optim wrapper's
    steps (``measure_steps``) in that epoch's ``metrics.jsonl`` row: the validation's, or a
    row of its own for an epoch that has none."""

    def __init__(self, run: RunDirectory, detector: CollapseDetector, world: Distributed,
                 norm_sync: str, logger, *, record_updates: bool = False,
                 record_invariance: bool = False, seed: int = 0, record_landscape: int = 0):
        self.run, self.detector, self.world = run, detector, world
        self.norm_sync, self.logger = norm_sync, logger
        self.record_updates, self.record_invariance = record_updates, record_invariance
        self.record_landscape = record_landscape
        self.seed = seed
        self.last: dict = {}
        self.updates: UpdateRecord | None = None
        self.pending: dict = {}  # the last epoch's update record, until its row is written

    def before_train(self, runner) -> None:
        """After mmengine initialised or loaded the weights, before the first update."""
        guard_loss_scaler(runner.optim_wrapper, _unwrapped(runner.model))
        if (self.record_invariance and self.world.main and runner.iter == 0
                and not recorded_scale_invariance(self.run.path)):
            record_scale_invariance(runner, self.run.path, self.world.device, self.seed)
        if self.record_updates:
            self.updates = measure_steps(runner.optim_wrapper)
        if self.record_landscape:
            counts = getattr(runner.optim_wrapper, "_accumulative_counts", 1)
            if counts > 1:
                raise ValueError(f"record_landscape with gradient accumulation (optim_wrapper."
                                 f"accumulative_counts={counts}) is not available in the mmdet "
                                 "backend: set accumulative_counts=1, or record_landscape=0")
            model = _unwrapped(runner.model)
            recorder = LandscapeRecorder(self.record_landscape, model,
                                         trained(runner.optim_wrapper.optimizer), self.world.device)
            runner.model.train_step = LandscapeStep(runner, recorder, self.run, self.world)

    def before_save_checkpoint(self, runner, checkpoint: dict) -> None:
        plain_logged_values(checkpoint)

    def after_load_checkpoint(self, runner, checkpoint: dict) -> None:
        rebuild_logged_values(checkpoint)

    def after_train_iter(self, runner, batch_idx, data_batch=None, outputs=None) -> None:
        if outputs is not None and "loss" in outputs:
            self.detector.update(runner.iter + 1, self.world.mean(outputs["loss"].detach()))

    def after_train_epoch(self, runner) -> None:
        """Registered at priority LOW: before CheckpointHook (VERY_LOW) saves the epoch, and
        before the validation loop runs."""
        self.detector.check()
        if self.world.world > 1:
            unnorm.distribute_norm_state(_unwrapped(runner.model), self.norm_sync)
        if self.updates is not None:  # runner.epoch counts the epoch once this hook returns
            self.pending = {"epoch": runner.epoch + 1, "step": runner.iter, **self.updates.flush()}

    def after_val_epoch(self, runner, metrics=None) -> None:
        self.last = {"epoch": runner.epoch, "step": runner.iter, **our_metrics(metrics or {})}
        self.run.log(**{**self.pending, **self.last})
        self.pending = {}
        self.logger.log(self.last, step=runner.iter)

    def before_train_epoch(self, runner) -> None:
        self._log_pending()

    def after_train(self, runner) -> None:
        self._log_pending()

    def _log_pending(self) -> None:
        """The row of an epoch that had no validation (its update record alone)."""
        if self.pending:
            self.run.log(**self.pending)
            self.pending = {}


def measure_steps(optim_wrapper) -> UpdateRecord:
    """An ``UpdateRecord`` of each of ``optim_wrapper``'s steps (its clipping, and an AMP
    scaler's skip, which counts as a step of 0, included: as the shared loop measures its
    ``optimizer_step``). mmengine's param-wise rules make each parameter a param group of its
    own, so the record has an entry per parameter."""
    record = UpdateRecord(optim_wrapper.optimizer)
    step = optim_wrapper.step

    @functools.wraps(step)  # keeps the marks mmengine's schedulers put on the step they count
    def measured(**kwargs) -> None:
        with record.step():
            step(**kwargs)
    optim_wrapper.step = measured  # what update_params and SharpnessAwareStep call
    return record


def record_scale_invariance(runner, run_dir: Path, device: torch.device, seed: int) -> None:
    """``scale_invariance.json`` (``plugins.runlog.write_scale_invariance``) of the detector
    on its first ``DETECTION_PROBE_EXAMPLES`` training images through the training pipeline
    (the RNGs left as they were). What the update reads, as in the torchvision backend (whose
    probe says why training mode is deterministic there): the float64 copy's losses, with
    mmcv's NMS finding its indices in float32 (``float32_nms``)."""
    loader = runner.train_dataloader
    count = min(len(loader.dataset), DETECTION_PROBE_EXAMPLES)
    with rngs_kept(device):
        data = loader.collate_fn([loader.dataset[index] for index in range(count)])

        def losses(detector: torch.nn.Module) -> dict:
            batch = detector.data_preprocessor(data, True)  # float64: the copy's mean and std
            with float32_nms():
                found = detector(**batch, mode="loss")
            return {name: value for name, value in found.items() if "loss" in name}  # not "acc"
        write_scale_invariance(run_dir, _unwrapped(runner.model), losses, examples=count, seed=seed)


@contextmanager
def float32_nms() -> Iterator[None]:
    """mmcv's NMS, whose CPU kernel takes float32 only, finding the indices it keeps in
    float32 (the boxes and scores it returns are still the caller's): a float64 detector trains
    through it. A change at float64 rounding moves a float32 rounding only at a rounding
    boundary, so the indices a scale-invariant weight's copies keep are the same."""
    original = vars(NMSop)["forward"]
    NMSop.forward = staticmethod(lambda ctx, boxes, scores, *options: original.__func__(
        ctx, boxes.float(), scores.float(), *options))
    try:
        yield
    finally:
        NMSop.forward = original


def _unwrapped(model: torch.nn.Module) -> torch.nn.Module:
    return model.module if is_model_wrapper(model) else model


def standardize_detector(model: torch.nn.Module, options: Mapping) -> int:
    """``model.weight_standardization`` (``options``: the model config's ``WS_KEYS``) on mmdet's
    detector. mmcv's ``Linear`` and ``Conv2d`` among the layers named (the FFNs' linear layers)
    become torch's own first, which ``unnorm.standardize_weights`` takes: exactly the same
    layers, as their forward is torch's on torch >= 1.6 (they add an empty-input path for
    older torch only)."""
    patterns = options.get("weight_standardization")
    if patterns is None:
        return 0
    for name, module in model.named_modules():
        if type(module) in MMCV_WRAPPERS and any(fnmatch.fnmatchcase(name, pattern)
                                                 for pattern in as_patterns(patterns)):
            module.__class__ = MMCV_WRAPPERS[type(module)]
    return standardize_layers(model, options, embedding=["backbone.patch_embed"], head=PREDICTORS)


def paper_config(cfg: DictConfig) -> Config:
    """The paper's mmdet config file of this run's model (3x schedule; ours sets the rest)."""
    name = cfg.model.name.replace("_swin_t", "_swin_t_fpn")
    return Config.fromfile(str(CONFIGS / f"{name}_3x_coco.py"))


def amp_optim_wrapper(amp, device: torch.device) -> dict:
    """mmengine's optim wrapper for ``amp``, as ``plugins.precision.autocast_dtype`` decides:
    bf16, or fp16 with a dynamic loss scale; plain fp32 for float32. mmengine's
    ``AmpOptimWrapper`` runs on GPUs only, so autocast on a CPU is refused."""
    dtype = autocast_dtype(amp, device)
    if dtype is None:
        return {"type": "OptimWrapper"}
    if device.type != "cuda":
        raise ValueError(f"amp={amp}: mmengine's AmpOptimWrapper autocasts on GPUs only; train "
                         "the mmdet backend on a CPU with amp=auto or amp=false, or rehearse "
                         "autocast on a CPU with the torchvision backend (model.backend=torchvision)")
    if dtype == torch.bfloat16:
        return {"type": "AmpOptimWrapper", "dtype": "bfloat16", "loss_scale": {"enabled": False}}
    return {"type": "AmpOptimWrapper", "dtype": "float16", "loss_scale": "dynamic"}


def mmdet_config(cfg: DictConfig, out_dir: Path, world: Distributed) -> Config:
    """The mmdet config of this run: the paper's file, with our norm, data and schedule."""
    model, recipe, data = cfg.model, cfg.recipe, cfg.data
    mm = paper_config(cfg)
    options = norm_kwargs(cfg.norm)
    backbone = mm.model.backbone
    backbone.norm_cfg = norm_cfg(cfg.norm.name, **options)
    kwargs = OmegaConf.to_container(model.backbone.kwargs, resolve=True)
    backbone.drop_path_rate = kwargs.get("drop_path_rate", backbone.drop_path_rate)
    if "embed_dim" in kwargs:  # a narrow Swin (scale=cpu)
        backbone.update(embed_dims=kwargs["embed_dim"], depths=kwargs["depths"],
                        num_heads=kwargs["num_heads"], window_size=kwargs["window_size"])
        mm.model.neck.in_channels = [kwargs["embed_dim"] * 2 ** i for i in range(4)]
    width = model.fpn_channels
    categories = json.loads((Path(data.root) / data.val.annotations).read_text())["categories"]
    classes = [category["name"] for category in categories]
    mm.model.neck.out_channels = width
    mm.model.rpn_head.update(in_channels=width, feat_channels=width)
    mm.model.rpn_head.anchor_generator.scales = [model.anchor_sizes[0] // 4]  # P2's stride is 4
    heads = mm.model.roi_head
    heads.bbox_roi_extractor.out_channels = width
    heads.bbox_head.update(in_channels=width, fc_out_channels=model.box_head_dim,
                           num_classes=len(classes))
    if model.masks:
        heads.mask_roi_extractor.out_channels = width
        heads.mask_head.update(num_classes=len(classes), in_channels=width,
                               conv_out_channels=model.mask_head_layers[-1],
                               num_convs=len(model.mask_head_layers))
    if cfg.scale.name != "full":  # plain multi-scale resizing at the model config's sizes
        scales = [(model.max_size, size) for size in model.min_size]
        pipeline = mm.train_dataloader.dataset.pipeline
        pipeline[3] = dict(type="RandomChoiceResize", scales=scales, keep_ratio=True)
        mm.val_dataloader.dataset.pipeline[1].scale = scales[-1]
    for split, loader in (("train", mm.train_dataloader), ("val", mm.val_dataloader)):
        paths = data[split]
        loader.dataset.update(data_root=str(data.root), ann_file=paths.annotations,
                              data_prefix=dict(img=paths.images + "/"), metainfo=dict(classes=classes))
        loader.update(num_workers=cfg.scale.num_workers, persistent_workers=cfg.scale.num_workers > 0)
    mm.test_dataloader = mm.val_dataloader
    mm.val_evaluator.ann_file = str(Path(data.root) / data.val.annotations)
    mm.test_evaluator = mm.val_evaluator
    mm.train_dataloader.batch_size = replica_batch(recipe.batch_size, world.world)
    if cfg.scale.max_steps_per_epoch:
        mm.train_dataloader.batch_sampler = dict(type="CappedAspectRatioBatchSampler",
                                                 max_batches=cfg.scale.max_steps_per_epoch)
    peak_lr = recipe.lr * recipe.batch_size / recipe.lr_batch * cfg.lr_multiple
    mm.optim_wrapper.update(amp_optim_wrapper(cfg.amp, world.device))
    optimizer_options(cfg.optimizer)  # refused here, before mmengine builds anything
    mm.optim_wrapper.optimizer = dict(type="TimmOptimizer", lr=peak_lr, weight_decay=recipe.weight_decay,
                                      optimizer=OmegaConf.to_container(cfg.optimizer, resolve=True))
    if recipe.clip_grad:
        mm.optim_wrapper.clip_grad = dict(max_norm=recipe.clip_grad)
    mm.agc = recipe.agc  # read by UnnormRunner.build_optim_wrapper
    mm.param_scheduler = [
        dict(type="LinearLR", start_factor=recipe.warmup_ratio, by_epoch=False, begin=0,
             end=recipe.warmup_iters),
        dict(type="MultiStepLR", begin=0, end=recipe.epochs, by_epoch=True,
             milestones=list(recipe.decay_epochs), gamma=recipe.decay_rate)]
    mm.train_cfg.update(max_epochs=recipe.epochs, val_interval=recipe.eval_every)
    mm.work_dir = str(out_dir)
    mm.randomness = dict(seed=cfg.seed)
    mm.resume = (out_dir / CHECKPOINT).exists()
    mm.default_hooks.logger.interval = cfg.collapse.check_every
    mm.launcher = "pytorch" if world.world > 1 else "none"  # on the group plugins.training joined
    mm.device = str(world.device)
    mm.trust_checkpoint = bool(cfg.trust_checkpoint)
    mm.train_only = cfg.get("train_only", "all")  # read by UnnormRunner, as device is
    model_options = OmegaConf.to_container(model, resolve=True)  # WS: read by UnnormRunner
    mm.weight_standardization = {key: model_options.get(key) for key in WS_KEYS}
    sam = cfg.get("sam")
    mm.sam = None if sam is None or sam.name == "none" else OmegaConf.to_container(sam, resolve=True)
    return mm


def replica_batch(batch_size: int, replicas: int) -> int:
    if batch_size % replicas:
        raise ValueError(f"recipe.batch_size {batch_size} (global) is not divisible by "
                         f"{replicas} replicas; choose a multiple of {replicas}")
    return batch_size // replicas


def train(cfg: DictConfig, out_dir: Path, overrides: Sequence[str] = ()) -> dict:
    """Train and evaluate one detection run with mmdetection; returns ``result.json``'s content."""
    return run_task(_train, cfg, out_dir, overrides)


def _train(cfg: DictConfig, out_dir: Path, world: Distributed, meta: dict) -> dict:
    for option in ("record_statistics", "record_gns", "compile"):
        if cfg[option]:
            raise ValueError(f"{option}=true is supported by model.backend=torchvision; drop it "
                             "for the mmdet backend")
    if landscape_interval(cfg.get("record_landscape")) and cfg.get("sam") is not None \
            and cfg.sam.name != "none":
        raise ValueError("record_landscape with sam in the mmdet backend: both split the "
                         "update open; use sam=none, or record_landscape=0")
    require_init(cfg)
    if cfg.data.get("generate"):
        if world.main:
            from plugins.torchvision.shapes import ensure_shapes
            ensure_shapes(Path(cfg.data.root), **cfg.data.generate)
        _barrier(world)
    total_steps = cfg.recipe.epochs * steps_per_epoch(cfg, world.world)
    cfg, run, finished = begin_run(cfg, out_dir, world, total_steps, CHECKPOINT)
    if finished is not None:
        return finished
    mm = mmdet_config(cfg, out_dir, world)
    init = "scratch"
    converted = out_dir / "backbone_init.pth"  # read by runner.train(), before the first step
    if cfg.init_from:
        mm.model.backbone.init_cfg = dict(type="Pretrained", checkpoint=str(converted))
        init = cfg.init_from
    if world.main:
        mm.dump(str(out_dir / "mmdet_config.py"))
    meta = {**meta, **run_meta(cfg, "detection", world.world, out_dir, epochs=cfg.recipe.epochs,
                               init=init, backend="mmdet", chance=DETECTION_CHANCE)}
    runner = UnnormRunner.from_cfg(mm)
    model = _unwrapped(runner.model)
    if cfg.init_from:  # converted for the detector built: its weight-standardised layers known
        if world.main and not converted.exists():
            saved = read_checkpoint(Path(cfg.init_from), "init_from", trusted=cfg.trust_checkpoint)
            weights = convert_checkpoint(saved, reset_steps=cfg.reset_norm_steps,
                                         standardized=standardized_layers(model))
            save_atomic({"state_dict": weights}, converted)
        _barrier(world)
    logger = run_logger(cfg, out_dir, enabled=world.main)
    hook = UnnormRunHook(run, CollapseDetector(**cfg.collapse), world, cfg.norm_sync, logger,
                         record_updates=bool(cfg.record_updates),
                         record_invariance=bool(cfg.record_scale_invariance), seed=cfg.seed,
                         record_landscape=landscape_interval(cfg.get("record_landscape")))
    runner.register_hook(hook, priority="LOW")
    try:
        runner.train()
        meta.update(steps=runner.iter, **trained_parameters(model, runner.sam),
                    **rejected_steps(model.state_dict()), **_invariance(cfg, out_dir))
        result = run.write_result(status="ok", metrics=hook.last, meta=meta)
    except TrainingCollapsed as collapse:
        meta.update(**trained_parameters(model, runner.sam), **rejected_steps(model.state_dict()),
                    **_invariance(cfg, out_dir))
        result = record_collapse(run, collapse, hook.last, meta)
    finally:
        logger.finish()
    return result


def _invariance(cfg: DictConfig, out_dir: Path) -> dict:
    """``result.json``'s ``scale_invariant``, as ``UnnormRunHook`` recorded it at the run's
    start (none for a resume of a run that has no record: its weights are not the start's)."""
    return recorded_scale_invariance(out_dir) if cfg.record_scale_invariance else {}


def _barrier(world: Distributed) -> None:
    if world.world > 1:
        dist.barrier()


def steps_per_epoch(cfg: DictConfig, replicas: int) -> int:
    """Training iterations per epoch, each one batch per replica (a training step of every
    norm), as mmdet draws them: the images its filter keeps (with an annotation, shorter side
    at least ``min_size``), spread over the replicas (the sampler pads to a multiple), in
    per-replica batches, the last one short; at most ``scale.max_steps_per_epoch``."""
    coco = json.loads((Path(cfg.data.root) / cfg.data.train.annotations).read_text())
    min_size = paper_config(cfg).train_dataloader.dataset.filter_cfg.min_size
    annotated = {a["image_id"] for a in coco["annotations"]}
    kept = sum(1 for image in coco["images"]
               if image["id"] in annotated and min(image["width"], image["height"]) >= min_size)
    per_replica = math.ceil(kept / replicas)
    steps = math.ceil(per_replica / replica_batch(cfg.recipe.batch_size, replicas))
    cap = cfg.scale.max_steps_per_epoch
    return min(steps, cap) if cap else steps
