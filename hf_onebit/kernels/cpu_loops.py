"""The numba loops of the CPU backend :mod:`hf_onebit.kernels.cpu` (its host side checks the
arguments and hands these functions numpy views of the caller's tensors).

Why the code looks like this
----------------------------
For a large buffer these kernels are limited by memory traffic, not arithmetic. On a CPU a
fresh multi-MB temporary costs a page fault per 4 KiB the first time it is written, so "compute
into a new buffer, then copy" is several times slower than writing into memory that already
exists. Every kernel here therefore streams over the caller's buffers exactly once per pass and
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
kernels run at memory speed. ``benchmarks/kernels.py`` measures that ratio.

The server operations read ``n`` rows of bits (``C/8`` bytes each) plus ``C`` floats of
server error. They work on blocks of :data:`_BLOCK` elements: the running average of a block
is kept in a small scratch array that stays in L1 cache, so the rows are summed in exactly the
order the reference defines (``acc = 0; acc += s_i·sign⁺_i for i in rank order; a = acc / n``)
without an fp32 temporary of length ``C``. Each row's bytes are first expanded into 0/1 flag
bytes (the packing trick below, run backwards), so that adding a row is a contiguous
select-and-add loop. Dividing by ``n`` is a multiplication when ``n`` is a power of two (that
is bitwise the same and much cheaper than a vector division).

Vectorisation. Numba hands the loops to LLVM, which vectorises them only if they are
branch-free and the floating-point semantics allow it. We never enable fast-math on code that
produces bits or error values (they must match the reference bitwise); only the float64
sum-of-squares reductions carry ``reassoc`` (and ``contract``, harmless because the square of
an fp32 value is exact in float64), which lets LLVM keep several partial sums in vector
registers; scales may therefore differ from the reference's by rounding, which is why the
self-test compares them to fp32 rounding, not bitwise.

Packing signs into MSB-first bytes is the awkward part for a vectoriser (eight neighbouring
elements collapse into one byte). We first store the ``y >= 0`` flags of a block as 0/1
bytes (a plain, perfectly vectorisable loop), then turn every 8 flag bytes, read as one
little-endian uint64, into one output byte with a single multiplication: multiplying by
``0x8040201008040201`` moves flag ``k`` of the word to bit ``63 - k`` without carries, so the
top byte is the packed MSB-first byte (see :data:`_PACK_MAGIC`).

Input dtypes. numba cannot load bf16 or fp16 arrays, so such inputs are handed to the kernels
as raw 16-bit integers: bf16 as ``uint16`` and fp16 as ``int16`` (the integer type is only a
tag telling :func:`_load_f32` which decoding to compile in). bf16 -> fp32 is exact: the bf16
bits are the top half of the fp32 bits. fp16 -> fp32 uses LLVM's ``fpext half`` (one
``vcvtph2ps`` instruction on x86 with F16C), exact for every one of the 65536 bit patterns.
Outputs of :func:`~hf_onebit.kernels.cpu.unpack_scaled` hold only two distinct values per chunk (``±t_j``), so the
fp32 -> out-dtype conversion is done by torch itself on those ``2·n`` values (bitwise what the
reference's ``copy_`` does), and the kernel only copies raw bit patterns.

The b-bit operations follow the same rules (one read-only pass for a scale, one
pass that writes codes and errors in place, the server blocked through an L1 scratch); their
section below explains how they match the reference bitwise, max-abs scales included.

Threads. The kernels are single-threaded on purpose (the other cores run backward) and release
the GIL (``nogil=True``) so a communication thread can compress while Python keeps going.
All kernels are compiled lazily with ``cache=True``: the first call per input dtype costs a
compile of about a second, later processes load the machine code from ``__pycache__``.

Pieces (``bounds=``, see the reference). The piece variants loop over the pieces inside numba
and run the single-scale kernels above on each piece's slices (piece bounds are multiples of 8,
so each slice owns whole bytes of the packed bits). A piece costs one call (a few hundred ns),
so hundreds of pieces in a multi-MB buffer cost nothing measurable.

One file for the loops that call one another: with ``cache=True`` numba notices an edit only to
the file that defines a cached function, not to the functions (or constants) it uses from other
files, so loops split across files could keep running stale machine code from ``__pycache__``
after an edit. BinSGDM's loops, which share nothing with these, are in
:mod:`hf_onebit.kernels.cpu_votes`.
"""

