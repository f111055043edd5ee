"""Fast CPU backend of the 1-bit compression kernels, written with numba.

Same functions, signatures and results as :mod:`hf_onebit.kernels.reference` (read its
docstring first: it defines ``x``, ``L``, ``error``, ``bits`` and ``sign⁺``). The reference
allocates several fp32 temporaries of length ``L`` per call; this backend allocates nothing
that grows with the buffer (a few KiB of per-call scratch at most).

This module is the host side: it checks the arguments, views the caller's tensors as numpy
arrays without copying them (bf16 and fp16 as raw 16-bit integers: numba cannot load those
dtypes) and calls the numba loops of :mod:`hf_onebit.kernels.cpu_sign_loops` and
:mod:`hf_onebit.kernels.cpu_code_loops`, whose docstrings explain why they look as they do. Outputs of
:func:`unpack_scaled` hold only two distinct values per chunk (``±t_j``): torch converts those
``2·n`` values to the out dtype (bitwise what the reference's ``copy_`` does), and the loop only
copies raw bit patterns.

The b-bit operations (``q*``) are defined exactly, scales included, and match the
reference bitwise; :func:`qunpack_scaled` converts a table of every code's value per piece the
same way for 16-bit and float64 outs, and writes fp32 outs directly.

Every tensor -> numpy conversion of the backend is made in this file and in
:mod:`hf_onebit.kernels.cpu_votes` (BinSGDM's kernels): host code by construction, which
tests/optim/test_host_syncs.py exempts by these files' names.
"""

from __future__ import annotations

import numpy as np
import torch

from . import contract
from .cpu_jit import _BLOCK
from .cpu_code_loops import (
    _qserver_amax_pieces,
    _qserver_average_pieces,
    _qserver_pack_pieces,
    _qunpack_lut_pieces,
    _qunpack_pieces,
    _qworker_amax_pieces,
    _qworker_pack_pieces,
)
from .cpu_sign_loops import (
    _server_average,
    _server_average_pieces,
    _server_pack,
    _server_pack_pieces,
    _server_sumsq,
    _server_sumsq_pieces,
    _unpack,
    _unpack_pieces,
    _worker_pack,
    _worker_pack_pieces,
    _worker_sumsq,
    _worker_sumsq_pieces,
)
from .reference import check_bounds, levels, pack_codes, pack_signs, unpack_codes, unpack_signs  # noqa: F401 (the backend's operations: contract.OPERATIONS)
from .cpu_votes import vote_threshold, vote_uniform, vote_uniform_table  # noqa: F401 (the backend's operations)

#: the kernel contract's operations, and the code helpers every backend shares with the reference
__all__ = [*contract.OPERATIONS, "levels", "pack_codes", "unpack_codes"]


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
    """The checked bounds as int64, kept in a :class:`~hf_onebit.kernels.contract.Bounds` layout
    (what the exchange passes) so that it is checked and converted once, not at every call:
    with 32-element pieces that costs more than the kernels themselves."""
    owned = getattr(bounds, "tables", None)
    array = None if owned is None else owned.get(("cpu", length))
    if array is None:
        array = np.asarray(check_bounds(bounds, length), dtype=np.int64)
        array.flags.writeable = False
        if owned is not None:
            owned[("cpu", length)] = array
    return array


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
        _worker_pack(_input_view(x), e, b, s[rank], update, np.empty(_BLOCK, np.uint8))
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
    """``mean_i scales[i] · sign⁺(bits[i])`` with the reference's exact summation order.

    With ``bounds`` (over the chunk), ``scales`` is ``(n, P)``.
    """
    contract.check_rows(bits, scales if bounds is None else None)
    bn = _bits_view(bits)
    out = torch.empty(8 * bn.shape[1], dtype=torch.float32)
    if bounds is None:
        _server_average(bn, _scales_f32(scales, bn.shape[0]), out.numpy(), np.empty(_BLOCK, np.uint8))
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
        z, flags = np.empty(_BLOCK, np.float32), np.empty(_BLOCK, np.uint8)
        return _rms(_server_sumsq(bn, _scales_f32(scales, bn.shape[0]), e, z, flags), e.size)
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
    z, flags = np.empty(_BLOCK, np.float32), np.empty(_BLOCK, np.uint8)
    _server_pack(bn, _scales_f32(scales, bn.shape[0]), e, t, update, b, z, flags)


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
# The b-bit exchange: same structure, width-bit codes and max-abs scales
# --------------------------------------------------------------------------------------------


