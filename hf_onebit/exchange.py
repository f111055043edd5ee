"""The exchange: everything one optimizer puts on the wire, owned in one place.

An optimizer says what a step needs from the network (a :class:`Plan`) and does its maths; its
:class:`Exchange`, in the shape of PyTorch's ``PowerSGDState``, owns the rest:

* the compression segments (:mod:`hf_onebit.comm.segments`): error-feedback state per group of
  parameters, each with the compressed all-reduce of its width, flat or by node;
* the node layout of the exchange by node, decided alike on every rank;
* the byte and round counters (:mod:`hf_onebit.comm.stats`), cumulative and per step;
* BinSGDM's vote collective (:mod:`hf_onebit.comm.vote`).

The DDP communication hook (:mod:`hf_onebit.hook`) runs each bucket's plan through it; when
attached, the hook state is the exchange's :attr:`~Exchange.hook_state`, which brings the process
group and the loss scaler.

Layers, one way: ``kernels -> comm -> exchange -> optim -> hook -> integrations``. No module of
:mod:`hf_onebit.optim` imports :mod:`hf_onebit.comm`. What crosses between an optimizer and the
network side:

====================================================  ===========================  ==========================
call                                                  who, when                    what for
====================================================  ===========================  ==========================
``Exchange(...)``, ``end_step(restart_errors)``       optimizer: built, each step  commit errors, count bytes
``covering_all``, ``sync_async(segment, t)``          0/1 Adam, a sync step        the exchange in ``step()``
``vote_collective()``, ``submit``, ``all_finite``     BinSGDM, each bucket         its vote
``state_dict``, ``load_state_dict``, ``nodes()``      per-rank checkpoints         error buffers, layout
``plan()``, ``prepare_bucket``, ``finish_bucket``     hook -> optimizer, a bucket  what a bucket sends
``hook_state.covered``, ``hook_state.*_over_shards``  guards, FSDP2                hook memory, shard sums
====================================================  ===========================  ==========================
"""

from __future__ import annotations

import enum
import logging
from typing import Any, Callable

import torch
import torch.distributed as dist

from hf_onebit.comm import CommRecord, CommStats, CompressedAllReduce, executor_for
from hf_onebit.comm.allreduce import finite_flag
from hf_onebit.comm.failures import with_failure_context
from hf_onebit.comm.hierarchical import HierarchicalCompressedAllReduce
from hf_onebit.comm.segments import Segment, SegmentRegistry
from hf_onebit.comm.topology import NodeTopology, check_same_local_world_size, node_topology
from hf_onebit.comm.vote import VoteAllGather

logger = logging.getLogger("hf_onebit")


class Plan(str, enum.Enum):
    """What one optimizer step needs from the network (the table is in :mod:`hf_onebit.hook`)."""

    ALLREDUCE = "allreduce"
    QUANTIZE_GRADIENT = "quantize_gradient"
    COMPRESS_MOMENTUM = "compress_momentum"
    COMPRESS_GRADIENT = "compress_gradient"
    LOCAL = "local"
    SYNC_AFTER_STEP = "sync_after_step"
    VOTE = "vote"


