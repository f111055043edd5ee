"""The host side of the Triton backend's piece variants (``bounds=``, see the reference).

The grid is a list of *tiles*, each at most ``BLOCK``
elements of exactly one piece (a piece of ``m`` elements has ``ceil(m / BLOCK)`` tiles, the
first starting at the piece's start). A program loads its tile's start and piece index from a
small table, so it needs one scale and never a per-element lookup. Per-piece sums of squares
are one float64 partial per tile, then a deterministic segmented sum (one program per piece
adds its tiles in order). The tables depend only on the bounds and the block size, which are
static for a compressed all-reduce, so they are built once on the host, copied to the
device and kept by the layout (:class:`~hf_onebit.kernels.contract.Bounds`, see :func:`_tables`).
The finite checks of the piece variants are one tiny device op (``isfinite().all()``) whose flag
the kernels read, so they never sync with the host either.
"""

from __future__ import annotations

import functools

import torch

from . import contract
from .reference import check_bounds
from .triton_kernels import _launch_options, _on_device, _same_device
from .triton_piece_kernels import (
    _segment_sum_kernel,
    _server_average_pieces_kernel,
    _server_pack_pieces_kernel,
    _server_sumsq_pieces_kernel,
    _worker_pack_pieces_kernel,
    _worker_sumsq_pieces_kernel,
)

_SEGMENT_R = 256  # tile partials summed per step of the segmented sum


def _build_table(bounds: tuple, block: int, device: torch.device) -> tuple:
    """Device tables for ``bounds`` tiled by ``block`` (five host-to-device copies).

    Returns ``(bounds, tile_start, tile_piece, tile_lo, counts, tiles)``: tile ``t`` starts at
    element ``tile_start[t]`` of piece ``tile_piece[t]``; piece ``p`` owns tiles
    ``tile_lo[p] .. tile_lo[p + 1] - 1``; ``counts`` are the pieces' lengths (float64).
    """
    starts, pieces, lo = [], [], [0]
    for p, (a, b) in enumerate(zip(bounds[:-1], bounds[1:])):
        first = range(a, b, block)
        starts.extend(first)
        pieces.extend([p] * len(first))
        lo.append(len(starts))
    i64 = dict(dtype=torch.int64, device=device)
    lengths = [b - a for a, b in zip(bounds[:-1], bounds[1:])]
    return (
        torch.tensor(bounds, **i64),
        torch.tensor(starts, **i64),
        torch.tensor(pieces, dtype=torch.int32, device=device),
        torch.tensor(lo, **i64),
        torch.tensor(lengths, dtype=torch.float64, device=device),
        len(starts),
    )


@functools.lru_cache(maxsize=512)
def _tile_table(bounds: tuple, block: int, device: torch.device) -> tuple:
    """:func:`_build_table` for plain-sequence bounds (ad hoc calls), a bounded cache."""
    return _build_table(bounds, block, device)


def _tables(bounds, length: int, block: int, device: torch.device) -> tuple:
    """The tables of ``bounds`` over ``length`` elements, tiled by ``block``, on ``device``.

    Built once per static layout: for :class:`~hf_onebit.kernels.contract.Bounds` (what
    :class:`~hf_onebit.comm.compressed.CompressedAllReduce` passes, one pair per segment) they
    live in the layout itself, so they are never rebuilt while the segment lives, however many
    segments there are (no host-to-device copy in the steady state, so nothing blocks inside
    the communication hook). Plain sequences go through a bounded LRU cache.
    """
    device = torch.device(device)
    owned = getattr(bounds, "tables", None)
    if owned is None:
        return _tile_table(tuple(check_bounds(bounds, length)), block, device)
    key = ("triton", length, block, device)
    table = owned.get(key)
    if table is None:
        table = owned[key] = _build_table(tuple(check_bounds(bounds, length)), block, device)
    return table


def _piece_rms(partials: torch.Tensor, table: tuple) -> torch.Tensor:
    """Per-piece RMS from the tiles' partial sums of squares (device ops only)."""
    _, _, _, tile_lo, counts, _ = table
    P = counts.numel()
    sums = torch.empty(P, dtype=torch.float64, device=counts.device)
    if P:
        _segment_sum_kernel[(P,)](partials, tile_lo, sums, R=_SEGMENT_R)
    rms = (sums / counts.clamp(min=1.0)).sqrt()
    return torch.where(counts > 0, rms, torch.zeros_like(rms)).to(torch.float32)


