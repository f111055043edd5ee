"""Byte and round counters for everything hf_onebit sends.

Accounting rule (the one benchmarks, logs and docs use): *bytes sent by this rank* under the
bandwidth-optimal algorithm of each collective, i.e. what a ring implementation sends:

* all-gather of ``c`` bytes per rank:           ``(n - 1) * c`` sent, ``(n - 1) * c`` received
* all-to-all of ``B`` bytes per rank:           ``(n - 1) / n * B`` sent and received
* all-reduce of ``B`` bytes (reduce-scatter + all-gather): ``2 * (n - 1) / n * B`` each way

``fp32_equivalent`` counts what a plain fp32 all-reduce of the same elements would have sent, so
``compression_ratio = fp32_equivalent / sent``. A *round* is one collective call: on a slow
network each round costs at least one latency, whatever its size.

Between nodes (``k`` of a group's ranks on each node, ranks numbered node by node as torchrun
numbers them): ``inter_node_sent`` is this rank's share of the bytes that leave its node, and
``inter_node_fp32`` the same share of an fp32 ring all-reduce's. Under a ring, each node's one
outgoing edge carries what one rank sends, so a ring collective's share is ``sent / k``; an
all-to-all sends to each peer directly, ``(n - k)/(n - 1)`` of it to other nodes. The exchange by
node counts its own (every byte of its inter-node group leaves the node). On one node both are 0.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from dataclasses import asdict, dataclass

import torch


def allreduce_bytes(nbytes: int, world_size: int) -> int:
    """Bytes one rank sends in a ring all-reduce of ``nbytes``."""
    return 2 * (world_size - 1) * nbytes // world_size if world_size > 1 else 0


def leaving_node(ring: int, direct: int, world_size: int, local_size: int) -> int:
    """This rank's share of the bytes leaving its node, for ``ring`` bytes sent in ring collectives
    (all-reduce, all-gather) and ``direct`` bytes in all-to-alls, ``local_size`` of the group's
    ``world_size`` ranks on each node (see the module docstring)."""
    if local_size >= world_size:
        return 0
    return ring // local_size + direct * (world_size - local_size) // (world_size - 1)


@dataclass
class CommRecord:
    """Counters of one call, or the running totals of many."""

    bytes_sent: int = 0
    bytes_received: int = 0
    rounds: int = 0
    fp32_equivalent: int = 0
    calls: int = 0
    inter_node_sent: int = 0
    inter_node_fp32: int = 0

    @property
    def compression_ratio(self) -> float:
        """``fp32_equivalent / bytes_sent`` (1.0 when nothing was sent)."""
        return self.fp32_equivalent / self.bytes_sent if self.bytes_sent else 1.0

    @property
    def inter_node_ratio(self) -> float | None:
        """``inter_node_fp32 / inter_node_sent``: the ratio over the links between nodes (``None`` on one node)."""
        return self.inter_node_fp32 / self.inter_node_sent if self.inter_node_sent else None

    @property
    def intra_node_ratio(self) -> float | None:
        """The same ratio for the bytes that stay inside the node (``None`` where none do)."""
        sent = self.bytes_sent - self.inter_node_sent
        return (self.fp32_equivalent - self.inter_node_fp32) / sent if sent > 0 else None

    @property
    def headline_ratio(self) -> float:
        """The ratio over the slowest link: between nodes where bytes leave the node, else overall."""
        inter = self.inter_node_ratio
        return inter if inter is not None else self.compression_ratio

    def __iadd__(self, other: "CommRecord") -> "CommRecord":
        self.bytes_sent += other.bytes_sent
        self.bytes_received += other.bytes_received
        self.rounds += other.rounds
        self.fp32_equivalent += other.fp32_equivalent
        self.calls += other.calls
        self.inter_node_sent += other.inter_node_sent
        self.inter_node_fp32 += other.inter_node_fp32
        return self

    def __sub__(self, other: "CommRecord") -> "CommRecord":
        """What was counted since ``other`` (an earlier snapshot of the same totals)."""
        return CommRecord(**{k: v - getattr(other, k) for k, v in asdict(self).items()})

    def as_dict(self) -> dict:
        return {**asdict(self), "compression_ratio": self.compression_ratio}


class CommStats:
    """Thread-safe running totals (calls finish on the communication thread)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.total = CommRecord()

    def record(self, call: CommRecord) -> None:
        with self._lock:
            self.total += call
        job = getattr(_current, "job", None)
        if job is not None:  # a timed job runs on this thread: its bytes, for the link speed
            job.sent[id(self)] = job.sent.get(id(self), 0) + call.bytes_sent

    def snapshot(self) -> CommRecord:
        """A copy of the running totals, safe to read while calls are in flight."""
        with self._lock:
            return CommRecord(**asdict(self.total))

    def state_dict(self) -> dict[str, int]:
        """The running totals as plain integers (for a checkpoint)."""
        return asdict(self.snapshot())

    def load_state_dict(self, totals: dict) -> None:
        """Continue counting from :meth:`state_dict`'s ``totals`` (a resumed run)."""
        with self._lock:
            self.total = CommRecord(**{k: int(v) for k, v in totals.items()})


