"""``hf-onebit check``: what a user runs first, on whatever they have (a CPU, one GPU, N GPUs).

    hf-onebit check                        # this machine: CPU, or the current GPU
    python -m hf_onebit.check --device cpu
    torchrun --nproc-per-node 8 -m hf_onebit.check   # the launched world (NCCL on GPUs)

It checks, in order, and prints one line each and a verdict that names where each part ran:

1. **kernels**: the device's compression kernels compile and match the reference bit for bit
   (:func:`hf_onebit.kernels.selftest.self_test`, fp32/bf16/fp16 buckets);
2. **speed**: worker scale, worker pack and unpack of a ``--size`` fp32 buffer against a device
   ``copy_`` of it, each kernel's bandwidth counting its own bytes (:func:`speed_bytes`); on a
   GPU each must reach :data:`SPEED_GOAL` of ``copy_``'s, judged from :data:`GOAL_MIN_SIZE`
   elements on (:func:`judge_speed`);
3. **training**: DDP steps of each optimizer at the library's defaults (per-tensor scales, the
   automatic freeze bounded by the run's length) in bf16 autocast and in fp16 autocast with a
   ``GradScaler``, as the HF Trainer runs them, on the launched world or, when started alone, on
   2 spawned CPU (gloo) processes (the verdict says so): finite parameters, every rank equal
   (0/1 Adam: after a sync), past the warmup, fewer bytes than an fp32 all-reduce. Every rank
   agrees on each part's result before the next part starts (:func:`run_part`): a part that
   raised on any rank stops every rank with the same message, and a rank that cannot agree
   (a peer stuck in a collective or gone) stops at once;
4. **host syncs** (CUDA only): hook and step in the steady compressed phase (after the step
   that starts it, which freezes masks once) under ``torch.cuda.set_sync_debug_mode("warn")``,
   counted by source: the finiteness guard's one read per step and the GradScaler's inf check
   are deliberate and reported apart; there should be no other;
5. **overlap**: how much of the hook's communication hides behind backward, on the same world
   (:func:`measure_overlap`).
"""

from __future__ import annotations

import argparse
import os
import socket
import sys
import time
import traceback
import warnings

import torch
import torch.distributed as dist

OPTIMIZERS = ("onebit_adam", "zeroone_adam", "onebit_lamb", "binsgdm")
DTYPES = (torch.float32, torch.bfloat16, torch.float16)


class Report:
    """Lines of ``[what] ok|FAIL|skip  detail``, where each part ran, and the verdict."""

    def __init__(self, quiet: bool = False) -> None:
        self.failed: list[str] = []
        self.quiet = quiet
        self.ran: dict = {}  # where -> the parts that ran there, in order
        self.failures: list = []  # (what, detail) of each FAIL line, printed or not
        self.kernels: list = []  # the speed part's timings (check_speed), for --json

    def line(self, what: str, status: str, detail: str, where: str | None = None) -> None:
        if status == "FAIL":
            self.failed.append(what)
            self.failures.append((what, detail))
        if where is not None and status != "skip":
            parts = self.ran.setdefault(where, [])
            if what not in parts:
                parts.append(what)
        if not self.quiet:
            print(f"[{what:<8}] {status:<4}  {detail}", flush=True)

    def verdict(self) -> str:
        """``OK`` or ``FAILED: parts``, then where each part ran (a GPU, or CPU processes)."""
        head = "OK" if not self.failed else "FAILED: " + ", ".join(dict.fromkeys(self.failed))
        ran = "; ".join(f"{', '.join(parts)} on {where}" for where, parts in self.ran.items())
        return head + (f" (ran: {ran})" if ran else "")


# ---------------------------------------------------------------------------------- 1. kernels
def check_kernels(device: torch.device, report: Report) -> None:
    from hf_onebit.kernels.selftest import self_test

    names = []
    try:
        for dtype in DTYPES:
            names.append(self_test(device, dtype))
    except Exception as exc:  # noqa: BLE001 - reported
        report.line("kernels", "FAIL", str(exc), where=str(device))
        return
    report.line("kernels", "ok", f"{names[0]} kernels on {device}: bit for bit against the reference"
                                 " (fp32, bf16, fp16 buckets; one scale per chunk and per piece)", where=str(device))


