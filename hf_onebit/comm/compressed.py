"""The compressed all-reduce (docs/algorithms.md): signs plus one scale, error feedback on both sides.

For a flat buffer ``x_i`` on each of ``n`` ranks, padded (virtually) with zeros to ``L``, a
multiple of ``8·n``, and split into ``n`` chunks of ``C = L / n`` elements::

    round 1  all-gather   s_i = RMS(x_i + e_i)                          4 bytes per rank
             (every rank now knows whether any rank's input is non-finite)
             bits_i = sign⁺(x_i + e_i);  e_i = y - s_i·sign⁺(y)          (worker error feedback)
    round 2  all-to-all   chunk j of bits_i -> rank j                   L/8 bytes per rank
             rank j is the "server" of chunk j:
             a = mean_i s_i·sign⁺_i;  z = a + ē_j;  t_j = RMS(z)
             bits = sign⁺(z);  ē_j = z - t_j·sign⁺(z)                   (server error feedback)
    round 3  all-gather   [t_j | bits of chunk j]                       4 + C/8 bytes per rank
             result = concat_j t_j·sign⁺(z_j), cut back to the unpadded length

Bytes sent per rank ≈ ``2·(n-1)/n·L/8``, against ``2·(n-1)/n·4·L`` for an fp32 ring all-reduce:
about 32 times less. DeepSpeed used four rounds (scales and signs gathered separately); here the
server's scale rides with its signs, and the worker scales go first, which costs nothing (they
had to be exchanged anyway) and lets a non-finite value on any rank be seen by every rank
*before* any error buffer is written: then no error buffer changes anywhere and the result is
non-finite on every rank, so ``GradScaler`` (or the optimizer) skips the step consistently.

Every rank decodes the same gathered payload with the same kernel, so the result is bitwise
identical on all ranks. With ``n == 1`` nothing is compressed and the input is returned as is.

Scale per tensor (option, ``piece_sizes=``): one scale per *piece* of the buffer, each piece in
one chunk and (up to a few elements) one tensor or one block of it (:mod:`hf_onebit.comm.pieces`).
``P`` may be large: a server needs only its own chunk's worker scales, which therefore travel
beside the signs, and round 1 carries one finiteness flag::

    round 1  all-gather   f_i = every s_i[p] finite, s_i[p] = RMS over piece p of (x_i + e_i)
                                                                          4 bytes per rank
             e_i = y - s_i[piece(k)]·sign⁺(y)
    round 2  all-to-all   [s_i of chunk j's pieces, padded to P_max | bits of chunk j] -> rank j
                                                                          n·4·P_max + L/8 bytes
             a[k] = mean_i s_i[piece(k)]·sign⁺_i[k];  z = a + ē_j
             t[p] = RMS over piece p of z (pieces of chunk j);  ē_j = z - t[piece(k)]·sign⁺(z)
    round 3  all-gather   [t of chunk j's pieces, padded to P_max | bits]  4·P_max + C/8 bytes

Error buffers keep their shapes. If any rank's flag is false, every rank replaces its worker
scales with NaN before use, so (as with one scale) no error buffer changes anywhere and the
whole result is NaN on every rank.

``width`` bits per element (``__call__(x, width=8)`` or ``width=4``; docs/algorithms.md,
"Exchanges"): the same three rounds and the same error feedback, with the compressor
``Q_b(y) = s·q``, ``s = max|y| / Q``, ``q = round(y / s)`` in ``[-Q, Q]``, ``Q = 2^(b-1) - 1``,
in place of ``RMS·sign⁺``; codes of ``b`` bits travel where signs did (the layout is
:mod:`hf_onebit.kernels.reference`'s)::

    round 1  all-gather   s_i = max|x_i + e_i| / Q (per piece: its flag)  4 bytes per rank
             codes_i = q(y, s_i);  e_i = y - s_i·q                       (worker error feedback)
    round 2  all-to-all   chunk j of codes_i (per piece: after its scales) -> rank j
                                                                          b·L/8 bytes per rank
             a = mean_i s_i·q_i;  z = a + ē_j;  t = max|z| / Q;  ē_j = z - t·q(z, t)
    round 3  all-gather   [t of chunk j's pieces | codes]                 4·P_max + b·C/8 bytes
             result = concat_j t_j·q_j

Its blocks are ``b`` times shorter than the 1-bit calls' (:mod:`hf_onebit.comm.pieces`): the
pieces, and so ``P_max``, depend on the width, and each width keeps its own layout.

It serves the exchanges that the papers make at full precision (the warmups), where Adam's
variance needs the gradient's magnitudes, which 1 bit does not carry. By default the error
buffers are the 1-bit exchange's own: one segment keeps one pair, whatever the width of a call,
because an error buffer is the part of the signal not yet sent, in the buffer's coordinates,
whatever compressor left it; 1-bit Adam's and 1-bit LAMB's b-bit warmups end before their 1-bit
phase begins, so one pair serves both. The optimizers zero them (:meth:`reset`) where the signal
changes meaning (1-bit Adam's warmup sends gradients, its compression phase momenta).

Where b-bit and 1-bit calls *alternate* on the same buffer (0/1 Adam's variance phase: a b-bit
variance step between 1-bit gradient steps), ``separate_coded_errors=True`` gives the b-bit calls a
pair of their own. A shared pair would hand each b-bit call the 1-bit steps' residual (of the
order of the gradient itself, against a b-bit residual ``2^(b-1)`` times smaller): the averaged
gradient the variance is built from would carry ``g + e₁``, whose square overstates ``v``, and the
1-bit steps would restart from the small b-bit residual. With its own pair each exchange corrects
only its own error, as if the other were exact.
"""

