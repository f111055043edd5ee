"""Triton kernels for the 1-bit compressor on CUDA tensors.

Same five operations, same signatures and the same results as :mod:`hf_onebit.kernels.reference`
(read its docstring first for the vocabulary: ``x``, ``N``, ``L``, ``error``, ``bits``,
``sign⁺``). Every public function also takes a keyword-only ``block`` (elements per Triton
program); callers never need it, tests use it to exercise several tilings.

Design
------
The compressor is memory bound: a handful of flops per element against 8-12 bytes of traffic.
So the goal is the fewest passes over memory, and no host synchronisation.

Worker side, two passes over ``x`` and ``error``:

1. :func:`worker_scale` reads ``x`` (zero padded to ``L`` through the load mask: no padded copy)
   and ``error``, and writes one partial sum of squares of ``y = x + error`` per program into a
   small float64 buffer. Summing those partials and the ``sqrt`` are three tiny torch ops on the
   device.
2. :func:`worker_pack` reads ``x`` and ``error`` again, packs ``sign⁺(y)`` into bytes and
   writes ``error = y - s·sign⁺(y)``.

Why two passes and not one: the error update needs the scale ``s``, which is a reduction over
the *whole* buffer, and on top of that the all-reduce must exchange every rank's scale before
any error buffer is written (a non-finite scale on any rank must leave all error buffers
untouched). So the scale must be complete and exchanged before pass 2 starts; a single fused
pass would need a grid-wide barrier plus a collective in the middle of a kernel.

Why no host sync: the "are all scales finite?" decision is taken *inside* the kernels. Each
program loads the ``n`` scales (``n`` is the world size, tiny), computes the flag and uses it
as a store mask for the error. Nothing ever calls ``.item()``/``bool()`` on a device tensor, so
the whole compressed all-reduce stays queued on the executor's side stream
(:class:`hf_onebit.comm.executor.StreamExecutor`) and overlaps with backward on the compute stream.

Server side, again two passes (scale, then pack) over ``n`` rows of received bits plus the
server error, for the same reason. The average ``a = (Σ_i s_i·sign⁺_i) / n`` is recomputed in
both passes instead of being materialised: recomputing it reads ``n/8`` bytes per element,
storing and reloading it would move 8 (so recomputing is cheaper below 64 ranks).

:func:`unpack_scaled` reads the gathered bits once and writes ``±t_j`` directly in the dtype of
the destination (the gradient bucket), with no fp32 intermediate.

Where the code is: this module holds the public functions (host code: argument checks, then one
launch each); :mod:`hf_onebit.kernels.triton_kernels` their kernels (and why these agree bitwise
with the reference); :mod:`hf_onebit.kernels.triton_pieces` the piece variants (``bounds=``) on
the host, :mod:`hf_onebit.kernels.triton_piece_kernels` on the device; BinSGDM's kernels and their host
functions are in :mod:`hf_onebit.kernels.triton_votes`.
"""

from __future__ import annotations

import torch
import triton

from . import contract
from .reference import check_bounds, levels, pack_bools, pack_codes, pack_signs, unpack_codes, unpack_signs  # noqa: F401 (the backend's operations: contract.OPERATIONS)
from .triton_kernels import (
    DEFAULT_BLOCK,
    _check_block,
    _launch_options,
    _on_device,
    _qscale_kernel,
    _qserver_amax_kernel,
    _qserver_average_kernel,
    _qserver_pack_kernel,
    _qunpack_kernel,
    _qworker_amax_kernel,
    _qworker_pack_kernel,
    _same_device,
    _server_average_kernel,
    _server_pack_kernel,
    _server_sumsq_kernel,
    _unpack_scaled_kernel,
    _worker_pack_kernel,
    _worker_sumsq_kernel,
)
from .triton_piece_kernels import (
    _qserver_amax_pieces_kernel,
    _qserver_average_pieces_kernel,
    _qserver_pack_pieces_kernel,
    _qunpack_pieces_kernel,
    _qworker_amax_pieces_kernel,
    _qworker_pack_pieces_kernel,
    _segment_amax_kernel,
    _unpack_pieces_kernel,
)
from .triton_pieces import (
    _all_finite_flag,
    _server_average_pieces,
    _server_pack_pieces,
    _server_scale_pieces,
    _tables,
    _worker_pack_pieces,
    _worker_scale_pieces,
)
from .triton_votes import vote_threshold, vote_uniform, vote_uniform_table  # noqa: F401 (the backend's operations: contract.OPERATIONS)

