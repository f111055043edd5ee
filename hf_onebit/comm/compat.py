"""torch.distributed names that differ between the torch versions hf_onebit supports."""

from __future__ import annotations

import torch.distributed as dist

#: torch 2.13 renamed ``all_gather_into_tensor`` to ``all_gather_single``; support both.
all_gather_into_tensor = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
