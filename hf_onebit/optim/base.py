"""What the four optimizers share: the step plan, counters, compression segments, state.

An optimizer's :meth:`OneBitOptimizer.plan` says what the coming step needs from the network;
the DDP communication hook (:mod:`hf_onebit.hook`, whose docstring has the table of plans)
carries it out during backward. Everything on the wire (segments and their error buffers, the
node layout, the byte counters) belongs to the optimizer's :class:`~hf_onebit.exchange.Exchange`.
"""

from __future__ import annotations

import logging

import torch
import torch.distributed as dist

from hf_onebit.exchange import Exchange, Plan
from hf_onebit.optim import guards, saved_state
from hf_onebit.optim.validation import check_bool, check_common, check_scale_block
from hf_onebit.optim.workspace import Workspace

logger = logging.getLogger("hf_onebit")


class OneBitOptimizer(torch.optim.Optimizer):
    """Base class: a phase machine whose :meth:`plan` drives the communication hook.

    Subclasses implement :meth:`plan`, :meth:`phase`, :meth:`step`, and for the compressed
    plans :meth:`prepare_bucket` / :meth:`finish_bucket` (what the parameters of a segment send
    and what lands in their ``.grad``, as list ops). Global counters live in :meth:`global_state` and travel in
    ``state_dict()["onebit"]``; per-rank state (error buffers, local accumulators) travels in
    :meth:`rank_state_dict`.
    """

    def __init__(self, params, defaults: dict, *, scale_per_tensor: bool = False, scale_block: int | None = None,
                 check_finite: bool = True, hierarchical: bool | None = False) -> None:
        check_bool(check_finite, f"{type(self).__name__}: check_finite")
        self._check_group(defaults)  # also when every group overrides them (torch checks groups only)
        super().__init__(params, defaults)
        #: Whether ``step()`` refuses non-finite gradients without a loss scaler (see
        #: :func:`~hf_onebit.optim.guards.check_finite_grads`; a setting of this process, saved nowhere).
        self.check_finite = check_finite
        if any(p.is_sparse for group in self.param_groups for p in group["params"]):
            raise ValueError("hf_onebit optimizers do not support sparse parameters")
        #: Everything this optimizer puts on the wire (:class:`~hf_onebit.exchange.Exchange`).
        self.exchange = Exchange(type(self).__name__, self.params_in_order, hierarchical=hierarchical,
                                 scale_per_tensor=scale_per_tensor, scale_block=check_scale_block(scale_block),
                                 separate_coded_errors=self.separate_coded_errors)
        self._workspace = Workspace()  # the step's temporaries (see workspace.py)
        self.steps_done = 0  # optimizer steps completed (t of the last step)
        self._step_plan: Plan | None = None  # the plan of the step under way (begin_step sets it)
        self._last_phase: str | None = None

    #: The exchange's compression settings as the constructor took them: one scale per parameter
    #: tensor, and at most ``scale_block`` elements per scale (:class:`~hf_onebit.exchange.Exchange`).
    scale_per_tensor = property(lambda self: self.exchange.scale_per_tensor)
    scale_block = property(lambda self: self.exchange.scale_block)

    #: The hook state (:class:`hf_onebit.hook.OneBitHookState`), which sets itself here when built
    #: (``hf_onebit.attach`` builds it); ``None``: not attached.
    hook_state = property(lambda self: self.exchange.hook_state,
                          lambda self, state: setattr(self.exchange, "hook_state", state))

    # ---------------------------------------------------------------- parameter groups
    def _check_group(self, group: dict) -> None:
        """Raise ``ValueError`` naming the value if a parameter group's hyperparameters are unusable.

        Runs on the constructor's defaults and on every group, those added later by
        :meth:`add_param_group` included, before the group is added. Subclasses extend it.
        """
        check_common(group)

    def add_param_group(self, param_group: dict) -> None:
        """As in torch, once :meth:`_check_group` has accepted the group's hyperparameters."""
        self._check_group({**self.defaults, **{k: v for k, v in param_group.items() if k != "params"}})
        super().add_param_group(param_group)
        self.params_changed()

    # ---------------------------------------------------------------- to implement
    def plan(self) -> Plan:
        """What the coming step (``t = steps_done + 1``) needs from the network."""
        raise NotImplementedError

    def phase(self) -> str:
        """Human-readable name of the coming step's phase (logged at every change)."""
        raise NotImplementedError

    def prepare_bucket(self, plan: Plan, params: list[torch.Tensor], grads: list[torch.Tensor],
                       outs: list[torch.Tensor], inv_scale: torch.Tensor | float | None) -> None:
        """Write the fp32 values to communicate for each of ``params`` into ``outs``, with list ops.

        ``grads`` and ``outs`` are shaped like the parameters (``outs`` fp32 and contiguous;
        ``outs is grads`` when a bucket is compressed in place). ``inv_scale``: ``None`` without a
        loss scaler, else what unscales ``grads`` (the hook passes a 0-dim tensor on the device,
        see :func:`hf_onebit.hook.buckets.compress_bucket`; never compare it with a number, which
        would wait for the device). One call per segment, whatever its number of tensors.
        """
        if plan in (Plan.COMPRESS_GRADIENT, Plan.QUANTIZE_GRADIENT):
            if outs is not grads:
                torch._foreach_copy_(outs, grads)
            if inv_scale is not None:
                torch._foreach_mul_(outs, inv_scale)
            return
        raise NotImplementedError(f"{type(self).__name__} does not prepare {plan.value}")

    def finish_bucket(self, plan: Plan, params: list[torch.Tensor], results: list[torch.Tensor],
                      grads: list[torch.Tensor], scale: torch.Tensor | float | None) -> None:
        """Write what each ``.grad`` holds after the hook, from the fp32 ``results``.

        ``results is grads`` for a bucket compressed in place (then nothing is left to copy);
        otherwise ``results`` are the segment's work views, free to overwrite. ``scale``:
        ``None`` without a loss scaler, else the loss scale (as ``inv_scale`` above).
        """
        if scale is not None:
            torch._foreach_mul_(results, scale)
        if results is not grads:
            torch._foreach_copy_(grads, results)  # logical order, whatever the gradients' strides

    #: Bits per element of the exchanges the papers make at full precision (the warmups):
    #: ``None`` for the full-precision all-reduce (the papers'), 8 or 4 for the b-bit exchange
    #: with error feedback (``docs/algorithms.md``, "Exchanges"). Set by the optimizers that have a
    #: warmup.
    warmup_bits: int | None = None
    #: Whether the b-bit exchange keeps error buffers apart from the 1-bit one's: where the two
    #: alternate on the same buffers (0/1 Adam's variance phase), not where one phase follows the
    #: other (see :mod:`hf_onebit.comm.compressed`).
    separate_coded_errors: bool = False

    def warmup_plan(self) -> Plan:
        """The plan of a step that the papers exchange at full precision: ALLREDUCE, or
        QUANTIZE_GRADIENT at :attr:`warmup_bits`."""
        return Plan.ALLREDUCE if self.warmup_bits is None else Plan.QUANTIZE_GRADIENT

    def exchange_width(self, plan: Plan) -> int:
        """Bits per element of ``plan``'s compressed exchange (the hook passes it to the segment)."""
        return self.warmup_bits if plan is Plan.QUANTIZE_GRADIENT else 1

    def global_state(self) -> dict:
        """Counters identical on every rank (saved in ``state_dict()``); extend in subclasses."""
        return {"steps_done": self.steps_done}

    def load_global_state(self, state: dict) -> None:
        self.steps_done = int(state["steps_done"])

    # ---------------------------------------------------------------- helpers
    @property
    def process_group(self) -> dist.ProcessGroup | None:
        """The attached DDP model's process group (``None``: not attached, the default group)."""
        return self.exchange.process_group

    @property
    def scaled(self) -> bool:
        """Whether a loss scaler is attached: it skips non-finite steps, so they may be retried."""
        return self.hook_state is not None and self.hook_state.scaled

    @property
    def world_size(self) -> int:
        return self.exchange.world_size

    @property
    def rank(self) -> int:
        return self.exchange.rank

    def replace_params(self, replacement: dict[int, torch.Tensor]) -> None:
        """Put ``replacement[id(p)]`` in place of each listed parameter ``p``, keeping its state.

        For FSDP2 (:mod:`hf_onebit.hook.fsdp`): the optimizer then steps on each DTensor
        parameter's local shard, a plain tensor that shares its storage, so all of its maths,
        kernels and per-rank state stay those of a plain tensor. Order, groups and indices are
        unchanged.
        """
        for group in self.param_groups:
            for k, p in enumerate(group["params"]):
                new = replacement.get(id(p))
                if new is None:
                    continue
                if p in self.state:
                    self.state[new] = self.state.pop(p)
                group["params"][k] = new
        self.params_changed()

    def zero_grad(self, set_to_none: bool = True) -> None:
        """As in torch; the hook state may clear gradients the optimizer does not hold (FSDP2's)."""
        super().zero_grad(set_to_none)
        if self.hook_state is not None:
            self.hook_state.zero_grad(set_to_none)

    def params_in_order(self) -> list[torch.Tensor]:
        return [p for group in self.param_groups for p in group["params"]]

    def indices(self, params: list[torch.Tensor]) -> tuple[int, ...]:
        """The optimizer-order indices of ``params`` (a bucket's key)."""
        index = self._index_of()
        return tuple(index[id(p)] for p in params)

    def params_changed(self) -> None:
        """Forget the lookups by parameter (:meth:`_index_of`, :meth:`_group_map`): the groups or
        their order changed."""
        self._group_cache = self._index_cache = None

    def _index_of(self) -> dict[int, int]:
        self._index_cache = self._index_cache or {id(p): i for i, p in enumerate(self.params_in_order())}
        return self._index_cache

    def _group_map(self) -> dict[int, dict]:
        self._group_cache = self._group_cache or {id(p): g for g in self.param_groups for p in g["params"]}
        return self._group_cache

    def exchange_bucket(self, call, hook_state) -> torch.futures.Future:
        """A plan of this optimizer's own on one bucket (``call``: a
        :class:`hf_onebit.hook.BucketCall`; ``hook_state``: the hook state); BinSGDM's vote."""
        raise NotImplementedError(f"{type(self).__name__} has no bucket handler for plan {call.plan.value}")

    # ---------------------------------------------------------------- after each step
    def _after_step(self) -> None:
        """Commit this step's error buffers, advance counters, record traffic, log phase changes."""
        self.steps_done += 1
        # The b-bit warmup's errors are gradient residuals, the momentum exchange's would be
        # momentum residuals: the compression phase starts from zero errors, as after a
        # full-precision warmup, and its segments from the bucket layout it meets.
        self.exchange.end_step(restart_errors=self._step_plan is Plan.QUANTIZE_GRADIENT
                               and self.plan() is Plan.COMPRESS_MOMENTUM)
        phase = self.phase()
        if phase != self._last_phase:
            if self._last_phase is not None and self.rank == 0:
                logger.info(
                    "hf_onebit %s: step %d done, entering phase '%s' (plan %s) from step %d",
                    type(self).__name__, self.steps_done, phase, self.plan().value, self.steps_done + 1,
                )
            self._last_phase = phase

    #: Whether ``step()`` masks its update with :attr:`finite_ok` (a 0-dim device bool): where it
    #: is False no state tensor may change. Optimizers that do get their gradients checked on a
    #: GPU without a host sync (:func:`~hf_onebit.optim.guards.check_finite_grads`); the others
    #: wait for the check, as every optimizer does on CPU.
    masks_non_finite_steps = False
    finite_ok: torch.Tensor | None = None

    def begin_step(self, closure=None) -> tuple:
        """The common start of every ``step()``: run the closure, refuse non-finite gradients
        (raising for the step before where its check was deferred; setting :attr:`finite_ok`).

        Returns ``(loss, t, plan)`` for the step about to run.
        """
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        guards.check_grads_exchanged(self, self.steps_done + 1)
        #: this step's finiteness flag on the device where the step must mask its update (a GPU,
        #: see guards.check_finite_grads), else None (checked on the host already, or not at all)
        self.finite_ok = guards.check_finite_grads(self)
        self._step_plan = self.plan()
        return loss, self.steps_done + 1, self._step_plan

    def check_synced(self, t: int) -> bool:
        """Whether the hook communicated for step ``t``; raise if it should have and did not."""
        return guards.check_synced(self, t)

    def onebit_stats(self) -> dict:
        """The phase, the steps done and :meth:`Exchange.traffic <hf_onebit.exchange.Exchange.traffic>`."""
        return {"phase": self.phase(), "step": self.steps_done, **self.exchange.traffic()}

    # ---------------------------------------------------------------- state
    def state_dict(self) -> dict:
        """Standard optimizer state plus the global counters; never communicates."""
        sd = super().state_dict()
        sd["onebit"] = self.global_state()
        return sd

    def load_state_dict(self, state_dict: dict) -> None:
        """As in torch, but state keeps the dtype it was saved with; a torch Adam/AdamW
        ``state_dict`` seeds the moments (:func:`hf_onebit.optim.saved_state.load_shared`)."""
        saved_state.load_shared(self, state_dict, super().load_state_dict)

    #: Whether a torch Adam/AdamW ``state_dict`` can seed this optimizer's moments.
    imports_adam_state = True
    #: Whether it keeps error-feedback buffers (compression segments), whose layout depends on
    #: the exchange (flat or by node): saved per-rank state records that layout.
    keeps_error_buffers = True

    def rank_state_dict(self) -> dict:
        """This rank's own state (:func:`hf_onebit.optim.saved_state.save`); subclasses add theirs.

        Contains only tensors, ints and tuples, so ``torch.load(..., weights_only=True)`` reads it.
        """
        return saved_state.save(self)

    def reset_rank_state(self) -> None:
        """Start this rank's own state afresh (error buffers zero); shared state is kept.

        For resuming when the per-rank state is missing or unusable (e.g. another world size):
        see :func:`hf_onebit.checkpoint.load_rank_state`. Subclasses extend it.
        """
        saved_state.reset(self)

    def load_rank_state_dict(self, state: dict) -> None:
        """Restore :meth:`rank_state_dict` output; segments are rebuilt lazily as buckets arrive."""
        saved_state.load(self, state)
