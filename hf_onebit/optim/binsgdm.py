"""BinSGDM / Birder (Peng et al., ICLR 2023 submission / NeurIPS 2023): unbiased 1-bit votes.

Spec §5. Every rank keeps its *own* momentum of the gradient and of its magnitude,

    m_i = β·m_i + (1-β)·g_i          b_i = β·b_i + (1-β)·|g_i|          (fp32, per rank)

and sends one stochastic bit per coordinate, ``q_i = +1`` with probability ``(1 + z)/2``
where ``z = m_i / (b_i + eps)``, else ``-1``. Every rank receives every bit, averages the votes
``q̄ = mean_i q_i`` and takes the step ``p = p - lr·(q̄ + wd·p)``.

Why no warmup and no error feedback
-----------------------------------
Because ``|m_i| <= b_i`` elementwise (triangle inequality: ``m`` and ``b`` are the same
exponential average of ``g`` and ``|g|``), ``z`` lies in ``[-1, 1]`` and is a valid
probability parameter, and ``E[q_i] = (1+z)/2 - (1-z)/2 = z``: the quantizer is *unbiased*.
The averaged vote is then an unbiased estimate of ``mean_i m_i/(b_i+eps)``, an Adam-like
normalised momentum (``b`` plays the role of ``sqrt(v)``; bias corrections cancel in the
ratio, so none is applied). 1-bit Adam needs error feedback because ``sign`` is biased, and
error feedback needs a linear optimizer, hence its frozen-variance warmup; an unbiased
quantizer needs neither, so BinSGDM compresses from step 1.

The price is variance: ``Var[q_i] = 1 - z²`` per coordinate, so
``Var[q̄] = (1/n²)·Σ_i (1 - z_i²)``, largest exactly where the momentum is uncertain
(``z ≈ 0``), and shrinking like ``1/n``. The step size of every coordinate is bounded by ``lr``
(``|q̄| <= 1``), as in signSGD. A coordinate whose gradient is exactly zero on every rank has
``z = 0`` and performs an unbiased ``±lr`` random walk (variance ``lr²/n`` per step) rather
than staying still; weight decay pulls it back. The paper's optional AMSGrad-style
``b = max(b_prev, b)`` is (as the paper says) a device of the proof and is not implemented.

Phase table row (see :mod:`hf_onebit.optim.base`)
-------------------------------------------------
===== ========================================= ========================== ====================
plan  sent (in the hook, during backward)       bytes sent per rank/bucket ``.grad`` after hook
===== ========================================= ========================== ====================
VOTE  flat: all-gather of 1 bit per element     ``(n-1)·(4 + N/8)``        ``q̄ = mean_i q_i``
      plus a 4-byte fp32 validity flag                                     (``·scale`` with a
      hierarchical (``k`` ranks per node,       intra ``(k-1)·(4 + N/8)``  GradScaler), the
      ``M = n/k`` nodes): 1-bit all-gather      inter ``(M-1)·(4+N/(8k))`` same on every rank
      inside the node, one stochastic bit per   intra ``(k-1)·M·N/(8k)``
      node, 1-bit all-gather between nodes
===== ========================================= ========================== ====================

``.grad`` holds the vote average ``q̄`` in the gradient's dtype; its values are multiples of
``1/n`` (``1/M`` hierarchically) in ``[-1, 1]``, bitwise identical on every rank, so
``clip_grad_norm_`` sees the same norm everywhere (and rescales the vote, i.e. the step).
``step()`` takes ``.grad`` as ``q̄``. With one process nothing is communicated: ``step()``
draws the local vote itself (the algorithm with ``n = 1``; the same random stream that rank 0
would use under DDP). The exchange, its bytes, the hierarchical variant (``LOCAL_WORLD_SIZE =
k`` ranks per node) and why it scales as it does are in :mod:`hf_onebit.comm.vote`.

Random streams
--------------
Draws are counter-based (:mod:`hf_onebit.optim.vote_streams`): the uniforms of parameter
``idx`` at step ``t`` depend only on ``(seed, stream, t, idx)``, the stream being the rank for
worker votes and the node for node votes, so resumes, rebuilt buckets and retried steps draw
the same numbers with no generator state to save. ``u < (1+z)/2`` with ``u`` a multiple of
``2**-24`` is unbiased up to ``2**-24``.

Non-finite gradients and skipped steps
--------------------------------------
Each rank prefixes its bits with an fp32 flag, NaN if its new ``b`` is not finite (a
non-finite gradient, or a state corrupted earlier). If any flag is NaN the result is NaN on
every rank, so ``GradScaler`` skips the step on every rank. The new ``m, b`` are written into
pending buffers by the hook and committed by ``step()``; a step that never happens leaves
``m, b`` untouched, and the retried hook (same step ``t``, same random numbers) recomputes
them from the new gradient.

State
-----
``m`` and ``b`` differ on every rank: they live in ``optimizer.state[p]`` as ``"momentum"`` and
``"abs_momentum"`` but are *not* in ``state_dict()`` (which holds only what every rank shares:
the step counter and the seed); they travel in :meth:`BinSGDM.rank_state_dict`. Resuming
without the per-rank state restarts ``m, b`` from zero (a warning says so).

Memory: 16 bytes per parameter of fp32 state (``m``, ``b`` and their pending copies; the commit
is a swap, not a copy) plus about 9 bytes per bucket element of reusable work buffers
(13 for bf16/fp16 buckets).
"""

