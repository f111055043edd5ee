"""hf_onebit in hand-written Accelerate loops (and the attach step the Trainer integration shares).

::

    from accelerate import Accelerator
    import hf_onebit
    from hf_onebit.integrations.accelerate import attach

    accelerator = Accelerator()
    optimizer = hf_onebit.OneBitAdam(model.parameters(), lr=1e-4, freeze_step=400)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    onebit = attach(accelerator, model, optimizer)     # the hook, on the DDP model Accelerate built
    for batch in loader:
        with accelerator.accumulate(model):            # no_sync on non-final micro-batches
            accelerator.backward(model(**batch).loss)
            optimizer.step(); optimizer.zero_grad()
        accelerator.log(onebit.log_entries(), step=...)  # phase, bytes, ratios, time: all numbers
    accelerator.save_state("ckpt")                     # also writes ckpt/hf_onebit/hf_onebit_rank{r}_of{n}.pt
    accelerator.load_state("ckpt")                     # per-rank state restored before the next forward
    accelerator.print(onebit.summary())                # one line: bytes and time saved against fp32 DDP

Or use :class:`OneBitAccelerator`, an ``Accelerator`` whose ``prepare`` does the ``attach``.

What :func:`attach` does: refuses setups hf_onebit cannot serve (see
:mod:`hf_onebit.integrations.checks`), unwraps Accelerate's ``AcceleratedOptimizer`` to the
hf_onebit optimizer, registers the communication hook once on the ``DistributedDataParallel``
module (with ``accelerator.scaler`` for fp16), and registers ``save_state`` / ``load_state``
pre-hooks (public Accelerate API) that write and read every rank's compression state.
``load_state`` calls its pre-hooks *before* it loads the optimizer, so the per-rank state is
applied later: by a forward pre-hook on the DDP module, before the next forward, after the
optimizer state (and the model weights) are in place, which is the order hf_onebit needs.
"""

from __future__ import annotations

import logging

import torch
from torch.nn.parallel import DistributedDataParallel

from hf_onebit.hook import OneBitHookState
from hf_onebit.hook import attach as attach_hook
from hf_onebit.integrations import checks
from hf_onebit.integrations.checkpoint import load_from_checkpoint, save_beside_checkpoint
from hf_onebit.integrations.logs import CompressionLog, show_info
from hf_onebit.optim import OneBitOptimizer

logger = logging.getLogger("hf_onebit")

_HOOK_ATTR = "_hf_onebit_hook_state"


def unwrap_optimizer(optimizer):
    """The optimizer inside Accelerate's ``AcceleratedOptimizer`` wrappers (public ``.optimizer``)."""
    for _ in range(8):
        if isinstance(optimizer, OneBitOptimizer):
            return optimizer
        inner = getattr(optimizer, "optimizer", None)
        if inner is None:
            return optimizer
        optimizer = inner
    return optimizer


def find_ddp(model) -> DistributedDataParallel | None:
    """The DDP module in ``model`` (itself, or under torch.compile's ``_orig_mod``)."""
    for _ in range(4):
        if isinstance(model, DistributedDataParallel):
            return model
        model = getattr(model, "_orig_mod", None)  # torch.compile's OptimizedModule
        if model is None:
            return None
    return None


def _grad_scaler(accelerator):
    scaler = getattr(accelerator, "scaler", None)
    return scaler if scaler is not None and scaler.is_enabled() else None


def attach_prepared(accelerator, model, optimizer) -> tuple[OneBitOptimizer, DistributedDataParallel | None]:
    """Register the hook on the DDP module Accelerate built; exactly once per DDP module.

    Returns the unwrapped optimizer and the DDP module (``None`` in a single process, where
    nothing is communicated and the optimizer runs uncompressed).
    """
    checks.check_accelerator(accelerator)
    opt = unwrap_optimizer(optimizer)
    if not isinstance(opt, OneBitOptimizer):
        raise TypeError(f"hf_onebit: expected an hf_onebit optimizer inside {type(optimizer).__name__}, got {type(opt).__name__}")
    ddp = find_ddp(model)
    checks.check_model(ddp.module if ddp is not None else model)
    if ddp is None:
        if accelerator.num_processes > 1:
            raise RuntimeError(
                f"hf_onebit: {accelerator.num_processes} processes but the prepared model is a"
                f" {type(model).__name__}, not DistributedDataParallel: pass the model returned by"
                " accelerator.prepare(...)"
            )
        logger.warning("hf_onebit: one process, nothing to communicate: %s runs uncompressed", type(opt).__name__)
        return opt, None
    existing: OneBitHookState | None = getattr(ddp, _HOOK_ATTR, None)
    if existing is not None:
        if existing.optimizer is not opt:
            raise RuntimeError(
                "hf_onebit: this DDP model already has the communication hook of another optimizer, and DDP"
                " accepts one hook per model: wrap the model again (accelerator.prepare) for a new optimizer"
            )
        return opt, ddp
    try:
        state = attach_hook(ddp, opt, grad_scaler=_grad_scaler(accelerator))
    except RuntimeError as exc:
        if "once" in str(exc):
            raise RuntimeError(
                "hf_onebit: the DDP model already has a communication hook (e.g. Accelerate's"
                " DistributedDataParallelKwargs(comm_hook=...)); DDP accepts one hook per model. Remove the"
                f" other hook to use hf_onebit. ({exc})"
            ) from exc
        raise
    setattr(ddp, _HOOK_ATTR, state)
    logger.info("hf_onebit: %s attached to DDP over %d processes", type(opt).__name__, opt.world_size)
    return opt, ddp


