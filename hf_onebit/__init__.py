"""hf_onebit: communication-compressed optimizers for stock PyTorch DDP and Hugging Face.

    opt = hf_onebit.OneBitAdam(model.parameters(), lr=1e-4, freeze_step=400)
    ddp = torch.nn.parallel.DistributedDataParallel(model)
    hf_onebit.attach(ddp, opt)
"""

from hf_onebit.checkpoint import load_rank_state, save_rank_state
from hf_onebit.hook import OneBitHookState, attach, onebit_hook
from hf_onebit.optim import BinSGDM, OneBitAdam, OneBitLamb, OneBitOptimizer, Plan, ZeroOneAdam

__version__ = "0.1.0.dev0"

__all__ = [
    "BinSGDM",
    "OneBitAdam",
    "OneBitHookState",
    "OneBitLamb",
    "OneBitOptimizer",
    "Plan",
    "ZeroOneAdam",
    "attach",
    "load_rank_state",
    "onebit_hook",
    "save_rank_state",
]
