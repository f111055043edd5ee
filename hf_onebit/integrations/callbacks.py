"""The Trainer callback that runs hf_onebit inside HF Trainer: attach, checkpoints, logs.

:class:`OneBitCallback` is added (first in the list) by :class:`~hf_onebit.OneBitTrainer`, and
by the launcher's patched ``Trainer.train`` for stock scripts. It uses only public Trainer
API: the callback events, ``trainer.model_wrapped`` (documented: the outermost model, the DDP
module Accelerate created), ``trainer.optimizer``, ``trainer.accelerator`` and ``trainer.state``.

* ``on_train_begin`` (after ``accelerator.prepare`` and after the Trainer loaded the optimizer
  state of a resumed checkpoint, before the first forward): registers the communication hook
  once, then on a resume restores this rank's compression state.
* ``on_save`` (after the Trainer wrote the checkpoint on rank 0): every rank writes
  ``<checkpoint>/hf_onebit/hf_onebit_rank{r}_of{n}.pt``; barriers before (the directory exists) and after
  (every file exists before any rank goes on).
* ``on_log``: adds the ``onebit/*`` figures (phase, bytes, ratios and communication time, all
  numbers: see :mod:`.logs`) to training logs, and to the ``log_history`` entry the Trainer just
  recorded. Being first in the callback list, it runs before the progress bar, TensorBoard, W&B
  and the other reporters, so they show them.
* ``on_train_end``: logs a one-line summary on rank 0 (bytes against fp32 DDP, time saved at the
  measured link: :meth:`.CompressionLog.summary`) and stops timing the communication.

hf_onebit's messages at INFO (phase changes, the chosen freeze step, the summary) reach the
console on the main process unless the user set the ``hf_onebit`` logger's level
(:func:`.logs.show_info`).
"""

from __future__ import annotations

import logging
import os

from transformers import TrainerCallback
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR

from hf_onebit.integrations.accelerate import attach_prepared, unwrap_optimizer
from hf_onebit.integrations.checkpoint import (
    checkpoint_has_rank_state,
    load_from_checkpoint,
    save_beside_checkpoint,
)
from hf_onebit.integrations.logs import SINGLE_PROCESS, CompressionLog, announce, show_info
from hf_onebit.integrations.options import warmup_end
from hf_onebit.optim import BinSGDM, OneBitOptimizer

logger = logging.getLogger("hf_onebit")

# Files the Trainer writes when it saves optimizer state (transformers.trainer OPTIMIZER_NAME/_BIN).
_OPTIMIZER_FILES = ("optimizer.pt", "optimizer.bin")