from __future__ import annotations

import sys

import numpy as np
from llvmlite import ir
from numba import njit, types
from numba.extending import intrinsic, overload

if sys.byteorder != "little":  # _flags_to_bytes reads 8 flag bytes as one little-endian word
    raise ImportError("hf_onebit.kernels.cpu assumes a little-endian CPU; use the reference backend")

# Elements per block in the blocked kernels: 2 KiB of flags + 8 KiB of fp32 scratch stay in
# L1 next to the streamed data. Smaller blocks pay the per-block call and slicing overhead on
# too few elements; larger ones amortise nothing more and push the scratch out of L1.
_BLOCK = 2048

# Multiplying 8 little-endian 0/1 bytes by this constant (byte j of it is 2**j) moves flag k
# to bit 8k + 9j for every j; the j = 7 - k copy lands on bit 63 - k, and no other copy or
# carry reaches the top byte (checked for all 256 patterns), so ``>> 56`` is the MSB-first
# packed byte. The same constant unpacks a byte again, see _byte_to_flags.
_PACK_MAGIC = np.uint64(0x8040201008040201)

_JIT = {"nogil": True, "cache": True}
# Only for float64 sum-of-squares loops: lets LLVM split the sum into vector partial sums.
_JIT_SUM = {"nogil": True, "cache": True, "fastmath": {"reassoc", "contract"}}


# --------------------------------------------------------------------------------------------
# Loading any supported input element as fp32
# --------------------------------------------------------------------------------------------


@intrinsic
def _bits_to_f32(typingctx, bits):
    """Reinterpret a uint32 bit pattern as fp32 (a free register move, no conversion)."""
    sig = types.float32(types.uint32)

    def codegen(context, builder, signature, args):
        return builder.bitcast(args[0], ir.FloatType())

    return sig, codegen


@intrinsic
def _half_bits_to_f32(typingctx, bits):
    """fp16 bit pattern (int16) -> fp32 via LLVM ``fpext half``: exact, hardware-converted."""
    sig = types.float32(types.int16)

    def codegen(context, builder, signature, args):
        return builder.fpext(builder.bitcast(args[0], ir.HalfType()), ir.FloatType())

    return sig, codegen


def _load_f32(v):  # pragma: no cover - replaced by the overload below inside numba code
    raise NotImplementedError


@overload(_load_f32, inline="always")
def _load_f32_impl(v):
    # Chosen at compile time from the element type of the input array (see module docstring).
    if isinstance(v, types.Float):
        return lambda v: np.float32(v)
    if v == types.uint16:  # bf16 bits: the upper half of the fp32 bits
        return lambda v: _bits_to_f32(np.uint32(v) << np.uint32(16))
    if v == types.int16:  # fp16 bits
        return lambda v: _half_bits_to_f32(v)
    return None