# ---------------------------------------------------------------------------------- 2. speed
#: bytes each timed operation moves per element of an fp32 buffer of ``n`` elements whose error
#: buffer holds ``L >= n`` (padded to whole chunks): its byte floor, reads plus writes. The
#: scalars (a scale, partial sums) are negligible next to these.
def speed_bytes(n: int, padded: int) -> dict:
    return {
        "copy_": 8 * n,  # reads x, writes the copy
        "worker_scale": 4 * n + 4 * padded,  # reads x and the error (a sum of squares)
        "worker_pack": 4 * n + 8 * padded + padded // 8,  # reads x and the error; writes the error and 1 bit
        "unpack_scaled": padded // 8 + 4 * n,  # reads 1 bit; writes the fp32 result
    }


#: On a GPU every kernel must reach this share of ``copy_``'s bandwidth, each counting its own
#: bytes (:func:`speed_bytes`). Correct kernels are memory-bound like the copy, so their shares
#: sit well above it (``benchmarks/gpu_costs.py`` measures them); a kernel a few times slower than
#: it should be falls below, and the margin leaves room for other GPUs and timing noise. A goal
#: on times (compress <= 2x a copy_) cannot hold: the two compress kernels move 20.125 bytes per
#: element, a copy_ 8, so their floor is already 2.5x.
SPEED_GOAL = 0.40
#: the smallest buffer on which the goal is judged: large enough for a copy_ to be bandwidth-bound
#: on current GPUs. On smaller buffers the kernels' fixed cost per launch (tens of microseconds)
#: is a large share of their time, so their share of the copy's bandwidth would measure launch
#: overhead, not the kernels.
GOAL_MIN_SIZE = 1 << 26


def _median_time(fn, device: torch.device, repeats: int) -> float:
    """Seconds per call of ``fn``, the median of ``repeats`` (after ``repeats + 1`` untimed calls:
    the first compiles).

    On CUDA timed with events on the stream, so the kernels' own time and any launch gap
    between them is counted, not the host's return."""
    import statistics

    fn()
    for _ in range(repeats):  # and warms the GPU's clocks: the first timings after idle run slow
        fn()
    if device.type != "cuda":
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            fn()
            times.append(time.perf_counter() - start)
        return statistics.median(times)
    torch.cuda.synchronize(device)
    pairs = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(repeats)]
    for start, stop in pairs:
        start.record()
        fn()
        stop.record()
    torch.cuda.synchronize(device)
    return statistics.median(start.elapsed_time(stop) for start, stop in pairs) / 1e3


def judge_speed(seconds: dict, n: int, padded: int, device_type: str) -> tuple[str, str, dict]:
    """``(status, detail, shares)`` from the median seconds of :func:`speed_bytes`'s operations.

    ``shares``: each kernel's bandwidth (its own bytes per second) over ``copy_``'s. The goal
    (:data:`SPEED_GOAL`) is judged on a GPU and on buffers of :data:`GOAL_MIN_SIZE` elements or
    more; elsewhere the figures are printed and the status is ``skip``."""
    moved = speed_bytes(n, padded)
    bandwidth = {k: moved[k] / seconds[k] for k in moved}
    shares = {k: bandwidth[k] / bandwidth["copy_"] for k in moved if k != "copy_"}
    compress = (seconds["worker_scale"] + seconds["worker_pack"]) / seconds["copy_"]
    floor = (moved["worker_scale"] + moved["worker_pack"]) / moved["copy_"]
    size = f"{n / 2**20:g}M" if n >= 2**20 else str(n)
    if device_type != "cuda":  # a CPU copy_ of a small buffer can wait on idle threads: no ratio means much
        return "ok", (f"{size} fp32: " + ", ".join(f"{k} {1e3 * seconds[k]:.3f} ms ({bandwidth[k] / 1e9:.0f} GB/s)"
                                                  for k in moved)
                      + " (no goal on CPU: numba against a memory-bound copy_)"), shares
    detail = (f"{size} fp32: copy_ {1e3 * seconds['copy_']:.3f} ms ({bandwidth['copy_'] / 1e9:.0f} GB/s); "
              + ", ".join(f"{k} {1e3 * seconds[k]:.3f} ms ({bandwidth[k] / 1e9:.0f} GB/s, {100 * v:.0f}% of copy_'s)"
                          for k, v in shares.items())
              + f"; compress takes {compress:.2f}x a copy_ (its byte floor: {floor:.2f}x)")
    if n < GOAL_MIN_SIZE:
        return "skip", detail + f" (goal judged only at --size >= {GOAL_MIN_SIZE}: below, fixed costs dominate)", shares
    slow = [k for k, v in shares.items() if v < SPEED_GOAL]
    goal = f" (goal: each >= {100 * SPEED_GOAL:.0f}%)"
    return ("FAIL", detail + goal + ": too slow: " + ", ".join(slow), shares) if slow else ("ok", detail + goal, shares)


