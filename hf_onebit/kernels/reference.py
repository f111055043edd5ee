"""Plain-torch reference of the 1-bit compression kernels.

This module *defines* what every kernel backend computes; the CPU fast path
(:mod:`hf_onebit.kernels.cpu`) and the Triton kernels (:mod:`hf_onebit.kernels.triton`)
are tested against it. It is written for clarity, not speed: it allocates freely.

Vocabulary (see ``docs/algorithms.md``):

* ``x``        the buffer to compress, any float dtype, ``N`` elements.
* ``L``        the padded length, a multiple of ``8 * n`` (``n`` = world size). ``x`` is read
               as if zero-padded to ``L``: no padded copy of ``x`` is ever made.
* ``error``    the worker error, fp32, ``L`` elements (the padding region has an error too).
* ``bits``     packed signs, uint8, 8 elements per byte, **most significant bit first**
               (``numpy.packbits`` layout); bit 1 means the element was ``>= 0``.
* ``sign⁺(y)`` +1 where ``y >= 0`` else -1 (zero maps to +1; NaN maps to -1).

The five operations, in the order the compressed all-reduce calls them:

1. :func:`worker_scale`   ``s = RMS(x + error)`` over ``L`` elements           (read only)
2. :func:`worker_pack`    ``bits = sign⁺(x + error)``; ``error = y - s·sign⁺(y)``
                          only if every rank's scale is finite
3. :func:`server_scale`   ``t = RMS(mean_i s_i·sign⁺_i + ē)``                  (read only)
4. :func:`server_pack`    ``bits = sign⁺(z)``; ``ē = z - t·sign⁺(z)`` only if ``t`` is finite
5. :func:`unpack_scaled`  ``out[k] = t_{k // C} · sign⁺_k`` in ``out``'s dtype

Splitting "scale" from "pack" is what lets the all-reduce exchange scales *before* any error
buffer is written, so a non-finite value on any rank leaves every error buffer untouched.

The server average is defined exactly, so every backend produces identical bits:
``acc = 0; for i in 0..n-1: acc += s_i · sign⁺_i`` (fp32, in rank order), then ``a = acc / n``.
Scales are sums of squares accumulated in float64 here; fast backends may accumulate in
another order, so scales agree to rounding, not bitwise (bits of a single call agree bitwise).

Pieces (one scale per piece instead of one per buffer or chunk)
---------------------------------------------------------------
Every function takes an optional keyword ``bounds``: ``P + 1`` non-decreasing element offsets
``0 = b_0 <= b_1 <= ... <= b_P = length``, each a multiple of 8 (so no packed byte straddles two
pieces), given on the host (a sequence of ints or a CPU integer tensor: the layout is static
metadata, never a device value). Piece ``p`` is ``[b_p, b_{p+1})``; an empty piece has scale 0
(the RMS of nothing). ``length`` is ``L`` for the worker operations, ``C`` (one chunk) for the
server operations and ``n·C`` (all chunks) for :func:`unpack_scaled`. With ``bounds``:

* :func:`worker_scale` returns the ``(P,)`` per-piece RMS of ``x + error``;
* :func:`worker_pack` takes every rank's scales as ``(n, P)``; ``error = y - s[rank, piece(k)]·sign⁺``,
  written only if all ``n·P`` scales are finite;
* :func:`server_average` / :func:`server_scale` / :func:`server_pack` take the worker scales of
  the chunk's pieces as ``(n, P)``: ``a[k] = (Σ_i s[i, piece(k)]·sign⁺_i[k]) / n`` in rank
  order; :func:`server_scale` returns ``(P,)``, :func:`server_pack` takes that ``(P,)`` and
  writes ``ē`` only if all ``P`` are finite;
* :func:`unpack_scaled` takes ``(P,)`` scales over all chunks: ``out[k] = s[piece(k)]·sign⁺_k``.

Without ``bounds`` everything is exactly the single-scale arithmetic above (bitwise); the
per-chunk scales of :func:`unpack_scaled` are the pieces ``[j·C, (j+1)·C)``.
"""

from __future__ import annotations

import torch

from hf_onebit.kernels import contract

#: the kernel contract's operations, and the code helpers the other backends import from here
__all__ = [*contract.OPERATIONS, "levels", "pack_codes", "unpack_codes"]

_BIT_WEIGHTS = (128, 64, 32, 16, 8, 4, 2, 1)


_WEIGHTS: dict[torch.device, torch.Tensor] = {}


