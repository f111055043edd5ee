"""The finiteness guard of a GPU, on CPU tensors: a non-finite gradient changes no state, and the
error comes at the next step (issue 29).

On CUDA, :func:`hf_onebit.optim.guards.check_finite_grads` does not read its verdict on the host
(that read would stall the host once per step): 1-bit Adam and 1-bit LAMB mask the step with the device flag,
and the next ``step()`` reads it from pinned memory and raises for the step before. The same
path is forced here on CPU (``guards.DEFERRED_DEVICES``); where it is not forced, CPU tensors are
checked before the step, as tests/test_hook.py checks.
"""

from __future__ import annotations

import pytest
import torch
from torch.nn.parallel import DistributedDataParallel as DDP

from tests.distributed import run_distributed
from tests.optim.harness import FixedGradModel, fixed_grads


def _snapshot(opt, model) -> list[torch.Tensor]:
    """Every state tensor: parameters, moments, masks, error buffers (worker and server)."""
    out = [p.detach().clone() for p in model.parameters()]
    for p in model.parameters():
        for value in opt.state.get(p, {}).values():
            if isinstance(value, torch.Tensor):
                out.append(value.clone())
    for seg in sorted(opt.segments, key=lambda s: s.key):
        out += [seg.comm.worker_error.clone(), seg.comm.server_error.clone()]
    return out


def _nan_at(rank, world_size, bad_step, name, kwargs):
    import hf_onebit
    from hf_onebit.optim import guards

    deferred = guards.DEFERRED_DEVICES
    guards.DEFERRED_DEVICES = {"cpu", "cuda"}
    try:
        torch.manual_seed(0)
        model = FixedGradModel()
        opt = getattr(hf_onebit, name)(model.parameters(), defaults="paper", lr=1e-2, freeze_step=3, **kwargs)
        ddp = DDP(model, bucket_cap_mb=0.01)
        hf_onebit.attach(ddp, opt)
        out = {"masked": None}
        for step in range(1, 8):
            coeffs = fixed_grads(step, rank)
            if step == bad_step and rank == 0:
                coeffs[0][0, 0] = float("nan")
            ddp(coeffs).backward()
            before = _snapshot(opt, model)
            try:
                opt.step()
            except FloatingPointError as exc:
                after = _snapshot(opt, model)
                out.update(raised_at=step, message=str(exc),
                           untouched=len(before) == len(after) and all(torch.equal(a, b) for a, b in zip(before, after)))
                return out
            if step == bad_step:  # no error yet: the flag is on its way to the host
                after = _snapshot(opt, model)
                out["masked"] = len(before) == len(after) and all(torch.equal(a, b) for a, b in zip(before, after))
                out["steps_done"] = opt.steps_done
            opt.zero_grad(set_to_none=True)
        return out
    finally:
        guards.DEFERRED_DEVICES = deferred


@pytest.mark.parametrize("bad_step", [2, 5])  # warmup, compression
@pytest.mark.parametrize("name,kwargs", [
    ("OneBitAdam", {}),
    ("OneBitAdam", {"warmup_bits": 8, "scale_per_tensor": True, "weight_decay": 0.01, "update_clip": 1.0}),
    ("OneBitLamb", {"weight_decay": 0.01, "update_clip": 1.0}),
    ("OneBitLamb", {"warmup_bits": 8, "scale_per_tensor": True}),
], ids=["adam", "adam-8bit-per-tensor", "lamb", "lamb-8bit-per-tensor"])
def test_a_masked_non_finite_step_changes_no_state_and_the_next_step_raises(bad_step, name, kwargs):
    outs = run_distributed(_nan_at, 2, bad_step, name, kwargs)
    for out in outs:  # the NaN of rank 0 reaches every rank through the exchange
        assert out["masked"] is True, "the step with a NaN gradient changed optimizer state"
        assert out["steps_done"] == bad_step  # only the counters moved on (documented)
        assert out["raised_at"] == bad_step + 1
        assert out["untouched"], "the step that raised changed optimizer state"
        msg = out["message"]
        assert f"non-finite gradient at step {bad_step}" in msg and "masked" in msg and "grad_scaler" in msg


def test_the_flag_is_the_elementwise_verdict():
    """NaN and inf anywhere, in any tensor, fail it; large finite values (whose sum of norms
    would overflow) and empty tensors pass."""
    from hf_onebit.optim.guards import _all_finite, finite_flag

    big = [torch.full((1000,), 1e17) for _ in range(10)]  # each norm ~3e18, their sum fine, squares near the range
    assert bool(finite_flag([torch.ones(3), *big, torch.empty(0)]))
    for bad in (float("nan"), float("inf"), -float("inf")):
        t = torch.zeros(5)
        t[3] = bad
        assert not bool(finite_flag([torch.ones(2), t, *big]))
    assert bool(finite_flag([torch.empty(0)]))
    huge = torch.full((4,), 3e38)  # finite, but its norm overflows: the host path confirms element-wise
    assert not bool(finite_flag([huge])) and _all_finite([huge])
