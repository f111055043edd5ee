"""Benchmark the CPU compression kernels against a plain memory copy, on one thread.

    python benchmarks/kernels.py [--numel 67108864] [--world-size 2] [--repeats 7]
                                 [--reference-numel N] [--skip-reference] [--pieces 100]

The yardstick is ``y.copy_(x)`` into a preallocated fp32 buffer of ``numel`` elements, timed in
the same run and interleaved with the kernels (absolute times depend on the machine's memory
bandwidth and on whatever else is running; the ratios are what to compare).

Rows (medians over ``--repeats``):
  compress <dtype>    worker_scale + worker_pack of the whole buffer, x in that dtype
  decompress -> <dt>  unpack_scaled of n chunks into a numel-element buffer of that dtype
  server              server_scale + server_pack of one chunk (numel / n elements, n bit rows)
  ... [P pieces]      the same with one scale per piece (``bounds=``): P = 1 (the whole
                      buffer as one piece) and P = --pieces pieces of random sizes
  ... b-bit [P pieces] the b-bit exchange's kernels (the warmup's, spec §1b) at ``--widths``
                      bits, one scale per piece: compress (qworker_scale + qworker_pack),
                      decompress (qunpack_scaled), server (qserver_scale + qserver_pack)

Compression must move about 2.5x the bytes of the copy (pass 1 reads x and error, pass 2 reads
them again and writes error and bits); since the copy also pays a read-for-ownership of its
destination, a ratio of about 2 already means memory speed. The target is <= 3.

The reference backend allocates fp32 temporaries and is much slower, so it runs on a smaller
buffer (``--reference-numel``, default numel / 8) with its own yardstick, followed by the cpu
backend at that same size for a side-by-side comparison. At that size the buffers may fit
in the last-level cache, which flatters the copy more than the kernels.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch

from hf_onebit.kernels import cpu, reference
from hf_onebit.kernels.contract import Bounds


def time_interleaved(ops: dict[str, Callable[[], object]], repeats: int) -> dict[str, float]:
    """Median ms of each op. Every repeat runs all ops once, in turn, so a noisy neighbour
    (another process on the machine) slows the yardstick and the kernels alike."""
    for fn in ops.values():
        fn()  # warm-up: JIT compile / load from cache, fault pages in
    times: dict[str, list[float]] = {name: [] for name in ops}
    for _ in range(repeats):
        for name, fn in ops.items():
            start = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - start)
    return {name: statistics.median(t) * 1e3 for name, t in times.items()}


def random_bounds(length: int, pieces: int, seed: int = 0) -> list[int]:
    """``pieces`` pieces of random sizes (multiples of 8) covering ``length`` elements."""
    gen = torch.Generator().manual_seed(seed)
    cuts = sorted(set((torch.randint(1, length // 8, (pieces - 1,), generator=gen) * 8).tolist()))
    return [0] + cuts + [length]


def piece_ops(mod, numel: int, n: int, pieces: int) -> dict[str, Callable[[], object]]:
    """compress / server / decompress fp32 with one scale per piece (``bounds=``)."""
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(numel, generator=gen)
    y = torch.empty(numel)
    error = torch.randn(numel, generator=gen) * 0.1
    bits = torch.empty(numel // 8, dtype=torch.uint8)
    bounds = [0, numel] if pieces == 1 else random_bounds(numel, pieces)
    chunk = numel // n
    cuts = sorted(set(bounds) | {j * chunk for j in range(n + 1)})
    local = [b for b in cuts if b <= chunk]  # the pieces of chunk 0
    bounds, cuts, local = Bounds(bounds), Bounds(cuts), Bounds(local)  # as the exchange passes them: checked once
    P = len(bounds) - 1
    scales = torch.ones(n, P)
    rows = torch.randint(0, 256, (n, chunk // 8), dtype=torch.uint8, generator=gen)
    server_error = torch.randn(chunk, generator=gen) * 0.1
    server_bits = torch.empty(chunk // 8, dtype=torch.uint8)
    server_scales = torch.ones(n, len(local) - 1)
    out_scales = torch.ones(len(cuts) - 1)

    def compress():
        scales[0] = mod.worker_scale(x, error, bounds=bounds)
        mod.worker_pack(x, error, scales, 0, bits, bounds=bounds)

    def server():
        t = mod.server_scale(rows, server_scales, server_error, bounds=local)
        mod.server_pack(rows, server_scales, server_error, t, server_bits, bounds=local)

    label = f"[{P} piece{'s' if P > 1 else ''}]"
    return {
        f"compress float32 {label}": compress,
        f"decompress -> float32 {label}": lambda: mod.unpack_scaled(rows, out_scales, y, bounds=cuts),
        f"server {label}": server,
    }


def quantized_ops(mod, numel: int, n: int, width: int, pieces: int) -> dict[str, Callable[[], object]]:
    """The b-bit exchange's kernels (spec §1b: the warmup's) at ``width`` bits, fp32, one scale
    per piece over ``pieces`` random pieces (the library's default: one scale per tensor)."""
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(numel, generator=gen)
    y = torch.empty(numel)
    error = torch.randn(numel, generator=gen) * 0.1
    codes = torch.empty(numel * width // 8, dtype=torch.uint8)
    bounds = random_bounds(numel, pieces)
    chunk = numel // n
    cuts = sorted(set(bounds) | {j * chunk for j in range(n + 1)})
    local = [b for b in cuts if b <= chunk]  # the pieces of chunk 0
    bounds, cuts, local = Bounds(bounds), Bounds(cuts), Bounds(local)  # as the exchange passes them: checked once
    scales = torch.ones(n, len(bounds) - 1)
    rows = torch.randint(0, 2**width, (n, chunk * width // 8), dtype=torch.uint8, generator=gen)
    server_error = torch.randn(chunk, generator=gen) * 0.1
    server_codes = torch.empty(chunk * width // 8, dtype=torch.uint8)
    server_scales = torch.full((n, len(local) - 1), 1e-3)
    out_scales = torch.full((len(cuts) - 1,), 1e-3)

    def compress():
        scales[0] = mod.qworker_scale(x, error, width=width, bounds=bounds)
        mod.qworker_pack(x, error, scales, 0, codes, width=width, bounds=bounds)

    def server():
        t = mod.qserver_scale(rows, server_scales, server_error, width=width, bounds=local)
        mod.qserver_pack(rows, server_scales, server_error, t, server_codes, width=width, bounds=local)

    label = f"{width}-bit [{len(bounds) - 1} pieces]"
    return {
        f"compress float32 {label}": compress,
        f"decompress -> float32 {label}": lambda: mod.qunpack_scaled(rows, out_scales, y, width=width, bounds=cuts),
        f"server {label}": server,
    }


def backend_ops(mod, numel: int, n: int, dtypes: list[torch.dtype], pieces: int = 0,
                widths: tuple[int, ...] = ()) -> dict[str, Callable[[], object]]:
    """The timed operations for a buffer of ``numel`` elements (a multiple of 8·n)."""
    gen = torch.Generator().manual_seed(0)
    x32 = torch.randn(numel, generator=gen)
    y = torch.empty(numel)
    error = torch.randn(numel, generator=gen) * 0.1
    bits = torch.empty(numel // 8, dtype=torch.uint8)
    scales = torch.ones(n)
    chunk = numel // n
    rows = torch.randint(0, 256, (n, chunk // 8), dtype=torch.uint8, generator=gen)
    server_error = torch.randn(chunk, generator=gen) * 0.1
    server_bits = torch.empty(chunk // 8, dtype=torch.uint8)

    def compress(x):
        def run():
            scales[0] = mod.worker_scale(x, error)
            mod.worker_pack(x, error, scales, 0, bits)

        return run

    def server():
        t = mod.server_scale(rows, scales, server_error)
        mod.server_pack(rows, scales, server_error, t, server_bits)

    ops: dict[str, Callable[[], object]] = {"copy_ fp32 (yardstick)": lambda: y.copy_(x32)}
    for dtype in dtypes:
        name = str(dtype).replace("torch.", "")
        ops[f"compress {name}"] = compress(x32 if dtype == torch.float32 else x32.to(dtype))
    for dtype in dtypes:
        name = str(dtype).replace("torch.", "")
        out = y if dtype == torch.float32 else torch.empty(numel, dtype=dtype)
        ops[f"decompress -> {name}"] = lambda out=out: mod.unpack_scaled(rows, scales, out)
    ops[f"server (chunk {chunk:,})"] = server
    if pieces:
        ops.update(piece_ops(mod, numel, n, 1))
        ops.update(piece_ops(mod, numel, n, pieces))
        for width in widths:
            ops.update(quantized_ops(mod, numel, n, width, pieces))
    return ops


def print_table(title: str, results: dict[str, float]) -> None:
    copy_ms = next(iter(results.values()))
    print(title)
    print(f"  {'operation':<36} {'ms':>9} {'x copy_':>8}")
    for name, ms in results.items():
        print(f"  {name:<36} {ms:>9.2f} {ms / copy_ms:>8.2f}")
    print()


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--numel", type=int, default=64 * 2**20, help="elements per buffer (default 64M)")
    parser.add_argument("--world-size", type=int, default=2, help="n: rows of bits in the server ops")
    parser.add_argument("--repeats", type=int, default=7, help="timed repeats per row (median reported)")
    parser.add_argument(
        "--reference-numel", type=int, default=None, help="buffer size for the reference (default numel/8)"
    )
    parser.add_argument("--skip-reference", action="store_true")
    parser.add_argument("--pieces", type=int, default=100, help="pieces for the one-scale-per-piece rows (0: none)")
    parser.add_argument("--widths", type=int, nargs="*", default=[8, 4],
                        help="bit widths of the b-bit exchange's rows (with --pieces; none: no such rows)")
    args = parser.parse_args()

    torch.set_num_threads(1)  # the kernels are single-threaded; so must the yardstick be
    n = args.world_size
    align = 8 * n
    numel = args.numel // align * align
    print(f"torch {torch.__version__}, threads={torch.get_num_threads()}, n={n}, repeats={args.repeats}\n")

    results = time_interleaved(backend_ops(cpu, numel, n, [torch.float32, torch.bfloat16], args.pieces, tuple(args.widths)),
                               args.repeats)
    print_table(f"cpu backend, numel={numel:,}", results)

    if not args.skip_reference:
        ref_numel = args.reference_numel or max(numel // 8, align)
        ref_numel = ref_numel // align * align
        note = "" if ref_numel == numel else " (smaller buffer: the reference is slow)"
        repeats = max(3, args.repeats // 2)
        results = time_interleaved(backend_ops(reference, ref_numel, n, [torch.float32]), repeats)
        print_table(f"reference backend, numel={ref_numel:,}{note}", results)
        if ref_numel != numel:
            results = time_interleaved(backend_ops(cpu, ref_numel, n, [torch.float32]), args.repeats)
            print_table(f"cpu backend at the reference's size, numel={ref_numel:,}", results)


if __name__ == "__main__":
    main()
