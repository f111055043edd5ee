"""A DDP bucket seen per parameter: its gradients at their logical positions, and the compressed
exchange of a bucket (prepare each parameter, compress each segment, finish each parameter)."""

from __future__ import annotations

import torch
import torch.distributed as dist

from hf_onebit.comm.segments import Segment
from hf_onebit.optim import OneBitOptimizer


def _dense(t: torch.Tensor) -> bool:
    """Whether ``t``'s strides cover its elements once without gaps (channels_last, transposes)."""
    expected = 1
    for stride, size in sorted((s, n) for n, s in zip(t.shape, t.stride()) if n != 1):
        if stride != expected:
            return False
        expected *= size
    return True


def bucket_gradients(bucket: dist.GradBucket) -> list:
    """The bucket's per-parameter gradients, as views with each parameter's own strides.

    DDP fills a bucket in each parameter's *memory* order (its bucket views copy the
    parameter's strides when they are dense, e.g. channels_last or a transposed view), but
    ``GradBucket.gradients()`` returns row-major views of the same memory, which for such a
    parameter scramble its coordinates. Re-view them as DDP wrote them, so every coordinate
    is read (and written back) at its logical position.
    """
    out = []
    for p, g in zip(bucket.parameters(), bucket.gradients()):
        if not p.is_contiguous() and _dense(p):
            g = g.as_strided(p.shape, p.stride())  # same storage offset as DDP's bucket view
        out.append(g)
    return out


def compress_bucket(opt: OneBitOptimizer, call, segments: list[Segment]) -> torch.Tensor:
    """Runs on the communication thread: the optimizer prepares what the parameters of each
    segment send, the segment is compressed and exchanged, the optimizer writes their ``.grad``
    (list ops per segment, :meth:`~hf_onebit.optim.OneBitOptimizer.prepare_bucket`, so the cost
    does not grow with the number of tensors).

    ``call`` is the hook's :class:`~hf_onebit.hook.state.BucketCall`. Its ``scale`` (the loss
    scaler's 0-dim scale tensor, or ``None``) stays on the device: a
    ``float()`` of it would stall the host until the GPU caught up, once per bucket. Its
    reciprocal is taken in fp64, as Python's ``1.0 / float(scale)`` was, so the unscaled
    values are bitwise those of a host-side scale.
    """
    plan, params, buffer, grads, scale = call.plan, call.params, call.buffer, call.grads, call.scale
    width = opt.exchange_width(plan)
    inv = None if scale is None else torch.reciprocal(scale.to(torch.float64))
    all_params = opt.params_in_order()
    seg0 = segments[0]
    # In place only when every gradient is contiguous: DDP lays a bucket out in each
    # parameter's memory order (channels_last, transposed views), while optimizer state and
    # compression work in logical order; other buckets go through the segment's work buffer.
    in_place = (
        len(segments) == 1 and buffer.dtype == torch.float32 and seg0.numel == buffer.numel()
        and all(g.is_contiguous() for g in grads)
        and len(seg0.key) == len(params) and all(all_params[i] is p for i, p in zip(seg0.key, params))
    )
    if in_place:
        # The bucket is the segment: prepare, compress and finish in the bucket's own buffer.
        # A work buffer left by a multi-segment bucket (the first one after a resume or a
        # re-wrap) is no longer needed: keeping it would cost 4 bytes per parameter for good.
        # (Its last use, last step's exchange, is complete: DDP waited for it before step().)
        seg0.release_work()
        opt.prepare_bucket(plan, params, grads, grads, inv)  # the gradients are the bucket: in place
        seg0.comm(buffer, width=width)
        opt.finish_bucket(plan, params, grads, grads, scale)
        return buffer
    position = {id(p): k for k, p in enumerate(params)}
    for seg in segments:
        seg_params, views = seg.shaped_views(all_params)
        seg_grads = [grads[position[id(p)]] for p in seg_params]
        opt.prepare_bucket(plan, seg_params, seg_grads, views, inv)
        seg.comm(seg.work, width=width)
        opt.finish_bucket(plan, seg_params, views, seg_grads, scale)
    return buffer
