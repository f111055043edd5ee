"""The emulated link: rates, network namespaces with a ``tc tbf`` loopback, and the link probe."""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import socket
import statistics
import signal
import subprocess
import time
from pathlib import Path


# ====================================================================== rates and namespaces
_UNITS = {"bit": 1, "kbit": 1e3, "mbit": 1e6, "gbit": 1e9, "tbit": 1e12}


def parse_rate(rate: str) -> float | None:
    """``'100mbit'`` -> 1e8 bits/s; ``'unlimited'`` -> None."""
    if rate == "unlimited":
        return None
    m = re.fullmatch(r"(\d+(?:\.\d+)?)([kmgt]?bit)", rate.lower())
    if not m:
        raise argparse.ArgumentTypeError(f"rate must look like 100mbit, 2.5gbit or 'unlimited', got {rate!r}")
    return float(m.group(1)) * _UNITS[m.group(2)]


def tbf_burst_bytes(bits_per_s: float) -> int:
    """Bucket size: at least 256 KiB (a 64 KiB loopback/GSO packet must fit), else 2 ms of the rate."""
    return max(256 * 1024, int(bits_per_s / 8 * 0.002))


def _run(cmd: list[str], check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, check=check, capture_output=True, text=True)


class Namespaces:
    """The network namespaces this process created; all deleted by :meth:`cleanup`."""

    def __init__(self) -> None:
        self.created: list[str] = []
        self.counter = 0

    def available(self) -> tuple[bool, str]:
        if os.geteuid() != 0:
            return False, "not running as root"
        if shutil.which("ip") is None or shutil.which("tc") is None:
            return False, "iproute2 (ip, tc) not found"
        name = self.create(None)
        if name is None:
            return False, "`ip netns add` failed"
        self.delete(name)
        return True, ""

    def create(self, bits_per_s: float | None) -> str | None:
        name = f"hfob{os.getpid()}n{self.counter}"
        self.counter += 1
        if _run(["ip", "netns", "add", name], check=False).returncode != 0:
            return None
        self.created.append(name)
        _run(["ip", "-n", name, "link", "set", "lo", "up"])
        if bits_per_s is not None:
            burst = tbf_burst_bytes(bits_per_s)
            _run(["tc", "-n", name, "qdisc", "add", "dev", "lo", "root", "tbf",
                  "rate", f"{int(bits_per_s)}bit", "burst", str(burst), "latency", "50ms"])
        return name

    def lo_tx_bytes(self, name: str) -> int:
        out = _run(["ip", "-j", "-s", "-n", name, "link", "show", "lo"]).stdout
        return int(json.loads(out)[0]["stats64"]["tx"]["bytes"])

    def qdisc(self, name: str) -> str:
        return _run(["tc", "-n", name, "qdisc", "show", "dev", "lo"], check=False).stdout.strip()

    def delete(self, name: str) -> None:
        _run(["ip", "netns", "del", name], check=False)
        if name in self.created:
            self.created.remove(name)

    def cleanup(self) -> None:
        for name in list(self.created):
            self.delete(name)


class Interrupted(Exception):
    pass


def _raise_interrupted(signum, frame):
    raise Interrupted(f"signal {signum}")


# ====================================================================== the worker (one rank)
def _read_lo_tx() -> int | None:
    """Bytes sent through this network namespace's loopback (/proc/net/dev is per namespace)."""
    try:
        with open("/proc/net/dev") as f:
            for line in f:
                name, _, rest = line.partition(":")
                if name.strip() == "lo":
                    return int(rest.split()[8])
    except OSError:
        return None
    return None


def probe_link(repeats: int = 300) -> dict:
    """Median time of a one-element all-reduce and all-gather (the latency of a round), and of an
    8 MB all-reduce (the throughput), on this group's link."""
    import torch
    import torch.distributed as dist

    from hf_onebit.comm import allreduce_bytes

    small = torch.ones(1)
    gathered = torch.empty(dist.get_world_size())
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor

    def timed(fn, n):
        dist.barrier()
        times = []
        for _ in range(n):
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
        return statistics.median(times)

    big = torch.ones(2 * 2**20)  # 8 MiB
    out = {
        "allreduce_1elem_s": timed(lambda: dist.all_reduce(small), repeats),
        "allgather_1elem_s": timed(lambda: gather(gathered, small), repeats),
        "allreduce_8MiB_s": timed(lambda: dist.all_reduce(big), 5),
    }
    sent = allreduce_bytes(big.numel() * 4, dist.get_world_size()) * dist.get_world_size()
    out["allreduce_8MiB_link_bits_per_s"] = 8 * sent / out["allreduce_8MiB_s"]
    return out


# ====================================================================== the parent
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch_rank(cmd: list[str], env: dict, rank: int, log_path: Path) -> tuple[subprocess.Popen, object]:
    """Start one rank in a session of its own (so it can be killed with its children); rank 0
    prints to this terminal, the others to ``log_path``. Returns ``(process, log file)``."""
    log = open(log_path, "w")  # noqa: SIM115 - closed by stop_ranks
    p = subprocess.Popen(cmd, env=env, stdout=None if rank == 0 else log, stderr=subprocess.STDOUT if rank else None,
                         start_new_session=True)
    return p, log


def wait_for_ranks(started: list, rate: str, timeout: float) -> None:
    """Until every rank of ``started`` (``(process, log)`` pairs) has exited 0; a failed rank
    (its peers' logs in the message) or ``timeout`` seconds raise ``RuntimeError``."""
    deadline = time.monotonic() + timeout
    while True:
        codes = [p.poll() for p, _ in started]
        if all(c == 0 for c in codes):
            return
        if any(c not in (None, 0) for c in codes):
            logs = "".join(Path(lg.name).read_text()[-3000:] for _, lg in started[1:])
            raise RuntimeError(f"a rank failed (exit codes {codes}) at rate {rate}\n{logs}")
        if time.monotonic() > deadline:
            raise RuntimeError(f"rate {rate}: timed out after {timeout} s")
        time.sleep(0.2)


def kill_rank(p: subprocess.Popen) -> None:
    """SIGTERM to the rank's session, SIGKILL if it is still there 10 s later."""
    try:
        os.killpg(p.pid, signal.SIGTERM)  # the worker's own session (start_new_session=True)
        p.wait(timeout=10)
    except (ProcessLookupError, subprocess.TimeoutExpired):
        try:
            os.killpg(p.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def kill_running(procs: list) -> None:
    """Kill the ranks of ``procs`` (processes) that still run."""
    for p in procs:
        if p.poll() is None:
            kill_rank(p)


def stop_ranks(started: list) -> None:
    """Kill the ranks of ``started`` (``(process, log)`` pairs) that still run; close their logs."""
    kill_running([p for p, _ in started])
    for _, log in started:
        log.close()
