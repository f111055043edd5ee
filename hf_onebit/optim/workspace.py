"""Reusable fp32 scratch tensors for an optimizer's step (no fresh temporaries per tensor).

Why: on CPU a fresh multi-MB temporary costs a page fault per 4 KiB the first time it is
written (glibc hands large blocks out with ``mmap`` and gives them back on free), while
``torch.sqrt(x, out=buf)`` into an existing buffer only streams memory: for an elementwise op
the faults cost several times the arithmetic. An update that makes five temporaries per
parameter tensor (1-bit LAMB's compression step) would spend most of its time faulting pages
in. On CUDA the caching allocator already reuses blocks; there a workspace keeps the same peak
memory, only for longer.

A :class:`Workspace` holds a few flat fp32 buffers per device ("slots"), each grown to the
largest request it has served. ``views(slot, tensors)`` returns a contiguous fp32 view shaped
like each tensor of a list, side by side in the slot's buffer, for the ``torch._foreach_*``
cores (:mod:`hf_onebit.optim.foreach`). The views of a list are made once and kept (keyed by
the shapes): cutting a buffer into views is one aten op per tensor, which a step must not pay
every time. The caller owns the slot until it asks for the same slot again: slots are the
names of the temporaries of one update, not a memory pool.
"""

from __future__ import annotations

import torch


class Workspace:
    """Flat fp32 buffers per ``(device, slot)``, grown on demand and reused."""

    def __init__(self) -> None:
        self._buffers: dict[tuple[torch.device, int], torch.Tensor] = {}
        self._views: dict[tuple, list[torch.Tensor]] = {}

    def _buffer(self, device: torch.device, slot: int, n: int) -> torch.Tensor:
        key = (device, slot)
        buf = self._buffers.get(key)
        if buf is None or buf.numel() < n:
            buf = self._buffers[key] = torch.empty(n, dtype=torch.float32, device=device)
            # views cut from the old buffer would outlive it: forget this slot's
            self._views = {k: v for k, v in self._views.items() if k[:2] != key}
        return buf

    def views(self, slot: int, like: list[torch.Tensor]) -> list[torch.Tensor]:
        """Contiguous fp32 tensors shaped like each of ``like`` (all on one device), side by
        side in one buffer (contents undefined); the same list object for the same shapes."""
        return self._cut(slot, like)[0]

    def flat(self, slot: int, like: list[torch.Tensor]) -> torch.Tensor:
        """The one flat tensor that :meth:`views` of the same arguments cut (for whole-list ops)."""
        return self._cut(slot, like)[1]

    def _cut(self, slot: int, like: list[torch.Tensor]) -> tuple[list[torch.Tensor], torch.Tensor]:
        device = like[0].device
        key = (device, slot, tuple(t.shape for t in like))
        cut = self._views.get(key)
        if cut is None:
            total = sum(t.numel() for t in like)
            flat = self._buffer(device, slot, total)[:total]
            views, off = [], 0
            for t in like:
                views.append(flat[off: off + t.numel()].view(t.shape))
                off += t.numel()
            cut = self._views[key] = (views, flat)
        return cut
