"""Tensor helpers of the per-tensor paths (1-bit LAMB on FSDP2 shards): reducing in logical
order, updating a low-precision parameter in fp32 with one rounding. The list cores have their
own (:mod:`hf_onebit.optim.foreach`)."""

from __future__ import annotations

from typing import Callable

import torch


def logical(t: torch.Tensor) -> torch.Tensor:
    """``t`` itself if contiguous, else a contiguous copy: reductions over it then sum in logical
    order, so a channels_last tensor reduces bitwise like the same values stored contiguously."""
    return t if t.is_contiguous() else t.contiguous()


def update_in_fp32_(p: torch.Tensor, update: Callable[[torch.Tensor], object]) -> None:
    """Apply the in-place ``update`` to ``p`` in fp32, rounding once.

    fp32 parameters are updated in place; bf16/fp16 ones through an fp32 copy that is written
    back, so every optimizer rounds a low-precision parameter exactly once per step.
    """
    if p.dtype == torch.float32:
        update(p)
    else:
        work = p.float()
        update(work)
        p.copy_(work)
