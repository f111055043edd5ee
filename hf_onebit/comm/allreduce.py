"""Full-precision mean all-reduce (warmup and variance steps), counted like the compressed one."""

from __future__ import annotations

import torch
import torch.distributed as dist

from hf_onebit.comm.executor import executor_for
from hf_onebit.comm.stats import CommRecord, CommStats, allreduce_bytes


class MeanAllReduce:
    """``x = mean over ranks of x``, in place, at ``x``'s own precision.

    Goes through the group's ordered executor like every hf_onebit collective, so it can be
    mixed freely with compressed calls on other buffers.
    """

    def __init__(self, group: dist.ProcessGroup | None = None, stats: CommStats | None = None) -> None:
        self.group = group
        self.world_size = dist.get_world_size(group) if dist.is_initialized() else 1
        self.stats = stats if stats is not None else CommStats()

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.world_size > 1:
            # Divide first, as DDP's own reducer does: an fp16/bf16 bucket whose sum over ranks
            # overflows but whose mean does not stays finite (gloo has no ReduceOp.AVG).
            x.div_(self.world_size)
            dist.all_reduce(x, group=self.group)
        moved = allreduce_bytes(x.numel() * x.element_size(), self.world_size)
        fp32 = allreduce_bytes(x.numel() * 4, self.world_size)
        rounds = 1 if self.world_size > 1 else 0
        self.stats.record(CommRecord(moved, moved, rounds, fp32, 1))
        return x

    def allreduce_async(self, x: torch.Tensor) -> torch.futures.Future:
        return executor_for(self.group, x.device).submit(lambda: self(x))
