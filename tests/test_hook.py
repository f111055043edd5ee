"""The DDP hook's contract: loss scaling, accumulation, clipping, autocast, refusals."""

from __future__ import annotations

import pytest
import torch
from torch.nn.parallel import DistributedDataParallel as DDP

from tests.distributed import run_distributed
from tests.optim.harness import FixedGradModel, fixed_grads


def _grad_scaler_skip(rank, world_size, bad_step, warmup_bits=None):
    import hf_onebit

    torch.manual_seed(0)
    model = FixedGradModel()
    opt = hf_onebit.OneBitAdam(model.parameters(), defaults="paper", lr=1e-2, freeze_step=3, warmup_bits=warmup_bits)
    ddp = DDP(model, bucket_cap_mb=0.01)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)
    hf_onebit.attach(ddp, opt, grad_scaler=scaler)
    report = []
    for step in range(1, 9):
        coeffs = fixed_grads(step, rank)
        if step == bad_step and rank == 1:
            coeffs[3][5] = float("inf")  # one bucket only, one rank only
        before = opt.rank_state_dict()
        params_before = [p.detach().clone() for p in model.parameters()]
        scaler.scale(ddp(coeffs)).backward()
        scaler.step(opt)
        scaler.update()
        opt.zero_grad(set_to_none=True)
        after = opt.rank_state_dict()
        # Segments of both: the same errors. A segment the step's bucket layout made (DDP's buckets
        # change after the first step): still zero.
        old, new = before["segments"], after["segments"]
        errors_same = all(
            torch.equal(old[k]["worker_error"], new[k]["worker_error"])
            and torch.equal(old[k]["server_error"], new[k]["server_error"])
            for k in old if k in new
        ) and all(not new[k]["worker_error"].any() and not new[k]["server_error"].any() for k in new if k not in old)
        params_same = all(torch.equal(a, b) for a, b in zip(params_before, model.parameters()))
        report.append({
            "step": step, "steps_done": opt.steps_done, "errors_same": errors_same, "params_same": params_same,
            "n_segments": len(before["segments"]), "params": [p.detach().clone() for p in model.parameters()],
        })
    return report


@pytest.mark.parametrize("bad_step,warmup_bits", [(2, None), (6, None), (2, 8)],
                         ids=["warmup-fp32", "compression", "warmup-8bit"])
def test_grad_scaler_skips_everywhere_and_leaves_error_buffers_untouched(bad_step, warmup_bits):
    outs = run_distributed(_grad_scaler_skip, 2, bad_step, warmup_bits)
    for r in range(2):
        rows = {row["step"]: row for row in outs[r]}
        bad = rows[bad_step]
        assert bad["params_same"], "the step with a non-finite gradient must be skipped"
        assert bad["steps_done"] == rows[bad_step - 1]["steps_done"] if bad_step > 1 else 0
        if warmup_bits is not None:  # the b-bit warmup keeps error buffers: the check must bite
            assert bad["n_segments"] > 0
        if bad["n_segments"]:
            assert bad["errors_same"], "a skipped step changed an error buffer"
        # the next good step proceeds
        assert not rows[bad_step + 1]["params_same"]
        assert rows[8]["steps_done"] == 7
        for row in outs[r]:
            for a, b in zip(row["params"], outs[0][row["step"] - 1]["params"]):
                assert torch.equal(a, b)
    # compression really ran after the skipped step
    assert outs[0][-1]["n_segments"] > 0


def _accumulation(rank, world_size, misuse, scaler=False):
    import hf_onebit

    torch.manual_seed(0)
    model = FixedGradModel()
    opt = hf_onebit.OneBitAdam(model.parameters(), defaults="paper", lr=1e-2, freeze_step=2)
    ddp = DDP(model, bucket_cap_mb=0.01)
    grad_scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10) if scaler else None
    link = hf_onebit.attach(ddp, opt, grad_scaler=grad_scaler)
    calls = []
    original = link.reduce

    def counting(*args, **kwargs):
        calls.append(opt.steps_done + 1)
        return original(*args, **kwargs)

    link.reduce = counting
    for step in range(1, 6):
        micro = [fixed_grads(10 * step + k, rank) for k in range(3)]
        for k, coeffs in enumerate(micro):
            if misuse or k == len(micro) - 1:
                ddp(coeffs).backward()
            else:
                with ddp.no_sync():
                    ddp(coeffs).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    return calls, [p.detach().clone() for p in model.parameters()]


