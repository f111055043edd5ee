"""FSDP2: the 1-bit exchange between replicas of a model sharded with ``fully_shard``.

Layout. ``W`` ranks form ``R`` replicas of ``S`` ranks each (``W = R·S``; a replica is
typically a node). The model is sharded with ``fully_shard`` over the 1-D mesh of the ``S``
ranks of its replica (:func:`replica_mesh` builds it), so inside a replica FSDP all-gathers
parameters and reduce-scatters gradients in full precision, over the fast link. After the
reduce-scatter, rank ``j`` of every replica holds the replica's mean gradient of the same shard
``j``; hf_onebit then exchanges that shard between the ``R`` replicas (the ranks ``j, S+j,
2S+j, ...``) by the optimizer's plan: 1 bit with error feedback in the compression phases, full
precision in the warmup, nothing on 0/1 Adam's local steps, BinSGDM's vote. With ``S = 1``
every rank holds the whole model and the exchange is DDP's (DDP's layout on FSDP2, with one
buffer per FSDP module in place of DDP's buckets); with ``S > 1`` it is hybrid sharding (HSDP)
with a 1-bit exchange between nodes::

    replica 0 (node 0)            replica 1 (node 1)
    rank 0: shard 0  <-- 1 bit -->  rank 2: shard 0
    rank 1: shard 1  <-- 1 bit -->  rank 3: shard 1
      ^ reduce-scatter fp32 ^         ^ reduce-scatter fp32 ^

The hook point is FSDP2's public :meth:`FSDPModule.set_all_reduce_hook`: with a mesh of one
dimension FSDP calls it with the reduce-scatter's output (the rank's shard of every gradient of
that FSDP module, each padded on dim 0 to an equal share), before it turns that buffer into the
DTensor ``.grad``. hf_onebit exchanges the buffer in place, so ``.grad`` holds what DDP's hook
would leave there (the averaged gradient, or the averaged momentum after the freeze; see
:mod:`hf_onebit.hook`). The optimizer steps on each parameter's local shard (a plain tensor that
shares the DTensor's storage), so its maths, kernels and per-rank state are those of the DDP
path.

Why not ``replicate`` (``torch.distributed._composable.replicate_with_fsdp``) or FSDP2's own
HSDP (a 2-D mesh): their replica all-reduce runs in full precision inside FSDP, and the public
API offers no way to replace it. The all-reduce hook runs *after* it, and
``set_requires_all_reduce(False)`` keeps the shard inside FSDP for a later all-reduce, leaving
``.grad`` unset (checked with torch 2.13). ``attach`` refuses both and names this layout.

With ``S > 1`` what is judged on whole tensors sums (or maximises) each rank's per-tensor figures
over its replica: the automatic freeze's statistics (one small all-reduce per check) and 1-bit
LAMB's norms, factors and momentum scalings (at most two small all-reduces per step, and one copy
of the rank's shards for the directions held meanwhile).

Checkpoints: :mod:`hf_onebit.sharded_checkpoint` writes the optimizer state as a distributed
checkpoint, finding each local shard's DTensor and name through :class:`FSDPHookState`'s
``owners`` and ``names``. Not built yet (user guide: API reference, "With FSDP2"): a loss scaler, FSDP's CPU offload and
fp16 reduction, Shard(dim > 0) placements.
"""

from __future__ import annotations

import functools
import pickle
from dataclasses import dataclass
from typing import Any, Optional

import torch
import torch.distributed as dist

from hf_onebit.comm.compat import all_gather_bytes
from hf_onebit.hook.attach_checks import (UnsupportedSetup, check_params_match, check_same_on_every_rank, create_node_groups,
                                         run_self_test)
from hf_onebit.hook.state import OneBitHookState
from hf_onebit.optim import OneBitOptimizer

try:  # torch >= 2.6
    from torch.distributed.fsdp import FSDPModule
except ImportError:  # pragma: no cover - torch without FSDP2
    FSDPModule = None
try:
    from torch.distributed._composable.replicate_with_fsdp import ReplicateModule
except ImportError:  # pragma: no cover - torch without replicate_with_fsdp
    ReplicateModule = ()

_LAYOUT = (" Shard the model over the ranks of one replica and replicate across: mesh ="
           " hf_onebit.replica_mesh(shard_size); fully_shard(model, mesh=mesh['shard']) (shard_size=1: every"
           " rank holds the whole model, as with DDP).")


