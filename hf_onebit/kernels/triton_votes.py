"""BinSGDM's two Triton kernels and their host functions: the worker math and the draws.

:func:`vote_threshold` is one elementwise pass of :func:`hf_onebit.kernels.reference.vote_threshold`
over a flat bucket; :func:`vote_uniform` draws numpy's Philox-4x64 numbers for every parameter of a
bucket in one launch, bitwise what the CPU backend draws. Both are part of the Triton backend
(:mod:`hf_onebit.kernels.triton` exports them); why their arithmetic agrees bitwise with the
reference is said in :mod:`hf_onebit.kernels.triton_kernels`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import contract
from .triton_kernels import DEFAULT_BLOCK, _check_block, _launch_options, _on_device, _same_device


# --------------------------------------------------------------------------------------------
# BinSGDM's worker math: one elementwise pass over a flat bucket
# --------------------------------------------------------------------------------------------


@triton.jit
def _vote_threshold_kernel(m_ptr, b_ptr, g_ptr, m_out_ptr, b_out_ptr, theta_ptr, numel, beta, one_minus_beta, eps,
                           NAN_TO_ZERO: tl.constexpr, BLOCK: tl.constexpr):
    """``m_out``, ``b_out`` and ``theta`` of :func:`hf_onebit.kernels.reference.vote_threshold`.

    Bitwise the reference's torch operations: each product and sum rounded on its own (the launch
    turns fused multiply-add off), the scalars fp32 as torch rounds them, and the division
    ``div_rn`` (Triton's plain ``/`` is approximate on NVIDIA GPUs, see :mod:`.triton_kernels`).
    """
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < numel
    g = tl.load(g_ptr + offs, mask=ok, other=0.0)
    m = tl.load(m_ptr + offs, mask=ok, other=0.0)
    b = tl.load(b_ptr + offs, mask=ok, other=0.0)
    m_new = m * beta + g * one_minus_beta
    b_new = b * beta + tl.abs(g) * one_minus_beta
    z = tl.math.div_rn(m_new, b_new + eps)
    if NAN_TO_ZERO:  # eps == 0: 0/0 of a coordinate that never had a gradient is z = 0
        z = tl.where(z != z, 0.0, z)
    tl.store(m_out_ptr + offs, m_new, mask=ok)
    tl.store(b_out_ptr + offs, b_new, mask=ok)
    tl.store(theta_ptr + offs, (z + 1.0) * 0.5, mask=ok)


# --------------------------------------------------------------------------------------------
# BinSGDM's draws: numpy's Philox-4x64 for every parameter of a bucket in one launch
# --------------------------------------------------------------------------------------------
# The numbers of hf_onebit.kernels.cpu_votes._vote_uniform (see there: numpy's float32 draws of
# a fresh generator per counter [0, 0, index, step]), so CUDA draws what CPU draws. One row of
# a program's tile is one Philox block (four 64-bit words, eight floats) of one parameter; a
# row finds its parameter by a branchless binary search over the parameters' first blocks.


@triton.jit
def _mulhilo64(a, b):
    """``(hi, lo)`` 64-bit halves of the 128-bit product of the uint64 ``a`` and ``b``."""
    low = 0xFFFFFFFF
    a_lo, a_hi = a & low, a >> 32
    b_lo, b_hi = b & low, b >> 32
    p0, p1, p2, p3 = a_lo * b_lo, a_lo * b_hi, a_hi * b_lo, a_hi * b_hi
    mid = (p0 >> 32) + (p1 & low) + (p2 & low)
    return p3 + (p1 >> 32) + (p2 >> 32) + (mid >> 32), a * b


@triton.jit
def _philox4x64(c0, c1, c2, c3, k0, k1):
    """Philox-4x64-10 (Random123, as numpy runs it) of the counter ``c`` under the key ``k``."""
    m0 = tl.full(c0.shape, 0xD2E7470EE14C6C93, tl.uint64)
    m1 = tl.full(c0.shape, 0xCA5A826395121157, tl.uint64)
    for r in tl.static_range(10):
        if r > 0:
            k0 = k0 + 0x9E3779B97F4A7C15
            k1 = k1 + 0xBB67AE8584CAA73B
        hi0, lo0 = _mulhilo64(m0, c0)
        hi1, lo1 = _mulhilo64(m1, c2)
        c0, c1, c2, c3 = hi1 ^ c1 ^ k0, lo1, hi0 ^ c3 ^ k1, lo0
    return c0, c1, c2, c3


@triton.jit
def _u64(a, b, c):
    """The uint64 ``a·2**44 + b·2**22 + c`` from three 22-bit chunks (see ``triton.vote_uniform``)."""
    return (a.to(tl.uint64) << 44) | (b.to(tl.uint64) << 22) | c.to(tl.uint64)


# The counters arrive as 22-bit chunks, so every scalar is an i32 whatever its value, and none is
# specialised (Triton would compile a variant for a chunk equal to 1 or divisible by 16): one
# compiled kernel serves every seed, stream and step (the step changes every call).
@triton.jit(do_not_specialize=["pieces", "seed_a", "seed_b", "seed_c", "stream_a", "stream_b", "stream_c",
                               "step_a", "step_b", "step_c"])
def _vote_uniform_kernel(out_ptr, table_ptr, pieces, seed_a, seed_b, seed_c, stream_a, stream_b, stream_c,
                         step_a, step_b, step_c, SEARCH_BITS: tl.constexpr, ROWS: tl.constexpr):
    """``out[offsets[i] + j]`` = draw ``j`` of counter ``[0, 0, indices[i], step]`` under the key
    ``(seed, stream)``. ``table`` (int64, 3 rows of ``pieces + 1``): the pieces' offsets in ``out``,
    their first Philox blocks (prefix sums of ``ceil(n_i / 8)``) and their indices.
    ``2**SEARCH_BITS >= pieces`` (the binary search's span)."""
    offsets_ptr, firsts_ptr, indices_ptr = table_ptr, table_ptr + (pieces + 1), table_ptr + 2 * (pieces + 1)
    row = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
    blocks = tl.load(firsts_ptr + pieces)
    # the last piece whose first block is <= row (an empty piece shares its first block with the
    # next one, so it is never chosen for a row it does not own)
    piece = tl.zeros([ROWS], dtype=tl.int64)
    for s in tl.static_range(SEARCH_BITS):
        cand = piece + (1 << (SEARCH_BITS - 1 - s))
        ok = cand < pieces
        first = tl.load(firsts_ptr + cand, mask=ok, other=0)
        piece = tl.where(ok & (first <= row), cand, piece)
    k = row - tl.load(firsts_ptr + piece)
    start = tl.load(offsets_ptr + piece)
    numel = tl.load(offsets_ptr + piece + 1) - start
    index = tl.load(indices_ptr + piece).to(tl.uint64)
    zero = tl.zeros([ROWS], dtype=tl.uint64)
    w0, w1, w2, w3 = _philox4x64((k + 1).to(tl.uint64), zero, index, zero + _u64(step_a, step_b, step_c),
                                 zero + _u64(seed_a, seed_b, seed_c), zero + _u64(stream_a, stream_b, stream_c))
    lane = tl.arange(0, 8)[None, :]
    word = tl.where(lane < 4, tl.where(lane < 2, w0[:, None], w1[:, None]),
                    tl.where(lane < 6, w2[:, None], w3[:, None]))
    half = tl.where(lane % 2 == 1, word >> 32, word & 0xFFFFFFFF)
    value = (half >> 8).to(tl.float32) * 5.9604644775390625e-08  # 2**-24: exact
    at = 8 * k[:, None] + lane
    tl.store(out_ptr + start[:, None] + at, value, mask=(row < blocks)[:, None] & (at < numel[:, None]))


# --------------------------------------------------------------------------------------------
# The host functions
# --------------------------------------------------------------------------------------------


def vote_threshold(m: torch.Tensor, b: torch.Tensor, g: torch.Tensor, *, beta: float, eps: float,
                   m_out: torch.Tensor, b_out: torch.Tensor, theta: torch.Tensor, block: int = DEFAULT_BLOCK) -> None:
    """One pass of :func:`hf_onebit.kernels.reference.vote_threshold` (bitwise the same) over a
    flat bucket: reads ``m, b, g``, writes ``m_out, b_out, theta`` (24 bytes per element; the
    reference's ten torch operations move about 80 and launch ten kernels). No host sync."""
    _check_block(block)
    numel = contract.check_vote(m, b, g, m_out, b_out, theta)
    _same_device(m, b, g, m_out, b_out, theta)
    if numel == 0:
        return
    with _on_device(m):
        # The scalars go as Python floats, which Triton passes as fp32 (rounded as torch rounds a
        # Python scalar against an fp32 tensor); ``1 - beta`` is formed in double first, as torch does.
        _vote_threshold_kernel[(triton.cdiv(numel, block),)](
            m, b, g, m_out, b_out, theta, numel, float(beta), float(1.0 - beta), float(eps),
            NAN_TO_ZERO=eps == 0.0, BLOCK=block, **_launch_options(block),
        )


def vote_uniform_table(offsets, indices, device) -> tuple:
    """The device table :func:`vote_uniform` reads for one bucket layout, made once per layout (a
    host-to-device copy): int64 rows of the pieces' offsets, their first Philox blocks (prefix
    sums of ``ceil(n_i / 8)``) and their indices; with the last offset, kept on the host."""
    offsets, indices = contract.check_vote_pieces(offsets, indices)
    firsts = [0]
    for a, b in zip(offsets, offsets[1:]):
        firsts.append(firsts[-1] + (b - a + 7) // 8)
    return torch.tensor([offsets, firsts, indices + [0]], dtype=torch.int64, device=device), offsets[-1]


def vote_uniform(out: torch.Tensor, table, *, seed: int, stream: int, step: int, rows: int = 128) -> None:
    """:func:`hf_onebit.kernels.reference.vote_uniform` (numpy's Philox per piece, bitwise) for
    the whole bucket in one launch, so CUDA draws exactly what CPU draws. ``rows``: Philox blocks
    (8 floats each) per program, a power of two. No host sync."""
    device_table, last = table
    contract.check_vote_uniform(out, last, seed, stream, step)
    _same_device(out, device_table)
    if rows < 1 or rows & (rows - 1):
        raise ValueError(f"rows must be a power of two, got {rows}")
    pieces = device_table.shape[1] - 1
    if pieces == 0:
        return
    # an upper bound of the Philox blocks from host metadata (the exact count is on the device):
    # the pieces lie within out, so there are at most numel/8 + pieces of them
    bound = out.numel() // 8 + pieces
    # 22-bit chunks: i32 arguments whatever the values (see the kernel); the search spans 2**16
    # pieces (a bucket of more gets a second variant), so one compiled kernel serves every bucket
    chunks = [(int(x) >> shift) & 0x3FFFFF for x in (seed, stream, step) for shift in (44, 22, 0)]
    with _on_device(out):
        _vote_uniform_kernel[(triton.cdiv(bound, rows),)](
            out, device_table, pieces, *chunks, SEARCH_BITS=max(16, (pieces - 1).bit_length()), ROWS=rows,
            **_launch_options(rows * 8),
        )
