"""No host synchronisation in the hook or in ``step()`` once a phase is steady (issue 12).

On CUDA every Python conversion of a device tensor (``bool(t)``, ``float(t)``, ``t.item()``,
``t.tolist()``, ``.cpu()``, ``.numpy()``, a ``torch.tensor`` built from a Python list) makes
the host wait until the GPU has caught up, which stalls backward between buckets and the next
step's launch. On this CPU-only machine such conversions cost nothing, so they are *counted*:
while 2 (4) gloo ranks train, ``torch.Tensor``'s conversions and ``torch.tensor`` are patched to
record every call that hf_onebit code makes (the innermost hf_onebit frame on the stack names
the culprit) on a non-empty tensor during backward (the hook and its communication jobs, on
whatever thread) and ``step()``. Attach, construction, forward and ``state_dict`` are not
watched.

What may appear:

* steady steps: nothing at all, with a ``GradScaler`` attached and with ``check_finite=False``;
  with the default ``check_finite=True`` and no scaler, nothing either where the check is
  deferred (a GPU's: the step masked on the device, the verdict read a step later from pinned
  memory; forced here on CPU), else exactly one call per step, from ``_all_finite`` (the check
  that refuses NaN before it reaches the state, which CPU tensors read at no cost);
* the step that starts a phase (and step 1, DDP's one-bucket iteration): also one-time setup,
  only from :data:`ONE_TIME` (the masks frozen at the end of the warmup, a compression
  segment's index tensor, the vote packing weights made once per device).

Host code by construction is exempt: the numba CPU kernels (``kernels/cpu*.py``; on CUDA the
Triton kernels run, which ``hf-onebit check`` watches with ``torch.cuda.set_sync_debug_mode``)
and numpy's Philox in ``VoteStream.uniform_`` (CUDA tensors use torch's generator). BinSGDM's
vote packing is forced onto its device path, which CUDA takes.
"""

from __future__ import annotations

import functools
import os
import sys
import threading

import pytest
import torch

from tests.distributed import run_distributed
from tests.optim.harness import backward_and_step

#: ``torch.Tensor`` methods that read values on the host.
CONVERSIONS = ("__bool__", "__float__", "__int__", "__index__", "item", "tolist", "numpy", "cpu")

#: (file under hf_onebit/, function, conversion): host-side by construction, never run on CUDA.
EXEMPT = {("kernels/cpu.py", "*", "*"), ("kernels/cpu_votes.py", "*", "*"), ("optim/vote_streams.py", "uniform_", "numpy")}

#: One-time setup allowed on the first step of a phase (never in a steady step).
ONE_TIME = {"optim/masks.py:freeze_masks", "comm/pieces.py:__init__", "kernels/reference.py:_weights",
            "optim/guards.py:_pinned_flag"}

#: The deliberate sync of ``check_finite_grads`` (one per step without a loss scaler).
FINITE_CHECK = "optim/guards.py:_all_finite"


class SyncWatch:
    """Counts host conversions made by hf_onebit code while :meth:`watch` is on (any thread).

    ``exempt``: (file, function, conversion) entries that are host-side by construction;
    ``ignored_roots``: folders whose frames make a call not ours (Triton's interpreter, which
    reads memory on the host only because it runs on CPU)."""

    def __init__(self, exempt=EXEMPT, ignored_roots: tuple = ()) -> None:
        import hf_onebit

        self.root = os.path.dirname(os.path.abspath(hf_onebit.__file__)) + os.sep
        self.exempt = exempt
        self.ignored_roots = tuple(ignored_roots)
        self.on = False
        self.calls: list[str] = []
        self._lock = threading.Lock()

    def install(self) -> None:
        for name in CONVERSIONS:
            setattr(torch.Tensor, name, self._wrap(name, getattr(torch.Tensor, name)))
        torch.tensor = self._wrap("torch.tensor", torch.tensor, method=False)

    def _wrap(self, name, original, method=True):
        @functools.wraps(original)
        def counted(*args, **kwargs):
            if self.on and (not method or args[0].numel() > 0):
                where = self._culprit(sys._getframe(1), name)
                if where is not None:
                    with self._lock:
                        self.calls.append(f"{where} {name}")
            return original(*args, **kwargs)

        return counted

    def _culprit(self, frame, name: str) -> str | None:
        """``file:function`` of the innermost hf_onebit frame, or None (not ours, or exempt)."""
        while frame is not None:
            path = frame.f_code.co_filename
            if self.ignored_roots and path.startswith(self.ignored_roots):
                return None
            if path.startswith(self.root):
                rel = path[len(self.root):].replace(os.sep, "/")
                func = frame.f_code.co_name
                for file, f, conv in self.exempt:
                    if rel == file and f in ("*", func) and conv in ("*", name):
                        return None
                return f"{rel}:{func}"
            frame = frame.f_back
        return None

    def take(self) -> list[str]:
        with self._lock:
            calls, self.calls = self.calls, []
        return calls

    def during(self, fn, *args) -> list[str]:
        """The calls made while ``fn(*args)`` runs (and only those)."""
        self.take()
        self.on = True
        try:
            fn(*args)
        finally:
            self.on = False
        return self.take()