# ---------------------------------------------------------------------------------------- time
# Where the communication time goes, measured without stalling training: each job the executors
# run (one DDP bucket, or a collective inside ``step()``) gets a record with three points in
# time, read later, once they have passed:
#
# * ``submit``: when the job was queued: the caller's position (CPU: ``perf_counter`` on the
#   calling thread; CUDA: an event on the compute stream, so "when the GPU got there");
# * ``start`` and ``end``: when the job began and finished (CPU: ``perf_counter`` on the
#   communication thread; CUDA: events on the executor's side stream).
#
# Optional stages inside a job (:func:`stage`: ``pack``, ``exchange``, ``unpack``) split its
# time into compression kernels and collectives. Steps are delimited by :meth:`CommTimer.mark_step`
# (called after each optimizer step by the integrations). For each step:
#
# * ``comm`` = the sum of its jobs' ``end - start``: the time communication ran;
# * ``wait`` = ``end - submit`` of its *last* job: training has nothing left to overlap with
#   once the last bucket is handed over (DDP's backward ends right after, then waits for every
#   bucket; a job queued inside ``step()`` is waited for at once), and the executor runs jobs in
#   order, so from that submission until the last job ends communication is all that runs.
#   ``comm - wait`` was hidden behind backward.
#
# Nothing here waits for the device: CUDA events are only *queried* (``Event.query()``, which
# returns at once) and their times read once they have completed; a record whose events have not
# completed stays pending until a later read. So on CUDA a log shows the steps whose events had
# completed by then; the others are counted in the next log.


class _HostJob:
    """Times of one job on the host clock (``time.perf_counter``, seconds)."""

    __slots__ = ("submit", "start", "end", "stages", "profiled", "sent")

    def __init__(self, profiled: bool) -> None:
        self.submit = time.perf_counter()
        self.start: float | None = None
        self.end: float | None = None
        self.stages: list = []  # (name, t0, t1)
        self.profiled = profiled
        self.sent: dict = {}  # id(CommStats) -> bytes this job recorded there

    def mark_start(self) -> None:
        self.start = time.perf_counter()

    def mark_end(self) -> None:
        self.end = time.perf_counter()

    def stage_begin(self):
        return time.perf_counter()

    def stage_end(self, name: str, token) -> None:
        self.stages.append((name, token, time.perf_counter()))

    def done(self) -> bool:
        return self.end is not None

    def times(self) -> tuple[float, float, dict]:
        """``(end - start, end - submit, {stage: seconds})``; call only when :meth:`done`."""
        stages: dict = {}
        for name, t0, t1 in self.stages:
            stages[name] = stages.get(name, 0.0) + (t1 - t0)
        return self.end - self.start, self.end - self.submit, stages

    def release(self) -> None:
        pass


class _CudaJob:
    """Times of one job as CUDA events (``enable_timing``): recorded on the streams, never waited for."""

    __slots__ = ("submit", "start", "end", "stages", "profiled", "sent", "_pool")

    def __init__(self, pool: "_EventPool", compute_stream, profiled: bool) -> None:
        self.submit = pool.take()
        self.submit.record(compute_stream)  # where the compute stream is when the job is queued
        self.start = pool.take()
        self.end = pool.take()
        self.stages: list = []
        self.profiled = profiled
        self.sent: dict = {}
        self._pool = pool

    def mark_start(self) -> None:
        self.start.record()  # the current stream: the executor's side stream

    def mark_end(self) -> None:
        self.end.record()

    def stage_begin(self):
        event = self._pool.take()
        event.record()
        return event

    def stage_end(self, name: str, token) -> None:
        event = self._pool.take()
        event.record()
        self.stages.append((name, token, event))

    def done(self) -> bool:
        # the events are recorded in this order on the side stream (and the side stream waited
        # for the compute stream after `submit`): the last one complete means all are
        return self.end.query()

    def times(self) -> tuple[float, float, dict]:
        stages: dict = {}
        for name, e0, e1 in self.stages:
            stages[name] = stages.get(name, 0.0) + e0.elapsed_time(e1) / 1e3
        return self.start.elapsed_time(self.end) / 1e3, self.submit.elapsed_time(self.end) / 1e3, stages

    def release(self) -> None:
        self._pool.give(self.submit, self.start, self.end, *(e for _, e0, e1 in self.stages for e in (e0, e1)))
        self.stages = []


