"""What ``attach`` checks and refuses before it pairs an optimizer with a model, on the DDP path and
the FSDP2 path alike (:mod:`hf_onebit.hook.attach`, :mod:`hf_onebit.hook.fsdp`).

Each check runs at attach time, so a mismatch is an error there rather than a deadlock or a
silent divergence hours later. The refusals of what the hook cannot serve (sparse gradients,
``find_unused_parameters`` on gloo, compiled autograd) need only the DDP model, so the
integrations (:mod:`hf_onebit.integrations.checks`) run them earlier too, before a Trainer or
Accelerate wraps the model; each raises :class:`UnsupportedSetup`, a ``ValueError``, with the fix.
"""

from __future__ import annotations

import pickle
import sys
from typing import Any, Optional

import torch

from hf_onebit.comm import runs_inline
from hf_onebit.comm.compat import all_gather_bytes
from hf_onebit.kernels.selftest import self_test
from hf_onebit.optim import BinSGDM, OneBitOptimizer
from hf_onebit.optim.base import logger


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


def check_params_match(module: torch.nn.Module, optimizer: OneBitOptimizer) -> None:
    """The optimizer holds every trainable parameter of ``module`` and nothing else."""
    opt_params = optimizer.params_in_order()
    opt_ids = {id(p) for p in opt_params}
    missing = [n for n, p in module.named_parameters() if p.requires_grad and id(p) not in opt_ids]
    if missing:
        raise ValueError(
            f"hf_onebit.attach: {len(missing)} trainable parameter(s) of the model are not in the"
            f" optimizer (first: {missing[:3]}); the hook must see every bucket's parameters in the optimizer"
        )
    # Frozen parameters of the model (requires_grad=False) may stay in the optimizer, as with
    # torch optimizers: they get no gradient, so step() leaves them and their state alone. This is
    # how parameters are frozen mid-run: change requires_grad, re-wrap in DDP, attach again.
    module_ids = {id(p) for p in module.parameters()}
    if any(id(p) not in module_ids for p in opt_params):
        raise ValueError("hf_onebit.attach: the optimizer holds parameters that are not parameters of the model")
    check_sparse(module)


def run_self_test(optimizer: OneBitOptimizer) -> None:
    """Triton compiles on first use: do it now, checked against the reference, not in the first
    compressing backward hours from here (where a failure would read as a dead peer)."""
    for device, dtype in sorted({(p.device, d) for p in optimizer.params_in_order() if runs_inline(p.device)
                                 for d in (p.dtype, torch.float32)}, key=str):
        self_test(device, dtype)


def create_node_groups(optimizer: OneBitOptimizer) -> None:
    """The exchange by node: every rank creates every subgroup, in the same order, here and not
    inside a backward pass (a collective)."""
    nodes = optimizer.exchange.nodes()
    if nodes is None:
        return
    nodes.create_groups()
    if optimizer.rank == 0:
        inside = ("every rank's votes gathered inside a node" if isinstance(optimizer, BinSGDM)
                  else "full precision inside a node")
        logger.warning(
            "hf_onebit %s: exchange by node, %d nodes of %d ranks: %s, 1 bit between nodes",
            type(optimizer).__name__, nodes.nodes, nodes.local_size, inside,
        )


def _first_difference(a: Any, b: Any, path: str = "") -> Optional[str]:
    if isinstance(a, dict) and isinstance(b, dict):
        for key in list(a) + [k for k in b if k not in a]:
            if key not in a or key not in b:
                return f"{path}{key}"
            found = _first_difference(a[key], b[key], f"{path}{key}.")
            if found:
                return found
        return None
    if isinstance(a, list) and isinstance(b, list):
        if len(a) != len(b):
            return f"{path}<length {len(a)} vs {len(b)}>"
        for i, (x, y) in enumerate(zip(a, b)):
            found = _first_difference(x, y, f"{path}{i}.")
            if found:
                return found
        return None
    return None if a == b else path.rstrip(".")


def _lookup(tree: Any, path: str) -> Any:
    for part in path.split("."):
        if part.startswith("<"):
            return None
        tree = tree[int(part)] if isinstance(tree, list) else tree.get(part) if isinstance(tree, dict) else None
    return tree


def _fingerprint(optimizer: OneBitOptimizer) -> dict:
    """What must be identical on every rank: class, hyperparameters, counters, parameter shapes."""
    return {
        "optimizer": type(optimizer).__name__,
        "hierarchical": optimizer.exchange.hierarchical,
        "global": optimizer.global_state(),
        "param_groups": [
            {k: (list(v) if isinstance(v, tuple) else v) for k, v in g.items() if k != "params"}
            for g in optimizer.param_groups
        ],
        "params": [[list(p.shape), str(p.dtype)] for p in optimizer.params_in_order()],
    }


def check_same_on_every_rank(optimizer: OneBitOptimizer, group) -> None:
    """Refuse ranks built differently (hyperparameters, counters, shapes): they would deadlock
    or silently diverge. One small all-gather at attach time."""
    device = optimizer.params_in_order()[0].device
    everyone = [pickle.loads(b) for b in all_gather_bytes(pickle.dumps(_fingerprint(optimizer)), device, group)]
    for rank, theirs in enumerate(everyone):
        where = _first_difference(everyone[0], theirs)
        if where is not None:
            raise ValueError(
                f"hf_onebit.attach: rank {rank} differs from rank 0 in {where!r}:"
                f" {_lookup(theirs, where)!r} vs {_lookup(everyone[0], where)!r}. Every rank must build the"
                " same optimizer (same hyperparameters, same parameter shapes) and load the same checkpoint."
            )