def check_speed(device: torch.device, size: int, report: Report, repeats: int = 20) -> dict:
    """Time compress (worker scale + pack) and decompress (unpack) of one ``size`` fp32 buffer
    against a ``copy_`` of it, and judge them by their byte floors (:func:`judge_speed`)."""
    from hf_onebit.kernels import get_backend

    kernels = get_backend(device)
    x = torch.randn(size, device=device)
    padded = -(-size // 64) * 64
    error = torch.zeros(padded, device=device)
    bits = torch.empty(padded // 8, dtype=torch.uint8, device=device)
    out = torch.empty(size, device=device)
    dst = torch.empty_like(x)
    scale = kernels.worker_scale(x, error).reshape(1)
    one = torch.ones(1, device=device)
    operations = {
        "copy_": lambda: dst.copy_(x),
        "worker_scale": lambda: kernels.worker_scale(x, error),
        # the error buffer is updated in place; its values do not change the work
        "worker_pack": lambda: kernels.worker_pack(x, error, scale, 0, bits),
        "unpack_scaled": lambda: kernels.unpack_scaled(bits.reshape(1, -1), one, out),
    }
    seconds = {k: _median_time(fn, device, repeats if device.type == "cuda" else 5) for k, fn in operations.items()}
    # what `--json` writes, and `hf-onebit estimate --kernels-from` reads (milliseconds per call)
    report.kernels = [{"dtype": "float32", "op": k, "numel": size, "ms": 1e3 * v} for k, v in seconds.items()]
    status, detail, shares = judge_speed(seconds, size, padded, device.type)
    report.line("speed", status, detail, where=str(device))
    return shares


# ---------------------------------------------------------------------------------- 3. training
#: how a launched world trains: as the HF Trainer does with --bf16 (autocast, no scaler) and with
#: --fp16 (autocast and a GradScaler handed to attach)
PRECISIONS = {"bf16": (torch.bfloat16, False), "fp16": (torch.float16, True)}


class PartFailed(RuntimeError):
    """A part raised on some rank; every rank agreed on it and stops (the same message everywhere)."""


class CheckAborted(RuntimeError):
    """The ranks could not agree on a part's result: some rank is stuck or gone. This rank stops."""


def _model(device: torch.device) -> torch.nn.Module:
    """Blocks of Linear + LayerNorm + GELU and a head of 3 outputs (a tensor whose size is no
    multiple of 8): many tensors of mixed sizes in several buckets, as in a transformer. On CUDA
    2.1M parameters in 34 tensors (about 9 buckets of 1 MB); on CPU 7.5K parameters in 14, to
    stay quick."""
    width, depth = (512, 8) if device.type == "cuda" else (48, 3)
    layers: list = []
    for _ in range(depth):
        layers += [torch.nn.Linear(width, width), torch.nn.LayerNorm(width), torch.nn.GELU()]
    layers.append(torch.nn.Linear(width, 3))
    return torch.nn.Sequential(*layers).to(device)


def _build(name: str, params, steps: int):
    """The optimizer at the library's defaults (per-tensor scales, the automatic freeze, 8-bit
    warmup), its freeze bounded by the run's length as the HF integration bounds it."""
    import hf_onebit

    if name == "onebit_adam":
        return hf_onebit.OneBitAdam(params, lr=1e-3, total_steps=steps)
    if name == "zeroone_adam":
        return hf_onebit.ZeroOneAdam(params, lr=1e-3, total_steps=steps)
    if name == "onebit_lamb":
        return hf_onebit.OneBitLamb(params, lr=1e-3, total_steps=steps)
    return hf_onebit.BinSGDM(params, lr=1e-4)


#: the phases in which nothing is compressed yet
WARMUPS = ("warmup", "variance")


def _sync_source(w) -> str:
    """Who asked for a host synchronisation (a warning of ``set_sync_debug_mode("warn")``): the
    finiteness guard's one deliberate read per step, torch's GradScaler reading its inf flag (by
    design), or anything else, which should not happen."""
    path = str(getattr(w, "filename", "")).replace("\\", "/")
    if path.endswith("hf_onebit/optim/guards.py"):
        return "guard"
    if path.endswith("amp/grad_scaler.py"):
        return "scaler"
    return "other"


def train_step(run: dict, it: int) -> None:
    """One training step of ``run`` (see :func:`train_one`): forward under autocast, backward
    (the hook), step; host synchronisations counted by source when ``run["watch"]``."""
    device, ddp, opt, scaler = run["device"], run["ddp"], run["opt"], run["scaler"]
    x = torch.randn(16, run["width"], generator=run["gen"]).to(device)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        if run["watch"]:
            torch.cuda.set_sync_debug_mode("warn")
        try:
            with torch.autocast(device.type, dtype=run["dtype"]):
                loss = ddp(x).float().pow(2).mean()
            if scaler is not None:
                scaler.scale(loss).backward()
                scaler.step(opt)
                scaler.update()
            else:
                loss.backward()
                opt.step()
        finally:
            if run["watch"]:
                torch.cuda.set_sync_debug_mode(0)
    for w in caught:
        if "synchroniz" in str(w.message):
            source = _sync_source(w)
            run["syncs"][source] = run["syncs"].get(source, 0) + 1
    opt.zero_grad(set_to_none=True)


def train_one(name: str, precision: str, device: torch.device, steps: int, sync_check: bool) -> dict:
    """``steps`` optimizer steps of ``name`` in ``precision`` on the initialised process group."""
    import hf_onebit
    from torch.nn.parallel import DistributedDataParallel as DDP

    rank, world = dist.get_rank(), dist.get_world_size()
    dtype, scaled = PRECISIONS[precision]
    torch.manual_seed(0)
    model = _model(device)
    opt = _build(name, model.parameters(), steps)
    bucket_mb = 1.0 if device.type == "cuda" else 0.01
    ddp = DDP(model, device_ids=[device] if device.type == "cuda" else None, bucket_cap_mb=bucket_mb)
    scaler = torch.amp.GradScaler(device.type) if scaled else None
    hf_onebit.attach(ddp, opt, grad_scaler=scaler)
    watched = sync_check and device.type == "cuda"
    run = {"device": device, "ddp": ddp, "opt": opt, "scaler": scaler, "dtype": dtype, "watch": False,
           "width": model[0].in_features, "gen": torch.Generator().manual_seed(100 + rank), "syncs": {}}
    compressing_since, watched_steps = None, 0
    # A GradScaler skips the steps it finds non-finite: count the optimizer's steps, not the loop's.
    for it in range(1, 3 * steps + 1):
        if opt.steps_done >= steps:
            break
        if compressing_since is None and opt.phase() not in WARMUPS:
            compressing_since = it
        # Watched from the second compressed step on (the first freezes the masks, once) and
        # from DDP's third iteration (its first is one bucket, then it rebuilds them).
        run["watch"] = watched and compressing_since is not None and it > max(compressing_since, 2)
        watched_steps += run["watch"]
        train_step(run, it)
    flat = torch.cat([p.detach().reshape(-1).float() for p in model.parameters()])
    everyone = [torch.empty_like(flat) for _ in range(world)]
    dist.all_gather(everyone, flat)
    stats = opt.onebit_stats()
    return {"finite": bool(torch.isfinite(flat).all()), "same": all(torch.equal(everyone[0], e) for e in everyone),
            "phase": stats["phase"], "ratio": stats["compression_ratio"], "steps": opt.steps_done,
            "params": flat.numel(), "tensors": len(list(model.parameters())),
            "syncs": run["syncs"].get("other", 0), "guard_syncs": run["syncs"].get("guard", 0),
            "scaler_syncs": run["syncs"].get("scaler", 0), "watched": watched_steps, "precision": precision}


def agree(side, part: str, error: str | None) -> list:
    """Every rank's ``error`` for ``part`` (``None``: it passed), the same list on every rank.

    Over ``side``, a gloo group of its own: a rank that failed in the middle of a part may have
    left a collective of the training group unmatched, and a message on that group would pair
    with it. If the exchange fails (a peer died) or times out (a peer is still waiting in such a
    collective, which only the process group's timeout ends), this rank cannot know the others'
    results: :class:`CheckAborted`, and it must stop rather than start the next part."""
    try:
        everyone: list = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, error, group=side)
    except Exception as exc:  # noqa: BLE001 - the reason is in the message
        here = f"failed here: {error}" if error else "passed here"
        raise CheckAborted(
            f"rank {dist.get_rank()}: part '{part}' {here}, but the ranks could not agree on its result"
            f" ({type(exc).__name__}: {str(exc).strip().splitlines()[0] if str(exc).strip() else ''}). Another rank"
            " failed in the middle of the part and left this one waiting in a collective, or it died; its own"
            " output says why. Stopping this rank.") from exc
    return everyone


def gather_local_failures(side, report: Report) -> None:
    """Every rank's failures of the parts it ran alone (kernels, speed), into every rank's report.

    Only rank 0 prints: without this a broken GPU on rank 5 would leave rank 0's verdict OK."""
    mine = [(what, " ".join(str(detail).split())) for what, detail in report.failures]
    everyone: list = [None] * dist.get_world_size()
    try:
        dist.all_gather_object(everyone, mine, group=side)
    except Exception as exc:  # noqa: BLE001 - as in agree()
        raise CheckAborted(f"rank {dist.get_rank()}: the ranks could not gather the kernels' and speed's results"
                           f" ({type(exc).__name__}: {exc}); another rank is stuck or gone. Stopping this rank.") from exc
    for r, theirs in enumerate(everyone):
        if r != dist.get_rank():
            for what, detail in theirs:
                report.line(what, "FAIL", f"rank {r}: {detail}")


def run_part(side, part: str, fn):
    """``fn()`` on every rank, then :func:`agree`: ``PartFailed`` on every rank if any rank raised."""
    error = None
    try:
        result = fn()
    except Exception as exc:  # noqa: BLE001 - agreed on, then raised on every rank
        result = None
        text = " ".join(str(exc).split())
        error = f"{type(exc).__name__}: {text[:600] + ' ...' if len(text) > 600 else text}"
        # the whole traceback on this rank's stderr (torchrun shows it by rank); the verdict
        # carries the one line above
        print(f"hf-onebit check, rank {dist.get_rank()}, part '{part}':\n{traceback.format_exc()}", file=sys.stderr,
              flush=True)
    everyone = agree(side, part, error)
    failed = [(r, e) for r, e in enumerate(everyone) if e]
    if failed:
        raise PartFailed(f"part '{part}' failed on rank(s) {', '.join(str(r) for r, _ in failed)}: "
                         + "; ".join(f"rank {r}: {e}" for r, e in failed)
                         + ". Every rank stopped after this part.")
    return result


def train_in_world(device: torch.device, steps: int, side, sync_check: bool = False,
                   precisions=tuple(PRECISIONS), results: dict | None = None) -> dict:
    """On an initialised process group: each optimizer in each precision, one agreed part each;
    ``{(name, precision): result}`` (also filled into ``results`` as the parts pass). Raises
    :class:`PartFailed` (on every rank) or :class:`CheckAborted` (on the ranks that cannot agree)."""
    results = {} if results is None else results
    for precision in precisions:
        for name in OPTIMIZERS:
            results[(name, precision)] = run_part(side, f"train {name} {precision}",
                                                  lambda: train_one(name, precision, device, steps, sync_check))
    return results


# ---------------------------------------------------------------------------------- 5. overlap
def measure_overlap(device: torch.device, rounds: int = 5, width: int = 1024, layers: int = 6) -> dict:
    """The share of the hook's communication that hides behind backward (1-bit Adam, compressing).

    Three ways of running forward + backward of one MLP, interleaved ``rounds`` times (medians):

    * ``compute``: under ``ddp.no_sync()``: no hook, no communication;
    * ``overlapped``: as in training: each bucket's exchange starts when its gradients are ready
      and runs while backward goes on;
    * ``serial``: the same, but the hook waits for each bucket's exchange before backward may go
      on (on CUDA: the device too), so nothing overlaps.

    ``serial - compute`` is the communication's cost, ``overlapped - compute`` what of it still
    shows: hidden = ``(serial - overlapped) / (serial - compute)``, clamped to [0, 1]. Every
    synced backward is followed by ``step()`` (outside the timing), as in training.
    """
    import statistics
    from contextlib import nullcontext

    import hf_onebit
    from torch.nn.parallel import DistributedDataParallel as DDP

    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(width, width) for _ in range(layers)]).to(device)
    opt = hf_onebit.OneBitAdam(model.parameters(), lr=1e-5, freeze_step=1)
    ddp = DDP(model, device_ids=[device] if device.type == "cuda" else None, bucket_cap_mb=4 * width * width / 2**20)
    link = hf_onebit.attach(ddp, opt)
    x = torch.randn(64, width, generator=torch.Generator().manual_seed(dist.get_rank())).to(device)
    hooked = link.reduce

    def waiting_hook(params, buffer, grads):
        fut = hooked(params, buffer, grads)
        fut.wait()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        return fut

    def timed(mode: str) -> float:
        if mode == "serial":
            link.reduce = waiting_hook  # the hook calls its state's reduce
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        dist.barrier()
        start = time.perf_counter()
        with ddp.no_sync() if mode == "compute" else nullcontext():
            ddp(x).pow(2).mean().backward()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        took = time.perf_counter() - start
        link.__dict__.pop("reduce", None)
        if mode != "compute":
            opt.step()
        opt.zero_grad(set_to_none=True)
        return took

    for mode in ("overlapped", "overlapped", "overlapped", "compute", "serial"):  # warmup, freeze, buckets rebuilt
        timed(mode)
    times: dict = {"compute": [], "overlapped": [], "serial": []}
    for _ in range(rounds):
        for mode in times:
            times[mode].append(timed(mode))
    med = {mode: statistics.median(v) for mode, v in times.items()}
    comm = med["serial"] - med["compute"]
    hidden = min(max((med["serial"] - med["overlapped"]) / comm, 0.0), 1.0) if comm > 0 else float("nan")
    return {**{f"{k}_ms": 1e3 * v for k, v in med.items()}, "hidden": hidden, "phase": opt.phase(),
            "params": sum(p.numel() for p in model.parameters())}


