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
"""
from __future__ import annotations

from fairseq import options
from fairseq.dataclass.utils import convert_namespace_to_omegaconf
from fairseq.distributed import utils as distributed_utils
from fairseq.trainer import Trainer
from fairseq_cli import train as fairseq_train

import unnorm


def loss_scale(optimizer) -> float:
    """What fairseq multiplies the loss by in the coming update: its ``DynamicLossScaler``'s
    scale (``--fp16``), the ``GradScaler``'s (``--amp``), else 1."""
    scaler = getattr(optimizer, "scaler", None)
    if scaler is None:
        return 1.0
    return scaler.get_scale() if hasattr(scaler, "get_scale") else scaler.loss_scale


class GuardedTrainer(Trainer):
    """fairseq's ``Trainer`` with every update inside an ``unnorm.LossScaleGuard``."""

    def __init__(self, cfg, task, model, criterion, quantizer=None):
        super().__init__(cfg, task, model, criterion, quantizer)
        self.guard = unnorm.LossScaleGuard(self.get_model())  # cast and on its device by now
        self._updating = False

    def train_step(self, samples, raise_oom=False):
        """One update; the norms' state is restored if fairseq takes none. fairseq retries an
        overflowed ``--amp`` update by calling ``train_step`` again from within: the attempt
        in progress was skipped."""
        if self._updating:
            self.guard.end_update(True)
        self.guard.begin_update(loss_scale(self.optimizer))
        self._updating = True
        updates = self.get_num_updates()
        try:
            return super().train_step(samples, raise_oom)
        finally:
            if self._updating:
                self.guard.end_update(self.get_num_updates() == updates)
                self._updating = False


def main(cfg) -> None:
    """fairseq-train's ``main`` with the guarded trainer (in every training process)."""
    fairseq_train.Trainer = GuardedTrainer
    fairseq_train.main(cfg)


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
