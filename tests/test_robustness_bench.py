"""benchmarks/robustness.py: the grid's cells, the pairing with each method's own baseline, the
worst-cell report, and one tiny run of the real thing."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys

import pytest

from tests.benchmark_scripts import BENCHMARKS, load_benchmark

rb = load_benchmark("robustness")


def _args(**kw):
    base = dict(task="bow", methods=rb.METHODS, lr_mults=[0.25, 1.0], steps=[40], freezes=["auto", "0.2"], seeds=[1],
                optim_args=None)
    base.update(kw)
    ns = argparse.Namespace(**base)
    ns.baselines = rb.baselines_of(ns.methods)
    return ns


def test_each_method_runs_at_each_freeze_and_each_baseline_once():
    cells = rb.cells_of(_args(), world=8)
    names = [(c["method"], c["freeze"]) for c in cells if c["lr_mult"] == 1.0]
    assert sorted(names) == sorted([("adamw", "-"), ("adamw_binsgdm", "-"), ("lamb", "-"), ("mean_vote_binsgdm", "-"),
                                   ("unvoted_binsgdm", "-"), ("binsgdm", "-")]
                                   + [(m, f) for m in ("onebit_adam", "zeroone_adam", "onebit_lamb")
                                      for f in ("auto", "0.2")])
    spec = rb.TASKS["bow"]
    for c in cells:  # the global batch is fixed; each family at its own advised lr
        assert c["batch"] * 8 == spec["global_batch"]
        assert c["lr"] == c["lr_mult"] * spec["lr"][rb.family(c["method"])]
    # a baseline runs at its method's lr: LAMB's lr for uncompressed LAMB, BinSGDM's for its AdamW
    assert rb.family("lamb") == rb.family("onebit_lamb") and rb.family("adamw_binsgdm") == rb.family("binsgdm")


def test_gaps_pair_each_run_with_its_own_baseline_and_sign_worse_as_positive():
    runs = [
        dict(method="adamw", lr_mult=1, steps=40, world=2, seed=1, freeze="-", score=80.0),
        dict(method="lamb", lr_mult=1, steps=40, world=2, seed=1, freeze="-", score=70.0),
        dict(method="onebit_adam", lr_mult=1, steps=40, world=2, seed=1, freeze="auto", score=79.0),
        dict(method="onebit_lamb", lr_mult=1, steps=40, world=2, seed=1, freeze="auto", score=72.0),
        dict(method="onebit_lamb", lr_mult=1, steps=40, world=8, seed=1, freeze="auto", score=50.0),  # no baseline
    ]
    got = {(g["method"], g["world"]): g["gap"] for g in rb.gaps(runs, "accuracy")}
    assert got == {("onebit_adam", 2): pytest.approx(1.0), ("onebit_lamb", 2): pytest.approx(-2.0)}
    loss = [dict(r, score=s) for r, s in zip(runs[:3], (2.0, 9.0, 2.1))]
    assert [g["gap"] for g in rb.gaps(loss, "loss")] == [pytest.approx(5.0)]  # % of the baseline's loss


def test_the_report_names_each_methods_worst_cell(capsys):
    meta = dict(task="bow", metric="accuracy")
    runs = [dict(method="adamw", lr_mult=m, steps=40, world=2, seed=s, freeze="-", score=80.0)
            for m in (1, 4) for s in (1, 2)]
    runs += [dict(method="onebit_adam", lr_mult=m, steps=40, world=2, seed=s, freeze="auto", score=score)
             for m, s, score in ((1, 1, 79.5), (1, 2, 80.5), (4, 1, 77.0), (4, 2, 78.0))]
    worst = rb.summarize([dict(meta=meta, runs=runs)])["worst"]
    assert worst[("bow", "onebit_adam")] == (pytest.approx(2.5), ["auto", 4, 40, 2], 2)  # mean over the seeds
    rb.print_report([dict(meta=meta, runs=runs)])
    assert "+2.50 points  at lr x4, 40 steps, 2 ranks, freeze auto (2 seeds)" in capsys.readouterr().out


def test_a_later_run_of_a_cell_replaces_the_earlier_one():
    meta = dict(task="bow", metric="accuracy")
    base = dict(method="adamw", lr_mult=1, steps=40, world=2, seed=1, freeze="-", score=80.0)
    before = dict(base, method="zeroone_adam", freeze="auto", score=75.0)
    after = dict(before, score=79.5)
    worst = rb.summarize([dict(meta=meta, runs=[base, before]), dict(meta=meta, runs=[after])])["worst"]
    assert worst[("bow", "zeroone_adam")][0] == pytest.approx(0.5)


def test_a_tiny_grid_runs_and_reports(tmp_path):
    out = tmp_path / "grid.json"
    proc = subprocess.run(
        [sys.executable, str(BENCHMARKS / "robustness.py"), "--task", "bow", "--steps", "6", "--lr-mults", "1",
         "--world-sizes", "2", "--methods", "onebit_lamb", "binsgdm", "--freezes", "0.5", "--eval-size", "50",
         "--json", str(out)],
        capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(out.read_text())
    assert [(r["method"], r["freeze_step"]) for r in result["runs"]] == [
        ("adamw_binsgdm", None), ("lamb", None), ("mean_vote_binsgdm", None), ("unvoted_binsgdm", None),
        ("onebit_lamb", 3), ("binsgdm", None)]
    assert all(0 <= r["score"] <= 100 for r in result["runs"])
    assert result["runs"][4]["compression_ratio"] > 1  # it compressed after its freeze
    assert "1-bit LAMB" in proc.stdout
    # BinSGDM also against its own update without the vote: the exact mean of its ranks' votes, and
    # the update of the averaged gradient
    assert "BinSGDM vs exact mean" in proc.stdout and "BinSGDM vs no vote" in proc.stdout


def test_one_bit_lamb_keeps_lambs_progress_where_training_needs_its_lr(tmp_path):
    """The README's loop (``--task teacher``, 2 ranks, 60 steps at lr 1e-3, still far from converged):
    1-bit LAMB's default frozen trust ratio ends 1.3 points below uncompressed LAMB; LAMB's own ratio
    of the 1-bit update (``fresh_trust_ratio``), which also shrinks the progress, 3.8 points below."""
    out = tmp_path / "teacher.json"
    proc = subprocess.run(
        [sys.executable, str(BENCHMARKS / "robustness.py"), "--task", "teacher", "--steps", "60", "--lr-mults", "1",
         "--world-sizes", "2", "--methods", "onebit_lamb", "--freezes", "auto", "--seeds", "1", "--json", str(out)],
        capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    scores = {r["method"]: r["score"] for r in json.loads(out.read_text())["runs"]}
    assert scores["lamb"] - scores["onebit_lamb"] < 2.5, scores


def test_a_rank_that_fails_stops_the_grid_instead_of_hanging():
    proc = subprocess.run(
        [sys.executable, str(BENCHMARKS / "robustness.py"), "--task", "teacher", "--steps", "2", "--lr-mults", "1",
         "--world-sizes", "2", "--methods", "onebit_lamb", "--no-baselines", "--optim-args", '{"no_such_option": 1}'],
        capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0
    assert "no_such_option" in proc.stderr and "exited with 1 before the grid was done" in proc.stderr, proc.stderr[-3000:]


def test_bad_grids_are_refused_before_anything_runs():
    with pytest.raises(SystemExit):
        rb.main(["--task", "bow", "--world-sizes", "3"])  # 3 does not divide the global batch
    with pytest.raises(SystemExit):
        rb.main(["--task", "bow", "--freezes", "1.5"])
