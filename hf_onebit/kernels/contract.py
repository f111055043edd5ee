"""The kernel contract: what every backend module provides, and the arguments it refuses.

A backend (:mod:`~hf_onebit.kernels.reference`, :mod:`~hf_onebit.kernels.cpu`,
:mod:`~hf_onebit.kernels.triton`) is a module with the functions of :class:`KernelBackend`,
computing what the reference computes (its module docstring is the vocabulary). Callers
(:mod:`hf_onebit.comm`) see only this protocol, through :func:`hf_onebit.kernels.get_backend`.

Every backend validates its arguments with the ``check_*`` functions below, first thing, so a
malformed call fails the same way (same exception type, same message) whichever backend runs
it. They read shapes, dtypes and layouts only, never values (on CUDA a value would make the
host wait). A backend may refuse more than this (the Triton kernels want contiguous fp32 scales
and one device; the CPU kernels want CPU tensors) and may take extra keyword-only tuning
arguments with defaults (Triton's ``block``).
"""

from __future__ import annotations

from typing import Protocol

import torch


class KernelBackend(Protocol):
    """The functions of a kernel backend module (signatures as in :mod:`.reference`)."""

    def worker_scale(self, x: torch.Tensor, error: torch.Tensor, *, bounds=None) -> torch.Tensor: ...

    def worker_pack(self, x: torch.Tensor, error: torch.Tensor, scales: torch.Tensor, rank: int,
                    bits_out: torch.Tensor, *, bounds=None) -> None: ...

    def server_average(self, bits: torch.Tensor, scales: torch.Tensor, *, bounds=None) -> torch.Tensor: ...

    def server_scale(self, bits: torch.Tensor, scales: torch.Tensor, server_error: torch.Tensor, *,
                     bounds=None) -> torch.Tensor: ...

    def server_pack(self, bits: torch.Tensor, scales: torch.Tensor, server_error: torch.Tensor,
                    scale: torch.Tensor, bits_out: torch.Tensor, *, bounds=None) -> None: ...

    def unpack_scaled(self, bits: torch.Tensor, scales: torch.Tensor, out: torch.Tensor, *, bounds=None) -> None: ...

    def pack_signs(self, y: torch.Tensor) -> torch.Tensor: ...

    def unpack_signs(self, bits: torch.Tensor) -> torch.Tensor: ...

    def pack_bools(self, flags: torch.Tensor, out: torch.Tensor) -> None: ...

    def check_bounds(self, bounds, length: int) -> list[int]: ...

    # the b-bit exchange: ``width``-bit codes in place of signs, max-abs scales
    def qworker_scale(self, x: torch.Tensor, error: torch.Tensor, *, width: int, bounds=None) -> torch.Tensor: ...

    def qworker_pack(self, x: torch.Tensor, error: torch.Tensor, scales: torch.Tensor, rank: int,
                     codes_out: torch.Tensor, *, width: int, bounds=None) -> None: ...

    def qserver_average(self, codes: torch.Tensor, scales: torch.Tensor, *, width: int, bounds=None) -> torch.Tensor: ...

    def qserver_scale(self, codes: torch.Tensor, scales: torch.Tensor, server_error: torch.Tensor, *,
                      width: int, bounds=None) -> torch.Tensor: ...

    def qserver_pack(self, codes: torch.Tensor, scales: torch.Tensor, server_error: torch.Tensor,
                     scale: torch.Tensor, codes_out: torch.Tensor, *, width: int, bounds=None) -> None: ...

    def qunpack_scaled(self, codes: torch.Tensor, scales: torch.Tensor, out: torch.Tensor, *, width: int,
                       bounds=None) -> None: ...

    # BinSGDM's worker math over one flat bucket: new momenta and P(+1 vote)
    def vote_threshold(self, m: torch.Tensor, b: torch.Tensor, g: torch.Tensor, *, beta: float, eps: float,
                       m_out: torch.Tensor, b_out: torch.Tensor, theta: torch.Tensor) -> None: ...

    # BinSGDM's draws over one flat bucket: numpy's Philox per piece (see reference.vote_uniform)
    def vote_uniform_table(self, offsets, indices, device) -> object: ...

    def vote_uniform(self, out: torch.Tensor, table, *, seed: int, stream: int, step: int) -> None: ...


class Bounds(tuple):
    """Piece bounds (host ints) that own their backend's derived tables for as long as they live.

    A plain sequence works as ``bounds=`` everywhere; a caller that calls the kernels again and
    again with one static layout (:class:`~hf_onebit.comm.compressed.CompressedAllReduce`, one per
    segment) passes a ``Bounds`` so that a backend builds its tables for that layout once and
    keeps them in :attr:`tables` (e.g. the Triton tile tables, which cost host-to-device copies),
    whatever the number of layouts alive, and frees them with the layout.
    """

    def __new__(cls, values):
        self = super().__new__(cls, (int(v) for v in values))
        #: backend -> its tables for this layout (e.g. keyed by length, block and device)
        self.tables = {}
        return self