def _codes_view(codes: torch.Tensor) -> np.ndarray:
    """The ``(n, C·width/8)`` codes (shape and dtype checked by ``contract.check_qrows``)."""
    _check_cpu("codes", codes)
    return codes.detach().contiguous().numpy()


def _whole(length: int) -> np.ndarray:
    """The bounds of one piece over everything: the single-scale call as a piece call."""
    return np.array([0, length], dtype=np.int64)


def _amax_scales(amax_bits: np.ndarray, width: int) -> torch.Tensor:
    """``max|y| / Q`` per piece from the kernels' ``max|y|`` bit patterns: the reference's fp32
    division, done by torch (0 for an empty piece, NaN or inf as soon as the piece had one)."""
    amax = torch.from_numpy(amax_bits.view(np.float32))
    return amax / torch.tensor(float(levels(width)), dtype=torch.float32)


def qworker_scale(x: torch.Tensor, error: torch.Tensor, *, width: int, bounds=None) -> torch.Tensor:
    """``max|x_padded + error| / Q`` as a 0-dim fp32 tensor (0 for an empty buffer).

    With ``bounds``: the ``(P,)`` scale of each piece.
    """
    contract.check_qworker(x, error, width)
    e = _inplace_view("error", error, torch.float32)
    bnd = _whole(e.size) if bounds is None else _bounds_array(bounds, e.size)
    amax = np.empty(bnd.size - 1, np.uint32)
    _qworker_amax_pieces(_input_view(x), e, bnd, amax)
    scales = _amax_scales(amax, width)
    return scales.reshape(()) if bounds is None else scales


def qworker_pack(x: torch.Tensor, error: torch.Tensor, scales: torch.Tensor, rank: int, codes_out: torch.Tensor,
                 *, width: int, bounds=None) -> None:
    """Write the codes of ``y = x + error`` at this rank's scales; ``error = y - s·q`` only when
    every scale (all ranks, all pieces) is finite. Scales as for :func:`worker_pack`."""
    contract.check_qworker(x, error, width, codes_out)
    if bounds is None:
        contract.check_rank(scales, rank)
    e = _inplace_view("error", error, torch.float32)
    c = _inplace_view("codes_out", codes_out, torch.uint8)
    if e.size == 0:  # nothing to pack (the reference returns before reading the bounds too)
        return
    update = bool(torch.isfinite(scales).all())  # on the given dtype, as the reference does
    if bounds is None:
        own = _scales_f32(scales, scales.numel())[rank : rank + 1]
        bnd = _whole(e.size)
    else:
        bnd = _bounds_array(bounds, e.size)
        pieces = bnd.size - 1
        _check_cpu("scales", scales)
        if scales.numel() % pieces or not 0 <= rank < scales.numel() // pieces:
            raise ValueError(f"scales {tuple(scales.shape)} do not hold rank {rank}'s {pieces} piece scales")
        own = scales.detach().reshape(-1, pieces)[rank].to(torch.float32).contiguous().numpy()
    _qworker_pack_pieces(_input_view(x), e, c, own, bnd, update, int(width))


def _q_row_scales(scales: torch.Tensor, n: int, bounds, chunk: int) -> tuple[np.ndarray, np.ndarray]:
    """The piece bounds over one chunk and the ``(P, n)`` scales (one piece without ``bounds``)."""
    if bounds is None:
        return _whole(chunk), _scales_f32(scales, n).reshape(1, n)
    bnd = _bounds_array(bounds, chunk)
    return bnd, _piece_scales(scales, n, bnd.size - 1)


def qserver_average(codes: torch.Tensor, scales: torch.Tensor, *, width: int, bounds=None) -> torch.Tensor:
    """``mean_i scales[i] · q_i`` in rank order (scales as for :func:`server_average`)."""
    n, chunk = contract.check_qrows(codes, width, scales if bounds is None else None)
    cn = _codes_view(codes)
    out = torch.empty(chunk, dtype=torch.float32)
    bnd, st = _q_row_scales(scales, n, bounds, chunk)
    _qserver_average_pieces(cn, st, bnd, out.numpy(), int(width))
    return out


