"""BinSGDM's functional core: the worker math, the update, and one bucket's work buffers.

What :class:`~hf_onebit.optim.binsgdm.BinSGDM` computes, with no optimizer around it (as
``adam_update_`` is for 1-bit Adam): :func:`vote_threshold_` (the new ``m, b`` and the
probability of a ``+1`` vote), :func:`vote_update_` (the step from the vote average) and
:func:`build_layout` (the flat work buffers of one DDP bucket, reused every step).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

from hf_onebit.kernels import get_backend
from hf_onebit.optim.tensors import update_in_fp32_


def vote_threshold_(m: torch.Tensor, b: torch.Tensor, g: torch.Tensor, *, beta: float, eps: float,
                    m_out: torch.Tensor, b_out: torch.Tensor, theta: torch.Tensor, tmp: torch.Tensor) -> None:
    """The worker math of one parameter (flat fp32 views), the functional core.

    ``m_out = β·m + (1-β)·g``, ``b_out = β·b + (1-β)·|g|``, ``theta = (1 + m_out/(b_out+eps))/2``,
    the probability of a ``+1`` vote. Every operation is rounded on its own (no fused
    multiply-add), so a plain float32 re-implementation reproduces it bitwise. The CPU kernel
    backend has it as one fused pass (``kernels.cpu.vote_threshold``, bitwise the same), taken
    for contiguous fp32 tensors; ``HF_ONEBIT_KERNELS=reference`` keeps the torch operations.
    """
    backend = get_backend(m.device)
    fused = getattr(backend, "vote_threshold", None)
    tensors = (m, b, g, m_out, b_out, theta)
    if fused is not None and all(t.dtype == torch.float32 and t.is_contiguous() for t in tensors):
        fused(m, b, g, beta=beta, eps=eps, m_out=m_out, b_out=b_out, theta=theta)
        return
    torch.mul(g, 1.0 - beta, out=tmp)
    torch.mul(m, beta, out=m_out)
    m_out.add_(tmp)
    torch.abs(g, out=tmp)
    tmp.mul_(1.0 - beta)
    torch.mul(b, beta, out=b_out)
    b_out.add_(tmp)
    torch.add(b_out, eps, out=theta)
    torch.div(m_out, theta, out=theta)
    if eps == 0.0:  # 0/0 where the coordinate never had a gradient: z = 0 (|m| <= b = 0)
        theta.nan_to_num_(nan=0.0, posinf=float("inf"), neginf=float("-inf"))
    theta.add_(1.0).mul_(0.5)


def vote_update_(p: torch.Tensor, q: torch.Tensor, *, lr: float, weight_decay: float) -> None:
    """``p = p·(1 - lr·wd) - lr·q`` (decoupled decay, AdamW order), fp32 math, one rounding."""
    step = torch.mul(q.float() if q.dtype != torch.float32 else q, lr)

    def update(w: torch.Tensor) -> None:
        if weight_decay:
            w.mul_(1.0 - lr * weight_decay)
        w.sub_(step)

    update_in_fp32_(p, update)


@dataclass
class VoteItem:
    """One parameter's place in its bucket's flat buffers."""

    index: int  # position in the optimizer's parameter order (names the random stream)
    param: torch.Tensor
    offset: int
    numel: int


@dataclass
class VoteLayout:
    """Work buffers of one DDP bucket (reused every step)."""

    key: tuple[int, ...]
    items: list[VoteItem]
    numel: int
    padded: int  # multiple of 8 (flat) or 8·k (hierarchical): VoteAllGather.padded_length
    theta: torch.Tensor  # fp32 [padded], P(+1); zero in the padding
    uniform: torch.Tensor  # fp32 [numel]: scratch of the worker math, then the draws
    votes: torch.Tensor  # bool [padded]; False in the padding
    scratch: torch.Tensor | None = None  # fp32 [numel], only for bf16/fp16 buckets


def build_layout(key: tuple[int, ...], params: Sequence[torch.Tensor], device: torch.device,
                 padded_length: int) -> VoteLayout:
    """Fresh work buffers for the bucket of parameters ``key`` (their indices) laid end to end;
    ``padded_length``: the exchange's length for their total (``VoteAllGather.padded_length``)."""
    items, off = [], 0
    for idx, p in zip(key, params):
        items.append(VoteItem(idx, p, off, p.numel()))
        off += p.numel()
    f32 = dict(dtype=torch.float32, device=device)
    return VoteLayout(
        key, items, off, padded_length,
        theta=torch.zeros(padded_length, **f32),
        uniform=torch.empty(off, **f32),
        votes=torch.zeros(padded_length, dtype=torch.bool, device=device),
    )
