"""Plain-torch reference of the 1-bit compression kernels (spec §1).

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
"""

from __future__ import annotations

import torch

__all__ = [
    "pack_signs",
    "unpack_signs",
    "worker_scale",
    "worker_pack",
    "server_average",
    "server_scale",
    "server_pack",
    "unpack_scaled",
]

_BIT_WEIGHTS = (128, 64, 32, 16, 8, 4, 2, 1)


def _weights(device: torch.device) -> torch.Tensor:
    return torch.tensor(_BIT_WEIGHTS, dtype=torch.uint8, device=device)


def pack_signs(y: torch.Tensor) -> torch.Tensor:
    """Pack ``y >= 0`` into uint8, MSB first. ``y.numel()`` must be a multiple of 8."""
    if y.numel() % 8:
        raise ValueError(f"pack_signs needs a multiple of 8 elements, got {y.numel()}")
    bits = (y.reshape(-1, 8) >= 0).to(torch.uint8) * _weights(y.device)
    return bits.sum(dim=1, dtype=torch.uint8)


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


def worker_scale(x: torch.Tensor, error: torch.Tensor) -> torch.Tensor:
    """``RMS(x_padded + error)`` as a 0-dim fp32 tensor (0 for an empty buffer)."""
    return _rms(_padded(x, error.numel()) + error)


def worker_pack(
    x: torch.Tensor,
    error: torch.Tensor,
    scales: torch.Tensor,
    rank: int,
    bits_out: torch.Tensor,
) -> None:
    """Write ``sign⁺(x + error)`` into ``bits_out``; update ``error`` in place.

    ``scales`` holds every rank's :func:`worker_scale` (already exchanged); this rank's is
    ``scales[rank]``. The error becomes ``y - s·sign⁺(y)`` only when all scales are finite.
    """
    y = _padded(x, error.numel()) + error
    bits_out.copy_(pack_signs(y))
    if bool(torch.isfinite(scales).all()):
        error.copy_(y - scales[rank] * _sign(y))


def server_average(bits: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """``mean_i scales[i] · sign⁺(bits[i])`` with the exact summation order of the spec."""
    signs = unpack_signs(bits)
    acc = torch.zeros(signs.shape[1], dtype=torch.float32, device=bits.device)
    for i in range(bits.shape[0]):
        acc += scales[i] * signs[i]
    return acc / bits.shape[0]


def server_scale(bits: torch.Tensor, scales: torch.Tensor, server_error: torch.Tensor) -> torch.Tensor:
    """``RMS(server_average(bits, scales) + server_error)`` as a 0-dim fp32 tensor."""
    return _rms(server_average(bits, scales) + server_error)


def server_pack(
    bits: torch.Tensor,
    scales: torch.Tensor,
    server_error: torch.Tensor,
    scale: torch.Tensor,
    bits_out: torch.Tensor,
) -> None:
    """Write ``sign⁺(z)``, ``z = average + ē``; ``ē = z - t·sign⁺(z)`` only if ``t`` is finite."""
    z = server_average(bits, scales) + server_error
    bits_out.copy_(pack_signs(z))
    if bool(torch.isfinite(scale)):
        server_error.copy_(z - scale * _sign(z))


def unpack_scaled(bits: torch.Tensor, scales: torch.Tensor, out: torch.Tensor) -> None:
    """``out[k] = scales[k // C] · sign⁺_k`` for ``k < out.numel()``, cast to ``out.dtype``.

    ``bits`` has shape ``(n, C // 8)``: row ``j`` is chunk ``j`` of the result.
    """
    values = unpack_signs(bits) * scales.reshape(-1, 1).to(torch.float32)
    out.copy_(values.reshape(-1)[: out.numel()].view(out.shape))
