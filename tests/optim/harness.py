"""A model whose gradients are chosen by the test, trained under DDP with an hf_onebit optimizer.

``loss = Σ_k (p_k · c_k).sum()`` has gradient ``c_k`` for parameter ``k``, so every rank's
gradient at every step is fixed in advance (``fixed_grads``) and a single-process simulation
can be fed exactly the same numbers.
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

SHAPES = [(64, 40), (3000,), (7,), (1000,), (33, 3)]


class FixedGradModel(torch.nn.Module):
    def __init__(self, seed: int = 0) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.ps = torch.nn.ParameterList([torch.nn.Parameter(torch.randn(s, generator=g)) for s in SHAPES])

    def forward(self, coeffs):
        return sum((p * c).sum() for p, c in zip(self.ps, coeffs))


#: with ``late=True``, parameter 1's coordinates 50..79 get their first gradient at this step
LATE_FROM = 5


def backward_and_step(loss: torch.Tensor, opt, scaler=None) -> None:
    """``loss.backward(); opt.step()``, or the same through a ``GradScaler``."""
    if scaler is None:
        loss.backward()
        opt.step()
    else:
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()


def fixed_grads(step: int, rank: int, tiny: bool = False, late: bool = False) -> list[torch.Tensor]:
    """Gradient of every parameter on ``rank`` at ``step`` (1-based); rank-dependent and varied.

    ``tiny``: parameter 3's first 20 coordinates get gradients of ~1e-12 (like attention key biases).
    ``late``: parameter 1's coordinates 50..79 are zero before step ``LATE_FROM`` (embedding rows
    whose word first appears then).
    """
    g = torch.Generator().manual_seed(7919 * step + 104729 * (rank + 1))
    out = []
    for k, s in enumerate(SHAPES):
        c = torch.randn(s, generator=g) * (0.5 + rank) * (1 + 0.3 * k)
        if k == 1:  # an "unused embedding row": always exactly zero on every rank
            c[:50] = 0
            if late and step < LATE_FROM:
                c[50:80] = 0
        if k == 3 and tiny:  # "attention key biases": tiny but non-zero (RMS far below eps)
            c[:20] *= 1e-12
        out.append(c)
    return out


def whole(p: torch.Tensor) -> torch.Tensor:
    """A copy of the whole parameter (gathered from its shards under FSDP2)."""
    p = p.detach()
    return (p.full_tensor() if hasattr(p, "full_tensor") else p).clone()


def build_optimizer(name: str, params, kwargs: dict):
    """``name`` is a class exported by ``hf_onebit`` or ``"module.path:ClassName"``; arguments left
    out take the papers' values (``defaults="paper"``, the spec the simulations implement) unless
    ``kwargs`` asks for ``defaults="library"``."""
    import importlib

    kwargs = {"defaults": "paper", **kwargs}
    if ":" in name:
        module, cls = name.split(":")
        return getattr(importlib.import_module(module), cls)(params, **kwargs)
    import hf_onebit

    return getattr(hf_onebit, name)(params, **kwargs)


def train(rank, world_size, opt_name, opt_kwargs, steps, save_dir=None, save_at=None, resume_dir=None,
          bucket_cap_mb=0.01, start_step=0, record_steps=False, tiny_grads=False, late_grads=False, shard_size=None,
          sharded_checkpoint=False, on_mismatch="error"):
    """Train for ``steps`` steps; return the parameters after every step and some stats.

    With ``save_dir``/``save_at`` the optimizer, model and per-rank state are saved after step
    ``save_at``; with ``resume_dir`` they are loaded before training continues at ``start_step``.
    With ``record_steps`` the result also holds ``"steps"``: for every step its plan and the
    traffic it caused (``opt.exchange.last_step``). ``tiny_grads``, ``late_grads``: see :func:`fixed_grads`.
    ``shard_size``: FSDP2 instead of DDP, the model sharded over replicas of that many ranks
    (:func:`hf_onebit.replica_mesh`); the history then holds the whole parameters.
    ``sharded_checkpoint`` (with ``shard_size``): save and resume through distributed checkpoints,
    the model's with DCP and the optimizer's with :func:`hf_onebit.save_sharded` /
    :func:`hf_onebit.load_sharded` (``on_mismatch`` goes to the latter), in place of per-rank files.
    """
    import hf_onebit

    torch.manual_seed(0)
    model = FixedGradModel()
    if shard_size is not None:  # FSDP2 replaces the parameters: build the optimizer after fully_shard
        from torch.distributed.fsdp import fully_shard

        fully_shard(model, mesh=hf_onebit.replica_mesh(shard_size, "cpu")["shard"])
    opt = build_optimizer(opt_name, model.parameters(), opt_kwargs)
    # FSDP2: every rank saves its own shards of the parameters and of the optimizer state
    own = "" if shard_size is None else f"_rank{rank}"
    if resume_dir is not None and sharded_checkpoint:
        import torch.distributed.checkpoint as dcp

        saved = model.state_dict()
        dcp.load(saved, checkpoint_id=os.path.join(resume_dir, "model"))
        model.load_state_dict(saved)
    elif resume_dir is not None:
        saved = torch.load(os.path.join(resume_dir, f"model{own}.pt"), weights_only=True)
        if shard_size is None:
            model.load_state_dict(saved)
        else:
            with torch.no_grad():
                for p, local in zip(model.parameters(), saved):
                    p.to_local().copy_(local)
        opt.load_state_dict(torch.load(os.path.join(resume_dir, f"optimizer{own}.pt"), weights_only=True))
    ddp = DDP(model, bucket_cap_mb=bucket_cap_mb) if shard_size is None else model
    hf_onebit.attach(ddp, opt)
    if resume_dir is not None and sharded_checkpoint:
        hf_onebit.load_sharded(opt, os.path.join(resume_dir, "optimizer"), on_mismatch)
    elif resume_dir is not None:
        path = os.path.join(resume_dir, f"rank{rank}.pt")
        opt.load_rank_state_dict(torch.load(path, weights_only=True))
    history = []
    per_step = []
    for step in range(start_step + 1, start_step + steps + 1):
        plan = opt.plan().value if record_steps else None
        coeffs = fixed_grads(step, rank, tiny_grads, late_grads)
        loss = ddp(coeffs)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        history.append([whole(p) for p in model.parameters()])
        if record_steps:
            per_step.append({"plan": plan, "layout": list(opt.hook_state.layout) if opt.hook_state else [],
                             **opt.exchange.last_step.as_dict()})
        if save_dir is not None and step == save_at and sharded_checkpoint:
            import torch.distributed.checkpoint as dcp

            dcp.save(model.state_dict(), checkpoint_id=os.path.join(save_dir, "model"))
            hf_onebit.save_sharded(opt, os.path.join(save_dir, "optimizer"))
        elif save_dir is not None and step == save_at:
            if shard_size is not None:
                torch.save([p.detach().to_local().clone() for p in model.parameters()],
                           os.path.join(save_dir, f"model{own}.pt"))
                torch.save(opt.state_dict(), os.path.join(save_dir, f"optimizer{own}.pt"))
            elif rank == 0:
                torch.save(model.state_dict(), os.path.join(save_dir, "model.pt"))
                torch.save(opt.state_dict(), os.path.join(save_dir, "optimizer.pt"))
            torch.save(opt.rank_state_dict(), os.path.join(save_dir, f"rank{rank}.pt"))
            dist.barrier()
    segments = sorted(opt.exchange.segments.keys())
    out = {"history": history, "segments": segments, "stats": opt.onebit_stats(), "global": opt.global_state(),
           # the segments that hold a work buffer, and the bucket layout of the last step
           "work_held": sorted(seg.key for seg in opt.exchange.segments if seg._work is not None),
           "last_layout": sorted(opt.hook_state.layout) if opt.hook_state is not None and opt.hook_state.layout else []}
    if record_steps:
        out["steps"] = per_step
    return out
