"""Run a test function in several gloo processes on this machine and collect what each returns.

Spawning a rank costs seconds (a fresh Python imports torch, hf_onebit and the compiled kernels,
then joins a gloo group), several times the work of a typical test. Under pytest (``conftest.py``
sets :data:`KEEP_WORKERS`) the ranks are therefore kept between calls: one pool of ``world_size``
processes per world size runs one test function after another on its default group. A pool is
replaced after any failure, timeout or death (a rank may be stuck in a collective), and when a
test destroys the default group. Tests that change a process for good (patched torch methods,
killed ranks, another collective timeout) ask for ``fresh=True`` processes, as do fault-injection
runs (``allow_dead``).
"""

from __future__ import annotations

import faulthandler
import io
import os
import socket
import traceback
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


#: keep ranks alive between calls (set by tests/conftest.py; benchmarks spawn fresh ranks)
KEEP_WORKERS = False
_DEFAULT_PG_TIMEOUT = 120.0


def _set_rank_env(rank: int, world_size: int, env: dict) -> None:
    os.environ.update(env)
    os.environ["LOCAL_RANK"] = str(rank % int(env.get("LOCAL_WORLD_SIZE", world_size)))


def _join_gloo(rank: int, world_size: int, port: int, pg_timeout: float) -> None:
    """Make this process ``rank`` of a gloo group on the loopback (one torch thread per rank)."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world_size))
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size,
        timeout=timedelta(seconds=pg_timeout),
    )


def _serialised(out) -> bytes:
    # Serialise here: tensors sent through a queue as shared memory vanish with this process.
    buf = io.BytesIO()
    torch.save(out, buf)
    return buf.getvalue()


def _worker(rank, world_size, port, fn, args, env, results, pg_timeout):
    faulthandler.enable()  # a rank that dies on a signal prints its Python stack to the test's stderr
    _set_rank_env(rank, world_size, env)
    try:
        _join_gloo(rank, world_size, port, pg_timeout)
        results.put((rank, "ok", _serialised(fn(rank, world_size, *args))))
    except BaseException:  # noqa: BLE001 - reported to the parent
        results.put((rank, "error", traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def _pool_worker(rank, world_size, port, inbox, results, pg_timeout):
    faulthandler.enable()
    _join_gloo(rank, world_size, port, pg_timeout)
    base_env = dict(os.environ)
    while True:
        job = inbox.get()
        if job is None:
            break
        fn, args, env = job
        _set_rank_env(rank, world_size, env)
        try:
            status, payload = "ok", _serialised(fn(rank, world_size, *args))
        except BaseException:  # noqa: BLE001 - reported to the parent
            status, payload = "error", traceback.format_exc()
        finally:  # the next test starts from the same environment
            for key in set(os.environ) - set(base_env):
                del os.environ[key]
            os.environ.update(base_env)
        usable = status == "ok" and dist.is_initialized()
        results.put((rank, status, payload, usable))
        if not usable:
            break
    if dist.is_initialized():
        dist.destroy_process_group()


class _Pool:
    """``world_size`` gloo ranks that run one test function after another."""

    def __init__(self, world_size: int) -> None:
        ctx = mp.get_context("spawn")
        self.world_size = world_size
        self.results = ctx.SimpleQueue()
        self.inboxes = [ctx.SimpleQueue() for _ in range(world_size)]
        port = _free_port()
        self.procs = [
            ctx.Process(target=_pool_worker, args=(r, world_size, port, self.inboxes[r], self.results, _DEFAULT_PG_TIMEOUT),
                        daemon=True)
            for r in range(world_size)
        ]
        for p in self.procs:
            p.start()

    def run(self, fn, args, env: dict, timeout: float) -> list:
        import time

        for inbox in self.inboxes:
            inbox.put((fn, args, env))
        deadline = time.monotonic() + timeout
        got: dict = {}
        usable = True
        try:
            while len(got) < self.world_size:
                if not self.results.empty():
                    rank, status, out, ok = self.results.get()
                    if status == "error":
                        raise AssertionError(self._failure(rank, out))
                    got[rank] = torch.load(io.BytesIO(out), weights_only=False)
                    usable = usable and ok
                elif any(p.exitcode is not None for p in self.procs):
                    time.sleep(0.5)
                    if self.results.empty():
                        raise AssertionError(f"a rank died without reporting (exit codes {[p.exitcode for p in self.procs]})")
                elif time.monotonic() > deadline:
                    raise AssertionError(f"timed out after {timeout}s; ranks that reported: {sorted(got)}")
                else:
                    time.sleep(0.005)
        except BaseException:
            usable = False
            raise
        finally:
            if not usable:
                self.close()
        return [got[r] for r in range(self.world_size)]

    def _failure(self, rank: int, out: str) -> str:
        """What to report when ``rank`` failed: its traceback, the other ranks' errors and every
        exit code (a peer that died first, on a signal, is often the cause of this rank's error)."""
        import time

        time.sleep(1.0)
        lines = [f"rank {rank} failed:\n{out}"]
        while not self.results.empty():
            other, status, text, _ = self.results.get()
            if status == "error":
                lines.append(f"rank {other} failed too:\n{text}")
        lines.append(f"exit codes {[p.exitcode for p in self.procs]} (negative: killed by that signal)")
        return "\n".join(lines)

    @property
    def alive(self) -> bool:
        return all(p.is_alive() for p in self.procs)

    def close(self) -> None:
        for inbox in self.inboxes:
            inbox.put(None)
        for p in self.procs:
            p.join(timeout=5)
            if p.is_alive():
                p.kill()
                p.join(timeout=5)


_POOLS: dict[int, _Pool] = {}


def close_pools() -> None:
    while _POOLS:
        _POOLS.popitem()[1].close()


def run_distributed(
    fn, world_size: int, *args, env: dict | None = None, timeout: float = 300.0,
    pg_timeout: float = _DEFAULT_PG_TIMEOUT, allow_dead: bool = False, wait_for: list[int] | None = None,
    fresh: bool = False,
):
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` gloo ranks; return results by rank.

    ``fn`` must be importable (module level). Any rank's exception fails the call with that
    rank's traceback; a rank that neither returns nor fails within ``timeout`` fails it too.
    With ``allow_dead`` (fault-injection tests) ranks that die are tolerated: the result is a
    dict of the ranks that reported; with ``wait_for`` it returns as soon as those ranks have
    reported and kills the others. ``pg_timeout`` is the process group's collective timeout.
    Under pytest the ranks are kept for the next call (see the module's docstring) unless
    ``fresh``, ``allow_dead`` or a non-default ``pg_timeout`` asks for new processes.
    """
    if KEEP_WORKERS and not (fresh or allow_dead or wait_for is not None or pg_timeout != _DEFAULT_PG_TIMEOUT):
        pool = _POOLS.get(world_size)
        if pool is None or not pool.alive:
            pool = _POOLS[world_size] = _Pool(world_size)
        try:
            return pool.run(fn, args, env or {}, timeout)
        finally:
            if not pool.alive:
                _POOLS.pop(world_size, None)
    ctx = mp.get_context("spawn")
    results = ctx.SimpleQueue()
    port = _free_port()
    procs = [
        ctx.Process(target=_worker, args=(r, world_size, port, fn, args, env or {}, results, pg_timeout), daemon=True)
        for r in range(world_size)
    ]
    for p in procs:
        p.start()
    import time

    deadline = time.monotonic() + timeout
    got: dict = {}

    def finished() -> bool:
        if len(got) == world_size:
            return True
        if allow_dead and wait_for is not None:
            return all(r in got for r in wait_for)
        if allow_dead:  # every rank either reported or is dead
            return all(r in got or procs[r].exitcode not in (None,) for r in range(world_size)) and results.empty()
        return False

    while not finished() and time.monotonic() < deadline:
        if not results.empty():
            rank, status, out = results.get()
            if status == "error":
                for p in procs:
                    p.kill()
                raise AssertionError(f"rank {rank} failed:\n{out}")
            got[rank] = torch.load(io.BytesIO(out), weights_only=False)
        elif not allow_dead and any(p.exitcode not in (None, 0) for p in procs) and results.empty():
            time.sleep(0.5)
            if results.empty():
                codes = [p.exitcode for p in procs]
                for p in procs:
                    p.kill()
                raise AssertionError(f"a rank died without reporting (exit codes {codes})")
        else:
            time.sleep(0.02)
    for r, p in enumerate(procs):
        if wait_for is not None and r not in wait_for:
            p.kill()  # fault-injection leftovers (a stalled rank) are not waited for
        p.join(timeout=10)
        if p.is_alive():
            p.kill()
    if allow_dead:
        if not finished():
            raise AssertionError(f"timed out after {timeout}s; ranks that reported: {sorted(got)}")
        return got
    if len(got) < world_size:
        raise AssertionError(f"timed out after {timeout}s; ranks that reported: {sorted(got)}")
    return [got[r] for r in range(world_size)]