def test_accumulation_with_no_sync_fires_the_hook_once_per_step():
    outs = run_distributed(_accumulation, 2, False)
    calls, params = outs[0]
    steps = sorted(set(calls))
    assert steps == [1, 2, 3, 4, 5]
    per_step = [calls.count(s) for s in steps]
    assert per_step[0] == 1  # DDP's first iteration: one bucket with every parameter
    assert len(set(per_step[1:])) == 1  # later: once per (rebuilt) bucket, never per micro-batch
    assert all(torch.equal(a, b) for a, b in zip(params, outs[1][1]))


@pytest.mark.parametrize("scaler", [False, True], ids=["no-scaler", "grad-scaler"])
def test_accumulation_without_no_sync_is_refused_in_compression(scaler):
    """A repeat of the hook for a step is admitted only after a non-finite attempt (a skipped
    step), so with a loss scaler too a finite repeat is refused, not compressed twice."""
    with pytest.raises(AssertionError, match="no_sync"):
        run_distributed(_accumulation, 2, True, scaler)


def _clip_and_autocast(rank, world_size):
    import hf_onebit

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.Linear(32, 4))
    opt = hf_onebit.OneBitAdam(model.parameters(), defaults="paper", lr=1e-2, freeze_step=2)
    ddp = DDP(model)
    hf_onebit.attach(ddp, opt)
    g = torch.Generator().manual_seed(rank)
    norms, losses = [], []
    for step in range(6):
        x = torch.randn(8, 16, generator=g)
        y = torch.randint(0, 4, (8,), generator=g)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = torch.nn.functional.cross_entropy(ddp(x), y)
        loss.backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)))
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(float(loss))
    return norms, [p.detach().clone() for p in model.parameters()], opt.onebit_stats()["phase"]


def test_clip_grad_norm_sees_the_same_values_on_every_rank_under_bf16_autocast():
    outs = run_distributed(_clip_and_autocast, 2)
    assert outs[0][2] == "compression"
    assert outs[0][0] == outs[1][0], "clip_grad_norm_ must compute the same norm on every rank"
    assert all(torch.equal(a, b) for a, b in zip(outs[0][1], outs[1][1]))
    assert all(torch.isfinite(p).all() for p in outs[0][1])


def _attach_refusals(rank, world_size):
    import hf_onebit

    model = torch.nn.Linear(4, 4)
    other = torch.nn.Linear(4, 4)
    messages = []
    for make in (
        lambda: hf_onebit.attach(model, hf_onebit.OneBitAdam(model.parameters())),
        lambda: hf_onebit.attach(DDP(model), torch.optim.AdamW(model.parameters())),
        lambda: hf_onebit.attach(DDP(model), hf_onebit.OneBitAdam(other.parameters())),
    ):
        try:
            make()
            messages.append(None)
        except (TypeError, ValueError) as exc:
            messages.append(str(exc))
    try:
        hf_onebit.attach(DDP(model, find_unused_parameters=True), hf_onebit.OneBitAdam(model.parameters()))
        messages.append(None)
    except ValueError as exc:
        messages.append(str(exc))
    emb = torch.nn.Embedding(10, 4, sparse=True)
    try:
        hf_onebit.attach(DDP(emb), hf_onebit.OneBitAdam(emb.parameters()))
        messages.append(None)
    except ValueError as exc:
        messages.append(str(exc))
    return messages