def is_fsdp(model: Any) -> bool:
    """Whether ``model`` was sharded with FSDP2's ``fully_shard`` (or ``replicate``, which builds on it)."""
    return FSDPModule is not None and isinstance(model, FSDPModule)


def replica_mesh(shard_size: int, device_type: Optional[str] = None):
    """The 2-D device mesh ``("replicate", "shard")`` of ``world_size // shard_size`` replicas of
    ``shard_size`` consecutive ranks (a node: ``shard_size = LOCAL_WORLD_SIZE``). Shard the model
    with ``fully_shard(model, mesh=mesh["shard"])``; hf_onebit exchanges between replicas."""
    from torch.distributed.device_mesh import init_device_mesh

    world = dist.get_world_size()
    if not isinstance(shard_size, int) or isinstance(shard_size, bool) or shard_size < 1 or world % shard_size:
        raise ValueError(f"hf_onebit.replica_mesh: shard_size must be a positive divisor of the world size {world},"
                         f" got {shard_size!r}")
    device_type = device_type or ("cuda" if torch.cuda.is_available() else "cpu")
    return init_device_mesh(device_type, (world // shard_size, shard_size), mesh_dim_names=("replicate", "shard"))


# --------------------------------------------------------------------------- one FSDP module's shard
@dataclass
class _ShardLayout:
    """Where each parameter of one FSDP module sits in its reduce-scatter output on this rank.

    FSDP pads every gradient on dim 0 to a multiple of ``S`` and gives each rank an equal share
    (``padded``), of which the first ``local.numel()`` elements are the rank's shard.
    """

    module: str
    fsdp_params: list  # FSDP's own records, to notice a parameter replaced after attach
    locals: list  # the local shards, in the buffer's order (what the optimizer steps on)
    offsets: list
    padded_numel: int

    def views(self, buffer: torch.Tensor) -> list:
        return [buffer[o: o + t.numel()].view(t.shape) for t, o in zip(self.locals, self.offsets)]

    def check_current(self) -> None:
        for fp, local in zip(self.fsdp_params, self.locals):
            if fp.sharded_param._local_tensor is not local:
                raise RuntimeError(
                    f"hf_onebit: a parameter of FSDP module {self.module!r} was replaced after hf_onebit.attach"
                    " (model.to(), load_state_dict(assign=True)): the optimizer would step on the old tensor."
                    " Move or load the model first, then build the optimizer and attach."
                )


def _fsdp_states(model) -> list:
    """``(name, module, param_group)`` for every FSDP module with parameters of its own."""
    out = []
    for name, module in model.named_modules():
        if not is_fsdp(module):
            continue
        if isinstance(module, ReplicateModule):
            raise UnsupportedSetup(
                "hf_onebit.attach: torch's replicate() (replicate_with_fsdp) all-reduces gradients in full precision"
                " inside FSDP, and FSDP2's public API cannot replace that all-reduce." + _LAYOUT)
        # FSDP2's records of the module's parameters (private; torch 2.13): the hook needs their
        # order and padding in the reduce-scatter output, which the public API does not expose.
        groups = module._get_fsdp_state()._fsdp_param_groups
        if len(groups) > 1:
            raise UnsupportedSetup(f"hf_onebit.attach: FSDP module {name or '<root>'!r} has several parameter groups"
                                   " (a per-parameter mesh via shard_placement_fn); one mesh per module is supported.")
        if groups:
            out.append((name or "<root>", module, groups[0]))
    return out


def _layout(name: str, group) -> _ShardLayout:
    trained, offsets, locals_, offset = [], [], [], 0
    if group.gradient_divide_factor is not None or group.force_sum_reduction_for_comms:
        raise UnsupportedSetup(f"hf_onebit.attach: FSDP module {name!r} sets a gradient divide factor or sum"
                               " reduction; hf_onebit needs FSDP's mean over the replica's ranks.")
    for fp in group.fsdp_params:
        if not fp.sharded_param.requires_grad:  # frozen: FSDP leaves it out of the reduce-scatter
            continue
        placement = getattr(fp, "fsdp_placement", None)
        if placement is not None and getattr(placement, "dim", 0) != 0:
            raise UnsupportedSetup(f"hf_onebit.attach: FSDP module {name!r} shards a parameter on dim {placement.dim};"
                                   " only the default Shard(0) is supported.")
        if fp.offload_to_cpu:
            raise UnsupportedSetup("hf_onebit.attach: FSDP's CPU offload is not supported.")
        reduced = group.mp_policy.reduce_dtype or group.mp_policy.param_dtype or fp.sharded_param.dtype
        if reduced != torch.float32 or fp.sharded_param.dtype != torch.float32:
            raise UnsupportedSetup(
                f"hf_onebit.attach: FSDP module {name!r} has {fp.sharded_param.dtype} parameters reduced in {reduced};"
                " with FSDP2 hf_onebit supports fp32 parameters and reduction for now (a MixedPrecisionPolicy with"
                " param_dtype=bfloat16 and reduce_dtype=float32 is fine).")
        trained.append(fp)
        locals_.append(fp.sharded_param._local_tensor)
        offsets.append(offset)
        offset += fp.padded_sharded_param_size.numel()
    return _ShardLayout(name, trained, locals_, offsets, offset)


# --------------------------------------------------------------------------- the hook state
class FSDPHookState(OneBitHookState):
    """:class:`OneBitHookState` whose "bucket" is one FSDP module's shard buffer and whose process
    group joins the ranks that hold the same shard in every replica (``None``: all ranks,
    ``S = 1``). ``shard_group``: the ranks of this rank's replica (``None`` for ``S = 1``)."""

    def __init__(self, optimizer: OneBitOptimizer, process_group, shard_group, grad_scaler: Any = None,
                 agree_group: Any = None) -> None:
        super().__init__(optimizer, process_group, grad_scaler)
        self.shard_group = shard_group
        #: the ranks of ``shard_group`` again, over gloo on the host: where :meth:`all_ranks_agree`
        #: reduces a verdict the host already holds, without waiting for the device
        self.agree_group = agree_group
        self.owners: list = []  # (local shard, its DTensor parameter), in the optimizer's order
        self.names: dict = {}  # id(local shard) -> its parameter's name in the model
        self.handles: list = []  # the optimizer's step hooks (lend and take back the gradients)

    @property
    def shard_size(self) -> int:
        return 1 if self.shard_group is None else dist.get_world_size(self.shard_group)

    def lend_grads(self, *_unused) -> None:
        """Before ``step()``: each local shard's ``.grad`` is its DTensor's (what FSDP wrote after the
        exchange, clipped or accumulated as the user's loop left it), so the optimizer reads exactly
        the gradient the user sees."""
        for local, param in self.owners:
            local.grad = None if param.grad is None else param.grad._local_tensor

    def take_back_grads(self, *_unused) -> None:
        """After ``step()``: the local shards hold no ``.grad`` of their own."""
        for local, _ in self.owners:
            local.grad = None

    def zero_grad(self, set_to_none: bool = True) -> None:
        """``optimizer.zero_grad()`` clears the model's DTensor gradients too: they are the ones
        FSDP accumulates into at the next backward."""
        for _, param in self.owners:
            if param.grad is not None:
                if set_to_none:
                    param.grad = None
                else:
                    param.grad.zero_()

    @property
    def sharded(self) -> bool:
        return self.shard_group is not None

    def sum_over_shards(self, t: torch.Tensor) -> torch.Tensor:
        if self.shard_group is not None:
            t = t.clone()
            dist.all_reduce(t, group=self.shard_group)
        return t

    def max_over_shards(self, t: torch.Tensor) -> torch.Tensor:
        if self.shard_group is not None:
            t = t.clone()
            dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.shard_group)
        return t

    def all_ranks_agree(self, ok):
        """Whether ``ok`` holds on every rank of this replica (each holds a different shard, so a
        check of its own gradients alone could stop one rank and leave the others waiting).

        ``ok`` a bool (the host has read it already, e.g. the finiteness guard's one read): the
        minimum over the replica is taken over :attr:`agree_group`, a gloo group of the same
        ranks, on a CPU tensor. The agreement therefore adds no host-to-device copy and does not
        wait for the device: an NCCL shard group would need the flag on the GPU, a copy there and
        a ``.item()`` back, that is a second and third host sync per step besides the guard's own.
        What gloo costs instead is one small message between the replica's ranks (a node).
        ``ok`` a tensor (a flag kept on the device): the minimum is taken in place over the shard
        group and returned, still on the device, so nothing waits.
        """
        if self.shard_group is None:
            return ok
        if isinstance(ok, torch.Tensor):
            dist.all_reduce(ok, op=dist.ReduceOp.MIN, group=self.shard_group)
            return ok
        if self.agree_group is None:  # no gloo in this torch build: through the device, with its syncs
            device = self.optimizer.params_in_order()[0].device  # an NCCL group reduces CUDA tensors only
            flag = torch.tensor([1 if ok else 0], dtype=torch.int32, device=device)
            dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=self.shard_group)
            return bool(flag.item())
        flag = torch.tensor([1 if ok else 0], dtype=torch.int32)
        dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=self.agree_group)
        return bool(flag[0])


