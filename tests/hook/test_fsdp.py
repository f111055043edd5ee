"""FSDP2 (hf_onebit.hook.fsdp): the optimizers' trajectories on sharded replicas against their
single-process simulations, and the refusals of what is not built."""

from __future__ import annotations

from functools import partial

import numpy as np
import pytest
import torch

from tests.distributed import run_distributed
from tests.optim.harness import FixedGradModel, fixed_grads, train
from tests.simulation import OneBitAdamSimulation


def _initial():
    torch.manual_seed(0)
    return [p.detach().numpy().copy() for p in FixedGradModel().parameters()]


def _shard(x: np.ndarray, j: int, size: int) -> np.ndarray:
    """Shard ``j`` of ``size`` on dim 0, as FSDP2 cuts it (torch.chunk)."""
    return torch.chunk(torch.from_numpy(x), size, dim=0)[j].numpy()


def _replica_grads(step: int, replicas: int, size: int, j: int) -> list:
    """What rank ``j`` of each replica holds after FSDP's reduce-scatter: its replica's mean of shard ``j``."""
    out = []
    for r in range(replicas):
        ranks = [fixed_grads(step, r * size + i, tiny=True) for i in range(size)]
        out.append([_shard(torch.stack([g[k] for g in ranks]).mean(0).numpy(), j, size) for k in range(len(ranks[0]))])
    return out


@pytest.mark.parametrize("world_size,shard_size", [(2, 1), (4, 2)])
def test_onebit_adam_on_fsdp2_matches_the_simulation_through_the_freeze(world_size, shard_size):
    steps, freeze = 10, 4
    kwargs = dict(lr=1e-2, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01, freeze_step=freeze, scale_per_tensor=True)
    outs = run_distributed(partial(train, tiny_grads=True, shard_size=shard_size), world_size, "OneBitAdam", kwargs,
                           steps)
    segments = outs[0]["segments"]
    assert segments == [tuple(range(5))], "one FSDP module: one buffer of its parameters in order"
    replicas = world_size // shard_size
    sims = [OneBitAdamSimulation([_shard(x, j, shard_size) for x in _initial()], replicas, [list(range(5))],
                                 lr=1e-2, wd=0.01, freeze_step=freeze, scale_per_tensor=True)
            for j in range(shard_size)]
    for step in range(1, steps + 1):
        shards = [sim.step(_replica_grads(step, replicas, shard_size, j)) for j, sim in enumerate(sims)]
        expected = [np.concatenate([s[k] for s in shards]) for k in range(5)]
        for r in range(world_size):
            for got, want in zip(outs[r]["history"][step - 1], expected):
                np.testing.assert_allclose(got.numpy(), want, rtol=1e-5, atol=1e-5 * np.abs(want).max())
            assert all(torch.equal(a, b) for a, b in zip(outs[r]["history"][step - 1], outs[0]["history"][step - 1]))
    stats = outs[0]["stats"]
    assert stats["phase"] == "compression" and stats["compression_ratio"] > 1
