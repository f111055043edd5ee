"""The numba CPU backend must compute what the reference computes (spec §1).

Bits, error buffers and unpacked outputs are compared bitwise; scales (float64 sums of squares
accumulated in a different order) to 1e-6 relative.
"""

from __future__ import annotations

import pytest
import torch

from hf_onebit.kernels import cpu, get_backend
from hf_onebit.kernels import reference as ref

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
WORLD_SIZES = [1, 2, 4]
LENGTHS = [0, 1, 7, 8, 9, 1000, 2**20 + 3]


def padded_length(numel: int, n: int) -> int:
    align = 8 * n
    return -(-numel // align) * align


def assert_bitwise_equal(actual: torch.Tensor, expected: torch.Tensor) -> None:
    """Equal bytes (so NaN payloads and the sign of zero count too)."""
    assert actual.dtype == expected.dtype and actual.shape == expected.shape
    a = actual.contiguous().reshape(-1).view(torch.uint8)
    e = expected.contiguous().reshape(-1).view(torch.uint8)
    if not torch.equal(a, e):
        bad = (a != e).nonzero()[:5].reshape(-1).tolist()
        raise AssertionError(f"{(a != e).sum().item()} bytes differ, first at byte offsets {bad}")


def assert_scale_close(actual: torch.Tensor, expected: torch.Tensor) -> None:
    assert actual.dtype == torch.float32 and actual.dim() == 0
    torch.testing.assert_close(actual, expected, rtol=1e-6, atol=0.0)


def test_backend_selection():
    assert get_backend("cpu") is cpu
    assert set(ref.__all__) <= set(cpu.__all__)


# ------------------------------------------------------------------------------------------
# Worker operations
# ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("n", WORLD_SIZES)
@pytest.mark.parametrize("numel", LENGTHS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_worker_ops_match_reference_over_20_steps(dtype, numel, n):
    gen = torch.Generator().manual_seed(numel * 10 + n)
    length = padded_length(numel, n)
    rank = n - 1
    err_cpu = torch.zeros(length)
    err_ref = torch.zeros(length)
    bits_cpu = torch.full((length // 8,), 0xAA, dtype=torch.uint8)
    bits_ref = torch.empty(length // 8, dtype=torch.uint8)
    others = torch.rand(n, generator=gen) + 0.5  # the other ranks' scales
    # 20 steps of error feedback; the 1M-element buffer (there for the block boundaries) gets
    # fewer because the reference's allocations make it the slowest part of this file.
    steps = 20 if numel < 2**20 else 8
    for step in range(steps):
        x = (torch.randn(numel, generator=gen) * (1 + step)).to(dtype)
        s_cpu = cpu.worker_scale(x, err_cpu)
        s_ref = ref.worker_scale(x, err_ref)
        assert_scale_close(s_cpu, s_ref)
        if length:
            assert s_ref > 0
        # Both packs get the same scales, so a one-ulp difference in a scale cannot flip a
        # bit several steps later; each backend keeps feeding its own error back in.
        scales = others.clone()
        scales[rank] = s_ref
        cpu.worker_pack(x, err_cpu, scales, rank, bits_cpu)
        ref.worker_pack(x, err_ref, scales, rank, bits_ref)
        assert_bitwise_equal(bits_cpu, bits_ref)
        assert_bitwise_equal(err_cpu, err_ref)
    if numel > 8:  # the error feedback actually did something
        assert err_cpu.abs().max() > 0


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_every_16_bit_input_pattern_is_decoded_exactly(dtype):
    # With scale 0 the new error is y - (±0) = y = fp32(x) + 0: the decoded input, bitwise.
    x = torch.arange(-(2**15), 2**15, dtype=torch.int32).to(torch.int16).view(dtype)
    error = torch.zeros(x.numel())
    bits = torch.empty(x.numel() // 8, dtype=torch.uint8)
    bits_ref = torch.empty_like(bits)
    cpu.worker_pack(x, error, torch.zeros(1), 0, bits)
    ref.worker_pack(x, torch.zeros(x.numel()), torch.zeros(1), 0, bits_ref)
    assert_bitwise_equal(error, x.float() + 0.0)
    assert_bitwise_equal(bits, bits_ref)


def test_worker_inputs_of_other_layouts_and_dtypes():
    gen = torch.Generator().manual_seed(1)
    base = torch.randn(2 * 1000 + 1, generator=gen, dtype=torch.float64)
    for x in (base[::2], base[:1000].reshape(10, 100)):  # strided, 2-D; float64
        error = torch.randn(1008, generator=gen)
        e_ref = error.clone()
        assert_scale_close(cpu.worker_scale(x, error), ref.worker_scale(x, e_ref))
        bits, bits_ref = torch.empty(126, dtype=torch.uint8), torch.empty(126, dtype=torch.uint8)
        scales = torch.tensor([0.7])
        cpu.worker_pack(x, error, scales, 0, bits)
        ref.worker_pack(x, e_ref, scales, 0, bits_ref)
        assert_bitwise_equal(bits, bits_ref)
        assert_bitwise_equal(error, e_ref)


def test_sign_conventions():
    # zero -> bit 1 (+1), -0.0 -> bit 1, negative -> 0, NaN -> 0; MSB first.
    x = torch.tensor([0.0, -0.0, -1.0, float("nan"), 2.0, -3.0, 1e-30, -1e-30])
    bits = torch.empty(1, dtype=torch.uint8)
    cpu.worker_pack(x, torch.zeros(8), torch.ones(1), 0, bits)
    assert bits.item() == 0b11001010


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_nan_in_x_leaves_error_untouched(dtype):
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(1000, generator=gen)
    x[123] = float("nan")
    x = x.to(dtype)
    error = torch.randn(1008, generator=gen)
    before = error.clone()
    s = cpu.worker_scale(x, error)
    assert torch.isnan(s) and torch.isnan(ref.worker_scale(x, before.clone()))
    bits = torch.empty(126, dtype=torch.uint8)
    bits_ref = torch.empty(126, dtype=torch.uint8)
    scales = torch.stack([torch.tensor(1.0), s])
    cpu.worker_pack(x, error, scales, 1, bits)
    ref.worker_pack(x, before.clone(), scales, 1, bits_ref)
    assert_bitwise_equal(error, before)
    assert_bitwise_equal(bits, bits_ref)  # the bits are still written (the NaN gives 0)


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_non_finite_scale_of_another_rank_leaves_error_untouched(bad):
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(64, generator=gen)
    error = torch.randn(64, generator=gen)
    before = error.clone()
    bits = torch.empty(8, dtype=torch.uint8)
    bits_ref = torch.empty(8, dtype=torch.uint8)
    scales = torch.tensor([0.5, bad, 0.25])
    cpu.worker_pack(x, error, scales, 0, bits)
    ref.worker_pack(x, before.clone(), scales, 0, bits_ref)
    assert_bitwise_equal(error, before)
    assert_bitwise_equal(bits, bits_ref)
    # ... and with all scales finite the same call does update it
    cpu.worker_pack(x, error, torch.tensor([0.5, 1.0, 0.25]), 0, bits)
    assert not torch.equal(error, before)


def test_empty_buffer():
    error = torch.zeros(0)
    bits = torch.empty(0, dtype=torch.uint8)
    s = cpu.worker_scale(torch.zeros(0), error)
    assert s.dtype == torch.float32 and s.dim() == 0 and s.item() == 0.0
    cpu.worker_pack(torch.zeros(0), error, torch.zeros(1), 0, bits)
    rows = torch.empty(2, 0, dtype=torch.uint8)
    assert cpu.server_scale(rows, torch.ones(2), torch.zeros(0)).item() == 0.0
    cpu.server_pack(rows, torch.ones(2), torch.zeros(0), torch.tensor(1.0), bits)
    assert cpu.server_average(rows, torch.ones(2)).numel() == 0
    cpu.unpack_scaled(rows, torch.ones(2), torch.empty(0))


def test_bad_arguments_are_refused():
    x = torch.randn(16)
    with pytest.raises(TypeError):
        cpu.worker_scale(x, torch.zeros(16, dtype=torch.float64))
    with pytest.raises(ValueError):
        cpu.worker_pack(x, torch.zeros(32)[::2], torch.ones(1), 0, torch.empty(2, dtype=torch.uint8))
    with pytest.raises(ValueError):
        cpu.worker_pack(x, torch.zeros(16), torch.ones(1), 0, torch.empty(3, dtype=torch.uint8))
    with pytest.raises(ValueError):
        cpu.worker_scale(torch.randn(17), torch.zeros(16))
    with pytest.raises(ValueError):
        cpu.server_scale(torch.zeros(2, 2, dtype=torch.uint8), torch.ones(3), torch.zeros(16))
    with pytest.raises(ValueError):
        cpu.unpack_scaled(torch.zeros(2, 2, dtype=torch.uint8), torch.ones(2), torch.empty(33))


# ------------------------------------------------------------------------------------------
# Server operations
# ------------------------------------------------------------------------------------------

SERVER_CHUNKS = [0, 8, 64, 8000, 2**17 + 8]


@pytest.mark.parametrize("chunk", SERVER_CHUNKS)
@pytest.mark.parametrize("n", [1, 2, 3, 4])  # 3: the division by n is not a power of two
def test_server_ops_match_reference(n, chunk):
    gen = torch.Generator().manual_seed(chunk + n)
    err_cpu = torch.zeros(chunk)
    err_ref = torch.zeros(chunk)
    out_cpu = torch.empty(chunk // 8, dtype=torch.uint8)
    out_ref = torch.empty(chunk // 8, dtype=torch.uint8)
    for step in range(5):
        bits = torch.randint(0, 256, (n, chunk // 8), dtype=torch.uint8, generator=gen)
        scales = torch.rand(n, generator=gen) * (step + 1)
        if step == 1:
            scales[0] = 0.0  # ±0.0 terms: the +0.0 start of the sum matters bitwise
        assert_bitwise_equal(cpu.server_average(bits, scales), ref.server_average(bits, scales))
        t_cpu = cpu.server_scale(bits, scales, err_cpu)
        t_ref = ref.server_scale(bits, scales, err_ref)
        assert_scale_close(t_cpu, t_ref)
        cpu.server_pack(bits, scales, err_cpu, t_ref, out_cpu)
        ref.server_pack(bits, scales, err_ref, t_ref, out_ref)
        assert_bitwise_equal(out_cpu, out_ref)
        assert_bitwise_equal(err_cpu, err_ref)
    if chunk and n > 1:
        assert err_cpu.abs().max() > 0


def test_server_average_sums_in_rank_order():
    # 1e8 + 1 - 1e8 in fp32 is 0, (1e8 - 1e8) + 1 would be 1: the order is observable.
    scales = torch.tensor([1e8, 1.0, 1e8])
    bits = torch.tensor([[0xFF], [0xFF], [0x00]], dtype=torch.uint8)
    avg = cpu.server_average(bits, scales)
    assert_bitwise_equal(avg, ref.server_average(bits, scales))
    assert avg[0].item() == 0.0


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_server_pack_with_non_finite_scale_leaves_error_untouched(bad):
    gen = torch.Generator().manual_seed(4)
    bits = torch.randint(0, 256, (2, 100), dtype=torch.uint8, generator=gen)
    scales = torch.rand(2, generator=gen)
    err = torch.randn(800, generator=gen)
    before = err.clone()
    out = torch.empty(100, dtype=torch.uint8)
    out_ref = torch.empty(100, dtype=torch.uint8)
    cpu.server_pack(bits, scales, err, torch.tensor(bad), out)
    ref.server_pack(bits, scales, before.clone(), torch.tensor(bad), out_ref)
    assert_bitwise_equal(err, before)
    assert_bitwise_equal(out, out_ref)


def test_server_ops_with_a_non_finite_worker_scale():
    gen = torch.Generator().manual_seed(5)
    bits = torch.randint(0, 256, (2, 16), dtype=torch.uint8, generator=gen)
    scales = torch.tensor([float("nan"), 1.0])
    err = torch.randn(128, generator=gen)
    before = err.clone()
    t = cpu.server_scale(bits, scales, err)
    assert torch.isnan(t)
    out = torch.empty(16, dtype=torch.uint8)
    out_ref = torch.empty(16, dtype=torch.uint8)
    cpu.server_pack(bits, scales, err, t, out)
    ref.server_pack(bits, scales, before.clone(), t, out_ref)
    assert_bitwise_equal(err, before)
    assert_bitwise_equal(out, out_ref)


# ------------------------------------------------------------------------------------------
# Decompression
# ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64], ids=str)
@pytest.mark.parametrize("n", WORLD_SIZES + [3])
def test_unpack_scaled_matches_reference(out_dtype, n):
    gen = torch.Generator().manual_seed(n)
    chunk = 8 * 1000
    bits = torch.randint(0, 256, (n, chunk // 8), dtype=torch.uint8, generator=gen)
    scales = torch.rand(n, generator=gen) * 3
    for numel in (n * chunk, n * chunk - 5, chunk - 3, 11, 0):
        out = torch.full((numel,), 7.0, dtype=out_dtype)
        expected = torch.full((numel,), 7.0, dtype=out_dtype)
        cpu.unpack_scaled(bits, scales, out)
        ref.unpack_scaled(bits, scales, expected)
        assert_bitwise_equal(out, expected)


@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float16], ids=str)
def test_unpack_scaled_rounds_like_torch(out_dtype):
    # Halfway cases (round to even, both directions), overflow, subnormals, NaN, ±0, inf.
    values = [
        1 + 2**-8, 1 + 3 * 2**-8, 1 + 2**-11, 1 + 3 * 2**-11, 1 + 2**-12 + 2**-20,
        65520.0, 1e5, 3e-8, 1e-40, 0.0, -0.0, float("inf"), float("nan"), 3.4e38,
    ]
    scales = torch.tensor(values, dtype=torch.float32)
    n = scales.numel()
    bits = torch.tensor([[0b10110010]] * n, dtype=torch.uint8)
    out = torch.empty(8 * n, dtype=out_dtype)
    cpu.unpack_scaled(bits, scales, out)
    signs = torch.tensor([1, -1, 1, 1, -1, -1, 1, -1], dtype=torch.float32)
    expected = (scales.reshape(-1, 1) * signs).reshape(-1).to(out_dtype)
    assert_bitwise_equal(out, expected)


def test_unpack_scaled_into_a_view_writes_through():
    bits = torch.tensor([[0xF0], [0x0F]], dtype=torch.uint8)
    big = torch.zeros(20)
    cpu.unpack_scaled(bits, torch.tensor([1.0, 2.0]), big[2:18])
    assert big[:2].tolist() == [0, 0] and big[18:].tolist() == [0, 0]
    assert big[2:18].tolist() == [1, 1, 1, 1, -1, -1, -1, -1, -2, -2, -2, -2, 2, 2, 2, 2]


def test_all_256_byte_patterns_round_trip():
    # Unpack every byte value, pack the result again: exercises both multiply tricks fully.
    bits = torch.arange(256, dtype=torch.int32).to(torch.uint8).reshape(1, 256)
    signs = torch.empty(2048)
    cpu.unpack_scaled(bits, torch.ones(1), signs)
    assert_bitwise_equal(signs, ref.unpack_signs(bits).reshape(-1))
    packed = torch.empty(256, dtype=torch.uint8)
    cpu.worker_pack(signs, torch.zeros(2048), torch.ones(1), 0, packed)
    assert_bitwise_equal(packed, bits.reshape(-1))
    z = torch.zeros(2048)  # server side: n = 1 row, zero error, so z = the signs
    cpu.server_pack(bits, torch.ones(1), z, torch.tensor(1.0), packed)
    assert_bitwise_equal(packed, bits.reshape(-1))


def test_unpack_scaled_into_a_strided_out():
    bits = torch.randint(0, 256, (2, 10), dtype=torch.uint8, generator=torch.Generator().manual_seed(6))
    scales = torch.tensor([0.5, 3.0])
    big = torch.zeros(20, 8)
    cpu.unpack_scaled(bits, scales, big[:, 1])  # a strided column: must be written through
    expected = torch.empty(20)
    ref.unpack_scaled(bits, scales, expected)
    assert_bitwise_equal(big[:, 1].contiguous(), expected)
    big[:, 1] = 0
    assert big.abs().max() == 0  # nothing outside the column was touched


# ------------------------------------------------------------------------------------------
# Pieces (one scale per piece, ``bounds=``)
# ------------------------------------------------------------------------------------------


def make_bounds(length: int, gen: torch.Generator, pieces: int) -> list[int]:
    """Random piece bounds over ``length`` (multiples of 8), with some empty pieces."""
    if length == 0:
        return [0]
    cuts = torch.randint(0, length // 8 + 1, (pieces - 1,), generator=gen) * 8
    cuts = sorted(cuts.tolist())
    return [0] + cuts + [cuts[-1] if cuts else 0] + [length]  # the duplicate: an empty piece


def piece_magnitudes(x_len: int, bounds: list[int], gen: torch.Generator) -> torch.Tensor:
    """A magnitude per element that differs by orders of magnitude between pieces."""
    mags = torch.ones(max(bounds[-1], x_len))
    for lo, hi in zip(bounds[:-1], bounds[1:]):
        mags[lo:hi] = 10.0 ** torch.randint(-6, 3, (1,), generator=gen).item()
    return mags[:x_len]


@pytest.mark.parametrize("n", [1, 2, 3])
@pytest.mark.parametrize("numel", [0, 9, 1000, 2**16 + 3])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_worker_ops_with_pieces_match_reference(dtype, numel, n):
    gen = torch.Generator().manual_seed(numel + 7 * n)
    length = padded_length(numel, n)
    bounds = make_bounds(length, gen, 6)
    P = len(bounds) - 1
    rank = n - 1
    err_cpu, err_ref = torch.zeros(length), torch.zeros(length)
    bits_cpu = torch.full((length // 8,), 0xAA, dtype=torch.uint8)
    bits_ref = torch.empty(length // 8, dtype=torch.uint8)
    mags = piece_magnitudes(numel, bounds, gen)
    for step in range(5):
        x = (torch.randn(numel, generator=gen) * mags).to(dtype)
        s_cpu = cpu.worker_scale(x, err_cpu, bounds=bounds)
        s_ref = ref.worker_scale(x, err_ref, bounds=torch.tensor(bounds))
        assert s_cpu.shape == (P,) and s_cpu.dtype == torch.float32
        torch.testing.assert_close(s_cpu, s_ref, rtol=1e-6, atol=0.0)
        for p, (lo, hi) in enumerate(zip(bounds[:-1], bounds[1:])):
            if hi == lo:
                assert s_ref[p] == 0  # the RMS of nothing
        scales = torch.rand(n, P, generator=gen) + 0.5
        scales[rank] = s_ref
        cpu.worker_pack(x, err_cpu, scales, rank, bits_cpu, bounds=bounds)
        ref.worker_pack(x, err_ref, scales, rank, bits_ref, bounds=bounds)
        assert_bitwise_equal(bits_cpu, bits_ref)
        assert_bitwise_equal(err_cpu, err_ref)
    if numel > 8:
        assert err_cpu.abs().max() > 0


@pytest.mark.parametrize("numel", [1000, 2**16 + 3])
def test_one_piece_is_the_single_scale(numel):
    gen = torch.Generator().manual_seed(numel)
    length = padded_length(numel, 2)
    e1, e2 = torch.randn(length, generator=gen), None
    e2 = e1.clone()
    x = torch.randn(numel, generator=gen)
    s = cpu.worker_scale(x, e1)
    sp = cpu.worker_scale(x, e2, bounds=[0, length])
    assert_bitwise_equal(sp, s.reshape(1))
    b1, b2 = torch.empty(length // 8, dtype=torch.uint8), torch.empty(length // 8, dtype=torch.uint8)
    scales = torch.stack([s, torch.tensor(0.3)])
    cpu.worker_pack(x, e1, scales, 0, b1)
    cpu.worker_pack(x, e2, scales.reshape(2, 1), 0, b2, bounds=[0, length])
    assert_bitwise_equal(b1, b2)
    assert_bitwise_equal(e1, e2)
    # unpack with the chunk boundaries as pieces is the per-chunk unpack
    rows = torch.randint(0, 256, (2, length // 16), dtype=torch.uint8, generator=gen)
    o1, o2 = torch.empty(numel), torch.empty(numel)
    cpu.unpack_scaled(rows, scales, o1)
    cpu.unpack_scaled(rows, scales, o2, bounds=[0, length // 2, length])
    assert_bitwise_equal(o1, o2)


@pytest.mark.parametrize("chunk", [8, 64, 8000, 2**15 + 8])
@pytest.mark.parametrize("n", [1, 2, 3])
def test_server_ops_with_pieces_match_reference(n, chunk):
    gen = torch.Generator().manual_seed(chunk + 11 * n)
    bounds = make_bounds(chunk, gen, 5)
    P = len(bounds) - 1
    err_cpu, err_ref = torch.zeros(chunk), torch.zeros(chunk)
    out_cpu = torch.empty(chunk // 8, dtype=torch.uint8)
    out_ref = torch.empty(chunk // 8, dtype=torch.uint8)
    for step in range(4):
        bits = torch.randint(0, 256, (n, chunk // 8), dtype=torch.uint8, generator=gen)
        scales = torch.rand(n, P, generator=gen) * 10.0 ** torch.randint(-5, 2, (1, P), generator=gen)
        if step == 1:
            scales[0] = 0.0
        assert_bitwise_equal(cpu.server_average(bits, scales, bounds=bounds), ref.server_average(bits, scales, bounds=bounds))
        t_cpu = cpu.server_scale(bits, scales, err_cpu, bounds=bounds)
        t_ref = ref.server_scale(bits, scales, err_ref, bounds=bounds)
        assert t_cpu.shape == (P,)
        torch.testing.assert_close(t_cpu, t_ref, rtol=1e-6, atol=0.0)
        cpu.server_pack(bits, scales, err_cpu, t_ref, out_cpu, bounds=bounds)
        ref.server_pack(bits, scales, err_ref, t_ref, out_ref, bounds=bounds)
        assert_bitwise_equal(out_cpu, out_ref)
        assert_bitwise_equal(err_cpu, err_ref)
    if n > 1:
        assert err_cpu.abs().max() > 0


def test_pieces_non_finite_scales_leave_errors_untouched():
    gen = torch.Generator().manual_seed(8)
    bounds = [0, 16, 48, 64]
    x = torch.randn(60, generator=gen)
    error = torch.randn(64, generator=gen)
    before = error.clone()
    bits, bits_ref = torch.empty(8, dtype=torch.uint8), torch.empty(8, dtype=torch.uint8)
    scales = torch.rand(2, 3, generator=gen)
    scales[1, 2] = float("nan")  # another rank's last piece
    cpu.worker_pack(x, error, scales, 0, bits, bounds=bounds)
    ref.worker_pack(x, before.clone(), scales, 0, bits_ref, bounds=bounds)
    assert_bitwise_equal(error, before)
    assert_bitwise_equal(bits, bits_ref)
    # server: one non-finite piece scale keeps the whole server error
    rows = torch.randint(0, 256, (2, 8), dtype=torch.uint8, generator=gen)
    good = torch.rand(2, 3, generator=gen)
    se = torch.randn(64, generator=gen)
    se_before = se.clone()
    t = cpu.server_scale(rows, good, se, bounds=bounds)
    t[1] = float("inf")
    cpu.server_pack(rows, good, se, t, bits, bounds=bounds)
    assert_bitwise_equal(se, se_before)
    t[1] = 1.0
    cpu.server_pack(rows, good, se, t, bits, bounds=bounds)
    assert not torch.equal(se, se_before)


@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("n", [1, 3])
def test_unpack_scaled_with_pieces_matches_reference(out_dtype, n):
    gen = torch.Generator().manual_seed(30 + n)
    chunk = 8 * 100
    bounds = make_bounds(n * chunk, gen, 9)
    bits = torch.randint(0, 256, (n, chunk // 8), dtype=torch.uint8, generator=gen)
    scales = torch.rand(len(bounds) - 1, generator=gen) / 3
    for numel in (n * chunk, n * chunk - 5, chunk - 3, 11, 0):
        out = torch.full((numel,), 7.0, dtype=out_dtype)
        expected = torch.full((numel,), 7.0, dtype=out_dtype)
        cpu.unpack_scaled(bits, scales, out, bounds=bounds)
        ref.unpack_scaled(bits, scales, expected, bounds=bounds)
        assert_bitwise_equal(out, expected)


def test_bad_bounds_are_refused():
    x, error = torch.randn(16), torch.zeros(16)
    for bad in ([0, 4, 16], [0, 8], [8, 16], [0, 16, 8, 16]):
        with pytest.raises(ValueError):
            cpu.worker_scale(x, error, bounds=bad)
    with pytest.raises(ValueError):
        cpu.worker_pack(x, error, torch.ones(5), 0, torch.empty(2, dtype=torch.uint8), bounds=[0, 8, 16])
    with pytest.raises(ValueError):  # 2 ranks x 2 pieces: there is no rank 2
        cpu.worker_pack(x, error, torch.ones(2, 2), 2, torch.empty(2, dtype=torch.uint8), bounds=[0, 8, 16])


# ---------------------------------------------------------------- BinSGDM's fused worker math
@pytest.mark.parametrize("eps", [1e-8, 0.0])
@pytest.mark.parametrize("beta", [0.9, 0.5])
def test_vote_threshold_is_bitwise_the_torch_operations(monkeypatch, eps, beta):
    from hf_onebit.optim.binsgdm import vote_threshold_

    gen = torch.Generator().manual_seed(0)
    n = 100_003
    def wide(): return torch.randn(n, generator=gen) * 10.0 ** torch.randint(-8, 3, (n,), generator=gen).float()
    m, g = wide(), wide()
    b = m.abs() * torch.rand(n, generator=gen) * 3
    m[:10], b[:10], g[:5] = 0.0, 0.0, 0.0  # 0/0 with eps == 0: z = 0
    g[20], g[21], m[22], b[23], g[24] = float("inf"), float("nan"), float("nan"), float("inf"), float("-inf")
    monkeypatch.setenv("HF_ONEBIT_KERNELS", "reference")  # the torch operations
    want = [torch.empty(n) for _ in range(3)]
    vote_threshold_(m, b, g, beta=beta, eps=eps, m_out=want[0], b_out=want[1], theta=want[2], tmp=torch.empty(n))
    got = [torch.empty(n) for _ in range(3)]
    cpu.vote_threshold(m, b, g, beta=beta, eps=eps, m_out=got[0], b_out=got[1], theta=got[2])
    for name, a, w in zip(("m_out", "b_out", "theta"), got, want):
        assert torch.equal(a.view(torch.int32), w.view(torch.int32)), name  # bit patterns, NaNs included
    assert torch.isinf(got[1]).any() and torch.isnan(got[0]).any()  # the special values reached the outputs
    assert bool(torch.isnan(got[2]).any()) == (eps != 0)  # with eps == 0 a NaN z is 0 (0/0 of unseen coordinates)
    monkeypatch.delenv("HF_ONEBIT_KERNELS")
    fused = [torch.empty(n) for _ in range(3)]  # BinSGDM's own call takes the fused pass on CPU
    vote_threshold_(m, b, g, beta=beta, eps=eps, m_out=fused[0], b_out=fused[1], theta=fused[2], tmp=torch.empty(n))
    assert all(torch.equal(a.view(torch.int32), w.view(torch.int32)) for a, w in zip(fused, want))


def test_vote_threshold_refuses_what_it_cannot_write():
    x = torch.zeros(8)
    with pytest.raises(ValueError, match="contiguous"):
        cpu.vote_threshold(x, x, x, beta=0.9, eps=1e-8, m_out=torch.zeros(8, 2)[:, 0], b_out=x.clone(), theta=x.clone())
    with pytest.raises(ValueError, match="lengths differ"):
        cpu.vote_threshold(x, x, x, beta=0.9, eps=1e-8, m_out=torch.zeros(7), b_out=x.clone(), theta=x.clone())


def test_pack_bools_matches_the_reference_layout():
    """BinSGDM's vote packing: numpy's packbits (CPU) and the torch reference (every other device)
    write the same bytes, in the layout of ``pack_signs`` (MSB first, True = +1)."""
    votes = torch.rand(8 * 37, generator=torch.Generator().manual_seed(1)) < 0.3
    a = torch.empty(37, dtype=torch.uint8)
    b = torch.empty(37, dtype=torch.uint8)
    cpu.pack_bools(votes, a)
    ref.pack_bools(votes, b)
    assert torch.equal(a, b)
    assert torch.equal(ref.unpack_signs(a), torch.where(votes, 1.0, -1.0))
    for backend in (cpu, ref):
        with pytest.raises(ValueError, match="multiple of 8"):
            backend.pack_bools(votes[:9], torch.empty(1, dtype=torch.uint8))
