"""Compression segments: error-feedback state that survives DDP's bucket rebuilds.

Error feedback needs state per compressed buffer. DDP's buckets are not stable: the first
iteration after constructing DDP uses one bucket holding every parameter, later ones use
buckets rebuilt in gradient-ready order. So compression state belongs to a *segment*, a tuple
of parameter indices (the first DDP bucket layout that compression meets, saved and restored
with the per-rank state). A bucket that equals a segment is compressed in place; a bucket that
is a union of known segments (the one-bucket first iteration after a resume) is compressed
segment by segment, so a resumed run issues exactly the same compressed calls as an
uninterrupted one. A bucket that matches neither becomes a new segment.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Callable, Iterator

import torch

from hf_onebit.comm.compressed import CompressedAllReduce

logger = logging.getLogger("hf_onebit")

Key = tuple[int, ...]


@dataclass
class Segment:
    """One compressed buffer: parameter indices, its error-feedback state and a work buffer."""

    key: Key
    numel: int
    comm: CompressedAllReduce
    device: torch.device
    _work: torch.Tensor | None = None
    #: ``(parameters, their views of work)`` made by :meth:`shaped_views`, kept with the buffer
    _shaped: tuple | None = None

    @property
    def work(self) -> torch.Tensor:
        """fp32 buffer of ``numel`` elements, allocated on first use and reused.

        Not needed when a bucket *is* the segment and holds fp32: then the bucket's own buffer
        is compressed in place (the common case, which saves 4 bytes per parameter), and the
        hook frees a buffer left from an earlier multi-segment bucket (:meth:`release_work`).
        """
        if self._work is None:
            self._work = torch.zeros(self.numel, dtype=torch.float32, device=self.device)
        return self._work

    def release_work(self) -> None:
        """Free the work buffer: a bucket that *is* this segment is compressed in place.

        A segment needs the buffer when a bucket spans several segments (DDP's one-bucket first
        iteration after a resume or a re-wrap) or when it is exchanged outside a bucket (0/1
        Adam's sync). Once its own bucket arrives the buffer would only hold 4 bytes per
        parameter for the rest of the run, so the hook releases it (a later use allocates a
        fresh one, see :attr:`work`).
        """
        self._work = None
        self._shaped = None

    def shaped_views(self, params: list[torch.Tensor]) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """The segment's parameters (in key order) and their ranges of :attr:`work`, each viewed in
        its parameter's shape; made once while the buffer lives (``params``: every parameter, in
        the optimizer's order), so a step's list ops over them cost no per-tensor view ops."""
        chosen = [params[i] for i in self.key]
        cached = self._shaped
        if cached is None or cached[2] is not self._work or any(a is not b for a, b in zip(cached[0], chosen)):
            work = self.work
            self._shaped = cached = (chosen, [view.view(p.shape) for p, view in self.views(params)], work)
        return cached[0], cached[1]

    def views(self, params: list[torch.Tensor]) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """``(p, p's flat range of work)`` for each parameter of the segment, in key order
        (``params``: every parameter, in the optimizer's order)."""
        out, off = [], 0
        for i in self.key:
            p = params[i]
            out.append((p, self.work[off : off + p.numel()]))
            off += p.numel()
        return out


class SegmentRegistry:
    """The segments of one optimizer, with the saved state of those not built yet.

    ``new_compressor(key, device)`` builds the compressed all-reduce of a new segment (its owner,
    :class:`hf_onebit.exchange.Exchange`, knows the parameter sizes, the process group and
    whether commits are deferred).
    """

    def __init__(self, new_compressor: Callable[[Key, torch.device], CompressedAllReduce]) -> None:
        self._new_compressor = new_compressor
        self._segments: dict[Key, Segment] = {}
        #: saved error state not yet used (key -> state, or None for a layout without state)
        self._pending: dict[Key, dict | None] | None = None

    def __len__(self) -> int:
        return len(self._segments)

    def __iter__(self) -> Iterator[Segment]:
        return iter(self._segments.values())

    def keys(self) -> list[Key]:
        return list(self._segments)

    def new(self, key: Key, device: torch.device) -> Segment:
        comm = self._new_compressor(key, device)
        seg = Segment(key, comm.numel, comm, torch.device(device))
        pending = (self._pending or {}).pop(key, None)
        if pending is not None:
            comm.load_state_dict(pending)
        for other in [k for k in self._segments if set(k) & set(key)]:
            logger.debug("hf_onebit: segment %s replaced by a new bucket layout", other[:4])
            del self._segments[other]
        self._segments[key] = seg
        return seg

    def for_bucket(self, key: Key, device: torch.device) -> list[Segment]:
        """The segments that cover exactly the parameters ``key`` (a bucket), in a fixed order."""
        if key in self._segments:
            return [self._segments[key]]
        wanted = set(key)
        known = [s for s in self._segments.values() if set(s.key) <= wanted]
        if not known and self._pending:
            # Resume before any segment was built: materialise the saved ones this bucket covers.
            for k in list(self._pending):
                if set(k) <= wanted:
                    known.append(self.new(k, device))
        covered = set().union(*(s.key for s in known)) if known else set()
        if known and covered == wanted:
            return sorted(known, key=lambda s: s.key)
        return [self.new(key, device)]

    def covering_all(self, numels: list[int], device: torch.device, cap_numel: int) -> list[Segment]:
        """Segments covering every parameter (``numels``: their sizes, in parameter order).

        Existing segments are reused; parameters not yet in any segment are grouped, in
        parameter order, into new segments of at most ``cap_numel`` elements.
        """
        # Restore the saved segments that carry error state. A key saved only as a bucket layout
        # (no state yet) is not a segment here: the uninterrupted run, which had no segment
        # either, groups those parameters in parameter order below, and so must the resumed one.
        saved = self._pending or {}
        for k in [k for k, state in saved.items() if state is not None and k not in self._segments]:
            self.new(k, device)
        covered = set().union(*(s.key for s in self._segments.values())) if self._segments else set()
        run: list[int] = []
        size = 0
        for i, n in enumerate(numels):
            if i in covered:
                continue
            if run and size + n > cap_numel:
                self.new(tuple(run), device)
                run, size = [], 0
            run.append(i)
            size += n
        if run:
            self.new(tuple(run), device)
        return sorted(self._segments.values(), key=lambda s: s.key)

    def commit(self) -> None:
        """Make every segment's last errors current (deferred commits, see CompressedAllReduce)."""
        for seg in self._segments.values():
            seg.comm.commit()

    def state_dict(self) -> dict[Key, dict | None]:
        """Every segment's error state, plus saved state not used yet (kept for the next save)."""
        state: dict[Key, dict | None] = {k: s.comm.state_dict() for k, s in self._segments.items()}
        for k, v in (self._pending or {}).items():
            state.setdefault(k, v)
        return state

    def load(self, saved: dict[Key, dict | None]) -> None:
        """Forget every segment; rebuild them from ``saved`` lazily, as buckets arrive."""
        self._segments.clear()
        self._pending = dict(saved)

    def clear(self) -> None:
        """Forget every segment and any saved state (errors restart from zero)."""
        self._segments.clear()
        self._pending = None
