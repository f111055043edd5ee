"""Hyperparameter checks shared by the optimizers' ``_check_group`` and constructors: each raises
``ValueError`` (``TypeError`` for a switch that is not a bool) naming the value."""

from __future__ import annotations

import math
from typing import Sequence


def check_betas(betas: Sequence[float], name: str = "betas") -> None:
    for b in betas:
        if not 0.0 <= b < 1.0:  # NaN fails too
            raise ValueError(f"{name} must lie in [0, 1), got {tuple(betas)}")


def check_common(lr: float, eps: float, weight_decay: float) -> None:
    for name, value in (("lr", lr), ("eps", eps), ("weight_decay", weight_decay)):
        if not value >= 0.0:  # NaN fails too
            raise ValueError(f"{name} must be >= 0, got {value}")


def check_positive_int(value: int, name: str) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be an integer >= 1, got {value!r}")


def check_bool(value: bool, name: str) -> None:
    """A switch: exactly ``True`` or ``False`` (a string such as ``"false"`` would be truthy)."""
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be True or False, got {value!r}")


def check_update_clip(value: float | None) -> float | None:
    """``update_clip`` is ``None`` or a finite number > 0; returns it as a float (or ``None``)."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
        raise ValueError(f"update_clip must be a positive number or None, got {value!r}")
    return float(value)


def check_scale_block(value, name: str = "scale_block") -> int | None:
    """``None`` (no limit) or a positive multiple of 8: packed sign bytes never straddle two scales."""
    if value is None:
        return None
    if type(value) is not int or value < 8 or value % 8:
        raise ValueError(f"{name} must be None or a positive multiple of 8 elements, got {value!r}")
    return value


def check_warmup_bits(value, name: str = "warmup_bits") -> int | None:
    """``None`` (full precision) or a width of the b-bit exchange (8 or 4)."""
    from hf_onebit.kernels.contract import WIDTHS

    if value is None:
        return None
    if type(value) is not int or value not in WIDTHS:  # neither True nor 8.0
        raise ValueError(f"{name} must be None (full precision) or one of {WIDTHS} bits, got {value!r}")
    return int(value)
