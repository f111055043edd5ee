"""BinSGDM / Birder (Peng et al., ICLR 2023 submission / NeurIPS 2023): unbiased 1-bit votes.

Every rank keeps its *own* momentum of the gradient and of its magnitude,

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

Stratified votes (``stratified_votes=True``, the library default): the ``n`` ranks whose votes
are averaged draw ``u`` from one shared stream and vote with ``u_i = frac(u + i/n)``. Each
``u_i`` is uniform on ``[0, 1)``, so each vote stays unbiased, ``E[q_i] = z_i``; but the ``u_i``
lie one in each interval ``[j/n, (j+1)/n)``. Where the ranks agree on ``z`` (a shared trend, or
a coordinate with no gradient anywhere), exactly ``⌊n(1+z)/2⌋`` or ``⌈n(1+z)/2⌉`` of them vote
``+1``: ``q̄`` is ``z`` rounded at random to a neighbouring multiple of ``2/n``, with variance at
most ``1/n²`` instead of ``(1 - z²)/n``, and a coordinate with ``z = 0`` everywhere stays still
at even ``n`` instead of walking. Nothing more is sent; the streams are named as above
(:data:`~hf_onebit.optim.vote_streams.STRATIFIED_STREAM`). By node the node's ranks share a
stream (offsets ``j/k``), and so do the nodes' votes (offsets ``node/M``).

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

Memory: 16 bytes per parameter of fp32 state (``m``, ``b`` and their pending copies, laid flat
per bucket, see :class:`~hf_onebit.optim.vote_core.VoteLayout`; the commit is a swap, not a
copy) plus about 9 bytes per bucket element of reusable work buffers (13 for bf16/fp16 buckets,
for buckets whose gradients are not the bucket laid end to end, e.g. under FSDP2 or with
channels_last parameters, and for the single-process step).

Cost per step: the hook and ``step()`` run a fixed number of torch operations whatever the
number of parameter tensors (one fused ``vote_threshold`` and one ``vote_uniform`` per bucket,
``torch._foreach_*`` updates per parameter group; counted in
tests/optim/test_binsgdm_op_counts.py).
"""

from __future__ import annotations

import numbers

import torch

