"""Triton kernels for the 1-bit compressor on CUDA tensors (spec §1).

Same five operations, same signatures and the same results as :mod:`hf_onebit.kernels.reference`
(read its docstring first for the vocabulary: ``x``, ``N``, ``L``, ``error``, ``bits``,
``sign⁺``). Every public function also takes a keyword-only ``block`` (elements per Triton
program); callers never need it, tests use it to exercise several tilings.

Design
------
The compressor is memory bound: a handful of flops per element against 8-12 bytes of traffic.
So the goal is the fewest passes over memory, and no host synchronisation.

Worker side, two passes over ``x`` and ``error``:

1. :func:`worker_scale` reads ``x`` (zero padded to ``L`` through the load mask: no padded copy)
   and ``error``, and writes one partial sum of squares of ``y = x + error`` per program into a
   small float64 buffer. Summing those partials and the ``sqrt`` are three tiny torch ops on the
   device.
2. :func:`worker_pack` reads ``x`` and ``error`` again, packs ``sign⁺(y)`` into bytes and
   writes ``error = y - s·sign⁺(y)``.

Why two passes and not one: the error update needs the scale ``s``, which is a reduction over
the *whole* buffer, and on top of that the all-reduce must exchange every rank's scale before
any error buffer is written (a non-finite scale on any rank must leave all error buffers
untouched). So the scale must be complete and exchanged before pass 2 starts; a single fused
pass would need a grid-wide barrier plus a collective in the middle of a kernel.

Why no host sync: the "are all scales finite?" decision is taken *inside* the kernels. Each
program loads the ``n`` scales (``n`` is the world size, tiny), computes the flag and uses it
as a store mask for the error. Nothing ever calls ``.item()``/``bool()`` on a device tensor, so
the whole compressed all-reduce stays queued on the executor's side stream
(:class:`hf_onebit.comm.executor.StreamExecutor`) and overlaps with backward on the compute stream.

Server side, again two passes (scale, then pack) over ``n`` rows of received bits plus the
server error, for the same reason. The average ``a = (Σ_i s_i·sign⁺_i) / n`` is recomputed in
both passes instead of being materialised: recomputing it reads ``n/8`` bytes per element,
storing and reloading it would move 8 (so recomputing is cheaper below 64 ranks).

:func:`unpack_scaled` reads the gathered bits once and writes ``±t_j`` directly in the dtype of
the destination (the gradient bucket), with no fp32 intermediate.

Bitwise agreement with the reference
------------------------------------
* Signs: ``y >= 0`` is an ordered comparison, false for NaN, so NaN packs as bit 0 as in torch.
* Error: ``y - where(y >= 0, s, -s)`` equals the reference's ``y - s·sign⁺(y)`` exactly
  (``s·(±1)`` is exact), and no fused multiply-add can change the rounding.
* Server average: summed in rank order ``i = 0..n-1`` in fp32 like the reference, and divided
  with ``tl.math.div_rn``. The plain ``/`` of Triton compiles to an approximate division on
  NVIDIA GPUs (``div.full.f32``, up to 2 ulp: checked in the PTX for sm_80), which would make
  ``a``, hence the server error and the sign of a near-zero ``z``, differ from torch.
* Scales: squares are accumulated in float64 like the reference (this also avoids fp32
  overflow of ``y²`` for ``|y| > 1.8e19``), but in a different order, so scales agree to
  rounding rather than bitwise (the reference documents this tolerance).

Sizes: program ids are widened to int64 before any multiplication, so buffers with more than
``2**31`` elements (or bits) index correctly. Empty buffers launch nothing.

Pieces (``bounds=``, see the reference): the grid is a list of *tiles*, each at most ``BLOCK``
elements of exactly one piece (a piece of ``m`` elements has ``ceil(m / BLOCK)`` tiles, the
first starting at the piece's start). A program loads its tile's start and piece index from a
small table, so it needs one scale and never a per-element lookup. Per-piece sums of squares
are one float64 partial per tile, then a deterministic segmented sum (one program per piece
adds its tiles in order). The tables depend only on the bounds and the block size, which are
static for a compressed all-reduce, so they are built once on the host and cached on the
device. The finite checks of the piece variants are one tiny device op (``isfinite().all()``)
whose flag the kernels read, so they never sync with the host either.
"""

