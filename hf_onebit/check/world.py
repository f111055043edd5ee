"""The self-check's parts that need the process group: training each optimizer in each precision,
host syncs, overlap; every rank agrees on each part's result before the next starts."""

from __future__ import annotations

import os
import socket
import sys
import time
import traceback
import warnings
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

if TYPE_CHECKING:
    from hf_onebit.check import Report

OPTIMIZERS = ("onebit_adam", "zeroone_adam", "onebit_lamb", "binsgdm")


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
