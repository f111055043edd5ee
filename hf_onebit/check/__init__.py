"""``hf-onebit check``: what a user runs first, on whatever they have (a CPU, one GPU, N GPUs).

    hf-onebit check                        # this machine: CPU, or the current GPU
    python -m hf_onebit.check --device cpu
    torchrun --nproc-per-node 8 -m hf_onebit.check   # the launched world (NCCL on GPUs)

It checks, in order, and prints one line each and a verdict that names where each part ran
(parts 1-2, which each rank runs alone, are in :mod:`~hf_onebit.check.speed`; parts 3-5, on the
process group, in :mod:`~hf_onebit.check.world`):

1. **kernels**: the device's compression kernels compile and match the reference bit for bit
   (:func:`hf_onebit.kernels.selftest.self_test`, fp32/bf16/fp16 buckets);
2. **speed**: worker scale, worker pack and unpack of a ``--size`` fp32 buffer against a device
   ``copy_`` of it, each kernel's bandwidth counting its own bytes (``speed_bytes``); on a GPU
   each must reach ``SPEED_GOAL`` of ``copy_``'s, judged from ``GOAL_MIN_SIZE`` elements on
   (``judge_speed``);
3. **training**: DDP steps of each optimizer at the library's defaults (per-tensor scales, the
   automatic freeze bounded by the run's length) in bf16 autocast and in fp16 autocast with a
   ``GradScaler``, as the HF Trainer runs them, on the launched world or, when started alone, on
   2 spawned CPU (gloo) processes (the verdict says so): finite parameters, every rank equal
   (0/1 Adam: after a sync), past the warmup, fewer bytes than an fp32 all-reduce. Every rank
   agrees on each part's result before the next part starts (``run_part``): a part that
   raised on any rank stops every rank with the same message, and a rank that cannot agree
   (a peer stuck in a collective or gone) stops at once;
4. **host syncs** (CUDA only): hook and step in the steady compressed phase (after the step
   that starts it, which freezes masks once) under ``torch.cuda.set_sync_debug_mode("warn")``,
   counted by source: the finiteness guard's one read per step and the GradScaler's inf check
   are deliberate and reported apart; there should be no other;
5. **overlap**: how much of the hook's communication hides behind backward, on the same world
   (``measure_overlap``).
"""

from __future__ import annotations

import argparse
import os
import sys

import torch
import torch.distributed as dist


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


from hf_onebit.check.speed import GOAL_MIN_SIZE, check_kernels, check_speed  # noqa: E402 - after Report
from hf_onebit.check.world import (  # noqa: E402
    CheckAborted, gather_local_failures, report_world, run_world, train_on_spawned_cpu_ranks,
)


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
