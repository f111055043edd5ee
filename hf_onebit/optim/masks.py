"""Masks for coordinates that never get a gradient (spec §2 "Mask"), shared by 1-bit Adam and LAMB.

A coordinate whose averaged gradient is exactly zero on every step (an unused embedding row, a
position beyond the longest sequence) has ``v == 0``. Once compression starts, the compressor
hands it ``±scale`` every step like any other coordinate, and with ``v == 0`` the update is
``scale / eps``: such coordinates would run away. DeepSpeed made the user pass a mask; here the
optimizer records during warmup which coordinates were ever non-zero and masks the others when
compression starts (``auto_mask``), unless a mask was set explicitly with ``set_mask``.
"""

from __future__ import annotations

import torch

from hf_onebit.optim.base import logger


class ZeroGradientMasks:
    """Mixin for :class:`~hf_onebit.optim.base.OneBitOptimizer` subclasses with a warmup."""

    auto_mask: bool = True

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
        state.pop("nonzero", None)

    def init_mask_tracking(self, p: torch.Tensor, state: dict) -> None:
        """Start recording where ``p``'s gradient is ever non-zero (called with fresh state)."""
        if self.auto_mask and not state.get("mask_explicit"):
            state["nonzero"] = torch.zeros_like(p, dtype=torch.bool)

    @staticmethod
    def track_nonzero(state: dict, grad: torch.Tensor) -> None:
        """During warmup: remember the coordinates where the averaged gradient was non-zero."""
        if "nonzero" in state:
            state["nonzero"].logical_or_(grad != 0)

    def freeze_masks(self) -> int:
        """When compression starts: turn "never non-zero" into masks; returns how many were masked."""
        masked = 0
        for p in self.params_in_order():
            state = self.state.get(p, {})
            nonzero = state.pop("nonzero", None)
            if nonzero is None or state.get("mask_explicit") or not self.auto_mask:
                continue
            nonzero = nonzero.bool()
            if not bool(nonzero.all()):
                state["mask"] = nonzero  # bool: 1 byte per coordinate
                masked += int((~nonzero).sum())
        if masked and self.rank == 0:
            logger.warning("hf_onebit: masking %d coordinates whose gradient was zero on every warmup step", masked)
        return masked
