"""1-bit Adam on gloo ranks against AdamW (warmup) and the spec simulation (all phases): flat at
every world size of ``tests/optim/world_sizes.py``, by node at each of its node layouts."""

from __future__ import annotations

from functools import partial

import numpy as np
import pytest
import torch

from tests.distributed import run_distributed
from tests.optim.harness import FixedGradModel, fixed_grads, train
from tests.optim.world_sizes import NODE_LAYOUTS, WORLD_SIZES, node_env
from tests.simulation import OneBitAdamSimulation



def _averaged(step, world_size):
    per_rank = [fixed_grads(step, r) for r in range(world_size)]
    return [torch.stack([per_rank[r][k] for r in range(world_size)]).mean(0) for k in range(len(per_rank[0]))]


@pytest.mark.parametrize("world_size", [2, 4])
def test_warmup_equals_adamw_on_the_averaged_gradient(world_size):
    kwargs = dict(lr=1e-2, betas=(0.9, 0.99), eps=1e-8, weight_decay=0.01, freeze_step=1000)
    outs = run_distributed(train, world_size, "OneBitAdam", kwargs, 20)
    torch.manual_seed(0)
    model = FixedGradModel()
    ref = torch.optim.AdamW(model.parameters(), lr=1e-2, betas=(0.9, 0.99), eps=1e-8, weight_decay=0.01, foreach=False)
    for step in range(1, 21):
        for p, g in zip(model.parameters(), _averaged(step, world_size)):
            p.grad = g
        ref.step()
    for r in range(world_size):
        for got, want in zip(outs[r]["history"][-1], model.parameters()):
            torch.testing.assert_close(got, want.detach(), rtol=1e-6, atol=1e-6)
    assert outs[0]["stats"]["phase"] == "warmup"


def _assert_follows(sim, outs, steps, world_size, late=False):
    """Every rank's parameters after every step: the simulation's, and bitwise the same on all ranks."""
    for step in range(1, steps + 1):
        grads = [[g.numpy() for g in fixed_grads(step, r, tiny=True, late=late)] for r in range(world_size)]
        expected = sim.step(grads)
        for r in range(world_size):
            for got, want in zip(outs[r]["history"][step - 1], expected):
                # 1e-5 relative to the tensor's scale: an element that crosses zero has no own scale
                np.testing.assert_allclose(got.numpy(), want, rtol=1e-5, atol=1e-5 * np.abs(want).max())
            for a, b in zip(outs[r]["history"][step - 1], outs[0]["history"][step - 1]):
                assert torch.equal(a, b)


@pytest.mark.parametrize("world_size", WORLD_SIZES)
@pytest.mark.parametrize("bias_correction", [True, False])
def test_trajectory_matches_spec_simulation_through_the_freeze(world_size, bias_correction):
    _follows_simulation_through_the_freeze(world_size, bias_correction)


def _follows_simulation_through_the_freeze(world_size, bias_correction, per_tensor=False, update_clip=None,
                                           precondition=False, freeze=6, late=False):
    """Trains 16 steps (freeze at ``freeze``) and checks every step against the simulation; returns the runs."""
    steps = 16
    kwargs = dict(lr=1e-2, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01, freeze_step=freeze,
                  bias_correction=bias_correction, scale_per_tensor=per_tensor, update_clip=update_clip,
                  precondition_exchange=precondition)
    outs = run_distributed(partial(train, tiny_grads=True, late_grads=late), world_size, "OneBitAdam", kwargs, steps)
    segments = outs[0]["segments"]
    assert len(segments) > 1, "the test wants several DDP buckets"
    torch.manual_seed(0)
    init = [p.detach().numpy() for p in FixedGradModel().parameters()]
    sim = OneBitAdamSimulation(init, world_size, [list(s) for s in segments], lr=1e-2, wd=0.01,
                               freeze_step=freeze, bias_correction=bias_correction, scale_per_tensor=per_tensor,
                               update_clip=update_clip, precondition_exchange=precondition)
    _assert_follows(sim, outs, steps, world_size, late)
    stats = outs[0]["stats"]
    assert stats["phase"] == "compression"
    assert stats["last_step_rounds"] == 3 * len(segments)
    assert stats["compression_ratio"] > 1
    return outs


