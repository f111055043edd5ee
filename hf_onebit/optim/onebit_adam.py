"""1-bit Adam (Tang et al., 2021): Adam warmup, then frozen variance and 1-bit momentum.

During warmup (``t <= freeze_step``) every rank runs Adam on the gradient that the hook
averaged, at full precision (``warmup_bits=None``; with ``bias_correction=True`` this is
``torch.optim.AdamW`` step for step) or with the b-bit exchange (the default, 8 bits; see
``docs/algorithms.md``, "Exchanges"). The variance is then frozen: Adam with a fixed ``v`` is
momentum SGD with a per-coordinate learning rate ``lr / (sqrt(v) + eps)``, which is linear in
the gradients, so error-compensated 1-bit compression of the momentum converges like the
uncompressed method. From step ``freeze_step + 1`` the hook computes each rank's local momentum
``β1·m + (1-β1)·g_i`` and exchanges it with 1 bit per element; ``step()`` takes the averaged
momentum (``.grad`` after the hook) as ``m`` and applies the Adam update with the frozen ``v``.

Coordinates whose gradient was exactly zero on every warmup step (e.g. unused position
embeddings), or whose RMS gradient stayed below ``eps/100`` (e.g. attention key biases), would
otherwise receive ``±scale`` from the compressor forever: they are masked when compression
starts (``auto_mask``, see :mod:`hf_onebit.optim.masks`), or by a mask given with :meth:`set_mask`.
"""

from __future__ import annotations

import math

import torch

from hf_onebit.optim.base import OneBitOptimizer, Plan
from hf_onebit.optim.foreach import Chunk, by_group, chunks, clip_roots_, masked_factor, select_
from hf_onebit.optim.defaults import LIBRARY_DEFAULT, resolve as resolve_defaults
from hf_onebit.optim.freeze import AutoFreeze, FreezeSchedule
from hf_onebit.optim.masks import ZeroGradientMasks
from hf_onebit.optim.validation import check_bool, check_positive_or_none, check_warmup_bits


def adam_update_(
    chunk: Chunk,
    m: list[torch.Tensor],
    v: list[torch.Tensor],
    *,
    lr: float,
    eps: float,
    weight_decay: float,
    bias_correction1: float,
    bias_correction2: float,
    update_clip: float | None = None,
    ok: torch.Tensor | None = None,
) -> None:
    """``p -= lr·(m̂/(sqrt(v̂)+eps) + wd·p)`` in AdamW's operation order, over a chunk's lists
    (the functional core; temporaries in the chunk's workspace slots 0 and 1).

    With ``update_clip = c`` the denominator is ``max(sqrt(v̂), |m̂|/c) + eps``: no coordinate
    moves by more than ``c·lr`` (see :class:`OneBitAdam`'s ``update_clip``). With ``ok`` (a 0-dim
    device bool) the parameters move only where it holds: the decay factor becomes 1 and ``m``
    enters as ``m·ok`` (exact: ``x·1 = x``, and ``p + 0 = p``).
    """
    if weight_decay:
        decay = 1 - lr * weight_decay
        torch._foreach_mul_(chunk.params, masked_factor(decay, ok))
    denom = chunk.scratch(0)
    torch._foreach_copy_(denom, v)
    torch._foreach_sqrt_(denom)
    torch._foreach_div_(denom, math.sqrt(bias_correction2))
    if update_clip is not None:
        clip_roots_(denom, m, bias_correction1 * update_clip, chunk.scratch(1))
    torch._foreach_add_(denom, eps)
    if ok is not None:
        m = torch._foreach_mul(m, ok.float())
    chunk.update_params_(lambda w: torch._foreach_addcdiv_(w, m, denom, value=-lr / bias_correction1), slot=2)


