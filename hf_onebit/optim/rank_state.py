"""This rank's own state: error buffers of every segment, the last bucket layout, the traffic so far.

:meth:`OneBitOptimizer.rank_state_dict` and its pair call these; subclasses add their own entries
(0/1 Adam's local accumulators, BinSGDM's vote state). Saved by :mod:`hf_onebit.checkpoint`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from hf_onebit.optim.base import OneBitOptimizer


def save(opt: OneBitOptimizer) -> dict:
    """The base's entries: error buffers of every segment, the last layout, the traffic so far."""
    return {
        "world_size": opt.world_size,
        "nodes": node_layout(opt),
        "rank": opt.rank,
        "steps_done": opt.steps_done,
        # The error buffers (restored but unused state included) and this rank's traffic so far,
        # so cumulative figures continue across a resume: "segments" and "comm_total".
        **opt.exchange.state_dict(),
        # The last bucket layout DDP used: a run resumed before compression started (e.g.
        # exactly at freeze_step) splits DDP's one-bucket first iteration along it, as the
        # uninterrupted run's buckets were.
        "layout": list(opt.hook_state.layout) if opt.hook_state is not None else [],
    }


def node_layout(opt: OneBitOptimizer) -> list[int] | None:
    """``[nodes, ranks per node]`` that the error buffers belong to (the exchange by node),
    ``None`` for the flat exchange, and for an optimizer without error buffers (BinSGDM)."""
    nodes = opt.exchange.nodes() if opt.keeps_error_buffers else None
    return None if nodes is None else [nodes.nodes, nodes.local_size]


def reset(opt: OneBitOptimizer) -> None:
    """Error buffers start afresh (zero)."""
    opt.exchange.segments.clear()


def load(opt: OneBitOptimizer, state: dict) -> None:
    """Restore what :func:`save` wrote; segments are rebuilt lazily as buckets arrive."""
    if state["world_size"] != opt.world_size:
        raise ValueError(
            f"per-rank compression state was saved with {state['world_size']} ranks, this run has"
            f" {opt.world_size}: resume with {state['world_size']} ranks, or start the per-rank state afresh with"
            " load_rank_state(..., on_mismatch='reset') (user guide: API reference, 'Per-rank state')"
        )
    saved = state["nodes"]
    if saved != node_layout(opt):
        def describe(layout):
            return "the flat exchange" if layout is None else f"the exchange by node ({layout[0]} nodes of {layout[1]} ranks)"
        raise ValueError(
            f"per-rank compression state was saved with {describe(saved)}, this run uses {describe(node_layout(opt))};"
            " its error buffers belong to other buffers: resume with the same node layout (LOCAL_WORLD_SIZE, hierarchical),"
            " or start the per-rank state afresh with on_mismatch='reset' (user guide: API reference, 'Per-rank state')"
        )
    opt.exchange.load_state_dict(state, state["layout"])