from hf_onebit.optim.base import OneBitOptimizer, Plan
from hf_onebit.optim.defaults import LIBRARY_DEFAULT, resolve
from hf_onebit.optim.validation import check_betas, check_bool
from hf_onebit.optim.vote_core import VoteLayout, vote_threshold_, vote_update_foreach_  # noqa: F401 (vote_threshold_: API)
from hf_onebit.optim.vote_state import VoteMomenta
from hf_onebit.optim.vote_streams import MASK64, NODE_STREAM, STRATIFIED_STREAM, VoteStream


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
        stratified_votes: ``True`` (library default): the ranks whose votes are averaged draw
            from one stream, each shifted by its place, ``u_i = frac(u + i/n)`` (stratified
            sampling, see the module docstring): each vote stays unbiased and their mean varies
            less; ``False`` (the paper): independent streams.
        check_finite: without a loss scaler, refuse a non-finite gradient (``FloatingPointError``);
            no parameter, ``m`` or ``b`` changes. CPU tensors are checked before the step; on a
            GPU the step is masked on the device and the error comes at the next ``step()``, with
            no host sync (see ``optim.guards.check_finite_grads``).
        defaults: ``"library"`` or ``"paper"``, as for the other optimizers
            (:mod:`hf_onebit.optim.defaults`); ``"paper"`` draws independent votes.
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
        stratified_votes: bool = LIBRARY_DEFAULT,
        check_finite: bool = True,
        defaults: str = "library",
    ) -> None:
        (stratified_votes,) = resolve("BinSGDM", defaults, stratified_votes=stratified_votes).values()
        check_bool(stratified_votes, "BinSGDM: stratified_votes")
        if isinstance(seed, bool) or not isinstance(seed, numbers.Integral) or not 0 <= int(seed) <= MASK64:
            raise ValueError(f"BinSGDM: seed must be an integer in [0, 2**64), got {seed!r}")
        defaults = dict(lr=lr, beta=beta, eps=eps, weight_decay=weight_decay)
        self._check_group(defaults)  # before float(), which would take a string
        defaults = {name: float(value) for name, value in defaults.items()}
        super().__init__(params, defaults, check_finite=check_finite, hierarchical=hierarchical)
        self.seed = int(seed)
        self.stratified_votes = stratified_votes
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
    def _draw_worker_votes(self, layout: VoteLayout, t: int, topology) -> None:
        """This rank's votes of step ``t``, ``u < (1+z)/2``, into ``layout.votes_n``; the voters
        averaged together are the world, or the node of ``topology``."""
        if topology is None:
            self._draw(layout, t, self.rank, STRATIFIED_STREAM, self.rank, self.world_size)
        else:
            self._draw(layout, t, self.rank, STRATIFIED_STREAM + topology.node, topology.local_rank, topology.local_size)
        torch.lt(layout.uniform, layout.theta_n, out=layout.votes_n)

    def _draw(self, layout: VoteLayout, t: int, own: int, shared: int, place: int, size: int) -> None:
        """The uniforms of step ``t`` into ``layout.uniform``: from the voter's ``own`` stream, or,
        stratified, from the stream ``shared`` by the ``size`` voters averaged together, shifted
        to ``frac(u + place/size)``."""
        if not self.stratified_votes:
            layout.draw(self._stream(own), t)
            return
        layout.draw(self._stream(shared), t)
        layout.uniform.add_(place / size).frac_()

    def _stream(self, stream: int) -> VoteStream:
        s = self._streams.get(stream)
        if s is None or s.seed != self.seed:
            s = self._streams[stream] = VoteStream(self.seed, stream)
        return s

    # ---------------------------------------------------------------- the hook side
    def exchange_bucket(self, call, hook_state) -> torch.futures.Future:
        """The VOTE plan on one bucket (see :class:`hf_onebit.hook.BucketCall`): local votes,
        exchanged on the ordered executor of this optimizer's exchange."""
        if call.plan is not Plan.VOTE:
            return super().exchange_bucket(call, hook_state)
        vote = self.exchange.vote_collective()
        layout = self._layouts.get(call.key)
        if layout is None:
            total = sum(p.numel() for p in call.params)
            layout = self._layout_for(call.key, call.params, call.buffer.device, vote.padded_length(total))
        layout.pending_t = call.t
        return self.exchange.submit(call.buffer.device, lambda: self._vote_bucket(layout, vote, call, hook_state))

    def _vote_bucket(self, layout: VoteLayout, vote, call, hook_state) -> torch.Tensor:
        """Runs on the communication thread: local state, local votes, exchange, ``.grad = q̄``.

        Flat over the bucket: a constant number of operations whatever the number of tensors in
        it (the draws, counter-based per parameter, are the exception: see ``VoteLayout.draw``).
        No value goes to the host (on CUDA that would wait for the GPU): the loss scale stays a
        0-dim tensor (its reciprocal in fp64, as ``1.0 / float(scale)`` was), the finiteness
        flag is a device boolean from the new ``b`` to the NaN written into ``q̄``.
        """
        buffer, grads, scale_t, t = call.buffer, call.grads, call.scale, call.t
        direct = layout.is_direct(buffer, grads)
        g32 = layout.gradients(buffer, grads, direct)  # overwritten below: the bucket becomes q̄
        if scale_t is not None:
            g32.mul_(torch.reciprocal(scale_t.to(torch.float64)))
        layout.threshold(g32)
        all_finite = self.exchange.all_finite(layout.nxt.b)  # NaN/inf gradient (or corrupted state) on this rank
        self._draw_worker_votes(layout, t, vote.topology)
        if vote.hierarchical:  # the node's draws (the worker votes are taken: reuse the buffer)
            topo = vote.topology
            self._draw(layout, t, NODE_STREAM + topo.node, STRATIFIED_STREAM + NODE_STREAM, topo.node, topo.nodes)
        qbar, valid = vote(layout.votes, all_finite, layout.numel, node_uniform=layout.uniform, scratch=layout.theta)
        qbar.masked_fill_(~valid, float("nan"))
        hook_state.note_attempt(t, call.attempt, valid)  # a repeat of step t is admitted only after a NaN vote
        if scale_t is not None:
            qbar.mul_(scale_t)
        layout.write(buffer, grads, direct, qbar)
        return buffer

    # ---------------------------------------------------------------- step
    #: A step whose vote average is not finite (some rank's gradient was not) leaves ``m, b`` and
    #: the parameters as they were (see :func:`~hf_onebit.optim.guards.check_finite_grads`, which
    #: then needs no host sync on a GPU): the commit keeps the current momenta, the update reads zeros.
    masks_non_finite_steps = True

    @torch.no_grad()
    def step(self, closure=None):
        loss, t, plan = self.begin_step(closure)
        synced = self.check_synced(t) if plan is Plan.VOTE else False
        index = self._index_of()
        # Parameters with a gradient, by group: Python bookkeeping only, no tensor operation.
        per_group = []
        for group in self.param_groups:
            ps = [p for p in group["params"] if p.grad is not None]
            for p in ps:
                if p.grad.is_sparse:
                    raise ValueError("hf_onebit optimizers do not support sparse gradients")
            per_group.append((group, ps))
        if synced:
            layouts = self._voted_layouts(t, [index[id(p)] for _, ps in per_group for p in ps])
            qs = {id(p): p.grad for _, ps in per_group for p in ps}  # q̄ (exact: multiples of 1/n)
        else:  # one process: the algorithm with n = 1, the local vote
            layouts, qs = self._local_votes(t, [(index[id(p)], p, p.grad) for _, ps in per_group for p in ps])
        ok = self.finite_ok  # a device flag: mask this step with it (None: nothing to mask)
        if ok is not None:
            qs = self._sanitized_votes(layouts, [p for _, ps in per_group for p in ps], qs, index, ok)
        for layout in layouts:
            layout.commit(ok)
        for group, ps in per_group:
            if ps:
                grads = [qs[id(p)] for p in ps]
                idxs = [index[id(p)] for p in ps]
                # fp32 stand-ins for low-precision gradients and parameters: the owners' buffers,
                # free between the hook (or the local vote) and the next hook
                q32 = None if all(q.dtype == torch.float32 for q in grads) else self._fp32_views(idxs, "scratch")
                work = None if all(p.dtype == torch.float32 for p in ps) else self._fp32_views(idxs, "uniform")
                vote_update_foreach_(ps, grads, lr=group["lr"], weight_decay=group["weight_decay"], q32=q32, work=work,
                                     ok=ok)
        self._after_step()
        return loss

    def _sanitized_votes(self, layouts: list[VoteLayout], params: list, qs: dict, index: dict, ok: torch.Tensor) -> dict:
        """``id(p) -> q`` as fp32 views of the layouts' ``scratch``, zero where ``ok`` is False.

        On a step some rank found non-finite the vote average is NaN everywhere (see the module
        docstring), and ``NaN·0`` is NaN: the votes are copied into the flat scratch (a no-op for
        the single process's own votes, which are there already) and filled with zero, a constant
        number of operations per layout, whatever the number of tensors."""
        for layout in layouts:
            layout.ensure_scratch()
        views = self._fp32_views([index[id(p)] for p in params], "scratch")
        src = [qs[id(p)] for p in params]
        moved = [(v, q) for v, q in zip(views, src) if v is not q]
        if moved:
            torch._foreach_copy_([v for v, _ in moved], [q for _, q in moved])
        bad = ok.logical_not()
        for layout in layouts:
            layout.scratch.masked_fill_(bad, 0.0)
        return {id(p): v for p, v in zip(params, views)}

    def _voted_layouts(self, t: int, idxs: list[int]) -> list[VoteLayout]:
        """The layouts holding the parameters ``idxs`` (those with a gradient), each voted for step
        ``t`` by the hook; raise naming a parameter the hook did not vote on."""
        layouts: dict[int, VoteLayout] = {}
        for idx in idxs:
            owner = self._owner.get(idx)
            if owner is None or owner.pending_t != t:
                raise RuntimeError(
                    f"BinSGDM: parameter {idx} has a gradient but the communication hook did not"
                    f" vote on it for step {t}"
                )
            layouts[id(owner)] = owner
        return list(layouts.values())

    def _local_votes(self, t: int, entries: list) -> tuple[list[VoteLayout], dict]:
        """One process: each rank's vote is the step (``n = 1``). ``entries``: ``(index, p, grad)``
        of the parameters with a gradient. Flat like the hook, over one layout per device of
        those parameters; returns the layouts (pending for ``t``) and ``id(p) -> q`` (fp32 ±1,
        views of the layout's scratch)."""
        by_device: dict[torch.device, list] = {}
        for entry in entries:
            by_device.setdefault(entry[1].device, []).append(entry)
        layouts, qs = [], {}
        for device, ents in by_device.items():
            params = [p for _, p, _ in ents]
            layout = self._layout_for(tuple(i for i, _, _ in ents), params, device, sum(p.numel() for p in params))
            scratch = layout.ensure_scratch()
            torch._foreach_copy_(layout.scratch_views, [g for _, _, g in ents])  # fp32, flat
            layout.threshold(scratch)
            self._draw_worker_votes(layout, t, None)
            scratch.fill_(-1.0).masked_fill_(layout.votes_n, 1.0)  # q = ±1, into the gradients' copy
            qs.update((id(p), q) for p, q in zip(params, layout.scratch_views))
            layout.pending_t = t
            layouts.append(layout)
        return layouts, qs

    def _fp32_views(self, idxs: list[int], kind: str) -> list[torch.Tensor]:
        """Each parameter's fp32 view (its shape) of its owner layout's ``scratch`` or ``uniform``."""
        out = []
        for idx in idxs:
            owner = self._owner[idx]
            if kind == "scratch":
                owner.ensure_scratch()
            out.append((owner.scratch_views if kind == "scratch" else owner.uniform_views)[owner.position[idx]])
        return out