def qserver_scale(codes: torch.Tensor, scales: torch.Tensor, server_error: torch.Tensor, *, width: int,
                  bounds=None) -> torch.Tensor:
    """``max|qserver_average + ē| / Q`` (0-dim), or the ``(P,)`` scales of the pieces of ``z``."""
    n, chunk = contract.check_qserver(codes, width, scales if bounds is None else None, server_error)
    cn = _codes_view(codes)
    e = _inplace_view("server_error", server_error, torch.float32)
    bnd, st = _q_row_scales(scales, n, bounds, chunk)
    amax = np.empty(bnd.size - 1, np.uint32)
    _qserver_amax_pieces(cn, st, e, bnd, amax, int(width))
    t = _amax_scales(amax, width)
    return t.reshape(()) if bounds is None else t


def qserver_pack(codes: torch.Tensor, scales: torch.Tensor, server_error: torch.Tensor, scale: torch.Tensor,
                 codes_out: torch.Tensor, *, width: int, bounds=None) -> None:
    """Write the codes of ``z = average + ē`` at ``scale``; ``ē = z - t·q`` only if every ``t`` is finite."""
    n, chunk = contract.check_qserver(codes, width, scales if bounds is None else None, server_error, codes_out)
    cn = _codes_view(codes)
    e = _inplace_view("server_error", server_error, torch.float32)
    c = _inplace_view("codes_out", codes_out, torch.uint8)
    bnd, st = _q_row_scales(scales, n, bounds, chunk)
    scale = torch.as_tensor(scale).detach()
    _check_cpu("scale", scale)
    if scale.numel() != bnd.size - 1:
        what = "one value" if bounds is None else f"{bnd.size - 1} piece scales"
        raise ValueError(f"scale must hold {what}, got {scale.numel()}")
    update = bool(torch.isfinite(scale).all())
    t = scale.reshape(-1).to(torch.float32).contiguous().numpy()
    _qserver_pack_pieces(cn, st, e, t, update, c, bnd, int(width))


def qunpack_scaled(codes: torch.Tensor, scales: torch.Tensor, out: torch.Tensor, *, width: int,
                   bounds=None) -> None:
    """``out[k] = scales[k // C] · q_k`` for ``k < out.numel()`` (with ``bounds``: ``scales[piece(k)]``).

    fp32 ``out`` is written directly (the reference's fp32 product). Any other dtype goes through
    a table of every code's value per piece (``2**width`` of them: codes outside ``[0, 2Q]``
    decode too, as in the reference), computed in fp32 and converted by torch itself, so every
    out dtype rounds exactly like the reference's ``copy_``; the loop only copies bit patterns.
    """
    n, chunk = contract.check_qunpack(codes, width, scales if bounds is None else None, out)
    cn = _codes_view(codes).reshape(-1)
    _check_cpu("out", out)
    if not out.is_contiguous():  # rare: decompress into contiguous memory, then copy over
        tmp = torch.empty(out.shape, dtype=out.dtype)
        qunpack_scaled(codes, scales, tmp, width=width, bounds=bounds)
        out.copy_(tmp)
        return
    if bounds is None:  # the chunks are the pieces
        bnd = np.arange(n + 1, dtype=np.int64) * chunk
    else:
        bnd = _bounds_array(bounds, n * chunk)
    sc = _scales_f32(scales, bnd.size - 1)
    flat = out.detach().reshape(-1)
    if out.dtype == torch.float32:
        _qunpack_pieces(cn, sc, bnd, flat.numpy(), int(width))
        return
    raw = _INT_OF_SIZE.get(out.element_size())
    if raw is None or out.is_complex():
        raise TypeError(f"qunpack_scaled cannot write {out.dtype}")
    q = torch.arange(2**width, dtype=torch.float32) - levels(width)  # every code's level
    lut = (q * torch.from_numpy(sc).reshape(-1, 1)).to(out.dtype).view(raw)
    _qunpack_lut_pieces(cn, lut.contiguous().numpy(), bnd, flat.view(raw).numpy(), int(width))
