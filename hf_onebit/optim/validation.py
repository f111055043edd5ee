"""Hyperparameter checks shared by the optimizers' ``_check_group`` and constructors: each raises
``ValueError`` (``TypeError`` for a switch that is not a bool) naming the value."""

from __future__ import annotations

import math
from typing import Sequence


def check_betas(betas: Sequence[float], name: str = "betas") -> None:
    for b in betas:
        if not 0.0 <= b < 1.0:  # NaN fails too
            raise ValueError(f"{name} must lie in [0, 1), got {tuple(betas)}")


def check_common(group: dict) -> None:
    """What every optimizer's parameter group has: ``lr``, ``eps``, ``weight_decay`` and (the
    Adams and LAMB) ``betas``."""
    for name in ("lr", "eps", "weight_decay"):
        if not group[name] >= 0.0:  # NaN fails too
            raise ValueError(f"{name} must be >= 0, got {group[name]}")
    if "betas" in group:
        betas = group["betas"]
        if not isinstance(betas, Sequence) or len(betas) != 2:
            raise ValueError(f"betas must be a pair (beta1, beta2), got {betas!r}")
        check_betas(betas)


def check_positive_int(value: int, name: str) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be an integer >= 1, got {value!r}")


def check_bool(value: bool, name: str) -> None:
    """A switch: exactly ``True`` or ``False`` (a string such as ``"false"`` would be truthy)."""
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be True or False, got {value!r}")


def check_positive_or_none(value: float | None, name: str) -> float | None:
    """``value`` (a bound: ``update_clip``, ``step_bound``) is ``None`` or a finite number > 0;
    returns it as a float (or ``None``)."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
        raise ValueError(f"{name} must be a positive number or None, got {value!r}")
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


def check_lamb_bounds(group: dict) -> None:
    """1-bit LAMB's trust-ratio bounds and factor settings of a parameter group."""
    for name in ("max_coeff", "min_coeff", "coeff_beta", "factor_max", "factor_min", "factor_threshold"):
        if isinstance(group[name], float) and math.isnan(group[name]):
            raise ValueError(f"{name} must not be NaN")
    min_c, max_c = group["min_coeff"], group["max_coeff"]
    if not min_c > 0.0:
        raise ValueError(f"min_coeff must be > 0 (it bounds the trust ratio from below), got {min_c}")
    if not min_c <= max_c:
        raise ValueError(f"min_coeff must be <= max_coeff, got min_coeff={min_c} > max_coeff={max_c}")
    if not 0.0 <= group["coeff_beta"] < 1.0:
        raise ValueError(
            f"coeff_beta must lie in [0, 1), got {group['coeff_beta']} (with 1 the frozen trust ratio"
            " would never leave its initial 0 and the compression phase would not move the parameters)"
        )
    f_min, f_max = group["factor_min"], group["factor_max"]
    if not f_min > 0.0:
        raise ValueError(
            f"factor_min must be > 0, got {f_min} (a zero factor would stop training for good: each"
            " step's factor is bounded relative to the previous one)"
        )
    if not f_min <= f_max:
        raise ValueError(f"factor_min must be <= factor_max, got factor_min={f_min} > factor_max={f_max}")
    if not group["factor_threshold"] >= 0.0:
        raise ValueError(f"factor_threshold must be >= 0, got {group['factor_threshold']}")
