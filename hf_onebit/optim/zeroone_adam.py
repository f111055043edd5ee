"""0/1 Adam (Lu et al., 2022): adaptive variance freezing, then 1-bit-synced local steps.

Two phases:

* **variance** (``t <= var_freeze_step``): every step is synchronised. The variance ``v`` is
  updated only on *variance steps* (``t mod var_interval == 0``), which all-reduce the
  gradient at full precision (the paper; by default hf_onebit sends it at 8 bits with error
  feedback, ``warmup_bits``); every other step all-reduces the gradient with 1 bit per element
  and error feedback, and updates only the momentum. After ``var_update_scaler`` variance
  steps the interval between them doubles (by default it never does: every step of the variance
  phase is a variance step; see the argument).
* **local_steps** (``t > var_freeze_step``): ``v`` is frozen. Each rank runs Adam steps on its
  own gradient and accumulates its updates ``u = -Σ Δ`` and learning rates ``λ = Σ lr``. On a
  *sync step* (``t mod local_interval == 0``) the ranks average ``u ⊙ (sqrt(v)+eps)`` with the
  1-bit compressed all-reduce (by default hf_onebit compresses ``u`` itself and multiplies the
  mean by ``sqrt(v)+eps``: ``precondition_exchange``), move every parameter to ``last synced
  point + ū/(sqrt(v)+eps)`` and restart from the momentum ``-ū/λ`` (times ``1 - β1**t`` with
  ``momentum_correction``). After ``local_step_scaler`` local-phase steps the interval between
  syncs doubles, up to ``local_step_clipper``.

Deviation from the paper (which has no mask): with ``auto_mask`` (default) coordinates whose
averaged gradient was zero on every variance step so far, or whose ``sqrt(v)`` is below
``eps/100``, are masked from the first step that compresses (a 1-bit gradient step or the
local phase): their momentum and their synced update stay zero. Unmasked, the compressor hands
them ``±scale`` and, with ``v ≈ 0``, they move by ``lr·scale/eps`` per step (see
:mod:`hf_onebit.optim.masks`).
"""

from __future__ import annotations

import math

import torch

from hf_onebit.optim.base import OneBitOptimizer, Plan, logger
from hf_onebit.optim.foreach import Chunk, by_group, chunks, masked_factor
from hf_onebit.optim.defaults import LIBRARY_DEFAULT, resolve as resolve_defaults
from hf_onebit.optim.freeze import AutoFreeze, FreezeSchedule
from hf_onebit.optim.local_state import LocalPhaseState
from hf_onebit.optim.masks import ZeroGradientMasks
from hf_onebit.optim.validation import check_bool, check_positive_int, check_positive_or_none, check_warmup_bits


