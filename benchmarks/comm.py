"""Wire volume and time of the compressed all-reduce against an fp32 all-reduce (gloo, loopback).

    python benchmarks/comm.py [--numel 4194304] [--world-sizes 2 4] [--repeats 5]

For each world size it starts that many gloo processes on this machine and, side by side in
the same processes, times ``dist.all_reduce`` of an fp32 buffer and hf_onebit's compressed
all-reduce of the same buffer, and reads the bytes each sent from the counters (see
``hf_onebit/comm/stats.py`` for the accounting). Loopback is fast, so the time column shows the
compute overhead of compression rather than a network gain: see benchmarks/network.py (to come)
for rate-limited links.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.distributed as dist


def _bench(rank, world_size, numel, repeats):
    from hf_onebit.comm import CompressedAllReduce, allreduce_bytes

    x = torch.randn(numel)
    buf = torch.empty_like(x)
    state = CompressedAllReduce(numel)
    t_fp32, t_1bit = [], []
    for _ in range(repeats + 1):  # first round warms up (numba JIT, gloo connections)
        buf.copy_(x)
        dist.barrier()
        t0 = time.perf_counter()
        dist.all_reduce(buf)
        t_fp32.append(time.perf_counter() - t0)
        buf.copy_(x)
        dist.barrier()
        t0 = time.perf_counter()
        state(buf)
        t_1bit.append(time.perf_counter() - t0)
    rec = state.bytes_per_call()
    return {
        "fp32_ms": statistics.median(t_fp32[1:]) * 1e3,
        "onebit_ms": statistics.median(t_1bit[1:]) * 1e3,
        "fp32_bytes": allreduce_bytes(4 * numel, world_size),
        "onebit_bytes": rec.bytes_sent,
        "rounds": rec.rounds,
    }


def main() -> None:
    import os
    import sys

    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    from tests.distributed import run_distributed

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--numel", type=int, default=4 * 2**20)
    parser.add_argument("--world-sizes", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    print(f"buffer: {args.numel:,} fp32 elements; gloo over loopback; {os.cpu_count()} cores")
    print(f"{'n':>3} {'fp32 B/elem':>12} {'1-bit B/elem':>13} {'fewer bytes':>12} {'rounds':>7}"
          f" {'fp32 ms':>9} {'1-bit ms':>9} {'time ratio':>11}")
    for n in args.world_sizes:
        r = run_distributed(_bench, n, args.numel, args.repeats, timeout=600)[0]
        print(f"{n:>3} {r['fp32_bytes'] / args.numel:>12.4f} {r['onebit_bytes'] / args.numel:>13.4f}"
              f" {r['fp32_bytes'] / r['onebit_bytes']:>11.1f}x {r['rounds']:>7}"
              f" {r['fp32_ms']:>9.1f} {r['onebit_ms']:>9.1f} {r['onebit_ms'] / r['fp32_ms']:>10.2f}x")


if __name__ == "__main__":
    main()
