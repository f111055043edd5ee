"""Full-precision mean all-reduce (warmup and variance steps), counted like the compressed one."""

from __future__ import annotations

import torch
import torch.distributed as dist

from hf_onebit.comm.executor import executor_for
from hf_onebit.comm.stats import CommRecord, CommStats, allreduce_bytes, leaving_node, stage
from hf_onebit.comm.topology import ranks_on_my_node


class MeanAllReduce:
    """``x = mean over ranks of x``, in place, at ``x``'s own precision.

    Goes through the group's ordered executor like every hf_onebit collective, so it can be
    mixed freely with compressed calls on other buffers.
    """

    def __init__(self, group: dist.ProcessGroup | None = None, stats: CommStats | None = None) -> None:
        self.group = group
        self.world_size = dist.get_world_size(group) if dist.is_initialized() else 1
        self.stats = stats if stats is not None else CommStats()
        self.local_size = ranks_on_my_node(group)  # for the bytes between nodes

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.world_size > 1:
            # Divide first, as DDP's own reducer does: an fp16/bf16 bucket whose sum over ranks
            # overflows but whose mean does not stays finite (gloo has no ReduceOp.AVG).
            x.div_(self.world_size)
            with stage("exchange"):
                dist.all_reduce(x, group=self.group)
        moved = allreduce_bytes(x.numel() * x.element_size(), self.world_size)
        fp32 = allreduce_bytes(x.numel() * 4, self.world_size)
        rounds = 1 if self.world_size > 1 else 0
        n, k = self.world_size, self.local_size
        self.stats.record(CommRecord(moved, moved, rounds, fp32, 1, leaving_node(moved, 0, n, k), leaving_node(fp32, 0, n, k)))
        return x

    def record_skipped(self, numel: int) -> None:
        """Count a buffer of ``numel`` elements not sent where DDP would have all-reduced it in
        fp32 (0/1 Adam's local steps): nothing sent, its fp32 equivalent kept for the ratios."""
        fp32 = allreduce_bytes(4 * numel, self.world_size)
        self.stats.record(CommRecord(fp32_equivalent=fp32,
                                     inter_node_fp32=leaving_node(fp32, 0, self.world_size, self.local_size)))

    def allreduce_async(self, x: torch.Tensor) -> torch.futures.Future:
        return executor_for(self.group, x.device).submit(lambda: self(x))


def finite_flag(t: torch.Tensor) -> torch.Tensor:
    """Whether every element of ``t`` is finite, as a 0-dim bool tensor on ``t``'s device (no sync).

    One ``aminmax`` pass: a NaN anywhere makes both NaN, an inf makes one of them infinite.
    ``isfinite(t).all()`` instead writes a bool tensor the size of ``t`` and reduces it, many times
    slower on CPU, where the check runs on every BinSGDM step.
    """
    if t.numel() == 0:
        return torch.ones((), dtype=torch.bool, device=t.device)
    lo, hi = torch.aminmax(t)
    return torch.isfinite(lo) & torch.isfinite(hi)


def poison_unless_all_finite_(buffer: torch.Tensor, group: dist.ProcessGroup | None, stats: CommStats) -> torch.Tensor:
    """Fill ``buffer`` with NaN on every rank if it is non-finite on any rank (4 bytes, 1 round).

    For steps whose gradients are not exchanged (0/1 Adam's local steps) under a loss scaler: a
    rank whose gradient overflowed skips the step, and every rank must skip with it, or step
    counters and sync schedules diverge. The flag stays on the device (no host round trip).
    """
    flag = (~finite_flag(buffer)).to(torch.float32).reshape(1)
    dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=group)
    n = dist.get_world_size(group)
    stats.record(CommRecord(2 * (n - 1) * 4 // n, 2 * (n - 1) * 4 // n, 1, 0, 1))
    buffer.masked_fill_(flag.bool(), float("nan"))  # a 1-element mask broadcast over the bucket
    return buffer