#: the kernel contract's operations, and the code helpers every backend shares with the reference
__all__ = [*contract.OPERATIONS, "DEFAULT_BLOCK", "levels", "pack_codes", "unpack_codes"]

_FLOAT_INPUTS = (torch.float32, torch.bfloat16, torch.float16, torch.float64)


# --------------------------------------------------------------------------------------------
# Host wrappers: validate shapes (host metadata only, never device values) and launch
# --------------------------------------------------------------------------------------------


def _flat_input(x: torch.Tensor, length: int) -> torch.Tensor:
    if x.dtype not in _FLOAT_INPUTS:
        raise TypeError(f"x must be one of {_FLOAT_INPUTS}, got {x.dtype}")
    if x.numel() > length:
        raise ValueError(f"x has {x.numel()} elements, more than the padded length {length}")
    # A view for contiguous x (the normal case); a contiguous copy otherwise (the kernels index
    # x flat, and reshape(-1) of a strided 1-D tensor is that same strided tensor).
    return x.reshape(-1).contiguous()


def _rms_from_partials(partials: torch.Tensor, length: int) -> torch.Tensor:
    # Device ops only (no .item()): the result stays a 0-dim fp32 tensor on the stream.
    return (partials.sum() / length).sqrt().to(torch.float32)


def _check_rows(bits: torch.Tensor, scales: torch.Tensor) -> tuple[int, int]:
    """``(n, row_bytes)`` of the bits matrix, after the contract's row checks: what the kernels
    add to them, contiguous ``bits`` and contiguous fp32 ``scales``."""
    contract.require(bits, "bits", torch.uint8)
    contract.require(scales, "scales", torch.float32)
    return bits.shape



def worker_scale(
    x: torch.Tensor, error: torch.Tensor, *, block: int = DEFAULT_BLOCK, bounds=None
) -> torch.Tensor:
    """``RMS(x_padded + error)`` as a 0-dim fp32 tensor (0 for an empty buffer). No host sync.

    With ``bounds``: the ``(P,)`` RMS of each piece.
    """
    _check_block(block)
    contract.check_worker(x, error)
    _same_device(x, error)
    L = error.numel()
    x_flat = _flat_input(x, L)
    if bounds is not None:
        return _worker_scale_pieces(x_flat, error, bounds, block)
    if L == 0:
        return torch.zeros((), dtype=torch.float32, device=error.device)
    programs = triton.cdiv(L, block)
    partials = torch.empty(programs, dtype=torch.float64, device=error.device)
    with _on_device(error):
        _worker_sumsq_kernel[(programs,)](
            x_flat, error, partials, x_flat.numel(), L, BLOCK=block, **_launch_options(block)
        )
    return _rms_from_partials(partials, L)