#: the functions every backend module defines (the members of :class:`KernelBackend`)
OPERATIONS = tuple(name for name in vars(KernelBackend) if not name.startswith("_"))


def require(t: torch.Tensor, name: str, dtype: torch.dtype, numel: int | None = None) -> None:
    """A tensor the kernels write or index in place: this dtype, contiguous, and (if given) this size."""
    if t.dtype != dtype:
        raise TypeError(f"{name} must be {dtype}, got {t.dtype}")
    if not t.is_contiguous():
        raise ValueError(f"{name} must be contiguous (it is written or indexed in place)")
    if numel is not None and t.numel() != numel:
        raise ValueError(f"{name} must hold {numel} elements, got {t.numel()}")


def check_worker(x: torch.Tensor, error: torch.Tensor, bits_out: torch.Tensor | None = None) -> int:
    """The worker side: ``error`` fp32 of the padded length ``L`` (a multiple of 8), ``x`` a float
    tensor of at most ``L`` elements, ``bits_out`` uint8 of ``L/8`` bytes. Returns ``L``."""
    require(error, "error", torch.float32)
    length = error.numel()
    if length % 8:
        raise ValueError(f"error length must be a multiple of 8, got {length}")
    if not x.is_floating_point():
        raise TypeError(f"x must be a floating-point tensor, got {x.dtype}")
    if x.numel() > length:
        raise ValueError(f"x has {x.numel()} elements, more than the padded length {length}")
    if bits_out is not None:
        require(bits_out, "bits_out", torch.uint8, length // 8)
    return length


def check_rank(scales: torch.Tensor, rank: int) -> None:
    """``scales`` holds one scale per rank (no pieces) and ``rank`` is one of them."""
    if not 0 <= rank < scales.numel():
        raise ValueError(f"rank {rank} out of range for {scales.numel()} scales")


def check_rows(bits: torch.Tensor, scales: torch.Tensor | None = None) -> tuple[int, int]:
    """``(n, row_bytes)`` of the ``(n, C/8)`` uint8 bits, at least one row; without pieces,
    ``scales`` holds one scale per row."""
    if bits.dim() != 2 or bits.dtype != torch.uint8:
        raise ValueError(f"bits must be a 2-D uint8 tensor (n, C // 8), got {tuple(bits.shape)} {bits.dtype}")
    n, row_bytes = bits.shape
    if n == 0:
        raise ValueError("bits must have at least one row")
    if scales is not None and scales.numel() != n:
        raise ValueError(f"scales must hold {n} elements (one per row of bits), got {scales.numel()}")
    return n, row_bytes


def check_server(bits: torch.Tensor, scales: torch.Tensor | None, server_error: torch.Tensor,
                 bits_out: torch.Tensor | None = None) -> tuple[int, int]:
    """The server side: :func:`check_rows`, ``server_error`` fp32 of one row's ``C`` elements,
    ``bits_out`` uint8 of one row's bytes."""
    n, row_bytes = check_rows(bits, scales)
    require(server_error, "server_error", torch.float32, 8 * row_bytes)
    if bits_out is not None:
        require(bits_out, "bits_out", torch.uint8, row_bytes)
    return n, row_bytes


def check_unpack(bits: torch.Tensor, scales: torch.Tensor | None, out: torch.Tensor) -> tuple[int, int]:
    """:func:`check_rows`; ``out`` a float tensor (any layout) of at most ``n·C`` elements."""
    n, row_bytes = check_rows(bits, scales)
    if not out.is_floating_point():
        raise TypeError(f"out must be a floating-point tensor, got {out.dtype}")
    if out.numel() > 8 * n * row_bytes:
        raise ValueError(f"out has {out.numel()} elements, bits only {8 * n * row_bytes}")
    return n, row_bytes


# ------------------------------------------------------------------ the b-bit exchange
#: the bit widths of the b-bit exchange
WIDTHS = (8, 4)


def check_width(width) -> int:
    """``width`` is one of :data:`WIDTHS` (a plain int, not a bool)."""
    if type(width) is not int or width not in WIDTHS:  # neither True nor 8.0
        raise ValueError(f"width must be one of {WIDTHS} bits, got {width!r}")
    return int(width)


def code_bytes(numel: int, width: int) -> int:
    """Bytes of ``numel`` packed ``width``-bit codes (``numel`` a multiple of 8)."""
    return numel * width // 8


def check_qworker(x: torch.Tensor, error: torch.Tensor, width, codes_out: torch.Tensor | None = None) -> int:
    """:func:`check_worker` for ``width``-bit codes: ``codes_out`` uint8 of ``L·width/8`` bytes."""
    width = check_width(width)
    length = check_worker(x, error)
    if codes_out is not None:
        require(codes_out, "codes_out", torch.uint8, code_bytes(length, width))
    return length


def check_qrows(codes: torch.Tensor, width, scales: torch.Tensor | None = None) -> tuple[int, int]:
    """``(n, C)`` of the ``(n, C·width/8)`` uint8 codes, at least one row; without pieces,
    ``scales`` holds one scale per row."""
    width = check_width(width)
    if codes.dim() != 2 or codes.dtype != torch.uint8:
        raise ValueError(f"codes must be a 2-D uint8 tensor (n, C * width // 8), got {tuple(codes.shape)} {codes.dtype}")
    n, row_bytes = codes.shape
    if n == 0:
        raise ValueError("codes must have at least one row")
    if scales is not None and scales.numel() != n:
        raise ValueError(f"scales must hold {n} elements (one per row of codes), got {scales.numel()}")
    return n, row_bytes * 8 // width


def check_qserver(codes: torch.Tensor, width, scales: torch.Tensor | None, server_error: torch.Tensor,
                  codes_out: torch.Tensor | None = None) -> tuple[int, int]:
    """The server side: :func:`check_qrows`, ``server_error`` fp32 of one row's ``C`` elements,
    ``codes_out`` uint8 of one row's bytes."""
    n, chunk = check_qrows(codes, width, scales)
    require(server_error, "server_error", torch.float32, chunk)
    if codes_out is not None:
        require(codes_out, "codes_out", torch.uint8, codes.shape[1])
    return n, chunk


def check_qunpack(codes: torch.Tensor, width, scales: torch.Tensor | None, out: torch.Tensor) -> tuple[int, int]:
    """:func:`check_qrows`; ``out`` a float tensor (any layout) of at most ``n·C`` elements."""
    n, chunk = check_qrows(codes, width, scales)
    if not out.is_floating_point():
        raise TypeError(f"out must be a floating-point tensor, got {out.dtype}")
    if out.numel() > n * chunk:
        raise ValueError(f"out has {out.numel()} elements, codes only {n * chunk}")
    return n, chunk


# ------------------------------------------------------------------ BinSGDM's worker math
def check_vote(m: torch.Tensor, b: torch.Tensor, g: torch.Tensor, m_out: torch.Tensor, b_out: torch.Tensor,
               theta: torch.Tensor) -> int:
    """:func:`vote_threshold`'s six tensors: fp32, contiguous (read or written flat, in place) and
    of one length, which it returns."""
    tensors = (("m", m), ("b", b), ("g", g), ("m_out", m_out), ("b_out", b_out), ("theta", theta))
    for name, t in tensors:
        require(t, name, torch.float32)
    lengths = [t.numel() for _, t in tensors]
    if len(set(lengths)) != 1:
        raise ValueError(f"vote_threshold: lengths differ: {lengths}")
    return lengths[0]


def check_vote_pieces(offsets, indices) -> tuple[list[int], list[int]]:
    """:func:`vote_uniform_table`'s host metadata as ints: ``offsets`` (``pieces + 1``,
    non-decreasing from 0 or more) split a buffer into pieces, ``indices`` name each piece's
    random stream (in ``[0, 2**63)``)."""
    offsets = [int(o) for o in offsets]
    indices = [int(i) for i in indices]
    if len(offsets) != len(indices) + 1 or offsets[0] < 0 or any(b < a for a, b in zip(offsets, offsets[1:])):
        raise ValueError(f"vote_uniform: offsets {offsets[:8]} do not split a buffer into {len(indices)} pieces")
    if any(not 0 <= i < 2**63 for i in indices):
        raise ValueError("vote_uniform: indices must be in [0, 2**63)")
    return offsets, indices


def check_vote_uniform(out: torch.Tensor, last_offset: int, seed: int, stream: int, step: int) -> None:
    """:func:`vote_uniform`'s ``out`` (fp32, contiguous, holding every piece) and counters (in
    ``[0, 2**64)``)."""
    require(out, "out", torch.float32)
    if last_offset > out.numel():
        raise ValueError(f"vote_uniform: the pieces end at {last_offset}, out holds {out.numel()} elements")
    for name, value in (("seed", seed), ("stream", stream), ("step", step)):
        if not 0 <= int(value) < 2**64:
            raise ValueError(f"vote_uniform: {name} must be in [0, 2**64), got {value}")