def _weights(device: torch.device) -> torch.Tensor:
    """:data:`_BIT_WEIGHTS` on ``device``, made once: a ``torch.tensor`` of a Python list per
    call would copy from the host, which on CUDA waits for the device."""
    w = _WEIGHTS.get(device)
    if w is None:
        w = _WEIGHTS[device] = torch.tensor(_BIT_WEIGHTS, dtype=torch.uint8, device=device)
    return w


def pack_signs(y: torch.Tensor) -> torch.Tensor:
    """Pack ``y >= 0`` into uint8, MSB first. ``y.numel()`` must be a multiple of 8."""
    if y.numel() % 8:
        raise ValueError(f"pack_signs needs a multiple of 8 elements, got {y.numel()}")
    bits = (y.reshape(-1, 8) >= 0).to(torch.uint8) * _weights(y.device)
    return bits.sum(dim=1, dtype=torch.uint8)


def pack_bools(flags: torch.Tensor, out: torch.Tensor) -> None:
    """Pack the bool vector ``flags`` into ``out`` (uint8), MSB first, 1 = True: the layout of
    :func:`pack_signs`. ``flags.numel()`` must be a multiple of 8, ``out`` hold an eighth of it."""
    if flags.numel() % 8 or out.numel() * 8 != flags.numel():
        raise ValueError(f"pack_bools: {flags.numel()} flags (a multiple of 8) into {out.numel()} bytes")
    out.copy_((flags.view(-1, 8).to(torch.uint8) * _weights(flags.device)).sum(dim=1, dtype=torch.uint8))