from __future__ import annotations

import numbers

import torch

from hf_onebit.comm.allreduce import finite_flag
from hf_onebit.comm.vote import VoteAllGather
from hf_onebit.optim.base import OneBitOptimizer, Plan, logger
from hf_onebit.optim.defaults import check_preset
from hf_onebit.optim.tensors import write_flat_
from hf_onebit.optim.validation import check_betas
from hf_onebit.optim.vote_core import VoteLayout, build_layout, vote_threshold_, vote_update_
from hf_onebit.optim.vote_state import VoteMomenta
from hf_onebit.optim.vote_streams import MASK64, NODE_STREAM, VoteStream


class BinSGDM(VoteMomenta, OneBitOptimizer):
    """BinSGDM (Birder) for DDP: stochastic 1-bit votes of ``m/b``, no warmup, no error feedback.

    Args:
        params: parameters or parameter groups.
        lr: learning rate; every coordinate moves by at most ``lr·(1 + wd·|p|)`` per step.
        beta: the momentum coefficient of both ``m`` and ``b`` (one coefficient: the ratio
            ``m/b`` is only in ``[-1, 1]`` if both use the same one; there is no ``betas``).
        eps: added to ``b`` in ``z = m/(b + eps)``.
        weight_decay: decoupled weight decay.
        hierarchical: ``True``: node-level binarisation and 1-bit exchange between nodes
            (needs ``1 < LOCAL_WORLD_SIZE < world size``, dividing it, and the DDP process
            group to be the whole world); ``False``: flat all-gather; ``None`` (default):
            hierarchical exactly when those conditions hold.
        seed: seed of the random votes (together with the rank, the node, the step and the
            parameter index, see the module docstring). Saved in ``state_dict()`` and restored
            from it, so a resumed run continues the same random streams.
        check_finite: without a loss scaler, refuse a non-finite gradient in ``step()`` before
            any state changes (the step's one host sync, see ``optim.guards.check_finite_grads``).
        defaults: ``"library"`` or ``"paper"``, as for the other optimizers
            (:mod:`hf_onebit.optim.defaults`); BinSGDM's library defaults are the paper's.
    """

    imports_adam_state = False  # its m, b are not Adam's moments
    keeps_error_buffers = False  # unbiased votes: its per-rank m, b do not depend on the node layout

    def __init__(
        self,
        params,
        lr: float = 1e-3,
        beta: float = 0.9,
        eps: float = 1e-8,
        weight_decay: float = 0.0,
        hierarchical: bool | None = None,
        seed: int = 0,
        check_finite: bool = True,
        defaults: str = "library",
    ) -> None:
        check_preset(defaults)  # accepted by every optimizer; BinSGDM has no warmup to change
        if isinstance(seed, bool) or not isinstance(seed, numbers.Integral) or not 0 <= int(seed) <= MASK64:
            raise ValueError(f"BinSGDM: seed must be an integer in [0, 2**64), got {seed!r}")
        defaults = dict(lr=lr, beta=beta, eps=eps, weight_decay=weight_decay)
        self._check_group(defaults)  # before float(), which would take a string
        defaults = {name: float(value) for name, value in defaults.items()}
        super().__init__(params, defaults, check_finite=check_finite, hierarchical=hierarchical)
        self.seed = int(seed)
        self._vote: VoteAllGather | None = None  # made at the first vote (attach sets the group)
        self._layouts: dict[tuple[int, ...], VoteLayout] = {}
        self._streams: dict[int, VoteStream] = {}
        self.init_vote_momenta()

    # ---------------------------------------------------------------- parameter groups
    def _check_group(self, group: dict) -> None:
        """Real numbers (TypeError otherwise), then the base's ranges and ``beta`` in [0, 1)."""
        for name in ("lr", "beta", "eps", "weight_decay"):
            value = group.get(name)
            if isinstance(value, bool) or not isinstance(value, numbers.Real):
                raise TypeError(
                    f"BinSGDM: {name} must be a real number, got {value!r}"
                    + (" (BinSGDM has a single momentum coefficient `beta`, not `betas`)" if name == "beta" else "")
                )
        super()._check_group(group)
        check_betas((group["beta"],), "beta")

    # ---------------------------------------------------------------- phase machine
    def plan(self) -> Plan:
        return Plan.VOTE if self.world_size > 1 else Plan.LOCAL

    def phase(self) -> str:
        return "vote" if self.world_size > 1 else "local"

    def global_state(self) -> dict:
        return {**super().global_state(), "seed": self.seed}

    def load_global_state(self, state: dict) -> None:
        super().load_global_state(state)
        if "seed" in state:
            self.seed = int(state["seed"])
            self._streams.clear()

    # ---------------------------------------------------------------- the exchange
    def _vote_exchange(self) -> VoteAllGather:
        if self._vote is None:
            nodes = self.nodes()
            self._vote = VoteAllGather(self.process_group, self.world_size, nodes, self.comm_stats, self.inter_node_stats)
            if nodes is not None and self.rank == 0:
                logger.info("hf_onebit BinSGDM: hierarchical votes, %d nodes of %d ranks", nodes.nodes, nodes.local_size)
        return self._vote

    def _stream(self, stream: int) -> VoteStream:
        s = self._streams.get(stream)
        if s is None or s.seed != self.seed:
            s = self._streams[stream] = VoteStream(self.seed, stream)
        return s

    # ---------------------------------------------------------------- the hook side
    def exchange_bucket(self, call, link) -> torch.futures.Future:
        """The VOTE plan on one bucket (see :class:`hf_onebit.hook.BucketCall`): local votes,
        exchanged by the ordered executor of ``link`` (the hook state)."""
        if call.plan is not Plan.VOTE:
            return super().exchange_bucket(call, link)
        vote = self._vote_exchange()
        layout = self._layout_for(call.key, call.params, call.buffer.device, vote)
        for item in layout.items:
            self._materialize(item.index, item.param)
            self._pending_t[item.index] = call.t
        return link.submit(call.buffer.device, lambda: self._vote_bucket(layout, vote, call, link))

    def _layout_for(self, key, params, device, vote: VoteAllGather) -> VoteLayout:
        layout = self._layouts.get(key)
        if layout is None:
            for other in [k for k in self._layouts if set(k) & set(key)]:
                del self._layouts[other]  # DDP rebuilt its buckets
            total = sum(p.numel() for p in params)
            layout = self._layouts[key] = build_layout(key, params, device, vote.padded_length(total))
        return layout

    def _vote_bucket(self, layout: VoteLayout, vote: VoteAllGather, call, link) -> torch.Tensor:
        """Runs on the communication thread: local state, local votes, exchange, ``.grad = q̄``.

        No value goes to the host (on CUDA that would wait for the GPU): the loss scale stays a
        0-dim tensor (its reciprocal in fp64, as ``1.0 / float(scale)`` was), the finiteness
        flags are device booleans from the new ``b`` to the NaN written into ``q̄``.
        """
        buffer, grads, scale_t, t = call.buffer, call.grads, call.scale, call.t
        inv = None if scale_t is None else torch.reciprocal(scale_t.to(torch.float64))
        finite = []  # per parameter: is its new b finite (0-dim bool tensors)
        worker = self._stream(self.rank)
        for item, g in zip(layout.items, grads):
            state = self.state[item.param]
            group = self._group_map()[id(item.param)]
            m_next, b_next = self._next[item.index]
            sl = slice(item.offset, item.offset + item.numel)
            g = g.reshape(-1)
            if g.dtype == torch.float32:
                g32 = g.mul_(inv) if inv is not None else g  # in place: the bucket is overwritten with q̄
            else:  # bf16/fp16 bucket: unscale into fp32 scratch
                if layout.scratch is None:
                    layout.scratch = torch.empty(layout.numel, dtype=torch.float32, device=g.device)
                g32 = layout.scratch[sl].copy_(g)
                if inv is not None:
                    g32.mul_(inv)
            vote_threshold_(
                state["momentum"].view(-1), state["abs_momentum"].view(-1), g32, beta=group["beta"],
                eps=group["eps"], m_out=m_next.view(-1), b_out=b_next.view(-1), theta=layout.theta[sl],
                tmp=layout.uniform[sl],
            )
            finite.append(finite_flag(b_next))
            worker.uniform_(layout.uniform[sl], t, item.index)
        n = layout.numel
        torch.lt(layout.uniform, layout.theta[:n], out=layout.votes[:n])
        all_finite = torch.stack(finite).all()
        if vote.hierarchical:  # the node's draws (the worker votes are taken: reuse the buffer)
            node_stream = self._stream(NODE_STREAM + vote.topology.node)
            for item in layout.items:
                node_stream.uniform_(layout.uniform[item.offset : item.offset + item.numel], t, item.index)
        qbar, valid = vote(layout.votes, all_finite, n, node_uniform=layout.uniform, scratch=layout.theta)
        qbar.masked_fill_(~valid, float("nan"))
        link.note_attempt(t, call.attempt, valid)  # a repeat of step t is admitted only after a NaN vote
        for item, g in zip(layout.items, grads):
            src = qbar[item.offset : item.offset + item.numel]
            if scale_t is not None:
                src = src * scale_t
            write_flat_(g, src)  # g has the parameter's strides: reshape(-1) could be a copy
        return buffer

    # ---------------------------------------------------------------- step
    @torch.no_grad()
    def step(self, closure=None):
        loss, t, plan = self.begin_step(closure)
        synced = self.check_synced(t) if plan is Plan.VOTE else False
        index = self._index_of()
        for p, grad, _, group in self.grads_in_order():
            idx = index[id(p)]
            if synced:
                if self._pending_t.get(idx) != t:
                    raise RuntimeError(
                        f"BinSGDM: parameter {idx} has a gradient but the communication hook did not"
                        f" vote on it for step {t}"
                    )
                q = grad  # the vote average q̄ (in fp32: exact, its values are multiples of 1/n)
            else:  # one process: the algorithm with n = 1, the local vote
                q = self._local_vote(idx, p, grad, group, t)
            self._commit(idx, p)
            vote_update_(p, q, lr=group["lr"], weight_decay=group["weight_decay"])
        self._after_step()
        return loss

    def _local_vote(self, idx: int, p: torch.Tensor, grad32: torch.Tensor, group: dict, t: int) -> torch.Tensor:
        state = self._materialize(idx, p)
        m_next, b_next = self._next[idx]
        g32 = grad32.reshape(-1)
        theta = torch.empty(p.numel(), dtype=torch.float32, device=p.device)
        u = torch.empty_like(theta)
        vote_threshold_(
            state["momentum"].view(-1), state["abs_momentum"].view(-1), g32, beta=group["beta"], eps=group["eps"],
            m_out=m_next.view(-1), b_out=b_next.view(-1), theta=theta, tmp=u,
        )
        self._stream(self.rank).uniform_(u, t, idx)
        return torch.where(u < theta, 1.0, -1.0).view(p.shape)