def worker_pack(
    x: torch.Tensor,
    error: torch.Tensor,
    scales: torch.Tensor,
    rank: int,
    bits_out: torch.Tensor,
    *,
    block: int = DEFAULT_BLOCK,
    bounds=None,
) -> None:
    """Write ``sign⁺(x + error)`` into ``bits_out``; update ``error`` in place.

    The error becomes ``y - scales[rank]·sign⁺(y)`` only when all scales are finite; the
    check happens on the device, so this call never waits for the GPU. With ``bounds``,
    ``scales`` is ``(n, P)`` and piece ``p`` uses ``scales[rank, p]``.
    """
    _check_block(block)
    L = contract.check_worker(x, error, bits_out)
    scales = scales.reshape(-1)
    contract.require(scales, "scales", torch.float32)
    if bounds is not None:
        _same_device(x, error, scales, bits_out)
        _worker_pack_pieces(_flat_input(x, L), error, scales, rank, bits_out, bounds, block)
        return
    n = scales.numel()
    contract.check_rank(scales, rank)
    _same_device(x, error, scales, bits_out)
    x_flat = _flat_input(x, L)
    if L == 0:
        return
    programs = triton.cdiv(L, block)
    with _on_device(error):
        _worker_pack_kernel[(programs,)](
            x_flat, error, scales, bits_out, x_flat.numel(), L, n, rank,
            N_PAD=triton.next_power_of_2(n), BLOCK=block, **_launch_options(block),
        )


def server_average(
    bits: torch.Tensor, scales: torch.Tensor, *, block: int = DEFAULT_BLOCK, bounds=None
) -> torch.Tensor:
    """``mean_i scales[i] · sign⁺(bits[i])`` with the reference's exact summation order.

    With ``bounds`` (over the chunk), ``scales`` is ``(n, P)``.
    """
    _check_block(block)
    contract.check_rows(bits, scales if bounds is None else None)
    if bounds is not None:
        return _server_average_pieces(bits, scales, bounds, block)
    scales = scales.reshape(-1)
    n, row_bytes = _check_rows(bits, scales)
    _same_device(bits, scales)
    out = torch.empty(row_bytes * 8, dtype=torch.float32, device=bits.device)
    if row_bytes == 0:
        return out
    programs = triton.cdiv(row_bytes * 8, block)
    with _on_device(bits):
        _server_average_kernel[(programs,)](
            bits, scales, out, n, row_bytes, BLOCK=block, **_launch_options(block)
        )
    return out


def server_scale(
    bits: torch.Tensor,
    scales: torch.Tensor,
    server_error: torch.Tensor,
    *,
    block: int = DEFAULT_BLOCK,
    bounds=None,
) -> torch.Tensor:
    """``RMS(server_average(bits, scales) + server_error)`` as a 0-dim fp32 tensor.

    With ``bounds``: the ``(P,)`` RMS of each piece of ``z``.
    """
    _check_block(block)
    contract.check_server(bits, scales if bounds is None else None, server_error)
    if bounds is not None:
        return _server_scale_pieces(bits, scales, server_error, bounds, block)
    scales = scales.reshape(-1)
    n, row_bytes = _check_rows(bits, scales)
    _same_device(bits, scales, server_error)
    C = row_bytes * 8
    if C == 0:
        return torch.zeros((), dtype=torch.float32, device=bits.device)
    programs = triton.cdiv(C, block)
    partials = torch.empty(programs, dtype=torch.float64, device=bits.device)
    with _on_device(bits):
        _server_sumsq_kernel[(programs,)](
            bits, scales, server_error, partials, n, row_bytes,
            BLOCK=block, **_launch_options(block),
        )
    return _rms_from_partials(partials, C)


def server_pack(
    bits: torch.Tensor,
    scales: torch.Tensor,
    server_error: torch.Tensor,
    scale: torch.Tensor,
    bits_out: torch.Tensor,
    *,
    block: int = DEFAULT_BLOCK,
    bounds=None,
) -> None:
    """Write ``sign⁺(z)``, ``z = average + ē``; ``ē = z - t·sign⁺(z)`` if ``t`` is finite.

    The finite check happens on the device, so this call never waits for the GPU. With
    ``bounds``, ``scale`` holds the ``(P,)`` piece scales (all must be finite).
    """
    _check_block(block)
    contract.check_server(bits, scales if bounds is None else None, server_error, bits_out)
    if bounds is not None:
        _server_pack_pieces(bits, scales, server_error, scale, bits_out, bounds, block)
        return
    scales = scales.reshape(-1)
    n, row_bytes = _check_rows(bits, scales)
    scale = scale.reshape(-1)
    contract.require(scale, "scale", torch.float32, numel=1)
    _same_device(bits, scales, server_error, scale, bits_out)
    if row_bytes == 0:
        return
    programs = triton.cdiv(row_bytes * 8, block)
    with _on_device(bits):
        _server_pack_kernel[(programs,)](
            bits, scales, server_error, scale, bits_out, n, row_bytes,
            BLOCK=block, **_launch_options(block),
        )


