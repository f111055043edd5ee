"""The numba loops of the 1-bit exchange, for the CPU backend :mod:`hf_onebit.kernels.cpu` (its
host side checks the arguments and hands these functions numpy views of the caller's tensors);
what they share with the b-bit loops, and why, is in :mod:`hf_onebit.kernels.cpu_jit`.

For a large buffer these loops are limited by memory traffic, not arithmetic. On a CPU a
fresh multi-MB temporary costs a page fault per 4 KiB the first time it is written, so "compute
into a new buffer, then copy" is several times slower than writing into memory that already
exists. Every loop here therefore streams over the caller's buffers exactly once per pass and
writes results in place:

* :func:`~hf_onebit.kernels.cpu.worker_scale` is one read-only pass over ``x`` and ``error`` (8
  bytes per element).
* :func:`~hf_onebit.kernels.cpu.worker_pack` is one pass that reads ``x`` and ``error`` again,
  writes the bits and, if every scale is finite, writes ``error`` back (12 bytes per element).

The two passes cannot be fused into one: the scale must be known (and exchanged with the
other ranks) before any error entry may be overwritten, and the split is what lets a
non-finite value anywhere leave every error buffer untouched. Together they move about 2.5x
the nominal bytes of a plain ``y.copy_(x)`` (20 vs 8 per element; the copy really moves 12,
because writing ``y`` first reads its cache lines), so a measured ratio of about 2 means the
loops run at memory speed. ``benchmarks/kernels.py`` measures that ratio.

The server operations read ``n`` rows of bits (``C/8`` bytes each) plus ``C`` floats of
server error. They work on blocks of :data:`~hf_onebit.kernels.cpu_jit._BLOCK` elements: the
running average of a block is kept in a small scratch array that stays in L1 cache, so the rows
are summed in exactly the order the reference defines (``acc = 0; acc += s_i·sign⁺_i for i in
rank order; a = acc / n``) without an fp32 temporary of length ``C``. Each row's bytes are first
expanded into 0/1 flag bytes (the packing trick below, run backwards), so that adding a row is
a contiguous select-and-add loop.

Packing signs into MSB-first bytes is the awkward part for a vectoriser (eight neighbouring
elements collapse into one byte). We first store the ``y >= 0`` flags of a block as 0/1
bytes (a plain, perfectly vectorisable loop), then turn every 8 flag bytes, read as one
little-endian uint64, into one output byte with a single multiplication: multiplying by
``0x8040201008040201`` moves flag ``k`` of the word to bit ``63 - k`` without carries, so the
top byte is the packed MSB-first byte (see :data:`_PACK_MAGIC`). Outputs of
:func:`~hf_onebit.kernels.cpu.unpack_scaled` hold only two distinct values per chunk (``±t_j``),
so the fp32 -> out-dtype conversion is done by torch itself on those ``2·n`` values (bitwise
what the reference's ``copy_`` does), and the loop only copies raw bit patterns.

Pieces (``bounds=``, see the reference). The piece variants loop over the pieces inside numba
and run the single-scale loops on each piece's slices (piece bounds are multiples of 8, so
each slice owns whole bytes of the packed bits). A piece costs one call (a few hundred ns),
so hundreds of pieces in a multi-MB buffer cost nothing measurable.
"""

from __future__ import annotations

import numpy as np
from numba import njit

from .cpu_jit import _BLOCK, _JIT, _divide_by_n, _load_f32, require_digest

require_digest("4bfc244d6ed5a77e", "cpu_sign_loops.py")

# Multiplying 8 little-endian 0/1 bytes by this constant (byte j of it is 2**j) moves flag k
# to bit 8k + 9j for every j; the j = 7 - k copy lands on bit 63 - k, and no other copy or
# carry reaches the top byte (checked for all 256 patterns), so ``>> 56`` is the MSB-first
# packed byte. The same constant unpacks a byte again, see _byte_to_flags.
_PACK_MAGIC = np.uint64(0x8040201008040201)

