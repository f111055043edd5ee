"""Where the compression scales go: the pieces of a buffer that get one scale each.

A DDP bucket concatenates many parameter tensors; one scale per rank and chunk rebuilds a
tiny-gradient tensor at the magnitude of its large neighbours. Given the sizes of the
concatenated tensors (``piece_sizes``), the buffer is cut into *pieces*: the tensor boundaries
rounded down to a multiple of 8 (no packed byte straddles two pieces; a tensor whose size is not
a multiple of 8 lends its last few elements to the next one's piece, and the last tensor owns the
zero padding), each tensor cut further into blocks of at most ``scale_block`` elements, united
with the ``n`` chunk boundaries, so that every piece lies in one chunk and gets its own scale on
both sides. A b-bit call's blocks are ``b`` times shorter than the 1-bit
calls' (:func:`width_block`). :mod:`hf_onebit.comm.compressed` derives the exchange over them.
"""

from __future__ import annotations

import torch

from hf_onebit.kernels.contract import Bounds


def padded_length(numel: int, world_size: int) -> int:
    """Smallest multiple of ``8 * world_size`` that holds ``numel`` elements."""
    unit = 8 * world_size
    return -(-numel // unit) * unit


def scale_pieces(numel: int, piece_sizes, scale_block: int | None) -> tuple[int, ...] | None:
    """The pieces that get a scale each: ``piece_sizes`` (default: the whole buffer) cut into
    blocks of at most ``scale_block`` elements, in order (a piece that is not a multiple of the
    block ends with the remainder); ``piece_sizes`` as given when ``scale_block`` is ``None``."""
    if piece_sizes is not None:
        piece_sizes = tuple(int(v) for v in piece_sizes)
        if sum(piece_sizes) != numel:
            raise ValueError(f"piece_sizes sum to {sum(piece_sizes)}, the buffer has {numel} elements")
    if scale_block is None:
        return piece_sizes
    out: list[int] = []
    for size in piece_sizes or (numel,):
        out += [scale_block] * (size // scale_block) + ([size % scale_block] if size % scale_block else [])
    return tuple(out)


def width_block(scale_block: int | None, width: int) -> int | None:
    """The block of a call at ``width`` bits, ``scale_block`` being the 1-bit calls': ``width``
    times shorter (at least 8 elements), so that a scale costs every width the same share of its
    payload (4 bytes per ``scale_block`` bits) and a b-bit code's rounding step follows the
    magnitudes of a few dozen coordinates, not of a whole block's largest one."""
    return None if scale_block is None else max(8, scale_block // width // 8 * 8)


def piece_bounds(piece_sizes, padded_numel: int, world_size: int) -> list[int]:
    """Piece boundaries (element offsets, ``0 .. padded_numel``) for tensors of ``piece_sizes``.

    The tensor boundaries rounded down to a multiple of 8, united with the ``world_size``
    chunk boundaries; empty pieces are dropped. See the module docstring.
    """
    sizes = [int(v) for v in piece_sizes]
    if any(v < 0 for v in sizes):
        raise ValueError("piece_sizes must be non-negative")
    chunk = padded_numel // world_size
    cuts = {j * chunk for j in range(world_size + 1)}
    offset = 0
    for size in sizes[:-1]:
        offset += size
        cuts.add(min(offset // 8 * 8, padded_numel))
    return sorted(cuts)


def width_pieces(numel: int, piece_sizes, scale_block: int | None, width: int) -> tuple[int, ...] | None:
    """The pieces of a call at ``width`` bits: ``piece_sizes`` cut into :func:`width_block` blocks."""
    return scale_pieces(numel, piece_sizes, width_block(scale_block, width))


class Pieces:
    """The static layout of one scale per piece (see the module docstring) for ``n`` chunks."""

    def __init__(self, bounds: list[int], n: int, rank: int, device: torch.device) -> None:
        C = bounds[-1] // n
        # Bounds own the backend's tables for this layout (built on first use, kept while this
        # all-reduce lives: nothing is rebuilt per call, whatever the number of segments).
        self.bounds = Bounds(bounds)
        self.count = P = len(bounds) - 1
        # Pieces [first[j], first[j + 1]) lie in chunk j (chunk boundaries are bounds).
        first = [bounds.index(j * C) for j in range(n)] + [P]
        self.by_chunk = [(first[j], first[j + 1]) for j in range(n)]
        self.most_in_a_chunk = max(hi - lo for lo, hi in self.by_chunk)
        lo, hi = self.by_chunk[rank]
        self.local_bounds = Bounds(b - rank * C for b in bounds[lo : hi + 1])
        # Where piece p's scale sits in a row-per-chunk (n, P_max) table: the worker scales sent
        # in round 2, the server scales gathered in round 3.
        self.gather_index = torch.tensor(
            [j * self.most_in_a_chunk + q for j, (a, b) in enumerate(self.by_chunk) for q in range(b - a)],
            dtype=torch.int64, device=device,
        )