@pytest.mark.parametrize("world_size", [2, 3])
@pytest.mark.parametrize("bias_correction", [True, False])
def test_the_preconditioned_exchange_matches_its_simulation(world_size, bias_correction):
    """precondition_exchange: the ranks exchange m/(sqrt(v̂)+eps), which the simulation models."""
    _follows_simulation_through_the_freeze(world_size, bias_correction, per_tensor=True, update_clip=1.0,
                                           precondition=True)


def test_coordinates_first_seen_after_the_freeze_send_nothing_when_preconditioned():
    """Coordinates with no gradient before the freeze (v̂ = 0, masked) get one after it: with
    precondition_exchange they send 0, not ~g/eps, so their block's scale and their neighbours'
    steps stay what the simulation says."""
    from tests.optim.harness import LATE_FROM

    freeze = LATE_FROM - 2
    _follows_simulation_through_the_freeze(2, True, per_tensor=True, update_clip=1.0, precondition=True,
                                           freeze=freeze, late=True)


@pytest.mark.parametrize("world_size", [2, 3])
def test_scale_per_tensor_trajectory_matches_piece_simulation(world_size):
    _follows_simulation_through_the_freeze(world_size, True, per_tensor=True)


@pytest.mark.parametrize("nodes,local_size", NODE_LAYOUTS)
@pytest.mark.parametrize("per_tensor", [False, True], ids=["one_scale", "scale_per_tensor"])
def test_exchange_by_node_matches_its_simulation_through_the_freeze(per_tensor, nodes, local_size):
    """hierarchical=True on ``nodes`` emulated nodes of ``local_size`` ranks: the warmup all-reduces
    every rank, the compression phase is spec §1 among the node means, once per shard
    (NodeSpecSimulation)."""
    steps, freeze, n = 16, 6, nodes * local_size
    kwargs = dict(lr=1e-2, weight_decay=0.01, freeze_step=freeze, scale_per_tensor=per_tensor, hierarchical=True)
    outs = run_distributed(partial(train, tiny_grads=True), n, "OneBitAdam", kwargs, steps, env=node_env(local_size))
    segments = [list(s) for s in outs[0]["segments"]]
    assert len(segments) > 1
    torch.manual_seed(0)
    init = [p.detach().numpy() for p in FixedGradModel().parameters()]
    by_node = OneBitAdamSimulation(init, n, segments, lr=1e-2, wd=0.01, freeze_step=freeze,
                                   scale_per_tensor=per_tensor, nodes=(nodes, local_size))
    flat = OneBitAdamSimulation(init, n, segments, lr=1e-2, wd=0.01, freeze_step=freeze, scale_per_tensor=per_tensor)
    for step in range(1, steps + 1):
        grads = [[g.numpy() for g in fixed_grads(step, r, tiny=True)] for r in range(n)]
        expected, other = by_node.step(grads), flat.step(grads)
        for r in range(n):
            for got, want in zip(outs[r]["history"][step - 1], expected):
                np.testing.assert_allclose(got.numpy(), want, rtol=1e-5, atol=1e-5 * np.abs(want).max())
            assert all(torch.equal(a, b) for a, b in zip(outs[r]["history"][step - 1], outs[0]["history"][step - 1]))
    # not the flat exchange under another name: the trajectories part after the freeze
    assert any(not np.allclose(e, o, rtol=1e-4, atol=1e-4 * np.abs(o).max()) for e, o in zip(expected, other))
    stats = outs[0]["stats"]
    assert stats["phase"] == "compression" and stats["last_step_rounds"] == 5 * len(segments)
    assert 0 < stats["inter_node_bytes_sent"] < stats["bytes_sent"]
    assert stats["intra_node_bytes_sent"] == stats["bytes_sent"] - stats["inter_node_bytes_sent"]
    # the headline is the slow link's: fp32 inside the node, compressed between nodes
    assert stats["compression_ratio"] == stats["inter_node_ratio"] > 2 > 1 > stats["intra_node_ratio"]


