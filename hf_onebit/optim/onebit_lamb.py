"""1-bit LAMB (Li et al., 2021): LAMB warmup, then frozen variance and trust ratios, 1-bit momentum.

See :class:`OneBitLamb` for the maths, the phase table and what ``.grad`` holds.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from functools import partial

import torch

from hf_onebit.optim.base import OneBitOptimizer, Plan
from hf_onebit.optim.foreach import Chunk, by_group, chunks, clip_roots_, logical, masked_factor, maxima, reduced, select_
from hf_onebit.optim.defaults import LIBRARY_DEFAULT, resolve as resolve_defaults
from hf_onebit.optim.freeze import AutoFreeze, FreezeSchedule
from hf_onebit.optim.masks import ZeroGradientMasks
from hf_onebit.optim.validation import check_bool, check_lamb_bounds, check_positive_or_none, check_warmup_bits


def _trust_ratio(w_norm: torch.Tensor, u_norm: torch.Tensor, group: dict) -> torch.Tensor:
    """LAMB's ``clip(‖p‖/‖u‖, min_coeff, max_coeff)`` per tensor, 1 unless both norms are positive."""
    ratio = (w_norm / u_norm).clamp_(group["min_coeff"], group["max_coeff"])
    return torch.where(torch.minimum(w_norm, u_norm) > 0, ratio, 1.0)  # both norms > 0 (3 ops, not 5)


