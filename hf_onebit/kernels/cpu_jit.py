"""What every numba loop of the CPU backend shares: the compile options, the block size, the fp32
load of every input dtype and the division by ``n``.

The loops themselves are in :mod:`hf_onebit.kernels.cpu_sign_loops` (the 1-bit exchange),
:mod:`hf_onebit.kernels.cpu_code_loops` (the b-bit exchange) and
:mod:`hf_onebit.kernels.cpu_votes` (BinSGDM's); :mod:`hf_onebit.kernels.cpu` is their host side.

Vectorisation. Numba hands the loops to LLVM, which vectorises them only if they are
branch-free and the floating-point semantics allow it. We never enable fast-math on code that
produces bits, codes or error values (they must match the reference bitwise); only the float64
sum-of-squares reductions carry ``reassoc`` (and ``contract``, harmless because the square of
an fp32 value is exact in float64), which lets LLVM keep several partial sums in vector
registers; scales may therefore differ from the reference's by rounding, which is why the
self-test compares them to fp32 rounding, not bitwise.

Input dtypes. numba cannot load bf16 or fp16 arrays, so such inputs are handed to the loops
as raw 16-bit integers: bf16 as ``uint16`` and fp16 as ``int16`` (the integer type is only a
tag telling :func:`_load_f32` which decoding to compile in). bf16 -> fp32 is exact: the bf16
bits are the top half of the fp32 bits. fp16 -> fp32 uses LLVM's ``fpext half`` (one
``vcvtph2ps`` instruction on x86 with F16C), exact for every one of the 65536 bit patterns.

Threads. The loops are single-threaded on purpose (the other cores run backward) and release
the GIL (``nogil=True``) so a communication thread can compress while Python keeps going.

The cache. Every loop is compiled lazily with ``cache=True``: the first call per input dtype
costs a compile of about a second, later processes load the machine code from ``__pycache__``.
numba keys that cache on the file that defines a loop alone, not on the functions it calls
from other files, so the loop files name this file's digest (:func:`require_digest`): an edit
here cannot be imported until they are edited too, and editing them is what makes numba
recompile their loops.
"""

from __future__ import annotations

import hashlib
import sys
from pathlib import Path

import numpy as np
from llvmlite import ir
from numba import njit, types
from numba.extending import intrinsic, overload

if sys.byteorder != "little":  # the sign loops read 8 flag bytes as one little-endian word
    raise ImportError("hf_onebit.kernels.cpu assumes a little-endian CPU; use the reference backend")

# Elements per block in the blocked loops: 2 KiB of flags + 8 KiB of fp32 scratch stay in
# L1 next to the streamed data. Smaller blocks pay the per-block call and slicing overhead on
# too few elements; larger ones amortise nothing more and push the scratch out of L1.
_BLOCK = 2048

_JIT = {"nogil": True, "cache": True}


def require_digest(expected: str, user: str) -> None:
    """Refuse to import ``user`` against another version of this file (see "The cache" above)."""
    digest = hashlib.sha256(Path(__file__).read_bytes().replace(b"\r\n", b"\n")).hexdigest()[:16]
    if digest != expected:
        raise ImportError(
            f"hf_onebit.kernels.cpu_jit changed: set the digest that {user} passes to require_digest to"
            f" {digest!r}. numba caches {user}'s loops keyed on that file alone, so editing it is what"
            " makes numba recompile the code they inline from cpu_jit."
        )


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
