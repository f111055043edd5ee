"""Buffers past 2^31 elements (2^31 bits once packed): no 32-bit index overflow anywhere.

Needs about 13 GiB of memory and a minute; marked ``slow`` (run with ``pytest -m slow``) and
skipped when the machine has less memory available.
"""

from __future__ import annotations

import pytest
import torch

N = 2**31 + 40  # elements; the packed signs then span 2^28 + 5 bytes


def _available_gib() -> float:
    try:
        with open("/proc/meminfo") as f:
            info = dict(line.split(":", 1) for line in f)
        return int(info["MemAvailable"].split()[0]) / 2**20
    except (OSError, KeyError, ValueError):
        return 0.0


@pytest.mark.slow
@pytest.mark.skipif(_available_gib() < 16, reason="needs ~13 GiB of free memory")
def test_cpu_kernels_past_2_to_the_31_elements():
    from hf_onebit.kernels import cpu

    L = N + 24  # a multiple of 8·n for n = 4
    x = torch.ones(N, dtype=torch.bfloat16)
    x[-40:] = -2.0  # the last 40 elements are negative: their bits sit past bit 2^31
    error = torch.zeros(L, dtype=torch.float32)
    s = cpu.worker_scale(x, error)
    expected = ((N - 40) * 1.0 + 40 * 4.0) / L
    assert abs(float(s) ** 2 - expected) / expected < 1e-6
    bits = torch.empty(L // 8, dtype=torch.uint8)
    cpu.worker_pack(x, error, s.reshape(1), 0, bits)
    # byte k holds elements 8k..8k+7; elements N-40..N-1 are negative (bit 0), padding is +1
    first_negative_byte = (N - 40) // 8
    assert int(bits[first_negative_byte - 1]) == 0xFF
    assert all(int(b) == 0 for b in bits[first_negative_byte : N // 8])
    assert all(int(b) == 0xFF for b in bits[N // 8 :])
    # error = y - s·sign(y), checked at both ends of the buffer
    sv = float(s)
    assert abs(float(error[0]) - (1.0 - sv)) < 1e-6
    assert abs(float(error[N - 1]) - (-2.0 + sv)) < 1e-6
    assert abs(float(error[L - 1]) - (0.0 - sv)) < 1e-6
    del error, x
    out = torch.empty(N, dtype=torch.bfloat16)
    cpu.unpack_scaled(bits.view(1, -1), torch.tensor([2.0]), out)
    assert float(out[0]) == 2.0 and float(out[N - 1]) == -2.0 and float(out[N - 41]) == 2.0