class Exchange:
    """The wire side of one optimizer: segments, error feedback, node layout, counters.

    Args:
        owner: the optimizer's class name, for messages.
        params: returns the optimizer's parameters in order (called when a segment is built:
            FSDP2's attach replaces parameters by their local shards).
        hierarchical: ``True``: the exchange by node (``ValueError`` at construction when
            ``LOCAL_WORLD_SIZE`` gives no layout); ``None``: by node exactly where there is a
            layout; ``False``: flat.
        scale_per_tensor: one compression scale per parameter tensor of a segment.
        scale_block: at most this many elements per compression scale (``None``: no limit).
        separate_coded_errors: the b-bit exchange keeps error buffers apart from the 1-bit one's
            (where the two alternate on the same segments: 0/1 Adam's variance phase).
    """

    def __init__(self, owner: str, params: Callable[[], list[torch.Tensor]], *, hierarchical: bool | None = False,
                 scale_per_tensor: bool = False, scale_block: int | None = None,
                 separate_coded_errors: bool = False) -> None:
        if hierarchical is not None and not isinstance(hierarchical, bool):
            raise TypeError(f"{owner}: hierarchical must be True, False or None (auto), got {hierarchical!r}")
        self.owner = owner
        self._params = params
        self.hierarchical = hierarchical
        self.scale_per_tensor = bool(scale_per_tensor)
        self.scale_block = scale_block
        self.separate_coded_errors = separate_coded_errors
        self.stats = CommStats()
        #: what the last completed step sent (see :meth:`end_step`)
        self.last_step = CommRecord()
        self._at_last_step = CommRecord()
        self.segments = SegmentRegistry(self._new_compressor)
        #: the hook state (:class:`hf_onebit.hook.OneBitHookState`) once attached, else ``None``
        self.hook_state: Any = None
        self._nodes: NodeTopology | None | bool = False  # False: not decided yet (see nodes())
        self._vote: VoteAllGather | None = None
        if hierarchical and dist.is_initialized():
            self._node_layout(dist.get_world_size(), None)  # an impossible layout is refused at construction

    # ---------------------------------------------------------------- the group
    @property
    def process_group(self) -> dist.ProcessGroup | None:
        """The attached model's process group (``None``: not attached, the default group)."""
        return self.hook_state.process_group if self.hook_state is not None else None

    @property
    def world_size(self) -> int:
        return dist.get_world_size(self.process_group) if dist.is_initialized() else 1

    @property
    def rank(self) -> int:
        return dist.get_rank(self.process_group) if dist.is_initialized() else 0

    def nodes(self) -> NodeTopology | None:
        """The node layout of the exchange by node, or ``None`` for the flat exchange.

        Decided once, from ``LOCAL_WORLD_SIZE`` and the world size. Unless ``hierarchical=False``,
        the first call is collective (attach makes it on every rank): ranks that read different
        ``LOCAL_WORLD_SIZE`` values all raise ``ValueError``, as they would otherwise build
        different exchanges.
        """
        if self._nodes is False:
            if self.hierarchical is False or not dist.is_initialized() or self.world_size == 1:
                self._nodes = None
            else:
                params = self._params()
                device = params[0].device if params else torch.device("cpu")
                check_same_local_world_size(device, self.process_group, self.owner)
                self._nodes = self._node_layout(self.world_size, self.process_group)
        return self._nodes

    def _node_layout(self, world_size: int, group) -> NodeTopology | None:
        try:
            return node_topology(world_size, group)
        except ValueError as exc:
            if self.hierarchical:
                raise ValueError(f"{self.owner}(hierarchical=True): {exc}") from None
            return None

    # ---------------------------------------------------------------- jobs
    def submit(self, device: torch.device, job: Callable[[], Any]) -> torch.futures.Future:
        """Queue ``job`` on the ordered executor of the group and device: every collective of this
        exchange, the hook's and those inside ``step()``, is issued in one order on every rank."""
        return executor_for(self.process_group, device).submit(job)

    def in_context(self, t: int, plan: Plan, job: Callable[[], Any]) -> Callable[[], Any]:
        """``job``, whose failure says where it happened (rank, step, plan) and what to suspect."""
        return with_failure_context(
            job, lambda: f"hf_onebit {self.owner}: rank {self.rank} of {self.world_size}, step {t} (plan {plan.value})")

    def sync_async(self, seg: Segment, t: int) -> torch.futures.Future:
        """Compressed all-reduce of ``seg.work`` in place, for an exchange inside ``step()`` (0/1
        Adam's sync at step ``t``), ordered after the hook's jobs."""
        return self.submit(seg.device, self.in_context(t, Plan.SYNC_AFTER_STEP, lambda: seg.comm(seg.work)))

    # ---------------------------------------------------------------- compressors
    def _new_compressor(self, key: tuple[int, ...], device: torch.device) -> CompressedAllReduce:
        """The compressed all-reduce of a new segment over the parameters ``key``: flat, or by node."""
        sizes = self._param_sizes()
        piece_sizes = [sizes[i] for i in key] if self.scale_per_tensor else None
        options = dict(stats=self.stats, piece_sizes=piece_sizes, scale_block=self.scale_block,
                       separate_coded_errors=self.separate_coded_errors,
                       deferred_commit=self.hook_state is not None and self.hook_state.scaled)  # a loss scaler may skip the step
        numel = sum(sizes[i] for i in key)
        nodes = self.nodes()
        if nodes is not None:
            return HierarchicalCompressedAllReduce(numel, device, nodes, **options)
        return CompressedAllReduce(numel, device=device, group=self.process_group, **options)

    def covering_all(self, device: torch.device, cap_numel: int = 25 * 2**20 // 4) -> list[Segment]:
        """Segments covering every parameter, for an exchange inside ``step()`` (0/1 Adam's sync)."""
        return self.segments.covering_all(self._param_sizes(), device, cap_numel)

    def _param_sizes(self) -> list[int]:
        return [p.numel() for p in self._params()]

    def vote_collective(self) -> VoteAllGather:
        """BinSGDM's vote average over the group, by node where :meth:`nodes` gives a layout."""
        if self._vote is None:
            nodes = self.nodes()
            self._vote = VoteAllGather(self.process_group, self.world_size, nodes, self.stats)
            if nodes is not None and self.rank == 0:
                logger.info("hf_onebit %s: hierarchical votes, %d nodes of %d ranks", self.owner, nodes.nodes, nodes.local_size)
        return self._vote

    #: whether every element of a tensor is finite, as a 0-dim device bool (no host sync)
    all_finite = staticmethod(finite_flag)

    # ---------------------------------------------------------------- per step
    def end_step(self, restart_errors: bool = False) -> None:
        """After each optimizer step: commit the step's error buffers (``restart_errors``: then
        forget them, as at the end of a b-bit warmup) and record what the step sent."""
        self.segments.commit()
        if restart_errors:
            self.segments.clear()
        total = self.stats.snapshot()
        self.last_step, self._at_last_step = total - self._at_last_step, total

    def traffic(self) -> dict:
        """Cumulative and last-step communication figures, for logs and benchmarks.

        ``compression_ratio`` is the ratio over the slowest link: on several nodes, the bytes that
        leave this rank's node against fp32 DDP's (``inter_node_ratio``), else all bytes against
        fp32 DDP's. Inside a node and between nodes are also given apart (``None`` where no byte
        goes that way); see :mod:`hf_onebit.comm.stats` for how they are counted.
        """
        total, last = self.stats.snapshot(), self.last_step
        return {
            "bytes_sent": total.bytes_sent,
            "bytes_received": total.bytes_received,
            "rounds": total.rounds,
            "fp32_allreduce_bytes": total.fp32_equivalent,
            "compression_ratio": total.headline_ratio,
            "inter_node_bytes_sent": total.inter_node_sent,
            "intra_node_bytes_sent": total.bytes_sent - total.inter_node_sent,
            "inter_node_ratio": total.inter_node_ratio,
            "intra_node_ratio": total.intra_node_ratio,
            "last_step_bytes_sent": last.bytes_sent,
            "last_step_rounds": last.rounds,
        }

    # ---------------------------------------------------------------- per-rank state
    def state_dict(self) -> dict:
        """This rank's error buffers (by segment) and its traffic so far."""
        return {"segments": self.segments.state_dict(), "comm_total": self.stats.state_dict()}

    def load_state_dict(self, state: dict, layout: list) -> None:
        """Restore :meth:`state_dict`; ``layout`` is the last bucket layout the hook saw (its keys
        without error state are kept, so a resumed run splits buckets as the saved one did)."""
        self.stats.load_state_dict(state["comm_total"])
        self._at_last_step = self.stats.snapshot()
        pending: dict = dict(state["segments"])
        covered = set().union(*pending) if pending else set()
        for key in layout:
            if not covered & set(key):  # a layout for parameters that have no error state yet
                pending.setdefault(tuple(key), None)
        self.segments.load(pending)