def unpack_scaled(
    bits: torch.Tensor, scales: torch.Tensor, out: torch.Tensor, *, block: int = DEFAULT_BLOCK,
    bounds=None,
) -> None:
    """``out[k] = scales[k // C] · sign⁺_k`` for ``k < out.numel()``, cast to ``out.dtype``.

    ``bits`` has shape ``(n, C // 8)``: row ``j`` is chunk ``j`` of the result. With ``bounds``
    (over all ``n·C`` elements), ``out[k] = scales[piece(k)] · sign⁺_k``.
    """
    _check_block(block)
    n, row_bytes = contract.check_unpack(bits, scales if bounds is None else None, out)
    contract.require(bits, "bits", torch.uint8)  # contiguous: the kernel indexes it flat
    scales = scales.reshape(-1)
    table = None
    if bounds is not None:
        table = _tables(bounds, n * row_bytes * 8, block, bits.device)
        if scales.numel() != table[4].numel():
            raise ValueError(f"scales must have {table[4].numel()} elements (one per piece), got {scales.numel()}")
    if out.dtype not in _FLOAT_INPUTS:
        raise TypeError(f"out must be one of {_FLOAT_INPUTS}, got {out.dtype}")
    numel = out.numel()
    _same_device(bits, scales, out)
    if numel == 0:
        return
    # (-t_j, +t_j) per row, converted to out's dtype by torch itself: exactly the rounding of
    # the reference (whose ±t_j are exact in fp32 before its final cast), and tiny (2n values,
    # two small asynchronous device ops). It also keeps every float conversion out of the
    # kernel: the Triton 3.9 CPU interpreter truncates fp32 -> bf16 instead of rounding.
    s32 = scales.to(torch.float32)
    # times -1.0, as the reference's signs multiply: negation would flip a NaN scale's sign bit
    pm = torch.stack((s32 * -1.0, s32), dim=1).to(out.dtype)
    # The kernel writes a flat contiguous range; for a strided `out` go through a temporary.
    target = out
    if not out.is_contiguous():
        target = torch.empty(numel, dtype=out.dtype, device=out.device)
    if table is not None:
        bnd, starts, pieces, _, _, tiles = table
        if tiles:
            with _on_device(bits):
                _unpack_pieces_kernel[(tiles,)](
                    bits, pm, target, starts, pieces, bnd, numel, BLOCK=block, **_launch_options(block)
                )
    else:
        programs = triton.cdiv(numel, block)
        with _on_device(bits):
            _unpack_scaled_kernel[(programs,)](
                bits, pm, target, numel, row_bytes, BLOCK=block, **_launch_options(block)
            )
    if target is not out:
        out.copy_(target.view(out.shape))


# --------------------------------------------------------------------------------------------
# The b-bit exchange: the same two passes per side, with max-abs scales
# --------------------------------------------------------------------------------------------
#
# The operations mirror the five above (see the reference's section "The b-bit exchange") and
# agree with the reference bitwise, scales included (how: triton_kernels). A scale is one int32
# partial max per program (per tile with pieces) and one tiny kernel that reduces them and
# divides by Q, all on the device. With pieces, the tiles and tables of triton_pieces are
# reused unchanged (they count elements; every bound is a multiple of 8, so a tile starts on a
# whole byte of codes for both widths).

_QSCALE_R = 256  # partials reduced per step by the scale kernels
_LEVELS: dict[tuple[int, torch.device], torch.Tensor] = {}


