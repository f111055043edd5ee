"""hf_onebit.sharded_checkpoint: FSDP2 optimizer state through distributed checkpoints.

4 ranks as 2 replicas of 2 (hybrid sharding). A run saves the model with DCP and the optimizer
with ``save_sharded`` in a compression phase; a fresh start loads both and must continue
bitwise. Loaded into another mesh (4 replicas of 1), the moments are resharded to the whole
tensors that were saved, and the per-rank state is refused or started afresh.
"""

from __future__ import annotations

import os
import sys

import pytest
import torch

from tests.distributed import run_distributed
from tests.hook.test_fsdp import SIMULATIONS
from tests.optim.harness import FixedGradModel, train

# optimizer -> the step after which it saves: a compression phase (0/1 Adam: between two
# syncs, with local accumulators; 1-bit LAMB: after its freeze at 6)
SAVE_AT = {"OneBitAdam": 6, "hf_onebit.optim.zeroone_adam:ZeroOneAdam": 22, "OneBitLamb": 9, "BinSGDM": 4}


def _resumed(rank, world_size, save_dir, name, steps, save_at):
    import torch.distributed as dist

    kwargs, _, tiny, _, _ = SIMULATIONS[name]
    common = dict(tiny_grads=tiny, shard_size=2, sharded_checkpoint=True)
    gathered_objects = []
    real = dist.all_gather_object

    def recorded(*args, **kwargs):  # with NCCL it stages through the current CUDA device
        caller = sys._getframe(1).f_code.co_filename  # DCP's own planning gathers objects too
        if os.sep + "hf_onebit" + os.sep in caller:
            gathered_objects.append(caller)
        return real(*args, **kwargs)

    dist.all_gather_object = recorded
    try:
        whole = train(rank, world_size, name, kwargs, steps, save_dir, save_at, **common)
        resumed = train(rank, world_size, name, kwargs, steps - save_at, resume_dir=save_dir, start_step=save_at,
                        **common)
    finally:
        dist.all_gather_object = real  # the ranks run the next test too
    return whole["history"][save_at:], resumed["history"], whole["global"], resumed["global"], len(gathered_objects)


@pytest.mark.parametrize("name", list(SAVE_AT))
def test_resume_from_a_distributed_checkpoint_is_bitwise(tmp_path, name):
    steps, save_at = SIMULATIONS[name][1], SAVE_AT[name]
    outs = run_distributed(_resumed, 4, str(tmp_path), name, steps, save_at)
    for r, (whole, resumed, g_whole, g_resumed, gathered_objects) in enumerate(outs):
        # hf_onebit's save and load exchange through the parameters' device (all_gather_bytes),
        # never all_gather_object, which NCCL stages through torch.cuda.current_device()
        assert gathered_objects == 0, f"rank {r}: {gathered_objects} all_gather_object calls"
        assert len(whole) == len(resumed) == steps - save_at
        for step, (a, b) in enumerate(zip(whole, resumed), start=save_at + 1):
            assert all(torch.equal(x, y) for x, y in zip(a, b)), f"{name}: rank {r} differs at step {step}"
        assert g_whole["steps_done"] == g_resumed["steps_done"] == steps  # the counters came back too
    # one DCP checkpoint (its metadata) and one per-rank file per global rank, none written over another
    files = sorted(os.listdir(tmp_path / "optimizer"))
    assert ".metadata" in files
    assert [f for f in files if f.endswith(".json")] == [f"hf_onebit_rank{r}_of4.json" for r in range(4)]


def _other_mesh(rank, world_size, save_dir, on_mismatch):
    """Saved as 2 replicas of 2 ranks after step 6, loaded as 4 replicas of 1."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.fsdp import fully_shard

    import hf_onebit

    kwargs = SIMULATIONS["OneBitAdam"][0]
    train(rank, world_size, "OneBitAdam", kwargs, 6, save_dir, 6, tiny_grads=True, shard_size=2,
          sharded_checkpoint=True)
    # what was saved, whole: the moments of the 2x2 run, read back with DCP's own reader
    torch.manual_seed(0)
    model = FixedGradModel()
    fully_shard(model, mesh=hf_onebit.replica_mesh(1, "cpu")["shard"])
    opt = hf_onebit.OneBitAdam(model.parameters(), **kwargs)
    hf_onebit.attach(model, opt)
    names = [n for n, _ in model.named_parameters()]
    saved = {f"optimizer.state.{n}.exp_avg": torch.empty(p.shape) for n, p in model.named_parameters()}
    dcp.load(saved, checkpoint_id=os.path.join(save_dir, "optimizer"))
    try:
        loaded = hf_onebit.load_sharded(opt, os.path.join(save_dir, "optimizer"), on_mismatch)
    except ValueError as exc:
        return str(exc), opt.steps_done, len(opt.state)  # refused before the optimizer changed
    moments = [opt.state[p]["exp_avg"] for p in opt.params_in_order()]
    same = all(torch.equal(m, saved[f"optimizer.state.{n}.exp_avg"]) for n, m in zip(names, moments))
    return loaded, same, opt.steps_done, len(opt.exchange.segments.keys())


def test_another_mesh_is_refused_or_reset_with_resharded_moments(tmp_path):
    for message, steps_done, with_state in run_distributed(_other_mesh, 4, str(tmp_path / "a"), "error"):
        assert "saved by world_size=4, shard_size=2, this run has world_size=4, shard_size=1" in message, message
        assert "on_mismatch='reset'" in message and steps_done == 0 and with_state == 0
    for loaded, same, steps_done, segments in run_distributed(_other_mesh, 4, str(tmp_path / "b"), "reset"):
        assert loaded is False  # the per-rank state started afresh ...
        assert same  # ... and the moments are the saved ones, resharded to whole tensors
        assert steps_done == 6 and segments == 0


def test_an_optimizer_not_attached_to_fsdp2_is_refused(tmp_path):
    import hf_onebit

    opt = hf_onebit.OneBitAdam(FixedGradModel().parameters(), lr=1e-3)
    for call in (hf_onebit.save_sharded, hf_onebit.load_sharded):
        with pytest.raises(ValueError, match="not attached to an FSDP2 model"):
            call(opt, str(tmp_path))
