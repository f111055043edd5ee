"""Nodes from LOCAL_WORLD_SIZE: every layout that cannot be split into equal nodes is named."""

from __future__ import annotations

import pytest
import torch.distributed as dist

from hf_onebit.comm.topology import NodeTopology, node_topology


@pytest.mark.parametrize(
    "local, world, reason",
    [
        (None, 4, "LOCAL_WORLD_SIZE is not set"),
        ("two", 4, "'two' is not an integer"),
        ("1", 4, "1 < LOCAL_WORLD_SIZE < world size"),  # one rank per node: nothing to gain
        ("4", 4, "1 < LOCAL_WORLD_SIZE < world size"),  # one node
        ("3", 8, "does not divide the world size 8"),
    ],
)
def test_layouts_without_equal_nodes_are_refused_with_the_reason(monkeypatch, local, world, reason):
    assert not dist.is_initialized()
    if local is None:
        monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    else:
        monkeypatch.setenv("LOCAL_WORLD_SIZE", local)
    with pytest.raises(ValueError, match=reason):
        node_topology(world)


def test_rank_zero_of_two_nodes_of_four(monkeypatch):
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    topo = node_topology(8)
    assert topo == NodeTopology(local_size=4, nodes=2, node=0, local_rank=0)
    assert topo.node_group is None and topo.inter_group is None  # made by create_groups(), collectively
