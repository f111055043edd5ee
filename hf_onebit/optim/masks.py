"""Masks for coordinates that never get a gradient, shared by 1-bit Adam, 0/1 Adam and 1-bit LAMB.

See ``docs/algorithms.md``, "1-bit Adam", for where ``auto_mask`` deviates from the paper.

A coordinate whose averaged gradient is exactly zero on every step (an unused embedding row, a
position beyond the longest sequence) has ``v == 0``. Once compression starts, the compressor
hands it ``±scale`` every step like any other coordinate, and with ``v == 0`` the update is
``scale / eps``: such coordinates would run away. DeepSpeed made the user pass a mask; here the
optimizer records during warmup which coordinates were ever non-zero and masks the others when
compression starts (``auto_mask``), unless a mask was set explicitly with ``set_mask``.

"Ever non-zero" needs no bookkeeping per step: the variance ``v = β2·v + (1-β2)·g²`` starts at
exactly 0 and stays exactly 0 for as long as every ``g`` is exactly 0, so where ``v == 0`` at the
freeze the averaged gradient was zero on every warmup step (or so small, below ~1e-22, that its
square underflowed: the tiny-RMS rule below masks such coordinates anyway). The masks are made
from ``v`` in the last warmup step (0/1 Adam: in its first compressing step).

The same runaway hits coordinates whose gradient is not exactly zero but negligible: BERT's
attention key biases get ~1e-12 (softmax ignores the constant they add), so ``sqrt(v) << eps``
and the compressor's ``±scale`` moves them by ``lr·scale/eps`` per step, orders of magnitude
more than Adam would. ``auto_mask`` therefore also masks coordinates whose frozen RMS gradient
``sqrt(v̂)`` is below ``eps / 100``: under Adam such a coordinate moves by at most
``lr·sqrt(v̂)/(sqrt(v̂)+eps)`` < 1% of a normal step, so keeping it still changes almost
nothing, while compressing it multiplies its step by ``scale / eps``.
"""

from __future__ import annotations

import math

import torch

from hf_onebit.optim.base import logger
from hf_onebit.optim.foreach import by_group


#: ``auto_mask`` masks coordinates whose frozen ``sqrt(v̂)`` is below this fraction of ``eps``.
TINY_GRADIENT_RMS = 0.01