def _exchange_shards(state: FSDPHookState, layout: _ShardLayout, reduce_output: torch.Tensor) -> None:
    """FSDP's all-reduce hook: run the step's plan on this module's shard buffer, in place.

    Runs inside backward (after FSDP's reduce-scatter, before it writes ``.grad``) and waits for
    the exchange: FSDP reads the buffer right after the hook returns.
    """
    if reduce_output.numel() != layout.padded_numel:
        raise RuntimeError(
            f"hf_onebit: FSDP module {layout.module!r} reduced {reduce_output.numel()} gradient elements on this rank,"
            f" {layout.padded_numel} expected: some of its parameters got no gradient this step. With FSDP2 every"
            " trainable parameter of a module must get a gradient at every step (freeze unused ones with"
            " requires_grad_(False) before fully_shard).")
    layout.check_current()
    result = state.reduce(layout.locals, reduce_output, layout.views(reduce_output)).wait()
    if result.data_ptr() != reduce_output.data_ptr():
        reduce_output.copy_(result)


def _replica_groups(shard_ranks: list, world: int):
    """From every rank's replica (its mesh's ranks): the ranks holding the same shard in each
    replica. Refuses meshes that are not a partition of the world into equal replicas."""
    replicas = sorted({tuple(r) for r in shard_ranks})
    size = len(replicas[0])
    if any(len(r) != size for r in replicas) or sorted(x for r in replicas for x in r) != list(range(world)):
        raise UnsupportedSetup(f"hf_onebit.attach: the FSDP meshes {replicas} do not split the {world} ranks into"
                               " replicas of equal size." + _LAYOUT)
    return [[r[j] for r in replicas] for j in range(size)], size


