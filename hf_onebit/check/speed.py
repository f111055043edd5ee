"""The self-check's parts that each rank runs alone: the kernels against the reference, and their speed."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from hf_onebit.check import Report

DTYPES = (torch.float32, torch.bfloat16, torch.float16)


# ---------------------------------------------------------------------------------- 1. kernels
def check_kernels(device: torch.device, report: Report) -> None:
    from hf_onebit.kernels.selftest import self_test

    names = []
    try:
        for dtype in DTYPES:
            names.append(self_test(device, dtype))
    except Exception as exc:  # noqa: BLE001 - reported
        report.line("kernels", "FAIL", str(exc), where=str(device))
        return
    report.line("kernels", "ok", f"{names[0]} kernels on {device}: bit for bit against the reference"
                                 " (fp32, bf16, fp16 buckets; one scale per chunk and per piece)", where=str(device))


# ---------------------------------------------------------------------------------- 2. speed
#: bytes each timed operation moves per element of an fp32 buffer of ``n`` elements whose error
#: buffer holds ``L >= n`` (padded to whole chunks): its byte floor, reads plus writes. The
#: scalars (a scale, partial sums) are negligible next to these.
def speed_bytes(n: int, padded: int) -> dict:
    return {
        "copy_": 8 * n,  # reads x, writes the copy
        "worker_scale": 4 * n + 4 * padded,  # reads x and the error (a sum of squares)
        "worker_pack": 4 * n + 8 * padded + padded // 8,  # reads x and the error; writes the error and 1 bit
        "unpack_scaled": padded // 8 + 4 * n,  # reads 1 bit; writes the fp32 result
    }


#: On a GPU every kernel must reach this share of ``copy_``'s bandwidth, each counting its own
#: bytes (:func:`speed_bytes`). Correct kernels are memory-bound like the copy, so their shares
#: sit well above it (``benchmarks/gpu_costs.py`` measures them); a kernel a few times slower than
#: it should be falls below, and the margin leaves room for other GPUs and timing noise. A goal
#: on times (compress <= 2x a copy_) cannot hold: the two compress kernels move 20.125 bytes per
#: element, a copy_ 8, so their floor is already 2.5x.
SPEED_GOAL = 0.40
#: the smallest buffer on which the goal is judged: large enough for a copy_ to be bandwidth-bound
#: on current GPUs. On smaller buffers the kernels' fixed cost per launch (tens of microseconds)
#: is a large share of their time, so their share of the copy's bandwidth would measure launch
#: overhead, not the kernels.
GOAL_MIN_SIZE = 1 << 26


def _median_time(fn, device: torch.device, repeats: int) -> float:
    """Seconds per call of ``fn``, the median of ``repeats`` (after ``repeats + 1`` untimed calls:
    the first compiles).

    On CUDA timed with events on the stream, so the kernels' own time and any launch gap
    between them is counted, not the host's return."""
    import statistics

    fn()
    for _ in range(repeats):  # and warms the GPU's clocks: the first timings after idle run slow
        fn()
    if device.type != "cuda":
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            fn()
            times.append(time.perf_counter() - start)
        return statistics.median(times)
    torch.cuda.synchronize(device)
    pairs = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(repeats)]
    for start, stop in pairs:
        start.record()
        fn()
        stop.record()
    torch.cuda.synchronize(device)
    return statistics.median(start.elapsed_time(stop) for start, stop in pairs) / 1e3


def judge_speed(seconds: dict, n: int, padded: int, device_type: str) -> tuple[str, str, dict]:
    """``(status, detail, shares)`` from the median seconds of :func:`speed_bytes`'s operations.

    ``shares``: each kernel's bandwidth (its own bytes per second) over ``copy_``'s. The goal
    (:data:`SPEED_GOAL`) is judged on a GPU and on buffers of :data:`GOAL_MIN_SIZE` elements or
    more; elsewhere the figures are printed and the status is ``skip``."""
    moved = speed_bytes(n, padded)
    bandwidth = {k: moved[k] / seconds[k] for k in moved}
    shares = {k: bandwidth[k] / bandwidth["copy_"] for k in moved if k != "copy_"}
    compress = (seconds["worker_scale"] + seconds["worker_pack"]) / seconds["copy_"]
    floor = (moved["worker_scale"] + moved["worker_pack"]) / moved["copy_"]
    size = f"{n / 2**20:g}M" if n >= 2**20 else str(n)
    if device_type != "cuda":  # a CPU copy_ of a small buffer can wait on idle threads: no ratio means much
        return "ok", (f"{size} fp32: " + ", ".join(f"{k} {1e3 * seconds[k]:.3f} ms ({bandwidth[k] / 1e9:.0f} GB/s)"
                                                  for k in moved)
                      + " (no goal on CPU: numba against a memory-bound copy_)"), shares
    detail = (f"{size} fp32: copy_ {1e3 * seconds['copy_']:.3f} ms ({bandwidth['copy_'] / 1e9:.0f} GB/s); "
              + ", ".join(f"{k} {1e3 * seconds[k]:.3f} ms ({bandwidth[k] / 1e9:.0f} GB/s, {100 * v:.0f}% of copy_'s)"
                          for k, v in shares.items())
              + f"; compress takes {compress:.2f}x a copy_ (its byte floor: {floor:.2f}x)")
    if n < GOAL_MIN_SIZE:
        return "skip", detail + f" (goal judged only at --size >= {GOAL_MIN_SIZE}: below, fixed costs dominate)", shares
    slow = [k for k, v in shares.items() if v < SPEED_GOAL]
    goal = f" (goal: each >= {100 * SPEED_GOAL:.0f}%)"
    return ("FAIL", detail + goal + ": too slow: " + ", ".join(slow), shares) if slow else ("ok", detail + goal, shares)


def check_speed(device: torch.device, size: int, report: Report, repeats: int = 20) -> dict:
    """Time compress (worker scale + pack) and decompress (unpack) of one ``size`` fp32 buffer
    against a ``copy_`` of it, and judge them by their byte floors (:func:`judge_speed`)."""
    from hf_onebit.kernels import get_backend

    kernels = get_backend(device)
    x = torch.randn(size, device=device)
    padded = -(-size // 64) * 64
    error = torch.zeros(padded, device=device)
    bits = torch.empty(padded // 8, dtype=torch.uint8, device=device)
    out = torch.empty(size, device=device)
    dst = torch.empty_like(x)
    scale = kernels.worker_scale(x, error).reshape(1)
    one = torch.ones(1, device=device)
    operations = {
        "copy_": lambda: dst.copy_(x),
        "worker_scale": lambda: kernels.worker_scale(x, error),
        # the error buffer is updated in place; its values do not change the work
        "worker_pack": lambda: kernels.worker_pack(x, error, scale, 0, bits),
        "unpack_scaled": lambda: kernels.unpack_scaled(bits.reshape(1, -1), one, out),
    }
    seconds = {k: _median_time(fn, device, repeats if device.type == "cuda" else 5) for k, fn in operations.items()}
    # what `--json` writes, and `hf-onebit estimate --kernels-from` reads (milliseconds per call)
    report.kernels = [{"dtype": "float32", "op": k, "numel": size, "ms": 1e3 * v} for k, v in seconds.items()]
    status, detail, shares = judge_speed(seconds, size, padded, device.type)
    report.line("speed", status, detail, where=str(device))
    return shares
