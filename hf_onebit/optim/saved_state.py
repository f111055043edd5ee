"""What an optimizer saves and restores: the shared ``state_dict`` (a torch Adam/AdamW one too)
and this rank's own state.

* :func:`load_shared`: ``load_state_dict``, keeping each state tensor's saved dtype, or, from a
  ``torch.optim.Adam``/``AdamW`` checkpoint, its moments (:func:`import_adam_state`).
* :func:`save`, :func:`reset`, :func:`load`: this rank's own state (``rank_state_dict`` and its
  pair): error buffers of every segment, the last bucket layout, the traffic so far; subclasses
  add their own entries (0/1 Adam's local accumulators, BinSGDM's vote state). Saved by
  :mod:`hf_onebit.checkpoint`.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Callable

import torch

if TYPE_CHECKING:
    from hf_onebit.optim.base import OneBitOptimizer

logger = logging.getLogger("hf_onebit")


def load_shared(opt: OneBitOptimizer, state_dict: dict, torch_load: Callable[[dict], None]) -> None:
    """``opt.load_state_dict(state_dict)`` with ``torch_load`` (torch's), but state keeps the dtype
    it was saved with: torch casts floating-point state to the parameter's dtype, hf_onebit keeps
    moments and errors in fp32 (and flags as bool) whatever the model's dtype, so undo that cast."""
    state_dict = dict(state_dict)
    onebit = state_dict.pop("onebit", None)
    if onebit is None and looks_like_adam(state_dict):
        import_adam_state(opt, state_dict)
        return
    saved_state = state_dict["state"]
    saved_ids = [i for g in state_dict["param_groups"] for i in g["params"]]
    torch_load(state_dict)
    opt.params_changed()
    for saved_id, p in zip(saved_ids, opt.params_in_order()):
        for key, value in (saved_state.get(saved_id) or {}).items():
            if isinstance(value, torch.Tensor):
                opt.state[p][key] = value.to(device=p.device, copy=True)
    if onebit is not None:
        opt.load_global_state(onebit)
    opt._last_phase = opt.phase()


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


def save(opt: OneBitOptimizer) -> dict:
    """The base's entries: error buffers of every segment, the last layout, the traffic so far."""
    return {
        "world_size": opt.world_size,
        "nodes": node_layout(opt),
        "rank": opt.rank,
        "steps_done": opt.steps_done,
        # The error buffers (restored but unused state included) and this rank's traffic so far,
        # so cumulative figures continue across a resume: "segments" and "comm_total".
        **opt.exchange.state_dict(),
        # The last bucket layout DDP used: a run resumed before compression started (e.g.
        # exactly at freeze_step) splits DDP's one-bucket first iteration along it, as the
        # uninterrupted run's buckets were.
        "layout": list(opt.hook_state.layout) if opt.hook_state is not None else [],
    }


def node_layout(opt: OneBitOptimizer) -> list[int] | None:
    """``[nodes, ranks per node]`` that the error buffers belong to (the exchange by node),
    ``None`` for the flat exchange, and for an optimizer without error buffers (BinSGDM)."""
    nodes = opt.exchange.nodes() if opt.keeps_error_buffers else None
    return None if nodes is None else [nodes.nodes, nodes.local_size]


def reset(opt: OneBitOptimizer) -> None:
    """Error buffers start afresh (zero)."""
    opt.exchange.segments.clear()


def load(opt: OneBitOptimizer, state: dict) -> None:
    """Restore what :func:`save` wrote; segments are rebuilt lazily as buckets arrive."""
    if state["world_size"] != opt.world_size:
        raise ValueError(
            f"per-rank compression state was saved with {state['world_size']} ranks, this run has"
            f" {opt.world_size}: resume with {state['world_size']} ranks, or start the per-rank state afresh with"
            " load_rank_state(..., on_mismatch='reset') (user guide: API reference, 'Per-rank state')"
        )
    saved = state["nodes"]
    if saved != node_layout(opt):
        def describe(layout):
            return "the flat exchange" if layout is None else f"the exchange by node ({layout[0]} nodes of {layout[1]} ranks)"
        raise ValueError(
            f"per-rank compression state was saved with {describe(saved)}, this run uses {describe(node_layout(opt))};"
            " its error buffers belong to other buffers: resume with the same node layout (LOCAL_WORLD_SIZE, hierarchical),"
            " or start the per-rank state afresh with on_mismatch='reset' (user guide: API reference, 'Per-rank state')"
        )
    opt.exchange.load_state_dict(state, state["layout"])
