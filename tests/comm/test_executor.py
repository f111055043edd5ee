"""The executor is chosen by the tensors' device, never by the backend's name; the mean divides first."""

from __future__ import annotations

import gc
import weakref

import pytest
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

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
        # "cuda" without an index is the current device (a CUDA future refuses an unindexed one)
        monkeypatch.setattr(ex.torch.cuda, "current_device", lambda: 1)
        assert ex.executor_for(group, "cuda") is cuda and ex.executor_for(group, torch.device("cuda")) is cuda
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
    # A DDP model in a reference cycle, as an Accelerate script leaves one behind;
    # with the automatic collector off, only the handler's own collection can free it.
    gc.disable()
    model = DDP(torch.nn.Linear(2, 2))
    model.cycle = [model]
    model_alive = weakref.ref(model)
    del model
    registered[0]()
    return dict(total=total.tolist(), thread_alive=thread.is_alive(), initialized=dist.is_initialized(),
                executors=len(ex._EXECUTORS), model_alive=model_alive() is not None)


def test_the_first_thread_executor_registers_an_exit_handler_that_tears_the_group_down():
    """Stock scripts exit with the gloo group alive; its C++ threads then abort the process at times."""
    for out in run_distributed(_released_at_exit, 2, fresh=True):  # needs a process without executors
        assert out == dict(total=[3.0, 3.0, 3.0], thread_alive=False, initialized=False, executors=0,
                           model_alive=False)


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


# ---------------------------------------------------------------------------------------- timing
def _sleeping_job(pack: float, exchange: float, sent: int, stats):
    """A job that spends ``pack`` s in compression and ``exchange`` s in a collective that sends ``sent`` bytes."""
    import time

    from hf_onebit.comm.stats import CommRecord, stage

    def job():
        with stage("pack"):
            time.sleep(pack)
        with stage("exchange"):
            time.sleep(exchange)
        stats.record(CommRecord(bytes_sent=sent, calls=1))
        return sent

    return job


def test_the_thread_executor_times_jobs_stages_and_the_wait_after_the_last_submission():
    """One step with two jobs: the first runs while "backward" goes on (hidden), the second is
    handed over at the end of backward, so the step waits from its submission to its end."""
    import time

    from hf_onebit.comm.stats import TIMER, CommStats

    executor, stats = ex.ThreadExecutor(name="timing-test"), CommStats()
    TIMER.enable()
    try:
        before = TIMER.snapshot()
        executor.submit(_sleeping_job(0.01, 0.03, 3000, stats))
        time.sleep(0.15)  # backward goes on: the first job is done well before the second is queued
        executor.submit(_sleeping_job(0.01, 0.02, 4000, stats)).wait()
        TIMER.mark_step()
        d = TIMER.snapshot() - before
    finally:
        TIMER.disable()
        executor.shutdown()
    assert (d.steps, d.jobs) == (1, 2)
    assert d.comm >= 0.07 and d.staged_comm == d.comm  # both jobs ran, and marked their stages
    assert d.compress >= 0.02 and d.exchange >= 0.05
    assert d.compress + d.exchange <= d.comm
    # exposed: the second job only (queued when the comm thread was idle), from submission to end
    assert 0.03 <= d.wait < d.comm - 0.03
    assert 0 < d.hidden_share < 1
    # the fastest job's bytes over its collective time (a running maximum for the process): at least
    # the two jobs' bytes over their collective time together
    assert d.link_speed >= 7000 / d.exchange * 0.999


def test_nothing_is_timed_while_the_timer_is_off_and_a_step_without_jobs_waits_nothing():
    from hf_onebit.comm.stats import TIMER, CommStats

    executor, stats = ex.ThreadExecutor(name="timing-test"), CommStats()
    try:
        assert not TIMER.enabled  # off unless an integration (or a test) enabled it
        before = TIMER.snapshot()
        executor.submit(_sleeping_job(0.0, 0.01, 10, stats)).wait()
        TIMER.mark_step()
        assert TIMER.snapshot() == before
        TIMER.enable()
        try:
            TIMER.mark_step()  # e.g. a 0/1 Adam local step: nothing communicated
            d = TIMER.snapshot() - before
        finally:
            TIMER.disable()
    finally:
        executor.shutdown()
    assert (d.steps, d.jobs, d.comm, d.wait) == (1, 0, 0.0, 0.0) and d.hidden_share is None


