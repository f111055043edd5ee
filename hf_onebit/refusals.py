"""What the hook cannot serve, refused before any step runs, with the fix.

These checks see only the DDP model and the optimizer, so :func:`hf_onebit.attach` runs them for
every user; the integrations (:mod:`hf_onebit.integrations.checks`) run them earlier too, before
a Trainer or Accelerate wraps the model, and add what only they can see (launchers, FSDP flags).
Each raises :class:`UnsupportedSetup`, a ``ValueError``.
"""

from __future__ import annotations

import sys

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


def check_compiled_autograd(ddp) -> None:
    """Refuse DDP's Python reducer (``torch._dynamo.config.optimize_ddp = "python_reducer"``) and
    compiled autograd (``torch._dynamo.config.compiled_autograd = True``).

    A DDP model built while ``optimize_ddp`` is ``"python_reducer"`` (checked: torch 2.13,
    ``DistributedDataParallel._use_python_reducer``) does not hand buckets to the communication
    hook: a post-accumulate-grad hook on every parameter calls it as ``hook(state, (grad, param))``,
    one parameter at a time, which hf_onebit's hook cannot serve (the 1-bit exchange needs DDP's
    buckets and its per-step protocol); the first backward would fail with
    ``AttributeError: 'tuple' object has no attribute 'parameters'``, with or without compiled
    autograd. DDP's C++ reducer, which does call the hook with buckets, refuses compiled autograd
    itself at the first backward ("Compiled autograd is not compatible with C++ DDP Reducer"), and
    its advice, the Python reducer, is the case above; so compiled autograd turned on when the hook
    is attached is refused here, at attach time. ``torch.compile`` of the model without compiled
    autograd (``optimize_ddp`` True, the default) works: the backward runs DDP's C++ reducer.
    """
    # Either setting lives in torch._dynamo's config: where nothing imported torch._dynamo (a slow
    # import), nothing set it, so it is read only from an already imported module.
    dynamo = sys.modules.get("torch._dynamo")
    used = getattr(ddp, "_use_python_reducer", None)  # what DDP chose when it was built
    if used is None and dynamo is not None:  # a torch without the attribute: the mode now
        used = dynamo.utils.get_optimize_ddp_mode() == "python_reducer"
    python_reducer = bool(used)
    compiled_autograd = dynamo is not None and bool(getattr(dynamo.config, "compiled_autograd", False))
    if not (python_reducer or compiled_autograd):
        return
    what = ("this DistributedDataParallel model was built while torch._dynamo.config.optimize_ddp was"
            " 'python_reducer': DDP then calls the communication hook once per parameter with (grad, param)"
            " instead of once per gradient bucket" if python_reducer else
            "torch._dynamo.config.compiled_autograd is True: DDP's C++ reducer, which hands the communication"
            " hook its gradient buckets, refuses compiled autograd, and the Python reducer torch suggests"
            " instead calls the hook once per parameter with (grad, param)")
    raise UnsupportedSetup(compiled_autograd_message(what))


def compiled_autograd_message(what: str) -> str:
    return (
        f"hf_onebit does not support compiled autograd or DDP's Python reducer ({what}); hf_onebit's 1-bit"
        " exchange needs DDP's buckets. Keep torch._dynamo.config.optimize_ddp = True (the default,"
        " 'ddp_optimizer') and compiled autograd off (torch._dynamo.config.compiled_autograd = False, no"
        " torch._dynamo.compiled_autograd.enable(...)), then build the DistributedDataParallel model:"
        " torch.compile of the model (--torch_compile) works that way."
    )
