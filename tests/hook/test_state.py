"""The hook state's protocol memory, without DDP: the repeat rule and the layout memory."""

from __future__ import annotations

import pytest
import torch

from hf_onebit.hook import OneBitHookState
from hf_onebit.optim import Plan
from tests.optim.harness import FixedGradModel, build_optimizer


def _state():
    opt = build_optimizer("OneBitAdam", FixedGradModel().parameters(), dict(lr=1e-2, freeze_step=2))
    return opt, OneBitHookState(opt)


def test_a_repeat_is_admitted_only_after_a_non_finite_attempt():
    _, state = _state()
    key = (0, 1)
    assert state._admit(key, 3, Plan.COMPRESS_MOMENTUM) == 0
    assert state._admit(key, 3, Plan.COMPRESS_MOMENTUM) is None  # accumulation without no_sync
    state.note_attempt(3, 0, torch.tensor(True))
    assert state._admit(key, 3, Plan.COMPRESS_MOMENTUM) is None  # a finite attempt: no retry
    state.note_attempt(3, 0, torch.tensor(False))  # another bucket of attempt 0 was non-finite
    assert state._admit(key, 3, Plan.COMPRESS_MOMENTUM) == 1  # the skipped step is retried
    assert state._admit(key, 3, Plan.COMPRESS_MOMENTUM) is None  # attempt 1 has no flag yet
    assert state._admit(key, 4, Plan.COMPRESS_MOMENTUM) == 0  # the next step starts afresh
    assert 3 not in state._attempt_finite  # flags of finished steps are dropped


def test_a_full_precision_step_may_repeat():
    _, state = _state()
    assert state._admit((0,), 1, Plan.ALLREDUCE) == 0
    assert state._admit((0,), 1, Plan.ALLREDUCE) == 0  # no error state to corrupt


def test_the_layout_memory_carries_over_to_a_new_attach():
    opt, state = _state()
    assert state.covered(5) is None
    state.layout_step, state.layout = 5, [(0, 2), (1,)]
    assert state.covered(5) == {0, 1, 2} and state.covered(6) is None
    again = OneBitHookState(opt)  # a re-attach: the new state becomes the optimizer's link
    assert opt.hook_state is again and again.covered(5) == {0, 1, 2}
    again.layout.append((3,))
    assert state.layout == [(0, 2), (1,)]  # a copy, not shared


def test_a_scaler_passed_where_the_process_group_goes_is_refused():
    opt, _ = _state()
    with pytest.raises(TypeError, match="grad_scaler="):
        OneBitHookState(opt, torch.amp.GradScaler("cpu"))