def _levels(width: int, device: torch.device) -> torch.Tensor:
    """``c - Q`` for every code ``c`` of ``width`` bits (fp32, on ``device``), made once (device ops)."""
    key = (width, device)
    levels = _LEVELS.get(key)
    if levels is None:
        q = (1 << (width - 1)) - 1
        levels = _LEVELS[key] = torch.arange(1 << width, dtype=torch.float32, device=device) - q
    return levels


def _qscale(partials: torch.Tensor, width: int) -> torch.Tensor:
    """``max(partials) / Q`` as a 0-dim fp32 tensor (one program, no host sync)."""
    out = torch.empty((), dtype=torch.float32, device=partials.device)
    _qscale_kernel[(1,)](partials, out, partials.numel(), WIDTH=width, R=_QSCALE_R, **_launch_options(_QSCALE_R))
    return out


def _qpiece_scales(partials: torch.Tensor, table: tuple, width: int) -> torch.Tensor:
    """The ``(P,)`` scales from the tiles' partial maxima (0 for an empty piece)."""
    tile_lo, P = table[3], table[4].numel()
    out = torch.empty(P, dtype=torch.float32, device=partials.device)
    if P:
        _segment_amax_kernel[(P,)](partials, tile_lo, out, WIDTH=width, R=_QSCALE_R, **_launch_options(_QSCALE_R))
    return out


def _qrows(codes: torch.Tensor, scales: torch.Tensor, chunk: int, bounds, block: int) -> tuple:
    """What the server kernels add to the contract's checks: contiguous ``codes`` and contiguous
    fp32 ``scales``, ``(n,)`` or, with ``bounds`` over the chunk, ``(n, P)``. Returns ``(scales
    flat, table or None)``."""
    contract.require(codes, "codes", torch.uint8)  # contiguous: the kernels index it flat
    scales = scales.reshape(-1)
    if bounds is None:
        contract.require(scales, "scales", torch.float32)
        return scales, None
    table = _tables(bounds, chunk, block, codes.device)
    contract.require(scales, "scales", torch.float32, numel=codes.shape[0] * table[4].numel())
    return scales, table


def qworker_scale(x: torch.Tensor, error: torch.Tensor, *, width: int, block: int = DEFAULT_BLOCK,
                  bounds=None) -> torch.Tensor:
    """``max|x_padded + error| / Q`` as a 0-dim fp32 tensor (0 for an empty buffer). No host sync.

    With ``bounds``: the ``(P,)`` scale of each piece.
    """
    _check_block(block)
    contract.check_qworker(x, error, width)
    _same_device(x, error)
    L = error.numel()
    x_flat = _flat_input(x, L)
    if bounds is not None:
        table = _tables(bounds, L, block, error.device)
        bnd, starts, pieces, _, _, tiles = table
        partials = torch.empty(tiles, dtype=torch.int32, device=error.device)
        with _on_device(error):
            if tiles:
                _qworker_amax_pieces_kernel[(tiles,)](
                    x_flat, error, starts, pieces, bnd, partials, x_flat.numel(),
                    BLOCK=block, **_launch_options(block),
                )
            return _qpiece_scales(partials, table, width)
    if L == 0:
        return torch.zeros((), dtype=torch.float32, device=error.device)
    programs = triton.cdiv(L, block)
    partials = torch.empty(programs, dtype=torch.int32, device=error.device)
    with _on_device(error):
        _qworker_amax_kernel[(programs,)](
            x_flat, error, partials, x_flat.numel(), L, BLOCK=block, **_launch_options(block)
        )
        return _qscale(partials, width)


