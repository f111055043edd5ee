"""The device code of the Triton backend's piece variants (``bounds=``): one tile (at most
``BLOCK`` elements of one piece) per program, found in the tables that
:mod:`hf_onebit.kernels.triton_pieces` builds (its docstring describes the layout), and the
deterministic segmented sum of the tiles' partial sums of squares.
"""

from __future__ import annotations

import triton
import triton.language as tl

from .triton_kernels import (
    _abs_bits,
    _amax_to_scale,
    _and_flag,
    _pack_bytes,
    _qmean,
    _qpack_store,
    _qunpack_store,
    _qz,
    _unpack_bytes,
)

# --------------------------------------------------------------------------------------------
# Piece kernels: one tile (<= BLOCK elements of one piece) per program
# --------------------------------------------------------------------------------------------


@triton.jit
def _piece_tile(tile_start_ptr, tile_piece_ptr, bounds_ptr, BLOCK: tl.constexpr):
    """This tile's piece, its byte and element indices, and which bytes lie in the piece."""
    pid = tl.program_id(0).to(tl.int64)
    start = tl.load(tile_start_ptr + pid)
    p = tl.load(tile_piece_ptr + pid).to(tl.int64)
    end = tl.load(bounds_ptr + p + 1)
    byte = start // 8 + tl.arange(0, BLOCK // 8).to(tl.int64)
    elem = byte[:, None] * 8 + tl.arange(0, 8)[None, :]
    return p, byte, elem, byte < end // 8


@triton.jit
def _segment_sum_kernel(partial_ptr, tile_lo_ptr, out_ptr, R: tl.constexpr):
    """``out[p] = Σ partial[tile_lo[p] : tile_lo[p + 1]]``, in a fixed order (deterministic)."""
    p = tl.program_id(0).to(tl.int64)
    lo = tl.load(tile_lo_ptr + p)
    hi = tl.load(tile_lo_ptr + p + 1)
    acc = tl.zeros([R], dtype=tl.float64)
    for i in range(lo, hi, R):
        k = i + tl.arange(0, R)
        acc += tl.load(partial_ptr + k, mask=k < hi, other=0.0)
    tl.store(out_ptr + p, tl.sum(acc, axis=0))


@triton.jit
def _worker_sumsq_pieces_kernel(
    x_ptr, err_ptr, tile_start_ptr, tile_piece_ptr, bounds_ptr, partial_ptr, N, BLOCK: tl.constexpr
):
    p, byte, elem, byte_ok = _piece_tile(tile_start_ptr, tile_piece_ptr, bounds_ptr, BLOCK)
    ok = byte_ok[:, None]
    x = tl.load(x_ptr + elem, mask=ok & (elem < N), other=0.0).to(tl.float32)
    e = tl.load(err_ptr + elem, mask=ok, other=0.0)
    y = (x + e).to(tl.float64)
    tl.store(partial_ptr + tl.program_id(0).to(tl.int64), tl.sum(tl.sum(y * y, axis=1), axis=0))


@triton.jit
def _worker_pack_pieces_kernel(
    x_ptr, err_ptr, own_ptr, flag_ptr, bits_ptr, tile_start_ptr, tile_piece_ptr, bounds_ptr, N,
    BLOCK: tl.constexpr,
):
    """Bits of ``y = x + e``; ``e = y - s[piece]·sign⁺(y)`` if the flag (all scales finite) is set."""
    p, byte, elem, byte_ok = _piece_tile(tile_start_ptr, tile_piece_ptr, bounds_ptr, BLOCK)
    ok = byte_ok[:, None]
    x = tl.load(x_ptr + elem, mask=ok & (elem < N), other=0.0).to(tl.float32)
    e = tl.load(err_ptr + elem, mask=ok, other=0.0)
    y = x + e
    positive = y >= 0
    tl.store(bits_ptr + byte, _pack_bytes(positive), mask=byte_ok)
    s = tl.load(own_ptr + p)
    all_finite = tl.load(flag_ptr) != 0
    tl.store(err_ptr + elem, y - tl.where(positive, s, -s), mask=_and_flag(ok, all_finite))