class _EventPool:
    """Completed timing events of one device, reused (creating a CUDA event is a driver call)."""

    def __init__(self) -> None:
        self._free: list = []

    def take(self):
        if self._free:
            return self._free.pop()
        return torch.cuda.Event(enable_timing=True)

    def give(self, *events) -> None:
        if len(self._free) < 4096:
            self._free.extend(events)


@dataclass
class TimeRecord:
    """Communication time summed over steps (seconds); see the comment above :class:`CommTimer`.

    ``compress`` and ``exchange`` cover the jobs that mark their stages (``pack``/``unpack`` and
    ``exchange``); ``staged_comm`` is those jobs' whole time, so ``comm - staged_comm`` is the time
    of jobs that mark none.
    """

    steps: int = 0
    jobs: int = 0
    comm: float = 0.0
    wait: float = 0.0
    compress: float = 0.0
    exchange: float = 0.0
    staged_comm: float = 0.0
    #: the fastest job's bytes sent per second of link time (its ``exchange`` stages, or the whole
    #: job where it marks none): a lower bound of the link's speed. Not a sum: ``a - b`` keeps ``a``'s.
    link_speed: float = 0.0
    #: whether that job marked its stages (then its time is the collectives' alone)
    link_speed_staged: bool = False

    def __sub__(self, other: "TimeRecord") -> "TimeRecord":
        keep = ("link_speed", "link_speed_staged")
        return TimeRecord(**{k: v if k in keep else v - getattr(other, k) for k, v in asdict(self).items()})

    @property
    def hidden_share(self) -> float | None:
        """The share of communication time that overlapped with backward, 0..1 (``None``: none ran)."""
        if self.comm <= 0:
            return None
        return min(1.0, max(0.0, 1.0 - self.wait / self.comm))


_MARK = object()  # a step boundary in the pending records
#: past this many pending records (a reader that never reads, or a GPU far behind) new jobs are not timed
_MAX_PENDING = 8192
_current = threading.local()  # .job: the record of the job running on this thread