class OneBitAccelerate:
    """hf_onebit attached to one prepared (model, optimizer) pair; see the module docstring."""

    def __init__(self, accelerator, model, optimizer) -> None:
        self.accelerator = accelerator
        show_info(accelerator.is_main_process)  # phase changes and the chosen freeze step, at INFO
        self.optimizer, self.ddp = attach_prepared(accelerator, model, optimizer)
        self.log = CompressionLog(self.optimizer)
        self.log.start()  # times the communication, per optimizer step
        self._pending_dir: str | None = None
        self._handles = [
            accelerator.register_save_state_pre_hook(self._before_save),
            accelerator.register_load_state_pre_hook(self._before_load),
        ]
        if self.ddp is not None:
            self._handles.append(self.ddp.register_forward_pre_hook(self._before_forward))

    # -- save_state / load_state
    def _before_save(self, models, weights, output_dir) -> None:
        self.save_rank_state(output_dir)

    def _before_load(self, models, input_dir) -> None:
        self._pending_dir = input_dir

    def _before_forward(self, module, args) -> None:
        if self._pending_dir is not None:
            path, self._pending_dir = self._pending_dir, None
            self.load_rank_state(path)
        if module.training:
            self.log.note_step_start()

    def save_rank_state(self, checkpoint_dir: str) -> None:
        """Write this rank's compression state into ``checkpoint_dir``; every rank must call it."""
        save_beside_checkpoint(self.optimizer, checkpoint_dir)
        self.accelerator.wait_for_everyone()  # every rank's file exists before anyone goes on

    def load_rank_state(self, checkpoint_dir: str) -> None:
        """Read this rank's state back (after the optimizer's ``load_state_dict``)."""
        self._pending_dir = None
        load_from_checkpoint(self.optimizer, checkpoint_dir)
        self.log.restart()

    # -- logs
    def log_entries(self) -> dict:
        """``onebit/phase``, ``onebit/bytes_per_step``, ``onebit/comm_ms``, ... for ``accelerator.log``:
        all numbers, so every tracker plots them (:mod:`.logs`)."""
        return self.log.entries()

    def summary(self) -> str:
        """One line for the end of training: bytes and communication time against fp32 DDP
        (:meth:`.CompressionLog.summary`; waits for the device's pending timing events)."""
        return self.log.summary()

    def remove(self) -> None:
        """Unregister the save/load hooks and stop timing (the DDP communication hook stays: DDP
        cannot drop it)."""
        for h in self._handles:
            h.remove()
        self._handles = []
        self.log.finish()


def attach(accelerator, model, optimizer) -> OneBitAccelerate:
    """Attach hf_onebit to a prepared model and optimizer; see the module docstring."""
    return OneBitAccelerate(accelerator, model, optimizer)


try:  # OneBitAccelerator needs accelerate; the functions above only need its objects
    from accelerate import Accelerator as _Accelerator
except ImportError:  # accelerate is in the `hf` extra

    class _Accelerator:  # type: ignore[no-redef]
        def __init__(self, *args, **kwargs) -> None:
            raise ImportError("OneBitAccelerator needs accelerate: pip install 'hf-onebit[hf]'")


class OneBitAccelerator(_Accelerator):  # type: ignore[misc,valid-type]
    """An ``Accelerator`` whose ``prepare`` attaches hf_onebit to each (model, hf_onebit optimizer).

    The pairs are matched by parameters: the optimizer that holds a prepared model's trainable
    parameters. ``self.onebit`` lists the :class:`OneBitAccelerate` objects (one per pair).
    """

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.onebit: list[OneBitAccelerate] = []

    def prepare(self, *args, **kwargs):
        result = super().prepare(*args, **kwargs)
        objects = result if isinstance(result, tuple) else (result,)
        models = [o for o in objects if isinstance(o, torch.nn.Module)]
        optimizers = [o for o in objects if isinstance(unwrap_optimizer(o), OneBitOptimizer)]
        for opt in optimizers:
            ids = {id(p) for p in unwrap_optimizer(opt).params_in_order()}
            for model in models:
                if any(id(p) in ids for p in model.parameters()):
                    self.onebit.append(attach(self, model, opt))
                    break
            else:
                raise ValueError(
                    "OneBitAccelerator: prepare the model together with its hf_onebit optimizer"
                    " (accelerator.prepare(model, optimizer, ...))"
                )
        return result


__all__ = ["OneBitAccelerate", "OneBitAccelerator", "attach", "attach_prepared", "find_ddp", "unwrap_optimizer"]
