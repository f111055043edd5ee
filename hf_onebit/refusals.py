"""What the hook cannot serve, refused before any step runs, with the fix.

These checks see only the DDP model and the optimizer, so :func:`hf_onebit.attach` runs them for
every user; the integrations (:mod:`hf_onebit.integrations.checks`) run them earlier too, before
a Trainer or Accelerate wraps the model, and add what only they can see (launchers, FSDP flags).
Each raises :class:`UnsupportedSetup`, a ``ValueError``.
"""

from __future__ import annotations

import torch

from hf_onebit.comm import runs_inline


class UnsupportedSetup(ValueError):
    """A training setup hf_onebit refuses to run."""


def check_sparse(module: torch.nn.Module) -> None:
    """Refuse modules that produce sparse gradients (``nn.Embedding(sparse=True)``)."""
    names = [n or type(m).__name__ for n, m in module.named_modules() if getattr(m, "sparse", False) is True]
    if names or any(p.is_sparse for p in module.parameters()):
        raise UnsupportedSetup(
            f"hf_onebit does not support sparse gradients (modules with sparse=True: {names[:3]}): the 1-bit"
            " all-reduce works on dense gradient buckets. Build the embedding with sparse=False, or train"
            " with a standard optimizer (--optim adamw_torch)."
        )


def check_find_unused(ddp) -> None:
    """Refuse ``DistributedDataParallel(find_unused_parameters=True)`` with CPU parameters (gloo).

    With it, DDP all-reduces its map of used parameters from the autograd thread during
    backward, while hf_onebit's gloo communication thread runs the gradient buckets' collectives
    on the same process group; gloo then pairs the two in different orders on different ranks
    and aborts ("Received data size doesn't match expected size"). (NCCL runs hf_onebit's
    collectives on the autograd thread itself, in one order.)
    """
    if not getattr(ddp, "find_unused_parameters", False):
        return
    # By the parameters' device, as hf_onebit chooses its executor (the backend's name may be
    # "undefined" or "cuda:nccl,cpu:gloo"): CPU buckets go through the communication thread.
    if not torch.distributed.is_initialized():
        return
    if all(runs_inline(p.device) for p in ddp.module.parameters() if p.requires_grad):
        return
    raise UnsupportedSetup(
        "hf_onebit on CPU (gloo) does not support DistributedDataParallel(find_unused_parameters=True): DDP's"
        " own all-reduce of the used-parameter map would race with hf_onebit's communication thread. Build DDP"
        " with find_unused_parameters=False: --ddp_find_unused_parameters false (Trainer),"
        " DistributedDataParallelKwargs(find_unused_parameters=False) (Accelerate); if the model really has"
        " parameters without gradients, freeze them (requires_grad=False) so DDP does not wait for them."
    )
