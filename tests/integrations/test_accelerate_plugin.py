"""hf_onebit in hand-written Accelerate loops: attach after prepare, save_state/load_state, fp16 scaler."""

from __future__ import annotations

import types
from collections import Counter

import pytest
import torch

from tests.distributed import run_distributed
from tests.integrations.launch import SCRIPTS, accelerate_launch


@pytest.mark.parametrize("optim", ["zeroone_adam"])
def test_save_state_and_load_state_carry_the_compression_state(tmp_path, optim):
    """0/1 Adam, saved after a local step (ranks' parameters differ), resumed in a fresh Accelerator."""
    accelerate_launch([str(SCRIPTS / "accelerate_loop.py"), "--optim", optim, "--out", str(tmp_path),
                       "--steps", "12", "--save_at", "9"], timeout=300).check()
    outs = [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in range(2)]
    for rank, out in enumerate(outs):
        assert out["files"] == ["hf_onebit_rank0_of2.json", "hf_onebit_rank0_of2.pt", "hf_onebit_rank1_of2.json", "hf_onebit_rank1_of2.pt"]
        different = [k for k in out["full"] if not torch.equal(out["full"][k], out["resumed"][k])]
        assert not different, f"rank {rank}: load_state did not continue bitwise: {different[:4]}"
        assert Counter(out["calls"]) == {s: 1 for s in range(1, 13)}  # accumulate(): once per step
        phases = [entry["onebit/phase"] for entry in out["logs"]]
        assert phases[:4] == [0] * 4 and phases[-1] == 1  # variance, then local_steps
        assert out["logs_resumed"][-1]["onebit/bytes_sent"] == out["logs"][-1]["onebit/bytes_sent"]
        # every entry is a number, for any tracker; each covers its step's communication time
        assert all(isinstance(v, (int, float)) for e in out["logs"] for v in e.values())
        timed = [e for e in out["logs"] if e["onebit/bytes_per_step"] > 0]
        assert timed and all(e["onebit/comm_ms"] > 0 and 0 <= e["onebit/hidden_share"] <= 1 for e in timed)
        silent = [e for e in out["logs"] if e["onebit/bytes_per_step"] == 0]  # local steps: nothing sent
        assert silent and all(e["onebit/comm_ms"] == 0 and "onebit/hidden_share" not in e for e in silent)
    assert out["summary"].startswith("hf_onebit ZeroOneAdam on 2 ranks, 12 steps") and "fp32 DDP" in out["summary"]
    # after step 9 (a local step) the two ranks' parameters differ, and each was restored as its own
    step9 = [o["logs"][8] for o in outs]
    assert step9[0]["onebit/bytes_per_step"] == 0


def _scaler_wiring(rank, world_size):
    from torch.nn.parallel import DistributedDataParallel as DDP

    import hf_onebit
    from hf_onebit.integrations.accelerate import attach_prepared

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 2))
    opt = hf_onebit.OneBitAdam(model.parameters(), lr=1e-2, freeze_step=1)
    ddp = DDP(model)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**8)
    wrapped = types.SimpleNamespace(optimizer=opt)  # what AcceleratedOptimizer looks like from outside
    accelerator = types.SimpleNamespace(num_processes=world_size, distributed_type="MULTI_CPU",
                                        parallelism_config=None, scaler=scaler)
    inner, found = attach_prepared(accelerator, ddp, wrapped)
    again, _ = attach_prepared(accelerator, ddp, wrapped)  # idempotent: DDP takes one hook
    state = ddp._hf_onebit_hook_state
    g = torch.Generator().manual_seed(rank)
    for _ in range(3):
        loss = ddp(torch.randn(4, 8, generator=g)).square().mean()
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
    return (inner is opt, again is opt, found is ddp, state.grad_scaler is scaler, opt.scaled,
            opt.steps_done, [p.detach().clone() for p in model.parameters()])


def test_attach_unwraps_the_optimizer_and_passes_the_grad_scaler():
    outs = run_distributed(_scaler_wiring, 2, timeout=180)
    for out in outs:
        assert out[:5] == (True, True, True, True, True)
        assert out[5] == 3  # two compressed steps ran after the warmup step, none skipped
    assert all(torch.equal(a, b) for a, b in zip(outs[0][6], outs[1][6]))


def test_onebit_accelerator_attaches_in_prepare():
    """One process: prepare pairs the model with its hf_onebit optimizer (nothing to communicate)."""
    import hf_onebit
    from hf_onebit.integrations.accelerate import OneBitAccelerator

    model = torch.nn.Linear(4, 2)
    other = torch.nn.Linear(4, 2)
    accelerator = OneBitAccelerator(cpu=True)
    opt = hf_onebit.OneBitAdam(model.parameters(), lr=1e-3, freeze_step=1)
    plain = torch.optim.SGD(other.parameters(), lr=0.1)
    prepared_model, prepared_opt, _, _ = accelerator.prepare(model, opt, other, plain)
    assert len(accelerator.onebit) == 1 and accelerator.onebit[0].optimizer is opt
    for _ in range(3):
        accelerator.backward(prepared_model(torch.randn(3, 4)).sum())
        prepared_opt.step()
        prepared_opt.zero_grad()
    assert opt.steps_done == 3
    assert accelerator.onebit[0].log_entries()["onebit/phase"] == 1  # compression
    from hf_onebit.comm.stats import TIMER

    assert TIMER.enabled  # the log times the communication ...
    accelerator.onebit[0].remove()
    assert not TIMER.enabled  # ... until remove(): the process-wide timer is not left running
