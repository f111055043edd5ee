"""The device code of the Triton backend (:mod:`hf_onebit.kernels.triton`) for one scale per
row: how its kernels are launched, the helpers inlined into them, and the kernels themselves.
The piece variants (``bounds=``, :mod:`hf_onebit.kernels.triton_piece_kernels`) use the same
helpers and follow the same rules.

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
"""

from __future__ import annotations

import contextlib

import torch
import triton
import triton.language as tl

# --------------------------------------------------------------------------------------------
# Launching: the block size, warps and device of a launch
# --------------------------------------------------------------------------------------------

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
# The b-bit exchange: ``WIDTH``-bit codes and max-abs scales
# --------------------------------------------------------------------------------------------
#
# Bitwise agreement with the reference (every result is defined exactly, scales included):
# * Max: ``|y|`` compared as int32 bit patterns. With the sign bit cleared these are ordered
#   like the floats, and every NaN lies above +inf, so the integer max is exact, independent of
#   the order, and propagates NaN (a float max on the GPU would drop it: ``max.f32`` returns
#   the other operand). Each program writes one int32 partial; a one-program kernel reduces
#   them and divides by ``Q`` (``div_rn``), so a scale costs no host sync and no torch op. A
#   NaN max becomes the default quiet NaN first, as torch's ``amax`` returns it.
# * Levels: ``y / s`` with ``div_rn``; clamped to ``[-Q, Q]`` first (round and clamp commute:
#   the bounds are integers), then rounded half to even by adding and subtracting 1.5·2^23
#   (exact for ``|v| <= 2^22``; libdevice ``rint`` does not run in the interpreter), keeping
#   the sign of a zero result as ``rint`` (``torch.round``) does.
# * Error ``y - s·q`` and average ``acc += s_i·q_i``: plain products and sums; the launches turn
#   fused multiply-add off, so the product is rounded before the sum as in torch.
# Codes are handled on ``[BLOCK // PER, PER]`` tiles (``PER = 8 // WIDTH`` elements per byte):
# packing is a row reduction, unpacking a broadcast, as for the signs.

_ROUND_MAGIC = tl.constexpr(12582912.0)  # 1.5 * 2**23: v + M rounds v to an integer, half to even


@triton.jit
def _qtile(WIDTH: tl.constexpr, BLOCK: tl.constexpr):
    """This program's byte indices ``[BLOCK // PER]`` and element indices ``[BLOCK // PER, PER]``."""
    PER: tl.constexpr = 8 // WIDTH
    BYTES: tl.constexpr = BLOCK // PER
    pid = tl.program_id(0).to(tl.int64)
    byte = pid * BYTES + tl.arange(0, BYTES)
    elem = byte[:, None] * PER + tl.arange(0, PER)[None, :]
    return byte, elem


@triton.jit
def _abs_bits(v):
    """``|v|`` as int32 bits: ordered like ``|v|``, every NaN above +inf (see above)."""
    return tl.abs(v).to(tl.int32, bitcast=True)


@triton.jit
def _amax_to_scale(amax_bits, WIDTH: tl.constexpr):
    """The scale ``max|y| / Q`` from the int32 bits of ``max|y|`` (IEEE division)."""
    Q: tl.constexpr = (1 << (WIDTH - 1)) - 1
    # A NaN max is torch's: ``amax`` returns the default quiet NaN whatever the payload (the
    # GPU's division makes any NaN canonical anyway; the interpreter's would keep the payload).
    amax_bits = tl.where(amax_bits > 0x7F800000, 0x7FC00000, amax_bits)
    m = amax_bits.to(tl.float32, bitcast=True)
    return tl.math.div_rn(m, tl.full(m.shape, Q, tl.float32))


@triton.jit
def _quantize(y, s, WIDTH: tl.constexpr):
    """``q = clamp(round_half_even(y / s), -Q, Q)``, ``+0`` where ``s`` is 0 or not finite."""
    QF: tl.constexpr = ((1 << (WIDTH - 1)) - 1) * 1.0
    usable = _is_finite(s) & (s > 0)
    d = tl.full(y.shape, 1.0, tl.float32)
    d = tl.where(usable, s, d)
    v = tl.math.div_rn(y, d)
    v = tl.minimum(tl.maximum(v, -QF), QF)
    r = (v + _ROUND_MAGIC) - _ROUND_MAGIC
    r = tl.where(r == 0.0, v * 0.0, r)  # rint keeps the sign: round(-0.3) = -0.0
    return tl.where(usable, r, 0.0)


