"""The vote exchange of BinSGDM (docs/algorithms.md, "BinSGDM"): every rank's 1-bit votes to every rank, averaged.

Each rank holds one vote ``q_i ∈ {-1, +1}`` per coordinate (a bool vector, ``True`` = +1) and
a validity flag; every rank ends with the same average ``q̄ = mean_i q_i`` and the same verdict
"every flag was finite".

===================================== ========================== ===============================
exchange                              bytes sent per rank/bucket rounds
===================================== ========================== ===============================
flat: all-gather of ``[flag | bits]`` ``(n-1)·(4 + N/8)``        1
hierarchical (``k`` ranks per node,   intra ``(k-1)·(4 + N/8)``  3 (1 of them between nodes)
``M = n/k`` nodes)                    inter ``(M-1)·(4+N/(8k))``
                                      intra ``(k-1)·M·N/(8k)``
===================================== ========================== ===============================

(``N`` = elements padded to a multiple of 8, or ``8k`` hierarchically; the flag is one fp32,
1.0 or NaN.) The average is exact: integer sums of ±1, one division, in rank (node) order,
so it is bitwise identical on every rank.

Scaling, honestly. An all-gather of bits sends ``(n-1)·N/8`` bytes per rank, growing with
``n``; an fp32 ring all-reduce sends ``2·(n-1)/n·4N ≈ 8N``, independent of ``n``. So the flat
vote beats fp32 only for ``n < ~64`` (and 1-bit Adam's compressed all-reduce, ``≈ N/4``
bytes, for ``n < ~3``). Its advantages are elsewhere: one round, no error buffers, trivial
compute. The hierarchical exchange divides the ``n`` of the expensive (inter-node) part by the
node size: each node sends ``(M-1)·N/8`` bytes between nodes (1 bit per element per node,
spread over its ``k`` ranks, which use their NICs in parallel), so with 8 GPUs per node the
crossover moves from 64 ranks to 64 *nodes*.

Hierarchical exchange (:class:`~hf_onebit.comm.topology.NodeTopology`):

1. intra-node all-gather of ``[flag | bits]``: every rank of the node sums the ``k`` votes
   (exact small integers) into the node mean ``μ ∈ [-1, 1]``;
2. every rank of the node binarises ``μ`` with uniforms ``u`` that the caller drew from the
   *node's* random stream (the same numbers on all ranks of a node, so they get the same node
   bits without a broadcast): ``+1`` where ``u < (1+μ)/2``, unbiased because ``E[μ] = mean z``;
3. local rank ``j`` of every node all-gathers slice ``j`` of the node bits with local rank
   ``j`` of the other nodes (``k`` inter-node groups work in parallel; each node sends its
   ``N`` bits exactly once);
4. intra-node all-gather of the gathered slices; every rank decodes the same ``M × N`` bits
   and averages them in node order: ``q̄ = mean over nodes``, identical on every rank.

The extra binarisation adds variance: ``Var[node bit] = 1 - μ̄²`` (``μ̄`` = the node's mean
``z``), so ``Var[q̄] = (1/M²)·Σ_nodes (1 - μ̄²)``, the flat variance of ``M`` ranks.
The subgroups are created inside the first call (every rank creates every subgroup in the same
order), which runs in the process group's ordered executor like every call, so the three
rounds of several buckets never interleave.
"""

from __future__ import annotations

import torch

from hf_onebit.comm.compat import all_gather_into_tensor
from hf_onebit.comm.stats import CommRecord, CommStats, allreduce_bytes, leaving_node
from hf_onebit.comm.topology import NodeTopology, ranks_on_my_node
from hf_onebit.kernels import get_backend


