"""benchmarks/kernels.py: every row it times runs on both CPU backends (small buffers, no timing)."""

from __future__ import annotations

import pytest
import torch

from tests.benchmark_scripts import load_benchmark


@pytest.fixture(scope="module")
def bench():
    return load_benchmark("kernels")


@pytest.mark.parametrize("backend", ["cpu", "reference"])
def test_every_row_runs(bench, backend):
    from hf_onebit import kernels

    mod = getattr(kernels, backend)
    ops = bench.backend_ops(mod, 2 * 8 * 64, 2, [torch.float32], pieces=5, widths=(8, 4))
    assert "compress float32 8-bit [5 pieces]" in ops and "server 4-bit [5 pieces]" in ops
    for fn in ops.values():
        fn()
    results = bench.time_interleaved(ops, repeats=1)
    assert set(results) == set(ops) and all(ms >= 0 for ms in results.values())