def report_overlap(r: dict, where: str, report: Report) -> None:
    if "error" in r:
        report.line("overlap", "FAIL", f"on {where}: {r['error'].strip().splitlines()[-1]}", where=where)
        return
    if r["hidden"] != r["hidden"]:  # NaN: serialised was no slower than backward alone
        report.line("overlap", "skip", f"on {where}: the communication's cost is below the timing noise (backward"
                                       f" {r['compute_ms']:.0f} ms alone, {r['serial_ms']:.0f} ms serialised):"
                                       " nothing to measure", where=where)
        return
    report.line("overlap", "ok", f"{100 * r['hidden']:.0f}% of the communication hides behind backward on {where}"
                                 f" (1-bit Adam, {r['params'] / 1e6:.1f}M parameters; backward {r['compute_ms']:.0f} ms"
                                 f" alone, {r['overlapped_ms']:.0f} ms with the hook, {r['serial_ms']:.0f} ms serialised)",
                where=where)


def run_world(device: torch.device, steps: int, side, sync_check: bool) -> dict:
    """Every part that needs the process group, each agreed on by every rank before the next:
    ``{"train": {(name, precision): result}, "overlap": result}``, and ``"stopped": message`` when a
    part raised on some rank (the same on every rank; the parts after it did not run).
    :class:`CheckAborted` propagates: the caller must stop."""
    out: dict = {"train": {}}
    try:
        train_in_world(device, steps, side, sync_check, results=out["train"])
        out["overlap"] = run_part(side, "overlap", lambda: measure_overlap(device))
    except PartFailed as exc:
        out["stopped"] = str(exc)
    return out


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _spawned_worker(rank: int, world: int, port: int, steps: int, timeout: float, queue) -> None:
    from datetime import timedelta

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=timeout))
    side = dist.new_group(backend="gloo", timeout=timedelta(seconds=2 * timeout))
    try:
        out = run_world(torch.device("cpu"), steps, side, sync_check=False)
    except CheckAborted as exc:
        out = {"aborted": str(exc)}
    queue.put((rank, out))
    if "overlap" not in out:  # a collective may still be pending: leave without teardown
        os._exit(0)
    dist.destroy_process_group()