class OneBitAdam(FreezeSchedule, ZeroGradientMasks, OneBitOptimizer):
    """1-bit Adam for DDP (attach it with :func:`hf_onebit.attach`).

    Args:
        params: parameters or parameter groups.
        lr: learning rate (schedulers may change it every step).
        betas: ``(β1, β2)``.
        eps: added to ``sqrt(v̂)``.
        weight_decay: decoupled weight decay (AdamW style).
        freeze_step: last step of the uncompressed warmup; the variance is frozen after it.
            Published guidance: 15-25% of the run (BERT-Large: 23k of ~150k; SQuAD: 400).
            ``"auto"`` (or an :class:`~hf_onebit.optim.freeze.AutoFreeze` with bounds) lets the
            optimizer choose it when the variance has settled (see :mod:`hf_onebit.optim.freeze`).
        bias_correction: apply Adam's bias corrections (the variance correction is frozen at
            ``freeze_step`` too). ``False`` reproduces DeepSpeed's trajectories.
        auto_mask: mask coordinates whose averaged gradient was exactly zero on every warmup step,
            or whose frozen ``sqrt(v̂)`` is below ``eps/100``.
        hierarchical: ``True``: the exchange by node (:mod:`hf_onebit.comm.hierarchical`: an fp32
            mean inside each node, the 1-bit exchange among the node means between nodes),
            which needs ``1 < LOCAL_WORLD_SIZE < world size``, dividing it, and the DDP process
            group to be the whole world; ``None``: by node exactly when those hold; ``False``
            (default): the paper's exchange among all ranks. Full-precision warmups stay flat; b-bit ones
            go by node too.
        check_finite: without a loss scaler, refuse a non-finite gradient (``FloatingPointError``);
            no optimizer state changes. CPU tensors are checked before the step; on a GPU the
            step is masked on the device and the error comes at the next ``step()``, with no host
            sync (see ``optim.guards.check_finite_grads``).
        update_clip: after the freeze, bound every coordinate's step at ``update_clip·lr`` by
            dividing by ``max(sqrt(v̂), |m̂|/update_clip)`` (``None``: the paper's update). Under Adam
            ``|m̂| <= sqrt(v̂)`` nearly always holds, as both average the same gradients; with the
            variance frozen early it stops holding where gradients grow later, and 1-bit momentum
            (every coordinate ``±scale``) breaks it wherever ``v̂`` is small. The frozen variance,
            not the compression, is what loses the bound: uncompressed Adam with the same frozen
            variance takes the same oversized steps, and the clip restores the bound without
            communication (``docs/algorithms.md``, "Update clip"). Default ``1.0``
            (``defaults="paper"``: ``None``).
        warmup_bits: how the warmup exchanges the gradient: ``None`` (the paper) at full
            precision, ``8`` or ``4`` with the b-bit exchange and error feedback (``2·b/8``
            bytes per element per rank instead of ``8``; Adam's moments are built from the
            exchanged gradient). The error buffers are the compression phase's, zeroed at the freeze.
        precondition_exchange: after the freeze, exchange ``m/d`` with ``d = sqrt(v̂)+eps`` and take
            back the average times ``d``, instead of exchanging ``m`` (the paper). The frozen ``v̂`` is
            the same on every rank, so without compression both give the mean momentum
            (``mean(m/d)·d = mean(m)``); with it, the 1-bit scales and the error feedback are in
            the units of the step: each coordinate of a scale block moves by about the same
            amount, where 1-bit momentum moves it by ``scale/d``, largest where ``v̂`` is small.
            Masked coordinates (``auto_mask``: ``v̂ ≈ 0``, which would send ~``g/eps``) send 0.
            Two or three more list ops per bucket and call. Default ``True``
            (``defaults="paper"``: ``False``).
        defaults: ``"library"`` (default): each argument of :mod:`hf_onebit.optim.defaults`'s table
            that is left out takes the library's value; ``"paper"``: the paper's value instead.
        total_steps: the run's length, which fits an automatic freeze's bounds to it (also later,
            :meth:`~hf_onebit.optim.freeze.FreezeSchedule.fit_to_run`).
    """

    def __init__(
        self,
        params,
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.0,
        freeze_step: int | str | AutoFreeze = LIBRARY_DEFAULT,
        bias_correction: bool = True,
        auto_mask: bool = True,
        scale_per_tensor: bool = LIBRARY_DEFAULT,
        scale_block: int | None = LIBRARY_DEFAULT,
        check_finite: bool = True,
        update_clip: float | None = LIBRARY_DEFAULT,
        hierarchical: bool | None = False,
        warmup_bits: int | None = LIBRARY_DEFAULT,
        precondition_exchange: bool = LIBRARY_DEFAULT,
        defaults: str = "library",
        total_steps: int | None = None,
    ) -> None:
        # arguments left out take the library's defaults, or the papers' (optim/defaults.py)
        freeze_step, scale_per_tensor, scale_block, update_clip, warmup_bits, precondition_exchange = resolve_defaults(
            "OneBitAdam", defaults, freeze_step=freeze_step, scale_per_tensor=scale_per_tensor,
            scale_block=scale_block, update_clip=update_clip, warmup_bits=warmup_bits,
            precondition_exchange=precondition_exchange,
        ).values()
        self.update_clip = check_positive_or_none(update_clip, "update_clip")
        self.warmup_bits = check_warmup_bits(warmup_bits)
        self.init_freeze(freeze_step, "freeze_step", total_steps)
        group_defaults = dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay, bias_correction=bias_correction)
        super().__init__(params, group_defaults, scale_per_tensor=scale_per_tensor, scale_block=scale_block,
                         check_finite=check_finite, hierarchical=hierarchical)
        self.auto_mask = auto_mask
        check_bool(precondition_exchange, "OneBitAdam: precondition_exchange")
        self.precondition_exchange = precondition_exchange
        if not bias_correction:
            self.warn_uncorrected_variance(betas[1])

    # ---------------------------------------------------------------- phase machine
    @property
    def freeze_step(self) -> int:
        """The last warmup step: fixed, or chosen by the automatic freeze (see :class:`FreezeSchedule`)."""
        return self.warmup_end

    def plan(self) -> Plan:
        return self.warmup_plan() if self.steps_done + 1 <= self.freeze_step else Plan.COMPRESS_MOMENTUM

    def phase(self) -> str:
        return "warmup" if self.steps_done + 1 <= self.freeze_step else "compression"

    def frozen_variance_correction(self, group: dict) -> float:
        if not group["bias_correction"]:
            return 1.0
        return 1 - group["betas"][1] ** max(self.freeze_step, 1)

    # ---------------------------------------------------------------- the hook side
    def prepare_bucket(self, plan, params, grads, outs, inv_scale) -> None:
        """Compression phase: ``out = β1·m + (1-β1)·g`` per parameter (``g`` unscaled), one list op per ``β1``."""
        if plan is not Plan.COMPRESS_MOMENTUM:
            return super().prepare_bucket(plan, params, grads, outs, inv_scale)
        if inv_scale is not None or grads[0].dtype != torch.float32:
            # the fp32, unscaled gradient goes into out first (out may be the gradient itself)
            if outs is not grads:
                torch._foreach_copy_(outs, grads)
            if inv_scale is not None:
                torch._foreach_mul_(outs, inv_scale)
            grads = outs
        for beta1, index in by_group(self, params, lambda g: g["betas"][0]):
            # _init_state: a parameter without a gradient in the warmup has no state yet
            m = [self._init_state(params[i])["exp_avg"] for i in index]
            mixed = torch._foreach_lerp(m, [grads[i] for i in index], 1 - beta1)  # β1·m + (1-β1)·g in one pass
            if self.precondition_exchange:
                self.to_step_units_([params[i] for i in index], mixed, self._root_scale)
            torch._foreach_copy_([outs[i] for i in index], mixed)

    def finish_bucket(self, plan, params, results, grads, scale) -> None:
        """With ``precondition_exchange``: the averaged ``m/d`` back to momentum (``·d``), then as the base."""
        if self.precondition_exchange and plan is Plan.COMPRESS_MOMENTUM:
            self.from_step_units_(params, results, self._root_scale)
        super().finish_bucket(plan, params, results, grads, scale)

    def _root_scale(self, group: dict) -> float:
        """``sqrt(v̂) = sqrt(v)·this`` for the frozen variance."""
        return 1 / math.sqrt(self.frozen_variance_correction(group))

    # ---------------------------------------------------------------- step
    #: A step whose gradients are not all finite leaves every state tensor as it was (see
    #: :func:`~hf_onebit.optim.guards.check_finite_grads`, which then needs no host sync on a GPU).
    masks_non_finite_steps = True

    @torch.no_grad()
    def step(self, closure=None):
        loss, t, plan = self.begin_step(closure)
        synced = self.check_synced(t) if plan is not Plan.ALLREDUCE else False  # b-bit warmups need the hook too
        compress = plan is Plan.COMPRESS_MOMENTUM
        ok = self.finite_ok  # a device flag: mask this step's update with it (None: nothing to mask)
        for chunk in chunks(self, self._init_state, ok=ok):
            group = chunk.group
            beta1, beta2 = group["betas"]
            m, v = chunk.state("exp_avg"), chunk.state("exp_avg_sq")
            # masked: gradients zero where not ok (chunks), and every state update below made neutral there
            grads = chunk.grads
            if not compress:  # warmup: .grad is the averaged gradient
                if ok is None:
                    torch._foreach_lerp_(m, grads, 1 - beta1)
                else:  # m = m·(1-ok) + lerp(m, g, 1-β1)·ok: exactly the lerp, or exactly m
                    select_(m, torch._foreach_lerp(m, grads, 1 - beta1), ok)
                torch._foreach_mul_(v, masked_factor(beta2, ok))
                torch._foreach_addcmul_(v, grads, grads, value=1 - beta2)
            elif synced:  # compression: the hook delivered the averaged momentum in .grad
                if ok is None:
                    torch._foreach_copy_(m, grads)
                else:
                    select_(m, grads, ok)
            else:  # one process: the momentum is local and exact
                torch._foreach_mul_(m, masked_factor(beta1, ok))
                torch._foreach_add_(m, grads, alpha=1 - beta1)
            if compress:
                self.apply_masks_(chunk, m)
            if group["bias_correction"]:
                bc1 = 1 - beta1**t
                bc2 = 1 - beta2 ** min(t, max(self.freeze_step, 1))
            else:
                bc1 = bc2 = 1.0
            adam_update_(
                chunk, m, v, lr=group["lr"], eps=group["eps"], weight_decay=group["weight_decay"],
                bias_correction1=bc1, bias_correction2=bc2, update_clip=self.update_clip if compress else None,
                ok=ok,
            )
        if not compress:
            self.observe_variance(t, t)
            if t == self.freeze_step:  # the last warmup step: the hook's next exchange reads the masks
                self.freeze_masks()
        self._after_step()
        return loss