def test_attach_refuses_what_it_cannot_serve():
    msgs = run_distributed(_attach_refusals, 2)[0]
    assert "DistributedDataParallel" in msgs[0] and "FSDP" in msgs[0]
    assert "hf_onebit optimizer" in msgs[1]
    assert "not in the optimizer" in msgs[2]
    assert msgs[3] is not None and "find_unused_parameters=False" in msgs[3]
    assert msgs[4] is not None and "sparse" in msgs[4]


def test_bad_hyperparameters_fail_at_construction():
    import hf_onebit

    p = [torch.nn.Parameter(torch.zeros(3))]
    for kwargs, word in [({"lr": -1}, "lr"), ({"betas": (1.0, 0.9)}, "betas"), ({"betas": (0.9, -0.1)}, "betas"),
                         ({"freeze_step": -5}, "freeze_step"), ({"eps": -1e-8}, "eps"),
                         ({"weight_decay": -0.1}, "weight_decay")]:
        with pytest.raises(ValueError, match=word):
            hf_onebit.OneBitAdam(p, **kwargs)


def test_world_size_one_runs_uncompressed_adam_with_frozen_variance():
    """One process, no DDP: warmup is AdamW, then Adam with the variance frozen, exactly."""
    import hf_onebit

    torch.manual_seed(0)
    a, b = FixedGradModel(), FixedGradModel()
    opt = hf_onebit.OneBitAdam(a.parameters(), defaults="paper", lr=1e-2, freeze_step=4, auto_mask=False)
    m = [torch.zeros_like(p) for p in b.parameters()]
    v = [torch.zeros_like(p) for p in b.parameters()]
    for t in range(1, 11):
        grads = fixed_grads(t, 0)
        for p, g in zip(a.parameters(), grads):
            p.grad = g.clone()
        opt.step()
        with torch.no_grad():
            for k, (p, g) in enumerate(zip(b.parameters(), grads)):
                m[k] = 0.9 * m[k] + 0.1 * g
                if t <= 4:
                    v[k] = 0.999 * v[k] + 0.001 * g * g
                vhat = v[k] / (1 - 0.999 ** min(t, 4))
                p -= 1e-2 * (m[k] / (1 - 0.9**t)) / (vhat.sqrt() + 1e-8)
    for p, q in zip(a.parameters(), b.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-5)
    assert opt.exchange.stats.snapshot().bytes_sent == 0


def _mismatched_hyperparameters(rank, world_size, what):
    import hf_onebit

    torch.manual_seed(0)
    model = FixedGradModel()
    kwargs = dict(lr=1e-2, freeze_step=5)
    if what == "freeze_step" and rank == 1:
        kwargs["freeze_step"] = 7
    if what == "lr" and rank == 1:
        kwargs["lr"] = 2e-2
    opt = hf_onebit.OneBitAdam(model.parameters(), **{"defaults": "paper", **kwargs})
    ddp = DDP(model, bucket_cap_mb=0.01)
    try:
        hf_onebit.attach(ddp, opt)
    except ValueError as exc:
        return str(exc)
    return None


@pytest.mark.parametrize("what", ["freeze_step", "lr"])
def test_attach_names_a_hyperparameter_that_differs_between_ranks(what):
    outs = run_distributed(_mismatched_hyperparameters, 2, what)
    for msg in outs:  # every rank refuses, none hangs
        assert msg is not None and "rank 1 differs from rank 0" in msg and what in msg


def _non_finite_without_scaler(rank, world_size, bad_step):
    import hf_onebit

    torch.manual_seed(0)
    model = FixedGradModel()
    opt = hf_onebit.OneBitAdam(model.parameters(), defaults="paper", lr=1e-2, freeze_step=3)
    ddp = DDP(model, bucket_cap_mb=0.01)
    hf_onebit.attach(ddp, opt)
    for step in range(1, 8):
        coeffs = fixed_grads(step, rank)
        if step == bad_step and rank == 0:
            coeffs[0][0, 0] = float("nan")
        ddp(coeffs).backward()
        before = [p.detach().clone() for p in model.parameters()]
        m_before = [opt.state[p]["exp_avg"].clone() for p in model.parameters() if p in opt.state]
        try:
            opt.step()
        except FloatingPointError as exc:
            untouched = all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
            m_same = all(torch.equal(a, opt.state[p]["exp_avg"]) for a, p in zip(m_before, model.parameters()))
            return str(exc), step, untouched, m_same
        opt.zero_grad(set_to_none=True)
    return None, None, None, None


