"""BinSGDM's functional core: the worker math, the update, and the flat buffers of one bucket.

What :class:`~hf_onebit.optim.binsgdm.BinSGDM` computes, with no optimizer around it (as
``adam_update_`` is for 1-bit Adam): :func:`vote_threshold_` (the new ``m, b`` and the
probability of a ``+1`` vote), :func:`vote_update_foreach_` (the step from the vote average) and
:class:`VoteLayout` (one DDP bucket's momenta and work buffers, laid flat and reused every step).

Why flat: on a GPU every torch operation is a kernel launch of ~5-10 µs of host time, so work
done per parameter tensor costs milliseconds a step on a model of a few hundred tensors. The
momenta of a bucket's parameters therefore live end to end in one fp32 buffer (``state[p]
["momentum"]`` is a view of it), the worker math is one fused pass over the bucket
(``kernels.vote_threshold``), and the update is a handful of ``torch._foreach_*`` operations per
parameter group, whatever the number of tensors. Per-tensor views are made once, when a layout
is built (DDP builds its buckets twice: at the first and at the second iteration).
"""

from __future__ import annotations

from typing import Sequence

import torch

from hf_onebit.kernels import get_backend
from hf_onebit.kernels import reference
from hf_onebit.optim.foreach import masked_factor


def vote_threshold_(m: torch.Tensor, b: torch.Tensor, g: torch.Tensor, *, beta: float, eps: float,
                    m_out: torch.Tensor, b_out: torch.Tensor, theta: torch.Tensor, tmp: torch.Tensor) -> None:
    """The worker math of one parameter or bucket (flat fp32 tensors), the functional core.

    ``m_out = β·m + (1-β)·g``, ``b_out = β·b + (1-β)·|g|``, ``theta = (1 + m_out/(b_out+eps))/2``,
    the probability of a ``+1`` vote: :func:`hf_onebit.kernels.reference.vote_threshold`, which
    defines it (every operation rounded on its own, so a plain float32 loop reproduces it
    bitwise). Contiguous fp32 tensors take the device's kernel backend (one fused pass on CPU and
    CUDA; ``HF_ONEBIT_KERNELS=reference`` keeps the torch operations); anything else runs the
    torch operations here, with ``tmp`` (fp32, as long) as their scratch.
    """
    tensors = (m, b, g, m_out, b_out, theta)
    if all(t.dtype == torch.float32 and t.is_contiguous() for t in tensors):
        get_backend(m.device).vote_threshold(m, b, g, beta=beta, eps=eps, m_out=m_out, b_out=b_out, theta=theta)
        return
    reference.vote_threshold_ops(m, b, g, beta=beta, eps=eps, m_out=m_out, b_out=b_out, theta=theta, tmp=tmp)


def vote_update_foreach_(params: list, qs: list, *, lr: float, weight_decay: float, q32: list | None = None,
                         work: list | None = None, ok: torch.Tensor | None = None) -> None:
    """``p = p·(1 - lr·wd) - lr·q`` (decoupled decay, AdamW order) for lists, in fp32, one rounding.

    Bitwise what ``step = q.float()·lr; w = p.float(); w.mul_(1 - lr·wd); w.sub_(step);
    p.copy_(w)`` does tensor by tensor, in a constant number of ``torch._foreach_*`` operations:

    * ``qs`` that are not fp32 are first copied into ``q32`` (fp32 tensors of their shapes);
    * ``params`` that are not fp32 are updated in ``work`` (fp32 tensors of their shapes) and
      written back, so a bf16/fp16 parameter is rounded once per step.

    ``q32`` and ``work`` are only read where the dtype needs them (``None`` elsewhere). With ``ok``
    (a 0-dim device bool; ``qs`` finite, zero where it is False) the decay factor becomes 1 where
    it is False, so the parameters stay exactly as they were (``p·1 - 0 = p``).
    """
    if not params:
        return
    fp32_q = [i for i, q in enumerate(qs) if q.dtype == torch.float32]
    if len(fp32_q) == len(qs):
        steps = torch._foreach_mul(qs, lr)
    else:
        low = [i for i in range(len(qs)) if qs[i].dtype != torch.float32]
        torch._foreach_copy_([q32[i] for i in low], [qs[i] for i in low])
        full = [qs[i] if qs[i].dtype == torch.float32 else q32[i] for i in range(len(qs))]
        steps = torch._foreach_mul(full, lr)
    if all(p.dtype == torch.float32 for p in params):
        targets = params
    else:
        low = [i for i, p in enumerate(params) if p.dtype != torch.float32]
        torch._foreach_copy_([work[i] for i in low], [params[i] for i in low])
        targets = [p if p.dtype == torch.float32 else work[i] for i, p in enumerate(params)]
    if weight_decay:
        decay = 1.0 - lr * weight_decay
        torch._foreach_mul_(targets, masked_factor(decay, ok))
    torch._foreach_sub_(targets, steps)
    if targets is not params:
        torch._foreach_copy_([params[i] for i in low], [work[i] for i in low])


