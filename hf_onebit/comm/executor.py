"""Issue collectives in one order on every rank, without blocking the caller.

The compressed all-reduce is a chain: exchange scales, then compress, then all-to-all, then
the server step, then all-gather. Each link needs the previous one's *result*. With several
DDP buckets in flight, the obvious asynchronous design (start the next collective in a
future's ``.then()`` callback) lets callbacks run in completion order, which differs between
ranks: gloo then pairs the wrong collectives and hangs or fails with "collective mismatch".

So every collective hf_onebit issues on a process group goes through that group's executor:

The executor is chosen by the device of the tensors (not by the backend's name, which may be
``"undefined"`` or ``"cuda:nccl,cpu:gloo"``): see :func:`runs_inline`.

* :class:`ThreadExecutor` (CPU tensors, gloo): one worker thread per group runs jobs strictly in
  submission order, each job blocking on its own collectives. DDP submits buckets in the same
  order on every rank, so every rank issues the same sequence. The caller gets a
  :class:`torch.futures.Future` at once; backward continues on the main thread meanwhile (the
  numba kernels and gloo release the GIL).
* :class:`StreamExecutor` (CUDA tensors, NCCL): NCCL collectives and Triton kernels are enqueued on
  CUDA streams and never block the host, so the job runs right away on the calling thread, in
  submission order. It runs on a *side stream* of its own, one per (group, device), not on the
  compute stream: enqueued on the compute stream, a bucket's kernels and its rounds of
  collectives would sit in front of every backward kernel issued after them, and backward of the
  remaining layers would wait for each bucket's exchange (no overlap, slower than stock DDP, whose
  all-reduce runs on NCCL's own stream). The side stream first waits for the compute stream (the
  bucket's gradients, and the previous ``step()``'s writes to optimizer state, are then ready); the
  bucket's memory is marked as used on the side stream (``record_stream``), so the caching allocator
  cannot hand it to the compute stream while the exchange still reads it. The returned future is
  CUDA-aware (``devices=[...]``) and completed on the side stream: whoever waits on it (DDP's end of
  backward, 0/1 Adam's ``step()``) makes *its* stream wait for the exchange, never the host.

Both executors time their jobs into :data:`hf_onebit.comm.stats.TIMER` while it is enabled (the
Trainer and Accelerate integrations enable it; see :mod:`hf_onebit.comm.stats`): the CPU one with
``perf_counter`` on the calling and on the communication thread, the CUDA one with timing events
recorded on the compute and the side stream, which nobody waits for (they are read once complete).
Under ``torch.profiler`` each job is a ``hf_onebit.comm_job`` range.
"""

from __future__ import annotations

import atexit
import gc
import queue
import threading
from typing import Any, Callable

import torch
import torch.distributed as dist

from hf_onebit.comm.stats import TIMER, running

Job = Callable[[], Any]


class StreamExecutor:
    """Run each job at once on the calling thread, on a CUDA side stream (stream-ordered NCCL).

    The stream is created on first use, so that choosing an executor needs no CUDA context.
    """

    def __init__(self, device: torch.device) -> None:
        self.device = torch.device(device)
        self.stream: Any = None

    def submit(self, job: Job) -> torch.futures.Future:
        if self.stream is None:
            self.stream = torch.cuda.Stream(device=self.device)
        fut: torch.futures.Future = torch.futures.Future(devices=[self.device])
        compute = torch.cuda.current_stream(self.device)
        timed = TIMER.cuda_job(compute)  # an event on the compute stream: where backward is now
        # Order after everything the compute stream has queued so far: the bucket's gradients,
        # and the optimizer state that the last step() wrote.
        self.stream.wait_stream(compute)
        try:
            with torch.cuda.stream(self.stream):
                with running(timed):  # start and end events on the side stream
                    result = job()
                for t in _tensors(result):  # DDP may free a bucket while the side stream reads it
                    t.record_stream(self.stream)
                # Inside the stream context: the future records its completion event on the side
                # stream, and a waiter's stream then waits for that event.
                fut.set_result(result)
        except BaseException as exc:  # noqa: BLE001 - handed to whoever waits
            fut.set_exception(exc)
        return fut


