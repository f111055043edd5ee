"""torch.distributed helpers: names that differ between torch versions, and a bytes all-gather."""

from __future__ import annotations

import torch
import torch.distributed as dist

#: torch 2.13 renamed ``all_gather_into_tensor`` to ``all_gather_single``; support both.
all_gather_into_tensor = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
#: ... and ``reduce_scatter_tensor`` to ``reduce_scatter_single``.
reduce_scatter_tensor = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def all_gather_bytes(data: bytes, device: torch.device, group) -> list[bytes]:
    """Every rank's ``data``, exchanged as uint8 tensors on ``device`` (the parameters' device).

    Not ``all_gather_object``: with NCCL it stages through ``torch.cuda.current_device()``, which is
    device 0 on every rank of a script that never calls ``torch.cuda.set_device`` (stock DDP
    works there), so all ranks would share one GPU and NCCL fails or hangs.
    """
    n = dist.get_world_size(group)
    mine = torch.frombuffer(bytearray(data), dtype=torch.uint8).to(device)
    sizes = [torch.zeros(1, dtype=torch.int64, device=device) for _ in range(n)]
    dist.all_gather(sizes, torch.tensor([mine.numel()], dtype=torch.int64, device=device), group=group)
    longest = max(int(s) for s in sizes)
    padded = torch.zeros(longest, dtype=torch.uint8, device=device)
    padded[: mine.numel()] = mine
    gathered = [torch.empty(longest, dtype=torch.uint8, device=device) for _ in range(n)]
    dist.all_gather(gathered, padded, group=group)
    return [bytes(g[: int(s)].cpu().numpy()) for g, s in zip(gathered, sizes)]
