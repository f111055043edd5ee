"""benchmarks/netbench/report.py's whole-run goals, on hand-made per-step figures (no network)."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

from netbench.report import warmup_speed, whole_run_goals  # noqa: E402


def row(label, step_s, phases, sps_run=None):
    t = [step_s * (s + 1) for s in range(len(phases))]
    return {"label": label, "t": t, "phases": phases, "sps_run": sps_run if sps_run is not None else 1 / step_s}


def test_warmup_speed_compares_the_same_steps():
    adamw = row("AdamW", 1.0, ["warmup"] * 4 + ["steady"] * 4)
    ours = row("1-bit Adam", 1.0, ["warmup"] * 3 + ["compression"] * 5)
    ours["t"] = [2.0, 3.1, 4.2, 4.5, 4.8, 5.1, 5.4, 5.7]  # step 1 slow (ignored), warmup steps 1.1 s
    assert abs(warmup_speed(ours, adamw) - 2.0 / 2.2) < 1e-9  # steps 2-3: AdamW 2 s, ours 2.2 s
    assert warmup_speed(row("BinSGDM", 1.0, ["vote"] * 8), adamw) is None  # no warmup


def test_whole_run_goals_are_met_or_missed_by_their_figures():
    phases = ["warmup"] * 4 + ["compression"] * 4
    rows = {"adamw": row("AdamW", 1.0, phases, sps_run=10.0), "powersgd": row("PowerSGD", 1.0, phases, sps_run=30.0),
            "onebit_adam": row("1-bit Adam", 1.0, phases, sps_run=46.0),
            "binsgdm": row("BinSGDM", 1.0, ["vote"] * 8, sps_run=38.0)}
    slow = {"rate": "200mbit", "bits_per_s": 2e8, "summary": {"rows": rows}}
    fast = {"rate": "unlimited", "bits_per_s": None,
            "summary": {"rows": {"adamw": row("AdamW", 1.0, phases), "onebit_adam": row("1-bit Adam", 1.1, phases)}}}
    lines = whole_run_goals({"rates": [slow, fast]})
    assert "MET  whole run at 200mbit: 1-bit Adam >= 4.5x AdamW samples/s: 4.60x" in lines
    assert "MET  whole run at 200mbit: 1-bit Adam >= 1.3x PowerSGD samples/s: 1.53x" in lines
    assert "MISSED whole run at 200mbit: BinSGDM >= 4.0x AdamW samples/s: 3.80x" in lines
    assert "MISSED whole run at 200mbit: BinSGDM >= 1.3x PowerSGD samples/s: 1.27x" in lines
    assert "MISSED unlimited: 1-bit Adam's warmup >= 0.95x AdamW samples/s over the same steps: 0.91x" in lines
