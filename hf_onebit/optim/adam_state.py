"""Continuing from a ``torch.optim.Adam``/``AdamW`` checkpoint: recognise one, import its moments."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from hf_onebit.optim.base import OneBitOptimizer

logger = logging.getLogger("hf_onebit")


def looks_like_adam(state_dict: dict) -> bool:
    """A ``torch.optim.Adam``/``AdamW`` state_dict (and not one of ours)."""
    states = list(state_dict.get("state", {}).values())
    adam_keys = {"step", "exp_avg", "exp_avg_sq", "max_exp_avg_sq"}
    return bool(states) and all({"step", "exp_avg", "exp_avg_sq"} <= set(s) <= adam_keys for s in states)


def import_adam_state(opt: OneBitOptimizer, state_dict: dict) -> None:
    """Continue from a ``torch.optim.Adam``/``AdamW`` checkpoint: its moments and step count.

    The hyperparameters stay those this optimizer was built with (not the checkpoint's).
    Warmup and freezing follow the step count: a checkpoint past ``freeze_step`` starts
    compressing at once. Coordinates whose variance is exactly zero never had a gradient, which
    is what the automatic mask reads (:mod:`hf_onebit.optim.masks`).
    """
    if not opt.imports_adam_state:
        raise ValueError(
            f"{type(opt).__name__} cannot continue from a torch Adam/AdamW state_dict (its state is not"
            " Adam's moments): start its state afresh and load only the model weights"
        )
    params = opt.params_in_order()
    saved_ids = [i for g in state_dict["param_groups"] for i in g["params"]]
    if len(saved_ids) != len(params):
        raise ValueError(f"the Adam state_dict has {len(saved_ids)} parameters, this optimizer {len(params)}")
    steps = 0
    for saved_id, p in zip(saved_ids, params):
        saved = state_dict["state"].get(saved_id)
        if not saved:
            continue
        if saved["exp_avg"].shape != p.shape:
            raise ValueError(f"the Adam state of parameter {saved_id} has shape {tuple(saved['exp_avg'].shape)}, the parameter {tuple(p.shape)}")
        state = opt._init_state(p)
        state["exp_avg"].copy_(saved["exp_avg"])
        state["exp_avg_sq"].copy_(saved["exp_avg_sq"])
        steps = max(steps, int(saved["step"]))
    opt.steps_done = steps
    opt._last_phase = opt.phase()
    logger.warning(
        "hf_onebit %s: continuing from a torch Adam/AdamW state at step %d (its moments; this"
        " optimizer's hyperparameters); phase '%s'", type(opt).__name__, steps, opt.phase(),
    )
