"""The automatic freeze (``freeze_step="auto"`` / ``var_freeze_step="auto"``).

The rule is re-derived here in numpy from its docstring (per-tensor RMS of the bias-corrected
variance, median |log change| over a window, bounds), fed the same averaged gradients, and must
pick the same step. On 2 gloo ranks every rank must pick the same step, the run must equal a run
with that step fixed (whose trajectory the per-optimizer tests check against the spec
simulation), and a resume before or after the decision must continue bitwise.
"""

from __future__ import annotations

import logging
import math

import numpy as np
import pytest
import torch

from hf_onebit.optim.freeze import UNDECIDED, AutoFreeze
from tests.distributed import run_distributed
from tests.optim.harness import FixedGradModel, fixed_grads, train

# ---------------------------------------------------------------- an independent reading of the rule


def expected_choice(grads_per_step, beta2, rule: AutoFreeze, variance_steps=None) -> int | None:
    """The step the rule picks for averaged gradients ``grads_per_step[t-1]`` (list per tensor).

    ``variance_steps``: the steps whose gradient updates the variance (default: every step).
    """
    v = [np.zeros_like(g, dtype=np.float64) for g in grads_per_step[0]]
    k, previous, prev_k = 0, None, None
    for t, grads in enumerate(grads_per_step, start=1):
        if variance_steps is None or t in variance_steps:
            k += 1
            v = [beta2 * a + (1 - beta2) * g.astype(np.float64) ** 2 for a, g in zip(v, grads)]
            if k % rule.window == 0:
                r = [math.sqrt(a.mean() / (1 - beta2**k)) for a in v if a.size]
                if previous is not None and prev_k == k - rule.window:
                    drift = float(np.median([abs(math.log(x / y)) for x, y in zip(r, previous) if x > 0 and y > 0]))
                    if t >= rule.min_step and drift <= rule.tolerance:
                        return t
                previous, prev_k = r, k
        if rule.max_step is not None and t >= rule.max_step:
            return t
    return None


def _averaged(step, world_size=2):
    per_rank = [fixed_grads(step, r) for r in range(world_size)]
    return [np.mean([per_rank[r][i].numpy() for r in range(world_size)], axis=0) for i in range(len(per_rank[0]))]


def _one_process_choice(cls, kwargs, grads_per_step):
    torch.manual_seed(0)
    model = FixedGradModel()
    opt = cls(model.parameters(), **kwargs)
    for grads in grads_per_step:
        for p, g in zip(model.parameters(), grads):
            p.grad = torch.as_tensor(g)
        opt.step()
    return opt


def _transient(step):
    """Averaged gradients that shrink by 20x over the first ~30 steps, then stay (a fine-tuning start)."""
    scale = 1 + 19 * math.exp(-step / 10)
    return [g * scale for g in _averaged(step)]


@pytest.mark.parametrize("cls_name, key", [("OneBitAdam", "freeze_step"), ("OneBitLamb", "freeze_step")])
def test_rule_picks_the_step_an_independent_reading_picks(cls_name, key):
    import hf_onebit

    rule = AutoFreeze(min_step=10, window=5, tolerance=0.05)
    grads = [_transient(t) for t in range(1, 201)]
    want = expected_choice(grads, 0.999, rule)
    opt = _one_process_choice(getattr(hf_onebit, cls_name), {key: rule, "lr": 1e-3}, grads)
    assert want is not None and rule.min_step < want < 200  # the drift decided, not a bound
    # the transient holds the freeze back well past min_step: the variance still remembers it
    assert want > 40
    assert opt.freeze_step == want and opt.auto_freeze.chosen == want
    assert opt.auto_freeze.chosen_drift <= rule.tolerance
    assert opt.phase() == "compression"


def test_zeroone_adam_checks_at_variance_steps_only():
    import hf_onebit

    rule = AutoFreeze(min_step=10, window=4, tolerance=0.1)
    kwargs = dict(var_freeze_step=rule, var_update_scaler=8, lr=1e-3)
    grads = [_transient(t) for t in range(1, 301)]
    probe = hf_onebit.ZeroOneAdam([torch.nn.Parameter(torch.zeros(1))], var_update_scaler=8)
    variance_steps = {t for t in range(1, 301) if probe.variance_updates_until(t) > probe.variance_updates_until(t - 1)}
    assert len(variance_steps) < 60  # the interval doubles: 8 at 1, 8 at 2, 8 at 4, ...
    want = expected_choice(grads, 0.999, rule, variance_steps)
    opt = _one_process_choice(hf_onebit.ZeroOneAdam, kwargs, grads)
    assert want is not None and want in variance_steps and rule.min_step < want < 300
    assert opt.var_freeze_step == want and opt.phase() == "local_steps"


