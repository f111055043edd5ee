"""The vote all-gather (``hf_onebit.comm.vote``) on its own: exact averages, the validity flag,
the node binarisation, and the bytes it counts."""

from __future__ import annotations

import torch

from tests.distributed import run_distributed

NUMEL = 21  # padded to 24 (flat) or 32 (hierarchical, 8 x 2 ranks per node)


def votes_of(rank: int, padded: int) -> torch.Tensor:
    """Rank r votes +1 on coordinate k exactly when bit r of k is set (False in the padding)."""
    k = torch.arange(padded)
    return ((k >> rank) & 1).bool() & (k < NUMEL)


def _exchange(rank, world_size, hierarchical, bad_rank):
    import torch.distributed as dist

    from hf_onebit.comm.topology import node_topology
    from hf_onebit.comm.vote import VoteAllGather

    vote = VoteAllGather(dist.group.WORLD, world_size, node_topology(world_size) if hierarchical else None)
    padded = vote.padded_length(NUMEL)
    votes = votes_of(rank, padded)
    finite = torch.tensor(rank != bad_rank)
    if hierarchical:  # the node's draws: 0.5 everywhere, so the node votes +1 exactly where μ > 0
        qbar, valid = vote(votes, finite, NUMEL, node_uniform=torch.full((NUMEL,), 0.5),
                           scratch=torch.empty(padded))
    else:
        qbar, valid = vote(votes, finite, NUMEL)
    return {"padded": padded, "qbar": qbar[:NUMEL].clone(), "valid": bool(valid),
            "sent": vote.stats.snapshot().bytes_sent, "inter": vote.stats.snapshot().inter_node_sent}


def test_the_flat_vote_is_the_exact_mean_of_every_rank_and_counts_its_bytes():
    outs = run_distributed(_exchange, 2, False, None)
    padded = outs[0]["padded"]
    want = torch.stack([votes_of(r, padded)[:NUMEL].float() * 2 - 1 for r in range(2)]).mean(0)
    for out in outs:
        assert padded == 24 and out["valid"]
        assert torch.equal(out["qbar"], want)
        assert out["sent"] == (2 - 1) * (4 + padded // 8) and out["inter"] == 0


def test_one_non_finite_flag_invalidates_the_vote_everywhere():
    for out in run_distributed(_exchange, 2, False, 1):
        assert not out["valid"]


def test_the_hierarchical_vote_averages_the_node_votes_and_counts_the_inter_node_bytes():
    outs = run_distributed(_exchange, 4, True, None, env={"LOCAL_WORLD_SIZE": "2"})
    padded = outs[0]["padded"]
    signs = [votes_of(r, padded)[:NUMEL].float() * 2 - 1 for r in range(4)]
    node_means = [(signs[0] + signs[1]) / 2, (signs[2] + signs[3]) / 2]  # nodes {0, 1} and {2, 3}
    node_votes = [torch.where(m > 0, 1.0, -1.0) for m in node_means]  # u = 0.5 < (1 + μ)/2 iff μ > 0
    want = (node_votes[0] + node_votes[1]) / 2
    k, nodes, nbytes = 2, 2, padded // 8
    for out in outs:
        assert padded == 32 and out["valid"]
        assert torch.equal(out["qbar"], want)
        inter = (nodes - 1) * (4 + nbytes // k)
        assert out["inter"] == inter
        assert out["sent"] == (k - 1) * (4 + nbytes) + inter + (k - 1) * nodes * (nbytes // k)
