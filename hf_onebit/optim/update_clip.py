"""The update clip (docs/algorithms.md, "Update clip"): its validation and its one formula.

1-bit Adam, 0/1 Adam and 1-bit LAMB divide by ``max(sqrt(v̂), |m|/limit) + eps`` where their
variance is stale, so no coordinate's adaptive step exceeds ``limit`` (``update_clip`` times the
method's own scale: Adam's momentum bias correction, 0/1 Adam's ``λ`` at a sync).
"""

from __future__ import annotations

import math

import torch


def check_update_clip(value: float | None) -> float | None:
    """``update_clip`` is ``None`` or a finite number > 0; returns it as a float (or ``None``)."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
        raise ValueError(f"update_clip must be a positive number or None, got {value!r}")
    return float(value)


def clip_root_(root: torch.Tensor, by: torch.Tensor, limit: float, scratch: torch.Tensor | None = None) -> torch.Tensor:
    """``root = max(root, |by|/limit)`` in place (``|by|`` goes into ``scratch`` if given); returns ``root``."""
    return torch.maximum(root, torch.abs(by, out=scratch).mul_(1 / limit), out=root)


def clip_roots_(roots: list[torch.Tensor], by: list[torch.Tensor], limit: float,
                scratch: list[torch.Tensor] | None = None) -> None:
    """:func:`clip_root_` over lists, in its operation order: ``roots = max(roots, |by|·(1/limit))``
    (``|by|`` goes into ``scratch``, or into new tensors without it)."""
    if scratch is None:
        scratch = torch._foreach_abs(by)
    else:
        torch._foreach_copy_(scratch, by)
        torch._foreach_abs_(scratch)
    if limit != 1.0:  # x·1 = x: the HF default (update_clip 1.0) skips a pass
        torch._foreach_mul_(scratch, 1 / limit)
    torch._foreach_maximum_(roots, scratch)
