"""Per-rank state files: exact resume, and refusal of missing, foreign, corrupt or malicious files."""

from __future__ import annotations

import json
import os
import pickle

import pytest
import torch
from torch.nn.parallel import DistributedDataParallel as DDP

from tests.distributed import run_distributed
from tests.optim.harness import FixedGradModel, build_optimizer, fixed_grads

OPTIMIZERS = {
    "OneBitAdam": dict(lr=1e-2, freeze_step=3),
    "ZeroOneAdam": dict(lr=1e-2, var_freeze_step=3, local_step_scaler=2, local_step_clipper=4),
    "OneBitLamb": dict(lr=1e-2, freeze_step=3),
    "BinSGDM": dict(lr=1e-2),
}


def _run(rank, world_size, name, steps, directory, save_at=None, resume=False, on_mismatch="error"):
    import hf_onebit
    from hf_onebit.checkpoint import load_rank_state, save_rank_state

    torch.manual_seed(0)
    model = FixedGradModel()
    opt = build_optimizer(name, model.parameters(), OPTIMIZERS[name])
    start = 0
    if resume:
        model.load_state_dict(torch.load(os.path.join(directory, "model.pt"), weights_only=True))
        opt.load_state_dict(torch.load(os.path.join(directory, "optimizer.pt"), weights_only=True))
        start = opt.steps_done
    ddp = DDP(model, bucket_cap_mb=0.01)
    hf_onebit.attach(ddp, opt)
    loaded = None
    if resume:
        loaded = load_rank_state(opt, directory, on_mismatch=on_mismatch)
    for step in range(start + 1, steps + 1):
        ddp(fixed_grads(step, rank)).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if step == save_at:
            if rank == 0:
                torch.save(model.state_dict(), os.path.join(directory, "model.pt"))
                torch.save(opt.state_dict(), os.path.join(directory, "optimizer.pt"))
            save_rank_state(opt, directory)
            torch.distributed.barrier()
    return [p.detach().clone() for p in model.parameters()], loaded


@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_resume_through_the_state_files_is_bitwise(tmp_path, name):
    full = run_distributed(_run, 2, name, 10, str(tmp_path), 7)
    resumed = run_distributed(_run, 2, name, 10, str(tmp_path), None, True)
    for r in range(2):
        assert resumed[r][1] is True
        for a, b in zip(full[r][0], resumed[r][0]):
            assert torch.equal(a, b)
    assert sorted(os.listdir(tmp_path)) == [
        "hf_onebit_rank0_of2.json", "hf_onebit_rank0_of2.pt", "hf_onebit_rank1_of2.json", "hf_onebit_rank1_of2.pt",
        "model.pt", "optimizer.pt",
    ]


def test_another_world_size_is_refused_then_reset_on_request(tmp_path):
    run_distributed(_run, 4, "OneBitAdam", 6, str(tmp_path), 5)
    with pytest.raises(AssertionError, match="another world size"):
        run_distributed(_run, 2, "OneBitAdam", 8, str(tmp_path), None, True)
    outs = run_distributed(_run, 2, "OneBitAdam", 8, str(tmp_path), None, True, "reset")
    assert outs[0][1] is False and outs[1][1] is False
    for a, b in zip(outs[0][0], outs[1][0]):
        assert torch.equal(a, b) and torch.isfinite(a).all()


def _resume_catching(rank, world_size, directory, on_mismatch):
    """The resume's error on this rank (None: it went on training) and how long loading took."""
    import time

    import hf_onebit.checkpoint as checkpoint

    real, seconds = checkpoint.load_rank_state, []

    def timed(*args, **kwargs):
        start = time.monotonic()
        try:
            return real(*args, **kwargs)
        finally:
            seconds.append(time.monotonic() - start)

    checkpoint.load_rank_state = timed  # _run imports it at call time
    try:
        _run(rank, world_size, "OneBitAdam", 8, directory, None, True, on_mismatch)
    except checkpoint.RankStateError as exc:
        return str(exc), seconds[0]
    finally:
        checkpoint.load_rank_state = real
    return None, seconds[0]


@pytest.mark.parametrize("on_mismatch", ["reset", "error"])
def test_one_rank_without_usable_state_stops_every_rank(tmp_path, on_mismatch):
    """Finding 5: with rank 1's file missing, rank 1 alone would reset (or raise) while rank 0
    restores its segments and goes on into an exchange rank 1 does not make (gloo errors, NCCL
    hangs). Every rank raises at load time instead, within seconds, naming rank 1 and the fix."""
    run_distributed(_run, 2, "OneBitAdam", 6, str(tmp_path), 5)
    for ext in ("pt", "json"):
        os.remove(tmp_path / f"hf_onebit_rank1_of2.{ext}")
    outs = run_distributed(_resume_catching, 2, str(tmp_path), on_mismatch, pg_timeout=20, timeout=120)
    for rank, (error, seconds) in enumerate(outs):
        assert error is not None, f"rank {rank} went on training"
        assert seconds < 15
    assert "no per-rank state for rank 1 of 2" in outs[1][0]
    assert "rank(s) [1] of 2 cannot use their per-rank state" in outs[0][0]
    assert "reset_rank_state() on every rank" in outs[0][0]
    if on_mismatch == "reset":
        assert outs[0][0] == outs[1][0]  # the same error everywhere