def qworker_pack(x: torch.Tensor, error: torch.Tensor, scales: torch.Tensor, rank: int, codes_out: torch.Tensor,
                 *, width: int, block: int = DEFAULT_BLOCK, bounds=None) -> None:
    """Write the ``width``-bit codes of ``y = x + error`` at this rank's scale; ``error = y - s·q``
    only when every scale (all ranks, all pieces) is finite, decided on the device. Scales as
    for :func:`worker_pack`: ``(n,)``, or ``(n, P)`` with ``bounds``."""
    _check_block(block)
    L = contract.check_qworker(x, error, width, codes_out)
    scales = scales.reshape(-1)
    contract.require(scales, "scales", torch.float32)
    if bounds is None:
        contract.check_rank(scales, rank)
    _same_device(x, error, scales, codes_out)
    x_flat = _flat_input(x, L)
    if bounds is not None:
        bnd, starts, pieces, _, counts, tiles = _tables(bounds, L, block, error.device)
        P = counts.numel()
        if P == 0:
            return
        if scales.numel() % P or not 0 <= rank < scales.numel() // P:
            raise ValueError(f"scales {tuple(scales.shape)} do not hold rank {rank}'s {P} piece scales")
        own = scales.reshape(-1, P)[rank].contiguous()
        if tiles:
            with _on_device(error):
                flag = _all_finite_flag(scales)
                _qworker_pack_pieces_kernel[(tiles,)](
                    x_flat, error, own, flag, codes_out, starts, pieces, bnd, x_flat.numel(),
                    WIDTH=width, BLOCK=block, **_launch_options(block),
                )
        return
    if L == 0:
        return
    n = scales.numel()
    programs = triton.cdiv(L, block)
    with _on_device(error):
        _qworker_pack_kernel[(programs,)](
            x_flat, error, scales, codes_out, x_flat.numel(), L, n, rank,
            N_PAD=triton.next_power_of_2(n), WIDTH=width, BLOCK=block, **_launch_options(block),
        )


def qserver_average(codes: torch.Tensor, scales: torch.Tensor, *, width: int, block: int = DEFAULT_BLOCK,
                    bounds=None) -> torch.Tensor:
    """``mean_i scales[i] · q_i`` in rank order, fp32 ``(C,)`` (scales as for :func:`server_average`)."""
    _check_block(block)
    n, C = contract.check_qrows(codes, width, scales if bounds is None else None)
    scales, table = _qrows(codes, scales, C, bounds, block)
    _same_device(codes, scales)
    row_bytes = codes.shape[1]
    out = torch.empty(C, dtype=torch.float32, device=codes.device)
    with _on_device(codes):
        if table is not None:
            bnd, starts, pieces, _, counts, tiles = table
            if tiles:
                _qserver_average_pieces_kernel[(tiles,)](
                    codes, scales, out, starts, pieces, bnd, n, counts.numel(), row_bytes,
                    WIDTH=width, BLOCK=block, **_launch_options(block),
                )
        elif C:
            _qserver_average_kernel[(triton.cdiv(C, block),)](
                codes, scales, out, n, row_bytes, WIDTH=width, BLOCK=block, **_launch_options(block)
            )
    return out


def qserver_scale(codes: torch.Tensor, scales: torch.Tensor, server_error: torch.Tensor, *, width: int,
                  block: int = DEFAULT_BLOCK, bounds=None) -> torch.Tensor:
    """``max|qserver_average + ē| / Q`` (0-dim), or the ``(P,)`` scales of the pieces of ``z``."""
    _check_block(block)
    n, C = contract.check_qserver(codes, width, scales if bounds is None else None, server_error)
    scales, table = _qrows(codes, scales, C, bounds, block)
    _same_device(codes, scales, server_error)
    row_bytes = codes.shape[1]
    with _on_device(codes):
        if table is not None:
            bnd, starts, pieces, _, counts, tiles = table
            partials = torch.empty(tiles, dtype=torch.int32, device=codes.device)
            if tiles:
                _qserver_amax_pieces_kernel[(tiles,)](
                    codes, scales, server_error, partials, starts, pieces, bnd, n, counts.numel(),
                    row_bytes, WIDTH=width, BLOCK=block, **_launch_options(block),
                )
            return _qpiece_scales(partials, table, width)
        if C == 0:
            return torch.zeros((), dtype=torch.float32, device=codes.device)
        programs = triton.cdiv(C, block)
        partials = torch.empty(programs, dtype=torch.int32, device=codes.device)
        _qserver_amax_kernel[(programs,)](
            codes, scales, server_error, partials, n, row_bytes, WIDTH=width, BLOCK=block,
            **_launch_options(block),
        )
        return _qscale(partials, width)


