"""Nodes: which ranks share a machine, and the process groups inside and across machines.

A hierarchical exchange talks over the fast links inside a node and the slow ones between
nodes separately. With ``k`` ranks per node (``LOCAL_WORLD_SIZE``, set by torchrun and
accelerate) and ``M = n/k`` nodes, rank ``r`` is local rank ``r % k`` of node ``r // k``:

* the *node group* of node ``i`` holds ranks ``i·k .. i·k + k-1``;
* the *inter-node group* of local rank ``j`` holds rank ``j`` of every node, so ``k`` inter-node
  groups work in parallel and each node's traffic leaves through all of its ranks.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist

from hf_onebit.comm.compat import all_gather_bytes


@dataclass
class NodeTopology:
    local_size: int  # k ranks per node
    nodes: int  # M nodes
    node: int  # this rank's node
    local_rank: int  # this rank's place inside its node
    node_group: object = None  # created by create_groups()
    inter_group: object = None

    def create_groups(self) -> None:
        """Every rank creates every subgroup, in the same order (``new_group`` is collective)."""
        k, nodes = self.local_size, self.nodes
        for node in range(nodes):
            g = dist.new_group([node * k + j for j in range(k)])
            if node == self.node:
                self.node_group = g
        for j in range(k):
            g = dist.new_group([node * k + j for node in range(nodes)])
            if j == self.local_rank:
                self.inter_group = g


def node_topology(world_size: int, group=None) -> NodeTopology:
    """The node layout of ``world_size`` ranks from ``LOCAL_WORLD_SIZE``.

    Raises ValueError with the reason when there is none: the variable is unset or not an
    integer, there is one node or one rank per node, nodes would be unequal, or ``group`` is not
    the whole world in rank order (subgroups are built from global ranks).
    """
    raw = os.environ.get("LOCAL_WORLD_SIZE")
    if raw is None:
        raise ValueError("LOCAL_WORLD_SIZE is not set (torchrun and accelerate set it)")
    try:
        k = int(raw)
    except ValueError:
        raise ValueError(f"LOCAL_WORLD_SIZE={raw!r} is not an integer") from None
    n = world_size
    if not 1 < k < n:
        raise ValueError(f"it needs 1 < LOCAL_WORLD_SIZE < world size, got LOCAL_WORLD_SIZE={k}, world size {n}")
    if n % k:
        raise ValueError(f"LOCAL_WORLD_SIZE={k} does not divide the world size {n} (nodes must be equal)")
    if dist.is_initialized() and (
        dist.get_world_size() != n or (group is not None and dist.get_process_group_ranks(group) != list(range(n)))
    ):
        raise ValueError("the DDP process group is not the whole world (ranks 0..n-1 in order)")
    rank = dist.get_rank() if dist.is_initialized() else 0
    return NodeTopology(k, n // k, rank // k, rank % k)


def check_same_local_world_size(device: torch.device, group=None, who: str = "hf_onebit") -> None:
    """Refuse ranks that read different ``LOCAL_WORLD_SIZE`` values (uneven nodes, e.g. 8 + 4
    ranks): each would decide on its own whether to exchange by node and build different
    process groups and exchanges, which hangs (``new_group`` on some ranks only) or mixes
    collectives. One small all-gather over ``group``, at attach time; raises the same
    ``ValueError`` on every rank. Call it on every rank of ``group`` at the same point.
    """
    if not dist.is_initialized() or dist.get_world_size(group) == 1:
        return
    mine = os.environ.get("LOCAL_WORLD_SIZE")
    everyone = [json.loads(b.decode()) for b in all_gather_bytes(json.dumps(mine).encode(), device, group)]
    other = next((r for r, v in enumerate(everyone) if v != everyone[0]), None)
    if other is not None:
        shown = lambda v: "unset" if v is None else v  # noqa: E731
        raise ValueError(
            f"{who}: LOCAL_WORLD_SIZE differs between ranks ({shown(everyone[0])} on rank 0, {shown(everyone[other])}"
            f" on rank {other}): the ranks would build different exchanges by node and hang. Pass"
            " hierarchical=False (the flat exchange), or launch the same number of ranks on every node."
        )


def ranks_on_my_node(group=None) -> int:
    """How many of ``group``'s ranks share this rank's node (for the byte counters' model of what
    leaves a node, :func:`hf_onebit.comm.stats.leaving_node`).

    Nodes of ``LOCAL_WORLD_SIZE`` ranks numbered node by node; without that variable (or outside a
    process group) every rank of the group counts as on this node.
    """
    if not dist.is_initialized():
        return 1
    size = dist.get_world_size(group)
    try:
        k = int(os.environ.get("LOCAL_WORLD_SIZE", ""))
    except ValueError:
        return size
    if not 1 <= k < dist.get_world_size():
        return size
    node = dist.get_rank() // k
    ranks = range(dist.get_world_size()) if group is None else dist.get_process_group_ranks(group)
    return sum(1 for r in ranks if r // k == node)