class VoteItem:
    """One parameter's place in its layout's flat buffers."""

    __slots__ = ("index", "param", "offset", "numel", "group", "state")

    def __init__(self, index: int, param: torch.Tensor, offset: int, group: dict, state: dict) -> None:
        self.index = index  # position in the optimizer's parameter order (names the random stream)
        self.param = param
        self.offset = offset
        self.numel = param.numel()
        self.group = group  # its parameter group (beta, eps; lr and weight decay in step())
        self.state = state  # optimizer.state[param], whose "momentum"/"abs_momentum" view the buffers


class _Momenta:
    """One copy of a layout's ``m`` and ``b``: flat fp32 buffers and each parameter's view of them."""

    def __init__(self, items: list[VoteItem], numel: int, device: torch.device) -> None:
        self.m = torch.zeros(numel, dtype=torch.float32, device=device)
        self.b = torch.zeros(numel, dtype=torch.float32, device=device)
        self.m_views = _views(self.m, items)
        self.b_views = _views(self.b, items)


def _views(flat: torch.Tensor, items: Sequence[VoteItem]) -> list[torch.Tensor]:
    """Each item's stretch of ``flat``, in its parameter's shape (made once per layout)."""
    return [flat[it.offset: it.offset + it.numel].view(it.param.shape) for it in items]


