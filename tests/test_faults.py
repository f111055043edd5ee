"""Fault injection: a rank that dies or stalls mid-step makes every other rank stop with a clear
error within the process group's timeout; nobody hangs."""

from __future__ import annotations

import os
import time

import pytest
import torch
from torch.nn.parallel import DistributedDataParallel as DDP

from tests.distributed import run_distributed
from tests.optim.harness import FixedGradModel, build_optimizer, fixed_grads

CASES = {
    # name: (optimizer, kwargs, step at which rank 2 fails, where)
    "warmup": ("OneBitAdam", dict(lr=1e-2, freeze_step=5), 3, "backward"),
    "compression": ("OneBitAdam", dict(lr=1e-2, freeze_step=2), 4, "backward"),
    "zeroone_sync": ("ZeroOneAdam", dict(lr=1e-2, var_freeze_step=2, local_step_scaler=100, local_step_clipper=2), 4, "step"),
}


def _victim(rank, world_size, case, mode):
    import hf_onebit

    name, kwargs, bad_step, where = CASES[case]
    torch.manual_seed(0)
    model = FixedGradModel()
    opt = build_optimizer(name, model.parameters(), kwargs)
    ddp = DDP(model, bucket_cap_mb=0.01)
    hf_onebit.attach(ddp, opt)

    def fail_here():
        if mode == "die":
            os._exit(17)  # no cleanup, like a killed process
        time.sleep(60)  # a stalled rank: alive, silent (killed by the test once the others stopped)

    for step in range(1, 10):
        loss = ddp(fixed_grads(step, rank))
        if rank == 2 and step == bad_step and where == "backward":
            fail_here()
        start = time.monotonic()
        try:
            loss.backward()
            if rank == 2 and step == bad_step and where == "step":
                fail_here()
            opt.step()
        except Exception as exc:  # noqa: BLE001 - the survivors report what they saw
            return {"step": step, "type": type(exc).__name__, "message": str(exc), "seconds": time.monotonic() - start}
        opt.zero_grad(set_to_none=True)
    return None


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("mode", ["die", "stall"])
def test_a_failed_rank_stops_the_others_with_a_clear_error(case, mode):
    pg_timeout = 8
    got = run_distributed(_victim, 3, case, mode, pg_timeout=pg_timeout, allow_dead=True, wait_for=[0, 1], timeout=150)
    survivors = [got[r] for r in (0, 1)]
    for report in survivors:
        assert report is not None, "a surviving rank trained on as if nothing happened"
        assert report["step"] == CASES[case][2]
        assert "hf_onebit" in report["message"] and "resume from the last checkpoint" in report["message"]
        assert "Another rank has probably died" in report["message"], report["message"]  # blamed on a peer, not local
        # a stall is detected by the process group's timeout, a death at once
        assert report["seconds"] < pg_timeout + 30


def test_a_local_failure_in_a_communication_job_does_not_blame_a_peer():
    """A kernel or memory error on this rank is reported as local, with the kernel way out."""
    from hf_onebit.comm.failures import CommunicationError, LocalFailure
    from hf_onebit.hook import OneBitHookState
    from hf_onebit.optim.base import Plan

    opt = build_optimizer("OneBitAdam", FixedGradModel().parameters(), dict(lr=1e-2, freeze_step=2))
    link = OneBitHookState(opt)

    def out_of_memory():
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")

    with pytest.raises(LocalFailure, match=r"not a network error.*HF_ONEBIT_KERNELS=reference") as got:
        link.optimizer.exchange.in_context(7, Plan.COMPRESS_MOMENTUM, out_of_memory)()
    assert "probably died" not in str(got.value)

    def peer_gone():
        raise RuntimeError("[/gloo/transport/tcp/pair.cc:534] Connection closed by peer [127.0.0.1]:4242")

    with pytest.raises(CommunicationError, match="Another rank has probably died"):
        link.optimizer.exchange.in_context(7, Plan.COMPRESS_MOMENTUM, peer_gone)()


def _link():
    from hf_onebit.hook import OneBitHookState

    return OneBitHookState(build_optimizer("OneBitAdam", FixedGradModel().parameters(), dict(lr=1e-2, freeze_step=2)))


def _raising(exc):
    def job():
        raise exc

    return job


def test_on_cuda_a_failed_collective_may_be_an_earlier_kernel_of_this_rank(monkeypatch):
    """CUDA reports a kernel's fault at the next wait, often the collective: once this process has
    initialised CUDA, a collective's failure is not blamed on a peer alone, and the message says
    how to find the kernel (read through torch.cuda.is_initialized, patched: no GPU here)."""
    from hf_onebit.comm.failures import CommunicationError
    from hf_onebit.optim.base import Plan

    peer_gone = RuntimeError("[/gloo/transport/tcp/pair.cc:534] Connection closed by peer [127.0.0.1]:4242")
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    with pytest.raises(CommunicationError) as got:
        _link().optimizer.exchange.in_context(7, Plan.COMPRESS_MOMENTUM, _raising(peer_gone))()
    message = str(got.value)
    assert "Another rank has probably died" not in message  # the survivors' wording of a CPU run
    assert "another rank has died" in message and "a kernel failed earlier on this rank" in message
    assert "CUDA_LAUNCH_BLOCKING=1" in message and "NCCL_DEBUG=WARN" in message
    assert "resume from the last checkpoint" in message

    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: False)  # a CPU run: the peer is the suspect
    with pytest.raises(CommunicationError, match="Another rank has probably died") as got:
        _link().optimizer.exchange.in_context(7, Plan.COMPRESS_MOMENTUM, _raising(peer_gone))()
    assert "CUDA_LAUNCH_BLOCKING" not in str(got.value)


@pytest.mark.parametrize("error", [
    torch.AcceleratorError("CUDA error: an illegal memory access was encountered"),
    RuntimeError("NCCL error in: ProcessGroupNCCL.cpp:3025, unhandled cuda error (run with NCCL_DEBUG=INFO for"
                 " details), NCCL version 2.27.3"),
], ids=["AcceleratorError", "nccl-unhandled-cuda-error"])
def test_an_error_of_the_cuda_runtime_is_never_blamed_on_a_peer(error, monkeypatch):
    """Even when NCCL raised it: "unhandled cuda error" is this rank's device, not the network."""
    from hf_onebit.comm.failures import LocalFailure, is_distributed_failure
    from hf_onebit.optim.base import Plan

    assert not is_distributed_failure(error)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    with pytest.raises(LocalFailure, match="not a network error") as got:
        _link().optimizer.exchange.in_context(3, Plan.COMPRESS_GRADIENT, _raising(error))()
    message = str(got.value)
    assert "earlier kernel on this rank" in message and "CUDA_LAUNCH_BLOCKING=1" in message
    assert "HF_ONEBIT_KERNELS=reference" in message and "probably died" not in message


def test_a_local_failure_on_cuda_says_the_error_may_come_from_an_earlier_kernel(monkeypatch):
    from hf_onebit.comm.failures import LocalFailure
    from hf_onebit.optim.base import Plan

    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    with pytest.raises(LocalFailure, match="not a network error") as got:
        _link().optimizer.exchange.in_context(3, Plan.COMPRESS_GRADIENT, _raising(ValueError("bad shape")))()
    assert "earlier kernel on this rank" in str(got.value) and "CUDA_LAUNCH_BLOCKING=1" in str(got.value)