def test_profiler_ranges_name_the_job_its_stages_and_the_optimizer_step():
    """Under torch.profiler: hf_onebit.comm_job and its stages (on the communication thread, which the
    profiler records with profile_all_threads) and torch's own range around every optimizer step."""
    import hf_onebit
    from hf_onebit.comm.stats import TIMER, CommStats
    from torch.profiler import profile

    executor = ex.ThreadExecutor(name="timing-test")
    opt = hf_onebit.OneBitAdam([torch.nn.Parameter(torch.ones(4))], lr=0.1, freeze_step=1)
    opt.param_groups[0]["params"][0].grad = torch.ones(4)
    TIMER.enable()
    try:
        config = torch._C._profiler._ExperimentalConfig(profile_all_threads=True)
        with profile(experimental_config=config) as prof:
            executor.submit(_sleeping_job(0.0, 0.0, 1, CommStats())).wait()
            opt.step()
    finally:
        TIMER.disable()
        executor.shutdown()
    names = {e.name for e in prof.events()}
    assert {"hf_onebit.comm_job", "hf_onebit.pack", "hf_onebit.exchange", "Optimizer.step#OneBitAdam.step"} <= names


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA events need a GPU")
def test_cuda_jobs_are_timed_with_events_that_nobody_waits_for():
    """On CUDA a job's times are events on the compute and the side stream. Reading the timer while
    the GPU is still busy neither waits (sync debug mode "error" would raise) nor counts the step;
    once the GPU is done, the step's figures are there: the first job ran while "backward" did
    (hidden), the second was exposed from the compute stream's arrival at its submission."""
    from hf_onebit.comm.stats import TIMER, CommRecord, CommStats, stage

    device = torch.device("cuda", torch.cuda.current_device())
    executor, stats = ex.StreamExecutor(device), CommStats()
    out = torch.zeros(4, device=device)

    def job():
        with stage("pack"):
            torch.cuda._sleep(10_000_000)
        with stage("exchange"):
            torch.cuda._sleep(40_000_000)
        stats.record(CommRecord(bytes_sent=1000, calls=1))
        return out

    TIMER.enable()
    try:
        before = TIMER.snapshot()
        torch.cuda.set_sync_debug_mode("error")
        try:
            executor.submit(job)
            torch.cuda._sleep(200_000_000)  # backward, on the compute stream: the first job overlaps it
            executor.submit(job).wait()
            TIMER.mark_step()
            pending = TIMER.snapshot() - before  # the GPU is still sleeping: nothing counted, nothing waited
        finally:
            torch.cuda.set_sync_debug_mode(0)
        torch.cuda.synchronize()  # the test waits, the timer never does
        d = TIMER.snapshot() - before
    finally:
        TIMER.disable()
    assert (pending.steps, pending.jobs) == (0, 0)
    assert (d.steps, d.jobs) == (1, 2)
    assert 0 < d.compress < d.exchange <= d.comm and d.staged_comm == d.comm
    one_job = d.comm / 2
    assert d.wait == pytest.approx(one_job, rel=0.25), (d.wait, d.comm)  # the second job only
    assert d.hidden_share == pytest.approx(0.5, abs=0.15)
    assert d.link_speed >= 2000 / d.exchange * 0.999  # a running maximum: at least these jobs' speed


def _cuda_ddp_timed(rank, world_size):
    """2 gloo ranks on one GPU: DDP + 1-bit Adam, 4 steps untimed, then 4 timed (log entries read at
    every step); the synchronising CUDA calls that sync debug mode reports, in each half."""
    import warnings

    from torch.nn.parallel import DistributedDataParallel as DDP

    import hf_onebit
    from hf_onebit.integrations.logs import CompressionLog

    device = torch.device("cuda", 0)
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(256, 256) for _ in range(6)]).to(device)
    opt = hf_onebit.OneBitAdam(model.parameters(), lr=1e-3, freeze_step=2)
    ddp = DDP(model, device_ids=[device], bucket_cap_mb=0.5)
    hf_onebit.attach(ddp, opt)
    log = CompressionLog(opt)
    g = torch.Generator().manual_seed(rank)
    xs = [torch.randn(32, 256, generator=g).to(device) for _ in range(12)]
    syncs = {"untimed": 0, "timed": 0}
    entries = []
    for t in range(12):
        if t == 8:
            log.start()
        watched = "timed" if t >= 8 else "untimed" if t >= 4 else None
        torch.cuda.synchronize()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            if watched:
                torch.cuda.set_sync_debug_mode("warn")
            try:
                ddp(xs[t]).pow(2).mean().backward()
                opt.step()
                opt.zero_grad(set_to_none=True)
                if t >= 8:
                    entries.append(log.entries())
            finally:
                torch.cuda.set_sync_debug_mode(0)
        if watched:
            syncs[watched] += sum("synchroniz" in str(w.message) for w in caught)
    torch.cuda.synchronize()
    entries.append(log.entries())  # the steps whose events had not completed at their log
    summary = log.summary()
    log.finish()
    return {"syncs": syncs, "entries": entries, "summary": summary}


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA events need a GPU")
def test_cuda_ddp_steps_are_timed_without_a_host_sync_more():
    for out in run_distributed(_cuda_ddp_timed, 2, timeout=240, fresh=True):
        assert out["syncs"]["timed"] == out["syncs"]["untimed"], out["syncs"]
        timed = [e for e in out["entries"] if "onebit/comm_ms" in e]  # a log before its steps' events completed has none
        assert timed and all(e["onebit/comm_ms"] > 0 and 0 <= e["onebit/hidden_share"] <= 1 for e in timed)
        assert "communication ran" in out["summary"], out["summary"]
