"""The Triton kernels against the reference, run on CPU tensors through the Triton interpreter.

No GPU is needed: ``TRITON_INTERPRET=1`` makes ``triton.jit`` build interpreted kernels that
execute with numpy. It must be set before the kernel module is imported (the decorators read
it), hence the first lines below. The interpreter is slow, so sizes are modest except for one
large case (``2**20 + 3`` elements), run with the largest block size only.

What is checked (spec §1): bits are bytewise identical to the reference, scales agree to 1e-6
relative, error buffers are identical over several successive calls, the server average keeps
the reference's summation order, ``unpack_scaled`` writes identical fp32/bf16/fp16 values, and
non-finite scales leave the error buffers untouched.
"""

from __future__ import annotations

import importlib
import math
import os

os.environ["TRITON_INTERPRET"] = "1"

import pytest
import torch

from tests.requirements import require  # noqa: E402

require("triton", "triton is not installed: the Triton kernels cannot be tested")
import triton  # noqa: E402

from triton.runtime.interpreter import InterpretedFunction

if not isinstance(triton.language.sum, InterpretedFunction):
    # Triton's own helpers (tl.sum, ...) are built when triton is first imported; if that
    # happened earlier in this process without TRITON_INTERPRET=1, nothing can run here.
    pytest.skip(
        "triton was imported before TRITON_INTERPRET=1 was set; run this file on its own or"
        " export TRITON_INTERPRET=1 (or set it in a conftest.py) when no GPU is available",
        allow_module_level=True,
    )

from hf_onebit.kernels import reference as R
from hf_onebit.kernels import triton as T

if not isinstance(T._worker_pack_kernel, InterpretedFunction):
    # The kernel module was imported earlier without the interpreter (while triton itself had
    # it): rebuild its kernels now.
    T = importlib.reload(T)

# 64: many programs even for small buffers; 4096: the largest, one program for most of them.
BLOCKS = (64, 256, 4096)
DTYPES = (torch.float32, torch.bfloat16, torch.float16)
LENGTHS = (0, 1, 7, 8, 9, 1000)
BIG = 2**20 + 3


def padded_length(numel: int, n: int) -> int:
    """The L of the spec: the next multiple of 8·n (0 stays 0)."""
    return math.ceil(numel / (8 * n)) * 8 * n


