"""benchmarks/time_to_accuracy.py's verdicts, on hand-made recipe reports (no network, no training)."""

from __future__ import annotations

import pytest

from tests.benchmark_scripts import load_benchmark


@pytest.fixture(scope="module")
def tta():
    return load_benchmark("time_to_accuracy")


def run(curve, final_accuracy=None, gb=1.0, ratio=1.0, freeze=None):
    """A run_method() result whose recipe report has ``curve`` as [(step, seconds, accuracy)]."""
    points = [{"step": s, "train_seconds": t, "bytes_sent": gb * 1e9 * s / curve[-1][0], "accuracy": a}
              for s, t, a in curve]
    acc = points[-1]["accuracy"] if final_accuracy is None else final_accuracy
    return {"report": {"eval": {"validation": {"accuracy": acc}}, "train_seconds_without_eval": curve[-1][1],
                       "wire": {"bytes_sent": gb * 1e9, "ratio": ratio}, "freeze_step": freeze, "curve": points}}


def test_time_to_accuracy_is_the_first_evaluation_at_the_target(tta):
    runs = {
        "adamw_torch": run([(24, 100.0, 0.70), (48, 200.0, 0.80), (72, 400.0, 0.820)]),
        # reaches 81.5 at 90 s (<= 400 / 4): met, though it dips below the target afterwards
        "onebit_adam": run([(24, 40.0, 0.75), (48, 90.0, 0.815), (72, 130.0, 0.81)], gb=0.1, ratio=10.0, freeze=30),
        # reaches it only at 110 s: missed
        "binsgdm": run([(24, 50.0, 0.79), (48, 110.0, 0.83), (72, 160.0, 0.83)], ratio=32.0),
        # never reaches it: missed, not an error
        "onebit_lamb": run([(24, 30.0, 0.60), (48, 60.0, 0.70), (72, 90.0, 0.80)]),
    }
    s = tta.summarize(runs, tolerance=0.5)
    assert s["target"] == pytest.approx(0.815) and s["budget_seconds"] == pytest.approx(100.0)
    rows = s["rows"]
    assert rows["onebit_adam"]["time_to_target"] == 90.0 and rows["onebit_adam"]["step_at_target"] == 48
    assert rows["onebit_adam"]["met"] is True and rows["onebit_adam"]["speedup"] == pytest.approx(400 / 130)
    assert rows["binsgdm"]["time_to_target"] == 110.0 and rows["binsgdm"]["met"] is False
    assert rows["onebit_lamb"]["time_to_target"] is None and rows["onebit_lamb"]["met"] is False
    assert rows["adamw_torch"]["met"] is None and rows["adamw_torch"]["time_to_target"] == 400.0
    # aiming at another AdamW accuracy (--against): 83.0 - 0.5 is reached by BinSGDM only, and too late
    other = tta.summarize(runs, tolerance=0.5, baseline_accuracy=0.83)["rows"]
    assert other["binsgdm"]["time_to_target"] == 110.0 and other["binsgdm"]["met"] is False
    assert other["onebit_adam"]["time_to_target"] is None and other["onebit_adam"]["met"] is False
    table = tta.print_table(s)
    assert "| 1-bit Adam | 30 | 130 s | 3.08x | 0.10 GB | 10.0x | 81.00 | 90 s (step 48) | 4.4x | 4.4x | met |" in table
    assert "| 1-bit LAMB | - | 90 s | 4.44x | 1.00 GB | 1.0x | 80.00 | not reached |  |  | missed |" in table
