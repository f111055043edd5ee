"""Step time against the number of parameter tensors: is anything quadratic in it?

    python benchmarks/many_tensors.py [--counts 1000 2000 4000 8000] [--size 64]

Two gloo ranks train a model of COUNT tensors of SIZE elements with 1-bit Adam (in its
compression phase) and, side by side in the same processes, with DDP + AdamW. It prints the
median step time and the time per tensor; linear cost keeps "µs/tensor" flat as COUNT grows.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch
from torch.nn.parallel import DistributedDataParallel as DDP

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


class ManyTensors(torch.nn.Module):
    def __init__(self, count: int, size: int) -> None:
        super().__init__()
        self.ps = torch.nn.ParameterList([torch.nn.Parameter(torch.randn(size)) for _ in range(count)])

    def forward(self, coeffs: torch.Tensor) -> torch.Tensor:
        return (torch.stack(list(self.ps)) * coeffs).sum()


def _time_steps(rank, world_size, count, size, repeats):
    import hf_onebit

    results = {}
    for name in ("AdamW", "OneBitAdam"):
        torch.manual_seed(0)
        model = ManyTensors(count, size)
        if name == "AdamW":
            opt = torch.optim.AdamW(model.parameters(), foreach=False)
            ddp = DDP(model)
        else:
            opt = hf_onebit.OneBitAdam(model.parameters(), freeze_step=2)
            ddp = DDP(model)
            hf_onebit.attach(ddp, opt)
        coeffs = torch.randn(count, size)

        times = []
        for step in range(repeats + 4):  # the first steps: warmup, bucket rebuild, JIT
            start = time.perf_counter()
            ddp(coeffs).backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            times.append(time.perf_counter() - start)
        results[name] = statistics.median(times[4:])
    return results


def main() -> None:
    from tests.distributed import run_distributed

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--counts", type=int, nargs="+", default=[1000, 2000, 4000, 8000])
    parser.add_argument("--size", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args()
    print(f"2 gloo ranks, tensors of {args.size} elements; median step time (ms) and µs per tensor")
    print(f"{'tensors':>8} {'AdamW ms':>9} {'µs/tensor':>10} {'1-bit ms':>9} {'µs/tensor':>10}")
    for count in args.counts:
        r = run_distributed(_time_steps, 2, count, args.size, args.repeats, timeout=900)[0]
        print(f"{count:>8} {r['AdamW'] * 1e3:>9.1f} {r['AdamW'] * 1e6 / count:>10.1f}"
              f" {r['OneBitAdam'] * 1e3:>9.1f} {r['OneBitAdam'] * 1e6 / count:>10.1f}")


if __name__ == "__main__":
    main()