# --------------------------------------------------------------------------------------------
# Kernels
# --------------------------------------------------------------------------------------------


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
def _worker_pack(x, error, bits_out, s, update):
    """bits_out = packed sign⁺(y), y = x (zero-padded to error.size) + error; if ``update``,
    error = y - s·sign⁺(y)."""
    n = x.size
    neg = s * np.float32(-1.0)
    flags = np.empty(_BLOCK, np.uint8)  # reused for every block, stays in L1
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
def _divide_by_n(acc, count, n, extra):
    """``acc[q] = acc[q] / n + extra[q]`` for ``q < count``; with an empty ``extra`` (the
    plain average) it is only ``acc[q] / n``.

    A vector division costs several cycles per 8 lanes, more than the memory traffic. When
    ``n`` is a power of two, ``x * (1/n)`` is bitwise ``x / n`` (1/n is exact, and both round
    the same real number once), so that case multiplies instead.
    """
    nf = np.float32(n)
    if n & (n - 1) == 0:
        inv = np.float32(1.0) / nf
        if extra.size:
            for q in range(count):
                acc[q] = acc[q] * inv + extra[q]
        else:
            for q in range(count):
                acc[q] = acc[q] * inv
    else:
        if extra.size:
            for q in range(count):
                acc[q] = acc[q] / nf + extra[q]
        else:
            for q in range(count):
                acc[q] = acc[q] / nf


@njit(**_JIT)
def _server_average(bits, scales, out):
    n, nbytes = bits.shape
    step = _BLOCK // 8
    flags = np.empty(_BLOCK, np.uint8)
    nothing = np.empty(0, np.float32)
    for b0 in range(0, nbytes, step):
        b1 = min(b0 + step, nbytes)
        block = out[8 * b0 : 8 * b1]
        _average_block(bits[:, b0:b1], scales, block, flags)
        _divide_by_n(block, block.size, n, nothing)


@njit(**_JIT)
def _server_sumsq(bits, scales, server_error):
    n, nbytes = bits.shape
    step = _BLOCK // 8
    z = np.empty(_BLOCK, np.float32)
    flags = np.empty(_BLOCK, np.uint8)
    total = 0.0
    for b0 in range(0, nbytes, step):
        b1 = min(b0 + step, nbytes)
        count = 8 * (b1 - b0)
        _average_block(bits[:, b0:b1], scales, z, flags)
        _divide_by_n(z, count, n, server_error[8 * b0 : 8 * b1])  # z = average + ē
        total += _sumsq(z, count)
    return total


