"""Run a test function in several gloo processes on this machine and collect what each returns."""

from __future__ import annotations

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


def _worker(rank, world_size, port, fn, args, env, results, pg_timeout):
    os.environ.update(env)
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_RANK=str(rank % int(env.get("LOCAL_WORLD_SIZE", world_size))),
    )
    torch.set_num_threads(1)
    try:
        dist.init_process_group(
            "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size,
            timeout=timedelta(seconds=pg_timeout),
        )
        out = fn(rank, world_size, *args)
        # Serialise here: tensors sent through a queue as shared memory vanish with this process.
        buf = io.BytesIO()
        torch.save(out, buf)
        results.put((rank, "ok", buf.getvalue()))
    except BaseException:  # noqa: BLE001 - reported to the parent
        results.put((rank, "error", traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def run_distributed(
    fn, world_size: int, *args, env: dict | None = None, timeout: float = 300.0,
    pg_timeout: float = 120.0, allow_dead: bool = False, wait_for: list[int] | None = None,
):
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` gloo ranks; return results by rank.

    ``fn`` must be importable (module level). Any rank's exception fails the call with that
    rank's traceback; a rank that neither returns nor fails within ``timeout`` fails it too.
    With ``allow_dead`` (fault-injection tests) ranks that die are tolerated: the result is a
    dict of the ranks that reported; with ``wait_for`` it returns as soon as those ranks have
    reported and kills the others. ``pg_timeout`` is the process group's collective timeout.
    """
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
