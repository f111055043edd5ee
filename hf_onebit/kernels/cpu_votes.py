"""BinSGDM's two CPU kernels and their host functions: the worker math and the draws.

:func:`vote_threshold` is one pass of :func:`hf_onebit.kernels.reference.vote_threshold`;
:func:`vote_uniform` draws numpy's Philox-4x64 numbers for every parameter of a bucket in one
call. Both are part of the CPU backend (:mod:`hf_onebit.kernels.cpu` exports them). Their numba
loops call nothing outside this file, so numba's cache (``cache=True``, which notices edits only
to the file that defines a function) never runs stale code of them (see
:mod:`hf_onebit.kernels.cpu_jit`).
"""

from __future__ import annotations

import numpy as np
import torch
from numba import njit

from . import contract

_JIT = {"nogil": True, "cache": True}


def _flat(name: str, t: torch.Tensor) -> np.ndarray:
    """The flat numpy view of a contiguous fp32 CPU tensor (checked by the contract), shared memory."""
    if t.device.type != "cpu":
        raise ValueError(f"hf_onebit.kernels.cpu: {name} must be a CPU tensor, got {t.device}")
    return t.detach().reshape(-1).numpy()


# --------------------------------------------------------------------------------------------
# BinSGDM's worker math (see vote_threshold below)
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



# --------------------------------------------------------------------------------------------
# BinSGDM's draws: numpy's Philox-4x64 for many counters in one call
# --------------------------------------------------------------------------------------------
# numpy's ``Generator(Philox(key=(k0, k1), counter=c)).random(n, float32)`` with a fresh state
# (empty buffer) draws from the blocks of counters c+1, c+2, ... (the counter is incremented
# before each block of four 64-bit words), uses each word as two 32-bit halves (low first) and
# turns each half into ``(half >> 8)·2**-24``. :func:`_vote_uniform` computes exactly those
# numbers for many counters ``[0, 0, index_i, step]`` into one flat buffer, so BinSGDM draws a
# whole bucket in one call instead of resetting a generator per parameter (bitwise numpy's,
# checked in tests/kernels/test_backend_vote.py). The 64x64 -> 128-bit products are formed from
# 32-bit halves (numba has no 128-bit integers).

_U64 = np.uint64
_PHILOX_M0, _PHILOX_M1 = _U64(0xD2E7470EE14C6C93), _U64(0xCA5A826395121157)
_PHILOX_W0, _PHILOX_W1 = _U64(0x9E3779B97F4A7C15), _U64(0xBB67AE8584CAA73B)
_LOW32, _SHIFT32 = _U64(0xFFFFFFFF), _U64(32)


@njit(**_JIT)
def _mulhilo64(a, b):
    a_lo, a_hi = a & _LOW32, a >> _SHIFT32
    b_lo, b_hi = b & _LOW32, b >> _SHIFT32
    p0, p1, p2, p3 = a_lo * b_lo, a_lo * b_hi, a_hi * b_lo, a_hi * b_hi
    mid = (p0 >> _SHIFT32) + (p1 & _LOW32) + (p2 & _LOW32)
    return p3 + (p1 >> _SHIFT32) + (p2 >> _SHIFT32) + (mid >> _SHIFT32), a * b


@njit(**_JIT)
def _philox4x64(c0, c1, c2, c3, k0, k1):
    """Philox-4x64-10 (Random123, as numpy runs it) of the counter ``c`` under the key ``k``."""
    for r in range(10):
        if r:
            k0 += _PHILOX_W0
            k1 += _PHILOX_W1
        hi0, lo0 = _mulhilo64(_PHILOX_M0, c0)
        hi1, lo1 = _mulhilo64(_PHILOX_M1, c2)
        c0, c1, c2, c3 = hi1 ^ c1 ^ k0, lo1, hi0 ^ c3 ^ k1, lo0
    return c0, c1, c2, c3


@njit(**_JIT)
def _vote_uniform(out, offsets, indices, step, k0, k1):
    """``out[offsets[i]:offsets[i+1]]`` = numpy's float32 draws of counter ``[0, 0, indices[i], step]``."""
    scale = np.float32(1.0 / 16777216.0)
    eight = _U64(8)
    for i in range(indices.size):
        lo, n = offsets[i], offsets[i + 1] - offsets[i]
        for k in range((n + 7) // 8):
            w = _philox4x64(_U64(k + 1), _U64(0), indices[i], step, k0, k1)
            for j in range(min(8, n - 8 * k)):
                word = w[j // 2]
                half = (word >> _SHIFT32) if j % 2 else (word & _LOW32)
                out[lo + 8 * k + j] = np.float32(half >> eight) * scale


# --------------------------------------------------------------------------------------------
# The host functions
# --------------------------------------------------------------------------------------------


def vote_threshold(m: torch.Tensor, b: torch.Tensor, g: torch.Tensor, *, beta: float, eps: float,
                   m_out: torch.Tensor, b_out: torch.Tensor, theta: torch.Tensor) -> None:
    """One pass of :func:`hf_onebit.kernels.reference.vote_threshold` (same results, bitwise).

    ``m_out = β·m + (1-β)·g``, ``b_out = β·b + (1-β)·|g|``, ``theta = (1 + m_out/(b_out+eps))/2``
    over flat contiguous fp32 CPU tensors; every operation rounded on its own, in the torch
    function's order, with the scalars rounded to fp32 as torch rounds them. The torch version
    makes ten passes over memory, this one one.
    """
    contract.check_vote(m, b, g, m_out, b_out, theta)
    arrays = [_flat(name, t) for name, t in
              (("m", m), ("b", b), ("g", g), ("m_out", m_out), ("b_out", b_out), ("theta", theta))]
    f32 = np.float32
    _vote_threshold(arrays[0], arrays[1], arrays[2], f32(beta), f32(1.0 - beta), f32(eps), eps == 0.0,
                    arrays[3], arrays[4], arrays[5])


def vote_uniform_table(offsets, indices, device) -> tuple:
    """:func:`hf_onebit.kernels.reference.vote_uniform_table` as numpy arrays (made once per layout)."""
    offsets, indices = contract.check_vote_pieces(offsets, indices)
    return np.array(offsets, dtype=np.int64), np.array(indices, dtype=np.uint64)


def vote_uniform(out: torch.Tensor, table, *, seed: int, stream: int, step: int) -> None:
    """:func:`hf_onebit.kernels.reference.vote_uniform` (numpy's Philox per piece, bitwise) in one
    numba call for the whole bucket, instead of resetting a numpy generator per parameter."""
    offsets, indices = table
    contract.check_vote_uniform(out, int(offsets[-1]), seed, stream, step)
    contract.require(out, "out", torch.float32)
    flat = _flat("out", out)
    u64 = np.uint64
    _vote_uniform(flat, offsets, indices, u64(step), u64(seed), u64(stream))
