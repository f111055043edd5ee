"""``hf-onebit check`` on CPU: a verdict a user can trust both ways."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest
import torch

from hf_onebit import check
from hf_onebit.check import speed, world
from hf_onebit.kernels import cpu, selftest
from tests.distributed import run_distributed

#: medians of 20 CUDA event timings on an NVIDIA H200 (torch 2.11, triton 3.6), one buffer of
#: 2^26 fp32 elements, in ms: two runs of the kernels as they were, one of them since
H200 = {"copy_": 0.133, "worker_scale": 0.164, "worker_pack": 0.219, "unpack_scaled": 0.122}
H200_RUNS = (H200, {"copy_": 0.130, "worker_scale": 0.210, "worker_pack": 0.193, "unpack_scaled": 0.079},
             {"copy_": 0.130, "worker_scale": 0.138, "worker_pack": 0.192, "unpack_scaled": 0.079})


def test_the_check_passes_on_this_machine_and_trains_every_optimizer_in_both_precisions():
    res = subprocess.run([sys.executable, "-m", "hf_onebit.check", "--device", "cpu", "--size", "100000",
                          "--steps", "5"], capture_output=True, text=True, timeout=900)
    out = res.stdout
    assert res.returncode == 0, out + res.stderr
    assert "[kernels ] ok" in out
    for precision in world.PRECISIONS:
        for name in world.OPTIMIZERS:
            line = next(x for x in out.splitlines() if f" {name} {precision} on " in x)
            assert line.startswith(f"[train   ] ok    {name} {precision} on 2 spawned CPU processes (gloo): 5 steps"), out
            assert "phase warmup" not in line and "phase variance" not in line  # the automatic freeze ended it
    overlap = next(line for line in out.splitlines() if line.startswith("[overlap ]"))
    if overlap.startswith("[overlap ] skip"):  # a loaded machine: serialised no slower than compute alone
        assert "below the timing noise" in overlap, out
        ran = "train on 2 spawned CPU processes (gloo)"
    else:
        assert overlap.startswith("[overlap ] ok") and "% of the communication hides behind backward" in overlap, out
        assert 0 <= int(overlap.split()[3].rstrip("%")) <= 100
        ran = "train, overlap on 2 spawned CPU processes (gloo)"
    # the verdict says where each part ran: here the training ran on CPU processes
    assert f"verdict: OK (ran: kernels, speed on cpu; {ran})" in out, out


def test_the_verdict_lists_where_each_part_ran(capsys):
    report = check.Report()
    report.line("kernels", "ok", "...", where="cuda:0")
    report.line("speed", "ok", "...", where="cuda:0")
    report.line("train", "ok", "...", where="2 spawned CPU processes (gloo)")
    report.line("train", "FAIL", "...", where="2 spawned CPU processes (gloo)")
    report.line("syncs", "skip", "needs the launched CUDA world")  # did not run: not listed
    assert report.verdict() == "FAILED: train (ran: kernels, speed on cuda:0; train on 2 spawned CPU processes (gloo))"


def test_the_speed_goal_comes_from_the_byte_floors():
    """The H200's kernels pass (the former goal, compress <= 2x a copy_, failed them: their byte
    floor is 2.5x); any one of them three times slower fails; small buffers are not judged."""
    n = padded = 1 << 26
    seconds = {k: v / 1e3 for k, v in H200.items()}
    status, detail, shares = speed.judge_speed(seconds, n, padded, "cuda")
    assert status == "ok", detail
    assert {k: round(100 * v) for k, v in shares.items()} == {"worker_scale": 81, "worker_pack": 92, "unpack_scaled": 56}
    assert "compress takes 2.88x a copy_ (its byte floor: 2.52x)" in detail  # > 2x: the former goal failed
    for run in H200_RUNS:
        seconds = {k: v / 1e3 for k, v in run.items()}
        assert speed.judge_speed(seconds, n, padded, "cuda")[0] == "ok", run
        for kernel in ("worker_scale", "worker_pack", "unpack_scaled"):
            slow = dict(seconds, **{kernel: 3 * seconds[kernel]})
            status, detail, _ = speed.judge_speed(slow, n, padded, "cuda")
            assert status == "FAIL" and detail.endswith(f"too slow: {kernel}"), detail
    seconds = {k: v / 1e3 for k, v in H200.items()}
    # a slower copy_ (another GPU) with kernels as slow in proportion still passes
    assert speed.judge_speed({k: 2 * v for k, v in seconds.items()}, n, padded, "cuda")[0] == "ok"
    assert speed.judge_speed(seconds, n // 4, padded // 4, "cuda")[0] == "skip"  # fixed costs dominate there
    assert speed.judge_speed(seconds, n, padded, "cpu")[0] == "ok"  # no goal for numba


def test_the_byte_floors_count_what_each_kernel_reads_and_writes():
    moved = speed.speed_bytes(1000, 1024)  # 1000 elements, the error buffer padded to 1024
    assert moved["copy_"] == 8000  # reads and writes 4 bytes an element
    assert moved["worker_scale"] == 4000 + 4096  # reads x and the error
    assert moved["worker_pack"] == 4000 + 2 * 4096 + 128  # reads x and the error; writes the error and 1 bit
    assert moved["unpack_scaled"] == 128 + 4000  # reads 1 bit, writes 4 bytes


def test_bad_arguments_are_refused_before_anything_runs(capsys):
    for argv in (["--steps", "3"], ["--size", "0"], ["--timeout", "0"]):
        with pytest.raises(SystemExit) as got:
            check.main(["--device", "cpu", *argv])
        assert got.value.code == 2
    err = capsys.readouterr().err
    assert "--steps must be at least 5" in err and "--size must be a positive" in err and "--timeout must be" in err


def test_the_overlap_figure_follows_from_the_three_timings(capsys):
    report = check.Report()
    world.report_overlap({"compute_ms": 100.0, "overlapped_ms": 130.0, "serial_ms": 180.0, "hidden": 0.625,
                          "phase": "compression", "params": 6_300_000}, "2 ranks", report)
    world.report_overlap({"error": "Traceback ...\nRuntimeError: boom"}, "2 ranks", report)
    world.report_overlap({"compute_ms": 100.0, "overlapped_ms": 101.0, "serial_ms": 99.0, "hidden": float("nan"),
                          "phase": "compression", "params": 6_300_000}, "2 ranks", report)
    out = capsys.readouterr().out
    assert "[overlap ] skip  on 2 ranks: the communication's cost is below the timing noise" in out
    assert "[overlap ] ok    62% of the communication hides behind backward on 2 ranks" in out
    assert "backward 100 ms alone, 130 ms with the hook, 180 ms serialised" in out
    assert "[overlap ] FAIL  on 2 ranks: RuntimeError: boom" in out and report.failed == ["overlap"]


def test_a_broken_kernel_fails_the_verdict(monkeypatch, capsys):
    monkeypatch.setattr(selftest, "_PASSED", set())
    real = cpu.unpack_scaled

    def off_by_one_scale(bits, scales, out, *, bounds=None):
        real(bits, scales * 1.5, out, bounds=bounds)

    monkeypatch.setattr(cpu, "unpack_scaled", off_by_one_scale)
    assert check.main(["--device", "cpu", "--size", "4096", "--no-train"]) == 1
    out = capsys.readouterr().out
    assert "[kernels ] FAIL" in out and "unpacked" in out and "verdict: FAILED: kernels" in out


def _result(**kw):
    base = {"finite": True, "same": True, "phase": "compression", "ratio": 8.2, "steps": 10, "params": 7491,
            "tensors": 14, "syncs": 0, "guard_syncs": 0, "scaler_syncs": 0, "watched": 0, "precision": "bf16"}
    return {**base, **kw}


def test_a_failed_training_step_is_reported_per_optimizer(capsys):
    report = check.Report()
    world.report_training({
        ("onebit_adam", "bf16"): _result(same=False),
        ("binsgdm", "fp16"): _result(phase="vote", ratio=1.0),
        ("zeroone_adam", "bf16"): _result(phase="variance"),
        ("onebit_lamb", "bf16"): {"error": "Traceback ...\nRuntimeError: boom"},
    }, "2 ranks", report)
    out = capsys.readouterr().out
    assert "onebit_adam bf16 on 2 ranks: 10 steps, phase compression, 8.2x fewer bytes than fp32" in out
    assert out.splitlines()[0].endswith(": ranks differ")
    assert "binsgdm fp16 on 2 ranks: 10 steps, phase vote, 1.0x" in out and "nothing compressed" in out
    assert "zeroone_adam bf16" in out and "still in its warmup" in out  # 8-bit warmup bytes alone do not pass
    assert "onebit_lamb bf16 on 2 ranks: RuntimeError: boom" in out
    assert report.failed == ["train"] * 4


def test_host_syncs_are_counted_apart_from_the_deliberate_ones(capsys):
    report = check.Report()
    world.report_training({
        ("onebit_adam", "bf16"): _result(watched=5, guard_syncs=5),
        ("onebit_lamb", "fp16"): _result(watched=5, scaler_syncs=5, syncs=2),
    }, "2 launched ranks (nccl, cuda)", report)
    out = capsys.readouterr().out
    assert ("[syncs   ] ok    onebit_adam bf16 on 2 launched ranks (nccl, cuda): no host synchronisation in hook and"
            " step over 5 compressed steps (5 by the finiteness guard (its one read a step), deliberate)") in out
    assert "[syncs   ] FAIL  onebit_lamb fp16 on 2 launched ranks (nccl, cuda): 2 host synchronisations" in out
    assert "5 by the GradScaler (its inf check), deliberate" in out and report.failed == ["syncs"]


# ------------------------------------------------------------------ ranks agree on every part
def _one_rank_fails_a_part(rank, world_size, how, pg_timeout):
    """Rank 1 fails at the third step of the first part, before its forward: rank 0 is then
    left in the step's exchange, waiting for it."""
    import os
    from datetime import timedelta

    import torch.distributed as dist

    side = dist.new_group(backend="gloo", timeout=timedelta(seconds=2 * pg_timeout))
    real = world.train_step

    def faulty(run, it):
        if rank == 1 and it == 3:
            if how == "die":
                os._exit(17)  # no cleanup, like a killed process
            raise ValueError("injected fault on rank 1")
        real(run, it)

    world.train_step = faulty
    start = time.monotonic()
    try:
        out = world.run_world(torch.device("cpu"), 5, side, sync_check=False)
    except world.CheckAborted as exc:
        out = {"aborted": str(exc)}
    finally:
        world.train_step = real
    return {**out, "seconds": time.monotonic() - start}


