"""The hook state: one DDP model's side of the protocol, in the shape of PyTorch's ``PowerSGDState``.

The optimizer decides *what* a step communicates (its :meth:`~hf_onebit.optim.OneBitOptimizer.plan`);
:class:`OneBitHookState` carries it out for each bucket DDP hands over, and owns everything that
is about DDP rather than about the optimizer's maths:

* the process group, the loss scaler and the ordered executor of each device;
* the rule for repeats: the hook may run twice for one bucket before ``step()`` only when the
  previous attempt gave a non-finite result (a skipped step); anything else is gradient
  accumulation without ``no_sync()``, which would compress twice and is refused;
* the layout memory: which parameters the hook saw for which step, so that ``step()`` can refuse
  gradients that were never exchanged, and a resume splits buckets as the uninterrupted run did.

What goes on the wire (segments, error buffers, counters, the node layout) belongs to the
optimizer's :class:`~hf_onebit.exchange.Exchange`, whose ``hook_state`` this state becomes: it brings
the process group and the loss scaler. Inside ``step()`` the optimizer queues a compressed
all-reduce with :meth:`~hf_onebit.exchange.Exchange.sync_async` (0/1 Adam's sync), and asks
:meth:`OneBitHookState.covered` which parameters were exchanged for a step.
"""

# No `from __future__ import annotations` here: DDP checks the hook's annotations at runtime.
from dataclasses import dataclass
from typing import Any, Optional

import torch
import torch.distributed as dist

from hf_onebit.comm import MeanAllReduce
from hf_onebit.comm.allreduce import finite_flag, poison_unless_all_finite_
from hf_onebit.hook.buckets import bucket_gradients, compress_bucket
from hf_onebit.exchange import Plan
from hf_onebit.optim import OneBitOptimizer

_REPEAT = (
    "hf_onebit: the communication hook ran twice for the same bucket before optimizer.step()."
    " For gradient accumulation wrap the non-final micro-batches in `ddp.no_sync()` (Accelerate:"
    " `accelerator.accumulate(model)`, HF Trainer: --gradient_accumulation_steps), so the hook"
    " fires once per optimizer step."
)


@dataclass(frozen=True)
class BucketCall:
    """One call of the hook: step ``t``, the ``attempt`` at it (0 unless a skipped step is
    retried), the plan, and the bucket: its parameters' optimizer indices (``key``), the
    parameters, DDP's flat ``buffer`` and per-parameter ``grads`` views, and the loss scale
    (a 0-dim device tensor, or ``None`` without a scaler)."""

    t: int
    attempt: int
    plan: Plan
    key: tuple
    params: list
    buffer: torch.Tensor
    grads: list
    scale: Optional[torch.Tensor]


def _completed(value: torch.Tensor) -> torch.futures.Future:
    fut: torch.futures.Future = torch.futures.Future()
    fut.set_result(value)
    return fut


def _failed(exc: BaseException) -> torch.futures.Future:
    fut: torch.futures.Future = torch.futures.Future()
    fut.set_exception(exc)
    return fut


