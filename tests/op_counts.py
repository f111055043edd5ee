"""Count the aten ops a step dispatches: what a GPU pays in kernel launches, made visible on CPU.

On CUDA every aten op on a tensor is (at least) one kernel launch of ~5-10 µs of host time, so a
per-tensor Python loop of eager ops costs milliseconds per step on a model of a few hundred
tensors. On this CPU-only machine the same ops are cheap, so they are *counted*: a
``TorchDispatchMode`` sees every aten op that reaches the dispatcher. The counts here are the
contract the optimizers' ``foreach`` cores and the hook keep (tests/optim/test_op_counts.py,
tests/hook/test_op_counts.py):

* the count must not grow with the number of parameter tensors (``torch._foreach_*`` ops are
  one op per list, whatever its length);
* a step should cost a small multiple of ``torch.optim.AdamW(foreach=True)``'s.

Only ops with at least one tensor argument of one or more dimensions are counted (0-d scalars are
what ``foreach`` cores use for hyper-parameters, and ``aten.detach`` of a 0-d tensor is not a
kernel); views count, since the dispatcher sees them, but a core that creates views per tensor
grows with the tensor count and is caught.

The hook runs partly off the calling thread (on CPU its exchange jobs run on the group's
:class:`~hf_onebit.comm.executor.ThreadExecutor`; on CUDA they run inline): :func:`counting`
therefore also counts the jobs submitted to any executor while it is on.
"""

from __future__ import annotations

import contextlib
import threading
from collections import Counter

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten


def _has_array(args, kwargs) -> bool:
    flat, _ = tree_flatten((args, kwargs))
    for a in flat:
        if isinstance(a, torch.Tensor) and a.dim() >= 1:
            return True
        if isinstance(a, (list, tuple)) and any(isinstance(t, torch.Tensor) and t.dim() >= 1 for t in a):
            return True
    return False


class OpCount:
    """A thread-safe tally of dispatched aten ops (by name, in :attr:`ops`)."""

    def __init__(self) -> None:
        self.ops: Counter = Counter()
        self._lock = threading.Lock()

    @property
    def total(self) -> int:
        return sum(self.ops.values())

    def add(self, name: str) -> None:
        with self._lock:
            self.ops[name] += 1

    def mode(self) -> TorchDispatchMode:
        """A fresh dispatch mode adding to this tally (one per thread: modes are thread-local)."""
        tally = self

        class _Counting(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                kwargs = kwargs or {}
                if _has_array(args, kwargs):
                    tally.add(str(func.overloadpacket.__name__))
                return func(*args, **kwargs)

        return _Counting()


@contextlib.contextmanager
def counting(tally: OpCount):
    """Count into ``tally`` the ops of this thread (and of autograd's threads, which inherit the
    mode) and of every job submitted to a ``ThreadExecutor`` meanwhile."""
    from hf_onebit.comm import executor

    original = executor.ThreadExecutor.submit

    def submit(self, job):
        def counted():
            with tally.mode():
                return job()

        return original(self, counted)

    executor.ThreadExecutor.submit = submit
    try:
        with tally.mode():
            yield tally
    finally:
        executor.ThreadExecutor.submit = original


class Stack(torch.nn.Module):
    """``tensors // 2`` linear layers (weight and bias each) of ``width``: a model of ``tensors``
    parameter tensors whose gradients all differ."""

    def __init__(self, tensors: int, width: int = 16) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.layers = torch.nn.ModuleList(torch.nn.Linear(width, width) for _ in range(tensors // 2))
        with torch.no_grad():
            for p in self.parameters():
                p.copy_(torch.randn(p.shape, generator=g) / width**0.5)

    def forward(self, x):
        for layer in self.layers:
            x = torch.tanh(layer(x))
        return x
