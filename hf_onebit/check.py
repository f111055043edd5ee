"""``hf-onebit check``: what a user runs first, on whatever they have (a CPU, one GPU, N GPUs).

    hf-onebit check                        # this machine: CPU, or the current GPU
    python -m hf_onebit.check --device cpu
    torchrun --nproc-per-node 8 -m hf_onebit.check   # the launched world (NCCL on GPUs)

It checks, in order, and prints one line each and a verdict:

1. **kernels**: the device's compression kernels compile and match the reference bit for bit
   (:func:`hf_onebit.kernels.selftest.self_test`, fp32/bf16/fp16 buckets);
2. **speed**: compress (worker scale + pack) and decompress (unpack) of a ``--size`` fp32 buffer
   against a device ``copy_`` of the same buffer (goals on a GPU: at most 2x and 1.5x);
3. **training**: a few DDP steps of each optimizer, past its warmup, on the launched world or,
   when started alone, on 2 spawned CPU (gloo) processes: finite parameters, every rank equal
   (0/1 Adam: after a sync), fewer bytes than an fp32 all-reduce;
4. **host syncs** (CUDA only): hook and step in the steady compressed phase (after the step
   that starts it, which freezes masks once) under ``torch.cuda.set_sync_debug_mode("warn")``,
   counted; there should be none. The optimizers are built with ``check_finite=False``: its
   one read per step is deliberate (``optim.guards.check_finite_grads``);
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
    """Lines of ``[what] ok|FAIL|skip  detail`` and the verdict."""

    def __init__(self, quiet: bool = False) -> None:
        self.failed: list[str] = []
        self.quiet = quiet

    def line(self, what: str, status: str, detail: str) -> None:
        if status == "FAIL":
            self.failed.append(what)
        if not self.quiet:
            print(f"[{what:<8}] {status:<4}  {detail}", flush=True)


# ---------------------------------------------------------------------------------- 1. kernels
def check_kernels(device: torch.device, report: Report) -> None:
    from hf_onebit.kernels.selftest import self_test

    names = []
    try:
        for dtype in DTYPES:
            names.append(self_test(device, dtype))
    except Exception as exc:  # noqa: BLE001 - reported
        report.line("kernels", "FAIL", str(exc))
        return
    report.line("kernels", "ok", f"{names[0]} kernels on {device}: bit for bit against the reference"
                                 " (fp32, bf16, fp16 buckets; one scale per chunk and per piece)")


# ---------------------------------------------------------------------------------- 2. speed
def _time(fn, device: torch.device, repeats: int) -> float:
    fn()  # warm (compiles)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        best = min(best, time.perf_counter() - start)
    return best


def check_speed(device: torch.device, size: int, report: Report, repeats: int = 5) -> dict:
    from hf_onebit.kernels import get_backend

    kernels = get_backend(device)
    x = torch.randn(size, device=device)
    padded = -(-size // 64) * 64
    error = torch.zeros(padded, device=device)
    bits = torch.empty(padded // 8, dtype=torch.uint8, device=device)
    out = torch.empty(size, device=device)
    dst = torch.empty_like(x)

    def compress():
        s = kernels.worker_scale(x, error)
        kernels.worker_pack(x, error, s.reshape(1), 0, bits)

    def decompress():
        kernels.unpack_scaled(bits.reshape(1, -1), torch.ones(1, device=device), out)

    copy = _time(lambda: dst.copy_(x), device, repeats)
    ratios = {"compress": _time(compress, device, repeats) / copy, "decompress": _time(decompress, device, repeats) / copy}
    goal = " (goals on a GPU: <= 2x, <= 1.5x)" if device.type == "cuda" else " (no goal on CPU: memory-bound copy_ vs numba)"
    status = "ok" if device.type != "cuda" or (ratios["compress"] <= 2 and ratios["decompress"] <= 1.5) else "FAIL"
    report.line("speed", status, f"{size / 2**20:.0f}M fp32 on {device}: copy_ {1e3 * copy:.2f} ms; compress"
                                 f" {ratios['compress']:.2f}x, decompress {ratios['decompress']:.2f}x of copy_{goal}")
    return ratios


# ---------------------------------------------------------------------------------- 3. training
def _build(name: str, params, **extra):
    import hf_onebit

    if name == "onebit_adam":
        return hf_onebit.OneBitAdam(params, lr=1e-3, freeze_step=2, **extra)
    if name == "zeroone_adam":  # variance frozen after 2 steps, then a sync every 2 steps
        return hf_onebit.ZeroOneAdam(params, lr=1e-3, var_freeze_step=2, local_step_scaler=1000, local_step_clipper=2,
                                     **extra)
    if name == "onebit_lamb":
        return hf_onebit.OneBitLamb(params, lr=1e-3, freeze_step=2, **extra)
    return hf_onebit.BinSGDM(params, lr=1e-3, **extra)


def train_each_optimizer(device: torch.device, steps: int = 6, sync_check: bool = False) -> dict:
    """On an initialised process group: ``steps`` DDP steps of each optimizer; a result per name."""
    import hf_onebit
    from torch.nn.parallel import DistributedDataParallel as DDP

    rank, world = dist.get_rank(), dist.get_world_size()
    results = {}
    for name in OPTIMIZERS:
        try:
            torch.manual_seed(0)
            model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.GELU(), torch.nn.Linear(256, 8)).to(device)
            watched = sync_check and device.type == "cuda"
            opt = _build(name, model.parameters(), check_finite=not watched)
            ddp = DDP(model, device_ids=[device] if device.type == "cuda" else None, bucket_cap_mb=0.05)
            hf_onebit.attach(ddp, opt)
            g = torch.Generator().manual_seed(100 + rank)
            syncs = 0
            for step in range(1, steps + 1):
                x = torch.randn(16, 64, generator=g).to(device)
                watch = watched and step > 3  # step 3 starts compressing (masks frozen once)
                with warnings.catch_warnings(record=True) as caught:
                    warnings.simplefilter("always")
                    if watch:
                        torch.cuda.set_sync_debug_mode("warn")
                    try:
                        ddp(x).pow(2).mean().backward()
                        opt.step()
                    finally:
                        if watch:
                            torch.cuda.set_sync_debug_mode(0)
                syncs += sum("synchroniz" in str(w.message) for w in caught)
                opt.zero_grad(set_to_none=True)
            flat = torch.cat([p.detach().reshape(-1).float() for p in model.parameters()])
            everyone = [torch.empty_like(flat) for _ in range(world)]
            dist.all_gather(everyone, flat)
            same = all(torch.equal(everyone[0], e) for e in everyone)
            stats = opt.onebit_stats()
            results[name] = {"finite": bool(torch.isfinite(flat).all()), "same": same, "phase": stats["phase"],
                             "ratio": stats["compression_ratio"], "syncs": syncs,
                             "watched": watched and steps > 3}
        except Exception:  # noqa: BLE001 - reported per optimizer
            results[name] = {"error": traceback.format_exc(limit=3)}
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
        report.line("overlap", "FAIL", f"on {where}: {r['error'].strip().splitlines()[-1]}")
        return
    report.line("overlap", "ok", f"{100 * r['hidden']:.0f}% of the communication hides behind backward on {where}"
                                 f" (1-bit Adam, {r['params'] / 1e6:.1f}M parameters; backward {r['compute_ms']:.0f} ms"
                                 f" alone, {r['overlapped_ms']:.0f} ms with the hook, {r['serial_ms']:.0f} ms serialised)")


def _overlap_or_error(device: torch.device) -> dict:
    try:
        return measure_overlap(device)
    except Exception:  # noqa: BLE001 - reported
        return {"error": traceback.format_exc(limit=3)}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _spawned_worker(rank: int, world: int, port: int, steps: int, queue) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        out = {"train": train_each_optimizer(torch.device("cpu"), steps), "overlap": _overlap_or_error(torch.device("cpu"))}
        if rank == 0:
            queue.put(out)
    finally:
        dist.destroy_process_group()


def train_on_spawned_cpu_ranks(world: int = 2, steps: int = 6) -> dict:
    """Started alone: :func:`train_each_optimizer` and :func:`measure_overlap` on ``world`` spawned
    CPU (gloo) processes; ``{"train": ..., "overlap": ...}`` of rank 0."""
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    queue = ctx.SimpleQueue()
    mp.start_processes(_spawned_worker, args=(world, _free_port(), steps, queue), nprocs=world, join=True,
                       start_method="spawn")
    return queue.get()


def report_training(results: dict, where: str, report: Report) -> None:
    for name, r in results.items():
        if "error" in r:
            report.line("train", "FAIL", f"{name} on {where}: {r['error'].strip().splitlines()[-1]}")
            continue
        problems = [w for w, bad in (("non-finite parameters", not r["finite"]),
                                     ("ranks differ", not r["same"] and name != "zeroone_adam"),
                                     ("nothing compressed", r["ratio"] <= 1.0)) if bad]
        detail = f"{name} on {where}: phase {r['phase']}, {r['ratio']:.1f}x fewer bytes than fp32"
        report.line("train", "FAIL" if problems else "ok", detail + (f": {', '.join(problems)}" if problems else ""))
        if r.get("syncs"):
            report.line("syncs", "FAIL", f"{name}: {r['syncs']} host synchronisations in hook and step after the warmup")
        elif "syncs" in r and r.get("watched"):
            report.line("syncs", "ok", f"{name}: no host synchronisation in hook and step after the warmup")


# ---------------------------------------------------------------------------------- main
def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="hf-onebit check", description=__doc__.splitlines()[0])
    parser.add_argument("--device", default=None, help="cpu or cuda[:k] (default: the GPU if there is one)")
    parser.add_argument("--size", type=int, default=1 << 24, help="elements of the timed buffer (default 16M)")
    parser.add_argument("--steps", type=int, default=6, help="training steps per optimizer")
    parser.add_argument("--no-train", action="store_true", help="only the kernels and their speed")
    args = parser.parse_args(argv)
    launched = int(os.environ.get("WORLD_SIZE", "1")) > 1
    if args.device is None:
        local = int(os.environ.get("LOCAL_RANK", "0"))
        args.device = f"cuda:{local}" if torch.cuda.is_available() else "cpu"
    device = torch.device(args.device)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    rank0 = int(os.environ.get("RANK", "0")) == 0
    report = Report(quiet=not rank0)
    if rank0:
        print(f"hf-onebit check: torch {torch.__version__}, device {device}"
              f"{' (' + torch.cuda.get_device_name(device) + ')' if device.type == 'cuda' else ''}", flush=True)
    check_kernels(device, report)
    check_speed(device, args.size, report)
    if not args.no_train:
        if launched:
            dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
            try:
                results = train_each_optimizer(device, args.steps, sync_check=True)
                where = f"{dist.get_world_size()} launched ranks ({dist.get_backend()})"
                report_training(results, where, report)
                report_overlap(_overlap_or_error(device), where, report)
            finally:
                dist.destroy_process_group()
        else:
            spawned = train_on_spawned_cpu_ranks(2, args.steps)
            report_training(spawned["train"], "2 spawned CPU ranks (gloo)", report)
            report_overlap(spawned["overlap"], "2 spawned CPU ranks (gloo)", report)
            if device.type == "cuda":
                report.line("syncs", "skip", "needs the launched CUDA world: torchrun --nproc-per-node N -m hf_onebit.check"
                                             " (one GPU cannot host two NCCL ranks)")
    if device.type != "cuda":
        report.line("syncs", "skip", "host syncs are a CUDA matter; nothing to check on CPU")
    if args.no_train:
        report.line("overlap", "skip", "needs training (without --no-train)")
    if rank0:
        print("verdict: " + ("OK" if not report.failed else "FAILED: " + ", ".join(dict.fromkeys(report.failed))),
              flush=True)
    return 0 if not report.failed else 1


if __name__ == "__main__":
    sys.exit(main())