def _train(watch, rank, opt_name, kwargs, steps, scaler, tensors=None, defer=False):
    """``tensors``: a :class:`tests.op_counts.Stack` of that many tensors, each in a DDP bucket
    (and so a compression segment) of its own, in place of the fixed-gradient model. ``defer``:
    the finiteness check of a GPU (masked on the device, read a step later) on these CPU tensors."""
    from hf_onebit.optim import guards

    deferred = guards.DEFERRED_DEVICES
    guards.DEFERRED_DEVICES = {"cpu", "cuda"} if defer else deferred
    try:
        return _train_watched(watch, rank, opt_name, kwargs, steps, scaler, tensors)
    finally:
        guards.DEFERRED_DEVICES = deferred


def _train_watched(watch, rank, opt_name, kwargs, steps, scaler, tensors):
    import hf_onebit
    from torch.nn.parallel import DistributedDataParallel as DDP

    from tests.op_counts import Stack
    from tests.optim.harness import FixedGradModel, build_optimizer, fixed_grads

    torch.manual_seed(0)
    model = FixedGradModel() if tensors is None else Stack(tensors, width=4)
    opt = build_optimizer(opt_name, model.parameters(), kwargs)
    # a bucket cap of a few bytes: DDP gives every parameter its own bucket
    ddp = DDP(model, bucket_cap_mb=0.01 if tensors is None else 1e-6)
    grad_scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10, growth_interval=10**6) if scaler else None
    hf_onebit.attach(ddp, opt, grad_scaler=grad_scaler)
    records = []
    for step in range(1, steps + 1):
        plan = opt.plan().value
        if tensors is None:
            loss = ddp(fixed_grads(step, rank))
        else:
            loss = ddp(torch.randn(2, 4, generator=torch.Generator().manual_seed(10 * step + rank))).sum()
        records.append({"plan": plan, "calls": watch.during(backward_and_step, loss, opt, grad_scaler)})
        opt.zero_grad(set_to_none=True)
        opt.state_dict()  # not watched: checkpoints may read values
    assert opt.steps_done == steps, "a step was skipped: the test's gradients must stay finite"
    if tensors is not None:
        assert len(opt.exchange.segments) > 256, f"only {len(opt.exchange.segments)} compression segments"
    return records


def _watched_worker(rank, world_size, cases):
    from hf_onebit.kernels import cpu, reference

    watch = SyncWatch()
    watch.install()
    # the device path of the vote packing (numpy's packbits is for CPU tensors only)
    cpu.pack_bools = reference.pack_bools
    return {name: _train(watch, rank, *case[:4], **(case[5] if len(case) > 5 else {})) for name, case in cases.items()}


ADAM = dict(lr=1e-2, freeze_step=3)
LAMB = dict(lr=1e-2, freeze_step=3, weight_decay=0.01)
# plans: allreduce, allreduce, 1-bit gradient, allreduce | sync, sync, local, sync, local x3, sync
ZERO_ONE = dict(lr=1e-2, var_freeze_step=4, var_update_scaler=1, local_step_scaler=2, local_step_clipper=4)
NO_CHECK = dict(check_finite=False)

#: name -> (optimizer, kwargs, steps, GradScaler?, steps that start something: the rest are steady)
CASES = {
    "OneBitAdam": ("OneBitAdam", {**ADAM, **NO_CHECK}, 7, False, {1, 3, 4}),  # masks freeze in step 3
    "OneBitAdam-scaler": ("OneBitAdam", ADAM, 7, True, {1, 3, 4}),
    "OneBitAdam-per-tensor-scaler": ("OneBitAdam", {**ADAM, "scale_per_tensor": True, "precondition_exchange": True}, 7,
                                     True, {1, 3, 4}),
    "OneBitLamb": ("OneBitLamb", {**LAMB, **NO_CHECK}, 7, False, {1, 3, 4}),  # masks freeze in step 3
    "OneBitLamb-scaler": ("OneBitLamb", LAMB, 7, True, {1, 3, 4}),
    "ZeroOneAdam": ("ZeroOneAdam", {**ZERO_ONE, **NO_CHECK}, 12, False, {1, 3, 5}),
    "ZeroOneAdam-scaler": ("ZeroOneAdam", {**ZERO_ONE, "precondition_exchange": True}, 12, True, {1, 3, 5}),
    "BinSGDM": ("BinSGDM", dict(lr=1e-2, **NO_CHECK), 5, False, {1}),
    "BinSGDM-scaler": ("BinSGDM", dict(lr=1e-2), 5, True, {1}),
    # the default check_finite=True: the one deliberate sync per step
    "OneBitAdam-checked": ("OneBitAdam", ADAM, 7, False, {1, 3, 4}),
    # the same check as on a GPU: masked on the device, read a step later from pinned memory
    "OneBitAdam-checked-deferred": ("OneBitAdam", ADAM, 7, False, {1, 3, 4}, {"defer": True}),
    "OneBitLamb-checked-deferred": ("OneBitLamb", LAMB, 7, False, {1, 3, 4}, {"defer": True}),
    "ZeroOneAdam-checked-deferred": ("ZeroOneAdam", ZERO_ONE, 12, False, {1, 3, 5}, {"defer": True}),
    "BinSGDM-checked-deferred": ("BinSGDM", dict(lr=1e-2), 5, False, {1}, {"defer": True}),
    "OneBitAdam-checked-deferred-per-tensor": ("OneBitAdam", {**ADAM, "scale_per_tensor": True, "warmup_bits": 8}, 7,
                                               False, {1, 2, 3, 4}, {"defer": True}),
    # more than 256 segments with one scale per tensor (issue 29, finding 3: piece tables cached
    # for 256 segments at most): the 300 segments are made at step 4, the first compressed one
    "OneBitAdam-300-segments": ("OneBitAdam", {**ADAM, **NO_CHECK, "scale_per_tensor": True}, 6, False, {1, 3, 4},
                                {"tensors": 300}),
}

