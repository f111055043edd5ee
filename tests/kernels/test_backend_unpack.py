"""``unpack_scaled`` of every fast backend against the reference (spec §1): the ``±t_j`` values,
written bitwise like the reference's cast into every float dtype, into any shape or layout of ``out``.
"""

from __future__ import annotations

import pytest
import torch

from hf_onebit.kernels import reference as ref
from tests.kernels.backends import (
    BIG,
    BLOCKS,
    DTYPES,
    assert_bitwise_equal,
    backends,
    dtype_id,
    make_bits,
    make_scales,
    padded_length,
    per_backend,
)

# numba: 1000-byte rows, every float dtype; Triton: small chunks at every block size.
UNPACK_CASES = per_backend(
    "chunk, n, dtype",
    cpu=[(8000, n, dtype) for n in (1, 2, 3, 4) for dtype in DTYPES + (torch.float64,)],
    triton=[(block, chunk, n, dtype) for block in BLOCKS for dtype in DTYPES for n in (1, 2, 4)
            for chunk in (0, 8, 1000)],
)


@pytest.mark.parametrize(*UNPACK_CASES)
def test_unpack_scaled_matches_reference(backend, chunk, n, dtype):
    bits = make_bits(n, chunk // 8, seed=chunk + n)
    # 1/3 and 0.1 are not representable in bf16/fp16: the cast must round like torch (RTNE).
    scales = (make_scales(n, n) / 3).to(torch.float32)
    if n > 1:
        scales[1] = 0.1
    total = n * chunk
    for numel in sorted({k for k in (0, 1, 11, chunk - 3, total - 5, total) if 0 <= k <= total}):
        out = torch.full((numel,), 7.0, dtype=dtype)
        expected = torch.full((numel,), 7.0, dtype=dtype)
        backend.unpack_scaled(bits, scales, out)
        ref.unpack_scaled(bits, scales, expected)
        assert_bitwise_equal(out, expected, f"numel={numel}")


def check_rounds_like_torch(backend, values, out_dtype):
    scales = torch.tensor(values, dtype=torch.float32)
    n = scales.numel()
    bits = torch.tensor([[0b10110010]] * n, dtype=torch.uint8)
    out = torch.empty(8 * n, dtype=out_dtype)
    backend.unpack_scaled(bits, scales, out)
    signs = torch.tensor([1, -1, 1, 1, -1, -1, 1, -1], dtype=torch.float32)
    expected = (scales.reshape(-1, 1) * signs).reshape(-1).to(out_dtype)
    assert_bitwise_equal(out, expected)


@pytest.mark.parametrize("backend", backends())
@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float16], ids=dtype_id)
def test_unpack_scaled_rounds_like_torch(backend, out_dtype):
    # Halfway cases (round to even, both directions), overflow, subnormals, ±0, inf (NaN: below).
    values = [
        1 + 2**-8, 1 + 3 * 2**-8, 1 + 2**-11, 1 + 3 * 2**-11, 1 + 2**-12 + 2**-20,
        65520.0, 1e5, 3e-8, 1e-40, 0.0, -0.0, float("inf"), 3.4e38,
    ]
    check_rounds_like_torch(backend, values, out_dtype)


@pytest.mark.parametrize(*per_backend(
    "out_dtype", cpu=[(torch.bfloat16,), (torch.float16,), (torch.float32,)],
    triton=[(64, torch.bfloat16), (64, torch.float16), (64, torch.float32)]))
def test_unpack_scaled_of_a_nan_scale_is_the_references_nan(backend, out_dtype):
    check_rounds_like_torch(backend, [1.0, float("nan"), -2.0], out_dtype)


@pytest.mark.parametrize("backend", backends())
def test_unpack_scaled_hand_computed_and_shaped_out(backend):
    bits = torch.tensor([[0b10100000], [0b01111111]], dtype=torch.uint8)
    scales = torch.tensor([2.0, 0.25])
    out = torch.zeros(2, 5, dtype=torch.float16)  # 10 of the 16 elements, any shape
    backend.unpack_scaled(bits, scales, out)
    expected = [[2, -2, 2, -2, -2], [-2, -2, -2, -0.25, 0.25]]
    assert out.tolist() == expected


@pytest.mark.parametrize("backend", backends())
def test_unpack_scaled_into_a_view_writes_through(backend):
    bits = torch.tensor([[0xF0], [0x0F]], dtype=torch.uint8)
    big = torch.zeros(20)
    backend.unpack_scaled(bits, torch.tensor([1.0, 2.0]), big[2:18])
    assert big[:2].tolist() == [0, 0] and big[18:].tolist() == [0, 0]
    assert big[2:18].tolist() == [1, 1, 1, 1, -1, -1, -1, -1, -2, -2, -2, -2, 2, 2, 2, 2]


@pytest.mark.parametrize("backend", backends())
def test_unpack_scaled_into_a_strided_out(backend):
    bits = torch.randint(0, 256, (2, 10), dtype=torch.uint8, generator=torch.Generator().manual_seed(6))
    scales = torch.tensor([0.5, 3.0])
    big = torch.zeros(20, 8)
    backend.unpack_scaled(bits, scales, big[:, 1])  # a strided column: must be written through
    expected = torch.empty(20)
    ref.unpack_scaled(bits, scales, expected)
    assert_bitwise_equal(big[:, 1].contiguous(), expected)
    big[:, 1] = 0
    assert big.abs().max() == 0  # nothing outside the column was touched


@pytest.mark.parametrize("backend", backends())
def test_unpack_scaled_into_non_contiguous_out(backend):
    bits = make_bits(2, 3, seed=11)
    scales = torch.tensor([0.3, 1.7])
    out = torch.zeros(6, 8, dtype=torch.bfloat16).t()  # shape (8, 6), not contiguous
    expected = torch.empty(48, dtype=torch.bfloat16)
    ref.unpack_scaled(bits, scales, expected)
    backend.unpack_scaled(bits, scales, out)
    assert_bitwise_equal(out.reshape(-1), expected)


@pytest.mark.parametrize("backend", backends(triton_blocks=(4096,)))
def test_unpack_scaled_big(backend):
    n, chunk = 4, padded_length(BIG, 4) // 4
    bits = make_bits(n, chunk // 8, seed=12)
    scales = make_scales(n, 12)
    out_ref = torch.empty(BIG, dtype=torch.bfloat16)
    out_got = torch.empty(BIG, dtype=torch.bfloat16)
    ref.unpack_scaled(bits, scales, out_ref)
    backend.unpack_scaled(bits, scales, out_got)
    assert_bitwise_equal(out_got, out_ref)


@pytest.mark.parametrize("backend", backends(triton_blocks=(4096,)))
def test_all_256_byte_patterns_round_trip(backend):
    # Unpack every byte value, pack the result again: exercises both directions of the bit
    # order (for numba, both multiply tricks fully).
    bits = torch.arange(256, dtype=torch.int32).to(torch.uint8).reshape(1, 256)
    signs = torch.empty(2048)
    backend.unpack_scaled(bits, torch.ones(1), signs)
    assert_bitwise_equal(signs, ref.unpack_signs(bits).reshape(-1))
    packed = torch.empty(256, dtype=torch.uint8)
    backend.worker_pack(signs, torch.zeros(2048), torch.ones(1), 0, packed)
    assert_bitwise_equal(packed, bits.reshape(-1))
    z = torch.zeros(2048)  # server side: n = 1 row, zero error, so z = the signs
    backend.server_pack(bits, torch.ones(1), z, torch.tensor(1.0), packed)
    assert_bitwise_equal(packed, bits.reshape(-1))