class VoteAllGather:
    """Average 1-bit votes over the ranks of ``group``, flat or by node; counts its bytes.

    Args:
        group: the process group (the whole world when ``topology`` is given).
        world_size: its size ``n``.
        topology: the nodes, for the hierarchical exchange; ``None`` for the flat one.
        stats: every byte this rank sends is counted here (with its share of what leaves the
            node, :mod:`hf_onebit.comm.stats`).
    """

    def __init__(self, group, world_size: int, topology: NodeTopology | None = None,
                 stats: CommStats | None = None) -> None:
        self.group = group
        self.world_size = world_size
        self.topology = topology
        self.stats = stats if stats is not None else CommStats()
        self.local_size = ranks_on_my_node(group) if topology is None else topology.local_size

    @property
    def hierarchical(self) -> bool:
        return self.topology is not None

    def padded_length(self, numel: int) -> int:
        """The vote vector's length for ``numel`` coordinates: a multiple of 8 (``8k`` by node)."""
        unit = 8 * self.topology.local_size if self.topology is not None else 8
        return -(-numel // unit) * unit

    def __call__(self, votes: torch.Tensor, finite: torch.Tensor, numel: int, *,
                 node_uniform: torch.Tensor | None = None,
                 scratch: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """``(q̄, valid)``: the fp32 average of ``votes`` over ranks, and whether every flag was finite.

        ``votes`` is bool, of :meth:`padded_length` (``False`` in the padding); ``finite`` a 0-dim
        device bool (this rank's flag); both stay on the device, nothing is read on the host.
        Hierarchically, ``node_uniform`` (fp32, ``numel``) holds the node stream's draws and
        ``scratch`` (fp32, padded length) is work space; ``votes`` is overwritten with the node's
        votes.
        """
        if self.topology is None:
            return self._flat(votes, finite, numel)
        if node_uniform is None or scratch is None:
            raise ValueError("the hierarchical vote needs the node's uniforms and a scratch buffer")
        return self._hierarchical(votes, finite, numel, node_uniform, scratch)

    def _flat(self, votes, finite, numel):
        n = self.world_size
        nbytes = votes.numel() // 8
        bits = torch.empty(nbytes, dtype=torch.uint8, device=votes.device)
        get_backend(votes.device).pack_bools(votes, bits)
        rows = _gather(_flagged(bits, finite), n, self.group)
        valid = _rows_valid(rows)
        qbar = _vote_mean(rows[:, 4:])
        moved = (n - 1) * (4 + nbytes)
        fp32, k = allreduce_bytes(4 * numel, n), self.local_size
        self.stats.record(CommRecord(moved, moved, 1, fp32, 1, leaving_node(moved, 0, n, k), leaving_node(fp32, 0, n, k)))
        return qbar, valid

    def _hierarchical(self, votes, finite, numel, node_uniform, theta):
        topo = self.topology
        if topo.node_group is None:
            topo.create_groups()
        k, nodes = topo.local_size, topo.nodes
        nbytes = votes.numel() // 8
        slice_bytes = nbytes // k
        pack = get_backend(votes.device).pack_bools
        bits = torch.empty(nbytes, dtype=torch.uint8, device=votes.device)
        pack(votes, bits)

        # Round 1 (intra-node): every rank of the node gets the node's k votes.
        rows = _gather(_flagged(bits, finite), k, topo.node_group)
        node_finite = _rows_valid(rows)
        mean = _vote_mean(rows[:, 4:])  # μ ∈ [-1, 1], identical on the node's ranks
        # Binarise once per node with the node's stream: P(+1) = (1 + μ)/2.
        torch.add(mean, 1.0, out=theta).mul_(0.5)
        theta[numel:].zero_()
        torch.lt(node_uniform, theta[:numel], out=votes[:numel])
        pack(votes, bits)

        # Round 2 (inter-node): local rank j exchanges slice j of the node bits across nodes.
        mine = bits[topo.local_rank * slice_bytes : (topo.local_rank + 1) * slice_bytes]
        inter = _gather(_flagged(mine, node_finite), nodes, topo.inter_group)
        valid = _rows_valid(inter)

        # Round 3 (intra-node): assemble every node's full bit vector on every rank.
        gathered = _gather(inter[:, 4:].contiguous().reshape(-1), k, topo.node_group)
        all_bits = gathered.view(k, nodes, slice_bytes).permute(1, 0, 2).reshape(nodes, nbytes)
        qbar = _vote_mean(all_bits)

        r1 = (k - 1) * (4 + nbytes)
        r2 = (nodes - 1) * (4 + slice_bytes)
        r3 = (k - 1) * nodes * slice_bytes
        moved = r1 + r2 + r3
        fp32 = allreduce_bytes(4 * numel, self.world_size)
        self.stats.record(CommRecord(moved, moved, 3, fp32, 1, r2, leaving_node(fp32, 0, self.world_size, k)))
        return qbar, valid


def _gather(payload: torch.Tensor, size: int, group) -> torch.Tensor:
    out = torch.empty(size * payload.numel(), dtype=torch.uint8, device=payload.device)
    all_gather_into_tensor(out, payload, group=group)
    return out.view(size, payload.numel())


def _flagged(bits: torch.Tensor, flag: torch.Tensor) -> torch.Tensor:
    """``[fp32 1.0 or NaN | bits]``, the flag written from the device bool ``flag``."""
    payload = torch.empty(4 + bits.numel(), dtype=torch.uint8, device=bits.device)
    payload[:4].view(torch.float32).copy_(torch.where(flag, 1.0, float("nan")))
    payload[4:].copy_(bits)
    return payload


def _rows_valid(rows: torch.Tensor) -> torch.Tensor:
    """Whether every gathered row's flag is finite: a 0-dim bool tensor on the device."""
    return torch.isfinite(rows[:, :4].contiguous().view(torch.float32)).all()


def _vote_mean(bits: torch.Tensor) -> torch.Tensor:
    """``mean_r ±1`` of the rows of ``bits`` (r, B): exact integer sums, one division."""
    ones = torch.ones(bits.shape[0], dtype=torch.float32, device=bits.device)
    return get_backend(bits.device).server_average(bits.contiguous(), ones)
