"""BinSGDM's hook and step on the Triton backend make no host synchronisation once its layouts exist.

tests/optim/test_host_syncs.py watches every optimizer with the numba CPU kernels. This file runs
BinSGDM's *CUDA code path* (``HF_ONEBIT_KERNELS=triton``: the fused ``vote_threshold``, the
one-launch ``vote_uniform`` draws, the device packing and average) with the Triton interpreter on
2 gloo ranks, and counts every host conversion of a tensor (``bool``, ``float``, ``item``,
``tolist``, ``numpy``, ``cpu``, ``torch.tensor``) that hf_onebit code makes during backward (the
hook, on any thread) and ``step()``:

* conversions made inside Triton's interpreter are not counted (on a GPU the kernels are compiled
  and launched without any);
* steps 1 and 2 may build layouts (DDP rebuilds its buckets after its first iteration): the
  allowed conversions are the draws' table, ``kernels/triton_votes.py:vote_uniform_table`` (one
  host-to-device copy per layout), the vote packing's weights (once per device) and the pinned
  host byte that the finiteness verdicts land in (once);
* later steps: none at all, bf16 without a loss scaler (with the finiteness check of a GPU, which
  masks the step with a device flag and reads it a step later from pinned memory, forced here
  on CPU) and fp32 with a ``GradScaler``.
"""

from __future__ import annotations

import os

import pytest
import torch

from tests.distributed import run_distributed
from tests.optim.harness import backward_and_step
from tests.optim.test_host_syncs import SyncWatch

#: one-time setup: the draws' table of each layout, the vote packing's weights made once per device
TABLE = "kernels/triton_votes.py:vote_uniform_table torch.tensor"
ONE_TIME = {TABLE, "kernels/reference.py:_weights torch.tensor", "optim/guards.py:_pinned_flag numpy"}
STEPS = 5


def _train(rank, world_size, case):
    import hf_onebit
    from torch.nn.parallel import DistributedDataParallel as DDP

    from hf_onebit.optim import guards
    from tests.op_counts import Stack

    import triton

    guards.DEFERRED_DEVICES = {"cpu", "cuda"}  # a fresh process: the GPU's check, masked on the device
    # exempt nothing; only Triton's interpreter (absent on a GPU) reads on the host for us
    watch = SyncWatch(exempt=(), ignored_roots=(os.path.dirname(os.path.abspath(triton.__file__)) + os.sep,))
    watch.install()
    dtype = torch.bfloat16 if case == "bf16" else torch.float32
    model = Stack(6).to(dtype)
    opt = hf_onebit.BinSGDM(model.parameters(), lr=1e-2)
    ddp = DDP(model, bucket_cap_mb=0.001)  # several buckets
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10, growth_interval=10**6) if case == "scaler" else None
    hf_onebit.attach(ddp, opt, grad_scaler=scaler)
    x = torch.randn(4, 16, generator=torch.Generator().manual_seed(rank)).to(dtype)
    calls = []
    for _ in range(STEPS):
        loss = ddp(x).float().square().mean()
        calls.append(watch.during(backward_and_step, loss, opt, scaler))
        opt.zero_grad(set_to_none=True)
    assert opt.steps_done == STEPS
    return calls


@pytest.mark.parametrize("case", ["bf16", "scaler"])
def test_no_host_sync_in_binsgdm_hook_and_step_on_the_triton_path(case):
    pytest.importorskip("triton")
    outs = run_distributed(_train, 2, case, env={"HF_ONEBIT_KERNELS": "triton", "TRITON_INTERPRET": "1"},
                           fresh=True, timeout=600)  # patches torch for good
    for rank, calls in enumerate(outs):
        layouts = sum(c.count(TABLE) for c in calls[:2])
        assert layouts >= 1, f"rank {rank}: the draws' table was never built: is the Triton path running? {calls}"
        for step, step_calls in enumerate(calls, 1):
            rest = [c for c in step_calls if not (step <= 2 and c in ONE_TIME)]
            assert not rest, f"rank {rank}, step {step}: host syncs in BinSGDM's hook or step(): {sorted(set(rest))}"
