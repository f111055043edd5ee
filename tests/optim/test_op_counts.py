"""Ops per ``step()`` and per backward's hook work do not grow with the number of tensors (issue 29).

On a GPU every aten op is a kernel launch of ~5-10 µs of host time, so a per-tensor loop of eager
ops costs milliseconds per step on a model of a few hundred tensors. The ops are counted here on
CPU (:mod:`tests.op_counts`), on 2 gloo ranks, for 1-bit Adam (full-precision and 8-bit warmup;
and with a GPU's finiteness check, which masks the step on the device),
0/1 Adam and 1-bit LAMB in every phase, on :class:`~tests.op_counts.Stack` models of 20 and 200
parameter tensors, against ``torch.optim.AdamW(foreach=True)`` on the same models:

* the 200-tensor model needs at most 1.2x the ops of the 20-tensor one, in ``step()`` and in
  the hook's work during backward (its jobs on the communication thread included);
* every step issues at most 4x AdamW's ops. 0/1 Adam's sync step runs the compressed exchange
  from ``step()``; that exchange (the jobs on the communication thread) is what the hook runs
  for the other plans, so it is counted apart and held to the first rule only.

Only steady steps are held to this: the first step (DDP's one-bucket iteration, state made per
tensor) and the step that starts a phase (masks frozen, local state made) do one-time work per
tensor.
"""

from __future__ import annotations

import pytest
import torch

from tests.distributed import run_distributed

SIZES = (20, 200)

#: name -> (optimizer, kwargs, steps, {plan: steady steps}); every plan the optimizer has is listed
CASES = {
    "AdamW": ("AdamW", dict(lr=1e-2, foreach=True), 3, {"adamw": [2, 3]}),
    "OneBitAdam": ("OneBitAdam", dict(lr=1e-2, weight_decay=0.01, freeze_step=3, warmup_bits=None), 6,
                   {"allreduce": [2], "compress_momentum": [5, 6]}),
    # step 2 meets DDP's rebuilt buckets (a new segment): step 3 is the steady 8-bit warmup step
    # the finiteness check of a GPU (the step masked with a device flag), forced on CPU
    "OneBitAdam-deferred-check": ("OneBitAdam", dict(lr=1e-2, weight_decay=0.01, freeze_step=3, warmup_bits=None), 6,
                                  {"allreduce": [2], "compress_momentum": [5, 6]}, {"defer": True}),
    "OneBitAdam-8bit-clip": ("OneBitAdam", dict(lr=1e-2, freeze_step=4, warmup_bits=8, update_clip=1.0,
                                                scale_per_tensor=True, precondition_exchange=True), 7,
                             {"quantize_gradient": [3], "compress_momentum": [6, 7]}),
    # variance steps at 1, 2, 4, 8; 1-bit steps at 3, 5-7; local phase from 9: syncs at 9, 10, 12, 16
    "ZeroOneAdam": ("ZeroOneAdam", dict(lr=1e-2, weight_decay=0.01, var_freeze_step=8, var_update_scaler=1,
                                        local_step_scaler=2, local_step_clipper=4, update_clip=1.0,
                                        precondition_exchange=True), 18,
                    {"allreduce": [4, 8], "compress_gradient": [5, 6, 7], "sync_after_step": [10, 12, 16],
                     "local": [11, 13, 14, 15, 17, 18]}),
    "ZeroOneAdam-deferred-check": ("ZeroOneAdam", dict(lr=1e-2, weight_decay=0.01, var_freeze_step=8, var_update_scaler=1,
                                                       local_step_scaler=2, local_step_clipper=4, update_clip=1.0), 18,
                                   {"allreduce": [4, 8], "compress_gradient": [5, 6, 7], "sync_after_step": [10, 12, 16],
                                    "local": [11, 13, 14, 15, 17, 18]}, {"defer": True}),
    "OneBitLamb": ("OneBitLamb", dict(lr=1e-2, freeze_step=3, update_clip=1.0), 6,
                   {"allreduce": [2], "compress_momentum": [5, 6]}),
    "OneBitLamb-deferred-check": ("OneBitLamb", dict(lr=1e-2, freeze_step=3, update_clip=1.0), 6,
                                  {"allreduce": [2], "compress_momentum": [5, 6]}, {"defer": True}),
    # weight decay adds two norms per tensor list and the vector maths of its share of the update
    "OneBitLamb-decay": ("OneBitLamb", dict(lr=1e-2, weight_decay=0.01, freeze_step=3, update_clip=1.0), 6,
                         {"allreduce": [2], "compress_momentum": [5, 6]}),
}

#: Ops over 4x AdamW's (32 on CPU) that steps are still allowed: a goal missed, measured and
#: reported in the closing note of issue 29, held here so that it cannot grow unseen.
#: 1-bit LAMB's compression step with weight decay (34): the vector maths of weight decay's share
#: of the trust ratio (a merged norm of both lists, 5 ops on stacked per-tensor scalars) on top of
#: its 27. Masked for a GPU's check (33): the gradients' flat copy and fill (2), g̃·ok, m kept
#: where the flag fails (one op more than its copy), the last factor and the coefficients kept.
#: 0/1 Adam's sync step masked for a GPU's check (33): the gradients' flat copy and fill (2) on
#: top of its 31.
OVER_FOUR_ADAMW = {("OneBitLamb-decay", "compress_momentum"): 2, ("OneBitLamb-deferred-check", "compress_momentum"): 1,
                   ("ZeroOneAdam-deferred-check", "sync_after_step"): 1}


