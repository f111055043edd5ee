"""The optimizers: a phase machine each, over a shared base (:mod:`hf_onebit.optim.base`)."""

from hf_onebit.optim.base import OneBitOptimizer, Plan
from hf_onebit.optim.binsgdm import BinSGDM
from hf_onebit.optim.onebit_adam import OneBitAdam
from hf_onebit.optim.onebit_lamb import OneBitLamb
from hf_onebit.optim.zeroone_adam import ZeroOneAdam

__all__ = ["BinSGDM", "OneBitAdam", "OneBitLamb", "OneBitOptimizer", "Plan", "ZeroOneAdam"]
