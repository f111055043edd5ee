"""The compressed all-reduce by node (``hf_onebit.comm.hierarchical``) against an independent
simulation (``tests.simulation.NodeSpecSimulation``): 4 ranks as 2 nodes of 2."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tests.distributed import run_distributed
from tests.simulation import NodeSpecSimulation

NODES = {"LOCAL_WORLD_SIZE": "2"}
SIZES = [400, 3, 333, 267]  # tensors laid end to end (1003 elements; shards of 502 cut the third)


def make_input(call: int, rank: int, numel: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 * call + rank)
    x = torch.randn(numel, generator=g) * (1 + rank)
    x[400:403] *= 1e-4  # a small tensor: its own scale matters with pieces
    return x


def _calls(rank, world_size, numel, calls, pieces, bad):
    from hf_onebit.comm.hierarchical import HierarchicalCompressedAllReduce
    from hf_onebit.comm.topology import node_topology

    nodes = node_topology(world_size)
    nodes.create_groups()
    state = HierarchicalCompressedAllReduce(numel, "cpu", nodes, piece_sizes=SIZES if pieces else None)
    results = []
    for call in range(calls):
        x = make_input(call, rank, numel)
        if bad is not None and call == bad[0] and rank == bad[1]:
            x[7] = float("inf")
        errors = (state.inner.worker_error.clone(), state.inner.server_error.clone())
        results.append(state.allreduce(x.clone()).clone())
        if bad is not None and call == bad[0]:
            unchanged = torch.equal(errors[0], state.inner.worker_error) and torch.equal(errors[1], state.inner.server_error)
    return {"results": results, "stats": state.stats.snapshot(), "inter": state.stats.snapshot().inter_node_sent,
            "per_call": state.bytes_per_call(), "shard": state.shard,
            "unchanged": unchanged if bad is not None else None, "saved": state.state_dict()}


@pytest.mark.parametrize("pieces", [False, True], ids=["one_scale", "scale_per_tensor"])
def test_matches_the_node_simulation_and_is_identical_everywhere(pieces):
    numel, calls = sum(SIZES), 6
    outs = run_distributed(_calls, 4, numel, calls, pieces, None, env=NODES)
    sim = NodeSpecSimulation(numel, 2, 2, SIZES if pieces else None)
    for call in range(calls):
        expected = sim.step([make_input(call, r, numel).numpy() for r in range(4)])
        for r in range(4):
            got = outs[r]["results"][call]
            assert torch.equal(got, outs[0]["results"][call])  # bitwise the same on every rank
            np.testing.assert_allclose(got.numpy(), expected, rtol=1e-6, atol=1e-6 * np.abs(expected).max())
    # the last call's result is not the plain mean (it is compressed) but tracks it
    mean = torch.stack([make_input(calls - 1, r, numel) for r in range(4)]).mean(0)
    assert not torch.allclose(outs[0]["results"][-1], mean)


def test_bytes_inside_and_between_nodes():
    numel = sum(SIZES)
    out = run_distributed(_calls, 4, numel, 2, False, None, env=NODES)[0]
    S = out["shard"]
    assert S == 502
    # between nodes: spec §1 among M = 2 nodes on S elements (padded to 8·M): scales, signs, [scale | signs]
    C = -(-S // 16) * 16 // 2
    inter = 4 + C // 8 + (4 + C // 8)
    assert out["inter"] == 2 * inter
    # inside the node: reduce-scatter of k·(S + 1) fp32 and all-gather of k·S fp32 (k = 2)
    assert out["stats"].bytes_sent == 2 * (inter + 4 * (S + 1) + 4 * S) and out["stats"].rounds == 2 * 5
    assert out["stats"].fp32_equivalent == 2 * (2 * 3 * 4 * numel // 4)
    assert out["per_call"].bytes_sent * 2 == out["stats"].bytes_sent


def test_a_non_finite_input_makes_the_result_nan_everywhere_and_keeps_every_error():
    numel = sum(SIZES)
    outs = run_distributed(_calls, 4, numel, 3, False, (1, 2), env=NODES)  # rank 2 (node 1), call 1
    for out in outs:
        assert torch.isnan(out["results"][1]).all()
        assert out["unchanged"]  # no error buffer changed on any rank, whichever shard it owns
        assert torch.isfinite(out["results"][2]).all()


def _load(rank, world_size, saved, flat):
    from hf_onebit.comm import CompressedAllReduce
    from hf_onebit.comm.hierarchical import HierarchicalCompressedAllReduce
    from hf_onebit.comm.topology import node_topology

    if flat:
        state = CompressedAllReduce(sum(SIZES))
    else:  # no create_groups(): the exchange creates the node groups it needs
        state = HierarchicalCompressedAllReduce(sum(SIZES), "cpu", node_topology(world_size))
    try:
        state.load_state_dict(saved[rank])
    except ValueError as exc:
        return str(exc)
    return None


def test_state_saved_by_node_loads_back_and_is_refused_by_the_flat_exchange():
    outs = run_distributed(_calls, 4, sum(SIZES), 2, False, None, env=NODES)
    saved = [o["saved"] for o in outs]
    assert run_distributed(_load, 4, saved, False, env=NODES) == [None] * 4
    for msg in run_distributed(_load, 4, saved, True, env=NODES):
        assert "by node (2 nodes of 2 ranks)" in msg and "flat" in msg