def train_on_spawned_cpu_ranks(world: int = 2, steps: int = 10, timeout: float = 300.0) -> dict:
    """Started alone: :func:`run_world` on ``world`` spawned CPU (gloo) processes; rank 0's
    result, or ``{"aborted": ...}`` with every rank's message if the ranks could not agree."""
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    queue = ctx.SimpleQueue()
    try:
        mp.start_processes(_spawned_worker, args=(world, _free_port(), steps, timeout, queue), nprocs=world,
                           join=True, start_method="spawn")
    except Exception as exc:  # noqa: BLE001 - a process died: report what the others said
        got = dict(queue.get() for _ in range(world) if not queue.empty())
        return {"aborted": f"a spawned process failed ({exc}); " + "; ".join(str(v) for v in got.values())}
    got = dict(queue.get() for _ in range(world))
    aborted = [out["aborted"] for out in got.values() if "aborted" in out]
    return {"aborted": "; ".join(aborted)} if aborted else got[0]


def report_training(results: dict, where: str, report: Report) -> None:
    """One line per optimizer and precision (``results`` keyed by ``(name, precision)``)."""
    for (name, precision), r in results.items():
        label = f"{name} {precision} on {where}"
        if "error" in r:
            report.line("train", "FAIL", f"{label}: {r['error'].strip().splitlines()[-1]}", where=where)
            continue
        problems = [w for w, bad in (("non-finite parameters", not r["finite"]),
                                     ("ranks differ", not r["same"] and name != "zeroone_adam"),
                                     ("still in its warmup", r["phase"] in WARMUPS),
                                     ("nothing compressed", r["ratio"] <= 1.0)) if bad]
        detail = (f"{label}: {r['steps']} steps, phase {r['phase']}, {r['ratio']:.1f}x fewer bytes than fp32"
                  f" ({r['params']} parameters in {r['tensors']} tensors)")
        report.line("train", "FAIL" if problems else "ok", detail + (f": {', '.join(problems)}" if problems else ""),
                    where=where)
        if not r.get("watched"):
            continue
        deliberate = [f"{r[k]} {what}" for k, what in (("guard_syncs", "by the finiteness guard (its one read a step)"),
                                                        ("scaler_syncs", "by the GradScaler (its inf check)")) if r.get(k)]
        note = f" ({', '.join(deliberate)}, deliberate)" if deliberate else ""
        if r["syncs"]:
            report.line("syncs", "FAIL", f"{label}: {r['syncs']} host synchronisations in hook and step over"
                                         f" {r['watched']} compressed steps{note}", where=where)
        else:
            report.line("syncs", "ok", f"{label}: no host synchronisation in hook and step over {r['watched']}"
                                       f" compressed steps{note}", where=where)