class OneBitLamb(FreezeSchedule, ZeroGradientMasks, OneBitOptimizer):
    r"""1-bit LAMB for DDP (attach it with :func:`hf_onebit.attach`).

    **The maths.** LAMB is Adam with a per-tensor *trust ratio*: parameter tensor ``p`` moves by
    ``lr·c·u`` with ``u = m/(sqrt(v)+eps) + wd·p`` and ``c = clip(‖p‖/‖u‖, min_coeff,
    max_coeff)``. 1-bit compression with error feedback converges like the uncompressed method
    only when the update is *linear* in the communicated momentum (1-bit Adam: with ``v``
    frozen, Adam is momentum SGD with a fixed per-coordinate learning rate). ``‖p‖/‖u‖`` is not
    linear in ``m``: computed from a 1-bit momentum, the compression error would enter the
    step size of every layer. So during the warmup (``t <= freeze_step``, exact LAMB on the
    averaged gradient) each tensor keeps an exponential average ``c_frozen`` (``coeff_beta``;
    starting at 0 as in DeepSpeed; steps with ``c == 1`` are not averaged) of its trust ratio,
    and afterwards the step uses ``c_frozen`` -- a constant, so the update is linear in ``m``
    again. A frozen variance and a frozen ratio become stale as training moves on, so a second
    variance ``v_fresh`` (a copy of ``v`` at the freeze) keeps tracking the gradient
    ``g̃ = (m − β1·m_prev)/(1−β1)`` reconstructed from two consecutive synced momenta (no extra
    communication). ``f = max((sqrt(v)+eps)/(sqrt(v_fresh)+eps))`` says how much larger the
    step would be with the current variance; it rescales the frozen ratio to ``c_frozen·f``.
    ``f`` is one scalar per tensor and is *bounded*: to ``[factor_min, factor_max]`` and to a
    relative change of ``factor_threshold`` per step (``f_last`` starts at 1), so it follows the
    drift of the variance slowly and cannot turn compression noise in ``g̃`` into jumps of the
    step size; with weight decay it only rescales the adaptive share ``ρ = min(1,
    ‖m/(sqrt(v)+eps)‖/‖u‖)`` of the update (``f ← ρ·f + 1 − ρ``).

    **The step bound** (``step_bound``). LAMB's ratio normalizes each step to ``lr·‖p‖``; the
    frozen one does not, so where the gradient outgrows the frozen variance ``‖u‖``, and the step,
    grow (from scratch at a large lr single tensors took 5-9 times LAMB's step, and diverged).
    ``c_frozen·f`` is capped at ``step_bound`` times LAMB's own ratio of the exchanged update: one
    scalar per tensor, so the step stays linear in ``m`` within it, where ``update_clip`` cuts
    coordinates that arrive near their block's scale (at 1.0 the step became ``sign(m)``).

    **Momentum scaling.** A bucket holds tensors whose momenta differ by orders of magnitude, so
    each tensor's momentum is multiplied by ``scaling_p = mean_q RMS(m_q) / RMS(m_p)`` before
    compression and divided by it after (1 where that is not a finite positive number), computed
    once at the end of step ``freeze_step`` over every tensor and kept in ``state_dict()``.

    Its phases are 1-bit Adam's (``docs/algorithms.md``): every exchange runs in the DDP hook
    while backward runs, none in ``step()``; after the freeze ``.grad`` holds the new momentum
    (so ``clip_grad_norm_`` clips the momentum). With one process nothing is communicated or
    compressed.

    State per parameter, fp32: ``exp_avg`` (m), ``exp_avg_sq`` (v), ``exp_avg_sq_fresh`` (v_fresh; none
    with ``fresh_trust_ratio``), ``coeff_frozen``, ``last_factor`` (f_last), ``scaling``, the mask.

    Args:
        params: parameters or parameter groups (every hyperparameter below except
            ``freeze_step`` and ``auto_mask`` may be set per group).
        lr: learning rate (schedulers may change it every step).
        betas: ``(β1, β2)``.
        eps: added to ``sqrt(v)`` (and to ``sqrt(v_fresh)``).
        weight_decay: ``wd``, added to the update before the trust ratio (LAMB style).
        freeze_step: last step of the warmup (published: 15-25% of the run), or ``"auto"`` / an
            :class:`~hf_onebit.optim.freeze.AutoFreeze`: when the variance has settled.
        max_coeff, min_coeff: bounds of the warmup trust ratio ``c`` (``0 < min <= max``).
        coeff_beta: averaging factor of ``c_frozen`` (in ``[0, 1)``).
        factor_max, factor_min: bounds of the compression-phase factor ``f`` (``0 < min <= max``).
        factor_threshold: largest relative change of ``f`` from one step to the next (``>= 0``).
        auto_mask: keep at zero the momentum of coordinates whose averaged gradient was zero on
            every warmup step (unused embedding rows) or whose ``sqrt(v)`` stayed below
            ``eps/100``; :meth:`set_mask` overrides it per parameter.
        hierarchical: ``True``: the exchange by node (:mod:`hf_onebit.comm.hierarchical`);
            ``None``: by node where ``LOCAL_WORLD_SIZE`` gives a layout; ``False``: flat.
        check_finite: without a loss scaler, refuse a non-finite gradient
            (``FloatingPointError``; :mod:`hf_onebit.optim.guards`); no optimizer state changes.
        update_clip: after the freeze ``u = m/(max(sqrt(v), |m|/update_clip) + eps) + wd·p``
            (``f`` compares the unclipped denominators). Not per group; ``None``: the spec's.
        step_bound: after the freeze the coefficient is ``min(c_frozen·f, step_bound·clip(‖p‖/‖u‖,
            min_coeff, max_coeff))``. Not per group; ``None``: the spec's ``c_frozen·f``.
        warmup_bits: the warmup's gradient exchange: ``8`` or ``4`` bits with error feedback, or
            ``None`` (the spec) at full precision.
        bias_correction: LAMB on Adam's corrected moments ``m̂``, ``v̂`` (``v̂`` frozen with ``v``),
            the trust-ratio average starting at the first ratio, not 0 (the paper: ``False``).
        fresh_trust_ratio: after the freeze, step with LAMB's own ratio ``clip(‖p‖/‖u‖, min_coeff,
            max_coeff)`` of the exchanged update instead of ``c_frozen·f``: its compression noise
            makes this LAMB at a smaller lr (``docs/results.md``). Default ``False``.
        precondition_exchange: after the freeze, exchange the scaled momentum divided by
            ``sqrt(v̂)+eps`` and multiply the average back, as 1-bit Adam's option of the same name
            (:meth:`~hf_onebit.optim.masks.ZeroGradientMasks.to_step_units_`). Default ``False``.
        defaults: ``"library"`` (default): each argument of :mod:`hf_onebit.optim.defaults`'s table
            that is left out takes its measured value; ``"paper"``: the spec's value instead.
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
        max_coeff: float = 10.0,
        min_coeff: float = 0.01,
        coeff_beta: float = 0.9,
        factor_max: float = 4.0,
        factor_min: float = 0.5,
        factor_threshold: float = 0.1,
        auto_mask: bool = True,
        scale_per_tensor: bool = LIBRARY_DEFAULT,
        scale_block: int | None = LIBRARY_DEFAULT,
        check_finite: bool = True,
        update_clip: float | None = LIBRARY_DEFAULT,
        hierarchical: bool | None = False,
        warmup_bits: int | None = LIBRARY_DEFAULT,
        bias_correction: bool = LIBRARY_DEFAULT,
        fresh_trust_ratio: bool = False,
        precondition_exchange: bool = False,
        step_bound: float | None = LIBRARY_DEFAULT,
        defaults: str = "library",
        total_steps: int | None = None,
    ) -> None:
        # arguments left out take the measured defaults, or the papers' (optim/defaults.py)
        freeze_step, scale_per_tensor, scale_block, update_clip, warmup_bits, bias_correction, step_bound = (
            resolve_defaults("OneBitLamb", defaults, freeze_step=freeze_step, scale_per_tensor=scale_per_tensor,
                             scale_block=scale_block, update_clip=update_clip, warmup_bits=warmup_bits,
                             bias_correction=bias_correction, step_bound=step_bound).values())
        self.init_freeze(freeze_step, "freeze_step", total_steps)
        self.update_clip = check_positive_or_none(update_clip, "update_clip")
        self.warmup_bits = check_warmup_bits(warmup_bits)
        check_bool(bias_correction, "bias_correction")
        self.bias_correction = bias_correction
        check_bool(fresh_trust_ratio, "fresh_trust_ratio")
        self.fresh_trust_ratio = fresh_trust_ratio
        check_bool(precondition_exchange, "precondition_exchange")
        self.precondition_exchange = precondition_exchange
        self.step_bound = check_positive_or_none(step_bound, "step_bound")
        group_defaults = dict(
            lr=lr, betas=tuple(betas) if isinstance(betas, Sequence) else betas, eps=eps,
            weight_decay=weight_decay, max_coeff=max_coeff, min_coeff=min_coeff, coeff_beta=coeff_beta,
            factor_max=factor_max, factor_min=factor_min, factor_threshold=factor_threshold,
        )
        super().__init__(params, group_defaults, scale_per_tensor=scale_per_tensor, scale_block=scale_block,
                         check_finite=check_finite, hierarchical=hierarchical)
        self.auto_mask = auto_mask

    # ---------------------------------------------------------------- parameter groups
    def _check_group(self, group: dict) -> None:
        """The base's checks (lr, eps, weight_decay, betas), then LAMB's bounds."""
        super()._check_group(group)
        check_lamb_bounds(group)

    # ---------------------------------------------------------------- phase machine
    @property
    def freeze_step(self) -> int:
        """The last warmup step: fixed, or chosen by the automatic freeze (see :class:`FreezeSchedule`)."""
        return self.warmup_end

    def plan(self) -> Plan:
        return self.warmup_plan() if self.steps_done + 1 <= self.freeze_step else Plan.COMPRESS_MOMENTUM

    def phase(self) -> str:
        return "warmup" if self.steps_done + 1 <= self.freeze_step else "compression"

    def _corrections(self, group: dict) -> tuple[float, float, float] | None:
        """With ``bias_correction``, the step's ``(1/(1−β1^t), 1/sqrt(1−β2^k), 1/sqrt(1−β2^t))``:
        the momentum's correction, the variance's (``k = min(t, freeze_step)``: frozen with it)
        and the fresh variance's (a copy of ``v`` at the freeze that goes on averaging); else ``None``."""
        if not self.bias_correction:
            return None
        beta1, beta2 = group["betas"]
        t = self.steps_done + 1
        return 1 / (1 - beta1**t), 1 / math.sqrt(1 - beta2 ** max(1, min(t, self.freeze_step))), 1 / math.sqrt(1 - beta2**t)

    def _root_scale(self, group: dict) -> float:
        """``sqrt(v̂) = sqrt(v)·this`` for the frozen variance in the compression phase."""
        bc = self._corrections(group)
        return 1.0 if bc is None else bc[1]

    # ---------------------------------------------------------------- the hook side
    def prepare_bucket(self, plan, params, grads, outs, inv_scale) -> None:
        """Compression phase: ``out = (β1·m_p + (1−β1)·g_p,i)·scaling_p`` (``g`` unscaled), list ops."""
        if plan is not Plan.COMPRESS_MOMENTUM:
            return super().prepare_bucket(plan, params, grads, outs, inv_scale)
        if outs is not grads:
            torch._foreach_copy_(outs, grads)
        for beta1, index in by_group(self, params, lambda g: g["betas"][0]):
            sub = [outs[i] for i in index]
            # (1 − β1)·inv_scale in fp64 (a 0-dim tensor), rounded once to fp32 as a Python float is
            torch._foreach_mul_(sub, (1 - beta1) if inv_scale is None else (1 - beta1) * inv_scale)
            states = [self.state.get(params[i]) for i in index]
            with_m = [(o, st["exp_avg"]) for o, st in zip(sub, states) if st and "exp_avg" in st]
            if with_m:
                torch._foreach_add_([o for o, _ in with_m], [m for _, m in with_m], alpha=beta1)
            scaled = [(o, st["scaling"]) for o, st in zip(sub, states) if st and "scaling" in st]
            if scaled:
                torch._foreach_mul_([o for o, _ in scaled], [s for _, s in scaled])
            if self.precondition_exchange:
                self.to_step_units_([params[i] for i in index], sub, self._root_scale)

    def finish_bucket(self, plan, params, results, grads, scale) -> None:
        """Compression phase: ``.grad = M_p / scaling_p`` (times the loss scale, if any)."""
        if plan is Plan.COMPRESS_MOMENTUM:
            if self.precondition_exchange:
                self.from_step_units_(params, results, self._root_scale)
            scaled = [(r, st["scaling"]) for r, st in zip(results, map(self.state.get, params)) if st and "scaling" in st]
            if scaled:  # results: this segment's work views or the bucket itself, free to overwrite
                torch._foreach_div_([r for r, _ in scaled], [s for _, s in scaled])
        super().finish_bucket(plan, params, results, grads, scale)

    def load_state_dict(self, state_dict: dict) -> None:
        """As the base class; where the frozen ratio reads the fresh variance and the checkpoint,
        saved with ``fresh_trust_ratio``, has none, it starts as ``v``, as at the freeze."""
        super().load_state_dict(state_dict)
        if not self.fresh_trust_ratio:
            for state in self.state.values():
                if "exp_avg_sq" in state and "exp_avg_sq_fresh" not in state:
                    state["exp_avg_sq_fresh"] = state["exp_avg_sq"].clone()

    # ---------------------------------------------------------------- step
    def _init_extra_state(self, p: torch.Tensor, state: dict) -> None:
        """The frozen trust ratio, the last factor, the momentum scaling and, where the frozen
        ratio's factor reads it (``fresh_trust_ratio=False``), the fresh variance."""
        if not self.fresh_trust_ratio:
            state["exp_avg_sq_fresh"] = torch.zeros_like(p, dtype=torch.float32, memory_format=torch.preserve_format)
        scalar = dict(dtype=torch.float32, device=p.device)
        state["coeff_frozen"] = torch.zeros((), **scalar)
        state["last_factor"] = torch.ones((), **scalar)
        state["scaling"] = torch.ones((), **scalar)

    # ---------------------------------------------------------------- the list cores
    # Each phase's step over one chunk's lists (hf_onebit.optim.foreach: one op per list, whatever
    # its length), in two halves. ``_*_directions`` updates the moments and forms the direction
    # ``u``; it returns ``u`` with the per-tensor scalars the step depends on, stacked into vectors:
    # ``norms`` and ``maxima``. ``_*_finish`` turns them into the step. Both scalars are of whole
    # tensors: where a rank holds whole tensors they are already; where it holds FSDP2 shards,
    # :meth:`_sharded_step` combines them over the replica's ranks between the two halves. ``ok``:
    # the device flag that masks the step (see masks_non_finite_steps). Workspace slots: 0
    # sqrt(v)+eps; 1 u (warmup); 3 fp32 copies of low-precision parameters.

    def _one_on(self, device: torch.device) -> torch.Tensor:
        """A 0-dim fp32 1.0 on ``device``, made once (``torch.fmin`` takes no Python scalar)."""
        ones = self.__dict__.setdefault("_ones", {})
        if device not in ones:
            ones[device] = torch.ones((), dtype=torch.float32, device=device)
        return ones[device]

    @staticmethod
    def _fp32_params(chunk: Chunk) -> list[torch.Tensor]:
        """The parameters in fp32 and in logical order (copies where they are not both), for norms."""
        if chunk.fp32:
            return [logical(p) for p in chunk.params]
        pf = chunk.scratch(3)
        torch._foreach_copy_(pf, chunk.params)
        return pf

    @staticmethod
    def _apply_updates(chunk: Chunk, u: list[torch.Tensor], coeffs: torch.Tensor, lr: float) -> None:
        """``p -= lr·coeff_p·u_p`` (``u`` is consumed; ``coeffs`` one per tensor); rounded once."""
        torch._foreach_mul_(u, list(coeffs.unbind()))
        chunk.update_params_(lambda w: torch._foreach_add_(w, u, alpha=-lr), slot=3)

    def _warmup_directions(self, chunk: Chunk, ok: torch.Tensor | None, keep: bool = False):
        """Adam's moments on the averaged gradient, then ``u = m/(sqrt(v)+eps) + wd·p``
        (``m̂/(sqrt(v̂)+eps) + wd·p`` with bias correction); norms ``(‖p‖, ‖u‖)``, no maxima.
        ``keep``: ``u`` in memory of its own, not in the workspace slot the next chunk reuses."""
        group = chunk.group
        grads = chunk.grads  # sanitized by chunks() on a masked step
        beta1, beta2 = group["betas"]
        m, v = chunk.state("exp_avg"), chunk.state("exp_avg_sq")
        torch._foreach_mul_(m, masked_factor(beta1, ok))
        torch._foreach_add_(m, grads, alpha=1 - beta1)
        torch._foreach_mul_(v, masked_factor(beta2, ok))
        torch._foreach_addcmul_(v, grads, grads, value=1 - beta2)
        pf = self._fp32_params(chunk)
        root = chunk.scratch(0)
        bc = self._corrections(group)
        torch._foreach_copy_(root, v)
        torch._foreach_sqrt_(root)
        if bc is not None:
            torch._foreach_mul_(root, bc[1])
        torch._foreach_add_(root, group["eps"])
        if keep:
            u = list(torch._foreach_div(m, root))
        else:
            u = chunk.scratch(1)
            torch._foreach_copy_(u, m)
            torch._foreach_div_(u, root)  # u = m / (sqrt(v) + eps)
        if bc is not None:
            torch._foreach_mul_(u, bc[0])  # u = m̂ / (sqrt(v̂) + eps)
        if group["weight_decay"]:
            torch._foreach_add_(u, pf, alpha=group["weight_decay"])
        return u, (torch.stack(torch._foreach_norm(pf)), torch.stack(torch._foreach_norm(u))), ()

    def _warmup_finish(self, chunk: Chunk, u: list[torch.Tensor], norms, maxima, ok: torch.Tensor | None) -> None:
        """The trust ratio ``c = clip(‖p‖/‖u‖)`` (1 unless both norms are positive), its average
        ``c_frozen`` (over the steps with ``c != 1``), the step ``p -= lr·c·u``."""
        group = chunk.group
        c = _trust_ratio(*norms, group)
        cb = group["coeff_beta"]
        frozen_list = chunk.state("coeff_frozen")
        frozen = torch.stack(frozen_list)
        average = frozen * cb + (1 - cb) * c
        if self.bias_correction:  # the average starts at the first ratio, not at 0
            average = torch.where(frozen == 0, c, average)
        new_frozen = torch.where(c != 1, average, frozen)
        if ok is not None:
            new_frozen, c = torch.where(ok, new_frozen, frozen), c * ok.float()
        torch._foreach_copy_(frozen_list, list(new_frozen.unbind()))
        self._apply_updates(chunk, u, c, group["lr"])

    def _compression_directions(self, chunk: Chunk, ok: torch.Tensor | None, keep: bool = False, *, synced: bool):
        """The momentum and the fresh variance, then ``u = m/(sqrt(v)+eps) + wd·p`` (corrected
        moments with bias correction, the adaptive share bounded by ``update_clip``); maxima: the
        factor ``max((sqrt(v)+eps)/(sqrt(v_fresh)+eps))``; norms: ``u``'s before and after weight
        decay (none without it). ``u`` and the temporaries are results of out-of-place list ops (one
        op each, where a workspace copy would add one), so ``u`` is its own whatever ``keep`` says."""
        group = chunk.group
        grads = chunk.grads  # sanitized by chunks() on a masked step
        beta1, beta2 = group["betas"]
        eps, wd = group["eps"], group["weight_decay"]
        m, v = chunk.state("exp_avg"), chunk.state("exp_avg_sq")
        if synced:  # the hook delivered the averaged momentum in .grad
            new_m = list(grads)
        else:  # one process: the momentum is local and exact
            new_m = list(torch._foreach_mul(m, beta1))
            torch._foreach_add_(new_m, grads, alpha=1 - beta1)
        masked = [i for i, st in enumerate(chunk.states) if "mask" in st]
        if masked:
            products = torch._foreach_mul([new_m[i] for i in masked], [chunk.states[i]["mask"] for i in masked])
            for i, product in zip(masked, products):
                new_m[i] = product
        with_factor = not self.fresh_trust_ratio  # the fresh variance serves only the factor
        okf = None if ok is None else ok.float()
        if with_factor:  # v_fresh from the gradient rebuilt before m moves; masked: kept where ok fails
            v_fresh = chunk.state("exp_avg_sq_fresh")
            g_rec = torch._foreach_sub(new_m, m, alpha=beta1)
            torch._foreach_div_(g_rec, 1 - beta1)  # (m − β1·m_prev)/(1−β1)
            if okf is not None:
                torch._foreach_mul_(g_rec, okf)  # g̃·0 adds 0
            torch._foreach_mul_(v_fresh, masked_factor(beta2, ok))
            torch._foreach_addcmul_(v_fresh, g_rec, g_rec, value=1 - beta2)
        if ok is None:
            torch._foreach_copy_(m, new_m)
        elif synced:  # new_m is the sanitized exchange, zero where ok fails: m·(1-ok) + new_m
            torch._foreach_mul_(m, 1 - okf)
            torch._foreach_add_(m, new_m)
        else:  # masked: m keeps its values where ok fails
            select_(m, new_m, ok)
        bc = self._corrections(group)
        root = torch._foreach_sqrt(v)
        if bc is not None:  # m̂, sqrt(v̂)
            m = torch._foreach_mul(m, bc[0])
            torch._foreach_mul_(root, bc[1])
        denom = torch._foreach_add(root, eps)  # sqrt(v) + eps
        if with_factor:
            fresh = torch._foreach_sqrt(v_fresh)
            if bc is not None:  # sqrt(v̂_fresh)
                torch._foreach_mul_(fresh, bc[2])
            torch._foreach_add_(fresh, eps)
            factor = maxima(torch._foreach_div(denom, fresh))
        if self.update_clip is not None:  # |m/denom| <= update_clip
            clip_roots_(root, m, self.update_clip)
            torch._foreach_add_(root, eps)
            denom = root
        u = torch._foreach_div(m, denom)
        if not with_factor:  # LAMB's ratio of this u: norms (‖p‖, ‖u‖)
            pf = self._fp32_params(chunk)
            if wd:
                torch._foreach_add_(u, pf, alpha=wd)
            return u, (torch.stack(torch._foreach_norm(pf)), torch.stack(torch._foreach_norm(u))), ()
        if not wd and self.step_bound is None:
            return u, (), (factor,)
        # norms, in one op: ‖u‖ before weight decay (its share ρ, with weight decay), ‖u‖, ‖p‖ (step_bound)
        pf = self._fp32_params(chunk)
        decayed = torch._foreach_add(u, pf, alpha=wd) if wd else u
        lists = (list(u) if wd else []) + list(decayed) + (list(pf) if self.step_bound is not None else [])
        norms = torch._foreach_norm(lists)
        n = len(u)
        return decayed, tuple(torch.stack(norms[i:i + n]) for i in range(0, len(norms), n)), (factor,)

    def _compression_finish(self, chunk: Chunk, u: list[torch.Tensor], norms, maxima,
                            ok: torch.Tensor | None) -> None:
        """The factor (weight decay's share, the bounds, the threshold against the last one),
        the step ``p -= lr·c_frozen·f·u``; with ``fresh_trust_ratio``, ``p -= lr·clip(‖p‖/‖u‖)·u``."""
        group = chunk.group
        if self.fresh_trust_ratio:  # LAMB's own ratio of the exchanged update
            c = _trust_ratio(*norms, group)
            self._apply_updates(chunk, u, c if ok is None else c * ok.float(), group["lr"])
            return
        (factor,) = maxima
        norms = list(norms)
        if group["weight_decay"]:  # f ← ρ·f + 1 − ρ with ρ = min(1, ‖u before decay‖/‖u‖)
            prelim_norm, u_norm = norms.pop(0), norms[0]
            # min(prelim/u_norm, 1), and 1 where u_norm = 0: x/0 is inf or NaN, which fmin maps to 1
            rho = torch.fmin(prelim_norm / u_norm, self._one_on(u_norm.device))
            factor = rho * factor + (1 - rho)
        factor = factor.clamp(group["factor_min"], group["factor_max"])
        last_list = chunk.state("last_factor")
        last = torch.stack(last_list)
        thr = group["factor_threshold"]
        factor = torch.clamp(factor, last * (1 - thr), last * (1 + thr))
        coeffs = torch.stack(chunk.state("coeff_frozen")) * factor
        if self.step_bound is not None:  # at most step_bound times LAMB's own ratio of this update
            u_norm, p_norm = norms
            coeffs = torch.minimum(coeffs, self.step_bound * _trust_ratio(p_norm, u_norm, group))
        if ok is not None:  # masked: the last factor stays, and the parameters move by 0·u
            factor, coeffs = torch.where(ok, factor, last), coeffs * ok.float()
        torch._foreach_copy_(last_list, list(factor.unbind()))
        self._apply_updates(chunk, u, coeffs, group["lr"])

    def _sharded_step(self, directions, finish, ok: torch.Tensor | None) -> None:
        """FSDP2 with shards (:mod:`hf_onebit.hook.fsdp`): each rank holds a shard of every tensor,
        so a whole tensor's norm is the root of the sum of its shards' squared norms, and its
        maximum the maximum of theirs. Every chunk's directions first, then one sum and one
        maximum over the replica's ranks for all of them, then the steps: holds every ``u`` at
        once (one extra copy of the rank's shards). The vectors line up on every rank: chunks()
        keeps parameter order, and empty shards take part (norm 0; maximum 0, see :func:`_maxima`)."""
        hook_state = self.hook_state
        parts = [(chunk, *directions(chunk, ok, keep=True)) for chunk in chunks(self, self._init_state, ok=ok)]
        norms = reduced([n for _, _, ns, _ in parts for n in ns], lambda t: hook_state.sum_over_shards(t**2).sqrt())
        maxima = reduced([x for _, _, _, xs in parts for x in xs], hook_state.max_over_shards)
        for chunk, u, ns, xs in parts:
            finish(chunk, u, [next(norms) for _ in ns], [next(maxima) for _ in xs], ok)

    def _freeze(self) -> None:
        """End of step ``freeze_step``: ``v_fresh = v``, momentum scaling ratios, masks.

        ``scaling_p = mean_q RMS(m_q) / RMS(m_p)`` (1 where that is not a positive number), on
        the device in fp64: each RMS from an fp64 norm, the mean summed in parameter order, one
        rounding to fp32 at the end, as the same arithmetic on Python floats would round.
        """
        params = [p for p in self.params_in_order() if "exp_avg" in self.state.get(p, {})]
        if not self.fresh_trust_ratio:
            for p in params:
                self.state[p]["exp_avg_sq_fresh"].copy_(self.state[p]["exp_avg_sq"])
        moments = [self.state[p]["exp_avg"] for p in params]
        if params and self.hook_state is not None and self.hook_state.sharded:  # FSDP2 shards: RMS of the whole tensors
            device = moments[0].device
            sums = self.hook_state.sum_over_shards(torch.stack(
                [torch.linalg.vector_norm(logical(m), dtype=torch.float64) ** 2 for m in moments]
                + [torch.tensor(float(m.numel()), dtype=torch.float64, device=device) for m in moments]))
            rms = [torch.where(n > 0, (s / n.clamp(min=1)).sqrt(), torch.zeros_like(s))
                   for s, n in zip(sums[: len(moments)], sums[len(moments):])]
        else:
            rms = [torch.linalg.vector_norm(logical(m), dtype=torch.float64) / math.sqrt(m.numel()) if m.numel()
                   else torch.zeros((), dtype=torch.float64, device=m.device) for m in moments]
        if rms:
            total = rms[0]
            for r in rms[1:]:
                total = total + r.to(total.device)
            mean = total / len(rms)
        for p, r in zip(params, rms):
            ratio = mean.to(r.device) / r  # inf or NaN where RMS(m_p) is 0 (or NaN): scaling 1
            self.state[p]["scaling"].copy_(torch.where(torch.isfinite(ratio) & (ratio > 0), ratio, 1.0))
        self.freeze_masks()

    #: A step whose gradients are not all finite leaves every state tensor as it was (``ok`` in the
    #: list cores). On FSDP2's shards the check is on the host (see
    #: :func:`~hf_onebit.optim.guards.check_finite_grads`), so there ``ok`` is ``None``.
    masks_non_finite_steps = True

    @torch.no_grad()
    def step(self, closure=None):
        loss, t, plan = self.begin_step(closure)
        compress = plan is Plan.COMPRESS_MOMENTUM
        synced = self.check_synced(t) if plan is not Plan.ALLREDUCE else False  # b-bit warmups need the hook too
        ok = self.finite_ok  # a device flag: mask this step with it (None: nothing to mask)
        if compress:
            directions, finish = partial(self._compression_directions, synced=synced), self._compression_finish
        else:
            directions, finish = self._warmup_directions, self._warmup_finish
        if self.hook_state is not None and self.hook_state.sharded:
            self._sharded_step(directions, finish, ok)
        else:  # whole tensors: their norms and maxima are the chunk's own
            for chunk in chunks(self, self._init_state, skip_empty=True, ok=ok):
                finish(chunk, *directions(chunk, ok), ok)
        if not compress:
            self.observe_variance(t, t)  # an automatic freeze may choose this step
        if t == self.freeze_step:
            self._freeze()
        self._after_step()
        return loss