class ZeroGradientMasks:
    """Mixin for :class:`~hf_onebit.optim.base.OneBitOptimizer` subclasses with a warmup.

    Subclasses keep the variance in ``state["exp_avg_sq"]`` and say how it is bias-corrected
    when frozen (:meth:`frozen_variance_correction`).
    """

    auto_mask: bool = True

    def frozen_variance_correction(self, group: dict) -> float:
        """``v̂ = v / this`` for the frozen variance (1.0: no bias correction)."""
        return 1.0

    def set_mask(self, p: torch.Tensor, mask: torch.Tensor | None) -> None:
        """Override the compression mask of ``p`` (True/1 = keep, False/0 = keep the momentum at zero).

        ``None`` removes any mask. An explicit mask is never replaced by ``auto_mask``.
        """
        state = self.state[p]
        if mask is None:
            state.pop("mask", None)
        else:
            if mask.shape != p.shape:
                raise ValueError(f"mask shape {tuple(mask.shape)} does not match parameter shape {tuple(p.shape)}")
            state["mask"] = mask.to(device=p.device, dtype=torch.bool)
        state["mask_explicit"] = True
        state.pop("mask_refresh", None)

    def _init_state(self, p: torch.Tensor) -> dict:
        """Adam's moments ``exp_avg``, ``exp_avg_sq`` (fp32, ``p``'s memory format) and what
        :meth:`_init_extra_state` adds: made at ``p``'s first use."""
        state = self.state[p]
        if "exp_avg" not in state:
            f32 = dict(dtype=torch.float32, memory_format=torch.preserve_format)
            state["exp_avg"] = torch.zeros_like(p, **f32)
            state["exp_avg_sq"] = torch.zeros_like(p, **f32)
            self._init_extra_state(p, state)
        return state

    def _init_extra_state(self, p: torch.Tensor, state: dict) -> None:
        """Per-parameter state besides Adam's moments (1-bit LAMB's); none by default."""

    def apply_masks_(self, chunk, moments: list[torch.Tensor]) -> None:
        """``m *= mask`` for the parameters of ``chunk`` that have a mask (one list op)."""
        self.mask_(chunk.states, moments)

    @staticmethod
    def mask_(states: list[dict], tensors: list[torch.Tensor]) -> None:
        """``x *= mask`` for each of ``tensors`` whose parameter state has a mask (one list op)."""
        masked = [(m, s["mask"]) for m, s in zip(tensors, states) if "mask" in s]
        if masked:
            torch._foreach_mul_([m for m, _ in masked], [mask for _, mask in masked])

    # ---------------------------------------------------------------- precondition_exchange
    def frozen_denominators(self, params: list[torch.Tensor], root_scale) -> list[torch.Tensor]:
        """``sqrt(v)·root_scale(group) + eps`` for each of ``params`` (new tensors): the step's
        denominators of the frozen variance (``root_scale``: its bias correction, or 1)."""
        d = torch._foreach_sqrt([self._init_state(p)["exp_avg_sq"] for p in params])
        for (scale, eps), index in by_group(self, params, lambda g: (root_scale(g), g["eps"])):
            part = [d[i] for i in index]
            if scale != 1.0:
                torch._foreach_mul_(part, scale)
            torch._foreach_add_(part, eps)
        return d

    def to_step_units_(self, params: list[torch.Tensor], xs: list[torch.Tensor], root_scale) -> None:
        """``x /= sqrt(v̂)+eps``, then 0 where masked: what ``precondition_exchange`` sends.

        The frozen ``v̂`` is the same on every rank, so ``mean(x/d)·d = mean(x)``: without
        compression nothing changes; with it, the scales and the error feedback are in the units
        of the step. A masked coordinate (``v̂ ≈ 0``) would send ~``x/eps`` and swamp its block's
        scale; it sends 0 (its momentum stays 0 anyway).
        """
        torch._foreach_div_(xs, self.frozen_denominators(params, root_scale))
        self.mask_([self.state[p] for p in params], xs)

    def from_step_units_(self, params: list[torch.Tensor], xs: list[torch.Tensor], root_scale) -> None:
        """``x *= sqrt(v̂)+eps``: the exchanged mean back from :meth:`to_step_units_`."""
        torch._foreach_mul_(xs, self.frozen_denominators(params, root_scale))

    def _tiny_rms_threshold(self, group: dict) -> float:
        """``sqrt(v)`` below this is masked: ``sqrt(v / c) >= TINY·eps  <=>  sqrt(v) >= TINY·eps·sqrt(c)``
        (no temporary for ``v / c``)."""
        return TINY_GRADIENT_RMS * group["eps"] * math.sqrt(self.frozen_variance_correction(group))

    def freeze_masks(self, keep_tracking: bool = False) -> int:
        """When compression starts: mask what was never non-zero or stayed tiny; returns how many.

        ``keep_tracking``: :meth:`unmask_seen` may release masked coordinates later (0/1 Adam's
        ``refresh_mask``). One-time work, per tensor.
        """
        zero = tiny = 0
        groups = self._group_map()
        for p in self.params_in_order():
            state = self.state.get(p, {})
            if state.get("mask_explicit") or not self.auto_mask or "exp_avg_sq" not in state:
                continue
            v = state["exp_avg_sq"]
            keep = v != 0  # ever non-zero (see the module docstring)
            zero += int((~keep).sum())
            above = v.sqrt() >= self._tiny_rms_threshold(groups[id(p)])
            tiny += int((keep & ~above).sum())
            keep &= above
            if not bool(keep.all()):
                state["mask"] = keep  # bool: 1 byte per coordinate
                if keep_tracking:
                    state["mask_refresh"] = True
        if (zero or tiny) and self.rank == 0:
            logger.warning(
                "hf_onebit: masking %d coordinates whose gradient was zero on every warmup step and %d whose"
                " RMS gradient stayed below eps/%d (their momentum stays zero; opt.set_mask overrides)",
                zero, tiny, round(1 / TINY_GRADIENT_RMS),
            )
        return zero + tiny

    def unmask_seen(self, state: dict, group: dict) -> None:
        """After a variance update (0/1 Adam's ``refresh_mask``): release the masked coordinates
        whose averaged gradient has now been non-zero (``v != 0``) and whose ``sqrt(v)`` reached
        the tiny-RMS threshold. Once nothing of the tensor stays masked, its mask goes."""
        mask = state.get("mask")
        if mask is None or not state.get("mask_refresh"):  # never beside an explicit mask (set_mask)
            return
        v = state["exp_avg_sq"]
        mask |= (v != 0) & (v.sqrt() >= self._tiny_rms_threshold(group))
        if bool(mask.all()):
            del state["mask"], state["mask_refresh"]

    def stop_mask_tracking(self) -> int:
        """At the freeze: the masks stay as they are from now on; returns how many coordinates stay masked."""
        masked = 0
        for p in self.params_in_order():
            state = self.state.get(p, {})
            state.pop("mask_refresh", None)
            if "mask" in state and not state.get("mask_explicit"):
                masked += int((~state["mask"]).sum())
        return masked