def report_world(out: dict, where: str, report: Report) -> None:
    """What :func:`run_world` returned: the parts that passed, then the one that stopped the ranks."""
    report_training(out["train"], where, report)
    if "overlap" in out:
        report_overlap(out["overlap"], where, report)
    if "stopped" in out:
        report.line("train" if len(out["train"]) < len(OPTIMIZERS) * len(PRECISIONS) else "overlap", "FAIL",
                    f"on {where}: {out['stopped']}", where=where)


# ---------------------------------------------------------------------------------- main
def _launched(device: torch.device, args, report: Report) -> None:
    """The launched world (torchrun): every part on every rank, agreed part by part.

    A part that raised on some rank stops every rank after it (:class:`PartFailed`). A rank that
    cannot agree (a peer stuck in a collective, or gone) prints why and leaves the process at
    once (:class:`CheckAborted`): a normal exit would tear down a process group with a collective
    still pending, which can hang on NCCL; torchrun then stops the other ranks."""
    from datetime import timedelta

    dist.init_process_group("nccl" if device.type == "cuda" else "gloo", timeout=timedelta(seconds=args.timeout))
    # Longer than the training group's timeout: a rank waiting there for one that failed reaches
    # this agreement only when that timeout ends it.
    side = dist.new_group(backend="gloo", timeout=timedelta(seconds=2 * args.timeout))
    where = f"{dist.get_world_size()} launched ranks ({dist.get_backend()}, {device.type})"
    try:
        gather_local_failures(side, report)
        out = run_world(device, args.steps, side, sync_check=True)
    except CheckAborted as exc:
        print(f"hf-onebit check: {exc}", file=sys.stderr, flush=True)
        report.line("train", "FAIL", str(exc), where=where)
        if not report.quiet:
            print("verdict: " + report.verdict(), flush=True)
        os._exit(1)
    report_world(out, where, report)
    if "stopped" not in out:  # else a collective may be pending: no teardown (see above)
        dist.destroy_process_group()


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="hf-onebit check", description=__doc__.splitlines()[0])
    parser.add_argument("--device", default=None, help="cpu or cuda[:k] (default: the GPU if there is one)")
    parser.add_argument("--size", type=int, default=None,
                        help=f"elements of the timed fp32 buffer (default on a GPU {GOAL_MIN_SIZE}, 256 MiB, the"
                             " smallest on which the speed goal is judged; on CPU 4194304)")
    parser.add_argument("--steps", type=int, default=10,
                        help="optimizer steps per optimizer and precision; the automatic freeze is bounded to"
                             " 10-40%% of them (at least 5)")
    parser.add_argument("--timeout", type=float, default=300.0,
                        help="seconds a rank waits for the others in a collective (the process group's timeout)")
    parser.add_argument("--no-train", action="store_true", help="only the kernels and their speed")
    parser.add_argument("--json", default=None, metavar="PATH",
                        help="also write the speed part's timings here (what `hf-onebit estimate --kernels-from` reads)")
    args = parser.parse_args(argv)
    if args.size is not None and args.size < 1:
        parser.error(f"--size must be a positive number of elements, got {args.size}")
    if args.steps < 5:  # a freeze at 40% of the run at the latest, then compressed steps to watch
        parser.error(f"--steps must be at least 5, got {args.steps}")
    if not args.timeout > 0:
        parser.error(f"--timeout must be a positive number of seconds, got {args.timeout}")
    launched = int(os.environ.get("WORLD_SIZE", "1")) > 1
    local = int(os.environ.get("LOCAL_RANK", "0"))
    if args.device is None:
        args.device = f"cuda:{local}" if torch.cuda.is_available() else "cpu"
    device = torch.device(args.device)
    if device.type == "cuda" and device.index is None:  # --device cuda: this rank's GPU
        device = torch.device("cuda", local)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    if args.size is None:
        args.size = GOAL_MIN_SIZE if device.type == "cuda" else 1 << 22
    rank0 = int(os.environ.get("RANK", "0")) == 0
    report = Report(quiet=not rank0)
    here = str(device) + (f" ({torch.cuda.get_device_name(device)})" if device.type == "cuda" else "")
    if rank0:
        print(f"hf-onebit check: torch {torch.__version__}, device {here}", flush=True)
    check_kernels(device, report)
    check_speed(device, args.size, report)
    if not args.no_train:
        if launched:
            _launched(device, args, report)
        else:
            where = "2 spawned CPU processes (gloo)"
            spawned = train_on_spawned_cpu_ranks(2, args.steps, args.timeout)
            if "aborted" in spawned:
                report.line("train", "FAIL", spawned["aborted"], where=where)
            else:
                report_world(spawned, where, report)
            if device.type == "cuda":
                report.line("syncs", "skip", "needs the launched CUDA world: torchrun --nproc-per-node N -m hf_onebit.check"
                                             " (one GPU cannot host two NCCL ranks; the training above ran on CPU)")
    if device.type != "cuda":
        report.line("syncs", "skip", "host syncs are a CUDA matter; nothing to check on CPU")
    if args.no_train:
        report.line("train", "skip", "not asked for (--no-train)")
    if rank0 and args.json:
        import json

        with open(args.json, "w", encoding="utf-8") as f:
            json.dump({"device": here, "torch": torch.__version__, "kernels": report.kernels}, f, indent=1)
        print(f"wrote {args.json} (kernel timings; hf-onebit estimate --kernels-from {args.json})", flush=True)
    if rank0:
        print("verdict: " + report.verdict(), flush=True)
    return 0 if not report.failed else 1


if __name__ == "__main__":
    code = main()
    if dist.is_initialized():  # a part failed: a collective may be pending, so no teardown (see _launched)
        sys.stdout.flush()
        os._exit(code)
    sys.exit(code)