class OneBitCallback(TrainerCallback):
    """Runs hf_onebit inside a ``transformers.Trainer`` (see the module docstring)."""

    def __init__(self, trainer) -> None:
        self.trainer = trainer
        self.resume_from: str | None = None  # set by the Trainer integration before train()
        self.optimizer: OneBitOptimizer | None = None
        self.log: CompressionLog | None = None

    # ------------------------------------------------------------------ train begin
    def on_train_begin(self, args, state, control, **kwargs):
        trainer = self.trainer
        opt = unwrap_optimizer(trainer.optimizer)
        if not isinstance(opt, OneBitOptimizer):
            logger.warning(
                "hf_onebit: --optim %s was requested but the Trainer's optimizer is %s; nothing attached",
                args.optim, type(opt).__name__,
            )
            return
        # --log_level (main process) and --log_level_replica, where given, decide hf_onebit's level too
        chosen = args.log_level != "passive" if state.is_world_process_zero else args.log_level_replica != "passive"
        show_info(state.is_world_process_zero, args.get_process_log_level() if chosen else None)
        self.optimizer, _ = attach_prepared(trainer.accelerator, trainer.model_wrapped, trainer.optimizer)
        if self.log is None or self.log.optimizer is not opt:
            if self.log is not None:
                self.log.finish()
            self.log = CompressionLog(opt)
        self.log.start()
        if self.resume_from is not None:
            self._restore(self.resume_from)
        if isinstance(opt, BinSGDM) and args.max_grad_norm and args.max_grad_norm > 0 and state.is_world_process_zero:
            logger.warning(
                "hf_onebit: --max_grad_norm %s clips BinSGDM's vote average, whose norm is about sqrt(number of"
                " parameters): every step shrinks by that factor. BinSGDM bounds each step by the learning rate"
                " already; pass --max_grad_norm 0.", args.max_grad_norm,
            )
        auto = getattr(opt, "auto_freeze", None)
        if auto is not None and auto.chosen is None and state.max_steps > 0 and auto.fit_to_run(state.max_steps):
            if state.is_world_process_zero:
                logger.info("hf_onebit %s: fitted to a run of %d steps, %s", type(opt).__name__, state.max_steps,
                               auto.describe())
        end = warmup_end(opt)
        if end is not None and end >= state.max_steps > 0 and state.is_world_process_zero:
            # name the option this script accepts: OneBitTrainingArguments has --freeze_step, stock ones do not
            suggestion = max(1, state.max_steps // 5)
            how = (f"--freeze_step {suggestion} (or --optim_args freeze_step={suggestion})" if hasattr(args, "freeze_step")
                   else f'--optim_args "freeze_step={suggestion}"')
            logger.warning(
                "hf_onebit: freeze_step=%d >= max_steps=%d: the whole run is uncompressed warmup. Set %s (20%% of"
                " the run; published guidance is 15-25%%).", end, state.max_steps, how,
            )
        if opt.world_size == 1:
            announce(
                f"one process: {type(opt).__name__} runs its phases (the update rule changes at the warmup's end)"
                " but nothing is communicated or compressed (onebit/bytes_sent stays 0; communication:"
                f" {SINGLE_PROCESS}). Launch several processes to compress, e.g. accelerate launch --config_file"
                " cpu_2proc.yaml -m hf_onebit.run script.py ... (hf-onebit config cpu_2proc --write cpu_2proc.yaml)"
            )

    def _restore(self, checkpoint: str) -> None:
        if not any(os.path.isfile(os.path.join(checkpoint, f)) for f in _OPTIMIZER_FILES):
            if checkpoint_has_rank_state(checkpoint):
                logger.warning("hf_onebit: %s has no optimizer state; its per-rank state is not used", checkpoint)
            return  # the Trainer did not restore the optimizer either (e.g. save_only_model)
        load_from_checkpoint(self.optimizer, checkpoint)
        self.log.restart()
        logger.info("hf_onebit: restored rank %d's compression state from %s", self.optimizer.rank, checkpoint)

    def on_step_begin(self, args, state, control, **kwargs):
        if self.log is not None:
            self.log.note_step_start()  # the phase the logs report: the step's own, not the next one's

    # ------------------------------------------------------------------ checkpoints
    def on_save(self, args, state, control, **kwargs):
        if self.optimizer is None or args.save_only_model:
            return
        accelerator = self.trainer.accelerator
        checkpoint = os.path.join(args.output_dir, f"{PREFIX_CHECKPOINT_DIR}-{state.global_step}")
        accelerator.wait_for_everyone()  # rank 0 has finished writing the checkpoint
        if not os.path.isdir(checkpoint):
            raise RuntimeError(
                f"hf_onebit: the Trainer's checkpoint {checkpoint} does not exist on rank {self.optimizer.rank};"
                " hf_onebit needs the output directory on a file system every rank can write to"
                " (hyperparameter search runs are not supported)"
            )
        save_beside_checkpoint(self.optimizer, checkpoint)
        accelerator.wait_for_everyone()  # every rank's file exists before anyone goes on

    # ------------------------------------------------------------------ logs
    def on_log(self, args, state, control, logs=None, **kwargs):
        if self.log is None or logs is None:
            return
        if any(k.startswith(("eval_", "test_", "predict_")) for k in logs):
            return
        added = self.log.entries()
        logs.update(added)
        if state.log_history and state.log_history[-1].get("step") == state.global_step:
            state.log_history[-1].update(added)

    # ------------------------------------------------------------------ train end
    def on_train_end(self, args, state, control, **kwargs):
        if self.log is None:
            return
        if state.is_world_process_zero:
            logger.info("%s", self.log.summary())
        self.log.finish()
