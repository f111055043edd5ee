"""``hf-onebit check`` on CPU: a verdict a user can trust both ways."""

from __future__ import annotations

import subprocess
import sys

from hf_onebit import check
from hf_onebit.kernels import cpu, selftest


def test_the_check_passes_on_this_machine_and_trains_every_optimizer():
    res = subprocess.run([sys.executable, "-m", "hf_onebit.check", "--device", "cpu", "--size", "100000"],
                         capture_output=True, text=True, timeout=600)
    out = res.stdout
    assert res.returncode == 0, out + res.stderr
    assert "[kernels ] ok" in out and "verdict: OK" in out
    for name in check.OPTIMIZERS:
        assert f"[train   ] ok    {name} on 2 spawned CPU ranks (gloo)" in out, out
    overlap = next(line for line in out.splitlines() if line.startswith("[overlap ]"))
    assert overlap.startswith("[overlap ] ok") and "% of the communication hides behind backward" in overlap, out
    assert 0 <= int(overlap.split()[3].rstrip("%")) <= 100


def test_the_overlap_figure_follows_from_the_three_timings(capsys):
    report = check.Report()
    check.report_overlap({"compute_ms": 100.0, "overlapped_ms": 130.0, "serial_ms": 180.0, "hidden": 0.625,
                          "phase": "compression", "params": 6_300_000}, "2 ranks", report)
    check.report_overlap({"error": "Traceback ...\nRuntimeError: boom"}, "2 ranks", report)
    out = capsys.readouterr().out
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


def test_a_failed_training_step_is_reported_per_optimizer(capsys):
    report = check.Report()
    check.report_training({
        "onebit_adam": {"finite": True, "same": False, "phase": "compression", "ratio": 2.8, "syncs": 0},
        "binsgdm": {"finite": True, "same": True, "phase": "vote", "ratio": 1.0, "syncs": 0},
        "onebit_lamb": {"error": "Traceback ...\nRuntimeError: boom"},
    }, "2 ranks", report)
    out = capsys.readouterr().out
    assert "onebit_adam on 2 ranks: phase compression, 2.8x fewer bytes than fp32: ranks differ" in out
    assert "binsgdm on 2 ranks: phase vote, 1.0x fewer bytes than fp32: nothing compressed" in out
    assert "onebit_lamb on 2 ranks: RuntimeError: boom" in out
    assert report.failed == ["train", "train", "train"]
