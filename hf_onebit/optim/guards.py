"""What ``step()`` refuses before any state changes: a step the hook did not communicate for,
gradients that never reached the hook, and non-finite gradients without a loss scaler.

Each is a function of the optimizer, called from :meth:`OneBitOptimizer.begin_step` (and, for
:func:`check_synced`, from the steps whose plan communicates).

Non-finite gradients on a GPU (:data:`DEFERRED_DEVICES`) are refused without a host sync, one
step later: the verdict is a flag on the device that masks the step's update (an optimizer that
can, :attr:`~hf_onebit.optim.base.OneBitOptimizer.masks_non_finite_steps`), copied to pinned host
memory, and read at the next ``step()`` (see :func:`check_finite_grads`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from hf_onebit.optim.base import OneBitOptimizer


#: Device types whose gradients are checked without a host sync, the verdict read a step later
#: (on CPU reading a value costs nothing, and the error comes before the step, as it always did).
DEFERRED_DEVICES = {"cuda"}


def norms_finite_flag(tensors: list[torch.Tensor]) -> torch.Tensor:
    """A 0-dim bool on the tensors' device: every tensor's 2-norm is finite. No host read.

    A NaN or inf anywhere makes that tensor's norm non-finite; the fused ``_foreach_norm`` reads
    each tensor once, for the whole list at once (``isfinite(g).all()`` per tensor launches two
    ops and writes a bool temporary per tensor; the ∞-norm, which could not overflow, is much
    slower on CPU). The norms are judged one by one, not summed, so only a tensor whose own norm
    exceeds fp32's range (elements near 1e19) reads as non-finite while finite: its square would
    make Adam's variance infinite anyway.
    """
    norms = torch._foreach_norm(tensors, 2, dtype=torch.float32)
    return torch.isfinite(torch.stack(norms).max())  # max is NaN (inf) where any norm is


def _all_finite(tensors: list[torch.Tensor]) -> bool:
    """True when every element of every tensor is finite; one host sync.

    :func:`norms_finite_flag`, confirmed element-wise when it says no (an overflowing norm of huge
    finite values is not a NaN), before anyone is told.
    """
    try:
        if bool(norms_finite_flag(tensors)):
            return True
    except (RuntimeError, TypeError):  # e.g. sparse or mixed-device lists: the element-wise check
        pass
    return bool(torch.stack([torch.isfinite(t).all() for t in tensors]).all())


class _PendingFlag:
    """The finiteness verdict of a step masked on the device, on its way to the host.

    One pinned host byte per optimizer, reused: a verdict is read before the next is copied.
    ``ready`` is read through a numpy view made once, so reading it converts no tensor, and
    it waits only if the copy has not landed (then for the step before, at the latest)."""

    def __init__(self, device: torch.device) -> None:
        self.host, self.array = _pinned_flag(device)
        self.event = None
        self.step: int | None = None
        self.phase = ""

    def send(self, flag: torch.Tensor, step: int, phase: str) -> None:
        self.host.copy_(flag, non_blocking=True)
        if flag.is_cuda:
            self.event = torch.cuda.Event()
            self.event.record()
        self.step, self.phase = step, phase

    def take(self) -> tuple[int, str] | None:
        """``(step, phase)`` of a step found non-finite, else ``None``; forgets the verdict."""
        if self.step is None:
            return None
        if self.event is not None and not self.event.query():
            self.event.synchronize()  # not landed after a whole step: wait for it
        bad = None if bool(self.array) else (self.step, self.phase)
        self.step, self.event = None, None
        return bad


def _pinned_flag(device: torch.device):
    """A host bool (pinned for a CUDA device's non-blocking copies) and a numpy view of it."""
    host = torch.zeros((), dtype=torch.bool, pin_memory=device.type == "cuda")
    return host, host.numpy()


def check_synced(opt: OneBitOptimizer, t: int) -> bool:
    """Whether the hook communicated for step ``t``; raise if it should have and did not."""
    if opt.world_size == 1:
        return False
    if opt.hook_state is None or opt.hook_state.layout_step != t:
        raise RuntimeError(
            f"hf_onebit: {type(opt).__name__}.step() runs on {opt.world_size} ranks but the"
            " communication hook did not run for this step. Call"
            " `hf_onebit.attach(ddp_model, optimizer)` after wrapping the model in"
            " DistributedDataParallel (HF Trainer and Accelerate integrations do this for you)."
        )
    return True


def check_grads_exchanged(opt: OneBitOptimizer, t: int) -> None:
    """Refuse a step in which a trainable parameter's gradient never reached the hook.

    DDP hands a bucket to the hook only once *every* parameter in it has a gradient. When
    ``requires_grad`` is switched off after DDP was built (freezing mid-run), the frozen
    parameter's bucket never completes: the other parameters of that bucket (and, since
    DDP launches buckets in order, of every later bucket) keep this rank's own gradient,
    and stock DDP only complains at the *next* forward, suggesting
    ``find_unused_parameters=True``, which hf_onebit refuses on gloo. Stepping would apply
    unexchanged gradients (ranks diverge; 1-bit Adam would even take a local gradient as its
    momentum), so stop here, before any optimizer state changes. Bookkeeping only, no sync.
    """
    if opt.hook_state is None or opt.world_size == 1:  # not attached: no hook to check
        return
    covered = opt.hook_state.covered(t) or set()
    missed = [i for i, p in enumerate(opt.params_in_order())
              if p.grad is not None and p.requires_grad and i not in covered]
    if missed:
        raise RuntimeError(
            f"hf_onebit {type(opt).__name__}: step {t} on rank {opt.rank}: parameter(s) {missed[:8]}"
            " (optimizer order) have a gradient that DDP never handed to the communication hook, so it"
            " was not exchanged between ranks; nothing was changed. A bucket waits for a parameter that"
            " got no gradient: requires_grad was switched off after DDP was built, or a parameter was"
            " unused. To freeze parameters mid-run, set requires_grad_(False), wrap the model in a new"
            " DistributedDataParallel and call hf_onebit.attach(new_ddp, optimizer) again (the optimizer"
            " keeps its state; frozen parameters may stay in it)."
        )


_REMEDIES = (
    " No loss scaler is attached, so the step cannot be skipped. Remedies: lower the learning rate, clip"
    " gradients, or for fp16 pass the GradScaler to hf_onebit.attach(..., grad_scaler=scaler) so such steps"
    " are skipped."
)


def check_finite_grads(opt: OneBitOptimizer) -> torch.Tensor | None:
    """Stop with a clear error if any gradient is non-finite and no loss scaler can skip the step.

    Called at the start of every ``step()``. With a loss scaler attached the scaler skips such
    steps on every rank (the exchanged values are non-finite everywhere) and never calls
    ``step()``; without one, silently applying NaN would corrupt moments, variance and parameters
    for good. ``check_finite=False`` at construction skips the check, for a loop that checks its
    gradients itself. The promise: a non-finite gradient never changes optimizer state
    (parameters, moments, error buffers), and ``FloatingPointError`` is raised (on a GPU also for
    a finite tensor whose 2-norm overflows fp32, see :func:`norms_finite_flag`).

    * Where reading a device value is free (CPU), or the optimizer cannot mask a step, or under
      FSDP2 (every rank of a replica must agree, which the host decides): the host reads one
      fused norm over the gradients and raises *before* any state changes. On a GPU that read is
      a host synchronisation, the one of such a step.
    * On a GPU (:data:`DEFERRED_DEVICES`), with an optimizer that masks
      (:attr:`~hf_onebit.optim.base.OneBitOptimizer.masks_non_finite_steps`): no host sync. The
      verdict stays on the device and is returned; the step uses it to leave every state tensor
      as it was (its arithmetic is unchanged where the flag holds). It is copied to pinned host
      memory and read at the next ``step()``, which raises for the step before, before changing
      anything itself. Only the counters (``steps_done`` and the schedules) moved on. An error
      buffer is not changed by a non-finite exchange in any case (the compressed all-reduce
      checks its scales on every rank first, see :mod:`hf_onebit.comm.compressed`).

    Returns the device flag of a masked step, else ``None``.
    """
    pending = getattr(opt, "_pending_finite", None)
    bad = pending.take() if pending is not None else None
    if bad is not None:
        raise FloatingPointError(
            f"hf_onebit {type(opt).__name__}: non-finite gradient at step {bad[0]} (phase '{bad[1]}'), found on the"
            " device after that step, whose update it masked: no parameter, moment or error buffer changed."
            + _REMEDIES
        )
    if opt.scaled or not opt.check_finite:
        return None
    grads = [p.grad for p in opt.params_in_order() if p.grad is not None]
    if not grads:
        return None
    device = grads[0].device
    if (opt.masks_non_finite_steps and device.type in DEFERRED_DEVICES
            and not (opt.hook_state is not None and opt.hook_state.sharded) and all(g.device == device for g in grads)):
        flag = norms_finite_flag(grads)
        if pending is None:
            pending = opt._pending_finite = _PendingFlag(device)
        pending.send(flag, opt.steps_done + 1, opt.phase())
        return flag
    finite = _all_finite(grads)
    if opt.hook_state is not None:  # FSDP2: each rank of a replica holds other shards; all stop or none
        finite = opt.hook_state.all_ranks_agree(finite)
    if finite:
        return None
    index = opt._index_of()
    bad = [index[id(p)] for p in opt.params_in_order() if p.grad is not None and not bool(torch.isfinite(p.grad).all())]
    where = f"in parameter(s) {bad[:8]} (optimizer order) on rank {opt.rank}" if bad else "on another rank's shard"
    raise FloatingPointError(
        f"hf_onebit {type(opt).__name__}: non-finite gradient at step {opt.steps_done + 1} (phase"
        f" '{opt.phase()}') {where}. No loss"
        " scaler is attached, so the step cannot be skipped; stopping before any optimizer state"
        " changes. Remedies: lower the learning rate, clip gradients, or for fp16 pass the"
        " GradScaler to hf_onebit.attach(..., grad_scaler=scaler) so such steps are skipped."
    )