def _tensors(value: Any) -> list:
    if isinstance(value, torch.Tensor):
        return [value] if value.is_cuda else []
    if isinstance(value, (list, tuple)):
        return [t for v in value for t in _tensors(v)]
    return []


class ThreadExecutor:
    """One daemon thread that runs jobs in submission order (host-blocking backends like gloo)."""

    def __init__(self, name: str = "hf_onebit-comm") -> None:
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._loop, name=name, daemon=True)
        self._thread.start()

    def submit(self, job: Job) -> torch.futures.Future:
        fut: torch.futures.Future = torch.futures.Future()
        self._jobs.put((job, fut, TIMER.host_job()))  # the record notes the submission time
        return fut

    def _loop(self) -> None:
        while True:
            item = self._jobs.get()
            if item is None:
                return
            job, fut, timed = item
            try:
                with running(timed):
                    result = job()
            except BaseException as exc:  # noqa: BLE001 - handed to whoever waits
                fut.set_exception(exc)
            else:
                fut.set_result(result)

    def shutdown(self) -> None:
        self._jobs.put(None)
        self._thread.join(timeout=5)


def runs_inline(device: torch.device | str | None) -> bool:
    """Whether collectives on ``device`` run inline (CUDA: stream-ordered) or on the ordered thread.

    Chosen by the *tensor's device*, never by the backend's name: a group created without a
    backend reports ``"undefined"``, a mixed one ``"cuda:nccl,cpu:gloo"``, and either may carry
    CPU buckets (gloo, host-blocking) and CUDA buckets (NCCL, stream-ordered).
    """
    return device is not None and torch.device(device).type == "cuda"


# (id(group), device kind) -> (group, executor); the group is kept so its id cannot be reused
# while we hold it.
_EXECUTORS: dict[tuple, tuple[Any, Any]] = {}
_LOCK = threading.Lock()


def executor_for(group: dist.ProcessGroup | None = None, device: torch.device | str | None = None):
    """The executor shared by every hf_onebit collective on ``group`` for tensors on ``device``.

    CUDA tensors get a :class:`StreamExecutor` (one per CUDA device and group), anything else (CPU, or
    no device given) the group's :class:`ThreadExecutor`; created on first use.
    """
    group = group if group is not None else dist.group.WORLD
    inline = runs_inline(device)
    if inline:
        device = torch.device(device)
        if device.index is None:  # "cuda": the current device (a CUDA future needs indexed devices)
            device = torch.device(device.type, torch.cuda.current_device())
    key = (id(group), str(device) if inline else "thread")
    with _LOCK:
        entry = _EXECUTORS.get(key)
        if entry is None:
            if not inline and not any(isinstance(e, ThreadExecutor) for _, e in _EXECUTORS.values()):
                atexit.register(release_at_exit)
            executor: Any = StreamExecutor(device) if inline else ThreadExecutor()
            entry = _EXECUTORS[key] = (group, executor)
        return entry[1]


def release_at_exit() -> None:
    """Stop the worker threads and destroy the default process group before the interpreter dies.

    Registered (once) when the first :class:`ThreadExecutor` starts. Stock scripts rarely call
    ``dist.destroy_process_group()``; gloo's C++ threads then outlive the interpreter and now and
    then abort the process at exit ("terminate called without an active exception", SIGABRT):
    the training finished, its checkpoint is written, yet the launcher reports a failed rank.
    atexit handlers run while the interpreter is whole, so the group is torn down here instead.
    Destroying a gloo group is local (no message to the other ranks), so it cannot hang; a group
    with NCCL in it is left to PyTorch (its teardown may wait on peers that crashed).

    Destroying the group only unregisters it: the DDP model still holds it (and its comm hook's
    Python state), and a model prepared by Accelerate can sit in a reference cycle that outlives
    the script. Left alone they are freed during interpreter finalization, the state in which the
    C++ side can no longer take the GIL. ``gc.collect()`` frees them here instead.
    """
    with _LOCK:
        entries = list(_EXECUTORS.values())
        _EXECUTORS.clear()
    for _, executor in entries:
        if isinstance(executor, ThreadExecutor):  # stream executors hold no thread
            executor.shutdown()
    if dist.is_available() and dist.is_initialized() and "nccl" not in str(dist.get_backend()):
        dist.destroy_process_group()
        gc.collect()  # only here: an NCCL group's destructor stays where PyTorch puts it