class ZeroOneAdam(LocalPhaseState, FreezeSchedule, ZeroGradientMasks, OneBitOptimizer):
    """0/1 Adam for DDP (attach it with :func:`hf_onebit.attach`); hyperparameter names are DeepSpeed's.

    The phases, what each step sends and where, and the deviations from the paper are in
    ``docs/algorithms.md`` ("0/1 Adam"); why each library default differs from the paper's, in
    :mod:`hf_onebit.optim.defaults`.

    Args:
        params: parameters or parameter groups.
        lr: learning rate (schedulers may change it every step; ``λ`` sums the actual values).
        betas: ``(β1, β2)``.
        eps: added to ``sqrt(v)``.
        weight_decay: decoupled weight decay (AdamW style): ``Δ = lr·(m/(sqrt(v)+eps) + wd·p)``.
        var_freeze_step: last step of the variance phase; ``0`` skips it (``v`` stays zero);
            ``"auto"`` or an :class:`~hf_onebit.optim.freeze.AutoFreeze`: chosen when the
            variance has settled, judged at variance steps (:mod:`hf_onebit.optim.freeze`).
        var_update_scaler: variance steps after which the interval between them doubles (the
            paper's 16; 1-bit gradient steps fill the gaps), or ``None``: every step of the
            variance phase is a variance step.
        local_step_scaler: local-phase steps after which the interval between syncs doubles.
        local_step_clipper: largest interval between syncs.
        auto_mask: from the first compressing step, keep at zero the momentum and synced update
            of coordinates whose averaged gradient was zero on every variance step, or whose
            ``sqrt(v)`` is below ``eps/100`` (``False``: the paper's).
        momentum_correction: step by ``m/(1 - β1**t)`` as Adam does; a sync restores the raw
            momentum.
        refresh_mask: with ``auto_mask``, until the variance freezes, release a masked coordinate
            at the first variance step that sees it non-zero (``False``: fixed at the first
            compressing step).
        bias_correction: divide ``sqrt(v)`` by ``sqrt(1 - β2**k)``, ``k`` the variance updates so
            far (frozen with ``v``; ``False``: the paper's, whose steps after a short variance
            phase are up to ``1/sqrt(1 - β2**k)`` times too large: warned at construction).
        scale_per_tensor, scale_block: one compression scale per tensor, and per block of that
            many elements of it (:mod:`hf_onebit.comm.pieces`).
        check_finite: without a loss scaler, refuse a non-finite gradient
            (``FloatingPointError``; see :mod:`hf_onebit.optim.guards`). A masked step changes no
            tensor of its own; a sync that falls on it still runs with the other ranks.
        update_clip: on steps that do not update the variance, divide by
            ``max(sqrt(v̂), |m|/update_clip) + eps`` (no coordinate moves more than
            ``update_clip·lr``), and bound a sync's move by ``update_clip·λ`` alike; ``None``:
            the paper's update.
        clip_synced_momentum: with ``update_clip``, add a local step followed at once by a sync
            to ``u`` clipped, as every other local step (the paper's preset), so clipping the
            momentum the sync restores; ``False``: unclipped, bounded by the sync's clip.
        sync_in_momentum_units: at a sync compress ``u ⊙ (sqrt(v)+eps) / λ`` (the mean momentum
            since the last sync) and multiply the mean by ``λ``, so the error feedback carries
            momentum whatever the lr; ``False``: the paper's units.
        precondition_exchange: at a sync compress ``u`` itself and multiply the mean by
            ``sqrt(v)+eps`` (the same mean uncompressed: ``v`` is frozen and equal on every
            rank); ``False``: the paper's ``u ⊙ (sqrt(v)+eps)``.
        hierarchical: ``True``: the exchange by node (:mod:`hf_onebit.comm.hierarchical`);
            ``None``: by node where ``LOCAL_WORLD_SIZE`` gives a layout; ``False``: flat.
        warmup_bits: the variance steps' exchange of the gradient: ``8`` or ``4`` bits with error
            buffers of their own, apart from the 1-bit steps'; ``None``: full precision.
        defaults: ``"library"``: each argument left out takes :mod:`hf_onebit.optim.defaults`'s
            value; ``"paper"``: the paper's.
        total_steps: the run's length, which fits an automatic freeze's bounds to it (also later,
            :meth:`~hf_onebit.optim.freeze.FreezeSchedule.fit_to_run`).

    ``.grad`` holds the averaged gradient in the variance phase (bitwise the same on every rank)
    and each rank's own in the local phase. State, fp32 per parameter: ``exp_avg``,
    ``exp_avg_sq``; in the local phase ``momentum_accumulator`` (``u``), ``lr_sum`` (``λ``) and,
    with more than one rank, ``synced_param``, the point of the last sync, so that every rank
    lands on bitwise the same parameters (the paper's ``p - u`` carries each rank's rounding).
    ``state_dict()`` holds what every rank shares; :meth:`rank_state_dict` each rank's own local
    state and error buffers (``docs/api.md``). With a ``GradScaler`` the hook exchanges one
    finiteness flag per bucket on local steps, so every rank skips a step together.
    """

    def __init__(
        self,
        params,
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.0,
        var_freeze_step: int | str | AutoFreeze = LIBRARY_DEFAULT,
        var_update_scaler: int | None = LIBRARY_DEFAULT,
        local_step_scaler: int = 32678,
        local_step_clipper: int = 16,
        auto_mask: bool = True,
        bias_correction: bool = True,
        scale_per_tensor: bool = LIBRARY_DEFAULT,
        scale_block: int | None = LIBRARY_DEFAULT,
        check_finite: bool = True,
        update_clip: float | None = LIBRARY_DEFAULT,
        clip_synced_momentum: bool = LIBRARY_DEFAULT,
        refresh_mask: bool = False,
        momentum_correction: bool = LIBRARY_DEFAULT,
        sync_in_momentum_units: bool = False,
        precondition_exchange: bool = LIBRARY_DEFAULT,
        hierarchical: bool | None = False,
        warmup_bits: int | None = LIBRARY_DEFAULT,
        defaults: str = "library",
        total_steps: int | None = None,
    ) -> None:
        # arguments left out take the library's defaults, or the papers' (optim/defaults.py)
        (var_freeze_step, scale_per_tensor, scale_block, update_clip, clip_synced_momentum, warmup_bits,
         var_update_scaler, momentum_correction, precondition_exchange) = resolve_defaults(
            "ZeroOneAdam", defaults, var_freeze_step=var_freeze_step, scale_per_tensor=scale_per_tensor,
            scale_block=scale_block, update_clip=update_clip, clip_synced_momentum=clip_synced_momentum, warmup_bits=warmup_bits,
            var_update_scaler=var_update_scaler, momentum_correction=momentum_correction,
            precondition_exchange=precondition_exchange).values()
        self.update_clip = check_positive_or_none(update_clip, "update_clip")
        self.warmup_bits = check_warmup_bits(warmup_bits)
        for name, switch in (("clip_synced_momentum", clip_synced_momentum), ("refresh_mask", refresh_mask),
                             ("momentum_correction", momentum_correction),
                             ("sync_in_momentum_units", sync_in_momentum_units),
                             ("precondition_exchange", precondition_exchange)):
            check_bool(switch, name)
        self.precondition_exchange = precondition_exchange
        self.clip_synced_momentum = clip_synced_momentum
        self.sync_in_momentum_units = sync_in_momentum_units
        self.refresh_mask = refresh_mask
        self.momentum_correction = momentum_correction
        self.init_freeze(var_freeze_step, "var_freeze_step", total_steps)
        if var_update_scaler is not None:
            check_positive_int(var_update_scaler, "var_update_scaler")
        check_positive_int(local_step_scaler, "local_step_scaler")
        check_positive_int(local_step_clipper, "local_step_clipper")
        group_defaults = dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay)
        super().__init__(params, group_defaults, scale_per_tensor=scale_per_tensor, scale_block=scale_block,
                         check_finite=check_finite, hierarchical=hierarchical)
        self.var_update_scaler = var_update_scaler
        self.local_step_scaler = local_step_scaler
        self.local_step_clipper = local_step_clipper
        self.var_interval = 1
        self.var_counter = 0
        self.local_interval = 1
        self.local_counter = 0
        self.auto_mask = auto_mask
        self.masks_frozen = False  # set at the first step that compresses
        self.bias_correction = bool(bias_correction)
        self.var_updates = 0  # variance steps so far: the variance's bias correction is 1 - β2**var_updates
        if not self.bias_correction:
            self.warn_uncorrected_variance(betas[1], self.variance_updates_until(self._freeze_bound()))

    def variance_updates_until(self, step: int) -> int:
        """How many variance steps the schedule has in steps ``1..step`` (from the constructor's settings)."""
        if self.var_update_scaler is None:
            return max(step, 0)  # every step is a variance step
        updates = counter = 0
        interval, t = 1, 0
        while True:  # the variance steps are the multiples of each interval, ``var_update_scaler`` at a time
            nxt = (t // interval + 1) * interval
            if nxt > step:
                return updates
            t, updates, counter = nxt, updates + 1, counter + 1
            if counter == self.var_update_scaler:
                counter, interval = 0, interval * 2

    def _freeze_bound(self) -> int:
        """The freeze step for the instability warning: the fixed one, or the earliest automatic one."""
        return self.auto_freeze.min_step if self.auto_freeze is not None else self.warmup_end

    # ---------------------------------------------------------------- phase machine
    @property
    def var_freeze_step(self) -> int:
        """The last variance-phase step: fixed, or chosen by the automatic freeze (see :class:`FreezeSchedule`)."""
        return self.warmup_end

    def plan(self) -> Plan:
        t = self.steps_done + 1
        if t <= self.var_freeze_step:
            return self.warmup_plan() if t % self.var_interval == 0 else Plan.COMPRESS_GRADIENT
        return Plan.SYNC_AFTER_STEP if t % self.local_interval == 0 else Plan.LOCAL

    def phase(self) -> str:
        return "variance" if self.steps_done + 1 <= self.var_freeze_step else "local_steps"

    def global_state(self) -> dict:
        return {
            **super().global_state(),
            "var_interval": self.var_interval,
            "var_counter": self.var_counter,
            "local_interval": self.local_interval,
            "local_counter": self.local_counter,
            "masks_frozen": self.masks_frozen,
            "var_updates": self.var_updates,
            # informative only: the constructor's hyperparameters win on load (var_freeze_step is
            # saved by FreezeSchedule, and an automatically chosen one is restored)
            "var_update_scaler": self.var_update_scaler,
            "local_step_scaler": self.local_step_scaler,
            "local_step_clipper": self.local_step_clipper,
        }

    def load_global_state(self, state: dict) -> None:
        super().load_global_state(state)
        self.var_interval = int(state["var_interval"])
        self.var_counter = int(state["var_counter"])
        self.local_interval = int(state["local_interval"])
        self.local_counter = int(state["local_counter"])
        self.masks_frozen = bool(state["masks_frozen"])
        self.var_updates = int(state["var_updates"])

    # ---------------------------------------------------------------- step
    # List cores over a chunk (hf_onebit.optim.foreach), in the per-tensor operation order. Their
    # temporaries are the results of out-of-place list ops (one op each, where a workspace copy
    # would add one); workspace slot 3 holds fp32 copies of low-precision parameters.
    def _deltas(self, chunk: Chunk, m: list[torch.Tensor], denom: list[torch.Tensor], lr: float,
                wd: float, ok: torch.Tensor | None = None) -> list[torch.Tensor]:
        """``Δ = lr·(m/denom + wd·p)`` (fp32) with ``denom = sqrt(v)+eps``. With ``ok`` (the device
        flag of a masked step) the factor is ``lr`` or 0: exactly ``Δ``, or exactly zero (``Δ``
        comes from finite state and sanitized gradients)."""
        delta = torch._foreach_div(m, denom)
        if wd:
            if chunk.fp32:
                pf = chunk.params
            else:
                pf = chunk.scratch(3)
                torch._foreach_copy_(pf, chunk.params)
            torch._foreach_add_(delta, pf, alpha=wd)
        torch._foreach_mul_(delta, masked_factor(lr, ok, 0.0))
        return delta

    def _update(self, chunk: Chunk, delta: list[torch.Tensor]) -> None:
        """``p -= Δ``, rounded once."""
        chunk.update_params_(lambda w: torch._foreach_sub_(w, delta), slot=3)

    def _roots(self, chunk: Chunk) -> list[torch.Tensor]:
        """``sqrt(v̂) = sqrt(v)/sqrt(1 - β2**var_updates)`` with ``bias_correction``, else ``sqrt(v)``
        (new tensors: the sync keeps them while its exchange runs)."""
        roots = torch._foreach_sqrt(chunk.state("exp_avg_sq"))
        if self.bias_correction and self.var_updates:
            torch._foreach_div_(roots, math.sqrt(1 - chunk.group["betas"][1] ** self.var_updates))
        return roots

    def _denominators(self, chunk: Chunk, clip_by: list[torch.Tensor] | None = None,
                      clip_scales: float | list[float] = 1.0, roots: list[torch.Tensor] | None = None) -> list[torch.Tensor]:
        """``sqrt(v̂) + eps`` (:meth:`_roots`, or ``roots`` given, which are consumed). With
        ``update_clip`` and ``clip_by`` (momenta, or synced ``ū`` with ``clip_scales = λ`` per
        tensor): ``max(sqrt(v̂), |clip_by|/(update_clip·clip_scale)) + eps``."""
        denom = self._roots(chunk) if roots is None else roots
        if self.update_clip is not None and clip_by is not None:
            scratch = torch._foreach_abs(clip_by)
            if isinstance(clip_scales, list):  # clip_roots_'s |clip_by|·(1/limit), one limit per tensor
                torch._foreach_mul_(scratch, [1 / (self.update_clip * c) for c in clip_scales])
            else:
                torch._foreach_mul_(scratch, 1 / (self.update_clip * clip_scales))
            torch._foreach_maximum_(denom, scratch)
        torch._foreach_add_(denom, chunk.group["eps"])
        return denom

    #: A step whose gradients are not all finite leaves every state tensor as it was (see
    #: :func:`~hf_onebit.optim.guards.check_finite_grads`, which then needs no host sync on a GPU):
    #: gradients read as zero, the decays become 1, and each update ``Δ`` is scaled by 0, not ``lr``.
    masks_non_finite_steps = True
    #: The variance phase alternates b-bit variance steps with 1-bit gradient steps on the same
    #: buffers: each keeps its own error feedback (a shared pair would pour the 1-bit residual,
    #: of the gradient's own size, into the gradient that the variance is built from).
    separate_coded_errors = True

    @torch.no_grad()
    def step(self, closure=None):
        loss, t, plan = self.begin_step(closure)
        if plan is not Plan.ALLREDUCE:
            # Every other plan needs the hook: without it DDP would all-reduce at full precision
            # (1-bit steps: more traffic; local steps: not local at all).
            self.check_synced(t)
        if plan not in (Plan.ALLREDUCE, Plan.QUANTIZE_GRADIENT) and not self.masks_frozen:
            # before the first 1-bit step: from the variance steps so far (a b-bit exchange
            # leaves a zero gradient at exactly zero, 1 bit gives it ±scale)
            self.freeze_masks(keep_tracking=self.refresh_mask)
            self.masks_frozen = True
        ok = self.finite_ok  # a device flag: mask this step's update with it (None: nothing to mask)
        if t <= self.var_freeze_step:
            self._variance_phase_step(t, plan, ok)
            self.observe_variance(t, self.var_updates)  # an automatic freeze may choose this step
        else:
            self._local_phase_step(t, plan, ok)
        self._after_step()
        return loss

    def _variance_phase_step(self, t: int, plan: Plan, ok: torch.Tensor | None) -> None:
        variance_step = plan in (Plan.ALLREDUCE, Plan.QUANTIZE_GRADIENT)
        if variance_step:
            self.var_updates += 1  # counts this step's update, which the loop below applies first
        for chunk in chunks(self, self._init_state, ok=ok):
            # masked: gradients zero where not ok (chunks), decays 1, updates ·0 (see masks_non_finite_steps)
            group, grads = chunk.group, chunk.grads
            beta1, beta2 = group["betas"]
            m = chunk.state("exp_avg")
            if variance_step:
                v = chunk.state("exp_avg_sq")
                torch._foreach_mul_(v, masked_factor(beta2, ok))
                torch._foreach_addcmul_(v, grads, grads, value=1 - beta2)
                if self.refresh_mask and self.masks_frozen:
                    for state in chunk.states:  # only tensors that still have a mask: one-time releases
                        if state.get("mask_refresh"):
                            self.unmask_seen(state, group)  # before m takes this gradient
            torch._foreach_mul_(m, masked_factor(beta1, ok))
            torch._foreach_add_(m, grads, alpha=1 - beta1)
            self.apply_masks_(chunk, m)
            # momentum_correction: m̂ = m/c1 as Adam's; m/(c1·(max(sqrt(v̂), |m̂|/clip) + eps)) = m̂/(...)
            c1 = self._momentum_bias(group, t)
            denom = self._denominators(chunk, None if variance_step else m, c1)
            if self.momentum_correction:
                torch._foreach_mul_(denom, c1)
            self._update(chunk, self._deltas(chunk, m, denom, group["lr"], group["weight_decay"], ok))
        if variance_step:
            self.var_counter += 1
            if self.var_counter == self.var_update_scaler:  # never with None
                self.var_counter = 0
                self.var_interval *= 2

    def _local_phase_step(self, t: int, plan: Plan, ok: torch.Tensor | None) -> None:
        if t == self.var_freeze_step + 1:
            self._enter_local_phase()
        clip = self.update_clip is not None
        for chunk in chunks(self, self._init_local_state, ok=ok):  # masked: this rank's gradients read as zero
            # A sync right after this one local step (λ = lr): its bound c·λ is this step's bound,
            # so without clip_synced_momentum u takes the unclipped step (a clipped u clips the
            # momentum the sync restores, u ⊙ (sqrt(v̂)+eps)/λ) and the sync's clip bounds where
            # the ranks land. After several local steps u takes the clipped ones either way, so
            # the sync lands on the mean of where the ranks went (docs/algorithms.md).
            unclipped_u = [not self.clip_synced_momentum and plan is Plan.SYNC_AFTER_STEP and s["lr_sum"] == 0.0
                           for s in chunk.states]
            for kind in sorted(set(unclipped_u)):  # usually one pass: every tensor alike
                part = chunk if len(set(unclipped_u)) == 1 else chunk.subset(
                    [i for i, x in enumerate(unclipped_u) if x == kind])
                self._local_update(part, clip, kind, ok, t)
        if plan is Plan.SYNC_AFTER_STEP:
            self._sync(t)
        self.local_counter += 1
        if self.local_counter == self.local_step_scaler:
            self.local_counter = 0
            self.local_interval = min(self.local_step_clipper, 2 * self.local_interval)

    def _momentum_bias(self, group: dict, t: int) -> float:
        """``c1 = 1 - β1**t`` with ``momentum_correction`` (else 1): every step moves by ``m̂ = m/c1``
        (in the local phase too, which an early freeze in a short run needs: ``β1**t`` is 0.43 at
        step 8), and a sync stores ``c1·m̂``, so ``m`` stays Adam's raw mean."""
        return 1 - group["betas"][0] ** t if self.momentum_correction else 1.0

    def _local_update(self, chunk: Chunk, clip: bool, unclipped_u: bool, ok: torch.Tensor | None,
                      t: int) -> None:
        """One local step: ``m``, then ``p -= Δ`` and ``u -= Δ`` (``unclipped_u``: ``u`` takes the
        unclipped ``Δ``, see the caller), ``Δ = lr·(m̂/(max(sqrt(v̂), |m̂|/clip) + eps) + wd·p)``
        with ``m̂ = m/c1``: ``_deltas`` at ``lr/c1`` and ``wd·c1``, no op more."""
        group = chunk.group
        beta1 = group["betas"][0]
        c1 = self._momentum_bias(group, t)
        lr, wd = group["lr"], group["weight_decay"]
        m = chunk.state("exp_avg")
        torch._foreach_mul_(m, masked_factor(beta1, ok))
        torch._foreach_add_(m, chunk.grads, alpha=1 - beta1)
        self.apply_masks_(chunk, m)
        delta = self._deltas(chunk, m, self._denominators(chunk, m if clip and not unclipped_u else None, c1),
                             lr / c1, wd * c1, ok)
        torch._foreach_sub_(chunk.state("momentum_accumulator"), delta)
        if clip and unclipped_u:
            delta = self._deltas(chunk, m, self._denominators(chunk, m, c1), lr / c1, wd * c1, ok)
        self._update(chunk, delta)
        for state in chunk.states:  # on the host, so a masked step counts too (λ is documented so)
            state["lr_sum"] += lr

    def _enter_local_phase(self) -> None:
        """First local step: allocate the local state; zero every error buffer; fix the masks."""
        if self.refresh_mask:
            masked = self.stop_mask_tracking()
            if self.rank == 0 and masked:
                logger.warning("hf_onebit ZeroOneAdam: %d coordinates stay masked from step %d (their gradient was"
                               " zero on every variance step, or its RMS stayed below eps/100)", masked, self.var_freeze_step + 1)
        params = self.params_in_order()
        for p in params:
            self._init_local_state(p)
        if self.world_size > 1 and params:
            # Materialises saved-but-unused segments too, so no stale error survives a resume.
            for seg in self.exchange.covering_all(params[0].device):
                seg.comm.reset()

    def _sync(self, t: int) -> None:
        """Average ``u ⊙ (sqrt(v)+eps)`` (1 bit), restart every rank from the same point, with the
        momentum ``m = -c1·ū ⊙ (sqrt(v)+eps)/λ`` (``c1``: :meth:`_momentum_bias` at step ``t``)."""
        params = self.params_in_order()
        if self.world_size == 1:
            for chunk in chunks(self, self._init_local_state, params=params):
                live = [i for i, s in enumerate(chunk.states) if s["lr_sum"] > 0]
                if live:
                    part = chunk if len(live) == len(chunk.params) else chunk.subset(live)
                    m = part.state("exp_avg")
                    torch._foreach_copy_(m, part.state("momentum_accumulator"))
                    torch._foreach_mul_(m, self._denominators(part))
                    c1 = self._momentum_bias(part.group, t)
                    torch._foreach_div_(m, [-s["lr_sum"] / c1 for s in part.states])
                self._restart(chunk)
            return
        segments = self.exchange.covering_all(params[0].device)
        futures, parts = [], []
        for seg in segments:  # fill a segment, queue it, fill the next while it travels
            seg_params, views = seg.shaped_views(params)
            seg_parts = self._segment_chunks(seg_params, views)
            with_roots = []
            for chunk, out in seg_parts:
                roots = self._roots(chunk)  # kept for the restart below, which clips them by ū
                torch._foreach_copy_(out, chunk.state("momentum_accumulator"))
                if not self.precondition_exchange:
                    torch._foreach_mul_(out, torch._foreach_add(roots, chunk.group["eps"]))
                if self.sync_in_momentum_units:
                    self._per_live_tensor(chunk, out, torch._foreach_div_)
                with_roots.append((chunk, out, roots))
            futures.append(self.exchange.sync_async(seg, self.steps_done + 1))
            parts.append(with_roots)
        for fut, seg_parts in zip(futures, parts):
            fut.wait()
            for chunk, ubar, roots in seg_parts:
                if self.precondition_exchange:  # the mean move back to u ⊙ (sqrt(v)+eps)
                    torch._foreach_mul_(ubar, torch._foreach_add(roots, chunk.group["eps"]))
                self.apply_masks_(chunk, ubar)
                # λ = 0: no local step since the last sync on any rank (a frozen parameter, no
                # gradient, or lr 0), so u = 0 everywhere and the exact mean is 0; ū is then only
                # compression noise (the segment's scale and error feedback), which would move a
                # frozen parameter. Leave it, and its state, where they are.
                live = [i for i, s in enumerate(chunk.states) if s["lr_sum"] > 0]
                if live:
                    part = chunk if len(live) == len(chunk.params) else chunk.subset(live)
                    ubar_live = [ubar[i] for i in live]
                    lams = [s["lr_sum"] for s in part.states]
                    if self.sync_in_momentum_units:
                        torch._foreach_mul_(ubar_live, lams)
                    m = part.state("exp_avg")
                    torch._foreach_copy_(m, ubar_live)
                    c1 = self._momentum_bias(part.group, t)
                    torch._foreach_div_(m, [-lam / c1 for lam in lams])
                    points = part.state("synced_param")
                    # the paper's (p - u) + ū/(sqrt(v)+eps); with update_clip no coordinate moves by more than update_clip·λ
                    roots_live = roots if part is chunk else [roots[i] for i in live]
                    torch._foreach_addcdiv_(points, ubar_live, self._denominators(part, ubar_live, lams, roots_live))
                    torch._foreach_copy_(part.params, points)
                self._restart(chunk)

    @staticmethod
    def _restart(chunk: Chunk) -> None:
        """After a sync: ``u = 0``, ``λ = 0``."""
        torch._foreach_zero_(chunk.state("momentum_accumulator"))
        for state in chunk.states:
            state["lr_sum"] = 0.0

    @staticmethod
    def _per_live_tensor(chunk: Chunk, tensors: list[torch.Tensor], op) -> None:
        """``op(tensors_p, λ_p)`` for the tensors whose ``λ > 0``."""
        live = [i for i, s in enumerate(chunk.states) if s["lr_sum"] > 0]
        if live:
            op([tensors[i] for i in live], [chunk.states[i]["lr_sum"] for i in live])

    def _segment_chunks(self, seg_params: list[torch.Tensor], views: list[torch.Tensor]) -> list[tuple[Chunk, list]]:
        """A segment's parameters as chunks by parameter group (their hyperparameters), each
        with its views of the segment's work buffer."""
        groups = self._group_map()
        out = []
        for _, index in by_group(self, seg_params, id):
            ps = [seg_params[i] for i in index]
            chunk = Chunk(ps, None, [self._init_local_state(p) for p in ps], groups[id(ps[0])], self._workspace)
            out.append((chunk, [views[i] for i in index]))
        return out
