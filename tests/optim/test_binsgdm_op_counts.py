"""BinSGDM's step and hook cost a constant number of torch operations, whatever the tensor count.

On a GPU every aten op is a kernel launch of ~5-10 µs of host time, so per-tensor work grows into
milliseconds a step on a model of a few hundred tensors (issue 29). Counted here on CPU with
:mod:`tests.op_counts` (ops on tensors of one or more dimensions), on 2 gloo ranks, after the
steps that build the layouts (DDP rebuilds its buckets after its first iteration):

* ops per ``step()`` and per hook call on ``Stack(200)`` are at most 1.2x those on ``Stack(20)``;
* a ``step()`` costs at most 4x ``torch.optim.AdamW(foreach=True)``'s on the same model;

for fp32 and bf16 parameters (no loss scaler) and for fp32 with a ``GradScaler``. The counts
are returned by the ranks and printed (``pytest -s``) for the issue's before/after table.

Not counted here: the random draws, counter-based per parameter (numpy's Philox on CPU, which
dispatches no aten op; on CUDA one ``torch.rand`` per parameter, see ``VoteLayout.draw``), and
the hook's prologue before ``OneBitHookState.reduce`` (``bucket_gradients``, DDP's).
"""

from __future__ import annotations

import pytest
import torch

from tests.distributed import run_distributed
from tests.optim.harness import backward_and_step

SIZES = (20, 200)
#: "bf16-deferred": the finiteness check of a GPU (the step masked with a device flag), forced on CPU
CASES = ("fp32", "bf16", "fp32-scaler", "bf16-deferred")


def _count(rank: int, world_size: int, case: str, tensors: int) -> dict:
    from hf_onebit.optim import guards

    deferred = guards.DEFERRED_DEVICES
    guards.DEFERRED_DEVICES = {"cpu", "cuda"} if case.endswith("deferred") else deferred
    try:
        return _count_case(case, tensors)
    finally:
        guards.DEFERRED_DEVICES = deferred


def _count_case(case: str, tensors: int) -> dict:
    import hf_onebit
    from torch.nn.parallel import DistributedDataParallel as DDP

    from tests.op_counts import OpCount, Stack, counting

    dtype = torch.bfloat16 if case.startswith("bf16") else torch.float32
    gen = torch.Generator().manual_seed(torch.distributed.get_rank())
    x = torch.randn(8, 16, generator=gen).to(dtype)

    # AdamW(foreach=True) on the same model: its step after the one that creates its state
    model = Stack(tensors).to(dtype)
    adamw = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.01, foreach=True)
    adamw_step = OpCount()
    for i in range(2):
        model(x).square().mean().backward()
        with counting(adamw_step) if i == 1 else _nothing():
            adamw.step()
        adamw.zero_grad()

    model = Stack(tensors).to(dtype)
    opt = hf_onebit.BinSGDM(model.parameters(), lr=1e-3, weight_decay=0.01)
    ddp = DDP(model)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10, growth_interval=10**6) if case.endswith("scaler") else None
    state = hf_onebit.attach(ddp, opt, grad_scaler=scaler)
    hook, step, calls = OpCount(), OpCount(), [0]
    watch = [False]
    reduce, real_step = state.reduce, opt.step

    def counted_reduce(*args, **kwargs):
        if not watch[0]:
            return reduce(*args, **kwargs)
        calls[0] += 1
        with counting(hook):
            return reduce(*args, **kwargs)

    def counted_step(*args, **kwargs):
        if not watch[0]:
            return real_step(*args, **kwargs)
        with counting(step):
            return real_step(*args, **kwargs)

    state.reduce, opt.step = counted_reduce, counted_step
    for i in range(4):  # steps 1-3 build the layouts (DDP's first iteration is one bucket); step 4 is counted
        watch[0] = i == 3
        backward_and_step(ddp(x).square().mean(), opt, scaler)
        opt.zero_grad()
    assert opt.steps_done == 4 and calls[0] >= 1
    return {"step": step.total, "hook": hook.total / calls[0], "hook_calls": calls[0], "adamw": adamw_step.total,
            "step_ops": dict(step.ops), "hook_ops": dict(hook.ops)}


class _nothing:
    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return False


def _all_counts(rank, world_size):
    return {(case, n): _count(rank, world_size, case, n) for case in CASES for n in SIZES}


@pytest.fixture(scope="module")
def counts():
    outs = run_distributed(_all_counts, 2, timeout=900)
    for (case, n), c in sorted(outs[0].items()):
        print(f"BinSGDM {case} Stack({n}): step {c['step']} ops, hook {c['hook']:.0f} ops per call"
              f" ({c['hook_calls']} calls), AdamW(foreach) step {c['adamw']}")
    return outs


@pytest.mark.parametrize("case", CASES)
def test_step_and_hook_ops_do_not_grow_with_the_tensor_count(counts, case):
    for rank, out in enumerate(counts):
        small, large = out[(case, SIZES[0])], out[(case, SIZES[1])]
        for what in ("step", "hook"):
            assert large[what] <= 1.2 * small[what], (
                f"rank {rank}, {case}: {what} {small[what]} ops at {SIZES[0]} tensors, {large[what]} at {SIZES[1]}:"
                f" {large[what + '_ops']}")


@pytest.mark.parametrize("case", CASES)
def test_step_costs_at_most_four_adamw_steps(counts, case):
    for rank, out in enumerate(counts):
        for n in SIZES:
            c = out[(case, n)]
            assert c["adamw"] > 0 and c["step"] <= 4 * c["adamw"], (
                f"rank {rank}, {case}, {n} tensors: step {c['step']} ops, AdamW {c['adamw']}: {c['step_ops']}")
