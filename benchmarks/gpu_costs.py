"""What a compressed step costs on a GPU: kernel time against the byte floor, and per step the
aten ops, CUDA kernel launches, host syncs and milliseconds, against AdamW on the same model.

    python benchmarks/gpu_costs.py [--out DIR] [--tensors 20 200] [--sizes 20 24 26]

Two parts, each printed as a table and written to ``DIR/gpu_costs.json``:

* **kernels**: one buffer of ``2**k`` elements (fp32 and bf16): ``copy_``, the worker's scale and
  pack, the decompression, and the 8-bit warmup's scale and pack, each timed with CUDA events
  (median of 20), and the bandwidth each reaches counting the bytes it must move (its floor:
  a ``copy_`` of fp32 moves 8 bytes per element, ``worker_scale`` reads the value and the error,
  ``worker_pack`` reads both and writes the error and 1 bit, ...).
* **steps**: two processes on the one GPU, joined by gloo (one GPU cannot host two NCCL ranks;
  gloo moves CUDA tensors through pinned host memory, so the milliseconds include that transport),
  train a stack of linear layers of 20 or 200 tensors with each optimizer in its compression
  phase, under bf16 autocast (no scaler) and under fp16 with a GradScaler. Per step: aten ops
  dispatched in ``step()`` and in backward (the hook), CUDA kernels launched (the profiler),
  synchronising CUDA calls that ``torch.cuda.set_sync_debug_mode("warn")`` reports on the Python
  side (gloo's own worker threads synchronise their copies and are not counted), and the median
  step time. AdamW is DDP's default all-reduce with ``AdamW(foreach=True)``.

On CPU (no GPU) the steps part runs on CPU tensors, to check the script, and the kernels part is
skipped.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import socket
import statistics
import sys
import traceback
import warnings

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

OPTIMIZERS = ("adamw", "onebit_adam", "zeroone_adam", "onebit_lamb", "binsgdm")


# ------------------------------------------------------------------------------------- kernels
def _median_ms(fn, repeats: int = 20) -> float:
    for _ in range(3):
        fn()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def kernel_times(log2_sizes, device) -> list[dict]:
    from hf_onebit.kernels import get_backend

    k = get_backend(device)
    rows = []
    for dtype in (torch.float32, torch.bfloat16):
        for p in log2_sizes:
            n = 1 << p
            b = torch.finfo(dtype).bits // 8
            x = torch.randn(n, device=device).to(dtype)
            error = torch.zeros(n, device=device)
            bits = torch.empty(n // 8, dtype=torch.uint8, device=device)
            codes = torch.empty(n, dtype=torch.uint8, device=device)
            dst = torch.empty_like(x)
            out = torch.empty_like(x)
            scale = k.worker_scale(x, error).reshape(1)
            qscale = k.qworker_scale(x, error, width=8).reshape(1)
            ones = torch.ones(1, device=device)
            cases = {  # name: (function, bytes it must move per element)
                "copy_": (lambda: dst.copy_(x), 2 * b),
                "worker_scale": (lambda: k.worker_scale(x, error), b + 4),
                "worker_pack": (lambda: k.worker_pack(x, error, scale, 0, bits), b + 8 + 1 / 8),
                "unpack_scaled": (lambda: k.unpack_scaled(bits.reshape(1, -1), ones, out), 1 / 8 + b),
                "qworker_scale(8)": (lambda: k.qworker_scale(x, error, width=8), b + 4),
                "qworker_pack(8)": (lambda: k.qworker_pack(x, error, qscale, 0, codes, width=8), b + 8 + 1),
            }
            copy_ms = None
            for name, (fn, per_elem) in cases.items():
                ms = _median_ms(fn)
                copy_ms = copy_ms or ms
                rows.append({"dtype": str(dtype).removeprefix("torch."), "log2": p, "op": name, "ms": ms,
                             "GBps": per_elem * n / ms / 1e6, "x_copy": ms / copy_ms,
                             "floor_x_copy": per_elem / (2 * b)})
    return rows


# --------------------------------------------------------------------------------------- steps
class Stack(torch.nn.Module):
    def __init__(self, tensors: int, width: int) -> None:
        super().__init__()
        self.layers = torch.nn.ModuleList(torch.nn.Linear(width, width) for _ in range(tensors // 2))

    def forward(self, x):
        for layer in self.layers:
            x = torch.nn.functional.gelu(layer(x))
        return x


def _build(name, params, phase="compressed"):
    """``phase="compressed"``: the warmup ends at step 3, the measured steps (9-14) compress at 1 bit
    (0/1 Adam's local phase with a sync every other step). ``"warmup"``: the measured steps are the
    library's 8-bit warmup (0/1 Adam: its variance phase, the 8-bit variance step 12 among 1-bit
    gradient steps)."""
    import hf_onebit

    warm = phase == "warmup"
    if name == "adamw":
        return torch.optim.AdamW(params, lr=1e-4, foreach=True)
    if name == "onebit_adam":
        return hf_onebit.OneBitAdam(params, lr=1e-4, freeze_step=1000 if warm else 3)
    if name == "zeroone_adam":
        if warm:
            return hf_onebit.ZeroOneAdam(params, lr=1e-4, var_freeze_step=1000, var_update_scaler=2)
        return hf_onebit.ZeroOneAdam(params, lr=1e-4, var_freeze_step=3, local_step_scaler=1000, local_step_clipper=2)
    if name == "onebit_lamb":
        return hf_onebit.OneBitLamb(params, lr=1e-4, freeze_step=1000 if warm else 3)
    return hf_onebit.BinSGDM(params, lr=1e-4)


class OpCount:
    """aten ops dispatched while on (any thread that inherits the mode: autograd's do)."""

    def __init__(self):
        from torch.utils._python_dispatch import TorchDispatchMode

        counter = self

        class Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                counter.n += 1
                return func(*args, **(kwargs or {}))

        self.mode = Mode()
        self.n = 0


def one_config(name, tensors, precision, device, rank, phase="compressed", width=256, steps=14,
               measured=range(8, 14)):
    import hf_onebit
    from torch.nn.parallel import DistributedDataParallel as DDP

    torch.manual_seed(0)
    model = Stack(tensors, width).to(device)
    opt = _build(name, model.parameters(), phase)
    ddp = DDP(model, device_ids=[device] if device.type == "cuda" else None)
    scaler = torch.amp.GradScaler(device.type) if precision == "fp16+scaler" else None
    if name != "adamw":
        hf_onebit.attach(ddp, opt, grad_scaler=scaler)
    dtype = torch.bfloat16 if precision == "bf16" else torch.float16
    g = torch.Generator().manual_seed(rank)
    xs = [torch.randn(32, width, generator=g).to(device) for _ in range(steps)]
    cuda = device.type == "cuda"
    out = {"ops_step": [], "ops_backward": [], "kernels_per_step": None, "syncs_backward": 0, "syncs_step": 0,
           "ms": []}

    def backward(x):
        with torch.autocast(device.type, dtype=dtype):
            loss = ddp(x).float().pow(2).mean()
        (scaler.scale(loss) if scaler else loss).backward()

    def step():
        if scaler:
            scaler.step(opt)
            scaler.update()
        else:
            opt.step()
        opt.zero_grad(set_to_none=True)

    for t in range(steps):
        watched = t in measured
        if cuda:
            torch.cuda.synchronize()
        start = torch.cuda.Event(enable_timing=True) if cuda else None
        if start is not None:
            start.record()
        if watched and t == measured[0] and cuda:  # kernel launches of one whole step
            from torch.profiler import ProfilerActivity, profile

            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                backward(xs[t])
                step()
                torch.cuda.synchronize()
            out["kernels_per_step"] = sum(e.count for e in prof.key_averages() if e.device_type.name == "CUDA")
            continue
        for part, fn in (("backward", lambda: backward(xs[t])), ("step", step)):
            counter = OpCount()
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                if watched and cuda:
                    torch.cuda.set_sync_debug_mode("warn")
                try:
                    if watched:
                        with counter.mode:
                            fn()
                    else:
                        fn()
                finally:
                    if cuda:
                        torch.cuda.set_sync_debug_mode(0)
            if watched:
                out["ops_" + part].append(counter.n)
                out["syncs_" + part] += sum("synchroniz" in str(w.message) for w in caught)
        if cuda and t >= 4:
            end = torch.cuda.Event(enable_timing=True)
            end.record()
            end.synchronize()
            if not watched:
                out["ms"].append(start.elapsed_time(end))
    # unwatched timing: a few more steps without any counting
    for t in range(6):
        if cuda:
            torch.cuda.synchronize()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
        backward(xs[t])
        step()
        if cuda:
            end.record()
            end.synchronize()
            out["ms"].append(start.elapsed_time(end))
    out["phase"] = opt.phase() if hasattr(opt, "phase") else "adamw"
    out["ms"] = statistics.median(out["ms"]) if out["ms"] else None
    out["ops_step"] = statistics.mean(out["ops_step"])
    out["ops_backward"] = statistics.mean(out["ops_backward"])
    out["syncs_step"] /= len(measured) - 1
    out["syncs_backward"] /= len(measured) - 1
    finite = torch.cat([p.detach().reshape(-1) for p in model.parameters()]).isfinite().all()
    out["finite"] = bool(finite)
    return out


def _worker(rank, world, port, tensors_list, phases, queue):
    import torch.distributed as dist

    torch.set_num_threads(4)
    device = torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    results = []
    try:
        for precision, tensors, phase, name in itertools.product(("bf16", "fp16+scaler"), tensors_list, phases,
                                                                 OPTIMIZERS):
            if phase == "warmup" and (name == "binsgdm" or (name == "adamw" and "compressed" in phases)):
                continue  # BinSGDM has no warmup; AdamW's row is the same in both
            row = {"optimizer": name, "tensors": tensors, "precision": precision, "asked": phase}
            try:
                row.update(one_config(name, tensors, precision, device, rank, phase))
            except Exception:  # noqa: BLE001 - reported in the table
                row["error"] = traceback.format_exc(limit=4)
            results.append(row)
            if rank == 0:
                print(json.dumps(row), flush=True)
            dist.barrier()
    finally:
        if rank == 0:
            queue.put(results)
        dist.destroy_process_group()


def step_costs(tensors_list, phases=("compressed",)) -> list[dict]:
    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    queue = ctx.SimpleQueue()
    mp.start_processes(_worker, args=(2, port, tensors_list, tuple(phases), queue), nprocs=2, join=True, start_method="spawn")
    return queue.get()


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=".")
    parser.add_argument("--tensors", type=int, nargs="+", default=[20, 200])
    parser.add_argument("--sizes", type=int, nargs="+", default=[20, 24, 26], help="log2 of the timed buffers")
    parser.add_argument("--skip", nargs="*", default=[], choices=["kernels", "steps"])
    parser.add_argument("--phases", nargs="+", default=["compressed"], choices=["compressed", "warmup"],
                        help="which phase the steps part measures: the 1-bit phase, the 8-bit warmup, or both")
    args = parser.parse_args(argv)
    report = {"device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
              "torch": torch.__version__}
    if torch.cuda.is_available() and "kernels" not in args.skip:
        report["kernels"] = kernel_times(args.sizes, torch.device("cuda"))
        print(f"{'dtype':8} {'2^k':>4} {'op':18} {'ms':>8} {'GB/s':>8} {'x copy_':>8} {'floor':>6}")
        for r in report["kernels"]:
            print(f"{r['dtype']:8} {r['log2']:>4} {r['op']:18} {r['ms']:8.3f} {r['GBps']:8.0f} {r['x_copy']:8.2f}"
                  f" {r['floor_x_copy']:6.2f}", flush=True)
    if "steps" not in args.skip:
        report["steps"] = step_costs(args.tensors, args.phases)
        print(f"{'precision':12} {'optimizer':13} {'T':>4} {'ops step':>9} {'ops bwd':>8} {'kernels':>8}"
              f" {'sync step':>9} {'sync bwd':>8} {'ms':>7}  phase")
        for r in report["steps"]:
            if "error" in r:
                print(f"{r['precision']:12} {r['optimizer']:13} {r['tensors']:>4} ERROR "
                      + r["error"].strip().splitlines()[-1])
                continue
            ms = f"{r['ms']:7.2f}" if r["ms"] is not None else "      -"
            kern = r["kernels_per_step"] if r["kernels_per_step"] is not None else "-"
            print(f"{r['precision']:12} {r['optimizer']:13} {r['tensors']:>4} {r['ops_step']:9.0f}"
                  f" {r['ops_backward']:8.0f} {kern:>8} {r['syncs_step']:9.1f} {r['syncs_backward']:8.1f} {ms}"
                  f"  {r['phase']}{'' if r['finite'] else ' NON-FINITE'}")
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "gpu_costs.json"), "w") as f:
        json.dump(report, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
