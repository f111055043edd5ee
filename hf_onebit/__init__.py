"""hf_onebit: communication-compressed optimizers for stock PyTorch DDP and Hugging Face.

    opt = hf_onebit.OneBitAdam(model.parameters(), lr=1e-4, total_steps=num_steps)
    ddp = torch.nn.parallel.DistributedDataParallel(model)
    hf_onebit.attach(ddp, opt)

``total_steps`` fits the automatic freeze (``freeze_step="auto"``, the default) to the run: the
warmup ends within 10-40% of it (without it, by step 1000; or ``opt.fit_to_run(lr_scheduler)``).

With FSDP2, shard inside a replica and exchange between replicas (``hf_onebit.hook.fsdp``)::

    mesh = hf_onebit.replica_mesh(shard_size=1)   # or the ranks of a node
    fully_shard(model, mesh=mesh["shard"])
    opt = hf_onebit.OneBitAdam(model.parameters(), lr=1e-4, total_steps=num_steps)
    hf_onebit.attach(model, opt)
    hf_onebit.save_sharded(opt, "ckpt/optimizer")   # a distributed checkpoint (hf_onebit.sharded_checkpoint)

With the Hugging Face Trainer: ``hf_onebit.OneBitTrainer`` and ``hf_onebit.OneBitTrainingArguments``
(``--optim onebit_adam``); they are imported on first use, so ``import hf_onebit`` does not
import transformers. See ``docs/integrations.md``.
"""

from hf_onebit.checkpoint import load_rank_state, save_rank_state
from hf_onebit.hook import OneBitHookState, UnsupportedSetup, attach, onebit_hook, replica_mesh
from hf_onebit.optim import BinSGDM, OneBitAdam, OneBitLamb, OneBitOptimizer, Plan, ZeroOneAdam
from hf_onebit.sharded_checkpoint import load_sharded, save_sharded

__version__ = "0.1.0.dev0"

# Imported on first access (module __getattr__, PEP 562): transformers is heavy and optional here.
# hf_onebit.integrations resolves them (and names the extra to install when it is missing).
_LAZY = ("OneBitTrainer", "OneBitTrainingArguments")


def __getattr__(name):
    if name not in _LAZY:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    from hf_onebit import integrations

    value = getattr(integrations, name)
    globals()[name] = value
    return value


__all__ = [
    "BinSGDM",
    "OneBitAdam",
    "OneBitHookState",
    "OneBitLamb",
    "OneBitOptimizer",
    "OneBitTrainer",
    "OneBitTrainingArguments",
    "Plan",
    "UnsupportedSetup",
    "ZeroOneAdam",
    "attach",
    "load_rank_state",
    "load_sharded",
    "onebit_hook",
    "replica_mesh",
    "save_rank_state",
    "save_sharded",
]