class CommTimer:
    """Times every job of the executors while enabled (see the comment above); thread-safe.

    Off until :meth:`enable` (the Trainer and Accelerate integrations enable it); then each job
    costs two or three ``perf_counter`` calls (CPU) or event records (CUDA) and a list append.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._users = 0
        self._pending: deque = deque()
        self._total = TimeRecord()
        self._last_wait: float | None = None  # of the open step: its last job's end - submit
        self._pools: dict = {}  # CUDA device index -> _EventPool (an event belongs to one device)
        self.dropped = 0  # jobs not timed because too many were pending

    @property
    def enabled(self) -> bool:
        return self._users > 0

    def enable(self) -> None:
        """Start timing (counted: each :meth:`enable` is undone by one :meth:`disable`)."""
        with self._lock:
            self._users += 1

    def disable(self) -> None:
        with self._lock:
            self._users = max(0, self._users - 1)

    # -- the executors' side
    def host_job(self):
        """A record for a job about to be queued (CPU), or ``None`` while disabled."""
        if not self._users:
            return None
        return self._add(_HostJob(_profiling()))

    def cuda_job(self, compute_stream):
        """A record for a job about to run on a side stream, its submit event on ``compute_stream``."""
        if not self._users:
            return None
        pool = self._pools.setdefault(compute_stream.device_index, _EventPool())
        return self._add(_CudaJob(pool, compute_stream, _profiling()))

    def _add(self, job):
        with self._lock:
            if len(self._pending) >= _MAX_PENDING:
                self._fold()
                if len(self._pending) >= _MAX_PENDING:
                    self.dropped += 1
                    return None
            self._pending.append(job)
        return job

    # -- the integrations' side
    def mark_step(self) -> None:
        """An optimizer step ended: the jobs queued since the previous mark belong to it."""
        if not self._users:
            return
        with self._lock:
            self._pending.append(_MARK)
            self._fold()

    def snapshot(self) -> TimeRecord:
        """The totals of every step whose jobs have all completed; never waits for them."""
        with self._lock:
            self._fold()
            return TimeRecord(**asdict(self._total))

    def settle(self) -> TimeRecord:
        """:meth:`snapshot` after waiting for the pending jobs' events: for the end of training only."""
        with self._lock:
            pending = [j for j in self._pending if isinstance(j, _CudaJob)]
        for job in pending:  # several side streams (groups, devices) may hold jobs
            job.end.synchronize()
        return self.snapshot()

    def _fold(self) -> None:
        """Add the completed records at the head of the queue to the totals (lock held)."""
        total, pending = self._total, self._pending
        while pending:
            job = pending[0]
            if job is _MARK:
                total.steps += 1
                if self._last_wait is not None:
                    total.wait += max(0.0, self._last_wait)
                self._last_wait = None
            else:
                if not job.done():
                    return
                try:
                    run, wait, stages = job.times()
                except RuntimeError:  # an event never recorded (the job failed before it ran)
                    pending.popleft()
                    continue
                total.jobs += 1
                total.comm += run
                link = run
                if stages:
                    total.staged_comm += run
                    total.compress += stages.get("pack", 0.0) + stages.get("unpack", 0.0)
                    link = stages.get("exchange", 0.0)
                    total.exchange += link
                # the flat exchange records into one CommStats; the exchange by node also counts
                # its inter-node bytes again in a second one, a subset: the largest is the job's
                sent = max(job.sent.values(), default=0)
                if sent > 0 and link > 0 and sent / link > total.link_speed:
                    total.link_speed, total.link_speed_staged = sent / link, bool(stages)
                self._last_wait = wait
                job.release()
            pending.popleft()


#: The process's timer: every executor records into it (all groups and devices of this process).
TIMER = CommTimer()


def _profiling() -> bool:
    """Whether a profiler runs: torch.profiler's process-wide flag (with ``profile_all_threads`` the
    thread-local one stays off), or the thread-local one (the legacy autograd profiler)."""
    return torch.autograd.profiler._is_profiler_enabled or torch.autograd._profiler_enabled()


def running(job):
    """Context manager for the executors: ``job`` (a record, or ``None``) runs on this thread now."""
    return _Running(job)


class _Running:
    __slots__ = ("job", "_range", "_previous")

    def __init__(self, job) -> None:
        self.job = job

    def __enter__(self):
        self._previous = getattr(_current, "job", None)
        _current.job = self.job
        self._range = None
        if self.job is not None and self.job.profiled:
            self._range = torch.profiler.record_function("hf_onebit.comm_job")
            self._range.__enter__()
        if self.job is not None:
            self.job.mark_start()
        return self.job

    def __exit__(self, *exc) -> None:
        if self.job is not None:
            self.job.mark_end()
        if self._range is not None:
            self._range.__exit__(*exc)
        _current.job = self._previous


class stage:
    """``with stage("pack"):`` around part of a communication job: times it and names it for the profiler.

    ``name`` is one of ``"pack"`` (compression kernels before a collective), ``"exchange"`` (a
    collective) and ``"unpack"`` (kernels after the last collective). Inside a job the executor
    timed, the stage's time is added to the job's record (host clock on CPU, CUDA events on the
    job's stream: nothing waits). Under ``torch.profiler`` it is also a ``record_function`` range
    ``hf_onebit.<name>`` (on the CPU communication thread, the profiler records it with
    ``experimental_config=torch._C._profiler._ExperimentalConfig(profile_all_threads=True)``).
    Outside a timed job and without a profiler it costs a thread-local lookup and one check.
    """

    __slots__ = ("name", "_job", "_token", "_range")

    def __init__(self, name: str) -> None:
        self.name = name

    def __enter__(self) -> None:
        job = self._job = getattr(_current, "job", None)
        self._range = None
        if job.profiled if job is not None else _profiling():
            self._range = torch.profiler.record_function(f"hf_onebit.{self.name}")
            self._range.__enter__()
        if job is not None:
            self._token = job.stage_begin()

    def __exit__(self, *exc) -> None:
        if self._job is not None:
            self._job.stage_end(self.name, self._token)
        if self._range is not None:
            self._range.__exit__(*exc)
