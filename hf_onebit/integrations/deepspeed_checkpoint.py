"""Continuing from a DeepSpeed 1-bit Adam / 1-bit LAMB checkpoint: its moments, in the layouts it saved.

DeepSpeed's 1-bit optimizers ran with ZeRO stage 0, so rank 0's ``mp_rank_00_model_states.pt``
holds the whole optimizer state (``checkpoint["optimizer"]``), a torch ``state_dict`` with
``state`` and ``param_groups``, in one of three wrappings:

* fp32: the optimizer's own ``state_dict``, one entry per parameter;
* fp16, 1-bit Adam and 0/1 Adam: DeepSpeed's fused fp16 optimizer, ``{"optimizer_state_dict":
  {...}, "fp32_groups_flat": [...], "cur_scale": ...}``, whose optimizer saw each parameter group
  as one flat fp32 tensor (the group's parameters concatenated in order, no padding): one entry
  per group, which is split back by the parameters' sizes;
* fp16, 1-bit LAMB: the unfused fp16 optimizer, the same ``optimizer_state_dict``, one entry per
  parameter.

What is taken: ``exp_avg`` and ``exp_avg_sq``, the step (DeepSpeed's counter, one ahead: its step
``S`` is ``S - 1`` updates here), and for 1-bit LAMB ``lamb_coeff_freeze``, ``last_factor``,
``exp_avg_sq_fresh`` (where the frozen ratio reads it, ``fresh_trust_ratio=False``) and
``scaling_coeff``. What is not: the error buffers (``worker_error`` /
``server_error``, rank 0's only; DeepSpeed itself dropped them on load) and the sizes DeepSpeed
padded to. The moments go through :func:`hf_onebit.optim.saved_state.import_adam_state`, the path a
torch AdamW checkpoint takes.

Refused with the reason: 0/1 Adam (its variance and sync schedules are counted on DeepSpeed's
one-ahead counter, and its accumulator was rank 0's only), bf16 or ZeRO checkpoints (each rank
saved its own partition of flat, padded moments), and anything whose parameters do not match.
"""

from __future__ import annotations

import torch

from hf_onebit.optim.base import OneBitOptimizer

#: keys DeepSpeed's 1-bit Adam (and 0/1 Adam) set on every parameter's state at its first step()
_SIZES = {"tensor_size", "corrected_tensor_size", "server_chunk_size"}
_RESTART = ("start hf_onebit's optimizer afresh from the model weights instead (a new warmup; see the user guide,"
            " 'Coming from DeepSpeed')")


def _unwrap(checkpoint: dict) -> dict:
    """The optimizer's own ``state_dict`` inside an engine checkpoint or an fp16 wrapper."""
    if not isinstance(checkpoint, dict):
        raise ValueError(f"a DeepSpeed checkpoint is a dict, got {type(checkpoint).__name__}")
    if "module" in checkpoint or "optimizer" in checkpoint:  # mp_rank_00_model_states.pt
        checkpoint = checkpoint.get("optimizer")
        if not isinstance(checkpoint, dict):
            raise ValueError("this DeepSpeed checkpoint holds no optimizer state (checkpoint['optimizer'] is empty:"
                             f" saved with ZeRO, or without the optimizer); {_RESTART}")
    if "base_optimizer_state" in checkpoint or "partition_count" in checkpoint:
        raise ValueError("this is a partitioned DeepSpeed optimizer state (bf16 or ZeRO: each rank saved its own"
                         " slice of flat, padded moments); hf_onebit reads the stage-0 fp32/fp16 layouts only; "
                         + _RESTART)
    if "optimizer_state_dict" in checkpoint:  # DeepSpeed's fp16 optimizers
        checkpoint = checkpoint["optimizer_state_dict"]
    if not isinstance(checkpoint, dict) or "state" not in checkpoint or "param_groups" not in checkpoint:
        raise ValueError("not a DeepSpeed optimizer state: expected a dict with 'state' and 'param_groups' (or an"
                         " engine checkpoint / fp16 wrapper around one)")
    return checkpoint


def deepspeed_kind(state_dict: dict) -> str:
    """``"OneBitAdam"``, ``"OneBitLamb"`` or ``"ZeroOneAdam"``: which DeepSpeed optimizer saved it."""
    states = [s for s in _unwrap(state_dict)["state"].values() if s]
    if not states:
        raise ValueError("the DeepSpeed optimizer state is empty (saved before the first step)")
    keys = set(states[0])
    if "lamb_coeff_freeze" in keys:
        return "OneBitLamb"
    if {"var_interval", "local_step_interval", "momentum_accumulator"} & keys:
        return "ZeroOneAdam"
    if {"exp_avg", "exp_avg_sq", "step"} <= keys and _SIZES & keys:
        return "OneBitAdam"
    if {"exp_avg", "exp_avg_sq", "step"} <= keys:
        raise ValueError("this looks like a torch Adam/AdamW state, not one of DeepSpeed's 1-bit optimizers: load it"
                         " with optimizer.load_state_dict(), which continues from AdamW's moments")
    raise ValueError(f"not a state of DeepSpeed's 1-bit optimizers (per-parameter keys: {sorted(keys)})")