def unpack_signs(bits: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`pack_signs`: fp32 tensor of ±1, shape ``bits.shape[:-1] + (8 * K,)``."""
    set_ = bits.unsqueeze(-1).bitwise_and(_weights(bits.device)).ne(0)
    return (set_.to(torch.float32) * 2 - 1).reshape(*bits.shape[:-1], bits.shape[-1] * 8)


def _padded(x: torch.Tensor, length: int) -> torch.Tensor:
    y = torch.zeros(length, dtype=torch.float32, device=x.device)
    y[: x.numel()] = x.reshape(-1).to(torch.float32)
    return y


def _rms(y: torch.Tensor) -> torch.Tensor:
    if y.numel() == 0:
        return torch.zeros((), dtype=torch.float32, device=y.device)
    sumsq = y.to(torch.float64).square().sum()
    return (sumsq / y.numel()).sqrt().to(torch.float32)


def _sign(y: torch.Tensor) -> torch.Tensor:
    return torch.where(y >= 0, 1.0, -1.0).to(torch.float32)


def check_bounds(bounds, length: int) -> list[int]:
    """Validate piece ``bounds`` (host ints) for a buffer of ``length`` elements; return a list."""
    if isinstance(bounds, torch.Tensor):
        if bounds.device.type != "cpu":
            raise ValueError("bounds are host metadata: pass a CPU tensor or a sequence of ints")
        bounds = bounds.tolist()
    b = [int(v) for v in bounds]
    if not b or b[0] != 0 or b[-1] != length:
        raise ValueError(f"bounds must run from 0 to {length}, got {b[:3]}...{b[-3:]}")
    if any(hi < lo for lo, hi in zip(b[:-1], b[1:])):
        raise ValueError("bounds must be non-decreasing")
    if any(v % 8 for v in b):
        raise ValueError("every bound must be a multiple of 8 (no packed byte may straddle two pieces)")
    return b


def _lengths(b: list[int], device: torch.device) -> torch.Tensor:
    return torch.tensor([hi - lo for lo, hi in zip(b[:-1], b[1:])], dtype=torch.int64, device=device)


def _expand(scales: torch.Tensor, b: list[int]) -> torch.Tensor:
    """Per-element scales: ``scales[..., p]`` repeated over piece ``p``'s elements."""
    return torch.repeat_interleave(scales.to(torch.float32), _lengths(b, scales.device), dim=-1)


def _piece_rms(y: torch.Tensor, b: list[int]) -> torch.Tensor:
    out = torch.zeros(len(b) - 1, dtype=torch.float32, device=y.device)
    for p, (lo, hi) in enumerate(zip(b[:-1], b[1:])):
        out[p] = _rms(y[lo:hi])
    return out


def worker_scale(x: torch.Tensor, error: torch.Tensor, *, bounds=None) -> torch.Tensor:
    """``RMS(x_padded + error)`` as a 0-dim fp32 tensor (0 for an empty buffer).

    With ``bounds``: the ``(P,)`` RMS of each piece.
    """
    contract.check_worker(x, error)
    y = _padded(x, error.numel()) + error
    if bounds is None:
        return _rms(y)
    return _piece_rms(y, check_bounds(bounds, error.numel()))


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

    ``scales`` holds every rank's :func:`worker_scale` (already exchanged); this rank's is
    ``scales[rank]``. The error becomes ``y - s·sign⁺(y)`` only when all scales are finite.
    With ``bounds``, ``scales`` is ``(n, P)`` and piece ``p`` uses ``scales[rank, p]``.
    """
    contract.check_worker(x, error, bits_out)
    if bounds is None:
        contract.check_rank(scales, rank)
    y = _padded(x, error.numel()) + error
    bits_out.copy_(pack_signs(y))
    if bool(torch.isfinite(scales).all()):
        if bounds is None:
            error.copy_(y - scales[rank] * _sign(y))
        else:
            b = check_bounds(bounds, error.numel())
            if len(b) > 1:  # else L == 0: nothing to update
                own = scales.reshape(-1, len(b) - 1)[rank]
                error.copy_(y - _expand(own, b) * _sign(y))


def server_average(bits: torch.Tensor, scales: torch.Tensor, *, bounds=None) -> torch.Tensor:
    """``mean_i scales[i] · sign⁺(bits[i])`` with the summation order the module docstring defines.

    With ``bounds`` (over the chunk), ``scales`` is ``(n, P)``: element ``k`` of row ``i`` is
    weighted by ``scales[i, piece(k)]``.
    """
    contract.check_rows(bits, scales if bounds is None else None)
    signs = unpack_signs(bits)
    if bounds is not None:
        b = check_bounds(bounds, signs.shape[1])
        scales = _expand(scales.reshape(bits.shape[0], len(b) - 1), b)
    acc = torch.zeros(signs.shape[1], dtype=torch.float32, device=bits.device)
    for i in range(bits.shape[0]):
        acc += scales[i] * signs[i]
    return acc / bits.shape[0]


def server_scale(
    bits: torch.Tensor, scales: torch.Tensor, server_error: torch.Tensor, *, bounds=None
) -> torch.Tensor:
    """``RMS(server_average(bits, scales) + server_error)`` as a 0-dim fp32 tensor.

    With ``bounds``: the ``(P,)`` RMS of each piece of ``z``.
    """
    contract.check_server(bits, scales if bounds is None else None, server_error)
    z = server_average(bits, scales, bounds=bounds) + server_error
    if bounds is None:
        return _rms(z)
    return _piece_rms(z, check_bounds(bounds, server_error.numel()))


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

    With ``bounds``, ``scale`` is the ``(P,)`` output of :func:`server_scale` and ``ē`` is
    written only if all of them are finite.
    """
    contract.check_server(bits, scales if bounds is None else None, server_error, bits_out)
    z = server_average(bits, scales, bounds=bounds) + server_error
    bits_out.copy_(pack_signs(z))
    if bool(torch.isfinite(scale).all()):
        if bounds is None:
            server_error.copy_(z - scale * _sign(z))
        else:
            b = check_bounds(bounds, server_error.numel())
            server_error.copy_(z - _expand(scale.reshape(-1), b) * _sign(z))


def unpack_scaled(bits: torch.Tensor, scales: torch.Tensor, out: torch.Tensor, *, bounds=None) -> None:
    """``out[k] = scales[k // C] · sign⁺_k`` for ``k < out.numel()``, cast to ``out.dtype``.

    ``bits`` has shape ``(n, C // 8)``: row ``j`` is chunk ``j`` of the result. With ``bounds``
    (over all ``n·C`` elements), ``out[k] = scales[piece(k)] · sign⁺_k``.
    """
    contract.check_unpack(bits, scales if bounds is None else None, out)
    if bounds is not None:
        b = check_bounds(bounds, bits.numel() * 8)
        values = unpack_signs(bits).reshape(-1) * _expand(scales.reshape(-1), b)
        out.copy_(values[: out.numel()].view(out.shape))
        return
    values = unpack_signs(bits) * scales.reshape(-1, 1).to(torch.float32)
    out.copy_(values.reshape(-1)[: out.numel()].view(out.shape))


# ============================================================================================
# The b-bit exchange: ``width``-bit codes and a max-abs scale in place of signs and RMS
# (docs/algorithms.md, "Exchanges")
# ============================================================================================
#
# Vocabulary, besides the above:
#
# * ``width``    bits per element, 8 or 4 (:data:`~hf_onebit.kernels.contract.WIDTHS`).
# * ``Q``        the largest level, ``2**(width-1) - 1`` (127 or 7).
# * ``s``        a scale, ``max|y| / Q`` in fp32 over the piece (0 for an empty or all-zero one);
#                NaN or inf as soon as ``y`` holds one (the max propagates them).
# * ``q``        the level of an element, ``round_half_even(y / s)`` (IEEE fp32 division),
#                clamped to ``[-Q, Q]``; ``q = 0`` wherever ``s`` is 0 or not finite.
# * ``codes``    the levels on the wire, uint8: ``code = q + Q``. ``width=8``: one per byte;
#                ``width=4``: two per byte, the first element in the high nibble (MSB first,
#                as the signs).
#
# Decoding is ``s·q`` (one fp32 product): every rank decodes the same codes to the same values.
# The operations mirror the five above, with a required keyword ``width``:
#
# 1. :func:`qworker_scale`    ``s = max|x + error| / Q``                          (read only)
# 2. :func:`qworker_pack`     ``codes = q(y, s)``; ``error = y - s·q`` only if every rank's
#                             scale is finite
# 3. :func:`qserver_scale`    ``t = max|mean_i s_i·q_i + ē| / Q``                  (read only)
# 4. :func:`qserver_pack`     ``codes = q(z, t)``; ``ē = z - t·q`` only if ``t`` is finite
# 5. :func:`qunpack_scaled`   ``out[k] = t_{k // C} · q_k`` in ``out``'s dtype
#
# The server average is ``acc = 0; for i in 0..n-1: acc += s_i · q_i`` (fp32, rank order, the
# product rounded before the sum: no fused multiply-add), then ``a = acc / n``. Every quantity is
# defined exactly (a max, not a sum of squares), so every backend must agree bitwise, scales too.
# ``bounds`` work as for the 1-bit operations: one scale per piece.


def levels(width: int) -> int:
    """``Q = 2**(width-1) - 1``, the largest level of a ``width``-bit code."""
    return 2 ** (contract.check_width(width) - 1) - 1


def pack_codes(q: torch.Tensor, width: int) -> torch.Tensor:
    """Levels ``q`` (integral floats in ``[-Q, Q]``, a multiple of 8 of them) as uint8 codes."""
    codes = (q.reshape(-1) + levels(width)).to(torch.uint8)
    if width == 8:
        return codes
    pairs = codes.view(-1, 2)
    return pairs[:, 0] * 16 + pairs[:, 1]


def unpack_codes(codes: torch.Tensor, width: int) -> torch.Tensor:
    """Inverse of :func:`pack_codes`: fp32 levels, shape ``codes.shape[:-1] + (K·8/width,)``."""
    Q = levels(width)
    if width == 8:
        return codes.to(torch.float32) - Q
    high, low = torch.div(codes, 16, rounding_mode="floor"), codes.remainder(16)
    pairs = torch.stack((high, low), dim=-1).to(torch.float32) - Q
    return pairs.reshape(*codes.shape[:-1], codes.shape[-1] * 2)


def _amax_scale(y: torch.Tensor, width: int) -> torch.Tensor:
    if y.numel() == 0:
        return torch.zeros((), dtype=torch.float32, device=y.device)
    return y.abs().amax() / torch.tensor(float(levels(width)), dtype=torch.float32, device=y.device)


def _piece_amax(y: torch.Tensor, b: list[int], width: int) -> torch.Tensor:
    out = torch.zeros(len(b) - 1, dtype=torch.float32, device=y.device)
    for p, (lo, hi) in enumerate(zip(b[:-1], b[1:])):
        out[p] = _amax_scale(y[lo:hi], width)
    return out


def _quantize(y: torch.Tensor, s: torch.Tensor, width: int) -> torch.Tensor:
    """``q``: ``s`` a scale or per-element scales; 0 where ``s`` is 0 or not finite."""
    Q = levels(width)
    usable = torch.isfinite(s) & (s > 0)
    q = torch.round(y / torch.where(usable, s, 1.0)).clamp_(-Q, Q)
    return torch.where(usable, q, 0.0)


def _element_scales(scales: torch.Tensor, bounds, length: int) -> torch.Tensor:
    """``scales`` (one per piece) repeated over each piece's elements."""
    return _expand(scales.reshape(-1), check_bounds(bounds, length))


def qworker_scale(x: torch.Tensor, error: torch.Tensor, *, width: int, bounds=None) -> torch.Tensor:
    """``max|x_padded + error| / Q`` as a 0-dim fp32 tensor (0 for an empty buffer).

    With ``bounds``: the ``(P,)`` scale of each piece.
    """
    contract.check_qworker(x, error, width)
    y = _padded(x, error.numel()) + error
    if bounds is None:
        return _amax_scale(y, width)
    return _piece_amax(y, check_bounds(bounds, error.numel()), width)


def qworker_pack(x: torch.Tensor, error: torch.Tensor, scales: torch.Tensor, rank: int, codes_out: torch.Tensor,
                 *, width: int, bounds=None) -> None:
    """Write the codes of ``y = x + error`` at this rank's scales; ``error = y - s·q`` only when
    every scale (all ranks, all pieces) is finite. Scales as for :func:`worker_pack`."""
    contract.check_qworker(x, error, width, codes_out)
    if bounds is None:
        contract.check_rank(scales, rank)
    y = _padded(x, error.numel()) + error
    if y.numel() == 0:
        return
    if bounds is None:
        s = scales[rank].to(torch.float32)
    else:
        b = check_bounds(bounds, error.numel())
        s = _expand(scales.reshape(-1, len(b) - 1)[rank], b)
    q = _quantize(y, s, width)
    codes_out.copy_(pack_codes(q, width))
    if bool(torch.isfinite(scales).all()):
        error.copy_(y - s * q)


def qserver_average(codes: torch.Tensor, scales: torch.Tensor, *, width: int, bounds=None) -> torch.Tensor:
    """``mean_i scales[i] · q_i`` in rank order (scales as for :func:`server_average`)."""
    n, chunk = contract.check_qrows(codes, width, scales if bounds is None else None)
    q = unpack_codes(codes, width)
    if bounds is not None:
        b = check_bounds(bounds, chunk)
        scales = _expand(scales.reshape(n, len(b) - 1), b)
    acc = torch.zeros(chunk, dtype=torch.float32, device=codes.device)
    for i in range(n):
        acc += scales[i].to(torch.float32) * q[i]
    return acc / n


def qserver_scale(codes: torch.Tensor, scales: torch.Tensor, server_error: torch.Tensor, *, width: int,
                  bounds=None) -> torch.Tensor:
    """``max|qserver_average + ē| / Q`` (0-dim), or the ``(P,)`` scales of the pieces of ``z``."""
    contract.check_qserver(codes, width, scales if bounds is None else None, server_error)
    z = qserver_average(codes, scales, width=width, bounds=bounds) + server_error
    if bounds is None:
        return _amax_scale(z, width)
    return _piece_amax(z, check_bounds(bounds, server_error.numel()), width)


def qserver_pack(codes: torch.Tensor, scales: torch.Tensor, server_error: torch.Tensor, scale: torch.Tensor,
                 codes_out: torch.Tensor, *, width: int, bounds=None) -> None:
    """Write the codes of ``z = average + ē`` at ``scale``; ``ē = z - t·q`` only if every ``t`` is finite."""
    contract.check_qserver(codes, width, scales if bounds is None else None, server_error, codes_out)
    z = qserver_average(codes, scales, width=width, bounds=bounds) + server_error
    t = scale.reshape(()) if bounds is None else _element_scales(scale, bounds, server_error.numel())
    q = _quantize(z, t.to(torch.float32), width)
    codes_out.copy_(pack_codes(q, width))
    if bool(torch.isfinite(scale).all()):
        server_error.copy_(z - t * q)


def qunpack_scaled(codes: torch.Tensor, scales: torch.Tensor, out: torch.Tensor, *, width: int,
                   bounds=None) -> None:
    """``out[k] = scales[k // C] · q_k`` for ``k < out.numel()`` (with ``bounds``: ``scales[piece(k)]``)."""
    n, chunk = contract.check_qunpack(codes, width, scales if bounds is None else None, out)
    q = unpack_codes(codes, width)
    if bounds is None:
        values = q * scales.reshape(-1, 1).to(torch.float32)
    else:
        values = q.reshape(-1) * _element_scales(scales, bounds, n * chunk)
    out.copy_(values.reshape(-1)[: out.numel()].view(out.shape))


# --------------------------------------------------------------------------------------------
# BinSGDM's worker math (docs/algorithms.md, "BinSGDM")
# --------------------------------------------------------------------------------------------


def vote_threshold(m: torch.Tensor, b: torch.Tensor, g: torch.Tensor, *, beta: float, eps: float,
                   m_out: torch.Tensor, b_out: torch.Tensor, theta: torch.Tensor) -> None:
    """BinSGDM's worker math over flat fp32 buffers (one parameter, or a whole bucket).

    ``m_out = β·m + (1-β)·g``, ``b_out = β·b + (1-β)·|g|``, ``theta = (1 + m_out/(b_out+eps))/2``,
    the probability of a ``+1`` vote; with ``eps == 0`` a ``0/0`` (a coordinate that never had a
    gradient, ``|m| <= b = 0``) gives ``z = 0``. Every operation is rounded on its own (no fused
    multiply-add) in this order, with the scalars rounded to fp32 as torch rounds them, so a plain
    float32 loop reproduces it bitwise: that is what the fast backends do, in one pass.
    """
    contract.check_vote(m, b, g, m_out, b_out, theta)
    vote_threshold_ops(m, b, g, beta=beta, eps=eps, m_out=m_out, b_out=b_out, theta=theta, tmp=torch.empty_like(g))


def vote_threshold_ops(m: torch.Tensor, b: torch.Tensor, g: torch.Tensor, *, beta: float, eps: float,
                       m_out: torch.Tensor, b_out: torch.Tensor, theta: torch.Tensor, tmp: torch.Tensor) -> None:
    """:func:`vote_threshold`'s torch operations, unchecked, with ``tmp`` (as long as ``g``) as
    scratch: also what BinSGDM runs on tensors the kernels do not take (strided, other dtypes)."""
    torch.mul(g, 1.0 - beta, out=tmp)
    torch.mul(m, beta, out=m_out)
    m_out.add_(tmp)
    torch.abs(g, out=tmp)
    tmp.mul_(1.0 - beta)
    torch.mul(b, beta, out=b_out)
    b_out.add_(tmp)
    torch.add(b_out, eps, out=theta)
    torch.div(m_out, theta, out=theta)
    if eps == 0.0:  # 0/0 where the coordinate never had a gradient: z = 0 (|m| <= b = 0)
        theta.nan_to_num_(nan=0.0, posinf=float("inf"), neginf=float("-inf"))
    theta.add_(1.0).mul_(0.5)


def vote_uniform_table(offsets, indices, device) -> tuple:
    """What :func:`vote_uniform` needs to know of a bucket layout (made once per layout): the
    pieces' offsets in the buffer and their random-stream indices (host ints here)."""
    return contract.check_vote_pieces(offsets, indices)


def vote_uniform(out: torch.Tensor, table, *, seed: int, stream: int, step: int) -> None:
    """BinSGDM's draws: piece ``i`` of ``out``, ``out[offsets[i]:offsets[i+1]]``, gets
    the float32 uniforms of a fresh numpy Philox-4x64 generator with key ``(seed, stream)`` and
    counter ``[0, 0, indices[i], step]``: ``Generator(Philox(key=..., counter=...)).random(n,
    float32)``. So the draws of a parameter depend on nothing but ``(seed, stream, step, index)``
    (see :mod:`hf_onebit.optim.vote_streams`). Defined with numpy on the host; the fast backends
    compute the same Philox blocks in one pass (bitwise the same)."""
    import numpy as np

    offsets, indices = table
    contract.check_vote_uniform(out, offsets[-1], seed, stream, step)
    key = np.array([int(seed), int(stream)], dtype=np.uint64)
    bitgen = np.random.Philox(key=key)
    gen = np.random.Generator(bitgen)
    host = torch.empty(out.numel(), dtype=torch.float32)
    for lo, hi, index in zip(offsets, offsets[1:], indices):
        bitgen.state = {
            "bit_generator": "Philox",
            "state": {"counter": np.array([0, 0, index, int(step)], dtype=np.uint64), "key": key},
            "buffer": np.zeros(4, dtype=np.uint64), "buffer_pos": 4, "has_uint32": 0, "uinteger": 0,
        }
        gen.random(out=host[lo:hi].numpy(), dtype=np.float32)
    if offsets[-1] > offsets[0]:
        out[offsets[0]:offsets[-1]].copy_(host[offsets[0]:offsets[-1]])