@pytest.mark.parametrize("bad_step", [2, 5])  # warmup, compression
def test_non_finite_gradient_without_a_scaler_stops_every_rank_before_any_state_changes(bad_step):
    outs = run_distributed(_non_finite_without_scaler, 2, bad_step)
    for msg, step, untouched, m_same in outs:  # the NaN of rank 0 reaches every rank
        assert msg is not None and "non-finite gradient" in msg and "grad_scaler" in msg
        assert step == bad_step and untouched and m_same


def _local_phase_scaler_skip(rank, world_size):
    import hf_onebit

    torch.manual_seed(0)
    model = FixedGradModel()
    opt = hf_onebit.ZeroOneAdam(model.parameters(), defaults="paper", lr=1e-2, var_freeze_step=2, local_step_scaler=100,
                                local_step_clipper=2)
    ddp = DDP(model, bucket_cap_mb=0.01)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**8)
    hf_onebit.attach(ddp, opt, grad_scaler=scaler)
    steps_done, params_after = [], []
    for it in range(1, 10):
        coeffs = fixed_grads(it, rank)
        if it == 5 and rank == 1:  # a local step (no communication of gradients), one rank only
            coeffs[2][0] = float("inf")
        scaler.scale(ddp(coeffs)).backward()
        scaler.step(opt)
        scaler.update()
        opt.zero_grad(set_to_none=True)
        steps_done.append(opt.steps_done)
        params_after.append([p.detach().clone() for p in model.parameters()])
    return steps_done, params_after, opt.phase()


def test_zeroone_local_steps_skip_together_under_a_loss_scaler():
    outs = run_distributed(_local_phase_scaler_skip, 2)
    (steps0, params0, phase), (steps1, params1, _) = outs
    assert phase == "local_steps"
    assert steps0 == steps1, "ranks took different skip decisions: their sync schedules would diverge"
    assert steps0[4] == steps0[3], "the overflowing iteration must be skipped"
    assert steps0[-1] == 8
    # after a sync (every 2 steps here) the parameters are identical again
    sync_iters = [i for i, s in enumerate(steps0) if s > 2 and s % 2 == 0 and (i == 0 or steps0[i - 1] != s)]
    assert sync_iters
    for i in sync_iters:
        assert all(torch.equal(a, b) for a, b in zip(params0[i], params1[i]))


def _manual_skip(rank, world_size):
    """A loop without a loss scaler that skips non-finite steps itself (check_finite=False)."""
    import hf_onebit

    torch.manual_seed(0)
    model = FixedGradModel()
    opt = hf_onebit.OneBitAdam(model.parameters(), defaults="paper", lr=1e-2, freeze_step=2, check_finite=False)
    ddp = DDP(model, bucket_cap_mb=0.01)
    hf_onebit.attach(ddp, opt)
    skipped = []
    for step in range(1, 8):
        coeffs = fixed_grads(step, rank)
        if step == 4 and rank == 1:
            coeffs[3][5] = float("inf")
        ddp(coeffs).backward()
        if all(bool(p.grad.isfinite().all()) for p in model.parameters()):
            opt.step()
        else:
            skipped.append(step)
        opt.zero_grad(set_to_none=True)
    return skipped, opt.steps_done, [p.detach().clone() for p in model.parameters()]


def test_a_loop_that_skips_a_non_finite_step_may_run_the_hook_again_for_it():
    outs = run_distributed(_manual_skip, 2)
    for skipped, steps_done, _ in outs:
        assert skipped == [4]  # every rank saw the non-finite result and skipped together
        assert steps_done == 6  # the hook ran again for step 4 (attempt 2) and training went on
    assert all(torch.equal(a, b) for a, b in zip(outs[0][2], outs[1][2]))
