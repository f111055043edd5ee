"""The compressed all-reduce by node: full precision inside a node, 1 bit between nodes.

Multi-node clusters have fast links inside a node (NVLink, shared memory) and slow ones between
nodes. The flat compressed all-reduce (:mod:`~hf_onebit.comm.compressed`) of ``n`` ranks sends
``≈ 2·(n-1)/n·N/8`` bytes per rank, and most of it crosses between nodes. By node, with ``k``
ranks per node and ``M = n/k`` nodes (:mod:`~hf_onebit.comm.topology`), a buffer of ``N``
elements is padded to ``k·S`` (``S = ceil(N/k)``), and local rank ``l`` owns shard ``l``::

    round 1    node group   reduce-scatter of x/k, plus one flag slot per shard    fp32 ≈ (k-1)·4S bytes
               shard l of the node mean  x̄_l = Σ_{ranks of the node} x[l·S:(l+1)·S]/k
               flag slot = Σ 0 or NaN: NaN if any rank of the node had a non-finite x
    rounds 2-4 inter group  the flat compressed all-reduce of x̄_l among the M nodes ≈ 2·(M-1)/M·S/8 bytes
               (local rank l of every node; k of these run in parallel, one per shard)
    round 5    node group   all-gather of the k averaged shards                     fp32 (k-1)·4S bytes

Each node sends ``≈ 2·(M-1)/M·N/8`` bytes between nodes, spread over its ``k`` ranks: the bytes
of a flat compressed all-reduce of ``M`` ranks, not ``n``. The algorithm is the flat one with
the ``M`` node means as its workers, run once per shard: error feedback (worker and server)
lives per shard, on the rank that owns it. The fp32 node mean costs no accuracy (it is what the
flat exchange's workers would average anyway); the 1-bit noise is that of ``M`` workers.

Non-finite input: a rank whose ``x`` holds a NaN or inf writes NaN into every shard's flag slot,
so after round 1 every rank of that node knows and poisons its whole shard. Every inter group
then sees a NaN scale from that node: as in the flat exchange, the result is NaN on every rank
and no error buffer changes anywhere (so ``GradScaler`` skips the step everywhere).

Every rank ends with the same bytes: shard ``l``'s result is bitwise identical across its
inter group (as in the flat exchange), and every rank of a node gathers the same ``k`` shards.

The reduce-scatter is an all-to-all of the ``k`` shards followed by a sum in local-rank order on
the rank that owns the shard: the bytes of a bandwidth-optimal reduce-scatter on every backend
(gloo's own ``reduce_scatter`` is an all-reduce of the whole buffer, which moves more bytes),
and a sum whose order does not depend on the backend.
"""

from __future__ import annotations

from types import ModuleType

import torch
import torch.distributed as dist

from hf_onebit.comm.allreduce import finite_flag
from hf_onebit.comm.compat import all_gather_into_tensor
from hf_onebit.comm.compressed import CompressedAllReduce
from hf_onebit.comm.pieces import width_pieces
from hf_onebit.comm.executor import executor_for
from hf_onebit.comm.stats import CommRecord, CommStats, allreduce_bytes, leaving_node
from hf_onebit.comm.topology import NodeTopology


def shard_piece_sizes(piece_sizes, lo: int, shard: int) -> list[int]:
    """The sizes of the tensors (``piece_sizes``, laid end to end) inside ``[lo, lo + shard)``;
    the zero padding past their end joins the last one (or is one piece of its own)."""
    out, start = [], 0
    for size in piece_sizes:
        overlap = min(lo + shard, start + size) - max(lo, start)
        if overlap > 0:
            out.append(overlap)
        start += size
    pad = shard - sum(out)
    if out:
        out[-1] += pad
    else:
        out = [shard]
    return out