def qserver_pack(codes: torch.Tensor, scales: torch.Tensor, server_error: torch.Tensor, scale: torch.Tensor,
                 codes_out: torch.Tensor, *, width: int, block: int = DEFAULT_BLOCK, bounds=None) -> None:
    """Write the codes of ``z = average + ē`` at ``scale``; ``ē = z - t·q`` only if every ``t`` is
    finite, decided on the device. With ``bounds``, ``scale`` holds the ``(P,)`` piece scales."""
    _check_block(block)
    n, C = contract.check_qserver(codes, width, scales if bounds is None else None, server_error, codes_out)
    scales, table = _qrows(codes, scales, C, bounds, block)
    scale = scale.reshape(-1)
    contract.require(scale, "scale", torch.float32, numel=1 if table is None else table[4].numel())
    _same_device(codes, scales, server_error, scale, codes_out)
    row_bytes = codes.shape[1]
    with _on_device(codes):
        if table is not None:
            bnd, starts, pieces, _, counts, tiles = table
            if tiles:
                flag = _all_finite_flag(scale)
                _qserver_pack_pieces_kernel[(tiles,)](
                    codes, scales, server_error, scale, flag, codes_out, starts, pieces, bnd, n,
                    counts.numel(), row_bytes, WIDTH=width, BLOCK=block, **_launch_options(block),
                )
        elif C:
            _qserver_pack_kernel[(triton.cdiv(C, block),)](
                codes, scales, server_error, scale, codes_out, n, row_bytes, WIDTH=width, BLOCK=block,
                **_launch_options(block),
            )


def qunpack_scaled(codes: torch.Tensor, scales: torch.Tensor, out: torch.Tensor, *, width: int,
                   block: int = DEFAULT_BLOCK, bounds=None) -> None:
    """``out[k] = scales[k // C] · q_k`` for ``k < out.numel()``, in ``out``'s dtype (with ``bounds``
    over all ``n·C`` elements: ``scales[piece(k)]``)."""
    _check_block(block)
    n, C = contract.check_qunpack(codes, width, scales if bounds is None else None, out)
    contract.require(codes, "codes", torch.uint8)  # contiguous: the kernel indexes it flat
    scales = scales.reshape(-1)
    table = None
    if bounds is not None:
        table = _tables(bounds, n * C, block, codes.device)
        if scales.numel() != table[4].numel():
            raise ValueError(f"scales must have {table[4].numel()} elements (one per piece), got {scales.numel()}")
    if out.dtype not in _FLOAT_INPUTS:
        raise TypeError(f"out must be one of {_FLOAT_INPUTS}, got {out.dtype}")
    numel = out.numel()
    _same_device(codes, scales, out)
    if numel == 0:
        return
    # Every value a row (piece) can decode to, s·(c - Q) for each of the 2^width codes c: the
    # reference's fp32 product, converted to out's dtype by torch (its rounding; no conversion in
    # the kernel, see unpack_scaled). Two small device ops: (rows or pieces) x 256 values at most.
    values = (_levels(width, codes.device) * scales.to(torch.float32).reshape(-1, 1)).to(out.dtype)
    target = out if out.is_contiguous() else torch.empty(numel, dtype=out.dtype, device=out.device)
    with _on_device(codes):
        if table is not None:
            bnd, starts, pieces, _, _, tiles = table
            if tiles:
                _qunpack_pieces_kernel[(tiles,)](
                    codes, values, target, starts, pieces, bnd, numel, WIDTH=width, BLOCK=block,
                    **_launch_options(block),
                )
        else:
            programs = triton.cdiv(numel, block)
            _qunpack_kernel[(programs,)](
                codes, values, target, numel, codes.shape[1], WIDTH=width, BLOCK=block,
                **_launch_options(block),
            )
    if target is not out:
        out.copy_(target.view(out.shape))
