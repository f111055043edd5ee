"""BinSGDM's per-rank momenta ``m, b``: where they live, how they are committed, saved and restored.

Each rank keeps its own ``m`` and ``b`` (``optimizer.state[p]["momentum"]``,
``["abs_momentum"]``, views of the flat buffers of the parameter's bucket layout). The hook writes
the new ones into *pending* buffers; ``step()`` commits them with a swap, so a step that never
happens leaves them untouched. They differ per rank, so
they are not in ``state_dict()`` but in ``rank_state_dict()``; a restored copy is applied lazily,
at the parameter's first use, after checking that it belongs to the same step.
"""

from __future__ import annotations

import torch

from hf_onebit.optim.base import logger
from hf_onebit.optim.vote_core import VoteLayout, build_layout


class VoteMomenta:
    """Mixin of :class:`~hf_onebit.optim.binsgdm.BinSGDM` (before ``OneBitOptimizer`` in its bases).

    The momenta of the parameters a bucket holds live in that bucket's
    :class:`~hf_onebit.optim.vote_core.VoteLayout` (flat buffers, the state entries views of
    them); ``_owner`` maps a parameter index to its layout.
    """

    def init_vote_momenta(self) -> None:
        self._layouts: dict[tuple, VoteLayout] = {}  # key (parameter indices) -> its layout
        self._owner: dict[int, VoteLayout] = {}  # parameter index -> the layout holding its m, b
        self._loaded_vote_state: dict | None = None
        self._warned_fresh = False

    def _materialize(self, idx: int, p: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(m, b)`` of parameter ``idx`` now: restored from per-rank state, the current ones, or
        zeros. Called when a layout that will hold them is built."""
        state = self.state[p]
        loaded = self._loaded_vote_state
        if loaded is not None and idx in loaded["params"]:
            if loaded["steps_done"] != self.steps_done:
                raise RuntimeError(
                    f"BinSGDM: the per-rank state was saved after step {loaded['steps_done']}, but the"
                    f" optimizer is at step {self.steps_done}: load the state_dict() and the per-rank state"
                    " of the same checkpoint"
                )
            entry = loaded["params"].pop(idx)
            return tuple(entry[name].to(device=p.device, dtype=torch.float32).reshape(p.shape)
                         for name in ("momentum", "abs_momentum"))
        if "momentum" not in state:
            if self.steps_done > 0 and not self._warned_fresh:
                self._warned_fresh = True
                logger.warning(
                    "hf_onebit BinSGDM: step %d without per-rank state for rank %d: m and b restart from zero"
                    " (save and load rank_state_dict() with the checkpoint to resume exactly)",
                    self.steps_done + 1, self.rank,
                )
            zeros = torch.zeros(p.shape, dtype=torch.float32, device=p.device)
            return zeros, zeros
        return state["momentum"], state["abs_momentum"]

    def _layout_for(self, key: tuple, params: list, device: torch.device, padded_length: int) -> VoteLayout:
        """The layout of the parameters ``key`` (built at their first vote, or when DDP rebuilt its
        buckets: the layouts it overlaps are dropped, their momenta copied over once)."""
        layout = self._layouts.get(key)
        if layout is None:
            for other in [k for k in self._layouts if set(k) & set(key)]:
                del self._layouts[other]
            momenta = [self._materialize(idx, p) for idx, p in zip(key, params)]
            groups = self._group_map()
            layout = build_layout(key, params, [groups[id(p)] for p in params], [self.state[p] for p in params],
                                  device, padded_length)
            layout.adopt(momenta)
            self._layouts[key] = layout
            for idx in key:
                self._owner[idx] = layout
        return layout

    def state_dict(self) -> dict:
        """Shared state only (step counter, seed, hyper-parameters); never communicates.

        ``m`` and ``b`` differ per rank and are left out: see :meth:`rank_state_dict`.
        """
        sd = super().state_dict()
        state = {}
        for i, s in sd["state"].items():
            rest = {k: v for k, v in s.items() if k not in ("momentum", "abs_momentum")}
            if rest:
                state[i] = rest
        sd["state"] = state
        return sd

    def load_state_dict(self, state_dict: dict) -> None:
        super().load_state_dict(state_dict)
        self._forget_layouts()  # torch rebuilt every state dict: the layouts' views are gone

    def rank_state_dict(self) -> dict:
        """This rank's ``m``, ``b`` per parameter index (plus the base's entries and the seed)."""
        sd = super().rank_state_dict()
        params = {}
        for idx, p in enumerate(self.params_in_order()):
            s = self.state.get(p, {})
            if "momentum" in s:
                params[idx] = {"momentum": s["momentum"].detach().clone(), "abs_momentum": s["abs_momentum"].detach().clone()}
        loaded = self._loaded_vote_state
        if loaded is not None:  # restored but not used yet: keep it
            for idx, entry in loaded["params"].items():
                params.setdefault(idx, entry)
        sd["binsgdm"] = {"seed": self.seed, "params": params}
        return sd

    def reset_rank_state(self) -> None:
        """Error state (none here) and this rank's ``m, b`` start from zero."""
        super().reset_rank_state()
        self._forget_momenta()
        self._loaded_vote_state = None
        self._warned_fresh = True  # the caller already warned about the reset

    def load_rank_state_dict(self, state: dict) -> None:
        """Restore :meth:`rank_state_dict` output of *this* rank; applied lazily at first use."""
        super().load_rank_state_dict(state)
        if state["rank"] != self.rank:
            raise ValueError(f"BinSGDM: per-rank state of rank {state['rank']} loaded on rank {self.rank}")
        vote = state.get("binsgdm")
        if vote is None:
            raise ValueError("BinSGDM: this per-rank state was not saved by BinSGDM (no 'binsgdm' entry)")
        self._forget_momenta()
        self._loaded_vote_state = {"steps_done": int(state["steps_done"]), "params": dict(vote["params"])}

    def _forget_momenta(self) -> None:
        """Drop every parameter's ``m, b`` and the pending copies (they are rebuilt at first use)."""
        for p in self.params_in_order():
            s = self.state.get(p)
            if s:
                s.pop("momentum", None)
                s.pop("abs_momentum", None)
        self._forget_layouts()

    def _forget_layouts(self) -> None:
        """Drop every layout (rebuilt at the next vote from whatever the state then holds)."""
        self._layouts.clear()
        self._owner.clear()
