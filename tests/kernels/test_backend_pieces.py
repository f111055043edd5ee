"""The piece variants (one scale per piece, ``bounds=``) of every fast backend against the reference.

Pieces differ in magnitude by orders of magnitude and include an empty one; a non-finite piece
scale on any rank leaves every error buffer untouched.
"""

from __future__ import annotations

import pytest
import torch

from hf_onebit.kernels import reference as ref
from tests.kernels.backends import (
    DTYPES,
    assert_bitwise_equal,
    backends,
    garbage_bytes,
    make_bits,
    make_bounds,
    make_scales,
    make_x,
    padded_length,
    per_backend,
    piece_x,
)

WORKER_PIECE_CASES = per_backend(
    "numel, n, dtype",
    cpu=[(numel, n, dtype) for dtype in DTYPES for numel in (0, 9, 1000, 2**16 + 3) for n in (1, 2, 3)],
    triton=[(block, numel, n, dtype) for block in (64, 4096) for dtype in DTYPES for n in (1, 3)
            for numel in (0, 9, 1000)],
)


@pytest.mark.parametrize(*WORKER_PIECE_CASES)
def test_worker_ops_with_pieces_match_reference(backend, numel, n, dtype):
    L = padded_length(numel, n)
    bounds = make_bounds(L, numel + 7 * n, pieces=6)
    P = len(bounds) - 1
    e_ref, e_got = torch.zeros(L), torch.zeros(L)
    for step in range({"cpu": 5, "triton": 3}[backend.name]):
        x = piece_x(numel, bounds, dtype, seed=step)
        # the reference also takes the bounds as a tensor
        s_ref = ref.worker_scale(x, e_ref, bounds=torch.tensor(bounds) if step % 2 else bounds)
        s_got = backend.worker_scale(x, e_got, bounds=bounds)
        assert s_got.shape == (P,) and s_got.dtype == torch.float32
        torch.testing.assert_close(s_got, s_ref, rtol=1e-6, atol=0.0)
        for p, (lo, hi) in enumerate(zip(bounds[:-1], bounds[1:])):
            if hi == lo:
                assert s_ref[p] == 0  # the RMS of nothing
        rank = step % n
        scales = make_scales(n * max(P, 1), step)[: n * P].reshape(n, P)
        scales[rank] = s_ref
        b_ref = torch.empty(L // 8, dtype=torch.uint8)
        b_got = garbage_bytes(L // 8)
        ref.worker_pack(x, e_ref, scales, rank, b_ref, bounds=bounds)
        backend.worker_pack(x, e_got, scales, rank, b_got, bounds=bounds)
        assert_bitwise_equal(b_got, b_ref, f"bits at step {step}")
        assert_bitwise_equal(e_got, e_ref, f"error at step {step}")
    if L:
        assert e_got.abs().max() > 0


@pytest.mark.parametrize(*per_backend("numel", cpu=[(1000,), (2**16 + 3,)], triton=[(2048, 1000)]))
def test_one_piece_is_the_single_scale(backend, numel):
    gen = torch.Generator().manual_seed(numel)
    length = padded_length(numel, 2)
    e1 = torch.randn(length, generator=gen)
    e2 = e1.clone()
    x = torch.randn(numel, generator=gen)
    s = backend.worker_scale(x, e1)
    sp = backend.worker_scale(x, e2, bounds=[0, length])
    assert_bitwise_equal(sp, s.reshape(1))
    b1, b2 = torch.empty(length // 8, dtype=torch.uint8), torch.empty(length // 8, dtype=torch.uint8)
    scales = torch.stack([s, torch.tensor(0.3)])
    backend.worker_pack(x, e1, scales, 0, b1)
    backend.worker_pack(x, e2, scales.reshape(2, 1), 0, b2, bounds=[0, length])
    assert_bitwise_equal(b1, b2)
    assert_bitwise_equal(e1, e2)
    # unpack with the chunk boundaries as pieces is the per-chunk unpack
    rows = torch.randint(0, 256, (2, length // 16), dtype=torch.uint8, generator=gen)
    o1, o2 = torch.empty(numel), torch.empty(numel)
    backend.unpack_scaled(rows, scales, o1)
    backend.unpack_scaled(rows, scales, o2, bounds=[0, length // 2, length])
    assert_bitwise_equal(o1, o2)


SERVER_PIECE_CASES = per_backend(
    "chunk, n",
    cpu=[(chunk, n) for chunk in (8, 64, 8000, 2**15 + 8) for n in (1, 2, 3)],
    triton=[(block, chunk, n) for block in (64, 4096) for n in (1, 3) for chunk in (8, 1000, 4104)],
)


@pytest.mark.parametrize(*SERVER_PIECE_CASES)
def test_server_ops_with_pieces_match_reference(backend, chunk, n):
    bounds = make_bounds(chunk, chunk + 11 * n)
    P = len(bounds) - 1
    se_ref, se_got = torch.zeros(chunk), torch.zeros(chunk)
    for step in range({"cpu": 4, "triton": 3}[backend.name]):
        bits = make_bits(n, chunk // 8, seed=step)
        scales = (make_scales(n * P, step) * 10.0 ** (torch.arange(n * P) % 7 - 5)).reshape(n, P)
        if step == 1:
            scales[0] = 0.0
        avg = backend.server_average(bits, scales, bounds=bounds)
        assert_bitwise_equal(avg, ref.server_average(bits, scales, bounds=bounds), f"average at step {step}")
        t_ref = ref.server_scale(bits, scales, se_ref, bounds=bounds)
        t_got = backend.server_scale(bits, scales, se_got, bounds=bounds)
        assert t_got.shape == (P,)
        torch.testing.assert_close(t_got, t_ref, rtol=1e-6, atol=0.0)
        o_ref = torch.empty(chunk // 8, dtype=torch.uint8)
        o_got = garbage_bytes(chunk // 8, 0x5A)
        ref.server_pack(bits, scales, se_ref, t_ref, o_ref, bounds=bounds)
        backend.server_pack(bits, scales, se_got, t_ref, o_got, bounds=bounds)
        assert_bitwise_equal(o_got, o_ref, f"bits at step {step}")
        assert_bitwise_equal(se_got, se_ref, f"server error at step {step}")
    if n > 1:
        assert se_got.abs().max() > 0
    # one non-finite piece scale keeps the whole server error
    before = se_got.clone()
    bad = t_ref.clone()
    bad[-1] = float("nan")
    backend.server_pack(bits, scales, se_got, bad, o_got, bounds=bounds)
    assert_bitwise_equal(se_got, before)


@pytest.mark.parametrize("backend", backends())
@pytest.mark.parametrize("bad", (float("nan"), float("inf")), ids=str)
def test_pieces_non_finite_scales_leave_errors_untouched(backend, bad):
    gen = torch.Generator().manual_seed(8)
    bounds = [0, 16, 48, 64]
    x = make_x(60, torch.float32, seed=9)
    error = torch.randn(64, generator=gen)
    before = error.clone()
    bits, bits_ref = torch.empty(8, dtype=torch.uint8), torch.empty(8, dtype=torch.uint8)
    scales = make_scales(6, 9).reshape(2, 3)
    scales[1, 2] = bad  # another rank's last piece
    backend.worker_pack(x, error, scales, 0, bits, bounds=bounds)
    ref.worker_pack(x, before.clone(), scales, 0, bits_ref, bounds=bounds)
    assert_bitwise_equal(error, before)
    assert_bitwise_equal(bits, bits_ref)
    assert_bitwise_equal(bits, ref.pack_signs(ref._padded(x, 64) + before))
    # server: one non-finite piece scale keeps the whole server error
    rows = torch.randint(0, 256, (2, 8), dtype=torch.uint8, generator=gen)
    good = torch.rand(2, 3, generator=gen)
    se = torch.randn(64, generator=gen)
    se_before = se.clone()
    t = backend.server_scale(rows, good, se, bounds=bounds)
    t[1] = bad
    backend.server_pack(rows, good, se, t, bits, bounds=bounds)
    assert_bitwise_equal(se, se_before)
    t[1] = 1.0
    backend.server_pack(rows, good, se, t, bits, bounds=bounds)
    assert not torch.equal(se, se_before)


UNPACK_PIECE_CASES = per_backend(
    "n, dtype",
    cpu=[(n, dtype) for n in (1, 3) for dtype in DTYPES],
    triton=[(block, n, dtype) for block in (64, 4096) for n in (1, 3) for dtype in DTYPES],
)


@pytest.mark.parametrize(*UNPACK_PIECE_CASES)
def test_unpack_scaled_with_pieces_matches_reference(backend, n, dtype):
    chunk = 1000
    bits = make_bits(n, chunk // 8, seed=40 + n)
    bounds = make_bounds(n * chunk, 40 + n, pieces=9)
    scales = (make_scales(len(bounds) - 1, n) / 3).to(torch.float32)
    total = n * chunk
    for numel in (total, total - 5, chunk - 3, 11, 1, 0):
        out = torch.full((numel,), 7.0, dtype=dtype)
        expected = torch.full((numel,), 7.0, dtype=dtype)
        backend.unpack_scaled(bits, scales, out, bounds=bounds)
        ref.unpack_scaled(bits, scales, expected, bounds=bounds)
        assert_bitwise_equal(out, expected, f"numel={numel}")


@pytest.mark.parametrize("backend", backends())
def test_bad_bounds_are_refused(backend):
    x, error = torch.randn(16), torch.zeros(16)
    for bad in ([0, 4, 16], [0, 8], [8, 16], [0, 16, 8, 16]):
        with pytest.raises(ValueError):
            backend.worker_scale(x, error, bounds=bad)
    with pytest.raises(ValueError):
        backend.worker_pack(x, error, torch.ones(5), 0, torch.empty(2, dtype=torch.uint8), bounds=[0, 8, 16])
    with pytest.raises(ValueError):  # 2 ranks x 2 pieces: there is no rank 2
        backend.worker_pack(x, error, torch.ones(2, 2), 2, torch.empty(2, dtype=torch.uint8), bounds=[0, 8, 16])
