"""The b-bit exchange (spec §1b: ``CompressedAllReduce(...)(x, width=b)``) against an independent
single-process simulation (:class:`tests.simulation.QuantizedSpecSimulation`), bitwise."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tests.comm.test_compressed import make_input
from tests.distributed import run_distributed
from tests.simulation import PieceSpecSimulation, QuantizedSpecSimulation

SIZES = [700, 9, 1300, 5]  # tensors of a bucket (scale per tensor), 2014 elements


def _quantized_calls(rank, world_size, numel, width, calls, kernels, pieces, poison_call=None):
    from hf_onebit.comm import CompressedAllReduce

    state = CompressedAllReduce(numel, kernels=kernels, piece_sizes=SIZES if pieces else None)
    results, errors = [], []
    for call in range(calls):
        x = make_input(call, rank, numel, torch.float32)
        if call == poison_call and rank == world_size - 1:
            x[3] = float("inf")
        results.append(state.allreduce(x.clone(), width=width))
        errors.append((state.worker_error.clone(), state.server_error.clone()))
    return {"results": results, "errors": errors, "stats": state.stats.snapshot().as_dict(),
            "record": state.bytes_per_call(width).as_dict()}


@pytest.mark.parametrize("world_size", [2, 3])
@pytest.mark.parametrize("width", [8, 4])
@pytest.mark.parametrize("pieces", [False, True], ids=["one_scale", "scale_per_tensor"])
@pytest.mark.parametrize("kernels", ["reference", "cpu"])
def test_matches_simulation_bitwise(world_size, width, pieces, kernels):
    numel, calls = sum(SIZES), 6
    outs = run_distributed(_quantized_calls, world_size, numel, width, calls, kernels, pieces, 3)
    sim = QuantizedSpecSimulation(numel, world_size, width, SIZES if pieces else None)
    for call in range(calls):
        xs = [make_input(call, r, numel, torch.float32).numpy() for r in range(world_size)]
        if call == 3:
            xs[-1][3] = np.inf
        expected = sim.step(xs)
        for r in range(world_size):
            got = outs[r]["results"][call].numpy()
            if call == 3:  # one rank's inf: NaN everywhere, no error buffer changes on any rank
                assert np.isnan(got).all()
            else:
                np.testing.assert_array_equal(got, expected)
            worker_error, server_error = outs[r]["errors"][call]
            np.testing.assert_array_equal(worker_error.numpy(), sim.worker_error[r])
            np.testing.assert_array_equal(server_error.numpy(), sim.server_error[r])
    # error feedback ran, and a b-bit exchange is far closer to the mean than 1 bit's
    assert outs[0]["errors"][-1][0].abs().sum() > 0
    n, chunk = world_size, sim.C
    record = outs[0]["record"]
    scales = len(sim.worker_cuts) - 1, (max(
        sum(1 for c in sim.server_cuts if j * chunk <= c < (j + 1) * chunk) for j in range(n)) if pieces else 1)
    assert record["bytes_sent"] == (n - 1) * (4 * scales[0] + 2 * chunk * width // 8 + 4 * scales[1])
    assert record["rounds"] == 3


def test_b_bits_rebuild_the_mean_closer_than_one_bit():
    """The point of the warmup exchange: 8 and 4 bits carry magnitudes, 1 bit only their RMS."""
    n, numel = 2, sum(SIZES)
    xs = [make_input(0, r, numel, torch.float32).numpy() for r in range(n)]
    mean = np.mean(xs, axis=0)
    err = {}
    for width in (8, 4):
        err[width] = np.abs(QuantizedSpecSimulation(numel, n, width, SIZES).step(xs) - mean).max()
    err[1] = np.abs(PieceSpecSimulation(numel, n, SIZES).step(xs) - mean).max()
    assert err[8] < err[4] / 8 < err[1] / 8


def _one_rank_world(rank, world_size):
    from hf_onebit.comm import CompressedAllReduce

    x = make_input(0, rank, 100, torch.float32)
    out = CompressedAllReduce(100, kernels="reference")(x.clone(), width=8)
    with pytest.raises(ValueError, match="width must be 1 or one of"):
        CompressedAllReduce(100, kernels="reference")(x.clone(), width=2)
    return torch.equal(out, x)


def test_one_rank_returns_its_input_and_refuses_other_widths():
    assert run_distributed(_one_rank_world, 1) == [True]
