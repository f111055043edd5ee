"""``attach``: pair an hf_onebit optimizer with a DDP model by registering the hook (an FSDP2
model goes to :func:`hf_onebit.hook.fsdp.attach_fsdp`).

Checks first (:mod:`hf_onebit.hook.attach_checks`) that both manage the same parameters, that
nothing unsupported is in use, and that every rank built the same optimizer (one small
all-gather), so a mismatch is an error at attach time rather than a deadlock or a silent
divergence hours later.
"""

# No `from __future__ import annotations` here: DDP checks the hook's annotations at runtime.
from typing import Any, Optional

from torch.nn.parallel import DistributedDataParallel

from hf_onebit.hook.attach_checks import (check_compiled_autograd, check_find_unused, check_params_match,
                                         check_same_on_every_rank, create_node_groups, run_self_test)
from hf_onebit.hook.fsdp import attach_fsdp, is_fsdp
from hf_onebit.hook.state import OneBitHookState, onebit_hook
from hf_onebit.optim import OneBitOptimizer
from hf_onebit.optim.base import logger


def attach(
    ddp_model: DistributedDataParallel,
    optimizer: OneBitOptimizer,
    grad_scaler: Any = None,
) -> Optional[OneBitHookState]:
    """Register the communication hook that pairs ``optimizer`` with ``ddp_model``.

    Checks that both manage the same parameters and that nothing unsupported is in use. With a
    world size of 1 nothing needs communicating: no hook is registered and the optimizer runs
    uncompressed (logged once). DDP allows one hook per model, so call this once.

    Args:
        ddp_model: the model wrapped in :class:`~torch.nn.parallel.DistributedDataParallel`.
        optimizer: an hf_onebit optimizer over the model's parameters.
        grad_scaler: the ``torch.amp.GradScaler`` used for fp16 training, if any: the hook
            unscales gradients before mixing them into optimizer state.
    """
    if not isinstance(optimizer, OneBitOptimizer):
        raise TypeError(f"hf_onebit.attach needs an hf_onebit optimizer, got {type(optimizer).__name__}")
    if is_fsdp(ddp_model):
        return attach_fsdp(ddp_model, optimizer, grad_scaler)
    if not isinstance(ddp_model, DistributedDataParallel):
        raise TypeError(
            f"hf_onebit.attach needs a torch.nn.parallel.DistributedDataParallel model or one sharded with FSDP2's"
            f" fully_shard, got {type(ddp_model).__name__}. FSDP1, DeepSpeed ZeRO and tensor/pipeline parallelism"
            " are not supported: use DDP, or FSDP2 as hf_onebit.hook.fsdp describes."
        )
    check_params_match(ddp_model.module, optimizer)
    state = OneBitHookState(optimizer, ddp_model.process_group, grad_scaler)  # becomes optimizer.hook_state
    if optimizer.world_size == 1:
        logger.warning("hf_onebit: world size is 1, nothing to communicate: %s runs uncompressed", type(optimizer).__name__)
        return None
    check_find_unused(ddp_model)
    check_compiled_autograd(ddp_model)
    run_self_test(optimizer)
    check_same_on_every_rank(optimizer, ddp_model.process_group)
    create_node_groups(optimizer)
    ddp_model.register_comm_hook(state, onebit_hook)
    return state