@njit(**_JIT)
def _server_pack(bits, scales, server_error, t, update, bits_out):
    n, nbytes = bits.shape
    step = _BLOCK // 8
    z = np.empty(_BLOCK, np.float32)
    flags = np.empty(_BLOCK, np.uint8)
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
    for p in range(bounds.size - 1):
        lo = bounds[p]
        hi = bounds[p + 1]
        if hi > lo:
            _worker_pack(x[min(lo, n) : min(hi, n)], error[lo:hi], bits_out[lo // 8 : hi // 8], own[p], update)


@njit(**_JIT)
def _server_average_pieces(bits, scales_t, bounds, out):
    for p in range(bounds.size - 1):
        lo = bounds[p]
        hi = bounds[p + 1]
        if hi > lo:
            _server_average(bits[:, lo // 8 : hi // 8], scales_t[p], out[lo:hi])


@njit(**_JIT)
def _server_sumsq_pieces(bits, scales_t, server_error, bounds, out):
    for p in range(bounds.size - 1):
        lo = bounds[p]
        hi = bounds[p + 1]
        out[p] = _server_sumsq(bits[:, lo // 8 : hi // 8], scales_t[p], server_error[lo:hi]) if hi > lo else 0.0


@njit(**_JIT)
def _server_pack_pieces(bits, scales_t, server_error, t, update, bits_out, bounds):
    for p in range(bounds.size - 1):
        lo = bounds[p]
        hi = bounds[p + 1]
        if hi > lo:
            _server_pack(
                bits[:, lo // 8 : hi // 8], scales_t[p], server_error[lo:hi], t[p], update,
                bits_out[lo // 8 : hi // 8],
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


# --------------------------------------------------------------------------------------------
# The b-bit exchange (see the end of hf_onebit.kernels.reference)
# --------------------------------------------------------------------------------------------
#
# Everything here is exact, so it matches the reference bitwise, scales included:
#
# * The max-abs scale is a max over the *bit patterns* of |y| (``bits & 0x7fffffff``), an unsigned
#   integer max: for non-negative floats the integer order is the float order, inf (0x7f800000)
#   is above every finite value and every NaN above inf, so the max propagates NaN and inf like
#   the reference's ``amax`` and vectorises as a plain integer reduction (a float max with NaN
#   propagation would need a branch or fast-math). The host divides the max by ``Q`` with torch.
# * ``q = rint(clamp(y / s, -Q, Q))``: IEEE division, ``np.rint`` (round half to even, keeps the
#   sign of zero like ``torch.round``); clamping before rounding equals rounding before clamping
#   because ``±Q`` are integers. ``q = 0`` when ``s`` is 0 or not finite (decided once per piece).
# * ``error = y - s·q``, ``acc += s·q``: separate fp32 products and sums (no fast-math, so LLVM
#   never contracts them into a fused multiply-add).
#
# Codes are ``q + Q``; width 4 packs two per byte, the first element in the high nibble. A NaN
# ``y`` at a usable scale (only reachable with hand-made scales: a NaN in ``y`` makes its own
# scale NaN) gets code 0, what the reference's float -> uint8 cast gives on x86 (C++ leaves that
# cast undefined, and so would LLVM: hence the explicit select in _code).
#
# Every operation runs per piece (without ``bounds`` the host passes one piece, or one per chunk
# for the unpack), on the piece's slices: bounds are multiples of 8, so a piece owns whole bytes
# of codes at either width.

# error_model="numpy": y / s with s known to be > 0 needs no ZeroDivisionError check in the loop
_QJIT = {"nogil": True, "cache": True, "error_model": "numpy"}

_ABS_MASK = np.uint32(0x7FFFFFFF)


@intrinsic
def _f32_to_bits(typingctx, value):
    """Reinterpret an fp32 value as its uint32 bit pattern (a free register move)."""
    sig = types.uint32(types.float32)

    def codegen(context, builder, signature, args):
        return builder.bitcast(args[0], ir.IntType(32))

    return sig, codegen


@njit(**_QJIT)
def _qlevels(width):
    return 127 if width == 8 else 7


@njit(**_QJIT)
def _usable(s):
    """``q`` is computed (not 0) only for a finite, positive scale (False for NaN)."""
    return s > np.float32(0.0) and s < np.float32(np.inf)


@njit(**_QJIT)
def _level(y, s, qf):
    """``round_half_even(y / s)`` clamped to ``[-Q, Q]`` (NaN stays NaN)."""
    v = y / s
    v = qf if v > qf else v
    v = -qf if v < -qf else v
    return np.rint(v)


@njit(**_QJIT)
def _code(q, qf, Q):
    """The code ``q + Q`` of a level (NaN: 0, see above)."""
    return np.uint8(np.int32(q if q == q else -qf) + Q)


@njit(**_QJIT)
def _qworker_amax(x, error):
    """Bits of ``max|y|``, y = x (zero-padded to error.size) + error: one read-only pass."""
    n = x.size
    m = np.uint32(0)
    for i in range(n):
        b = _f32_to_bits(_load_f32(x[i]) + error[i]) & _ABS_MASK
        m = b if b > m else m
    for i in range(n, error.size):
        b = _f32_to_bits(np.float32(0.0) + error[i]) & _ABS_MASK
        m = b if b > m else m
    return m


@njit(**_QJIT)
def _qworker_amax_pieces(x, error, bounds, out):
    n = x.size
    for p in range(bounds.size - 1):
        lo = bounds[p]
        hi = bounds[p + 1]
        out[p] = _qworker_amax(x[min(lo, n) : min(hi, n)], error[lo:hi])


@njit(**_QJIT)
def _qstore(y, s, qf, Q, usable, update, error, i):
    """The code of ``y`` (element ``i``); writes ``error[i] = y - s·q`` if ``update``. For the
    few elements outside :func:`_qspan` (the padding, a byte straddling the end of ``x``)."""
    q = _level(y, s, qf) if usable else np.float32(0.0)
    if update:
        error[i] = y - s * q
    return _code(q, qf, Q)


@njit(**_QJIT)
def _qspan(x, error, codes_out, s, update, width):
    """codes_out = codes of y = x + error at scale ``s`` (``x.size == error.size``, even for
    width 4); if ``update``, error = y - s·q. Also the server's packing pass, with ``x`` the
    average (so y = average + ē in the reference's order).

    Separate loops per case (usable scale or not, update or not, width), each branch-free so
    LLVM vectorises it (the division, ``rint`` and the code conversion all have vector forms);
    a branch inside the loop would keep it scalar.
    """
    n = x.size
    Q = _qlevels(width)
    qf = np.float32(Q)
    if not _usable(s):  # every level is 0
        zero_code = np.uint8(Q if width == 8 else Q * 17)
        for b in range(n * width // 8):
            codes_out[b] = zero_code
        if update:  # s is finite here (0, or a negative hand-made one): y - s·0
            zq = s * np.float32(0.0)
            for i in range(n):
                error[i] = (_load_f32(x[i]) + error[i]) - zq
        return
    if width == 8:
        if update:
            for i in range(n):
                y = _load_f32(x[i]) + error[i]
                q = _level(y, s, qf)
                error[i] = y - s * q
                codes_out[i] = _code(q, qf, Q)
        else:
            for i in range(n):
                codes_out[i] = _code(_level(_load_f32(x[i]) + error[i], s, qf), qf, Q)
        return
    if update:
        for b in range(n // 2):
            i = 2 * b
            y0 = _load_f32(x[i]) + error[i]
            y1 = _load_f32(x[i + 1]) + error[i + 1]
            q0 = _level(y0, s, qf)
            q1 = _level(y1, s, qf)
            error[i] = y0 - s * q0
            error[i + 1] = y1 - s * q1
            codes_out[b] = (_code(q0, qf, Q) << np.uint8(4)) | _code(q1, qf, Q)
    else:
        for b in range(n // 2):
            i = 2 * b
            q0 = _level(_load_f32(x[i]) + error[i], s, qf)
            q1 = _level(_load_f32(x[i + 1]) + error[i + 1], s, qf)
            codes_out[b] = (_code(q0, qf, Q) << np.uint8(4)) | _code(q1, qf, Q)


@njit(**_QJIT)
def _qworker_pack(x, error, codes_out, s, update, width):
    """codes_out = codes of y = x (zero-padded to error.size) + error at scale ``s``; if
    ``update``, error = y - s·q. One pass; ``error.size`` is a multiple of 8."""
    n = x.size
    length = error.size
    whole = n - n % 2 if width == 4 else n  # elements of x that fill whole bytes
    _qspan(x[:whole], error[:whole], codes_out[: whole * width // 8], s, update, width)
    # The rest (at most one element of x, then the padding): short, so a plain scalar loop.
    Q = _qlevels(width)
    qf = np.float32(Q)
    usable = _usable(s)
    zero = np.float32(0.0)
    if width == 8:
        for i in range(whole, length):
            codes_out[i] = _qstore(zero + error[i], s, qf, Q, usable, update, error, i)
        return
    for b in range(whole // 2, length // 2):
        i = 2 * b
        y0 = (_load_f32(x[i]) if i < n else zero) + error[i]
        hi = _qstore(y0, s, qf, Q, usable, update, error, i)
        lo = _qstore(zero + error[i + 1], s, qf, Q, usable, update, error, i + 1)
        codes_out[b] = (hi << np.uint8(4)) | lo


@njit(**_QJIT)
def _qworker_pack_pieces(x, error, codes_out, own, bounds, update, width):
    n = x.size
    for p in range(bounds.size - 1):
        lo = bounds[p]
        hi = bounds[p + 1]
        if hi > lo:
            _qworker_pack(
                x[min(lo, n) : min(hi, n)], error[lo:hi], codes_out[lo * width // 8 : hi * width // 8],
                own[p], update, width,
            )


@njit(**_QJIT)
def _qaverage_block(rows, scales, acc, width):
    """``acc[:C_block] = Σ_i scales[i]·q_i`` for ``rows`` of shape ``(n, bytes)``: fp32, starting
    at +0.0, rows in rank order, each product rounded before it is added. The division by ``n``
    is left to the caller (:func:`_divide_by_n`)."""
    n, nbytes = rows.shape
    qf = np.float32(_qlevels(width))
    zero = np.float32(0.0)
    for r in range(n):
        s = scales[r]
        row = rows[r]
        if width == 8:
            if r == 0:  # `0.0 + v`, not `v`: a -0.0 term becomes +0.0 exactly like the reference
                for k in range(nbytes):
                    acc[k] = zero + s * (np.float32(row[k]) - qf)
            else:
                for k in range(nbytes):
                    acc[k] += s * (np.float32(row[k]) - qf)
        else:
            if r == 0:
                for k in range(nbytes):
                    c = row[k]
                    acc[2 * k] = zero + s * (np.float32(c >> np.uint8(4)) - qf)
                    acc[2 * k + 1] = zero + s * (np.float32(c & np.uint8(15)) - qf)
            else:
                for k in range(nbytes):
                    c = row[k]
                    acc[2 * k] += s * (np.float32(c >> np.uint8(4)) - qf)
                    acc[2 * k + 1] += s * (np.float32(c & np.uint8(15)) - qf)


@njit(**_QJIT)
def _qserver_average(codes, scales, out, width):
    n, nbytes = codes.shape
    step = _BLOCK * width // 8
    nothing = np.empty(0, np.float32)
    for b0 in range(0, nbytes, step):
        b1 = min(b0 + step, nbytes)
        block = out[b0 * 8 // width : b1 * 8 // width]
        _qaverage_block(codes[:, b0:b1], scales, block, width)
        _divide_by_n(block, block.size, n, nothing)


@njit(**_QJIT)
def _qserver_amax(codes, scales, server_error, width):
    """Bits of ``max|z|``, z = average + server_error (one read-only pass, blocked): the
    worker's loop with the block's average as ``x``."""
    n, nbytes = codes.shape
    step = _BLOCK * width // 8
    avg = np.empty(_BLOCK, np.float32)  # reused for every block, stays in L1
    nothing = np.empty(0, np.float32)
    m = np.uint32(0)
    for b0 in range(0, nbytes, step):
        b1 = min(b0 + step, nbytes)
        lo = b0 * 8 // width
        count = b1 * 8 // width - lo
        _qaverage_block(codes[:, b0:b1], scales, avg, width)
        _divide_by_n(avg, count, n, nothing)
        b = _qworker_amax(avg[:count], server_error[lo : lo + count])  # |average + ē|
        m = b if b > m else m
    return m


@njit(**_QJIT)
def _qserver_pack(codes, scales, server_error, t, update, codes_out, width):
    """codes_out = codes of z = average + ē at scale ``t``; if ``update``, ē = z - t·q."""
    n, nbytes = codes.shape
    step = _BLOCK * width // 8
    avg = np.empty(_BLOCK, np.float32)
    nothing = np.empty(0, np.float32)
    for b0 in range(0, nbytes, step):
        b1 = min(b0 + step, nbytes)
        lo = b0 * 8 // width
        count = b1 * 8 // width - lo
        _qaverage_block(codes[:, b0:b1], scales, avg, width)
        _divide_by_n(avg, count, n, nothing)
        # z = average + ē, quantised, ē written in place: the worker's loop (count is even)
        _qspan(avg[:count], server_error[lo : lo + count], codes_out[b0:b1], t, update, width)


@njit(**_QJIT)
def _qserver_average_pieces(codes, scales_t, bounds, out, width):
    for p in range(bounds.size - 1):
        lo = bounds[p]
        hi = bounds[p + 1]
        if hi > lo:
            _qserver_average(codes[:, lo * width // 8 : hi * width // 8], scales_t[p], out[lo:hi], width)


@njit(**_QJIT)
def _qserver_amax_pieces(codes, scales_t, server_error, bounds, out, width):
    for p in range(bounds.size - 1):
        lo = bounds[p]
        hi = bounds[p + 1]
        out[p] = (
            _qserver_amax(codes[:, lo * width // 8 : hi * width // 8], scales_t[p], server_error[lo:hi], width)
            if hi > lo else np.uint32(0)
        )


@njit(**_QJIT)
def _qserver_pack_pieces(codes, scales_t, server_error, t, update, codes_out, bounds, width):
    for p in range(bounds.size - 1):
        lo = bounds[p]
        hi = bounds[p + 1]
        if hi > lo:
            _qserver_pack(
                codes[:, lo * width // 8 : hi * width // 8], scales_t[p], server_error[lo:hi], t[p], update,
                codes_out[lo * width // 8 : hi * width // 8], width,
            )


@njit(**_QJIT)
def _qunpack_span(codes, s, out, width):
    """fp32 ``out[k] = s·q_k`` for ``k < out.size``: one fp32 product per element, the
    reference's exactly. ``codes`` and ``out`` are views starting at the same element: a loop
    from 0 over views vectorises, the same loop over ``[lo, hi)`` of the whole buffers does not
    (``benchmarks/kernels.py`` shows the difference)."""
    qf = np.float32(_qlevels(width))
    if width == 8:
        for k in range(out.size):
            out[k] = s * (np.float32(codes[k]) - qf)
        return
    whole = out.size // 2
    for b in range(whole):
        c = codes[b]
        out[2 * b] = s * (np.float32(c >> np.uint8(4)) - qf)
        out[2 * b + 1] = s * (np.float32(c & np.uint8(15)) - qf)
    if out.size % 2:  # out ends in the middle of a byte
        out[2 * whole] = s * (np.float32(codes[whole] >> np.uint8(4)) - qf)


@njit(**_QJIT)
def _qunpack_pieces(codes, scales, bounds, out, width):
    """fp32 ``out[k] = scales[piece(k)]·q_k`` for ``k < out.size``; ``codes`` flat, every bound
    a multiple of 8 (so a piece starts on a whole byte)."""
    total = out.size
    for p in range(bounds.size - 1):
        lo = bounds[p]
        if lo >= total:
            break
        hi = min(bounds[p + 1], total)
        _qunpack_span(codes[lo * width // 8 : (hi * width + 7) // 8], scales[p], out[lo:hi], width)


@njit(**_QJIT)
def _qunpack_lut_span(codes, table, out, width):
    """``out[k] = table[code_k]`` for ``k < out.size`` (views, as in :func:`_qunpack_span`)."""
    if width == 8:
        for k in range(out.size):
            out[k] = table[codes[k]]
        return
    whole = out.size // 2
    for b in range(whole):
        c = codes[b]
        out[2 * b] = table[c >> np.uint8(4)]
        out[2 * b + 1] = table[c & np.uint8(15)]
    if out.size % 2:
        out[2 * whole] = table[codes[whole] >> np.uint8(4)]


@njit(**_QJIT)
def _qunpack_lut_pieces(codes, lut, bounds, out, width):
    """``out[k] = lut[piece(k), code_k]`` for ``k < out.size`` (raw bit patterns of out's dtype,
    the table made by torch); ``codes`` flat."""
    total = out.size
    for p in range(bounds.size - 1):
        lo = bounds[p]
        if lo >= total:
            break
        hi = min(bounds[p + 1], total)
        _qunpack_lut_span(codes[lo * width // 8 : (hi * width + 7) // 8], lut[p], out[lo:hi], width)
