"""The b-bit exchange (spec §1b: ``CompressedAllReduce(...)(x, width=b)``) against an independent
single-process simulation (:class:`tests.simulation.QuantizedSpecSimulation`), bitwise."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tests.comm.test_compressed import make_input
from tests.distributed import run_distributed
from tests.simulation import PieceSpecSimulation, QuantizedSpecSimulation, scale_pieces

SIZES = [700, 9, 1300, 5]  # tensors of a bucket (scale per tensor), 2014 elements
BLOCK = 256  # the 1-bit calls' scale block; a b-bit call's blocks are b times shorter


def _quantized_calls(rank, world_size, numel, width, calls, kernels, pieces, poison_call=None):
    from hf_onebit.comm import CompressedAllReduce

    state = CompressedAllReduce(numel, kernels=kernels, piece_sizes=SIZES if pieces else None,
                                scale_block=BLOCK if pieces == "blocks" else None)
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
@pytest.mark.parametrize("pieces", [False, True, "blocks"], ids=["one_scale", "scale_per_tensor", "blocks"])
@pytest.mark.parametrize("kernels", ["reference", "cpu"])
def test_matches_simulation_bitwise(world_size, width, pieces, kernels):
    numel, calls = sum(SIZES), 6
    outs = run_distributed(_quantized_calls, world_size, numel, width, calls, kernels, pieces, 3)
    sim_pieces = scale_pieces(SIZES, True, BLOCK // width if pieces == "blocks" else None) if pieces else None
    sim = QuantizedSpecSimulation(numel, world_size, width, sim_pieces)
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
    if pieces:  # a finiteness flag, then each chunk's P_max scales beside its codes, twice
        assert record["bytes_sent"] == (n - 1) * (4 + 2 * (4 * scales[1] + chunk * width // 8))
    else:
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


WIDTHS_IN_TURN = [1, 8, 1, 1, 8, 1]  # 0/1 Adam's variance phase: b-bit steps between 1-bit steps


def _alternating_calls(rank, world_size, deferred, device="cpu"):
    from hf_onebit.comm import CompressedAllReduce

    numel = sum(SIZES)
    make = lambda **kw: CompressedAllReduce(numel, device=device, piece_sizes=SIZES, deferred_commit=deferred, **kw)
    state = make(separate_coded_errors=True)
    results, coded = [], []
    for call, width in enumerate(WIDTHS_IN_TURN):
        x = make_input(call, rank, numel, torch.float32).to(device)
        if deferred and call == 4:  # an attempt a loss scaler skips: never committed, leaves no trace
            state.allreduce(3 * x, width=8)
        results.append(state.allreduce(x.clone(), width=width).cpu())
        state.commit()
        coded.append(None if state.coded_errors is None else state.coded_errors.worker.to("cpu", copy=True))
    saved = state.state_dict()
    fresh = make(separate_coded_errors=True)
    fresh.load_state_dict(saved)
    restored = all(torch.equal(a, b) for a, b in [(fresh.worker_error, state.worker_error),
                                                  (fresh.server_error, state.server_error),
                                                  (fresh.coded_errors.worker, state.coded_errors.worker),
                                                  (fresh.coded_errors.server, state.coded_errors.server)])
    with pytest.raises(ValueError, match="b-bit exchange's own error buffers"):
        make().load_state_dict(saved)
    state.reset()
    return {"results": results, "coded": coded, "restored": restored, "freed": state.coded_errors is None,
            "one_bit_error": state.worker_error.abs().max().item()}


CUDA = pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU"))


@pytest.mark.parametrize("device", ["cpu", CUDA])  # numba kernels; Triton's, 2 gloo ranks on the one GPU
@pytest.mark.parametrize("deferred", [False, True], ids=["commit", "deferred_commit"])
def test_separate_coded_errors_keep_each_width_to_its_own_error_feedback(deferred, device):
    """``separate_coded_errors=True``: the 1-bit calls run as if no b-bit call came between them,
    and the b-bit calls as if no 1-bit call did (two independent simulations); the state saves and
    restores both pairs, refuses to load into a buffer that shares one pair, and reset frees the
    b-bit pair."""
    n, numel = 2, sum(SIZES)
    outs = run_distributed(_alternating_calls, n, deferred, device)
    one_bit, coded = PieceSpecSimulation(numel, n, SIZES), QuantizedSpecSimulation(numel, n, 8, SIZES)
    for call, width in enumerate(WIDTHS_IN_TURN):
        xs = [make_input(call, r, numel, torch.float32).numpy() for r in range(n)]
        expected = (one_bit if width == 1 else coded).step(xs)
        for r in range(n):
            got = outs[r]["results"][call].numpy()
            if width == 1:
                np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-6)
            else:
                np.testing.assert_array_equal(got, expected)
            if outs[r]["coded"][call] is not None:
                np.testing.assert_array_equal(outs[r]["coded"][call].numpy(), coded.worker_error[r])
    assert outs[0]["coded"][0] is None  # made on the first b-bit call
    assert all(o["restored"] and o["freed"] and o["one_bit_error"] == 0 for o in outs)
