"""The optimizers: a phase machine each, over a shared base (:mod:`hf_onebit.optim.base`)."""

from hf_onebit.optim.base import OneBitOptimizer, Plan
from hf_onebit.optim.onebit_adam import OneBitAdam

__all__ = ["OneBitAdam", "OneBitOptimizer", "Plan"]