def _per_parameter(sd: dict, optimizer: OneBitOptimizer) -> list[tuple[torch.nn.Parameter, dict]]:
    """``(parameter, its DeepSpeed state)`` in order, the fused fp16 layout split back per parameter."""
    saved_groups, groups = sd["param_groups"], optimizer.param_groups
    if len(saved_groups) != len(groups):
        raise ValueError(f"the DeepSpeed state has {len(saved_groups)} parameter group(s), this optimizer"
                         f" {len(groups)}: build it with the same groups, in the same order")
    out = []
    for g, (saved, group) in enumerate(zip(saved_groups, groups)):
        ids, params = list(saved["params"]), list(group["params"])
        states = [sd["state"].get(i) or {} for i in ids]
        if len(ids) == len(params):
            for p, st in zip(params, states):
                if st and st["exp_avg"].numel() != p.numel():
                    raise ValueError(f"group {g}: a DeepSpeed moment has {st['exp_avg'].numel()} elements, its"
                                     f" parameter {tuple(p.shape)}: not the same model")
                out.append((p, st))
        elif len(ids) == 1 and states[0] and states[0]["exp_avg"].numel() == sum(p.numel() for p in params):
            flat = states[0]  # the fused fp16 optimizer: one flat tensor per group, in parameter order
            sizes = [p.numel() for p in params]
            pieces = {k: torch.split(flat[k].reshape(-1), sizes) for k in ("exp_avg", "exp_avg_sq")}
            for n, p in enumerate(params):
                out.append((p, {**flat, **{k: v[n] for k, v in pieces.items()}}))
        else:
            raise ValueError(f"group {g}: the DeepSpeed state has {len(ids)} entr(ies), this optimizer {len(params)}"
                             " parameter(s), and no flat layout matches their sizes: not the same model")
    return out


def load_deepspeed_state(optimizer: OneBitOptimizer, checkpoint: dict) -> int:
    """Seed ``optimizer`` (an :class:`~hf_onebit.OneBitAdam` or :class:`~hf_onebit.OneBitLamb` over
    the same parameters, in the same groups and order as DeepSpeed's) with a DeepSpeed checkpoint's
    moments; returns the number of updates it continues after (DeepSpeed's step minus one).

    ``checkpoint``: ``torch.load`` of ``mp_rank_00_model_states.pt``, or its ``["optimizer"]``.
    Call it before :func:`hf_onebit.attach`, on every rank (every rank reads the same file). The
    hyperparameters stay the optimizer's own: build it from ``hf-onebit from-deepspeed``'s output
    so the freeze falls where DeepSpeed's did. Error buffers start at zero, as DeepSpeed's did.
    """
    sd = _unwrap(checkpoint)
    kind = deepspeed_kind(sd)
    if kind == "ZeroOneAdam":
        raise ValueError("a DeepSpeed 0/1 Adam state is not loaded: its variance and sync schedules run on DeepSpeed's"
                         " one-ahead step counter (they would not line up here) and its local accumulator was rank 0's"
                         f" only; {_RESTART}")
    if kind != type(optimizer).__name__:
        raise ValueError(f"the checkpoint is DeepSpeed's {kind}, the optimizer hf_onebit.{type(optimizer).__name__}:"
                         f" build hf_onebit.{kind}")
    pairs = _per_parameter(sd, optimizer)
    steps = max(int(st["step"]) for _, st in pairs if st)
    adam = {"state": {}, "param_groups": [{"params": list(range(len(pairs)))}]}
    for i, (p, st) in enumerate(pairs):
        if st:
            adam["state"][i] = {"step": max(steps - 1, 0), "exp_avg": st["exp_avg"].reshape(p.shape),
                                "exp_avg_sq": st["exp_avg_sq"].reshape(p.shape)}
    optimizer.load_state_dict(adam)  # torch Adam's layout: saved_state.import_adam_state
    if kind == "OneBitLamb":
        for p, st in pairs:
            if not st:
                continue
            state = optimizer.state[p]
            state["coeff_frozen"].fill_(float(st["lamb_coeff_freeze"]))
            state["last_factor"].fill_(float(st["last_factor"]))
            if "scaling_coeff" in st:
                state["scaling"].fill_(float(st["scaling_coeff"]))
            if "exp_avg_sq_fresh" in st and not optimizer.fresh_trust_ratio:  # only the frozen ratio reads it
                state["exp_avg_sq_fresh"].copy_(st["exp_avg_sq_fresh"].reshape(p.shape))
    return optimizer.steps_done
