"""What ``attach`` checks and prepares before it pairs an optimizer with a model, on the DDP path and
the FSDP2 path alike (:mod:`hf_onebit.hook.attach`, :mod:`hf_onebit.hook.fsdp`).

Each check runs at attach time, so a mismatch is an error there rather than a deadlock or a
silent divergence hours later.
"""

import pickle
from typing import Any, Optional

import torch

from hf_onebit.comm import runs_inline
from hf_onebit.comm.compat import all_gather_bytes
from hf_onebit.kernels.selftest import self_test
from hf_onebit.optim import BinSGDM, OneBitOptimizer
from hf_onebit.optim.base import logger
from hf_onebit.refusals import check_sparse


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
    nodes = optimizer.nodes()
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
        "hierarchical": optimizer.hierarchical,
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