from __future__ import annotations

import contextlib
import functools

import torch
import triton
import triton.language as tl

from . import contract
from .reference import check_bounds, pack_bools, pack_signs, unpack_signs

__all__ = [
    "check_bounds",
    "DEFAULT_BLOCK",
    "pack_bools",
    "pack_signs",
    "server_average",
    "server_pack",
    "server_scale",
    "unpack_scaled",
    "unpack_signs",
    "worker_pack",
    "worker_scale",
]

# Elements per Triton program. The kernels stream memory: pass 2 of the worker moves about
# 12 bytes per element (x and error in, error out), so 2048 elements is ~24 KB per program.
# With 8 warps (see _launch_options) that is 8 elements per thread, i.e. two 16-byte vector
# loads per fp32 tensor: enough bytes in flight to hide DRAM latency while staying at ~32
# registers per thread (full occupancy; compiled for sm_80, no spills). A 25 MB DDP bucket
# still gives ~3000 programs, many waves on every GPU, and the per-program fixed costs
# (loading the n scales, the finite flag, one partial sum) are amortised over 2048 elements.
DEFAULT_BLOCK = 2048


def _launch_options(block: int) -> dict:
    # 256 elements per warp (8 per thread) up to 8 warps; small test blocks get fewer warps
    # rather than threads that would all hold copies of the same few elements.
    # No multiply feeds an add whose rounding matters in these kernels, but turning fused
    # multiply-add off states that results are plain IEEE operations (as in torch) whatever a
    # future edit adds; it also silences Triton 3.9's warning about the fusion default.
    return {"num_warps": min(8, max(1, block // 256)), "enable_fp_fusion": False}


_FLOAT_INPUTS = (torch.float32, torch.bfloat16, torch.float16, torch.float64)


# --------------------------------------------------------------------------------------------
# Device helpers (inlined into the kernels)
# --------------------------------------------------------------------------------------------


@triton.jit
def _is_finite(v):
    # |v| <= FLT_MAX is false for ±inf and for NaN (every comparison with NaN is false). This
    # needs no libdevice isinf/isnan, so it also runs in the CPU interpreter.
    return tl.abs(v) <= 3.4028234663852886e38


@triton.jit
def _and_flag(mask, flag):
    # ``mask & flag`` for a block mask and a scalar flag. Written as a select because the Triton
    # 3.9 CPU interpreter (used by the tests) mis-types ``block & scalar`` of booleans as int32
    # and then rejects it as a store mask; on the GPU both forms compile to the same predicate.
    return tl.where(flag, mask, False)


@triton.jit
def _pack_bytes(positive):
    """``[B, 8]`` booleans -> ``[B]`` uint8, element 0 of each row in the most significant bit."""
    weights = 1 << (7 - tl.arange(0, 8))  # 128, 64, ..., 1
    # Summed in int32 and cast once: the sum is at most 255, so the cast is exact. (Storing a
    # wider integer into a uint8 pointer would truncate silently: keep the cast explicit.)
    return tl.sum(positive.to(tl.int32) * weights[None, :], axis=1).to(tl.uint8)


@triton.jit
def _unpack_bytes(packed):
    """``[B]`` uint8 -> ``[B, 8]`` booleans (True = bit set = sign +1), MSB first."""
    shifts = 7 - tl.arange(0, 8)
    # uint8 -> int32 zero-extends, so the shifts never see a sign bit.
    return ((packed.to(tl.int32)[:, None] >> shifts[None, :]) & 1) != 0


@triton.jit
def _tile(BLOCK: tl.constexpr):
    """This program's byte indices ``[BLOCK // 8]`` and element indices ``[BLOCK // 8, 8]``.

    Working on a ``[bytes, 8]`` tile makes the pack/unpack a row reduction/broadcast. The
    element indices are still one contiguous range, so loads and stores stay coalesced.
    """
    BYTES: tl.constexpr = BLOCK // 8
    # int64 before multiplying: pid * BYTES * 8 overflows int32 beyond 2**31 elements.
    pid = tl.program_id(0).to(tl.int64)
    byte = pid * BYTES + tl.arange(0, BYTES)
    elem = byte[:, None] * 8 + tl.arange(0, 8)[None, :]
    return byte, elem


@triton.jit
def _server_mean(bits_ptr, scales_ptr, byte, byte_ok, n, row_bytes, BLOCK: tl.constexpr):
    """``a = (Σ_i s_i·sign⁺_i) / n`` on one tile, summed in rank order like the reference."""
    acc = tl.zeros([BLOCK // 8, 8], dtype=tl.float32)
    # Walk the rows with a pointer: pointer arithmetic is 64-bit, while i * row_bytes could
    # overflow int32 when the n rows together hold more than 2**31 bytes.
    row_ptr = bits_ptr + byte
    for i in range(n):
        packed = tl.load(row_ptr, mask=byte_ok, other=0)
        s = tl.load(scales_ptr + i)
        acc += tl.where(_unpack_bytes(packed), s, -s)
        row_ptr += row_bytes
    # IEEE division: Triton's `/` is approximate on NVIDIA (see module docstring).
    return tl.math.div_rn(acc, tl.full(acc.shape, n, tl.float32))  # same shape: older Triton does not broadcast here


@triton.jit
def _server_z(
    bits_ptr, scales_ptr, serr_ptr, byte, elem, byte_ok, n, row_bytes, BLOCK: tl.constexpr
):
    """``z = a + ē`` on one tile (lanes outside the chunk are garbage: mask them)."""
    a = _server_mean(bits_ptr, scales_ptr, byte, byte_ok, n, row_bytes, BLOCK)
    e = tl.load(serr_ptr + elem, mask=byte_ok[:, None], other=0.0)
    return a + e


# --------------------------------------------------------------------------------------------
# Kernels
# --------------------------------------------------------------------------------------------


@triton.jit
def _worker_sumsq_kernel(x_ptr, err_ptr, partial_ptr, N, L, BLOCK: tl.constexpr):
    """Pass 1 (read only): ``partial[pid] = Σ (x + e)²`` over this program's block."""
    pid = tl.program_id(0).to(tl.int64)
    offs = pid * BLOCK + tl.arange(0, BLOCK)
    # x is read as if zero padded to L: beyond N the mask supplies the zeros.
    x = tl.load(x_ptr + offs, mask=offs < N, other=0.0).to(tl.float32)
    e = tl.load(err_ptr + offs, mask=offs < L, other=0.0)
    # y in fp32 (as the reference), its square and sum in fp64 (as the reference).
    y = (x + e).to(tl.float64)
    tl.store(partial_ptr + pid, tl.sum(y * y, axis=0))


@triton.jit
def _worker_pack_kernel(
    x_ptr, err_ptr, scales_ptr, bits_ptr, N, L, n, rank, N_PAD: tl.constexpr, BLOCK: tl.constexpr
):
    """Pass 2: bits of ``y = x + e``; ``e = y - s·sign⁺(y)`` if all ``n`` scales are finite."""
    byte, elem = _tile(BLOCK)
    in_range = elem < L
    x = tl.load(x_ptr + elem, mask=elem < N, other=0.0).to(tl.float32)
    e = tl.load(err_ptr + elem, mask=in_range, other=0.0)
    y = x + e
    positive = y >= 0  # false for NaN: NaN packs as bit 0, like the reference
    tl.store(bits_ptr + byte, _pack_bytes(positive), mask=byte < L // 8)

    # The finite flag, computed by every program from the n gathered scales (a few bytes, served
    # from cache), so no host round trip decides whether the error is written.
    k = tl.arange(0, N_PAD)  # arange lengths must be powers of two: pad and mask
    scales = tl.load(scales_ptr + k, mask=k < n, other=0.0)
    all_finite = tl.sum((~_is_finite(scales)).to(tl.int32), axis=0) == 0
    s = tl.load(scales_ptr + rank)
    new_e = y - tl.where(positive, s, -s)
    tl.store(err_ptr + elem, new_e, mask=_and_flag(in_range, all_finite))


@triton.jit
def _server_average_kernel(bits_ptr, scales_ptr, out_ptr, n, row_bytes, BLOCK: tl.constexpr):
    """``out = (Σ_i s_i·sign⁺_i) / n`` (only :func:`server_average` needs it materialised)."""
    byte, elem = _tile(BLOCK)
    byte_ok = byte < row_bytes
    a = _server_mean(bits_ptr, scales_ptr, byte, byte_ok, n, row_bytes, BLOCK)
    tl.store(out_ptr + elem, a, mask=byte_ok[:, None])


@triton.jit
def _server_sumsq_kernel(
    bits_ptr, scales_ptr, serr_ptr, partial_ptr, n, row_bytes, BLOCK: tl.constexpr
):
    """Server pass 1 (read only): ``partial[pid] = Σ z²`` over this program's block."""
    byte, elem = _tile(BLOCK)
    byte_ok = byte < row_bytes
    z = _server_z(bits_ptr, scales_ptr, serr_ptr, byte, elem, byte_ok, n, row_bytes, BLOCK)
    # Masked lanes hold -Σs_i/n, not 0 (their bits load as 0 = sign -1): zero them explicitly.
    z = tl.where(byte_ok[:, None], z, 0.0).to(tl.float64)
    tl.store(partial_ptr + tl.program_id(0).to(tl.int64), tl.sum(tl.sum(z * z, axis=1), axis=0))


@triton.jit
def _server_pack_kernel(
    bits_ptr, scales_ptr, serr_ptr, t_ptr, out_bits_ptr, n, row_bytes, BLOCK: tl.constexpr
):
    """Server pass 2: bits of ``z``; ``ē = z - t·sign⁺(z)`` only if ``t`` is finite."""
    byte, elem = _tile(BLOCK)
    byte_ok = byte < row_bytes
    z = _server_z(bits_ptr, scales_ptr, serr_ptr, byte, elem, byte_ok, n, row_bytes, BLOCK)
    positive = z >= 0
    tl.store(out_bits_ptr + byte, _pack_bytes(positive), mask=byte_ok)
    t = tl.load(t_ptr)
    new_e = z - tl.where(positive, t, -t)
    tl.store(serr_ptr + elem, new_e, mask=_and_flag(byte_ok[:, None], _is_finite(t)))


@triton.jit
def _unpack_scaled_kernel(bits_ptr, table_ptr, out_ptr, numel, row_bytes, BLOCK: tl.constexpr):
    """``out[k] = ±t_j`` (``j = k // C``) for ``k < numel``, stored in ``out``'s dtype.

    ``table`` holds ``(-t_j, +t_j)`` per row, already in ``out``'s dtype (see
    :func:`unpack_scaled`), so the kernel only selects and stores: no float conversion happens
    on the device. ``bits`` is ``(n, C // 8)`` and contiguous, so element ``k`` lives in flat
    byte ``k // 8`` whatever its row, and the row is ``byte // (C // 8)``. A 1-D grid over
    bytes (rather than rows x blocks) keeps every grid dimension far from CUDA's 65535 limit.
    """
    byte, elem = _tile(BLOCK)
    byte_ok = byte * 8 < numel  # the byte holds at least one wanted element
    packed = tl.load(bits_ptr + byte, mask=byte_ok, other=0)
    row = byte // row_bytes
    # Per byte, two loads from a 2n-entry table: cache hits, negligible next to the stores.
    neg = tl.load(table_ptr + 2 * row, mask=byte_ok, other=0.0)
    pos = tl.load(table_ptr + 2 * row + 1, mask=byte_ok, other=0.0)
    values = tl.where(_unpack_bytes(packed), pos[:, None], neg[:, None])
    tl.store(out_ptr + elem, values, mask=elem < numel)


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
# Host wrappers: validate shapes (host metadata only, never device values) and launch
# --------------------------------------------------------------------------------------------


def _check_block(block: int) -> int:
    if block < 8 or block & (block - 1):
        raise ValueError(f"block must be a power of two >= 8 (whole bytes), got {block}")
    return block


def _on_device(t: torch.Tensor):
    # Triton launches on the *current* CUDA device, not on the device of its arguments; make
    # them agree (matters when a process drives a tensor on a non-default GPU).
    return torch.cuda.device(t.device) if t.is_cuda else contextlib.nullcontext()


def _same_device(*tensors: torch.Tensor) -> None:
    devices = {t.device for t in tensors}
    if len(devices) > 1:
        raise ValueError(f"all tensors must be on one device, got {sorted(map(str, devices))}")


def _flat_input(x: torch.Tensor, length: int) -> torch.Tensor:
    if x.dtype not in _FLOAT_INPUTS:
        raise TypeError(f"x must be one of {_FLOAT_INPUTS}, got {x.dtype}")
    if x.numel() > length:
        raise ValueError(f"x has {x.numel()} elements, more than the padded length {length}")
    # A view for contiguous x (the normal case); a copy otherwise, which is correct but slower.
    return x.reshape(-1)


def _rms_from_partials(partials: torch.Tensor, length: int) -> torch.Tensor:
    # Device ops only (no .item()): the result stays a 0-dim fp32 tensor on the stream.
    return (partials.sum() / length).sqrt().to(torch.float32)


def _check_rows(bits: torch.Tensor, scales: torch.Tensor) -> tuple[int, int]:
    """``(n, row_bytes)`` of the bits matrix, after the contract's row checks: what the kernels
    add to them, contiguous ``bits`` and contiguous fp32 ``scales``."""
    contract.require(bits, "bits", torch.uint8)
    contract.require(scales, "scales", torch.float32)
    return bits.shape


def worker_scale(
    x: torch.Tensor, error: torch.Tensor, *, block: int = DEFAULT_BLOCK, bounds=None
) -> torch.Tensor:
    """``RMS(x_padded + error)`` as a 0-dim fp32 tensor (0 for an empty buffer). No host sync.

    With ``bounds``: the ``(P,)`` RMS of each piece.
    """
    _check_block(block)
    contract.check_worker(x, error)
    _same_device(x, error)
    L = error.numel()
    x_flat = _flat_input(x, L)
    if bounds is not None:
        return _worker_scale_pieces(x_flat, error, bounds, block)
    if L == 0:
        return torch.zeros((), dtype=torch.float32, device=error.device)
    programs = triton.cdiv(L, block)
    partials = torch.empty(programs, dtype=torch.float64, device=error.device)
    with _on_device(error):
        _worker_sumsq_kernel[(programs,)](
            x_flat, error, partials, x_flat.numel(), L, BLOCK=block, **_launch_options(block)
        )
    return _rms_from_partials(partials, L)


def worker_pack(
    x: torch.Tensor,
    error: torch.Tensor,
    scales: torch.Tensor,
    rank: int,
    bits_out: torch.Tensor,
    *,
    block: int = DEFAULT_BLOCK,
    bounds=None,
) -> None:
    """Write ``sign⁺(x + error)`` into ``bits_out``; update ``error`` in place.

    The error becomes ``y - scales[rank]·sign⁺(y)`` only when all scales are finite; the
    check happens on the device, so this call never waits for the GPU. With ``bounds``,
    ``scales`` is ``(n, P)`` and piece ``p`` uses ``scales[rank, p]``.
    """
    _check_block(block)
    L = contract.check_worker(x, error, bits_out)
    scales = scales.reshape(-1)
    contract.require(scales, "scales", torch.float32)
    if bounds is not None:
        _same_device(x, error, scales, bits_out)
        _worker_pack_pieces(_flat_input(x, L), error, scales, rank, bits_out, bounds, block)
        return
    n = scales.numel()
    contract.check_rank(scales, rank)
    _same_device(x, error, scales, bits_out)
    x_flat = _flat_input(x, L)
    if L == 0:
        return
    programs = triton.cdiv(L, block)
    with _on_device(error):
        _worker_pack_kernel[(programs,)](
            x_flat, error, scales, bits_out, x_flat.numel(), L, n, rank,
            N_PAD=triton.next_power_of_2(n), BLOCK=block, **_launch_options(block),
        )


def server_average(
    bits: torch.Tensor, scales: torch.Tensor, *, block: int = DEFAULT_BLOCK, bounds=None
) -> torch.Tensor:
    """``mean_i scales[i] · sign⁺(bits[i])`` with the exact summation order of the spec.

    With ``bounds`` (over the chunk), ``scales`` is ``(n, P)``.
    """
    _check_block(block)
    contract.check_rows(bits, scales if bounds is None else None)
    if bounds is not None:
        n, row_bytes, scales, table = _piece_rows(bits, scales, bounds, block)
        _same_device(bits, scales)
        bnd, starts, pieces, _, counts, tiles = table
        out = torch.empty(row_bytes * 8, dtype=torch.float32, device=bits.device)
        if tiles:
            with _on_device(bits):
                _server_average_pieces_kernel[(tiles,)](
                    bits, scales, out, starts, pieces, bnd, n, counts.numel(), row_bytes,
                    BLOCK=block, **_launch_options(block),
                )
        return out
    scales = scales.reshape(-1)
    n, row_bytes = _check_rows(bits, scales)
    _same_device(bits, scales)
    out = torch.empty(row_bytes * 8, dtype=torch.float32, device=bits.device)
    if row_bytes == 0:
        return out
    programs = triton.cdiv(row_bytes * 8, block)
    with _on_device(bits):
        _server_average_kernel[(programs,)](
            bits, scales, out, n, row_bytes, BLOCK=block, **_launch_options(block)
        )
    return out


def server_scale(
    bits: torch.Tensor,
    scales: torch.Tensor,
    server_error: torch.Tensor,
    *,
    block: int = DEFAULT_BLOCK,
    bounds=None,
) -> torch.Tensor:
    """``RMS(server_average(bits, scales) + server_error)`` as a 0-dim fp32 tensor.

    With ``bounds``: the ``(P,)`` RMS of each piece of ``z``.
    """
    _check_block(block)
    contract.check_server(bits, scales if bounds is None else None, server_error)
    if bounds is not None:
        n, row_bytes, scales, table = _piece_rows(bits, scales, bounds, block)
        _same_device(bits, scales, server_error)
        bnd, starts, pieces, _, counts, tiles = table
        partials = torch.empty(tiles, dtype=torch.float64, device=bits.device)
        with _on_device(bits):
            if tiles:
                _server_sumsq_pieces_kernel[(tiles,)](
                    bits, scales, server_error, partials, starts, pieces, bnd, n, counts.numel(),
                    row_bytes, BLOCK=block, **_launch_options(block),
                )
            return _piece_rms(partials, table)
    scales = scales.reshape(-1)
    n, row_bytes = _check_rows(bits, scales)
    _same_device(bits, scales, server_error)
    C = row_bytes * 8
    if C == 0:
        return torch.zeros((), dtype=torch.float32, device=bits.device)
    programs = triton.cdiv(C, block)
    partials = torch.empty(programs, dtype=torch.float64, device=bits.device)
    with _on_device(bits):
        _server_sumsq_kernel[(programs,)](
            bits, scales, server_error, partials, n, row_bytes,
            BLOCK=block, **_launch_options(block),
        )
    return _rms_from_partials(partials, C)


def server_pack(
    bits: torch.Tensor,
    scales: torch.Tensor,
    server_error: torch.Tensor,
    scale: torch.Tensor,
    bits_out: torch.Tensor,
    *,
    block: int = DEFAULT_BLOCK,
    bounds=None,
) -> None:
    """Write ``sign⁺(z)``, ``z = average + ē``; ``ē = z - t·sign⁺(z)`` if ``t`` is finite.

    The finite check happens on the device, so this call never waits for the GPU. With
    ``bounds``, ``scale`` holds the ``(P,)`` piece scales (all must be finite).
    """
    _check_block(block)
    contract.check_server(bits, scales if bounds is None else None, server_error, bits_out)
    if bounds is not None:
        n, row_bytes, scales, table = _piece_rows(bits, scales, bounds, block)
        bnd, starts, pieces, _, counts, tiles = table
        scale = scale.reshape(-1)
        contract.require(scale, "scale", torch.float32, numel=counts.numel())
        _same_device(bits, scales, server_error, scale, bits_out)
        if tiles:
            with _on_device(bits):
                flag = _all_finite_flag(scale)
                _server_pack_pieces_kernel[(tiles,)](
                    bits, scales, server_error, scale, flag, bits_out, starts, pieces, bnd, n,
                    counts.numel(), row_bytes, BLOCK=block, **_launch_options(block),
                )
        return
    scales = scales.reshape(-1)
    n, row_bytes = _check_rows(bits, scales)
    scale = scale.reshape(-1)
    contract.require(scale, "scale", torch.float32, numel=1)
    _same_device(bits, scales, server_error, scale, bits_out)
    if row_bytes == 0:
        return
    programs = triton.cdiv(row_bytes * 8, block)
    with _on_device(bits):
        _server_pack_kernel[(programs,)](
            bits, scales, server_error, scale, bits_out, n, row_bytes,
            BLOCK=block, **_launch_options(block),
        )


def unpack_scaled(
    bits: torch.Tensor, scales: torch.Tensor, out: torch.Tensor, *, block: int = DEFAULT_BLOCK,
    bounds=None,
) -> None:
    """``out[k] = scales[k // C] · sign⁺_k`` for ``k < out.numel()``, cast to ``out.dtype``.

    ``bits`` has shape ``(n, C // 8)``: row ``j`` is chunk ``j`` of the result. With ``bounds``
    (over all ``n·C`` elements), ``out[k] = scales[piece(k)] · sign⁺_k``.
    """
    _check_block(block)
    n, row_bytes = contract.check_unpack(bits, scales if bounds is None else None, out)
    contract.require(bits, "bits", torch.uint8)  # contiguous: the kernel indexes it flat
    scales = scales.reshape(-1)
    table = None
    if bounds is not None:
        table = _tables(bounds, n * row_bytes * 8, block, bits.device)
        if scales.numel() != table[4].numel():
            raise ValueError(f"scales must have {table[4].numel()} elements (one per piece), got {scales.numel()}")
    if out.dtype not in _FLOAT_INPUTS:
        raise TypeError(f"out must be one of {_FLOAT_INPUTS}, got {out.dtype}")
    numel = out.numel()
    _same_device(bits, scales, out)
    if numel == 0:
        return
    # (-t_j, +t_j) per row, converted to out's dtype by torch itself: exactly the rounding of
    # the reference (whose ±t_j are exact in fp32 before its final cast), and tiny (2n values,
    # two small asynchronous device ops). It also keeps every float conversion out of the
    # kernel: the Triton 3.9 CPU interpreter truncates fp32 -> bf16 instead of rounding.
    s32 = scales.to(torch.float32)
    pm = torch.stack((-s32, s32), dim=1).to(out.dtype)
    # The kernel writes a flat contiguous range; for a strided `out` go through a temporary.
    target = out
    if not out.is_contiguous():
        target = torch.empty(numel, dtype=out.dtype, device=out.device)
    if table is not None:
        bnd, starts, pieces, _, _, tiles = table
        if tiles:
            with _on_device(bits):
                _unpack_pieces_kernel[(tiles,)](
                    bits, pm, target, starts, pieces, bnd, numel, BLOCK=block, **_launch_options(block)
                )
    else:
        programs = triton.cdiv(numel, block)
        with _on_device(bits):
            _unpack_scaled_kernel[(programs,)](
                bits, pm, target, numel, row_bytes, BLOCK=block, **_launch_options(block)
            )
    if target is not out:
        out.copy_(target.view(out.shape))


# --------------------------------------------------------------------------------------------
# Piece variants of the wrappers (``bounds=``)
# --------------------------------------------------------------------------------------------

_SEGMENT_R = 256  # tile partials summed per step of the segmented sum


@functools.lru_cache(maxsize=512)
def _tile_table(bounds: tuple, block: int, device: torch.device) -> tuple:
    """Device tables for ``bounds`` tiled by ``block``: built once per static layout.

    Returns ``(bounds, tile_start, tile_piece, tile_lo, counts, tiles)``: tile ``t`` starts at
    element ``tile_start[t]`` of piece ``tile_piece[t]``; piece ``p`` owns tiles
    ``tile_lo[p] .. tile_lo[p + 1] - 1``; ``counts`` are the pieces' lengths (float64).
    """
    starts, pieces, lo = [], [], [0]
    for p, (a, b) in enumerate(zip(bounds[:-1], bounds[1:])):
        first = range(a, b, block)
        starts.extend(first)
        pieces.extend([p] * len(first))
        lo.append(len(starts))
    i64 = dict(dtype=torch.int64, device=device)
    lengths = [b - a for a, b in zip(bounds[:-1], bounds[1:])]
    return (
        torch.tensor(bounds, **i64),
        torch.tensor(starts, **i64),
        torch.tensor(pieces, dtype=torch.int32, device=device),
        torch.tensor(lo, **i64),
        torch.tensor(lengths, dtype=torch.float64, device=device),
        len(starts),
    )


def _tables(bounds, length: int, block: int, device: torch.device) -> tuple:
    return _tile_table(tuple(check_bounds(bounds, length)), block, torch.device(device))


def _piece_rms(partials: torch.Tensor, table: tuple) -> torch.Tensor:
    """Per-piece RMS from the tiles' partial sums of squares (device ops only)."""
    _, _, _, tile_lo, counts, _ = table
    P = counts.numel()
    sums = torch.empty(P, dtype=torch.float64, device=counts.device)
    if P:
        _segment_sum_kernel[(P,)](partials, tile_lo, sums, R=_SEGMENT_R)
    rms = (sums / counts.clamp(min=1.0)).sqrt()
    return torch.where(counts > 0, rms, torch.zeros_like(rms)).to(torch.float32)


def _all_finite_flag(t: torch.Tensor) -> torch.Tensor:
    return torch.isfinite(t).all().to(torch.int32).reshape(1)


def _worker_scale_pieces(x_flat, error, bounds, block) -> torch.Tensor:
    table = _tables(bounds, error.numel(), block, error.device)
    bnd, starts, pieces, _, _, tiles = table
    partials = torch.empty(tiles, dtype=torch.float64, device=error.device)
    with _on_device(error):
        if tiles:
            _worker_sumsq_pieces_kernel[(tiles,)](
                x_flat, error, starts, pieces, bnd, partials, x_flat.numel(),
                BLOCK=block, **_launch_options(block),
            )
        return _piece_rms(partials, table)


def _worker_pack_pieces(x_flat, error, scales, rank, bits_out, bounds, block) -> None:
    table = _tables(bounds, error.numel(), block, error.device)
    bnd, starts, pieces, _, counts, tiles = table
    P = counts.numel()
    if P == 0:
        return
    if scales.numel() % P or not 0 <= rank < scales.numel() // P:
        raise ValueError(f"scales {tuple(scales.shape)} do not hold rank {rank}'s {P} piece scales")
    own = scales.reshape(-1, P)[rank].contiguous()
    with _on_device(error):
        flag = _all_finite_flag(scales)
        _worker_pack_pieces_kernel[(tiles,)](
            x_flat, error, own, flag, bits_out, starts, pieces, bnd, x_flat.numel(),
            BLOCK=block, **_launch_options(block),
        )


def _piece_rows(bits: torch.Tensor, scales: torch.Tensor, bounds, block: int) -> tuple:
    """Checks for the server piece variants, after the contract's row checks: ``(n, row_bytes,
    scales (n, P), table)``."""
    contract.require(bits, "bits", torch.uint8)  # contiguous: the kernels index it flat
    n, row_bytes = bits.shape
    table = _tables(bounds, row_bytes * 8, block, bits.device)
    P = table[4].numel()
    scales = scales.reshape(-1)
    contract.require(scales, "scales", torch.float32, numel=n * P)
    return n, row_bytes, scales, table