# Only for float64 sum-of-squares loops: lets LLVM split the sum into vector partial sums.
_JIT_SUM = {"nogil": True, "cache": True, "fastmath": {"reassoc", "contract"}}


@njit(**_JIT_SUM)
def _worker_sumsq(x, error):
    # One read-only pass. The padding region (x absent) reads as 0.0 + error, like the
    # reference's zero-padded copy.
    n = x.size
    acc = 0.0
    for i in range(n):
        y = _load_f32(x[i]) + error[i]
        acc += np.float64(y) * np.float64(y)
    for i in range(n, error.size):
        y = np.float32(0.0) + error[i]
        acc += np.float64(y) * np.float64(y)
    return acc


@njit(**_JIT_SUM)
def _sumsq(buf, count):
    acc = 0.0
    for i in range(count):
        v = np.float64(buf[i])
        acc += v * v
    return acc


@njit(**_JIT)
def _flags_to_bytes(flags, count, bits_out, first):
    """Pack ``flags[:count]`` (0/1 bytes, ``count % 8 == 0``) into ``bits_out[first:]``.

    ``flags.size`` must be a multiple of 8 (it is always a whole :data:`_BLOCK` scratch).
    """
    words = flags.view(np.uint64)
    for q in range(count // 8):
        bits_out[first + q] = np.uint8((words[q] * _PACK_MAGIC) >> np.uint64(56))


@njit(**_JIT)
def _byte_to_flags(byte):
    """The inverse of the packing trick: MSB-first byte -> 8 little-endian 0/1 bytes.

    ``byte * 0x8040201008040201`` places copy ``k`` of the byte at bits ``9k .. 9k+7`` (the
    copies do not overlap, so no carries); bit ``7 - k`` of copy ``k`` lands on bit ``8k + 7``,
    and ``>> 7`` then masking keeps exactly those: flag ``k`` in the lowest bit of byte ``k``.
    """
    return ((np.uint64(byte) * _PACK_MAGIC) >> np.uint64(7)) & np.uint64(0x0101010101010101)


@njit(**_JIT)
def _worker_pack(x, error, bits_out, s, update, flags):
    """bits_out = packed sign⁺(y), y = x (zero-padded to error.size) + error; if ``update``,
    error = y - s·sign⁺(y). ``flags``: :data:`_BLOCK` bytes of scratch, reused for every block
    (and by the caller for every piece: an allocation per piece costs more than a short
    piece's elements), so it stays in L1."""
    n = x.size
    neg = s * np.float32(-1.0)
    words = flags.view(np.uint64)
    # Whole blocks first. The constant trip count, plain `base + j` indexing and the inlined
    # packing loop matter: they spare a slice and a call per block (iterating over slices and
    # calling _flags_to_bytes is slower), and LLVM does not vectorise a variable trip count with
    # `base + j` indexing at all.
    full_end = n - n % _BLOCK
    for base in range(0, full_end, _BLOCK):
        # Two copies of the loop instead of an `if update` inside it: keeps both branch-free.
        if update:
            for j in range(_BLOCK):
                y = _load_f32(x[base + j]) + error[base + j]
                pos = y >= np.float32(0.0)  # False for NaN, as in the reference
                flags[j] = pos
                error[base + j] = y - (s if pos else neg)
        else:
            for j in range(_BLOCK):
                flags[j] = _load_f32(x[base + j]) + error[base + j] >= np.float32(0.0)
        first = base // 8
        for q in range(_BLOCK // 8):
            bits_out[first + q] = np.uint8((words[q] * _PACK_MAGIC) >> np.uint64(56))
    # The last partial block, up to a multiple of 8 elements of x: the same loops over slices.
    vector_end = n - n % 8
    if vector_end > full_end:
        count = vector_end - full_end
        xb = x[full_end:vector_end]
        eb = error[full_end:vector_end]
        if update:
            for j in range(count):
                y = _load_f32(xb[j]) + eb[j]
                pos = y >= np.float32(0.0)
                flags[j] = pos
                eb[j] = y - (s if pos else neg)
        else:
            for j in range(count):
                flags[j] = _load_f32(xb[j]) + eb[j] >= np.float32(0.0)
        _flags_to_bytes(flags, count, bits_out, full_end // 8)
    # At most 7 elements of x, then the zero padding: short, so a plain scalar loop.
    for b in range(vector_end // 8, bits_out.size):
        byte = 0
        for k in range(8):
            i = 8 * b + k
            xv = _load_f32(x[i]) if i < n else np.float32(0.0)
            y = xv + error[i]
            pos = y >= np.float32(0.0)
            byte = (byte << 1) | (1 if pos else 0)
            if update:
                error[i] = y - (s if pos else neg)
        bits_out[b] = np.uint8(byte)


@njit(**_JIT)
def _average_block(rows, scales, acc, flags):
    """``acc[:8*B] = Σ_i scales[i]·sign⁺(rows[i])`` for ``rows`` of shape ``(n, B)``.

    The reference's exact order: fp32 accumulator starting at +0.0, rows added in rank order. The
    division by ``n`` is left to the caller, fused into its next loop. ``flags`` is scratch of
    at least ``8*B`` bytes.
    """
    n, nbytes = rows.shape
    count = 8 * nbytes
    words = flags.view(np.uint64)
    for r in range(n):
        pos = scales[r]
        neg = pos * np.float32(-1.0)
        # Unpack the row into 0/1 flag bytes first, so the accumulation below is a plain
        # contiguous loop (one select + add per element) that LLVM vectorises.
        row = rows[r]
        for q in range(nbytes):
            words[q] = _byte_to_flags(row[q])
        if r == 0:  # `0.0 + v`, not `v`: turns a -0.0 term into +0.0 exactly like the reference
            for q in range(count):
                acc[q] = np.float32(0.0) + (pos if flags[q] else neg)
        else:
            for q in range(count):
                acc[q] += pos if flags[q] else neg
    if n == 0:
        for q in range(count):
            acc[q] = np.float32(0.0)


@njit(**_JIT)
def _server_average(bits, scales, out, flags):
    n, nbytes = bits.shape
    step = _BLOCK // 8
    nothing = out[:0]
    for b0 in range(0, nbytes, step):
        b1 = min(b0 + step, nbytes)
        block = out[8 * b0 : 8 * b1]
        _average_block(bits[:, b0:b1], scales, block, flags)
        _divide_by_n(block, block.size, n, nothing)


@njit(**_JIT)
def _server_sumsq(bits, scales, server_error, z, flags):
    """(``z``: :data:`_BLOCK` fp32 scratch, ``flags`` as for :func:`_worker_pack`.)"""
    n, nbytes = bits.shape
    step = _BLOCK // 8
    total = 0.0
    for b0 in range(0, nbytes, step):
        b1 = min(b0 + step, nbytes)
        count = 8 * (b1 - b0)
        _average_block(bits[:, b0:b1], scales, z, flags)
        _divide_by_n(z, count, n, server_error[8 * b0 : 8 * b1])  # z = average + ē
        total += _sumsq(z, count)
    return total


@njit(**_JIT)
def _server_pack(bits, scales, server_error, t, update, bits_out, z, flags):
    n, nbytes = bits.shape
    step = _BLOCK // 8
    neg = t * np.float32(-1.0)
    for b0 in range(0, nbytes, step):
        b1 = min(b0 + step, nbytes)
        count = 8 * (b1 - b0)
        err = server_error[8 * b0 : 8 * b1]
        _average_block(bits[:, b0:b1], scales, z, flags)
        _divide_by_n(z, count, n, err)  # z = average + ē
        if update:
            for q in range(count):
                pos = z[q] >= np.float32(0.0)
                flags[q] = pos
                err[q] = z[q] - (t if pos else neg)
        else:
            for q in range(count):
                flags[q] = z[q] >= np.float32(0.0)
        _flags_to_bytes(flags, count, bits_out, b0)


@njit(**_JIT)
def _unpack(bits, lut, out):
    """``out[j*C + m] = lut[j, bit]`` for the ``out.size`` first elements (raw bit patterns)."""
    n, row_bytes = bits.shape
    chunk = 8 * row_bytes
    total = out.size
    for j in range(n):
        start = j * chunk
        if start >= total:
            break
        count = min(chunk, total - start)
        lo = lut[j, 0]
        hi = lut[j, 1]
        full = count // 8
        for b in range(full):
            byte = bits[j, b]
            o = start + 8 * b
            for k in range(8):
                out[o + k] = hi if (byte >> (7 - k)) & 1 else lo
        if full * 8 < count:  # the cut-off end of the last chunk
            byte = bits[j, full]
            for k in range(count - 8 * full):
                out[start + 8 * full + k] = hi if (byte >> (7 - k)) & 1 else lo


# --------------------------------------------------------------------------------------------
# Pieces: the kernels above, once per piece on that piece's slices
# --------------------------------------------------------------------------------------------


@njit(**_JIT)
def _worker_sumsq_pieces(x, error, bounds, out):
    n = x.size
    for p in range(bounds.size - 1):
        lo = bounds[p]
        hi = bounds[p + 1]
        out[p] = _worker_sumsq(x[min(lo, n) : min(hi, n)], error[lo:hi])


@njit(**_JIT)
def _worker_pack_pieces(x, error, bits_out, own, bounds, update):
    n = x.size
    flags = np.empty(_BLOCK, np.uint8)
    for p in range(bounds.size - 1):
        lo = bounds[p]
        hi = bounds[p + 1]
        if hi > lo:
            _worker_pack(x[min(lo, n) : min(hi, n)], error[lo:hi], bits_out[lo // 8 : hi // 8], own[p], update, flags)


@njit(**_JIT)
def _server_average_pieces(bits, scales_t, bounds, out):
    flags = np.empty(_BLOCK, np.uint8)
    for p in range(bounds.size - 1):
        lo = bounds[p]
        hi = bounds[p + 1]
        if hi > lo:
            _server_average(bits[:, lo // 8 : hi // 8], scales_t[p], out[lo:hi], flags)


@njit(**_JIT)
def _server_sumsq_pieces(bits, scales_t, server_error, bounds, out):
    z = np.empty(_BLOCK, np.float32)
    flags = np.empty(_BLOCK, np.uint8)
    for p in range(bounds.size - 1):
        lo = bounds[p]
        hi = bounds[p + 1]
        rows = bits[:, lo // 8 : hi // 8]
        out[p] = _server_sumsq(rows, scales_t[p], server_error[lo:hi], z, flags) if hi > lo else 0.0


@njit(**_JIT)
def _server_pack_pieces(bits, scales_t, server_error, t, update, bits_out, bounds):
    z = np.empty(_BLOCK, np.float32)
    flags = np.empty(_BLOCK, np.uint8)
    for p in range(bounds.size - 1):
        lo = bounds[p]
        hi = bounds[p + 1]
        if hi > lo:
            _server_pack(
                bits[:, lo // 8 : hi // 8], scales_t[p], server_error[lo:hi], t[p], update,
                bits_out[lo // 8 : hi // 8], z, flags,
            )


@njit(**_JIT)
def _unpack_pieces(bits, lut, bounds, out):
    """``out[k] = lut[piece(k), bit k]`` for ``k < out.size``; ``bits`` flat (raw bit patterns)."""
    total = out.size
    for p in range(bounds.size - 1):
        lo = bounds[p]
        if lo >= total:
            break
        hi = min(bounds[p + 1], total)
        neg = lut[p, 0]
        pos = lut[p, 1]
        full_end = lo + (hi - lo) // 8 * 8
        # The loop shape of _unpack (a byte counter, 8 stores per byte), which compiles to
        # faster code than stepping the element offset by 8 (benchmarks/kernels.py).
        for b in range(lo // 8, full_end // 8):
            byte = bits[b]
            o = 8 * b
            for k in range(8):
                out[o + k] = pos if (byte >> (7 - k)) & 1 else neg
        if full_end < hi:
            byte = bits[full_end // 8]
            for k in range(hi - full_end):
                out[full_end + k] = pos if (byte >> (7 - k)) & 1 else neg