@triton.jit
def _pack_codes(q, WIDTH: tl.constexpr):
    """``[B, PER]`` levels -> ``[B]`` uint8 codes ``q + Q``, element 0 in the high bits."""
    Q: tl.constexpr = (1 << (WIDTH - 1)) - 1
    PER: tl.constexpr = 8 // WIDTH
    shifts = (PER - 1 - tl.arange(0, PER)) * WIDTH
    codes = (q + Q).to(tl.int32)  # exact: an integer in [0, 2Q]
    # At most 255, so the final cast is exact (see _pack_bytes).
    return tl.sum(codes << shifts[None, :], axis=1).to(tl.uint8)


@triton.jit
def _unpack_codes(packed, WIDTH: tl.constexpr):
    """``[B]`` uint8 -> ``[B, PER]`` int32 codes (``0 .. 2^WIDTH - 1``), element 0 from the high bits."""
    PER: tl.constexpr = 8 // WIDTH
    shifts = (PER - 1 - tl.arange(0, PER)) * WIDTH
    return (packed.to(tl.int32)[:, None] >> shifts[None, :]) & ((1 << WIDTH) - 1)


@triton.jit
def _qmean(codes_ptr, scales_ptr, stride, p, byte, byte_ok, n, row_bytes, WIDTH: tl.constexpr,
           BLOCK: tl.constexpr):
    """``a = (Σ_i s_i·q_i) / n`` on one tile, in rank order; ``s_i = scales[i·stride + p]``."""
    Q: tl.constexpr = (1 << (WIDTH - 1)) - 1
    PER: tl.constexpr = 8 // WIDTH
    acc = tl.zeros([BLOCK // PER, PER], dtype=tl.float32)
    row_ptr = codes_ptr + byte  # pointer walk: 64-bit, as in _server_mean
    for i in range(n):
        packed = tl.load(row_ptr, mask=byte_ok, other=0)
        s = tl.load(scales_ptr + i * stride + p)
        acc += s * (_unpack_codes(packed, WIDTH).to(tl.float32) - Q)
        row_ptr += row_bytes
    return tl.math.div_rn(acc, tl.full(acc.shape, n, tl.float32))


@triton.jit
def _qz(codes_ptr, scales_ptr, stride, p, serr_ptr, byte, elem, byte_ok, n, row_bytes,
        WIDTH: tl.constexpr, BLOCK: tl.constexpr):
    """``z = a + ē`` on one tile (lanes outside the chunk are garbage: mask them)."""
    a = _qmean(codes_ptr, scales_ptr, stride, p, byte, byte_ok, n, row_bytes, WIDTH, BLOCK)
    return a + tl.load(serr_ptr + elem, mask=byte_ok[:, None], other=0.0)


@triton.jit
def _qpack_store(y, s, all_finite, codes_ptr, err_ptr, byte, elem, byte_ok, WIDTH: tl.constexpr):
    """Store the codes of ``y`` at scale ``s``; ``error = y - s·q`` where ``all_finite``."""
    q = _quantize(y, s, WIDTH)
    tl.store(codes_ptr + byte, _pack_codes(q, WIDTH), mask=byte_ok)
    tl.store(err_ptr + elem, y - s * q, mask=_and_flag(byte_ok[:, None], all_finite))


@triton.jit
def _qunpack_store(codes_ptr, table_ptr, out_ptr, row, byte, elem, byte_ok, numel, WIDTH: tl.constexpr):
    """``out = table[row, code]``: the table holds ``s_row·(c - Q)`` for every code ``c``, already in
    ``out``'s dtype (so the kernel converts nothing, as :func:`_unpack_scaled_kernel`)."""
    packed = tl.load(codes_ptr + byte, mask=byte_ok, other=0)
    idx = row * (1 << WIDTH) + _unpack_codes(packed, WIDTH)
    ok = byte_ok[:, None] & (elem < numel)
    tl.store(out_ptr + elem, tl.load(table_ptr + idx, mask=ok, other=0.0), mask=ok)


@triton.jit
def _qscale_kernel(partial_ptr, out_ptr, count, WIDTH: tl.constexpr, R: tl.constexpr):
    """``out = max(partials) / Q``: one program, the int32 max of the ``count`` partials."""
    acc = tl.zeros([R], dtype=tl.int32)
    for i in range(0, count, R):
        k = i + tl.arange(0, R)
        acc = tl.maximum(acc, tl.load(partial_ptr + k, mask=k < count, other=0))
    tl.store(out_ptr, _amax_to_scale(tl.max(acc, axis=0), WIDTH))


@triton.jit
def _qworker_amax_kernel(x_ptr, err_ptr, partial_ptr, N, L, BLOCK: tl.constexpr):
    """Pass 1 (read only): ``partial[pid] = max |x + e|`` (int32 bits) over this program's block."""
    pid = tl.program_id(0).to(tl.int64)
    offs = pid * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(x_ptr + offs, mask=offs < N, other=0.0).to(tl.float32)
    e = tl.load(err_ptr + offs, mask=offs < L, other=0.0)
    tl.store(partial_ptr + pid, tl.max(_abs_bits(x + e), axis=0))  # padding: |0| = bits 0


@triton.jit
def _qworker_pack_kernel(
    x_ptr, err_ptr, scales_ptr, codes_ptr, N, L, n, rank, N_PAD: tl.constexpr, WIDTH: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """Pass 2: codes of ``y = x + e`` at ``s = scales[rank]``; ``e = y - s·q`` if all scales are finite."""
    byte, elem = _qtile(WIDTH, BLOCK)
    PER: tl.constexpr = 8 // WIDTH
    in_range = elem < L
    x = tl.load(x_ptr + elem, mask=elem < N, other=0.0).to(tl.float32)
    e = tl.load(err_ptr + elem, mask=in_range, other=0.0)
    k = tl.arange(0, N_PAD)
    scales = tl.load(scales_ptr + k, mask=k < n, other=0.0)
    all_finite = tl.sum((~_is_finite(scales)).to(tl.int32), axis=0) == 0
    s = tl.load(scales_ptr + rank)
    _qpack_store(x + e, s, all_finite, codes_ptr, err_ptr, byte, elem, byte < L // PER, WIDTH)


@triton.jit
def _qserver_average_kernel(codes_ptr, scales_ptr, out_ptr, n, row_bytes, WIDTH: tl.constexpr,
                            BLOCK: tl.constexpr):
    """``out = (Σ_i s_i·q_i) / n`` (only :func:`qserver_average` needs it materialised)."""
    byte, elem = _qtile(WIDTH, BLOCK)
    byte_ok = byte < row_bytes
    a = _qmean(codes_ptr, scales_ptr, 1, 0, byte, byte_ok, n, row_bytes, WIDTH, BLOCK)
    tl.store(out_ptr + elem, a, mask=byte_ok[:, None])


@triton.jit
def _qserver_amax_kernel(codes_ptr, scales_ptr, serr_ptr, partial_ptr, n, row_bytes, WIDTH: tl.constexpr,
                         BLOCK: tl.constexpr):
    """Server pass 1 (read only): ``partial[pid] = max |z|`` (int32 bits) over this program's block."""
    byte, elem = _qtile(WIDTH, BLOCK)
    byte_ok = byte < row_bytes
    z = _qz(codes_ptr, scales_ptr, 1, 0, serr_ptr, byte, elem, byte_ok, n, row_bytes, WIDTH, BLOCK)
    bits = tl.where(byte_ok[:, None], _abs_bits(z), 0)
    tl.store(partial_ptr + tl.program_id(0).to(tl.int64), tl.max(tl.max(bits, axis=1), axis=0))


@triton.jit
def _qserver_pack_kernel(codes_ptr, scales_ptr, serr_ptr, t_ptr, out_ptr, n, row_bytes, WIDTH: tl.constexpr,
                         BLOCK: tl.constexpr):
    """Server pass 2: codes of ``z`` at ``t``; ``ē = z - t·q`` only if ``t`` is finite."""
    byte, elem = _qtile(WIDTH, BLOCK)
    byte_ok = byte < row_bytes
    z = _qz(codes_ptr, scales_ptr, 1, 0, serr_ptr, byte, elem, byte_ok, n, row_bytes, WIDTH, BLOCK)
    t = tl.load(t_ptr)
    _qpack_store(z, t, _is_finite(t), out_ptr, serr_ptr, byte, elem, byte_ok, WIDTH)


@triton.jit
def _qunpack_kernel(codes_ptr, table_ptr, out_ptr, numel, row_bytes, WIDTH: tl.constexpr, BLOCK: tl.constexpr):
    """``out[k] = s_j·q_k`` (``j = k // C``) for ``k < numel``, from the per-row table of values
    (see :func:`_qunpack_store`); a 1-D grid over bytes, as :func:`_unpack_scaled_kernel`."""
    byte, elem = _qtile(WIDTH, BLOCK)
    PER: tl.constexpr = 8 // WIDTH
    row = (byte // row_bytes)[:, None]
    _qunpack_store(codes_ptr, table_ptr, out_ptr, row, byte, elem, byte * PER < numel, numel, WIDTH)
