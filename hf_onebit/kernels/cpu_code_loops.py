"""The numba loops of the b-bit exchange (see the end of :mod:`hf_onebit.kernels.reference`), for
the CPU backend :mod:`hf_onebit.kernels.cpu`. They follow the sign loops' rules
(:mod:`hf_onebit.kernels.cpu_sign_loops`): one read-only pass for a scale, one pass that writes
codes and errors in place, the server blocked through an L1 scratch.

Everything here is exact, so it matches the reference bitwise, scales included:

* The max-abs scale is a max over the *bit patterns* of |y| (``bits & 0x7fffffff``), an unsigned
  integer max: for non-negative floats the integer order is the float order, inf (0x7f800000)
  is above every finite value and every NaN above inf, so the max propagates NaN and inf like
  the reference's ``amax`` and vectorises as a plain integer reduction (a float max with NaN
  propagation would need a branch or fast-math). The host divides the max by ``Q`` with torch.
* ``q = rint(clamp(y / s, -Q, Q))``: IEEE division, ``np.rint`` (round half to even, keeps the
  sign of zero like ``torch.round``); clamping before rounding equals rounding before clamping
  because ``±Q`` are integers. ``q = 0`` when ``s`` is 0 or not finite (decided once per piece).
* ``error = y - s·q``, ``acc += s·q``: separate fp32 products and sums (no fast-math, so LLVM
  never contracts them into a fused multiply-add).

Codes are ``q + Q``; width 4 packs two per byte, the first element in the high nibble. A NaN
``y`` at a usable scale (only reachable with hand-made scales: a NaN in ``y`` makes its own
scale NaN) gets code 0, what the reference's float -> uint8 cast gives on x86 (C++ leaves that
cast undefined, and so would LLVM: hence the explicit select in _code).

Every operation runs per piece (without ``bounds`` the host passes one piece, or one per chunk
for the unpack), on the piece's slices: bounds are multiples of 8, so a piece owns whole bytes
of codes at either width.
"""

from __future__ import annotations

import numpy as np
from llvmlite import ir
from numba import njit, types
from numba.extending import intrinsic

from .cpu_jit import _BLOCK, _divide_by_n, _load_f32, require_digest

require_digest("4bfc244d6ed5a77e", "cpu_code_loops.py")

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
    nothing = out[:0]
    for b0 in range(0, nbytes, step):
        b1 = min(b0 + step, nbytes)
        block = out[b0 * 8 // width : b1 * 8 // width]
        _qaverage_block(codes[:, b0:b1], scales, block, width)
        _divide_by_n(block, block.size, n, nothing)


@njit(**_QJIT)
def _qserver_amax(codes, scales, server_error, width, avg):
    """Bits of ``max|z|``, z = average + server_error (one read-only pass, blocked): the
    worker's loop with the block's average as ``x``. ``avg``: scratch of :data:`_BLOCK`
    elements, reused for every block (and piece: an allocation per piece would cost more than
    a short piece's elements), so it stays in L1."""
    n, nbytes = codes.shape
    step = _BLOCK * width // 8
    nothing = avg[:0]
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
def _qserver_pack(codes, scales, server_error, t, update, codes_out, width, avg):
    """codes_out = codes of z = average + ē at scale ``t``; if ``update``, ē = z - t·q
    (``avg`` as for :func:`_qserver_amax`)."""
    n, nbytes = codes.shape
    step = _BLOCK * width // 8
    nothing = avg[:0]
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
    avg = np.empty(_BLOCK, np.float32)
    for p in range(bounds.size - 1):
        lo = bounds[p]
        hi = bounds[p + 1]
        out[p] = (
            _qserver_amax(codes[:, lo * width // 8 : hi * width // 8], scales_t[p], server_error[lo:hi], width, avg)
            if hi > lo else np.uint32(0)
        )


@njit(**_QJIT)
def _qserver_pack_pieces(codes, scales_t, server_error, t, update, codes_out, bounds, width):
    avg = np.empty(_BLOCK, np.float32)
    for p in range(bounds.size - 1):
        lo = bounds[p]
        hi = bounds[p + 1]
        if hi > lo:
            _qserver_pack(
                codes[:, lo * width // 8 : hi * width // 8], scales_t[p], server_error[lo:hi], t[p], update,
                codes_out[lo * width // 8 : hi * width // 8], width, avg,
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