class OneBitHookState:
    """What :func:`onebit_hook` needs for one DDP model: the optimizer, the process group
    (``None``: the default group), the loss scaler if fp16 is used, and the protocol's memory
    (see the module docstring).

    Constructing it makes it the optimizer's ``hook_state`` (``hf_onebit.attach`` does, and so does a
    hand-registered hook). An earlier state of the same optimizer (a re-wrapped model) hands its
    layout memory over.
    """

    def __init__(self, optimizer: OneBitOptimizer, process_group: Any = None, grad_scaler: Any = None) -> None:
        if process_group is not None and not isinstance(process_group, dist.ProcessGroup):
            raise TypeError(
                f"OneBitHookState(optimizer, process_group=None, grad_scaler=None): process_group must be a"
                f" torch.distributed.ProcessGroup, got {type(process_group).__name__} (pass a loss scaler as"
                " grad_scaler=...)"
            )
        previous = optimizer.hook_state
        self.optimizer = optimizer
        self.process_group = process_group
        self.grad_scaler = grad_scaler  # torch.amp.GradScaler or None
        self._last_call: dict = {}  # bucket key -> step t of its last hook call
        self._attempts: dict = {}  # bucket key -> attempt number of that call at t
        # step t -> attempt -> 0-dim device bool: every bucket result of that attempt was finite
        self._attempt_finite: dict = {}
        #: step t whose buckets the hook saw (it communicated for t), and their keys
        self.layout_step: Optional[int] = previous.layout_step if previous is not None else None
        self.layout: list = list(previous.layout) if previous is not None else []
        self._mean: Optional[MeanAllReduce] = None  # the warmup's fp32 all-reduce, made at its first use
        optimizer.hook_state = self

    def _mean_allreduce(self) -> MeanAllReduce:
        """The fp32 mean all-reduce over ``process_group`` (one for every bucket: it reads the node
        layout once)."""
        if self._mean is None:
            self._mean = MeanAllReduce(self.process_group, self.optimizer.exchange.stats)
        return self._mean

    # ---------------------------------------------------------------- the optimizer's handle
    @property
    def scaled(self) -> bool:
        """Whether a loss scaler is attached (it may skip steps, so error buffers commit late)."""
        return self.grad_scaler is not None

    def current_scale(self) -> Optional[torch.Tensor]:
        scaler = self.grad_scaler
        if scaler is None or not scaler.is_enabled():
            return None
        return scaler._scale if getattr(scaler, "_scale", None) is not None else None

    def covered(self, t: int) -> Optional[set]:
        """The optimizer indices of the parameters the hook saw for step ``t`` (``None``: it did
        not run for ``t``)."""
        return set().union(*self.layout) if self.layout_step == t else None

    #: Whether each rank holds shards of the parameters (FSDP2), so that statistics of whole
    #: tensors need :meth:`sum_over_shards`.
    sharded = False
    #: Ranks that hold the shards of one replica (1: every rank holds whole tensors). Per-rank
    #: state files record it: error buffers belong to one shard layout.
    shard_size = 1

    def sum_over_shards(self, t: torch.Tensor) -> torch.Tensor:
        """``t`` summed over the ranks that hold the other shards of the same parameters (the
        identity on the DDP path, where every rank holds whole tensors)."""
        return t

    def max_over_shards(self, t: torch.Tensor) -> torch.Tensor:
        """The elementwise maximum of ``t`` over those ranks (the identity on the DDP path)."""
        return t

    def zero_grad(self, set_to_none: bool = True) -> None:
        """What ``optimizer.zero_grad()`` clears besides the optimizer's own parameters: nothing
        on the DDP path (FSDP2's state clears the model's DTensor gradients)."""

    def all_ranks_agree(self, ok: bool) -> bool:
        """Whether a check of this rank's gradients holds on every rank that must stop with it.
        On the DDP path every rank holds the same exchanged gradients: ``ok`` itself (FSDP2's
        state overrides this, see :mod:`hf_onebit.hook.fsdp`)."""
        return ok

    def note_attempt(self, t: int, attempt: int, finite: torch.Tensor) -> None:
        """Record, on the device, whether a bucket result of ``attempt`` at step ``t`` was finite."""
        attempts = self._attempt_finite.setdefault(t, {})
        seen = attempts.get(attempt)
        attempts[attempt] = finite if seen is None else seen & finite

    # ---------------------------------------------------------------- the protocol
    def reduce(self, params: list, buffer: torch.Tensor, grads: list) -> torch.futures.Future:
        """Run this step's plan on one DDP bucket; the future's value becomes the bucket's grads."""
        opt = self.optimizer
        t, plan = opt.steps_done + 1, opt.plan()
        key = opt.indices(params)
        attempt = self._admit(key, t, plan)
        if attempt is None:
            # Fail through the future: an exception raised inside a DDP hook kills the process.
            return _failed(RuntimeError(_REPEAT))
        if self.layout_step != t:  # remember this step's bucket layout (saved per rank)
            self.layout_step, self.layout = t, []
        self.layout.append(key)
        scale = self.current_scale() if self.scaled else None
        call = BucketCall(t, attempt, plan, key, params, buffer, grads, scale)
        if plan in (Plan.LOCAL, Plan.SYNC_AFTER_STEP):
            if plan is Plan.LOCAL:  # nothing sent where DDP would have all-reduced the bucket (a sync counts its own)
                self._mean_allreduce().record_skipped(buffer.numel())
            if not self.scaled:
                return _completed(buffer)
            # With a loss scaler, ranks must skip a step together (see poison_unless_all_finite_).
            return opt.exchange.submit(buffer.device, lambda: self._noted(call, poison_unless_all_finite_(
                buffer, self.process_group, opt.exchange.stats)))
        if plan is Plan.ALLREDUCE:
            mean = self._mean_allreduce()
            return opt.exchange.submit(buffer.device, opt.exchange.in_context(t, plan, lambda: mean(buffer)))
        if plan in (Plan.COMPRESS_MOMENTUM, Plan.COMPRESS_GRADIENT, Plan.QUANTIZE_GRADIENT):
            segments = opt.exchange.segments.for_bucket(key, buffer.device)
            job = lambda: self._noted(call, compress_bucket(opt, call, segments))  # noqa: E731
            return opt.exchange.submit(buffer.device, opt.exchange.in_context(t, plan, job))
        return opt.exchange_bucket(call, self)  # a plan of the optimizer's own (BinSGDM's vote)

    def _admit(self, key: tuple, t: int, plan: Plan) -> Optional[int]:
        """The attempt number of this call at step ``t``, or ``None`` for a refused repeat.

        One rule for repeats: the hook may run again for step ``t`` only when the previous
        attempt's result was non-finite (a loss scaler, or the loop, skipped the step; the
        skipped attempt's deferred error buffers were never committed). An ALLREDUCE step holds
        no error state, so it may repeat freely.
        """
        # Flags of finished steps. list() copies the keys in one step: bucket jobs of this step
        # may be adding theirs on the communication thread while this iterates.
        for done in [s for s in list(self._attempt_finite) if s < t]:
            self._attempt_finite.pop(done, None)
        if self._last_call.get(key) == t and plan is not Plan.ALLREDUCE:
            if not self._previous_attempt_failed(key, t):
                return None
            self._attempts[key] += 1
        else:
            self._attempts[key] = 0
        self._last_call[key] = t
        return self._attempts[key]

    def _previous_attempt_failed(self, key: tuple, t: int) -> bool:
        """Whether the last attempt at step ``t`` gave a non-finite result for some bucket.

        Reads a device flag on the host, but only here: when the hook runs again for a step
        (a skipped step, or a misuse), never in the steady state.
        """
        finite = self._attempt_finite.get(t, {}).get(self._attempts.get(key, 0))
        return finite is not None and not bool(finite)

    def _noted(self, call: BucketCall, result: torch.Tensor) -> torch.Tensor:
        """``result``, after recording whether it is finite (see :meth:`note_attempt`).

        Only when a step can be skipped and retried: with a loss scaler, or with
        ``check_finite=False`` (a loop that skips non-finite steps itself). Otherwise a
        non-finite gradient stops the run in ``step()`` and no repeat can follow, so the
        ``aminmax`` pass over the bucket is not spent.
        """
        if self.scaled or not self.optimizer.check_finite:
            self.note_attempt(call.t, call.attempt, finite_flag(result))
        return result


def onebit_hook(state: OneBitHookState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """DDP communication hook: run the optimizer's plan for this step on ``bucket``."""
    if isinstance(bucket, tuple):  # DDP's Python reducer: (grad, param), one parameter at a time
        from hf_onebit.hook.attach_checks import UnsupportedSetup, compiled_autograd_message

        raise UnsupportedSetup(compiled_autograd_message(
            "DDP's Python reducer called the communication hook with (grad, param) instead of a gradient bucket"))
    return state.reduce(bucket.parameters(), bucket.buffer(), bucket_gradients(bucket))