from __future__ import annotations

import functools
import logging
from types import ModuleType

import torch
import torch.distributed as dist

from hf_onebit.comm.compat import all_gather_into_tensor
from hf_onebit.comm.executor import executor_for
from hf_onebit.comm.pieces import Pieces, padded_length, piece_bounds, width_pieces
from hf_onebit.comm.stats import CommRecord, CommStats, allreduce_bytes, leaving_node, stage
from hf_onebit.comm.topology import ranks_on_my_node
from hf_onebit.kernels import get_backend, load_backend
from hf_onebit.kernels.contract import WIDTHS

logger = logging.getLogger(__name__)


class _Codec:
    """The kernels of one width under the 1-bit names: signs and RMS scales (``width=1``), or
    ``width``-bit codes and max-abs scales (the backends' ``q*`` operations)."""

    __slots__ = ("worker_scale", "worker_pack", "server_scale", "server_pack", "unpack_scaled")

    def __init__(self, kernels, width: int) -> None:
        names = ("worker_scale", "worker_pack", "server_scale", "server_pack", "unpack_scaled")
        for name in names:
            op = getattr(kernels, name if width == 1 else "q" + name)
            setattr(self, name, op if width == 1 else functools.partial(op, width=width))


@functools.lru_cache(maxsize=None)
def _codec(kernels: ModuleType, width: int) -> _Codec:
    """One :class:`_Codec` per backend and width, made once (calls run on every bucket of every step)."""
    return _Codec(kernels, width)


