"""The executor is chosen by the tensors' device, never by the backend's name; the mean divides first."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from hf_onebit.comm import executor as ex
from tests.distributed import run_distributed


def test_executor_follows_the_device_not_the_backend_name(monkeypatch):
    def no_names(*args, **kwargs):
        raise AssertionError("executor_for looked at the backend's name")

    monkeypatch.setattr(ex.dist, "get_backend", no_names)
    group = object()  # only its identity is used
    try:
        cpu = ex.executor_for(group, torch.device("cpu"))
        assert isinstance(cpu, ex.ThreadExecutor)
        assert ex.executor_for(group, None) is cpu and ex.executor_for(group, "cpu") is cpu
        cuda = ex.executor_for(group, torch.device("cuda", 1))
        assert isinstance(cuda, ex.StreamExecutor) and cuda.device == torch.device("cuda", 1)
        assert cuda.stream is None  # choosing an executor creates no CUDA context
        assert ex.executor_for(group, "cuda:1") is cuda
        assert ex.executor_for(group, torch.device("cuda", 0)) is not cuda
    finally:
        for key in [k for k in ex._EXECUTORS if k[0] == id(group)]:
            executor = ex._EXECUTORS.pop(key)[1]
            if isinstance(executor, ex.ThreadExecutor):
                executor.shutdown()


def _device_named_group(rank, world_size):
    """A group whose backend is named per device ("cpu:gloo"), as a mixed or default group is."""
    import hf_onebit
    from hf_onebit.integrations.checks import UnsupportedSetup, check_find_unused
    from torch.nn.parallel import DistributedDataParallel as DDP

    group = dist.new_group(list(range(world_size)), backend="cpu:gloo")
    backend = dist.get_backend(group)
    assert backend != "gloo", backend  # a name check would miss it
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 4)
    opt = hf_onebit.OneBitAdam(model.parameters(), lr=1e-2, freeze_step=1)
    ddp = DDP(model, process_group=group)
    hf_onebit.attach(ddp, opt)
    for step in range(3):
        torch.manual_seed(step * 10 + rank)
        ddp(torch.randn(5, 8)).pow(2).sum().backward()
        opt.step()
        opt.zero_grad()
    executor = ex.executor_for(ddp.process_group, model.weight.device)
    refused = []
    unused = DDP(torch.nn.Linear(8, 4), process_group=group, find_unused_parameters=True)
    try:
        hf_onebit.attach(unused, hf_onebit.OneBitAdam(unused.module.parameters()))
    except ValueError as exc:
        refused.append(str(exc))
    try:
        check_find_unused(unused)
    except UnsupportedSetup as exc:
        refused.append(str(exc))
    return {"backend": backend, "thread": isinstance(executor, ex.ThreadExecutor), "refused": refused,
            "params": [p.detach().clone() for p in model.parameters()]}


def test_group_named_per_device_uses_the_thread_and_refuses_find_unused():
    outs = run_distributed(_device_named_group, 2)
    for out in outs:
        assert out["thread"]
        assert len(out["refused"]) == 2 and all("find_unused_parameters" in m for m in out["refused"])
    assert all(torch.equal(a, b) for a, b in zip(outs[0]["params"], outs[1]["params"]))


def _fp16_mean(rank, world_size):
    from hf_onebit.comm import MeanAllReduce

    x = torch.full((16,), 40000.0 + 8 * rank, dtype=torch.float16)  # sum over ranks > fp16 max (65504)
    y = torch.full((16,), 3.0 + rank, dtype=torch.float32)
    return MeanAllReduce().allreduce_async(x).wait(), MeanAllReduce().allreduce_async(y).wait()


@pytest.mark.parametrize("world_size", [2])
def test_fp16_mean_does_not_overflow_where_the_sum_would(world_size):
    outs = run_distributed(_fp16_mean, world_size)
    # DDP's order: each rank divides by the world size, then the sum (exact here)
    want16 = sum(torch.full((16,), 40000.0 + 8 * r, dtype=torch.float16) / world_size for r in range(world_size))
    for x, y in outs:
        assert torch.isfinite(x).all()
        assert torch.equal(x, want16)
        assert torch.equal(y, torch.full((16,), 3.5))


def _released_at_exit(rank, world_size):
    registered = []
    ex.atexit.register = registered.append  # this spawned process only: record, do not run at exit
    total = torch.full((3,), float(rank + 1))
    ex.executor_for(None, total.device).submit(lambda: dist.all_reduce(total)).wait()
    thread = ex.executor_for(None, total.device)._thread
    assert registered == [ex.release_at_exit], registered
    ex.executor_for(None, total.device)  # a second use registers nothing more
    assert len(registered) == 1
    registered[0]()
    return dict(total=total.tolist(), thread_alive=thread.is_alive(), initialized=dist.is_initialized(),
                executors=len(ex._EXECUTORS))


def test_the_first_thread_executor_registers_an_exit_handler_that_tears_the_group_down():
    """Stock scripts exit with the gloo group alive; its C++ threads then abort the process at times."""
    for out in run_distributed(_released_at_exit, 2, fresh=True):  # needs a process without executors
        assert out == dict(total=[3.0, 3.0, 3.0], thread_alive=False, initialized=False, executors=0)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA streams need a GPU")
def test_cuda_jobs_run_on_a_side_stream_and_waiters_sync_on_the_device():
    """A bucket's job runs on the executor's own stream, after what the compute stream queued;
    whoever waits on the future gets the job's result on its own stream, without a host sync."""
    device = torch.device("cuda", torch.cuda.current_device())
    executor = ex.StreamExecutor(device)
    compute = torch.cuda.current_stream(device)
    bucket = torch.zeros(1 << 22, device=device)
    seen = {}

    def job():
        seen["stream"] = torch.cuda.current_stream(device)
        return bucket.add_(1.0).mul_(3.0)  # must see the fill_ queued on the compute stream below

    torch.cuda._sleep(50_000_000)  # keep the compute stream busy: the side stream must wait for it
    bucket.fill_(2.0)
    torch.cuda.set_sync_debug_mode("error")
    try:
        fut = executor.submit(job)
        out = fut.wait()  # a CUDA-aware future: the compute stream waits, the host does not
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert seen["stream"] == executor.stream and seen["stream"] != compute
    assert out is bucket
    assert torch.equal(bucket, torch.full_like(bucket, 9.0))