def make_x(numel: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    """Random values in ``dtype`` with a few exact zeros and negative zeros (sign⁺(0) = +1)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(numel, generator=g)
    x[2::11] = 0.0
    x[5::13] = -0.0
    return x.to(dtype)


def make_scales(n: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 + seed)
    return torch.rand(n, generator=g) + 0.5


def assert_scale_close(actual: torch.Tensor, expected: torch.Tensor) -> None:
    assert actual.dtype == torch.float32 and actual.shape == ()
    torch.testing.assert_close(actual, expected, rtol=1e-6, atol=0.0)


# --------------------------------------------------------------------------------------------
# Worker side
# --------------------------------------------------------------------------------------------


def run_worker_steps(numel: int, n: int, dtype: torch.dtype, block: int, steps: int = 3) -> None:
    """Several successive scale+pack calls on one error buffer, reference and Triton side by side.

    Both packs get the *same* scales (the reference's, as an all-gather would deliver them), so
    bits and error must agree exactly; the Triton scale itself is compared to 1e-6.
    """
    L = padded_length(numel, n)
    e_ref = torch.zeros(L)
    e_tri = torch.zeros(L)
    for step in range(steps):
        x = make_x(numel, dtype, seed=step)
        s_ref = R.worker_scale(x, e_ref)
        s_tri = T.worker_scale(x, e_tri, block=block)
        assert_scale_close(s_tri, s_ref)

        rank = step % n
        scales = make_scales(n, step)
        scales[rank] = s_ref
        b_ref = torch.empty(L // 8, dtype=torch.uint8)
        b_tri = torch.full((L // 8,), 0xA5, dtype=torch.uint8)  # garbage: every byte is written
        R.worker_pack(x, e_ref, scales, rank, b_ref)
        T.worker_pack(x, e_tri, scales, rank, b_tri, block=block)
        assert torch.equal(b_tri, b_ref), f"bits differ at step {step}"
        assert torch.equal(e_tri, e_ref), f"error differs at step {step}"
    if L:
        assert e_tri.abs().sum() > 0  # the error really was updated (not trivially equal)


@pytest.mark.parametrize("block", BLOCKS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("n", (1, 2, 4))
@pytest.mark.parametrize("numel", LENGTHS)
def test_worker_matches_reference(numel, n, dtype, block):
    run_worker_steps(numel, n, dtype, block)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_worker_matches_reference_big(dtype):
    run_worker_steps(BIG, 4, dtype, block=4096, steps=2)


def test_worker_hand_computed():
    """A case worked out by hand, so the test does not only trust the reference."""
    x = torch.tensor([1.0, -2.0, 0.0, -0.0, 3.0, -1.0, 2.0, -5.0, 4.0])
    error = torch.zeros(16)
    s = T.worker_scale(x, error, block=64)
    expected_s = math.sqrt((1 + 4 + 9 + 1 + 4 + 25 + 16) / 16)
    assert s.item() == pytest.approx(expected_s, rel=1e-7)

    bits = torch.empty(2, dtype=torch.uint8)
    T.worker_pack(x, error, s.reshape(1), 0, bits, block=64)
    # y >= 0 -> 1, MSB first: [1,0,1,1,1,0,1,0] = 0xBA; [4, then 7 zeros of padding] = 0xFF.
    assert bits.tolist() == [0xBA, 0xFF]
    y = torch.cat([x, torch.zeros(7)])
    expected_error = y - s * torch.where(y >= 0, 1.0, -1.0)
    assert torch.equal(error, expected_error)


def test_worker_scale_empty_is_zero():
    s = T.worker_scale(torch.empty(0, dtype=torch.bfloat16), torch.empty(0))
    assert s.dtype == torch.float32 and s.shape == () and s.item() == 0.0
    no_bits = torch.empty(0, dtype=torch.uint8)
    T.worker_pack(torch.empty(0), torch.empty(0), torch.ones(2), 1, no_bits)  # launches nothing


def test_worker_padding_only():
    """x empty but L > 0: everything comes from the error buffer (the padding has an error too)."""
    e_ref = torch.randn(16)
    e_tri = e_ref.clone()
    x = torch.empty(0, dtype=torch.float16)
    assert_scale_close(T.worker_scale(x, e_tri, block=64), R.worker_scale(x, e_ref))
    scales = torch.tensor([0.7, 1.3])
    b_ref, b_tri = torch.empty(2, dtype=torch.uint8), torch.empty(2, dtype=torch.uint8)
    R.worker_pack(x, e_ref, scales, 1, b_ref)
    T.worker_pack(x, e_tri, scales, 1, b_tri, block=64)
    assert torch.equal(b_tri, b_ref) and torch.equal(e_tri, e_ref)


@pytest.mark.parametrize("block", (64, 4096))
def test_worker_nan_in_x_leaves_error_untouched(block):
    x = make_x(1000, torch.bfloat16, seed=3)
    x[123] = float("nan")
    L = padded_length(x.numel(), 2)
    e_ref = torch.randn(L)
    e_tri = e_ref.clone()
    before = e_ref.clone()
    s = T.worker_scale(x, e_tri, block=block)
    assert torch.isnan(s)
    scales = torch.stack([torch.tensor(0.9), s])  # this rank is 1, its scale is NaN
    b_ref, b_tri = torch.empty(L // 8, dtype=torch.uint8), torch.empty(L // 8, dtype=torch.uint8)
    R.worker_pack(x, e_ref, scales, 1, b_ref)
    T.worker_pack(x, e_tri, scales, 1, b_tri, block=block)
    assert torch.equal(e_tri, before)
    assert torch.equal(b_tri, b_ref)  # bits are still written; NaN packs as 0
    assert (b_tri[123 // 8] >> (7 - 123 % 8)) & 1 == 0


@pytest.mark.parametrize("bad", (float("nan"), float("inf"), float("-inf")))
@pytest.mark.parametrize("n, bad_rank", ((2, 1), (3, 2), (4, 0)))
def test_worker_non_finite_scale_of_any_rank_leaves_error_untouched(bad, n, bad_rank):
    x = make_x(100, torch.float32, seed=4)
    L = padded_length(x.numel(), n)
    error = torch.randn(L)
    before = error.clone()
    scales = make_scales(n, 4)
    scales[bad_rank] = bad
    rank = (bad_rank + 1) % n  # the non-finite scale belongs to another rank
    bits = torch.empty(L // 8, dtype=torch.uint8)
    T.worker_pack(x, error, scales, rank, bits, block=64)
    assert torch.equal(error, before)
    expected_bits = R.pack_signs(R._padded(x, L) + before)
    assert torch.equal(bits, expected_bits)


def test_worker_scales_read_only_up_to_n():
    """n = 3 pads the in-kernel arange to 4: the 4th value in memory must not be read."""
    storage = torch.tensor([0.5, 0.75, 1.25, float("nan")])
    scales = storage[:3]
    x = make_x(40, torch.float32, seed=5)
    L = padded_length(x.numel(), 3)
    e_ref = torch.randn(L)
    e_tri = e_ref.clone()
    b_ref, b_tri = torch.empty(L // 8, dtype=torch.uint8), torch.empty(L // 8, dtype=torch.uint8)
    R.worker_pack(x, e_ref, scales, 2, b_ref)
    T.worker_pack(x, e_tri, scales, 2, b_tri, block=64)
    assert torch.equal(b_tri, b_ref) and torch.equal(e_tri, e_ref)
    assert not torch.equal(e_tri, torch.zeros(L))


# --------------------------------------------------------------------------------------------
# Server side
# --------------------------------------------------------------------------------------------


def make_bits(n: int, row_bytes: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(2000 + seed)
    return torch.randint(0, 256, (n, row_bytes), generator=g, dtype=torch.uint8)


# Equal scales make many averages exactly 0 (sign⁺ must give +1 there); distinct ones with
# n = 3 make divisions that are inexact, where only an IEEE division matches the reference.
SCALE_KINDS = ("random", "equal")


def server_scales(n: int, kind: str, seed: int) -> torch.Tensor:
    return make_scales(n, seed) if kind == "random" else torch.full((n,), 0.375)


# 4104 = one byte row more than the largest block: two programs even at block 4096. It is left
# out for the smallest block, where it only costs interpreter time (1000 is already 16 blocks).
SERVER_CASES = [
    (chunk, block)
    for chunk in (0, 8, 24, 1000, 4104)
    for block in BLOCKS
    if not (chunk == 4104 and block == 64)
]


@pytest.mark.parametrize("chunk, block", SERVER_CASES)
@pytest.mark.parametrize("kind", SCALE_KINDS)
@pytest.mark.parametrize("n", (1, 2, 3, 4))
def test_server_matches_reference(chunk, n, kind, block):
    se_ref = torch.zeros(chunk)
    se_tri = torch.zeros(chunk)
    for step in range(3):
        bits = make_bits(n, chunk // 8, seed=step)
        scales = server_scales(n, kind, step)
        avg = T.server_average(bits, scales, block=block)
        assert avg.dtype == torch.float32 and avg.shape == (chunk,)
        assert torch.equal(avg, R.server_average(bits, scales))

        t_ref = R.server_scale(bits, scales, se_ref)
        t_tri = T.server_scale(bits, scales, se_tri, block=block)
        assert_scale_close(t_tri, t_ref)

        o_ref = torch.empty(chunk // 8, dtype=torch.uint8)
        o_tri = torch.full((chunk // 8,), 0x5A, dtype=torch.uint8)
        R.server_pack(bits, scales, se_ref, t_ref, o_ref)
        T.server_pack(bits, scales, se_tri, t_ref, o_tri, block=block)
        assert torch.equal(o_tri, o_ref), f"bits differ at step {step}"
        assert torch.equal(se_tri, se_ref), f"server error differs at step {step}"


def test_server_average_hand_computed():
    # Row 0 (s = 1): + - + - + - + -    Row 1 (s = 0.5): + + + + - - - -
    bits = torch.tensor([[0b10101010], [0b11110000]], dtype=torch.uint8)
    scales = torch.tensor([1.0, 0.5])
    expected = torch.tensor([1.5, -0.5, 1.5, -0.5, 0.5, -1.5, 0.5, -1.5]) / 2
    assert torch.equal(T.server_average(bits, scales, block=64), expected)


@pytest.mark.parametrize("bad", (float("nan"), float("inf")))
def test_server_non_finite_scale_leaves_server_error_untouched(bad):
    bits = make_bits(2, 125, seed=7)
    scales = make_scales(2, 7)
    se = torch.randn(1000)
    before = se.clone()
    out = torch.empty(125, dtype=torch.uint8)
    T.server_pack(bits, scales, se, torch.tensor(bad), out, block=256)
    assert torch.equal(se, before)
    assert torch.equal(out, R.pack_signs(R.server_average(bits, scales) + before))


# --------------------------------------------------------------------------------------------
# unpack_scaled
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("block", BLOCKS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("n", (1, 2, 4))
@pytest.mark.parametrize("chunk", (0, 8, 1000))
def test_unpack_scaled_matches_reference(chunk, n, dtype, block):
    bits = make_bits(n, chunk // 8, seed=chunk + n)
    # 1/3 and 0.1 are not representable in bf16/fp16: the cast must round like torch (RTNE).
    scales = (make_scales(n, n) / 3).to(torch.float32)
    if n > 1:
        scales[1] = 0.1
    total = n * chunk
    for numel in sorted({k for k in (0, 1, total - 5, total) if 0 <= k <= total}):
        out_ref = torch.empty(numel, dtype=dtype)
        out_tri = torch.full((numel,), 7.0, dtype=dtype)
        R.unpack_scaled(bits, scales, out_ref)
        T.unpack_scaled(bits, scales, out_tri, block=block)
        assert torch.equal(out_tri, out_ref), f"numel={numel}"


def test_unpack_scaled_hand_computed_and_shaped_out():
    bits = torch.tensor([[0b10100000], [0b01111111]], dtype=torch.uint8)
    scales = torch.tensor([2.0, 0.25])
    out = torch.zeros(2, 5, dtype=torch.float16)  # 10 of the 16 elements, any shape
    T.unpack_scaled(bits, scales, out, block=64)
    expected = [[2, -2, 2, -2, -2], [-2, -2, -2, -0.25, 0.25]]
    assert out.tolist() == expected


def test_unpack_scaled_into_non_contiguous_out():
    bits = make_bits(2, 3, seed=11)
    scales = torch.tensor([0.3, 1.7])
    out = torch.zeros(6, 8, dtype=torch.bfloat16).t()  # shape (8, 6), not contiguous
    expected = torch.empty(48, dtype=torch.bfloat16)
    R.unpack_scaled(bits, scales, expected)
    T.unpack_scaled(bits, scales, out, block=64)
    assert torch.equal(out.reshape(-1), expected)


def test_unpack_scaled_big():
    n, chunk = 4, padded_length(BIG, 4) // 4
    bits = make_bits(n, chunk // 8, seed=12)
    scales = make_scales(n, 12)
    out_ref = torch.empty(BIG, dtype=torch.bfloat16)
    out_tri = torch.empty(BIG, dtype=torch.bfloat16)
    R.unpack_scaled(bits, scales, out_ref)
    T.unpack_scaled(bits, scales, out_tri, block=4096)
    assert torch.equal(out_tri, out_ref)


# --------------------------------------------------------------------------------------------
# The whole compressed all-reduce, simulated for n ranks in one process
# --------------------------------------------------------------------------------------------


def compressed_all_reduce(backend, xs, worker_errors, server_errors, out_dtype, **kw):
    """Spec §1 with the all-to-all and all-gathers done by indexing. Returns rank 0's result."""
    n = len(xs)
    L = worker_errors[0].numel()
    scales = torch.stack([backend.worker_scale(x, e, **kw) for x, e in zip(xs, worker_errors)])
    sent = []
    for rank, (x, e) in enumerate(zip(xs, worker_errors)):
        bits = torch.empty(L // 8, dtype=torch.uint8)
        backend.worker_pack(x, e, scales, rank, bits, **kw)
        sent.append(bits.view(n, -1))  # row j goes to rank j
    server_bits, server_scales = [], []
    for j in range(n):
        received = torch.stack([sent[i][j] for i in range(n)])
        t = backend.server_scale(received, scales, server_errors[j], **kw)
        out_bits = torch.empty(L // (8 * n), dtype=torch.uint8)
        backend.server_pack(received, scales, server_errors[j], t, out_bits, **kw)
        server_bits.append(out_bits)
        server_scales.append(t)
    result = torch.empty(xs[0].numel(), dtype=out_dtype)
    backend.unpack_scaled(torch.stack(server_bits), torch.stack(server_scales), result, **kw)
    return scales, result


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("n", (2, 4))
def test_compressed_all_reduce_pipeline(n, dtype):
    numel = 1003
    L = padded_length(numel, n)
    state = {
        name: ([torch.zeros(L) for _ in range(n)], [torch.zeros(L // n) for _ in range(n)])
        for name in ("ref", "tri")
    }
    for step in range(3):
        xs = [make_x(numel, dtype, seed=10 * step + i) for i in range(n)]
        s_ref, r_ref = compressed_all_reduce(R, xs, *state["ref"], dtype)
        s_tri, r_tri = compressed_all_reduce(T, xs, *state["tri"], dtype, block=256)
        torch.testing.assert_close(s_tri, s_ref, rtol=1e-6, atol=0.0)
        assert torch.equal(r_tri, r_ref), f"result differs at step {step}"
        for a, b in zip(state["tri"][0] + state["tri"][1], state["ref"][0] + state["ref"][1]):
            torch.testing.assert_close(a, b, rtol=0.0, atol=1e-6)


# --------------------------------------------------------------------------------------------
# No host synchronisation, argument checks
# --------------------------------------------------------------------------------------------


def test_no_host_sync(monkeypatch):
    """No wrapper reads a device value on the host (it would block on a CUDA stream).

    Reading a tensor's value goes through one of these methods; make them all fail while the
    five operations run. (The interpreter itself reads memory through numpy, not through them.)
    """

    def forbidden(*args, **kwargs):
        raise AssertionError("host read of a tensor value (a device sync on CUDA)")

    for name in ("item", "tolist", "__bool__", "__int__", "__float__", "__index__", "cpu", "numpy"):
        monkeypatch.setattr(torch.Tensor, name, forbidden)
    n, numel = 2, 50
    L = padded_length(numel, n)
    x, error, server_error = torch.randn(numel), torch.zeros(L), torch.zeros(L // n)
    scales = torch.stack([T.worker_scale(x, error), torch.ones(())])
    bits = torch.empty(L // 8, dtype=torch.uint8)
    T.worker_pack(x, error, scales, 0, bits)
    received = bits.view(n, -1)
    T.server_average(received, scales)
    t = T.server_scale(received, scales, server_error)
    out_bits = torch.empty(L // (8 * n), dtype=torch.uint8)
    T.server_pack(received, scales, server_error, t, out_bits)
    T.unpack_scaled(torch.stack([out_bits, out_bits]), torch.stack([t, t]), torch.empty(numel))
    monkeypatch.undo()
    assert error.abs().sum().item() > 0 and server_error.abs().sum().item() > 0


def test_argument_checks():
    error = torch.zeros(16)
    with pytest.raises(ValueError, match="power of two"):
        T.worker_scale(torch.zeros(3), error, block=100)
    with pytest.raises(ValueError, match="padded length"):
        T.worker_scale(torch.zeros(17), error)
    with pytest.raises(ValueError, match="bits_out"):
        T.worker_pack(torch.zeros(3), error, torch.ones(1), 0, torch.empty(3, dtype=torch.uint8))
    with pytest.raises(ValueError, match="rank"):
        T.worker_pack(torch.zeros(3), error, torch.ones(2), 2, torch.empty(2, dtype=torch.uint8))
    with pytest.raises(TypeError, match="error"):
        T.worker_scale(torch.zeros(3), torch.zeros(16, dtype=torch.float64))
    with pytest.raises(ValueError, match="server_error"):
        T.server_scale(torch.zeros(2, 1, dtype=torch.uint8), torch.ones(2), torch.zeros(16))
    with pytest.raises(ValueError, match="out has"):
        T.unpack_scaled(torch.zeros(2, 1, dtype=torch.uint8), torch.ones(2), torch.zeros(17))


# --------------------------------------------------------------------------------------------
# Pieces (one scale per piece, ``bounds=``)
# --------------------------------------------------------------------------------------------


def make_bounds(length: int, seed: int, pieces: int = 5) -> list[int]:
    """Random bounds over ``length`` (multiples of 8), with an empty piece; [0] for length 0."""
    if length == 0:
        return [0]
    g = torch.Generator().manual_seed(3000 + seed)
    cuts = sorted((torch.randint(0, length // 8 + 1, (pieces - 1,), generator=g) * 8).tolist())
    return [0] + cuts + [cuts[-1]] + [length]


def piece_x(numel: int, bounds: list[int], dtype: torch.dtype, seed: int) -> torch.Tensor:
    """``make_x`` with magnitudes that differ by orders of magnitude between pieces."""
    x = make_x(numel, torch.float32, seed)
    for p, (lo, hi) in enumerate(zip(bounds[:-1], bounds[1:])):
        x[lo:hi] *= 10.0 ** ((p * 7 + seed) % 9 - 6)
    return x.to(dtype)


@pytest.mark.parametrize("block", (64, 4096))
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("n", (1, 3))
@pytest.mark.parametrize("numel", (0, 9, 1000))
def test_worker_pieces_match_reference(numel, n, dtype, block):
    L = padded_length(numel, n)
    bounds = make_bounds(L, numel + n)
    P = len(bounds) - 1
    e_ref, e_tri = torch.zeros(L), torch.zeros(L)
    for step in range(3):
        x = piece_x(numel, bounds, dtype, seed=step)
        s_ref = R.worker_scale(x, e_ref, bounds=bounds)
        s_tri = T.worker_scale(x, e_tri, block=block, bounds=bounds)
        assert s_tri.shape == (P,) and s_tri.dtype == torch.float32
        torch.testing.assert_close(s_tri, s_ref, rtol=1e-6, atol=0.0)
        rank = step % n
        scales = make_scales(n * max(P, 1), step)[: n * P].reshape(n, P)
        scales[rank] = s_ref
        b_ref = torch.empty(L // 8, dtype=torch.uint8)
        b_tri = torch.full((L // 8,), 0xA5, dtype=torch.uint8)
        R.worker_pack(x, e_ref, scales, rank, b_ref, bounds=bounds)
        T.worker_pack(x, e_tri, scales, rank, b_tri, block=block, bounds=bounds)
        assert torch.equal(b_tri, b_ref), f"bits differ at step {step}"
        assert torch.equal(e_tri, e_ref), f"error differs at step {step}"
    if L:
        assert e_tri.abs().sum() > 0


def test_worker_pieces_non_finite_scale_leaves_error_untouched():
    x = make_x(60, torch.float32, seed=9)
    bounds = [0, 16, 48, 64]
    error = torch.randn(64)
    before = error.clone()
    scales = make_scales(6, 9).reshape(2, 3)
    scales[1, 2] = float("inf")
    bits = torch.empty(8, dtype=torch.uint8)
    T.worker_pack(x, error, scales, 0, bits, block=64, bounds=bounds)
    assert torch.equal(error, before)
    assert torch.equal(bits, R.pack_signs(R._padded(x, 64) + before))


@pytest.mark.parametrize("block", (64, 4096))
@pytest.mark.parametrize("n", (1, 3))
@pytest.mark.parametrize("chunk", (8, 1000, 4104))
def test_server_pieces_match_reference(chunk, n, block):
    bounds = make_bounds(chunk, chunk + n)
    P = len(bounds) - 1
    se_ref, se_tri = torch.zeros(chunk), torch.zeros(chunk)
    for step in range(3):
        bits = make_bits(n, chunk // 8, seed=step)
        scales = (make_scales(n * P, step) * 10.0 ** (torch.arange(n * P) % 5 - 3)).reshape(n, P)
        avg = T.server_average(bits, scales, block=block, bounds=bounds)
        assert torch.equal(avg, R.server_average(bits, scales, bounds=bounds))
        t_ref = R.server_scale(bits, scales, se_ref, bounds=bounds)
        t_tri = T.server_scale(bits, scales, se_tri, block=block, bounds=bounds)
        assert t_tri.shape == (P,)
        torch.testing.assert_close(t_tri, t_ref, rtol=1e-6, atol=0.0)
        o_ref = torch.empty(chunk // 8, dtype=torch.uint8)
        o_tri = torch.full((chunk // 8,), 0x5A, dtype=torch.uint8)
        R.server_pack(bits, scales, se_ref, t_ref, o_ref, bounds=bounds)
        T.server_pack(bits, scales, se_tri, t_ref, o_tri, block=block, bounds=bounds)
        assert torch.equal(o_tri, o_ref), f"bits differ at step {step}"
        assert torch.equal(se_tri, se_ref), f"server error differs at step {step}"
    if n > 1:
        assert se_tri.abs().sum() > 0
    # one non-finite piece scale keeps the whole server error
    before = se_tri.clone()
    bad = t_ref.clone()
    bad[-1] = float("nan")
    T.server_pack(bits, scales, se_tri, bad, o_tri, block=block, bounds=bounds)
    assert torch.equal(se_tri, before)


@pytest.mark.parametrize("block", (64, 4096))
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("n", (1, 3))
def test_unpack_scaled_pieces_match_reference(n, dtype, block):
    chunk = 1000
    bits = make_bits(n, chunk // 8, seed=40 + n)
    bounds = make_bounds(n * chunk, 40 + n, pieces=7)
    scales = (make_scales(len(bounds) - 1, n) / 3).to(torch.float32)
    total = n * chunk
    for numel in (0, 1, total - 5, total):
        out_ref = torch.empty(numel, dtype=dtype)
        out_tri = torch.full((numel,), 7.0, dtype=dtype)
        R.unpack_scaled(bits, scales, out_ref, bounds=bounds)
        T.unpack_scaled(bits, scales, out_tri, block=block, bounds=bounds)
        assert torch.equal(out_tri, out_ref), f"numel={numel}"


def test_pieces_no_host_sync(monkeypatch):
    """The piece variants read no device value on the host either (tables are built first)."""
    n, numel = 2, 50
    L = padded_length(numel, n)
    bounds, local, everything = [0, 16, 48, 64], [0, 16, 32], [0, 16, 48, 64]
    x, error, server_error = torch.randn(numel), torch.zeros(L), torch.zeros(L // n)
    for b, length in ((bounds, L), (local, L // n), (everything, L)):
        T._tables(b, length, T.DEFAULT_BLOCK, error.device)  # the static tables, built once

    def forbidden(*args, **kwargs):
        raise AssertionError("host read of a tensor value (a device sync on CUDA)")

    for name in ("item", "tolist", "__bool__", "__int__", "__float__", "__index__", "cpu", "numpy"):
        monkeypatch.setattr(torch.Tensor, name, forbidden)
    own = T.worker_scale(x, error, bounds=bounds)
    scales = torch.stack([own, torch.ones(3)])
    bits = torch.empty(L // 8, dtype=torch.uint8)
    T.worker_pack(x, error, scales, 0, bits, bounds=bounds)
    received = bits.view(n, -1)
    chunk_scales = scales[:, :2].contiguous()
    t = T.server_scale(received, chunk_scales, server_error, bounds=local)
    out_bits = torch.empty(L // (8 * n), dtype=torch.uint8)
    T.server_pack(received, chunk_scales, server_error, t, out_bits, bounds=local)
    T.unpack_scaled(torch.stack([out_bits, out_bits]), torch.ones(3), torch.empty(numel), bounds=everything)
    monkeypatch.undo()
    assert error.abs().sum().item() > 0 and server_error.abs().sum().item() > 0


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_the_self_test_passes_the_triton_kernels(monkeypatch, dtype):
    """What attach runs for CUDA buckets, here through the interpreter (the same kernels)."""
    from hf_onebit.kernels import selftest

    monkeypatch.setattr(selftest, "_PASSED", set())
    monkeypatch.setenv("HF_ONEBIT_KERNELS", "triton")
    assert selftest.self_test("cpu", dtype) == "triton"