def _count(rank, world_size, tensors):
    """Per case, per step: the plan, the ops of ``step()`` and those of the hook during backward."""
    import hf_onebit
    from torch.nn.parallel import DistributedDataParallel as DDP

    from hf_onebit.hook.state import OneBitHookState
    from hf_onebit.optim import guards
    from tests.op_counts import OpCount, Stack, counting

    from hf_onebit.comm import executor

    hook_ops = [OpCount()]
    exchange_ops = [OpCount()]
    original = OneBitHookState.reduce
    submit = executor.ThreadExecutor.submit

    def reduce(self, *args):  # the hook's work, and the jobs it queues on the communication thread
        with counting(hook_ops[0]):
            return original(self, *args)

    def counted_submit(self, job):  # a job queued from step() (0/1 Adam's sync): the exchange
        def counted():
            with exchange_ops[0].mode():
                return job()

        return submit(self, counted)

    OneBitHookState.reduce = reduce
    out = {}
    deferred = guards.DEFERRED_DEVICES
    try:
        for name, (cls, kwargs, steps, _, *options) in CASES.items():
            guards.DEFERRED_DEVICES = {"cpu", "cuda"} if options and options[0].get("defer") else deferred
            torch.manual_seed(0)
            model = Stack(tensors)
            ddp = DDP(model)
            if cls == "AdamW":
                opt = torch.optim.AdamW(model.parameters(), **kwargs)
            else:
                opt = getattr(hf_onebit, cls)(model.parameters(), defaults="paper", **kwargs)
                hf_onebit.attach(ddp, opt)
            records = []
            for step in range(1, steps + 1):
                plan = opt.plan().value if cls != "AdamW" else "adamw"
                x = torch.randn(4, 16, generator=torch.Generator().manual_seed(10 * step + rank))
                loss = ddp(x).sum()
                hook_ops[0] = OpCount()
                loss.backward()
                step_ops, exchange_ops[0] = OpCount(), OpCount()
                executor.ThreadExecutor.submit = counted_submit
                try:
                    with step_ops.mode():
                        opt.step()
                finally:
                    executor.ThreadExecutor.submit = submit
                opt.zero_grad(set_to_none=True)
                records.append((plan, step_ops.total, hook_ops[0].total, exchange_ops[0].total, dict(step_ops.ops)))
            out[name] = records
    finally:
        OneBitHookState.reduce = original
        executor.ThreadExecutor.submit = submit
        guards.DEFERRED_DEVICES = deferred
    return out


@pytest.fixture(scope="module")
def counts():
    return {n: run_distributed(_count, 2, n)[0] for n in SIZES}


def _steady(counts, name):
    """``(plan, step, {size: (step ops, hook ops, exchange ops)})`` for every steady step of ``name``."""
    for plan, steps in CASES[name][3].items():
        for step in steps:
            for n in SIZES:
                assert counts[n][name][step - 1][0] == plan, f"{name} step {step}: the schedule changed"
            yield plan, step, {n: counts[n][name][step - 1][1:4] for n in SIZES}


@pytest.mark.parametrize("name", [n for n in CASES if n != "AdamW"])
def test_ops_do_not_grow_with_the_tensor_count(counts, name):
    for plan, step, by_size in _steady(counts, name):
        (step20, hook20, ex20), (step200, hook200, ex200) = by_size[20], by_size[200]
        where = f"{name} step {step} ({plan})"
        assert step200 <= 1.2 * step20, f"{where}: step() ops {step20} at 20 tensors, {step200} at 200"
        assert hook200 <= 1.2 * hook20, f"{where}: hook ops {hook20} at 20 tensors, {hook200} at 200"
        assert ex200 <= 1.2 * ex20, f"{where}: ops of the exchange in step() {ex20} at 20 tensors, {ex200} at 200"
        if plan in ("compress_momentum", "compress_gradient", "quantize_gradient"):
            assert hook20 > 0, f"{where}: the hook's work was not counted"
        if plan == "sync_after_step":
            assert ex20 > 0, f"{where}: the sync's exchange was not counted"


@pytest.mark.parametrize("name", [n for n in CASES if n != "AdamW"])
def test_a_step_costs_at_most_four_adamw_steps(counts, name):
    adamw = {n: max(counts[n]["AdamW"][s - 1][1] for s in CASES["AdamW"][3]["adamw"]) for n in SIZES}
    assert 0 < adamw[20] <= adamw[200] <= 1.2 * adamw[20]  # the yardstick itself is a foreach step
    for plan, step, by_size in _steady(counts, name):
        for n in SIZES:
            ops = by_size[n][0]
            allowed = 4 * adamw[n] + OVER_FOUR_ADAMW.get((name, plan), 0)
            assert ops <= allowed, f"{name} step {step} ({plan}), {n} tensors: {ops} ops, AdamW {adamw[n]}"