def _check_state_fits(optimizer: OneBitOptimizer, local_of: dict) -> None:
    """Refuse optimizer state cut for other shards (a checkpoint of another mesh or world size):
    stepping on it would fail in the middle of a step, or broadcast silently. Checked before the
    optimizer is changed, so a refusal leaves it as it was."""
    for i, p in enumerate(optimizer.params_in_order()):
        shard = local_of.get(id(p), p)
        for key, value in optimizer.state.get(p, {}).items():
            if isinstance(value, torch.Tensor) and value.numel() > 1 and value.shape != shard.shape:
                raise ValueError(
                    f"hf_onebit.attach: optimizer state {key!r} of parameter {i} has shape {tuple(value.shape)}, this"
                    f" rank's shard {tuple(shard.shape)}: the state was saved with another mesh or world size. Resume"
                    " with the layout it was saved with, or start the optimizer afresh.")


def attach_fsdp(model, optimizer: OneBitOptimizer, grad_scaler: Any = None) -> Optional[FSDPHookState]:
    """``hf_onebit.attach`` for a model sharded with FSDP2 (see the module docstring)."""
    if grad_scaler is not None:
        raise UnsupportedSetup("hf_onebit.attach: a loss scaler with FSDP2 is not supported yet; train in bf16 or fp32.")
    modules = _fsdp_states(model)
    if not modules:
        raise UnsupportedSetup("hf_onebit.attach: the FSDP2 model has no parameters managed by fully_shard.")
    meshes = {id(g.mesh_info.mesh): g.mesh_info.mesh for _, _, g in modules}
    if len(meshes) != 1:
        raise UnsupportedSetup("hf_onebit.attach: the model's FSDP modules use different meshes; one mesh is supported.")
    mesh = next(iter(meshes.values()))
    if mesh.ndim != 1:
        raise UnsupportedSetup(f"hf_onebit.attach: FSDP's native HSDP (a {mesh.ndim}-D mesh) all-reduces between"
                               " replicas in full precision, which hf_onebit cannot replace." + _LAYOUT)
    if isinstance(optimizer.hook_state, FSDPHookState):
        raise ValueError("hf_onebit.attach: this optimizer is already attached to an FSDP2 model (it steps on the"
                         " local shards now); with FSDP2 attach once, to a new optimizer built after fully_shard.")
    if any(not hasattr(p, "to_local") for p in optimizer.params_in_order()):
        raise ValueError("hf_onebit.attach: the optimizer holds plain tensors, not the model's FSDP2 (DTensor)"
                         " parameters: fully_shard replaces the parameters, so build the optimizer after it.")
    check_params_match(model, optimizer)
    world = dist.get_world_size()
    mine = pickle.dumps(sorted(int(r) for r in mesh.mesh.flatten().tolist()))
    device = optimizer.params_in_order()[0].device
    everyone = [pickle.loads(b) for b in all_gather_bytes(mine, device, None)]
    # Every rank built the same optimizer (checked on the whole parameters' shapes), before any
    # refusal that depends on it: a rank refusing alone would leave the others in a collective.
    check_same_on_every_rank(optimizer, None)
    replica_of, shard_size = _replica_groups(everyone, world)
    if shard_size == world:
        raise UnsupportedSetup(
            f"hf_onebit.attach: the model is sharded over all {world} ranks, so there is no replica to exchange with"
            " and nothing to compress (FSDP's own reduce-scatter carries all the traffic)." + _LAYOUT)
    if shard_size > 1 and optimizer.exchange.hierarchical:
        raise UnsupportedSetup("hf_onebit.attach: hierarchical=True with FSDP2: the replica's mesh already"
                               " keeps full precision inside a node; leave hierarchical off.")
    layouts = [_layout(name, group) for name, _, group in modules]
    # Frozen parameters too: the optimizer may hold them (they get no gradient, as on the DDP path).
    every = [fp.sharded_param for _, _, group in modules for fp in group.fsdp_params]
    local_of = {id(p): p._local_tensor for p in every}
    param_of = {id(p._local_tensor): p for p in every}
    _check_state_fits(optimizer, local_of)
    optimizer.replace_params(local_of)
    agree_group = None
    if shard_size == 1:
        cross, shard_group = None, None  # every rank is a replica: the world, as on the DDP path
    else:
        # Collective: every rank creates every subgroup, in the same order.
        cross, _ = dist.new_subgroups_by_enumeration(replica_of)
        shard_group = mesh.get_group()
        if dist.is_gloo_available():  # see FSDPHookState.all_ranks_agree
            replicas = [list(r) for r in sorted({tuple(r) for r in everyone})]
            agree_group, _ = dist.new_subgroups_by_enumeration(replicas, backend="gloo")
        # The exchange between replicas is flat: "auto" must not find a node layout in a group
        # that holds one rank per node.
        optimizer.exchange.hierarchical = False
    state = FSDPHookState(optimizer, cross, shard_group, agree_group=agree_group)
    state.owners = [(p, param_of[id(p)]) for p in optimizer.params_in_order() if id(p) in param_of]
    name_of = {id(p): name for name, p in model.named_parameters(remove_duplicate=False)}
    state.names = {id(local): name_of[id(param)] for local, param in state.owners if id(param) in name_of}
    state.handles = [optimizer.register_step_pre_hook(state.lend_grads),
                     optimizer.register_step_post_hook(state.take_back_grads)]
    run_self_test(optimizer)
    create_node_groups(optimizer)  # shard_size 1 with hierarchical: the exchange by node, as with DDP
    for layout, (_, module, _) in zip(layouts, modules):
        module.set_all_reduce_hook(functools.partial(_exchange_shards, state, layout))
    if dist.get_rank() == 0:
        from hf_onebit.optim.base import logger

        logger.warning("hf_onebit %s on FSDP2: %d replicas of %d rank(s); %s between replicas",
                       type(optimizer).__name__, world // shard_size, shard_size,
                       "the DDP exchange" if shard_size == 1 else "shards exchanged by the optimizer's plan")
    return state