def test_update_clip_matches_its_simulation_and_bounds_every_step():
    """update_clip=c: after the freeze no coordinate moves by more than c·lr (plus weight decay)."""
    lr, wd, clip, freeze = 1e-2, 0.01, 0.5, 6
    outs = _follows_simulation_through_the_freeze(2, True, per_tensor=True, update_clip=clip)
    history = outs[0]["history"]
    clipped = 0
    for step in range(freeze + 1, len(history)):
        for before, after in zip(history[step - 1], history[step]):
            move = (after - before * (1 - lr * wd)).abs()
            assert move.max() <= clip * lr + 1e-6, move.max()  # 1e-6: fp32 rounding of parameters ~1
            clipped += int((move >= clip * lr - 1e-6).sum())
    assert clipped > 0  # the bound was reached: without it these coordinates would have moved further


def test_update_clip_is_validated():
    import hf_onebit

    for bad in (0, -1.0, float("inf"), True, "1"):
        with pytest.raises(ValueError, match="update_clip"):
            hf_onebit.OneBitAdam([torch.nn.Parameter(torch.ones(2))], update_clip=bad)


def test_auto_mask_keeps_never_updated_coordinates_still():
    kwargs = dict(lr=1e-2, freeze_step=4)
    outs = run_distributed(partial(train, tiny_grads=True), 2, "OneBitAdam", kwargs, 10)
    torch.manual_seed(0)
    init = list(FixedGradModel().parameters())
    final = outs[0]["history"][-1]
    # parameter 1's first 50 coordinates always had zero gradient: masked, so never moved
    assert torch.equal(final[1][:50], init[1][:50].detach())
    assert not torch.equal(final[1][50:], init[1][50:].detach())
    # parameter 3's first 20 coordinates get gradients of ~1e-12 (sqrt(v) << eps): masked too.
    # Unmasked, each compressed step would move them by about lr·scale/eps ~ 1e6.
    after_freeze = outs[0]["history"][3]
    assert torch.equal(final[3][:20], after_freeze[3][:20])
    assert (final[3][:20] - init[3][:20].detach()).abs().max() < 1e-2 * 4  # at most ~lr per warmup step
    assert not torch.equal(final[3][20:], after_freeze[3][20:])


def test_auto_mask_off_lets_tiny_gradient_coordinates_run_away():
    # the hazard auto_mask prevents (docs/algorithms.md, the automatic mask): the same run without it
    outs = run_distributed(partial(train, tiny_grads=True), 2, "OneBitAdam", dict(lr=1e-2, freeze_step=4, auto_mask=False), 6)
    moved = (outs[0]["history"][-1][3][:20] - outs[0]["history"][3][3][:20]).abs().max()
    assert moved > 100


@pytest.mark.parametrize("save_at,warmup_bits", [(3, None), (5, None), (8, None), (3, 8), (5, 4)],
                         ids=["warmup", "at-freeze", "compression", "8bit-warmup", "4bit-at-freeze"])
def test_resume_continues_bitwise(tmp_path, save_at, warmup_bits):
    """In a b-bit warmup the error buffers are state too: saved per rank, restored bitwise."""
    kwargs = dict(lr=1e-2, freeze_step=5, warmup_bits=warmup_bits)
    full = run_distributed(train, 2, "OneBitAdam", kwargs, 12, str(tmp_path), save_at)
    resumed = run_distributed(train, 2, "OneBitAdam", kwargs, 12 - save_at, None, None, str(tmp_path),
                              0.01, save_at)
    for r in range(2):
        for a, b in zip(full[r]["history"][-1], resumed[r]["history"][-1]):
            assert torch.equal(a, b)