class ErrorFeedback:
    """One pair of error buffers: the worker's (``L`` fp32 elements) and the server's (``C``).

    With ``deferred`` commits a call writes spare copies, which :meth:`commit` makes current, so a
    step skipped after the exchange (a loss scaler's) leaves the current pair bitwise untouched.
    """

    __slots__ = ("worker", "server", "_spares", "_uncommitted")

    def __init__(self, padded_numel: int, chunk: int, device: torch.device, deferred: bool) -> None:
        self.worker = torch.zeros(padded_numel, dtype=torch.float32, device=device)
        self.server = torch.zeros(chunk, dtype=torch.float32, device=device)
        self._spares = (torch.zeros_like(self.worker), torch.zeros_like(self.server)) if deferred else None
        self._uncommitted = False

    def for_call(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The pair a call reads and writes: the current one, or spares holding a copy of it."""
        if self._spares is None:
            return self.worker, self.server
        worker, server = self._spares
        self._uncommitted = True
        return worker.copy_(self.worker), server.copy_(self.server)

    def commit(self) -> None:
        if self._uncommitted:
            self._spares, (self.worker, self.server) = (self.worker, self.server), self._spares
            self._uncommitted = False

    def zero(self) -> None:
        self.worker.zero_()
        self.server.zero_()

    def load(self, worker: torch.Tensor, server: torch.Tensor) -> None:
        self.worker.copy_(worker)
        self.server.copy_(server)


class CompressedAllReduce:
    """State and algorithm of the compressed all-reduce for one flat buffer.

    The state is the worker error (``L`` fp32 elements) and the server error (``C`` fp32
    elements): it persists across calls, belongs to this buffer only, and is saved and
    restored with :meth:`state_dict` / :meth:`load_state_dict` (it differs on every rank).
    Work buffers are allocated once and reused: fresh large allocations are several times
    slower than writing into memory that is already mapped.

    Args:
        numel: number of elements of the buffers this state compresses (fixed).
        device: where the buffers live (the kernels are chosen by device type).
        group: process group (default: the world).
        kernels: kernel backend name (``"reference"``, ``"cpu"``, ``"triton"``) or module;
            default: by device.
        stats: counters to record into (default: a fresh :class:`CommStats`).
        deferred_commit: write the new error buffers into spare copies and make them current
            only on :meth:`commit`. With a loss scaler an optimizer step may be skipped *after*
            the hook already compressed some buckets; deferring keeps every error buffer
            bitwise untouched by a skipped step, at the cost of one extra copy of each buffer
            per call and twice the error memory.
        piece_sizes: sizes of the tensors concatenated in the buffer (summing to ``numel``):
            one scale per tensor piece instead of one per rank and chunk (see the module
            docstring; a tensor whose size is not a multiple of 8 lends up to 7 elements to its
            neighbour's scale). Default ``None``: the paper's single scale, bit for bit.
        separate_coded_errors: give the b-bit calls (``width`` 8 or 4) a pair of error buffers of
            their own, made on the first such call and freed by :meth:`reset` (4 bytes per
            element while they live), for callers whose b-bit and 1-bit calls alternate (see the
            module docstring). Default ``False``: one pair for every width.
        scale_block: cut every piece (or, without ``piece_sizes``, the buffer) into blocks of at
            most this many elements, each with its own scale; the b-bit calls cut blocks ``width``
            times shorter (:mod:`hf_onebit.comm.pieces`). Default ``None``: no cutting.
        pieces_at: in place of ``piece_sizes`` and ``scale_block``, the pieces of the calls at
            each width (``pieces_at(width)``; the exchange by node gives its shard's).
    """

    def __init__(
        self,
        numel: int,
        device: torch.device | str = "cpu",
        group: dist.ProcessGroup | None = None,
        kernels: str | ModuleType | None = None,
        stats: CommStats | None = None,
        deferred_commit: bool = False,
        piece_sizes=None,
        separate_coded_errors: bool = False,
        scale_block: int | None = None,
        pieces_at=None,
    ) -> None:
        self.numel = int(numel)
        self.deferred_commit = deferred_commit
        self.separate_coded_errors = separate_coded_errors
        self.device = torch.device(device)
        self.group = group
        self.world_size = dist.get_world_size(group) if dist.is_initialized() else 1
        self.rank = dist.get_rank(group) if dist.is_initialized() else 0
        self.local_size = ranks_on_my_node(group)  # for the bytes between nodes
        if isinstance(kernels, str):
            kernels = load_backend(kernels)
        self.kernels: ModuleType = kernels or get_backend(self.device)
        self.stats = stats if stats is not None else CommStats()

        n = self.world_size
        self.padded_numel = padded_length(self.numel, n) if n > 1 else self.numel
        self.chunk = self.padded_numel // n
        self.errors = ErrorFeedback(self.padded_numel if n > 1 else 0, self.chunk if n > 1 else 0,
                                    self.device, deferred_commit)
        #: the b-bit calls' own pair (``separate_coded_errors``), made on the first such call
        self.coded_errors: ErrorFeedback | None = None
        if pieces_at is None:
            pieces_at = functools.partial(width_pieces, self.numel, piece_sizes, scale_block)
        self._pieces_of = pieces_at
        #: the pieces of the 1-bit calls (``None``: one scale per chunk)
        self.piece_sizes = pieces_at(1)
        self._layouts: dict[int, Pieces | None] = {}
        self._layout(1)  # the other widths' on their first call
        self._finite_flags = torch.empty(n, dtype=torch.float32, device=self.device)
        #: work buffers by width, made on a width's first call (see :meth:`reset`)
        self._buffers: dict[int, dict[str, torch.Tensor]] = {}

    @property
    def worker_error(self) -> torch.Tensor:
        """The current worker error buffer (of the 1-bit calls, and of every call by default)."""
        return self.errors.worker

    @property
    def server_error(self) -> torch.Tensor:
        """The current server error buffer (of the 1-bit calls, and of every call by default)."""
        return self.errors.server

    def _errors_for(self, width: int) -> ErrorFeedback:
        """The error pair a call at ``width`` bits uses."""
        if width == 1 or not self.separate_coded_errors:
            return self.errors
        if self.coded_errors is None:
            self.coded_errors = ErrorFeedback(self.padded_numel, self.chunk, self.device, self.deferred_commit)
        return self.coded_errors

    def _layout(self, width: int) -> Pieces | None:
        """The pieces of the calls at ``width`` bits (``None``: one scale per chunk), made once."""
        if width not in self._layouts:
            sizes = self._pieces_of(width)
            n = self.world_size
            self._layouts[width] = (None if sizes is None or n == 1 or self.padded_numel == 0 else
                                    Pieces(piece_bounds(sizes, self.padded_numel, n), n, self.rank, self.device))
        return self._layouts[width]

    # ------------------------------------------------------------------ the algorithm
    def __call__(self, x: torch.Tensor, out: torch.Tensor | None = None, *, width: int = 1) -> torch.Tensor:
        """Blocking compressed all-reduce of ``x`` (any float dtype); returns ``out`` (default ``x``).

        ``width``: bits per element, 1 (signs) or 8 or 4 (codes). Call it from
        the group's executor (as :meth:`allreduce_async` and :meth:`allreduce` do) when other
        hf_onebit collectives may be in flight on the same group.
        """
        if type(width) is not int or width not in (1, *WIDTHS):
            raise ValueError(f"width must be 1 or one of {WIDTHS} bits, got {width!r}")
        if x.numel() != self.numel:
            raise ValueError(f"this state compresses {self.numel} elements, got a buffer of {x.numel()}")
        out = x if out is None else out
        if not out.is_contiguous():
            raise ValueError("the compressed all-reduce writes its result into a contiguous tensor; got a strided `out`")
        if self.world_size == 1:
            if out is not x:
                out.copy_(x)
            return out
        x = x.reshape(-1)
        # with deferred commits, spare copies; commit() makes them current
        worker_error, server_error = self._errors_for(width).for_call()

        pieces = self._layout(width)
        if pieces is not None:
            self._call_pieces(x, out, worker_error, server_error, width, pieces)
        else:
            self._call_chunks(x, out, worker_error, server_error, width)
        self.stats.record(self.bytes_per_call(width))
        return out

    def _work_buffers(self, width: int) -> dict[str, torch.Tensor]:
        """The work buffers of calls at ``width`` bits (made once; :meth:`reset` frees the b-bit
        ones). Rows of ``[4·S bytes of scales | C·width/8 bytes of codes]``, one per chunk, ``S``
        the most scales of a chunk (1, or ``P_max`` pieces): what round 2 sends with one scale per
        piece, and what round 3 gathers."""
        bufs = self._buffers.get(width)
        if bufs is None:
            n, C = self.world_size, self.chunk
            pieces = self._layout(width)
            scales_per_row = pieces.most_in_a_chunk if pieces is not None else 1
            u8 = dict(dtype=torch.uint8, device=self.device)
            row = 4 * scales_per_row + C * width // 8
            bufs = self._buffers[width] = dict(
                scales=torch.zeros(n * scales_per_row, dtype=torch.float32, device=self.device),
                codes=torch.empty(self.padded_numel * width // 8, **u8),
                received=torch.empty(n, C * width // 8, **u8),
                payload=torch.zeros(row, **u8),
                gathered=torch.empty(n, row, **u8),
                gathered_scales=torch.empty(n, 4 * scales_per_row, **u8),
            )
            if pieces is not None:
                bufs.update(send=torch.zeros(n, row, **u8), recv=torch.empty(n, row, **u8))
            else:
                bufs.update(recv=torch.empty(self.padded_numel * width // 8, **u8))
        return bufs

    def _call_chunks(self, x, out, worker_error, server_error, width: int) -> None:
        """The three rounds with one scale per rank and chunk (the spec's; see the module docstring)."""
        k, n, group = _codec(self.kernels, width), self.world_size, self.group
        bufs = self._work_buffers(width)
        # (stage(...): the time of each part, for the logs and the profiler; see comm/stats.py)
        # Round 1: worker scales. Every rank learns every rank's scale (and its finiteness).
        with stage("pack"):
            own = k.worker_scale(x, worker_error).reshape(1)
        with stage("exchange"):
            all_gather_into_tensor(bufs["scales"], own, group=group)
        with stage("pack"):
            k.worker_pack(x, worker_error, bufs["scales"], self.rank, bufs["codes"])

        # Round 2: chunk j of every rank's codes goes to rank j.
        with stage("exchange"):
            dist.all_to_all_single(bufs["recv"], bufs["codes"], group=group)
        with stage("pack"):
            recv = bufs["recv"].view(n, -1)
            t = k.server_scale(recv, bufs["scales"], server_error)
            payload = bufs["payload"]
            payload[:4].view(torch.float32).copy_(t.reshape(1))
            k.server_pack(recv, bufs["scales"], server_error, t, payload[4:])

        # Round 3: every server's scale and codes go to every rank.
        with stage("exchange"):
            all_gather_into_tensor(bufs["gathered"].view(-1), payload, group=group)
        with stage("unpack"):
            rows = bufs["gathered"]
            bufs["gathered_scales"].copy_(rows[:, :4])
            bufs["received"].copy_(rows[:, 4:])
            k.unpack_scaled(bufs["received"], bufs["gathered_scales"].view(torch.float32).reshape(n), out.view(-1))

    def _call_pieces(self, x, out, worker_error, server_error, width: int, pieces: Pieces) -> None:
        """The three rounds with one scale per piece, at ``width`` bits (see the module docstring)."""
        n, group, P = self.world_size, self.group, pieces.count
        bounds, local = pieces.bounds, pieces.local_bounds
        k = _codec(self.kernels, width)
        bufs = self._work_buffers(width)
        head = 4 * pieces.most_in_a_chunk

        # Round 1: whether every rank's scales are finite. One non-finite scale anywhere poisons
        # them all (a device op, no host sync), so no error buffer changes on any rank and the
        # whole result is non-finite everywhere.
        with stage("pack"):
            own = k.worker_scale(x, worker_error, bounds=bounds).reshape(-1)
            flag = torch.isfinite(own).all().to(torch.float32).reshape(1)
        with stage("exchange"):
            all_gather_into_tensor(self._finite_flags, flag, group=group)
        with stage("pack"):
            own = torch.where(self._finite_flags.bool().all(), own, torch.full_like(own, float("nan")))
            k.worker_pack(x, worker_error, own.view(1, P), 0, bufs["codes"], bounds=bounds)
            bufs["scales"][pieces.gather_index] = own  # chunk j's piece scales in row j
            send = bufs["send"]
            send[:, :head].copy_(bufs["scales"].view(torch.uint8).view(n, head))
            send[:, head:].copy_(bufs["codes"].view(n, -1))

        # Round 2: chunk j's scales and codes go to rank j, the server of chunk j's pieces.
        with stage("exchange"):
            dist.all_to_all_single(bufs["recv"], send, group=group)
        with stage("pack"):
            lo, hi = pieces.by_chunk[self.rank]
            recv = bufs["received"]
            recv.copy_(bufs["recv"][:, head:])
            chunk_scales = bufs["recv"][:, :head].contiguous().view(torch.float32)[:, : hi - lo].contiguous()
            t = k.server_scale(recv, chunk_scales, server_error, bounds=local)
            payload = bufs["payload"]
            payload[: 4 * (hi - lo)].view(torch.float32).copy_(t.reshape(-1))
            k.server_pack(recv, chunk_scales, server_error, t, payload[head:], bounds=local)

        # Round 3: every server's piece scales and codes go to every rank.
        with stage("exchange"):
            all_gather_into_tensor(bufs["gathered"].view(-1), payload, group=group)
        with stage("unpack"):
            rows = bufs["gathered"]
            bufs["gathered_scales"].copy_(rows[:, :head])
            recv.copy_(rows[:, head:])
            server_scales = bufs["gathered_scales"].view(torch.float32).reshape(-1)[pieces.gather_index]
            k.unpack_scaled(recv, server_scales, out.view(-1), bounds=bounds)

    def bytes_per_call(self, width: int = 1) -> CommRecord:
        """What one call at ``width`` bits per element sends and receives on this rank (see
        :mod:`hf_onebit.comm.stats`)."""
        n = self.world_size
        if n == 1:
            return CommRecord(calls=1)
        codes = self.chunk * width // 8
        pieces = self._layout(width)
        if pieces is not None:  # round 1 a finiteness flag; the worker scales ride in round 2
            head = 4 * pieces.most_in_a_chunk
            scales, signs, payload = (n - 1) * 4, (n - 1) * (head + codes), (n - 1) * (head + codes)
        else:
            scales, signs, payload = (n - 1) * 4, (n - 1) * codes, (n - 1) * (4 + codes)
        moved = scales + signs + payload
        fp32 = allreduce_bytes(4 * self.numel, n)
        return CommRecord(
            bytes_sent=moved,
            bytes_received=moved,
            rounds=3,
            fp32_equivalent=fp32,
            calls=1,
            inter_node_sent=leaving_node(scales + payload, signs, n, self.local_size),
            inter_node_fp32=leaving_node(fp32, 0, n, self.local_size),
        )

    # ------------------------------------------------------------------ entry points
    def allreduce_async(self, x: torch.Tensor, out: torch.Tensor | None = None, *,
                        width: int = 1) -> torch.futures.Future:
        """Queue the call on the group's ordered executor; the future's value is ``out``."""
        return executor_for(self.group, self.device).submit(lambda: self(x, out, width=width))

    def allreduce(self, x: torch.Tensor, out: torch.Tensor | None = None, *, width: int = 1) -> torch.Tensor:
        """Blocking call, ordered after every hf_onebit collective already queued on the group."""
        return self.allreduce_async(x, out, width=width).wait()

    # ------------------------------------------------------------------ state
    def state_dict(self) -> dict:
        """This rank's error buffers (they differ on every rank: save them per rank)."""
        state = {
            "numel": self.numel,
            "world_size": self.world_size,
            "worker_error": self.worker_error.detach().clone(),
            "server_error": self.server_error.detach().clone(),
        }
        if self.piece_sizes is not None:  # absent: one scale per chunk
            state["piece_sizes"] = self.piece_sizes
        if self.coded_errors is not None:
            state["coded_worker_error"] = self.coded_errors.worker.detach().clone()
            state["coded_server_error"] = self.coded_errors.server.detach().clone()
        return state

    def load_state_dict(self, state: dict) -> None:
        """Restore :meth:`state_dict` output saved by the same rank with the same world size.

        Another saved scale layout is not refused (a run may switch ``scale_per_tensor`` on at a
        resume): an error buffer is the part of the signal not yet sent, in the buffer's own
        coordinates, valid under any layout; a warning says so. The b-bit calls' own errors
        start from zero where none were saved."""
        if "nodes" in state:
            raise ValueError(
                f"compression state was saved by the exchange by node ({state['nodes'][0]} nodes of"
                f" {state['nodes'][1]} ranks); this buffer uses the flat exchange"
            )
        if state["numel"] != self.numel or state["world_size"] != self.world_size:
            raise ValueError(
                "compression state was saved for a buffer of {} elements on {} ranks, this one has"
                " {} elements on {} ranks".format(state["numel"], state["world_size"], self.numel, self.world_size)
            )
        saved = state.get("piece_sizes")
        saved = None if saved is None else tuple(int(v) for v in saved)
        if saved != self.piece_sizes:
            count = lambda sizes: "one scale per chunk" if sizes is None else f"{len(sizes)} scale pieces"
            logger.warning("hf_onebit: compression state saved with %s is loaded into a buffer using %s;"
                           " the error buffers carry over", count(saved), count(self.piece_sizes))
        coded = "coded_worker_error" in state
        if coded and not self.separate_coded_errors:
            raise ValueError(
                "compression state holds the b-bit exchange's own error buffers (saved with"
                " separate_coded_errors=True, by 0/1 Adam), this buffer shares one pair for every width:"
                " resume it with the optimizer that saved it"
            )
        self.errors.load(state["worker_error"], state["server_error"])
        self.coded_errors = None
        if coded:
            self._errors_for(8).load(state["coded_worker_error"], state["coded_server_error"])

    def commit(self) -> None:
        """Make the errors of the last call current (only needed with ``deferred_commit``)."""
        self.errors.commit()
        if self.coded_errors is not None:
            self.coded_errors.commit()

    def reset(self) -> None:
        """Zero both error buffers, where the exchanged signal changes meaning (0/1 Adam entering
        its local steps, a b-bit warmup ending), and free the b-bit work buffers, piece layout and
        errors (a later b-bit call makes them again, from zero)."""
        self.errors.zero()
        self.coded_errors = None
        for by_width in (self._buffers, self._layouts):
            for width in [w for w in by_width if w != 1]:
                del by_width[width]