def test_a_rank_that_fails_a_part_stops_every_rank_with_the_same_clear_error():
    pg_timeout = 5
    outs = run_distributed(_one_rank_fails_a_part, 2, "raise", pg_timeout, pg_timeout=pg_timeout, fresh=True,
                           timeout=120)
    for rank, out in enumerate(outs):
        assert "stopped" in out and "overlap" not in out, (rank, out)
        assert out["train"] == {}  # the first part failed: no later part ran
        message = out["stopped"]
        assert message.startswith("part 'train onebit_adam bf16' failed on rank(s) ") and "Every rank stopped" in message
        assert "rank 1: ValueError: injected fault on rank 1" in message, message
        # rank 0 waited in the exchange until the process group's timeout, then both agreed
        assert out["seconds"] < 4 * pg_timeout + 30, out["seconds"]
    assert outs[0]["stopped"] == outs[1]["stopped"]  # the same verdict on every rank


def test_a_rank_that_dies_in_a_part_leaves_the_others_a_clear_error_not_a_hang():
    pg_timeout = 5
    got = run_distributed(_one_rank_fails_a_part, 2, "die", pg_timeout, pg_timeout=pg_timeout, allow_dead=True,
                          wait_for=[0], timeout=120)
    out = got[0]
    assert "aborted" in out, out
    assert out["aborted"].startswith("rank 0: part 'train onebit_adam bf16' failed here: ")
    assert "could not agree on its result" in out["aborted"] and "Stopping this rank" in out["aborted"]
    assert out["seconds"] < 4 * pg_timeout + 30


def _gathered(rank, world_size):
    import torch.distributed as dist

    side = dist.new_group(backend="gloo")
    report = check.Report(quiet=True)
    if rank == 1:  # its GPU failed the kernels; rank 0's did not
        report.line("kernels", "FAIL", "bf16 bucket:\nunpacked 3 values wrong")
    world.gather_local_failures(side, report)
    return report.failed, report.failures


def test_a_kernel_failure_on_another_rank_fails_rank_0s_verdict():
    """Only rank 0 prints the verdict, so every rank's kernel and speed failures reach it."""
    (failed0, failures0), (failed1, failures1) = run_distributed(_gathered, 2)
    assert failed0 == ["kernels"] and failures0 == [("kernels", "rank 1: bf16 bucket: unpacked 3 values wrong")]
    assert failed1 == ["kernels"] and failures1 == [("kernels", "bf16 bucket:\nunpacked 3 values wrong")]
