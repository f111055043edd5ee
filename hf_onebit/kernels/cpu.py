"""Fast CPU backend of the 1-bit compression kernels (spec §1), written with numba.

Same functions, signatures and results as :mod:`hf_onebit.kernels.reference` (read its
docstring first: it defines ``x``, ``L``, ``error``, ``bits`` and ``sign⁺``). The reference
allocates several fp32 temporaries of length ``L`` per call; this module allocates nothing
that grows with the buffer (a few KiB of per-call scratch at most).

Why the code looks like this
----------------------------
For a large buffer these kernels are limited by memory traffic, not arithmetic. On a CPU a
fresh multi-MB temporary costs a page fault per 4 KiB the first time it is written, so "compute
into a new buffer, then copy" is several times slower than writing into memory that already
exists. Every kernel here therefore streams over the caller's buffers exactly once per pass and
writes results in place:

* :func:`worker_scale` is one read-only pass over ``x`` and ``error`` (8 bytes per element).
* :func:`worker_pack` is one pass that reads ``x`` and ``error`` again, writes the bits and, if
  every scale is finite, writes ``error`` back (12 bytes per element).

The two passes cannot be fused into one: the scale must be known (and exchanged with the
other ranks) before any error entry may be overwritten, and the split is what lets a
non-finite value anywhere leave every error buffer untouched. Together they move about 2.5x
the nominal bytes of a plain ``y.copy_(x)`` (20 vs 8 per element; the copy really moves 12,
because writing ``y`` first reads its cache lines), so a measured ratio of about 2 means the
kernels run at memory speed. ``benchmarks/kernels.py`` measures it (about 2.1x for 64M fp32
elements on the 2-core Xeon this was written on).

The server operations read ``n`` rows of bits (``C/8`` bytes each) plus ``C`` floats of
server error. They work on blocks of :data:`_BLOCK` elements: the running average of a block
is kept in a small scratch array that stays in L1 cache, so the rows are summed in exactly the
order the spec prescribes (``acc = 0; acc += s_i·sign⁺_i for i in rank order; a = acc / n``)
without an fp32 temporary of length ``C``. Each row's bytes are first expanded into 0/1 flag
bytes (the packing trick below, run backwards), so that adding a row is a contiguous
select-and-add loop. Dividing by ``n`` is a multiplication when ``n`` is a power of two (that
is bitwise the same and much cheaper than a vector division).

Vectorisation. Numba hands the loops to LLVM, which vectorises them only if they are
branch-free and the floating-point semantics allow it. We never enable fast-math on code that
produces bits or error values (they must match the reference bitwise); only the float64
sum-of-squares reductions carry ``reassoc`` (and ``contract``, harmless because the square of
an fp32 value is exact in float64), which lets LLVM keep several partial sums in vector
registers. The spec allows scales to differ from the reference by rounding for that reason.

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
Outputs of :func:`unpack_scaled` hold only two distinct values per chunk (``±t_j``), so the
fp32 -> out-dtype conversion is done by torch itself on those ``2·n`` values (bitwise what the
reference's ``copy_`` does), and the kernel only copies raw bit patterns.

Threads. The kernels are single-threaded on purpose (the other cores run backward) and release
the GIL (``nogil=True``) so a communication thread can compress while Python keeps going.
All kernels are compiled lazily with ``cache=True``: the first call per input dtype costs a
compile of about a second, later processes load the machine code from ``__pycache__``.

Pieces (``bounds=``, see the reference). The piece variants loop over the pieces inside numba
and run the single-scale kernels above on each piece's slices (piece bounds are multiples of 8,
so each slice owns whole bytes of the packed bits). A piece costs one call (a few hundred ns),
so hundreds of pieces in a multi-MB buffer cost nothing measurable.
"""

from __future__ import annotations

import sys

import numpy as np
import torch
from llvmlite import ir
from numba import njit, types
from numba.extending import intrinsic, overload

from . import contract
from .reference import check_bounds, pack_signs, unpack_signs