@triton.jit
def _server_mean_pieces(bits_ptr, scales_ptr, p, P, byte, byte_ok, n, row_bytes, BLOCK: tl.constexpr):
    """``a = (Σ_i s[i, p]·sign⁺_i) / n`` on one tile of piece ``p``, in rank order."""
    acc = tl.zeros([BLOCK // 8, 8], dtype=tl.float32)
    row_ptr = bits_ptr + byte
    for i in range(n):
        packed = tl.load(row_ptr, mask=byte_ok, other=0)
        s = tl.load(scales_ptr + i * P + p)
        acc += tl.where(_unpack_bytes(packed), s, -s)
        row_ptr += row_bytes
    return tl.math.div_rn(acc, tl.full(acc.shape, n, tl.float32))  # same shape: older Triton does not broadcast here


@triton.jit
def _server_average_pieces_kernel(
    bits_ptr, scales_ptr, out_ptr, tile_start_ptr, tile_piece_ptr, bounds_ptr, n, P, row_bytes,
    BLOCK: tl.constexpr,
):
    p, byte, elem, byte_ok = _piece_tile(tile_start_ptr, tile_piece_ptr, bounds_ptr, BLOCK)
    a = _server_mean_pieces(bits_ptr, scales_ptr, p, P, byte, byte_ok, n, row_bytes, BLOCK)
    tl.store(out_ptr + elem, a, mask=byte_ok[:, None])


@triton.jit
def _server_sumsq_pieces_kernel(
    bits_ptr, scales_ptr, serr_ptr, partial_ptr, tile_start_ptr, tile_piece_ptr, bounds_ptr, n, P,
    row_bytes, BLOCK: tl.constexpr,
):
    p, byte, elem, byte_ok = _piece_tile(tile_start_ptr, tile_piece_ptr, bounds_ptr, BLOCK)
    ok = byte_ok[:, None]
    a = _server_mean_pieces(bits_ptr, scales_ptr, p, P, byte, byte_ok, n, row_bytes, BLOCK)
    z = a + tl.load(serr_ptr + elem, mask=ok, other=0.0)
    z = tl.where(ok, z, 0.0).to(tl.float64)
    tl.store(partial_ptr + tl.program_id(0).to(tl.int64), tl.sum(tl.sum(z * z, axis=1), axis=0))


@triton.jit
def _server_pack_pieces_kernel(
    bits_ptr, scales_ptr, serr_ptr, t_ptr, flag_ptr, out_bits_ptr, tile_start_ptr, tile_piece_ptr,
    bounds_ptr, n, P, row_bytes, BLOCK: tl.constexpr,
):
    p, byte, elem, byte_ok = _piece_tile(tile_start_ptr, tile_piece_ptr, bounds_ptr, BLOCK)
    ok = byte_ok[:, None]
    a = _server_mean_pieces(bits_ptr, scales_ptr, p, P, byte, byte_ok, n, row_bytes, BLOCK)
    z = a + tl.load(serr_ptr + elem, mask=ok, other=0.0)
    positive = z >= 0
    tl.store(out_bits_ptr + byte, _pack_bytes(positive), mask=byte_ok)
    t = tl.load(t_ptr + p)
    all_finite = tl.load(flag_ptr) != 0
    tl.store(serr_ptr + elem, z - tl.where(positive, t, -t), mask=_and_flag(ok, all_finite))


@triton.jit
def _unpack_pieces_kernel(
    bits_ptr, table_ptr, out_ptr, tile_start_ptr, tile_piece_ptr, bounds_ptr, numel, BLOCK: tl.constexpr
):
    """``out[k] = ±s[piece(k)]`` for ``k < numel``; ``table`` holds ``(-s_p, +s_p)`` in out's dtype."""
    p, byte, elem, byte_ok = _piece_tile(tile_start_ptr, tile_piece_ptr, bounds_ptr, BLOCK)
    byte_ok = byte_ok & (byte * 8 < numel)
    packed = tl.load(bits_ptr + byte, mask=byte_ok, other=0)
    neg = tl.load(table_ptr + 2 * p)
    pos = tl.load(table_ptr + 2 * p + 1)
    values = tl.where(_unpack_bytes(packed), pos, neg)
    tl.store(out_ptr + elem, values, mask=byte_ok[:, None] & (elem < numel))



# --------------------------------------------------------------------------------------------
# The b-bit exchange: the piece variants of the q kernels of triton_kernels
# --------------------------------------------------------------------------------------------


@triton.jit
def _qpiece_tile(tile_start_ptr, tile_piece_ptr, bounds_ptr, WIDTH: tl.constexpr, BLOCK: tl.constexpr):
    """:func:`_piece_tile` for ``WIDTH``-bit codes: bytes ``[BLOCK // PER]``, elements ``[BLOCK // PER, PER]``."""
    PER: tl.constexpr = 8 // WIDTH
    pid = tl.program_id(0).to(tl.int64)
    start = tl.load(tile_start_ptr + pid)
    p = tl.load(tile_piece_ptr + pid).to(tl.int64)
    end = tl.load(bounds_ptr + p + 1)
    byte = start // PER + tl.arange(0, BLOCK // PER).to(tl.int64)
    elem = byte[:, None] * PER + tl.arange(0, PER)[None, :]
    return p, byte, elem, byte < end // PER


@triton.jit
def _segment_amax_kernel(partial_ptr, tile_lo_ptr, out_ptr, WIDTH: tl.constexpr, R: tl.constexpr):
    """``out[p] = max(partial[tile_lo[p] : tile_lo[p + 1]]) / Q`` (int32 bits; 0 for an empty piece)."""
    p = tl.program_id(0).to(tl.int64)
    lo = tl.load(tile_lo_ptr + p)
    hi = tl.load(tile_lo_ptr + p + 1)
    acc = tl.zeros([R], dtype=tl.int32)
    for i in range(lo, hi, R):
        k = i + tl.arange(0, R)
        acc = tl.maximum(acc, tl.load(partial_ptr + k, mask=k < hi, other=0))
    tl.store(out_ptr + p, _amax_to_scale(tl.max(acc, axis=0), WIDTH))


@triton.jit
def _qworker_amax_pieces_kernel(
    x_ptr, err_ptr, tile_start_ptr, tile_piece_ptr, bounds_ptr, partial_ptr, N, BLOCK: tl.constexpr
):
    """``partial[tile] = max |x + e|`` (int32 bits) over the tile."""
    p, byte, elem, byte_ok = _piece_tile(tile_start_ptr, tile_piece_ptr, bounds_ptr, BLOCK)
    ok = byte_ok[:, None]
    x = tl.load(x_ptr + elem, mask=ok & (elem < N), other=0.0).to(tl.float32)
    e = tl.load(err_ptr + elem, mask=ok, other=0.0)
    bits = _abs_bits(x + e)  # masked lanes: |0| = bits 0
    tl.store(partial_ptr + tl.program_id(0).to(tl.int64), tl.max(tl.max(bits, axis=1), axis=0))


@triton.jit
def _qworker_pack_pieces_kernel(
    x_ptr, err_ptr, own_ptr, flag_ptr, codes_ptr, tile_start_ptr, tile_piece_ptr, bounds_ptr, N,
    WIDTH: tl.constexpr, BLOCK: tl.constexpr,
):
    """Codes of ``y = x + e`` at ``s[piece]``; ``e = y - s·q`` if the flag (all scales finite) is set."""
    p, byte, elem, byte_ok = _qpiece_tile(tile_start_ptr, tile_piece_ptr, bounds_ptr, WIDTH, BLOCK)
    ok = byte_ok[:, None]
    x = tl.load(x_ptr + elem, mask=ok & (elem < N), other=0.0).to(tl.float32)
    e = tl.load(err_ptr + elem, mask=ok, other=0.0)
    s = tl.load(own_ptr + p)
    all_finite = tl.load(flag_ptr) != 0
    _qpack_store(x + e, s, all_finite, codes_ptr, err_ptr, byte, elem, byte_ok, WIDTH)


@triton.jit
def _qserver_average_pieces_kernel(
    codes_ptr, scales_ptr, out_ptr, tile_start_ptr, tile_piece_ptr, bounds_ptr, n, P, row_bytes,
    WIDTH: tl.constexpr, BLOCK: tl.constexpr,
):
    p, byte, elem, byte_ok = _qpiece_tile(tile_start_ptr, tile_piece_ptr, bounds_ptr, WIDTH, BLOCK)
    a = _qmean(codes_ptr, scales_ptr, P, p, byte, byte_ok, n, row_bytes, WIDTH, BLOCK)
    tl.store(out_ptr + elem, a, mask=byte_ok[:, None])


@triton.jit
def _qserver_amax_pieces_kernel(
    codes_ptr, scales_ptr, serr_ptr, partial_ptr, tile_start_ptr, tile_piece_ptr, bounds_ptr, n, P,
    row_bytes, WIDTH: tl.constexpr, BLOCK: tl.constexpr,
):
    p, byte, elem, byte_ok = _qpiece_tile(tile_start_ptr, tile_piece_ptr, bounds_ptr, WIDTH, BLOCK)
    z = _qz(codes_ptr, scales_ptr, P, p, serr_ptr, byte, elem, byte_ok, n, row_bytes, WIDTH, BLOCK)
    bits = tl.where(byte_ok[:, None], _abs_bits(z), 0)
    tl.store(partial_ptr + tl.program_id(0).to(tl.int64), tl.max(tl.max(bits, axis=1), axis=0))


@triton.jit
def _qserver_pack_pieces_kernel(
    codes_ptr, scales_ptr, serr_ptr, t_ptr, flag_ptr, out_ptr, tile_start_ptr, tile_piece_ptr,
    bounds_ptr, n, P, row_bytes, WIDTH: tl.constexpr, BLOCK: tl.constexpr,
):
    p, byte, elem, byte_ok = _qpiece_tile(tile_start_ptr, tile_piece_ptr, bounds_ptr, WIDTH, BLOCK)
    z = _qz(codes_ptr, scales_ptr, P, p, serr_ptr, byte, elem, byte_ok, n, row_bytes, WIDTH, BLOCK)
    t = tl.load(t_ptr + p)
    all_finite = tl.load(flag_ptr) != 0
    _qpack_store(z, t, all_finite, out_ptr, serr_ptr, byte, elem, byte_ok, WIDTH)


@triton.jit
def _qunpack_pieces_kernel(
    codes_ptr, table_ptr, out_ptr, tile_start_ptr, tile_piece_ptr, bounds_ptr, numel,
    WIDTH: tl.constexpr, BLOCK: tl.constexpr,
):
    """``out[k] = s[piece(k)]·q_k`` for ``k < numel``, from the per-piece table of values."""
    p, byte, elem, byte_ok = _qpiece_tile(tile_start_ptr, tile_piece_ptr, bounds_ptr, WIDTH, BLOCK)
    PER: tl.constexpr = 8 // WIDTH
    _qunpack_store(codes_ptr, table_ptr, out_ptr, p, byte, elem, byte_ok & (byte * PER < numel), numel, WIDTH)