def test_resume_keeps_no_work_buffer_once_buckets_are_compressed_in_place(tmp_path):
    """Finding 6: the first bucket after a resume spans several segments, each compressed through
    a work buffer; once later buckets equal their segments (compressed in place) no work buffer
    is kept (4 bytes per parameter), and the run stays bitwise the uninterrupted one."""
    save_at, steps = 8, 10
    kwargs = dict(lr=1e-2, freeze_step=5)
    full = run_distributed(train, 2, "OneBitAdam", kwargs, steps, str(tmp_path), save_at)
    after_one = run_distributed(train, 2, "OneBitAdam", kwargs, 1, None, None, str(tmp_path), 0.01, save_at)
    resumed = run_distributed(train, 2, "OneBitAdam", kwargs, steps - save_at, None, None, str(tmp_path),
                              0.01, save_at)
    for r in range(2):
        assert len(after_one[r]["last_layout"]) == 1 and len(after_one[r]["segments"]) > 1
        assert after_one[r]["work_held"]  # the one-bucket step after the resume needed them
        in_place = set(resumed[r]["last_layout"]) & set(resumed[r]["segments"])
        assert in_place == set(resumed[r]["segments"])  # every bucket is its segment again
        assert not in_place & set(resumed[r]["work_held"]), "work buffers outlive the resume"
        for a, b in zip(full[r]["history"][-1], resumed[r]["history"][-1]):
            assert torch.equal(a, b)


@pytest.mark.parametrize("world_size,width,per_tensor,block", [(2, 8, True, None), (3, 4, True, None),
                                                              (2, 8, False, None), (3, 8, True, 128)])
def test_b_bit_warmup_trajectory_matches_simulation_through_the_freeze(world_size, width, per_tensor, block):
    """warmup_bits: the warmup's gradient goes through spec §1b per DDP bucket (error state per
    segment, zeroed at the freeze), then the compression phase is the spec's; ``scale_block``
    cuts each tensor's piece into blocks of that many elements in the compression phase, one scale
    each, and into blocks ``width`` times shorter in the warmup."""
    steps, freeze = 14, 6
    kwargs = dict(lr=1e-2, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01, freeze_step=freeze,
                  scale_per_tensor=per_tensor, scale_block=block, update_clip=1.0, warmup_bits=width)
    outs = run_distributed(partial(train, tiny_grads=True, record_steps=True), world_size, "OneBitAdam", kwargs, steps)
    layouts = [s["layout"] for s in outs[0]["steps"]]
    torch.manual_seed(0)
    init = [p.detach().numpy() for p in FixedGradModel().parameters()]
    sim = OneBitAdamSimulation(init, world_size, [list(s) for s in outs[0]["segments"]], lr=1e-2, wd=0.01,
                               freeze_step=freeze, scale_per_tensor=per_tensor, update_clip=1.0,
                               warmup_bits=width, warmup_layouts=layouts, scale_block=block)
    _assert_follows(sim, outs, steps, world_size)
    plans = [s["plan"] for s in outs[0]["steps"]]
    assert plans == ["quantize_gradient"] * freeze + ["compress_momentum"] * (steps - freeze)
    # a warmup step sends about b/32 of an fp32 all-reduce's bytes, plus 4 bytes per block and round
    warm = outs[0]["steps"][freeze - 1]
    assert warm["fp32_equivalent"] / warm["bytes_sent"] > 32 / (width + (64 / (block // width) if block else 0)) * 0.8


def test_warmup_bits_is_checked_at_construction():
    from hf_onebit import OneBitAdam

    for bad in (2, 1, True, "8"):
        with pytest.raises(ValueError, match="warmup_bits must be None"):
            OneBitAdam([torch.nn.Parameter(torch.zeros(2))], warmup_bits=bad)