# ---------------------------------------------------------------- single process: file checks
def _saved(tmp_path):
    import hf_onebit
    from hf_onebit.checkpoint import save_rank_state

    model = FixedGradModel()
    opt = hf_onebit.OneBitAdam(model.parameters(), freeze_step=2)
    for step in range(1, 4):
        for p, g in zip(model.parameters(), fixed_grads(step, 0)):
            p.grad = g
        opt.step()
    path = save_rank_state(opt, str(tmp_path))
    return opt, path


def test_a_modified_file_is_refused_naming_it(tmp_path):
    from hf_onebit.checkpoint import RankStateError, load_rank_state

    opt, path = _saved(tmp_path)
    data = bytearray(open(path, "rb").read())
    data[len(data) // 2] ^= 0xFF
    open(path, "wb").write(bytes(data))
    with pytest.raises(RankStateError, match="hf_onebit_rank0_of1.pt.*checksum"):
        load_rank_state(opt, str(tmp_path))


def test_a_foreign_file_is_refused(tmp_path):
    import hf_onebit
    from hf_onebit.checkpoint import RankStateError, load_rank_state

    _, path = _saved(tmp_path)
    other = hf_onebit.OneBitLamb(FixedGradModel().parameters())
    with pytest.raises(RankStateError, match="optimizer='OneBitAdam'"):
        load_rank_state(other, str(tmp_path))


def test_a_missing_file_errors_or_resets_on_request(tmp_path):
    import hf_onebit
    from hf_onebit.checkpoint import RankStateError, load_rank_state

    opt = hf_onebit.OneBitAdam(FixedGradModel().parameters())
    with pytest.raises(RankStateError, match="missing.*on_mismatch='reset'"):
        load_rank_state(opt, str(tmp_path))
    assert load_rank_state(opt, str(tmp_path), on_mismatch="reset") is False


class _Exploit:
    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def test_pickled_code_is_never_executed_even_with_a_matching_checksum(tmp_path):
    import hashlib

    from hf_onebit.checkpoint import RankStateError, load_rank_state

    opt, path = _saved(tmp_path)
    marker = tmp_path / "pwned"
    exploit = _Exploit()
    exploit.marker = str(marker)
    payload = pickle.dumps({"segments": exploit}, protocol=2)
    open(path, "wb").write(payload)
    meta_path = path[: -len(".pt")] + ".json"
    meta = json.load(open(meta_path))
    meta["sha256"] = hashlib.sha256(payload).hexdigest()  # an attacker can recompute the checksum
    json.dump(meta, open(meta_path, "w"))
    with pytest.raises(RankStateError, match="not a valid hf_onebit state file"):
        load_rank_state(opt, str(tmp_path))
    assert not marker.exists()


# ---------------------------------------------------------------- from a plain AdamW checkpoint
def _from_adamw(rank, world_size, directory, name):
    import hf_onebit

    torch.manual_seed(0)
    model = FixedGradModel()
    ddp = DDP(model, bucket_cap_mb=0.01)
    adamw = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for step in range(1, 5):  # 4 steps of plain DDP + AdamW
        ddp(fixed_grads(step, rank)).backward()
        adamw.step()
        adamw.zero_grad(set_to_none=True)
    sd = adamw.state_dict()
    m_adam = [adamw.state[p]["exp_avg"].clone() for p in model.parameters()]
    del ddp
    opt = build_optimizer(name, model.parameters(), OPTIMIZERS[name])
    try:
        opt.load_state_dict(sd)
    except ValueError as exc:
        return {"refused": str(exc)}
    ddp = DDP(model, bucket_cap_mb=0.01)
    hf_onebit.attach(ddp, opt)
    moments_kept = all(torch.equal(opt.state[p]["exp_avg"], m) for p, m in zip(model.parameters(), m_adam))
    steps_done, phase = opt.steps_done, opt.phase()
    for step in range(5, 9):
        ddp(fixed_grads(step, rank)).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    return {"moments_kept": moments_kept, "steps_done": steps_done, "phase": phase,
            "final_phase": opt.phase(), "params": [p.detach().clone() for p in model.parameters()]}


@pytest.mark.parametrize("name", ["OneBitAdam", "BinSGDM"])
def test_continuing_from_a_plain_adamw_checkpoint(tmp_path, name):
    outs = run_distributed(_from_adamw, 2, str(tmp_path), name)
    if name == "BinSGDM":
        assert "cannot continue from a torch Adam/AdamW state_dict" in outs[0]["refused"]
        return
    for out in outs:
        assert out["moments_kept"] and out["steps_done"] == 4
        assert out["phase"] == "compression"  # freeze_step=3 < 4: compression starts at once
        assert all(torch.isfinite(p).all() for p in out["params"])
    assert all(torch.equal(a, b) for a, b in zip(outs[0]["params"], outs[1]["params"]))