class HierarchicalCompressedAllReduce:
    """The node-wise compressed all-reduce of one flat buffer (see the module docstring).

    Same interface as :class:`~hf_onebit.comm.CompressedAllReduce` (the optimizers and
    :mod:`~hf_onebit.comm.segments` use either): ``__call__``, ``state_dict`` and its pair,
    ``commit``, ``reset``, ``bytes_per_call``.

    Args:
        numel: elements of the buffers this state compresses (fixed).
        device: where the buffers live.
        nodes: the node layout; its groups are created here if nobody did yet
            (``NodeTopology.create_groups``, a collective: :func:`hf_onebit.attach` does it first).
        kernels, deferred_commit, separate_coded_errors: as for :class:`~hf_onebit.comm.CompressedAllReduce`.
        stats: every byte this rank sends is counted here (those of the inter-node group also
            as ``inter_node_sent``).
        piece_sizes, scale_block: the sizes of the tensors concatenated in the buffer and the
            block they are cut into: one scale per piece of each shard (the whole buffer's blocks
            cut again at the shard's bounds), as in the flat exchange, b-bit calls' blocks too.
    """

    def __init__(self, numel: int, device: torch.device | str, nodes: NodeTopology,
                 kernels: str | ModuleType | None = None, stats: CommStats | None = None, deferred_commit: bool = False,
                 piece_sizes=None, separate_coded_errors: bool = False, scale_block: int | None = None) -> None:
        if nodes.node_group is None:
            # attach creates them first; a hand-registered hook state reaches here first, on every
            # rank at the same point (its first compressed bucket), as VoteAllGather does
            nodes.create_groups()
        self.numel = int(numel)
        self.device = torch.device(device)
        self.nodes = nodes
        self.world_size = nodes.local_size * nodes.nodes
        self.stats = stats if stats is not None else CommStats()
        k = nodes.local_size
        self.shard = -(-self.numel // k)  # S
        lo = nodes.local_rank * self.shard
        self.piece_sizes = width_pieces(self.numel, piece_sizes, scale_block, 1)

        def inner_pieces(width: int):  # the whole buffer's pieces at this width, cut to the shard
            whole = width_pieces(self.numel, piece_sizes, scale_block, width)
            return None if whole is None else shard_piece_sizes(whole, lo, self.shard)
        # the 1-bit exchange of this rank's shard among the M nodes (its bytes are counted here)
        self.inner = CompressedAllReduce(self.shard, self.device, group=nodes.inter_group, kernels=kernels,
                                         stats=CommStats(), deferred_commit=deferred_commit, pieces_at=inner_pieces,
                                         separate_coded_errors=separate_coded_errors)
        f32 = dict(dtype=torch.float32, device=self.device)
        self._rows = torch.zeros(k, self.shard + 1, **f32)  # [shard l | flag slot] per local rank
        self._received = torch.empty(k, self.shard + 1, **f32)  # shard l (and flag) of every local rank
        self._mine = torch.empty(self.shard + 1, **f32)
        self._gathered = torch.empty(k * self.shard, **f32)

    def __call__(self, x: torch.Tensor, out: torch.Tensor | None = None, *, width: int = 1) -> torch.Tensor:
        """Blocking node-wise compressed all-reduce of ``x`` (any float dtype); returns ``out``
        (default ``x``). ``width``: bits per element between nodes (1, 8 or 4, as for the flat
        exchange). Call it from the group's executor, as the flat one."""
        if x.numel() != self.numel:
            raise ValueError(f"this state compresses {self.numel} elements, got a buffer of {x.numel()}")
        out = x if out is None else out
        if not out.is_contiguous():
            raise ValueError("the compressed all-reduce writes its result into a contiguous tensor; got a strided `out`")
        k, S, topo = self.nodes.local_size, self.shard, self.nodes
        flat = x.reshape(-1)
        rows = self._rows
        # Round 1: the node mean, shard by shard (divide first, as DDP and MeanAllReduce do).
        for l in range(k):
            part = flat[l * S : (l + 1) * S]
            rows[l, : part.numel()].copy_(part)  # the padding past N stays zero
        rows[:, S] = torch.where(finite_flag(flat), 0.0, float("nan"))
        rows.div_(k)
        dist.all_to_all_single(self._received, rows, group=topo.node_group)
        self._mine.zero_()
        for j in range(k):  # 0 + Σ in local-rank order, on every backend
            self._mine.add_(self._received[j])
        shard = self._mine[:S]
        shard.masked_fill_(torch.isnan(self._mine[S]), float("nan"))  # a rank of this node was non-finite

        # Rounds 2-4: this shard's 1-bit exchange with the same shard of every other node.
        self.inner(shard, width=width)

        # Round 5: every rank of the node gets every shard.
        all_gather_into_tensor(self._gathered, shard, group=topo.node_group)
        out.view(-1).copy_(self._gathered[: self.numel])
        self.stats.record(self.bytes_per_call(width))
        return out

    def bytes_per_call(self, width: int = 1) -> CommRecord:
        """What one call sends and receives on this rank, inside the node and between nodes."""
        k, S = self.nodes.local_size, self.shard
        inter = self.inner.bytes_per_call(width)
        intra = (k - 1) * 4 * (S + 1) + (k - 1) * 4 * S  # reduce-scatter, all-gather
        fp32 = allreduce_bytes(4 * self.numel, self.world_size)
        return CommRecord(
            bytes_sent=intra + inter.bytes_sent,
            bytes_received=intra + inter.bytes_received,
            rounds=2 + inter.rounds,
            fp32_equivalent=fp32,
            calls=1,
            inter_node_sent=inter.bytes_sent,
            inter_node_fp32=leaving_node(fp32, 0, self.world_size, k),
        )

    def allreduce_async(self, x: torch.Tensor, out: torch.Tensor | None = None, *,
                        width: int = 1) -> torch.futures.Future:
        """Queue the call on the default group's ordered executor (the node groups are subgroups of it)."""
        return executor_for(None, self.device).submit(lambda: self(x, out, width=width))

    def allreduce(self, x: torch.Tensor, out: torch.Tensor | None = None, *, width: int = 1) -> torch.Tensor:
        """Blocking call, ordered after every hf_onebit collective already queued on the group."""
        return self.allreduce_async(x, out, width=width).wait()

    # ------------------------------------------------------------------ state
    def layout(self) -> tuple[int, int]:
        """``(nodes, ranks per node)``: what saved state must match."""
        return self.nodes.nodes, self.nodes.local_size

    def state_dict(self) -> dict:
        """This rank's error buffers (those of its shard's 1-bit exchange) and the node layout."""
        return {"numel": self.numel, "world_size": self.world_size, "nodes": list(self.layout()),
                "inner": self.inner.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        """Restore :meth:`state_dict` output saved by the same rank with the same node layout."""
        saved = tuple(state["nodes"]) if "nodes" in state else None
        if saved != self.layout() or state["numel"] != self.numel:
            raise ValueError(
                f"compression state was saved for {state['numel']} elements "
                + (f"on {saved[0]} nodes of {saved[1]} ranks" if saved else "by the flat (not node-wise) exchange")
                + f"; this buffer has {self.numel} elements on {self.layout()[0]} nodes of {self.layout()[1]} ranks"
            )
        self.inner.load_state_dict(state["inner"])

    def commit(self) -> None:
        self.inner.commit()

    def reset(self) -> None:
        self.inner.reset()