def test_bounds():
    import hf_onebit

    steady = [_averaged(t) for t in range(1, 61)]
    # a steady gradient settles at the first comparison; min_step holds it back
    opt = _one_process_choice(hf_onebit.OneBitAdam, dict(freeze_step=AutoFreeze(min_step=30, window=2, tolerance=0.5)), steady)
    assert opt.freeze_step == 30
    # max_step ends the warmup whatever the drift (a tolerance nothing meets)
    opt = _one_process_choice(hf_onebit.OneBitAdam, dict(freeze_step=AutoFreeze(min_step=5, max_step=17, tolerance=1e-9)), steady)
    assert opt.freeze_step == 17 and opt.auto_freeze.chosen_drift is None
    assert "max_step reached" in opt.auto_freeze.describe()
    # undecided: the warmup goes on, and the saved freeze step says so
    opt = _one_process_choice(hf_onebit.OneBitAdam, dict(freeze_step=AutoFreeze(min_step=5, tolerance=1e-9)), steady)
    assert opt.freeze_step == UNDECIDED and opt.phase() == "warmup"
    assert opt.global_state()["freeze_step"] is None


@pytest.mark.parametrize("bad, match", [
    (dict(freeze_step="sometimes"), "freeze_step must be an integer >= 1 or 'auto'"),
    (dict(freeze_step=-3), "freeze_step must be an integer >= 1 or 'auto'"),
    (dict(freeze_step=2.5), "freeze_step must be an integer >= 1 or 'auto'"),
    (dict(freeze_step=0), "freeze_step=0: without a warmup step Adam's variance is never estimated"),
])
def test_construction_errors(bad, match):
    import hf_onebit

    for cls in (hf_onebit.OneBitAdam, hf_onebit.OneBitLamb):
        with pytest.raises(ValueError, match=match):
            cls([torch.nn.Parameter(torch.zeros(3))], **bad)
    with pytest.raises(ValueError, match=match.replace("freeze_step", "var_freeze_step")):
        hf_onebit.ZeroOneAdam([torch.nn.Parameter(torch.zeros(3))], var_freeze_step=bad["freeze_step"])


@pytest.mark.parametrize("bad, match", [
    (dict(min_step=0), "min_step must be an integer >= 1"),
    (dict(window=0), "window must be an integer >= 1"),
    (dict(min_step=10, max_step=5), "max_step must be an integer >= min_step"),
    (dict(tolerance=0.0), "tolerance must be a positive number"),
    (dict(tolerance=float("nan")), "tolerance must be a positive number"),
])
def test_auto_freeze_validation(bad, match):
    with pytest.raises(ValueError, match=match):
        AutoFreeze(**bad)


def test_for_run_bounds():
    rule = AutoFreeze.for_run(1080)
    assert (rule.min_step, rule.max_step, rule.window) == (108, 432, 43)
    rule = AutoFreeze.for_run(3)
    assert 1 <= rule.min_step <= rule.max_step <= 3
    # short runs: not before 20 variance updates where 40% of the run allows
    assert [(AutoFreeze.for_run(n).min_step, AutoFreeze.for_run(n).max_step) for n in (40, 60, 100, 300)] == [
        (16, 16), (20, 24), (20, 40), (30, 120)]
    plain = AutoFreeze()
    assert plain.fit_to_run(240) and (plain.min_step, plain.max_step, plain.window) == (24, 96, 10)
    chosen_bounds = AutoFreeze(min_step=5, window=3)
    assert not chosen_bounds.fit_to_run(240) and chosen_bounds.max_step is None  # the user's bounds stay


def test_one_instance_configures_several_optimizers_independently():
    import hf_onebit

    rule = AutoFreeze(min_step=3, window=1, tolerance=10.0)
    a = _one_process_choice(hf_onebit.OneBitAdam, dict(freeze_step=rule), [_averaged(t) for t in range(1, 6)])
    b = hf_onebit.OneBitAdam([torch.nn.Parameter(torch.zeros(3))], freeze_step=rule)
    assert a.freeze_step == 3 and rule.chosen is None and b.auto_freeze.chosen is None


