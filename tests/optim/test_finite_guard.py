"""The finiteness guard of a GPU, on CPU tensors: a non-finite gradient changes no state, and the
error comes at the next step (issue 29).

On CUDA, :func:`hf_onebit.optim.guards.check_finite_grads` does not read its verdict on the host
(that read would stall the host once per step): 1-bit Adam, 0/1 Adam and 1-bit LAMB mask the step with the
device flag, and the next ``step()`` reads it from pinned memory and raises for the step before. The same
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
    """Every state tensor: parameters, moments, masks, error buffers (worker and server, and the
    b-bit exchange's own where it has them)."""
    out = [p.detach().clone() for p in model.parameters()]
    for p in model.parameters():
        for value in opt.state.get(p, {}).values():
            if isinstance(value, torch.Tensor):
                out.append(value.clone())
    for seg in sorted(opt.exchange.segments, key=lambda s: s.key):
        out += [seg.comm.worker_error.clone(), seg.comm.server_error.clone()]
        if getattr(seg.comm, "coded_errors", None) is not None:
            out += [seg.comm.coded_errors.worker.clone(), seg.comm.coded_errors.server.clone()]
    return out


def _nan_at(rank, world_size, bad_step, name, kwargs, nan_ranks=(0,), steps=7, device="cpu"):
    import hf_onebit
    from hf_onebit.optim import guards

    deferred = guards.DEFERRED_DEVICES
    guards.DEFERRED_DEVICES = {"cpu", "cuda"}
    try:
        torch.manual_seed(0)
        model = FixedGradModel().to(device)
        base = {"defaults": "paper", "lr": 1e-2, **({"freeze_step": 3} if name in ("OneBitAdam", "OneBitLamb") else {})}
        opt = getattr(hf_onebit, name)(model.parameters(), **base, **kwargs)
        ddp = DDP(model, bucket_cap_mb=0.01)
        hf_onebit.attach(ddp, opt)
        out = {"masked": None}
        for step in range(1, steps + 1):
            coeffs = [c.to(device) for c in fixed_grads(step, rank)]
            if step == bad_step and rank in nan_ranks:
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
                out["finite"] = all(bool(torch.isfinite(t).all()) for t in after)
                out["params"] = [p.detach().clone() for p in model.parameters()]
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
    ("BinSGDM", {}),  # votes from step 1: the vote average is NaN on every rank
    ("BinSGDM", {"weight_decay": 0.01}),
], ids=["adam", "adam-8bit-per-tensor", "lamb", "lamb-8bit-per-tensor", "binsgdm", "binsgdm-decay"])
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
    from hf_onebit.optim.guards import _all_finite, norms_finite_flag

    big = [torch.full((1000,), 1e17) for _ in range(10)]  # each norm ~3e18, their sum fine, squares near the range
    assert bool(norms_finite_flag([torch.ones(3), *big, torch.empty(0)]))
    for bad in (float("nan"), float("inf"), -float("inf")):
        t = torch.zeros(5)
        t[3] = bad
        assert not bool(norms_finite_flag([torch.ones(2), t, *big]))
    assert bool(norms_finite_flag([torch.empty(0)]))
    huge = torch.full((4,), 3e38)  # finite, but its norm overflows: the host path confirms element-wise
    assert not bool(norms_finite_flag([huge])) and _all_finite([huge])


# 0/1 Adam: variance steps at 1, 2, 4, 8; 1-bit gradient steps at 3, 5-7 (step 3 freezes the masks:
# one-time state); local phase from 9, syncs at 9, 10, 12. In the local phase each rank steps on its
# own gradient, so both ranks get the NaN.
ZERO_ONE = dict(var_freeze_step=8, var_update_scaler=1, local_step_scaler=2, local_step_clipper=4)


@pytest.mark.parametrize("bad_step", [2, 5, 11])  # a variance step, a 1-bit gradient step, a local step
@pytest.mark.parametrize("kwargs", [{}, {"warmup_bits": 8, "scale_per_tensor": True, "weight_decay": 0.01,
                                         "update_clip": 1.0, "momentum_correction": True}], ids=["spec", "library-like"])
def test_zeroone_adam_masks_a_non_finite_step_and_the_next_step_raises(bad_step, kwargs):
    outs = run_distributed(_nan_at, 2, bad_step, "ZeroOneAdam", {**ZERO_ONE, **kwargs}, (0, 1), 13)
    for out in outs:
        assert out["masked"] is True, "the step with a NaN gradient changed optimizer state"
        assert out["steps_done"] == bad_step and out["raised_at"] == bad_step + 1
        assert out["untouched"], "the step that raised changed optimizer state"
        assert f"non-finite gradient at step {bad_step}" in out["message"]


def test_zeroone_adam_a_masked_sync_step_still_syncs_with_finite_state():
    """Step 10 is a sync: both ranks take part (no hang), with no update of their own; their
    parameters stay finite and identical, and step 11 raises."""
    outs = run_distributed(_nan_at, 2, 10, "ZeroOneAdam", ZERO_ONE, (0, 1), 13)
    for out in outs:
        assert out["masked"] is False and out["finite"] and out["raised_at"] == 11
    for a, b in zip(outs[0]["params"], outs[1]["params"]):
        assert torch.equal(a, b)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the GPU's own path: pinned memory and a CUDA event")
@pytest.mark.parametrize("name,kwargs,bad_step", [
    ("OneBitAdam", {}, 5), ("OneBitLamb", {"weight_decay": 0.01}, 5), ("ZeroOneAdam", ZERO_ONE, 11), ("BinSGDM", {}, 3),
    # the library's 8-bit exchanges: a warmup step, 0/1 Adam's b-bit variance step and a 1-bit step between them
    ("OneBitAdam", {"warmup_bits": 8}, 2), ("OneBitLamb", {"warmup_bits": 8}, 2),
    ("ZeroOneAdam", {**ZERO_ONE, "warmup_bits": 8}, 2), ("ZeroOneAdam", {**ZERO_ONE, "warmup_bits": 8}, 5),
])
def test_on_cuda_a_masked_step_changes_no_state_and_the_next_step_raises(name, kwargs, bad_step):
    """2 gloo ranks on the one GPU: the flag copied to pinned memory behind a CUDA event, read a step later."""
    outs = run_distributed(_nan_at, 2, bad_step, name, kwargs, (0, 1), 13, "cuda")
    for out in outs:
        assert out["masked"] is True and out["untouched"] and out["raised_at"] == bad_step + 1
