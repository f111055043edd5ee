"""The multi-tensor prologue of every ``step()``: parameters cut into lists that ``torch._foreach_*``
cores update together.

A step that loops over parameter tensors issues every eager op once per tensor: on a GPU each
is a kernel launch of ~5-10 µs of host time, so a model of a few hundred tensors spends
milliseconds per step launching. ``torch.optim.Adam``'s multi-tensor path instead
groups the tensors and applies each operation to a whole list at once; the cores of 1-bit Adam,
0/1 Adam and 1-bit LAMB do the same, over the :class:`Chunk` lists made here. Each ``_foreach_``
op computes, per element, exactly what the same eager op computes on one tensor (on CPU it *is*
that op, per tensor, below the dispatcher), so the cores keep the per-tensor code's operation
order and its results bitwise.

A chunk holds tensors that one list op may take together: one parameter group (its
hyperparameters), one device, one parameter dtype and one gradient dtype. Its temporaries are
:class:`~hf_onebit.optim.workspace.Workspace` views (fp32, made once per layout) or the results
of out-of-place list ops (one op where a copy into a view and an in-place op are two; transient,
as torch's own foreach Adam's), so a chunk is also bounded in size (:data:`CHUNK_NUMEL`): a
workspace slot holds at most that (or the largest tensor), not a copy of the model. The number
of chunks grows with the model's size, not with its number of tensors.

On CUDA, torch runs a list op as one fused launch only where each pair of tensors matches in
shape and dtype; a list of 0-dim per-tensor factors (1-bit LAMB's ratios and scalings) or of
bool masks takes its per-tensor fallback, still one op for the dispatcher. Masks exist only
on tensors with masked coordinates. The per-tensor reductions of a chunk (:func:`maxima`, and
:func:`reduced` over FSDP2 shards) are here too.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Iterator

import torch

from hf_onebit.optim.workspace import Workspace

if TYPE_CHECKING:
    from hf_onebit.optim.base import OneBitOptimizer

#: Largest number of elements of one chunk (unless a single tensor is larger), by device type:
#: on a GPU 64 MiB of fp32 per workspace slot (a list op is a launch: few, large lists); on CPU,
#: where a list op is a loop over its tensors anyway, 1 MiB, so that the ~10 passes of a step over
#: one chunk and its temporaries stay in the cache (streamed through memory chunk by chunk, the
#: whole model, a 1-bit Adam step took 2.5-4x longer than per tensor on 10M parameters).
CHUNK_NUMEL = {"cuda": 16 * 2**20, "cpu": 2**18}
_OTHER_DEVICES = 16 * 2**20


@dataclass
class Chunk:
    """Parameters with a gradient that one ``_foreach_`` op updates together.

    ``grads`` are fp32 (the gradients themselves, or copies into workspace slot :data:`GRAD_SLOT`),
    ``states`` the parameters' state dicts, ``group`` their parameter group.
    """

    params: list[torch.Tensor]
    grads: list[torch.Tensor] | None
    states: list[dict]
    group: dict
    workspace: Workspace

    def subset(self, index: list[int]) -> "Chunk":
        """The chunk of the parameters at positions ``index`` (e.g. those a condition holds for)."""
        return Chunk([self.params[i] for i in index], None if self.grads is None else [self.grads[i] for i in index],
                     [self.states[i] for i in index], self.group, self.workspace)

    def state(self, key: str) -> list[torch.Tensor]:
        """The state tensors ``key`` of every parameter, in order."""
        return [s[key] for s in self.states]

    def scratch(self, slot: int) -> list[torch.Tensor]:
        """fp32 temporaries shaped like the parameters (workspace ``slot``; contents undefined)."""
        return self.workspace.views(slot, self.params)

    def sanitized_grads(self, ok: torch.Tensor) -> list[torch.Tensor]:
        """The fp32 gradients where ``ok`` (a 0-dim device bool) holds, zeros where it does not
        (NaN included): one fill of a flat copy in workspace slot :data:`GRAD_SLOT`, two ops
        whatever the number of tensors. For steps masked on the device (see
        :func:`hf_onebit.optim.guards.check_finite_grads`)."""
        views = self.workspace.views(GRAD_SLOT, self.params)
        if self.grads is not views:  # low-precision gradients are in those views already
            torch._foreach_copy_(views, self.grads)
        flat = self.workspace.flat(GRAD_SLOT, self.params)
        flat.masked_fill_(ok.logical_not(), 0.0)  # NaN too: a fill, not a product
        return views

    @property
    def fp32(self) -> bool:
        return self.params[0].dtype == torch.float32

    def update_params_(self, update: Callable[[list[torch.Tensor]], object], slot: int) -> None:
        """Apply the in-place list ``update`` to the parameters in fp32, rounding once: bf16/fp16
        parameters go through fp32 copies in workspace ``slot``, written back."""
        if self.fp32:
            update(self.params)
            return
        work = self.scratch(slot)
        torch._foreach_copy_(work, self.params)
        update(work)
        torch._foreach_copy_(self.params, work)


#: Workspace slot of the fp32 copies of low-precision gradients (the cores use 0..3).
GRAD_SLOT = 7


def chunks(opt: OneBitOptimizer, init_state: Callable[[torch.Tensor], dict] | None = None, *,
           skip_empty: bool = False, params: list[torch.Tensor] | None = None,
           ok: torch.Tensor | None = None) -> Iterator[Chunk]:
    """The :class:`Chunk` lists of every parameter with a gradient, in parameter order within each.

    Sparse gradients are refused, ``init_state(p)`` makes a parameter's state at its first use,
    ``skip_empty`` leaves out parameters with no elements. ``params``: these parameters instead,
    gradient or not (the chunks' ``grads`` are then ``None``). ``ok``: the device flag of a step
    masked on the device (:attr:`~hf_onebit.optim.base.OneBitOptimizer.finite_ok`): the gradients
    read as zero where it fails (:meth:`Chunk.sanitized_grads`).
    """
    ws = opt._workspace
    wanted = None if params is None else {id(p) for p in params}
    for group in opt.param_groups:
        lists: dict[tuple, list] = {}
        for p in group["params"]:
            g = p.grad if wanted is None else None
            if wanted is not None and id(p) not in wanted:
                continue
            if (wanted is None and g is None) or (skip_empty and p.numel() == 0):
                continue
            if g is not None and g.is_sparse:
                raise ValueError("hf_onebit optimizers do not support sparse gradients")
            key = (p.device, p.dtype, None if g is None else g.dtype)
            runs = lists.setdefault(key, [[[], 0]])  # [params, their elements], the last one filling
            if runs[-1][0] and runs[-1][1] + p.numel() > CHUNK_NUMEL.get(p.device.type, _OTHER_DEVICES):
                runs.append([[], 0])
            runs[-1][0].append(p)
            runs[-1][1] += p.numel()
        for (_, _, grad_dtype), runs in lists.items():
            for run, _ in runs:
                states = [init_state(p) if init_state is not None else None for p in run]
                grads = None if grad_dtype is None else [p.grad for p in run]
                if grads is not None and grad_dtype != torch.float32:
                    fp32 = ws.views(GRAD_SLOT, run)
                    torch._foreach_copy_(fp32, grads)
                    grads = fp32
                chunk = Chunk(run, grads, states, group, ws)
                if ok is not None and grads is not None:
                    chunk.grads = chunk.sanitized_grads(ok)
                yield chunk


def by_group(opt: OneBitOptimizer, params: list[torch.Tensor], value: Callable[[dict], object]) -> list[tuple[object, list[int]]]:
    """The positions in ``params`` grouped by ``value(parameter group)`` (e.g. ``β1``): one list op
    per distinct value, in first-seen order."""
    groups = opt._group_map()
    out: dict = {}
    for i, p in enumerate(params):
        out.setdefault(value(groups[id(p)]), []).append(i)
    return list(out.items())


def masked_factor(value: float, ok: torch.Tensor | None, otherwise: float = 1.0):
    """The factor a list op applies on a step masked on the device: ``value`` where the flag
    ``ok`` holds, ``otherwise`` (the neutral factor: 1 for a decay, 0 for an update) where it
    does not, as a 0-dim device tensor (no host read); ``value`` itself without a flag."""
    return value if ok is None else torch.where(ok, value, otherwise)


def select_(state: list[torch.Tensor], new: list[torch.Tensor], ok: torch.Tensor) -> None:
    """``state = new`` where the device flag ``ok`` holds, else unchanged, with no host read:
    ``state·(1-ok) + new·ok`` (both finite: ``x·0 = 0``; ``new`` is consumed)."""
    okf = ok.float()
    torch._foreach_mul_(new, okf)
    torch._foreach_mul_(state, 1 - okf)
    torch._foreach_add_(state, new)


def clip_roots_(roots: list[torch.Tensor], by: list[torch.Tensor], limit: float,
                scratch: list[torch.Tensor] | None = None) -> None:
    """The update clip (docs/algorithms.md, "Update clip"): ``roots = max(roots, |by|·(1/limit))``.

    1-bit Adam, 0/1 Adam and 1-bit LAMB divide by ``max(sqrt(v̂), |m|/limit) + eps`` where their
    variance is stale, so no coordinate's adaptive step exceeds ``limit`` (``update_clip`` times the
    method's own scale: Adam's momentum bias correction, 0/1 Adam's ``λ`` at a sync). ``|by|`` goes
    into ``scratch``, or into new tensors without it."""
    if scratch is None:
        scratch = torch._foreach_abs(by)
    else:
        torch._foreach_copy_(scratch, by)
        torch._foreach_abs_(scratch)
    if limit != 1.0:  # x·1 = x: the HF default (update_clip 1.0) skips a pass
        torch._foreach_mul_(scratch, 1 / limit)
    torch._foreach_maximum_(roots, scratch)


def logical(t: torch.Tensor) -> torch.Tensor:
    """``t`` itself if contiguous, else a contiguous copy: reductions over it then sum in logical
    order, so a channels_last tensor reduces bitwise like the same values stored contiguously."""
    return t if t.is_contiguous() else t.contiguous()


def maxima(xs: list[torch.Tensor]) -> torch.Tensor:
    """Each tensor's maximum, stacked; 0 for an empty one (an FSDP2 shard with no elements has
    no ratio: 0 leaves the maximum over the other shards, whose ratios are positive)."""
    full = [x for x in xs if x.numel()]
    each = iter(torch._foreach_max(full) if full else ())
    return torch.stack([next(each) if x.numel() else x.new_zeros(()) for x in xs])


def reduced(vectors: list[torch.Tensor], reduce) -> Iterator[torch.Tensor]:
    """``reduce`` of all ``vectors`` in one call (one collective), cut back to their lengths."""
    if not vectors:
        return iter(())
    return iter(reduce(torch.cat(vectors)).split([len(v) for v in vectors]))