def _all_finite_flag(t: torch.Tensor) -> torch.Tensor:
    return torch.isfinite(t).all().to(torch.int32).reshape(1)


def _worker_scale_pieces(x_flat, error, bounds, block) -> torch.Tensor:
    table = _tables(bounds, error.numel(), block, error.device)
    bnd, starts, pieces, _, _, tiles = table
    partials = torch.empty(tiles, dtype=torch.float64, device=error.device)
    with _on_device(error):
        if tiles:
            _worker_sumsq_pieces_kernel[(tiles,)](
                x_flat, error, starts, pieces, bnd, partials, x_flat.numel(),
                BLOCK=block, **_launch_options(block),
            )
        return _piece_rms(partials, table)


def _worker_pack_pieces(x_flat, error, scales, rank, bits_out, bounds, block) -> None:
    table = _tables(bounds, error.numel(), block, error.device)
    bnd, starts, pieces, _, counts, tiles = table
    P = counts.numel()
    if P == 0:
        return
    if scales.numel() % P or not 0 <= rank < scales.numel() // P:
        raise ValueError(f"scales {tuple(scales.shape)} do not hold rank {rank}'s {P} piece scales")
    own = scales.reshape(-1, P)[rank].contiguous()
    with _on_device(error):
        flag = _all_finite_flag(scales)
        _worker_pack_pieces_kernel[(tiles,)](
            x_flat, error, own, flag, bits_out, starts, pieces, bnd, x_flat.numel(),
            BLOCK=block, **_launch_options(block),
        )


def _piece_rows(bits: torch.Tensor, scales: torch.Tensor, bounds, block: int) -> tuple:
    """Checks for the server piece variants, after the contract's row checks: ``(n, row_bytes,
    scales (n, P), table)``."""
    contract.require(bits, "bits", torch.uint8)  # contiguous: the kernels index it flat
    n, row_bytes = bits.shape
    table = _tables(bounds, row_bytes * 8, block, bits.device)
    P = table[4].numel()
    scales = scales.reshape(-1)
    contract.require(scales, "scales", torch.float32, numel=n * P)
    return n, row_bytes, scales, table


def _server_average_pieces(bits, scales, bounds, block) -> torch.Tensor:
    n, row_bytes, scales, table = _piece_rows(bits, scales, bounds, block)
    _same_device(bits, scales)
    bnd, starts, pieces, _, counts, tiles = table
    out = torch.empty(row_bytes * 8, dtype=torch.float32, device=bits.device)
    if tiles:
        with _on_device(bits):
            _server_average_pieces_kernel[(tiles,)](
                bits, scales, out, starts, pieces, bnd, n, counts.numel(), row_bytes,
                BLOCK=block, **_launch_options(block),
            )
    return out


def _server_scale_pieces(bits, scales, server_error, bounds, block) -> torch.Tensor:
    n, row_bytes, scales, table = _piece_rows(bits, scales, bounds, block)
    _same_device(bits, scales, server_error)
    bnd, starts, pieces, _, counts, tiles = table
    partials = torch.empty(tiles, dtype=torch.float64, device=bits.device)
    with _on_device(bits):
        if tiles:
            _server_sumsq_pieces_kernel[(tiles,)](
                bits, scales, server_error, partials, starts, pieces, bnd, n, counts.numel(),
                row_bytes, BLOCK=block, **_launch_options(block),
            )
        return _piece_rms(partials, table)


def _server_pack_pieces(bits, scales, server_error, scale, bits_out, bounds, block) -> None:
    n, row_bytes, scales, table = _piece_rows(bits, scales, bounds, block)
    bnd, starts, pieces, _, counts, tiles = table
    scale = scale.reshape(-1)
    contract.require(scale, "scale", torch.float32, numel=counts.numel())
    _same_device(bits, scales, server_error, scale, bits_out)
    if tiles:
        with _on_device(bits):
            flag = _all_finite_flag(scale)
            _server_pack_pieces_kernel[(tiles,)](
                bits, scales, server_error, scale, flag, bits_out, starts, pieces, bnd, n,
                counts.numel(), row_bytes, BLOCK=block, **_launch_options(block),
            )
