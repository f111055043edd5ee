"""The DDP communication hook that lets an hf_onebit optimizer replace gradient sync.

Usage (plain PyTorch)::

    opt = hf_onebit.OneBitAdam(model.parameters(), lr=1e-4, freeze_step=400)
    ddp = torch.nn.parallel.DistributedDataParallel(model)
    hf_onebit.attach(ddp, opt)

DDP calls :func:`onebit_hook` once per gradient bucket as soon as the bucket's gradients are
ready, while the rest of backward still runs. Before backward, the optimizer's counters already
decide what the coming step needs from the network: its *plan*. The hook state
(:class:`OneBitHookState`) executes the plan through :mod:`hf_onebit.comm` and returns a future
of the tensor DDP writes into ``.grad``:

================== ============================================ ===============================
plan               communicated (in the hook, during backward)  ``.grad`` after the hook
================== ============================================ ===============================
ALLREDUCE          mean of the gradient, full precision         averaged gradient
QUANTIZE_GRADIENT  gradient, b bits with error feedback         averaged gradient (b-bit)
COMPRESS_MOMENTUM  local momentum ``β1·m + (1-β1)·g_i``, 1 bit  averaged momentum (synced)
COMPRESS_GRADIENT  gradient, 1 bit with error feedback          averaged gradient (1-bit)
LOCAL              nothing                                      local gradient of this rank
SYNC_AFTER_STEP    nothing in the hook; ``step()`` syncs        local gradient of this rank
VOTE               stochastic signs, 1 bit (BinSGDM)            mean of the signs
================== ============================================ ===============================

In every plan but LOCAL/SYNC_AFTER_STEP, ``.grad`` is bitwise identical on all ranks, so
``clip_grad_norm_`` computes the same norm everywhere and scales the same values. What it
scales differs by plan (documented in ``docs/algorithms.md``): in COMPRESS_MOMENTUM it is the
momentum, which ``step()`` takes as the new momentum.

For the compressed plans the optimizer says what a segment's parameters send
(:meth:`~hf_onebit.optim.OneBitOptimizer.prepare_bucket`) and what their ``.grad`` hold afterwards
(:meth:`~hf_onebit.optim.OneBitOptimizer.finish_bucket`); :mod:`hf_onebit.hook.buckets` runs
them around each segment's compressed all-reduce. A plan of the optimizer's own (BinSGDM's vote)
goes to its ``exchange_bucket``. All collectives go through one ordered executor per process
group (:mod:`hf_onebit.comm.executor`), so several buckets in flight are issued in the same
order on every rank.

Modules: :mod:`~hf_onebit.hook.state` (the state and the hook function),
:mod:`~hf_onebit.hook.buckets` (a bucket per parameter), :mod:`~hf_onebit.hook.attach` (with
:mod:`~hf_onebit.hook.attach_checks`, what it checks and refuses first),
:mod:`~hf_onebit.hook.fsdp` (the same protocol on FSDP2's shards, exchanged between replicas).
"""

from hf_onebit.hook.attach import attach
from hf_onebit.hook.attach_checks import UnsupportedSetup
from hf_onebit.hook.fsdp import FSDPHookState, replica_mesh
from hf_onebit.hook.buckets import bucket_gradients
from hf_onebit.hook.state import BucketCall, OneBitHookState, onebit_hook

__all__ = [
    "BucketCall", "FSDPHookState", "OneBitHookState", "UnsupportedSetup", "attach", "bucket_gradients", "onebit_hook",
    "replica_mesh",
]