class VoteLayout:
    """One bucket's momenta and work buffers, laid end to end in the bucket's order, reused every step.

    ``cur`` holds this rank's ``m, b`` (``state[p]["momentum"]``, ``["abs_momentum"]`` are views
    of it); the hook writes the new ones into ``nxt`` and marks the layout pending for its step;
    :meth:`commit` (in ``step()``) swaps the two, so a step that never happens leaves ``m, b`` as
    they were. Work buffers (``padded``: the exchange's length, ``VoteAllGather.padded_length``):

    * ``theta`` fp32 ``[padded]``: P(+1) (zero in the padding), then the exchange's scratch;
    * ``uniform`` fp32 ``[numel]``: the draws; in ``step()`` the fp32 copy of low-precision
      parameters; after the exchange, the staging of the vote average for gradients that are not
      the bucket itself;
    * ``votes`` bool ``[padded]`` (``False`` in the padding);
    * ``scratch`` fp32 ``[numel]`` (made on first need): the unscaled gradients when the bucket is
      not fp32 or its gradients are not the bucket laid end to end, and the fp32 copy of
      low-precision gradients in ``step()``.
    """

    def __init__(self, key: tuple[int, ...], items: list[VoteItem], padded: int, device: torch.device) -> None:
        self.key = key
        self.items = items
        self.position = {it.index: i for i, it in enumerate(items)}  # parameter index -> item
        self.numel = sum(it.numel for it in items)
        self.padded = padded
        self.device = device
        self.cur = _Momenta(items, self.numel, device)
        self.nxt = _Momenta(items, self.numel, device)
        f32 = dict(dtype=torch.float32, device=device)
        self.theta = torch.zeros(padded, **f32)
        self.theta_n = self.theta[: self.numel]
        self.uniform = torch.empty(self.numel, **f32)
        self._draw_table: tuple | None = None  # (kernel backend, its vote_uniform_table of the items)
        self.uniform_views = _views(self.uniform, items)
        self.votes = torch.zeros(padded, dtype=torch.bool, device=device)
        self.votes_n = self.votes[: self.numel]
        self.scratch: torch.Tensor | None = None
        self.scratch_views: list[torch.Tensor] | None = None
        self.pending_t: int | None = None  # the step whose new m, b are in nxt
        self._spans: list | None = None
        self._span_key: tuple | None = None
        self._direct: tuple | None = None  # (buffer identity, verdict) of the last gradients seen
        for it, m, b in zip(items, self.cur.m_views, self.cur.b_views):
            it.state["momentum"], it.state["abs_momentum"] = m, b

    # ---------------------------------------------------------------- buffers
    def ensure_scratch(self) -> torch.Tensor:
        if self.scratch is None:
            self.scratch = torch.empty(self.numel, dtype=torch.float32, device=self.device)
            self.scratch_views = _views(self.scratch, self.items)
        return self.scratch

    def adopt(self, momenta: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Start from these ``(m, b)`` per item (one-time copies when the layout is built)."""
        for (m, b), m_dst, b_dst in zip(momenta, self.cur.m_views, self.cur.b_views):
            m_dst.copy_(m)
            b_dst.copy_(b)

    def commit(self, ok: torch.Tensor | None = None) -> None:
        """Make the pending ``m, b`` current: a swap of the two copies, no data moves. With ``ok``
        (a 0-dim device bool, False for a step masked on the device) the pending copies first
        take the current values where it is False, so the step leaves ``m, b`` as they were."""
        if ok is not None:
            for new, old in ((self.nxt.m, self.cur.m), (self.nxt.b, self.cur.b)):
                torch.where(ok, new, old, out=new)
        self.cur, self.nxt = self.nxt, self.cur
        for it, m, b in zip(self.items, self.cur.m_views, self.cur.b_views):
            it.state["momentum"], it.state["abs_momentum"] = m, b
        self.pending_t = None

    # ---------------------------------------------------------------- the worker math
    def spans(self) -> list[tuple[int, int, float, float]]:
        """``(lo, hi, beta, eps)``: runs of consecutive items whose groups share ``beta`` and ``eps``
        (usually one run: weight-decay groups differ in neither). Recomputed when a group's
        values change."""
        groups = {id(it.group): it.group for it in self.items}
        key = tuple((gid, g["beta"], g["eps"]) for gid, g in groups.items())
        if key != self._span_key:
            spans: list[list] = []
            for it in self.items:
                hyper = (it.group["beta"], it.group["eps"])
                if spans and (spans[-1][2], spans[-1][3]) == hyper:
                    spans[-1][1] = it.offset + it.numel
                else:
                    spans.append([it.offset, it.offset + it.numel, *hyper])
            self._spans, self._span_key = [tuple(s) for s in spans], key
        return self._spans

    def threshold(self, g32: torch.Tensor) -> None:
        """New ``m, b`` into ``nxt`` and P(+1) into ``theta`` from the flat fp32 gradients ``g32``."""
        cur, nxt, n = self.cur, self.nxt, self.numel
        fused = get_backend(self.device).vote_threshold  # every buffer here is flat, contiguous fp32
        for lo, hi, beta, eps in self.spans():
            if lo == 0 and hi == n:  # the whole bucket: no slicing
                m, b, g, m_out, b_out, theta = cur.m, cur.b, g32, nxt.m, nxt.b, self.theta_n
            else:
                m, b, g, m_out, b_out, theta = (t[lo:hi] for t in (cur.m, cur.b, g32, nxt.m, nxt.b, self.theta_n))
            fused(m, b, g, beta=beta, eps=eps, m_out=m_out, b_out=b_out, theta=theta)

    def draw(self, stream, t: int) -> None:
        """The uniforms of step ``t`` from ``stream`` into ``uniform``, in one kernel call for the
        bucket (each parameter's draws depend only on its index: see :mod:`.vote_streams`)."""
        kernels = get_backend(self.device)
        if self._draw_table is None or self._draw_table[0] is not kernels:  # once per layout
            offsets = [it.offset for it in self.items] + [self.numel]
            self._draw_table = (kernels, kernels.vote_uniform_table(offsets, [it.index for it in self.items], self.device))
        stream.uniform_many_(self.uniform, t, kernels, self._draw_table[1])

    # ---------------------------------------------------------------- the bucket's gradients
    def is_direct(self, buffer: torch.Tensor, grads: Sequence[torch.Tensor]) -> bool:
        """Whether ``grads`` are ``buffer``'s first elements laid end to end in this layout's order
        (DDP's buckets of contiguous parameters): the bucket is then read and written flat."""
        ident = (buffer.data_ptr(), buffer.dtype, buffer.numel(), tuple(g.data_ptr() for g in grads))
        if self._direct is None or self._direct[0] != ident:
            base, size = buffer.data_ptr(), buffer.element_size()
            ok = buffer.dim() == 1 and buffer.is_contiguous() and buffer.numel() >= self.numel and all(
                g.dtype == buffer.dtype and g.is_contiguous() and g.data_ptr() == base + it.offset * size
                for g, it in zip(grads, self.items))
            self._direct = (ident, ok)
        return self._direct[1]

    def gradients(self, buffer: torch.Tensor, grads: Sequence[torch.Tensor], direct: bool) -> torch.Tensor:
        """The bucket's gradients as one flat fp32 tensor that may be overwritten: the bucket itself
        when it is fp32 and ``direct``, else ``scratch`` filled in one operation."""
        if direct:
            flat = buffer if buffer.numel() == self.numel else buffer[: self.numel]
            return flat if flat.dtype == torch.float32 else self.ensure_scratch().copy_(flat)
        self.ensure_scratch()
        torch._foreach_copy_(self.scratch_views, list(grads))
        return self.scratch

    def write(self, buffer: torch.Tensor, grads: Sequence[torch.Tensor], direct: bool, values: torch.Tensor) -> None:
        """``grads = values`` (flat fp32, this layout's order) in the gradients' dtype and strides."""
        n = self.numel
        if direct:
            (buffer if buffer.numel() == n else buffer[:n]).copy_(values[:n])
            return
        self.uniform.copy_(values[:n])  # staged where per-parameter views exist: no views per call
        torch._foreach_copy_(list(grads), self.uniform_views)


def build_layout(key: tuple[int, ...], params: Sequence[torch.Tensor], groups: Sequence[dict],
                 states: Sequence[dict], device: torch.device, padded_length: int) -> VoteLayout:
    """A fresh layout for the parameters ``key`` (their indices) laid end to end, of groups
    ``groups`` and optimizer states ``states``; ``padded_length``: the exchange's length for
    their total (``VoteAllGather.padded_length``). Its momenta start at zero (see ``adopt``)."""
    items, off = [], 0
    for idx, p, group, state in zip(key, params, groups, states):
        items.append(VoteItem(idx, p, off, group, state))
        off += p.numel()
    return VoteLayout(key, items, padded_length, device)