# ---------------------------------------------------------------- the warning for known-unstable settings
def test_unstable_uncorrected_variance_warns(caplog):
    import hf_onebit

    p = [torch.nn.Parameter(torch.zeros(3))]
    with caplog.at_level(logging.WARNING, logger="hf_onebit"):
        hf_onebit.ZeroOneAdam(p, var_freeze_step=12, bias_correction=False)
    assert "known to lose accuracy or diverge" in caplog.text and "bias_correction=True" in caplog.text
    assert "after 12 update(s)" in caplog.text  # steps 1..12 are all variance steps (interval 1 for 16)
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="hf_onebit"):
        hf_onebit.OneBitAdam(p, freeze_step=40, bias_correction=False)
    assert "known to lose accuracy or diverge" in caplog.text and "5.0x larger" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="hf_onebit"):
        hf_onebit.ZeroOneAdam(p, var_freeze_step=12)  # the default corrects the variance
        hf_onebit.ZeroOneAdam(p, var_freeze_step=100000, bias_correction=False)  # DeepSpeed's default: settled
        hf_onebit.OneBitAdam(p, freeze_step=3000, bias_correction=False)
    assert "known to lose accuracy or diverge" not in caplog.text


# ---------------------------------------------------------------- on 2 ranks
RULE = AutoFreeze(min_step=4, window=2, tolerance=0.08)
CASES = {
    "OneBitAdam": ("freeze_step", dict(lr=1e-2, weight_decay=0.01)),
    "OneBitLamb": ("freeze_step", dict(lr=1e-2, weight_decay=0.01)),
    "ZeroOneAdam": ("var_freeze_step", dict(lr=1e-2, eps=1e-4, var_update_scaler=4, local_step_scaler=2,
                                            local_step_clipper=4)),
}
STEPS = 24


def _chosen(out, key):
    return out["global"][key]


@pytest.mark.parametrize("name", list(CASES))
def test_every_rank_picks_the_same_step_and_trains_as_if_it_were_fixed(name, tmp_path):
    key, kwargs = CASES[name]
    auto = run_distributed(train, 2, name, {**kwargs, key: RULE}, STEPS)
    chosen = [_chosen(o, key) for o in auto]
    assert chosen[0] is not None and chosen[0] == chosen[1]
    assert RULE.min_step <= chosen[0] < STEPS - 4
    fixed = run_distributed(train, 2, name, {**kwargs, key: chosen[0]}, STEPS)
    for r in range(2):
        for a, b in zip(auto[r]["history"], fixed[r]["history"]):
            for x, y in zip(a, b):
                assert torch.equal(x, y)
    # the independent reading of the rule picks the same step from the averaged gradients
    variance_steps = None
    if name == "ZeroOneAdam":
        import hf_onebit

        probe = hf_onebit.ZeroOneAdam([torch.nn.Parameter(torch.zeros(1))], var_update_scaler=4)
        variance_steps = {t for t in range(1, STEPS + 1) if probe.variance_updates_until(t) > probe.variance_updates_until(t - 1)}
    assert expected_choice([_averaged(t) for t in range(1, STEPS + 1)], 0.999, RULE, variance_steps) == chosen[0]


@pytest.mark.parametrize("name", ["OneBitAdam", "ZeroOneAdam"])
def test_resume_before_and_after_the_decision_continues_bitwise(name, tmp_path):
    key, kwargs = CASES[name]
    kwargs = {**kwargs, key: RULE}
    chosen = _chosen(run_distributed(train, 2, name, kwargs, STEPS)[0], key)
    for save_at in (chosen - 1, chosen + 3):
        d = tmp_path / str(save_at)
        d.mkdir()
        full = run_distributed(train, 2, name, kwargs, STEPS, str(d), save_at)
        # after the decision the resumed optimizer must not decide again, even with other bounds
        resume_kwargs = kwargs if save_at < chosen else {**kwargs, key: AutoFreeze(min_step=1, window=1, tolerance=10.0)}
        resumed = run_distributed(train, 2, name, resume_kwargs, STEPS - save_at, None, None, str(d), 0.01, save_at)
        for r in range(2):
            assert _chosen(resumed[r], key) == chosen
            for a, b in zip(full[r]["history"][-1], resumed[r]["history"][-1]):
                assert torch.equal(a, b)
