"""0/1 Adam's local-phase state: what each rank keeps between syncs, and how it is saved and restored.

Between two syncs every rank takes its own steps, so its parameters, momentum ``exp_avg``,
accumulator ``u`` (``momentum_accumulator``) and ``λ`` (``lr_sum``) are its own. They travel in
``rank_state_dict()`` (the synced point ``synced_param`` is the same on every rank and stays in
``state_dict()``), and a resume writes this rank's own parameters back, so a run stopped between
two syncs continues bitwise.
"""

from __future__ import annotations

import torch


class LocalPhaseState:
    """Mixin of :class:`~hf_onebit.optim.zeroone_adam.ZeroOneAdam` (before ``OneBitOptimizer`` in its bases)."""

    def _init_local_state(self, p: torch.Tensor) -> dict:
        """The local-phase state; created when the local phase starts (parameters are synced then)."""
        state = self._init_state(p)
        if "momentum_accumulator" not in state:
            state["momentum_accumulator"] = torch.zeros_like(p, dtype=torch.float32, memory_format=torch.preserve_format)
            state["lr_sum"] = 0.0
            if self.world_size > 1:
                state["synced_param"] = p.detach().to(dtype=torch.float32, copy=True)
        return state

    def rank_state_dict(self) -> dict:
        """Base per-rank state plus, in the local phase, this rank's parameters and local state.

        Only tensors, ints, floats and dicts: ``torch.load(..., weights_only=True)`` reads it.
        """
        sd = super().rank_state_dict()
        if self.steps_done > self.var_freeze_step:
            local: dict[int, dict] = {}
            for i, p in enumerate(self.params_in_order()):
                state = self.state.get(p, {})
                entry: dict = {"param": p.detach().clone()}
                for k in ("exp_avg", "momentum_accumulator"):  # synced_param is the same everywhere
                    if k in state:
                        entry[k] = state[k].detach().clone()
                if "lr_sum" in state:
                    entry["lr_sum"] = float(state["lr_sum"])
                local[i] = entry
            sd["local"] = local
        return sd

    def reset_rank_state(self) -> None:
        """Error buffers zero; in the local phase, start a fresh sync interval from the current
        parameters (those of the model checkpoint, identical on every rank after DDP's broadcast):
        the last synced point becomes ``p``, the accumulator and ``λ`` become zero."""
        super().reset_rank_state()
        if self.steps_done <= self.var_freeze_step:
            return
        with torch.no_grad():
            for p in self.params_in_order():
                state = self.state.get(p)
                if not state:
                    continue
                if "synced_param" in state:
                    state["synced_param"].copy_(p)
                if "momentum_accumulator" in state:
                    state["momentum_accumulator"].zero_()
                if "lr_sum" in state:
                    state["lr_sum"] = 0.0

    def load_rank_state_dict(self, state: dict) -> None:
        """Restore :meth:`rank_state_dict` output, including this rank's own parameters.

        Call it after ``load_state_dict`` and after wrapping the model in DDP (DDP broadcasts
        rank 0's parameters when it is constructed).
        """
        super().load_rank_state_dict(state)
        local = state.get("local")
        if local is None:
            return
        if int(state["steps_done"]) != self.steps_done:
            raise ValueError(
                f"per-rank state was saved after step {state['steps_done']} but the optimizer is at step"
                f" {self.steps_done}: call optimizer.load_state_dict(...) from the same checkpoint first"
            )
        params = self.params_in_order()
        if len(local) != len(params):
            raise ValueError(f"per-rank state holds {len(local)} parameters, the optimizer has {len(params)}")
        with torch.no_grad():
            for i, entry in local.items():
                p = params[i]
                p.copy_(entry["param"])
                st = self.state[p]
                for k in ("exp_avg", "momentum_accumulator"):
                    if k in entry:
                        st[k] = entry[k].to(device=p.device, dtype=torch.float32, copy=True)
                if "lr_sum" in entry:
                    st["lr_sum"] = float(entry["lr_sum"])