HIER_CASES = {
    "BinSGDM-hierarchical": ("BinSGDM", dict(lr=1e-2, hierarchical=True, **NO_CHECK), 4, False, {1}),
    "BinSGDM-hierarchical-scaler": ("BinSGDM", dict(lr=1e-2, hierarchical=True), 4, True, {1}),
}


@pytest.fixture(scope="module")
def flat_runs():
    return run_distributed(_watched_worker, 2, CASES, env={"LOCAL_WORLD_SIZE": "2"}, fresh=True)  # patches torch for good


@pytest.fixture(scope="module")
def hier_runs():
    return run_distributed(_watched_worker, 4, HIER_CASES, env={"LOCAL_WORLD_SIZE": "2"}, fresh=True)  # patches torch for good


def _check(outs, name, case):
    opt_name, kwargs, steps, scaler, starts = case[:5]
    deferred = len(case) > 5 and case[5].get("defer", False)  # no host read at all
    checked = not scaler and kwargs.get("check_finite", True) and not deferred
    plans = [r["plan"] for r in outs[0][name]]
    for rank, records in enumerate(outs):
        for step, rec in enumerate(records[name], 1):
            calls = rec["calls"]
            finite = [c for c in calls if c.startswith(FINITE_CHECK + " ")]
            rest = [c for c in calls if c not in finite]
            where = f"{name}, rank {rank}, step {step} ({rec['plan']})"
            assert len(finite) == (1 if checked else 0), f"{where}: check_finite_grads synced {len(finite)} times"
            if step in starts:
                rest = [c for c in rest if c.split(" ")[0] not in ONE_TIME]
            assert not rest, f"{where}: host syncs in the hook or step(): {sorted(set(rest))}"
    return plans


@pytest.mark.parametrize("name", list(CASES))
def test_no_host_sync_in_hook_and_step(flat_runs, name):
    plans = _check(flat_runs, name, CASES[name])
    assert len(set(plans)) >= (1 if name.startswith("BinSGDM") else 2)  # the phases were crossed
    if name.startswith("ZeroOneAdam"):
        assert {"allreduce", "compress_gradient", "local", "sync_after_step"} <= set(plans)


@pytest.mark.parametrize("name", list(HIER_CASES))
def test_no_host_sync_in_hierarchical_votes(hier_runs, name):
    _check(hier_runs, name, HIER_CASES[name])


def test_the_watch_counts_hf_onebit_conversions_on_any_thread():
    """The counting itself: hf_onebit's ``bool()`` is seen, on the main thread and another; the
    test's own conversions are not hf_onebit's."""
    from hf_onebit.optim.guards import _all_finite

    watch = SyncWatch()
    original = {name: getattr(torch.Tensor, name) for name in CONVERSIONS}
    tensor = torch.tensor
    try:
        watch.install()
        watch.on = True
        float(torch.ones(()))
        torch.tensor([1.0])
        assert watch.take() == []
        _all_finite([torch.ones(3)])
        thread = threading.Thread(target=_all_finite, args=([torch.ones(3)],))
        thread.start()
        thread.join()
        assert watch.take() == [f"{FINITE_CHECK} __bool__"] * 2
    finally:
        watch.on = False
        for name, method in original.items():
            setattr(torch.Tensor, name, method)
        torch.tensor = tensor


def test_check_finite_false_skips_the_check_and_is_validated():
    import hf_onebit

    for cls in (hf_onebit.OneBitAdam, hf_onebit.ZeroOneAdam, hf_onebit.OneBitLamb, hf_onebit.BinSGDM):
        with pytest.raises(TypeError, match="check_finite"):
            cls([torch.nn.Parameter(torch.zeros(3))], check_finite="no")
        p = torch.nn.Parameter(torch.zeros(3))
        p.grad = torch.tensor([1.0, float("nan"), 0.0])
        with pytest.raises(FloatingPointError):
            cls([p]).step()
        opt = cls([p], check_finite=False)
        opt.step()  # refused nothing: the NaN went in, as documented
        assert opt.steps_done == 1 and "check_finite" not in str(opt.state_dict())