__all__ = [
    "check_bounds",
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

if sys.byteorder != "little":  # _flags_to_bytes reads 8 flag bytes as one little-endian word
    raise ImportError("hf_onebit.kernels.cpu assumes a little-endian CPU; use the reference backend")

# Elements per block in the blocked kernels: 2 KiB of flags + 8 KiB of fp32 scratch stay in
# L1 next to the streamed data. Smaller blocks pay the per-block call and slicing overhead
# measurably; larger ones measured no faster.
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
    # packing loop matter: this form measured ~20% faster than iterating over slices and
    # calling _flags_to_bytes, and a variable trip count with `base + j` indexing was not
    # vectorised at all (3x slower).
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

    Exact spec order: fp32 accumulator starting at +0.0, rows added in rank order. The
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
        if r == 0:  # `0.0 + v`, not `v`: turns a -0.0 term into +0.0 exactly like the spec
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
        # The loop shape of _unpack (a byte counter, 8 stores per byte): measured faster than
        # stepping the element offset by 8.
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
# Tensor plumbing
# --------------------------------------------------------------------------------------------

_INT_OF_SIZE = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def _check_cpu(name: str, t: torch.Tensor) -> None:
    if t.device.type != "cpu":
        raise ValueError(f"hf_onebit.kernels.cpu: {name} must be a CPU tensor, got {t.device}")


def _input_view(x: torch.Tensor) -> np.ndarray:
    """Flat numpy view of ``x`` in a type the kernels can load (no copy for float dtypes)."""
    _check_cpu("x", x)
    x = x.detach().reshape(-1)
    if not x.is_contiguous():  # e.g. a strided 1-D view, which reshape leaves as it is
        x = x.contiguous()
    if x.dtype in (torch.float32, torch.float64):
        return x.numpy()
    if x.dtype == torch.bfloat16:
        return x.view(torch.int16).numpy().view(np.uint16)
    if x.dtype == torch.float16:
        return x.view(torch.int16).numpy()
    # Any other dtype: one conversion copy, as the reference's `.to(torch.float32)` does.
    return x.to(torch.float32).numpy()


def _inplace_view(name: str, t: torch.Tensor, dtype: torch.dtype) -> np.ndarray:
    """numpy view sharing memory with ``t``; refuses anything we could not write through."""
    _check_cpu(name, t)
    contract.require(t, name, dtype)
    return t.detach().reshape(-1).numpy()


def _scales_f32(scales: torch.Tensor, count: int) -> np.ndarray:
    # The kernels index scales without bounds checks, so the length is checked here.
    _check_cpu("scales", scales)
    if scales.numel() != count:
        raise ValueError(f"expected {count} scales, got {scales.numel()}")
    return scales.detach().reshape(-1).to(torch.float32).contiguous().numpy()


def _bits_view(bits: torch.Tensor) -> np.ndarray:
    _check_cpu("bits", bits)
    if bits.dim() != 2 or bits.dtype != torch.uint8:
        raise ValueError(f"bits must be a 2-D uint8 tensor (n, C // 8), got {tuple(bits.shape)} {bits.dtype}")
    return bits.detach().contiguous().numpy()


def _rms(sumsq: float, count: int) -> torch.Tensor:
    # Same final steps as the reference: float64 mean, sqrt, one rounding to fp32.
    if count == 0:
        return torch.zeros((), dtype=torch.float32)
    return torch.tensor(np.sqrt(sumsq / count), dtype=torch.float64).to(torch.float32)


def _bounds_array(bounds, length: int) -> np.ndarray:
    return np.asarray(check_bounds(bounds, length), dtype=np.int64)


def _piece_scales(scales: torch.Tensor, rows: int, pieces: int) -> np.ndarray:
    """``(rows, P)`` scales, transposed to ``(P, rows)`` fp32 so each piece's row is contiguous."""
    _check_cpu("scales", scales)
    if scales.numel() != rows * pieces:
        raise ValueError(f"expected {rows} x {pieces} scales, got {tuple(scales.shape)}")
    return scales.detach().reshape(rows, pieces).to(torch.float32).t().contiguous().numpy()


def _rms_pieces(sumsq: np.ndarray, bounds: np.ndarray) -> torch.Tensor:
    # The same final steps as _rms, elementwise: float64 mean, sqrt, one rounding to fp32.
    counts = np.diff(bounds).astype(np.float64)
    with np.errstate(invalid="ignore", divide="ignore"):
        rms = np.where(counts > 0, np.sqrt(sumsq / np.maximum(counts, 1.0)), 0.0)
    return torch.from_numpy(rms).to(torch.float32)


# --------------------------------------------------------------------------------------------
# Public API (same as hf_onebit.kernels.reference)
# --------------------------------------------------------------------------------------------


def worker_scale(x: torch.Tensor, error: torch.Tensor, *, bounds=None) -> torch.Tensor:
    """``RMS(x_padded + error)`` as a 0-dim fp32 tensor (0 for an empty buffer).

    With ``bounds``: the ``(P,)`` RMS of each piece.
    """
    contract.check_worker(x, error)
    e = _inplace_view("error", error, torch.float32)
    if bounds is None:
        return _rms(_worker_sumsq(_input_view(x), e), e.size)
    b = _bounds_array(bounds, e.size)
    sumsq = np.empty(b.size - 1, np.float64)
    _worker_sumsq_pieces(_input_view(x), e, b, sumsq)
    return _rms_pieces(sumsq, b)


def worker_pack(
    x: torch.Tensor,
    error: torch.Tensor,
    scales: torch.Tensor,
    rank: int,
    bits_out: torch.Tensor,
    *,
    bounds=None,
) -> None:
    """Write ``sign⁺(x + error)`` into ``bits_out``; update ``error`` in place.

    ``scales`` holds every rank's :func:`worker_scale`; this rank's is ``scales[rank]``. The
    error becomes ``y - s·sign⁺(y)`` only when all scales are finite. With ``bounds``,
    ``scales`` is ``(n, P)`` and piece ``p`` uses ``scales[rank, p]``.
    """
    contract.check_worker(x, error, bits_out)
    if bounds is None:
        contract.check_rank(scales, rank)
    e = _inplace_view("error", error, torch.float32)
    b = _inplace_view("bits_out", bits_out, torch.uint8)
    update = bool(torch.isfinite(scales).all())  # on the given dtype, as the reference does
    if bounds is None:
        s = _scales_f32(scales, scales.numel())
        _worker_pack(_input_view(x), e, b, s[rank], update)
        return
    bnd = _bounds_array(bounds, e.size)
    pieces = bnd.size - 1
    _check_cpu("scales", scales)
    if pieces == 0:  # L == 0: nothing to pack
        return
    if scales.numel() % pieces or not 0 <= rank < scales.numel() // pieces:
        raise ValueError(f"scales {tuple(scales.shape)} do not hold rank {rank}'s {pieces} piece scales")
    own = scales.detach().reshape(-1, pieces)[rank].to(torch.float32).contiguous().numpy()
    _worker_pack_pieces(_input_view(x), e, b, own, bnd, update)


def server_average(bits: torch.Tensor, scales: torch.Tensor, *, bounds=None) -> torch.Tensor:
    """``mean_i scales[i] · sign⁺(bits[i])`` with the exact summation order of the spec.

    With ``bounds`` (over the chunk), ``scales`` is ``(n, P)``.
    """
    contract.check_rows(bits, scales if bounds is None else None)
    bn = _bits_view(bits)
    out = torch.empty(8 * bn.shape[1], dtype=torch.float32)
    if bounds is None:
        _server_average(bn, _scales_f32(scales, bn.shape[0]), out.numpy())
    else:
        bnd = _bounds_array(bounds, out.numel())
        _server_average_pieces(bn, _piece_scales(scales, bn.shape[0], bnd.size - 1), bnd, out.numpy())
    return out


def server_scale(
    bits: torch.Tensor, scales: torch.Tensor, server_error: torch.Tensor, *, bounds=None
) -> torch.Tensor:
    """``RMS(server_average(bits, scales) + server_error)`` as a 0-dim fp32 tensor.

    With ``bounds``: the ``(P,)`` RMS of each piece of ``z``.
    """
    contract.check_server(bits, scales if bounds is None else None, server_error)
    bn = _bits_view(bits)
    e = _inplace_view("server_error", server_error, torch.float32)
    if bounds is None:
        return _rms(_server_sumsq(bn, _scales_f32(scales, bn.shape[0]), e), e.size)
    bnd = _bounds_array(bounds, e.size)
    sumsq = np.empty(bnd.size - 1, np.float64)
    _server_sumsq_pieces(bn, _piece_scales(scales, bn.shape[0], bnd.size - 1), e, bnd, sumsq)
    return _rms_pieces(sumsq, bnd)


def server_pack(
    bits: torch.Tensor,
    scales: torch.Tensor,
    server_error: torch.Tensor,
    scale: torch.Tensor,
    bits_out: torch.Tensor,
    *,
    bounds=None,
) -> None:
    """Write ``sign⁺(z)``, ``z = average + ē``; ``ē = z - t·sign⁺(z)`` only if ``t`` is finite.

    With ``bounds``, ``scale`` holds the ``(P,)`` piece scales (all must be finite).
    """
    contract.check_server(bits, scales if bounds is None else None, server_error, bits_out)
    if bounds is not None:
        _server_pack_with_pieces(bits, scales, server_error, scale, bits_out, bounds)
        return
    bn, e, b = _server_pack_views(bits, server_error, bits_out)
    scale = torch.as_tensor(scale).detach()
    if scale.numel() != 1:
        raise ValueError(f"scale must hold one value, got {scale.numel()}")
    update = bool(torch.isfinite(scale).all())
    t = scale.reshape(-1).to(torch.float32).numpy()[0]
    _server_pack(bn, _scales_f32(scales, bn.shape[0]), e, t, update, b)


def _server_pack_views(bits, server_error, bits_out):
    """The numpy views :func:`server_pack` works on (checked by ``contract.check_server``)."""
    bn = _bits_view(bits)
    e = _inplace_view("server_error", server_error, torch.float32)
    b = _inplace_view("bits_out", bits_out, torch.uint8)
    return bn, e, b


def _server_pack_with_pieces(bits, scales, server_error, scale, bits_out, bounds) -> None:
    bn, e, b = _server_pack_views(bits, server_error, bits_out)
    bnd = _bounds_array(bounds, e.size)
    scale = torch.as_tensor(scale).detach()
    if scale.numel() != bnd.size - 1:
        raise ValueError(f"scale must hold {bnd.size - 1} piece scales, got {scale.numel()}")
    update = bool(torch.isfinite(scale).all())
    t = scale.reshape(-1).to(torch.float32).contiguous().numpy()
    _server_pack_pieces(bn, _piece_scales(scales, bn.shape[0], bnd.size - 1), e, t, update, b, bnd)


def unpack_scaled(bits: torch.Tensor, scales: torch.Tensor, out: torch.Tensor, *, bounds=None) -> None:
    """``out[k] = scales[k // C] · sign⁺_k`` for ``k < out.numel()``, cast to ``out.dtype``.

    ``bits`` has shape ``(n, C // 8)``: row ``j`` is chunk ``j`` of the result. With ``bounds``
    (over all ``n·C`` elements), ``out[k] = scales[piece(k)] · sign⁺_k``.
    """
    contract.check_unpack(bits, scales if bounds is None else None, out)
    bn = _bits_view(bits)
    _check_cpu("out", out)
    if not out.is_contiguous():  # rare: decompress into contiguous memory, then copy over
        tmp = torch.empty(out.shape, dtype=out.dtype)
        unpack_scaled(bits, scales, tmp, bounds=bounds)
        out.copy_(tmp)
        return
    raw = _INT_OF_SIZE.get(out.element_size())
    if raw is None or out.is_complex():
        raise TypeError(f"unpack_scaled cannot write {out.dtype}")
    # Only two values per chunk exist: -t_j and +t_j, computed in fp32 as the reference does,
    # then converted by torch itself, so every out dtype rounds exactly like `copy_`.
    if bounds is None:
        sc = torch.from_numpy(_scales_f32(scales, bn.shape[0]))
        lut = torch.stack((sc * -1.0, sc * 1.0), dim=1).to(out.dtype).view(raw)
        _unpack(bn, lut.numpy(), out.detach().reshape(-1).view(raw).numpy())
        return
    bnd = _bounds_array(bounds, 8 * bn.size)
    sc = torch.from_numpy(_scales_f32(scales, bnd.size - 1))
    lut = torch.stack((sc * -1.0, sc * 1.0), dim=1).to(out.dtype).view(raw)
    _unpack_pieces(bn.reshape(-1), lut.numpy(), bnd, out.detach().reshape(-1).view(raw).numpy())


def pack_bools(flags: torch.Tensor, out: torch.Tensor) -> None:
    """:func:`hf_onebit.kernels.reference.pack_bools` as one vectorised pass (``numpy.packbits``)."""
    _check_cpu("flags", flags)
    _check_cpu("out", out)
    if flags.numel() % 8 or out.numel() * 8 != flags.numel():
        raise ValueError(f"pack_bools: {flags.numel()} flags (a multiple of 8) into {out.numel()} bytes")
    out.numpy()[:] = np.packbits(flags.numpy())


# --------------------------------------------------------------------------------------------
# BinSGDM's worker math (not part of the compression contract: a CPU fast path that
# hf_onebit.optim.binsgdm.vote_threshold_ takes for contiguous fp32 CPU tensors)
# --------------------------------------------------------------------------------------------


@njit(**_JIT, error_model="numpy")  # x/0 is ±inf or NaN as in torch, not a ZeroDivisionError
def _vote_threshold(m, b, g, beta, one_minus_beta, eps, nan_to_zero, m_out, b_out, theta):
    one, half = np.float32(1.0), np.float32(0.5)
    for i in range(m.size):
        gi = g[i]
        mo = m[i] * beta + gi * one_minus_beta  # each product and the sum rounded to fp32 (no FMA)
        bo = b[i] * beta + abs(gi) * one_minus_beta
        m_out[i] = mo
        b_out[i] = bo
        z = mo / (bo + eps)
        if nan_to_zero and z != z:
            z = np.float32(0.0)
        theta[i] = (z + one) * half


def vote_threshold(m: torch.Tensor, b: torch.Tensor, g: torch.Tensor, *, beta: float, eps: float,
                   m_out: torch.Tensor, b_out: torch.Tensor, theta: torch.Tensor) -> None:
    """One pass of :func:`hf_onebit.optim.binsgdm.vote_threshold_` (same results, bitwise).

    ``m_out = β·m + (1-β)·g``, ``b_out = β·b + (1-β)·|g|``, ``theta = (1 + m_out/(b_out+eps))/2``
    over flat contiguous fp32 CPU tensors; every operation rounded on its own, in the torch
    function's order, with the scalars rounded to fp32 as torch rounds them. The torch version
    makes ten passes over memory (~70 ms for 11M elements on one thread), this one one.
    """
    arrays = [_inplace_view(name, t, torch.float32) for name, t in
              (("m", m), ("b", b), ("g", g), ("m_out", m_out), ("b_out", b_out), ("theta", theta))]
    if len({a.size for a in arrays}) != 1:
        raise ValueError(f"vote_threshold: lengths differ: {[a.size for a in arrays]}")
    f32 = np.float32
    _vote_threshold(arrays[0], arrays[1], arrays[2], f32(beta), f32(1.0 - beta), f32(eps), eps == 0.0,
                    arrays[3], arrays[4], arrays[5])
