"""Time to accuracy on an emulated slow network: the GLUE recipe at its defaults, AdamW and every method.

    python benchmarks/time_to_accuracy.py [--rate 200mbit] [--methods adamw_torch onebit_adam ...]
        [--eval-steps 24] [--json docs/img/time_to_accuracy/tta_200mbit.json]
        [--plot docs/img/time_to_accuracy/accuracy_vs_time.png] [-- more recipe arguments]
    python benchmarks/time_to_accuracy.py --report-from docs/img/time_to_accuracy/tta_200mbit.json [--plot ...]
    (as root: it creates a network namespace per method; docs/results.md has the results)

For each method it creates a fresh network namespace whose loopback is rate-limited with
``tc tbf`` (benchmarks/netbench/link.py: the same link as benchmarks/network.py; the rate is the
aggregate of both ranks' traffic) and runs, inside it, the recipe exactly as a user would::

    accelerate launch --config_file recipes/accelerate/cpu_2proc.yaml recipes/glue/run_glue.py \\
        --optim METHOD --eval_strategy steps --eval_steps 24 --seed 42

i.e. the embedded Rotten Tomatoes task, 240 steps of 2 x 16, the pretrained MiniLM (all 22.7M
parameters trained: a 91 MB fp32 gradient), every optimizer and training-loop argument at the
library's defaults (automatic freeze, 8-bit warmup, LAMB's lr and BinSGDM's clipping policy), the
whole run with its warmup. The only additions are the evaluations every ``--eval-steps`` steps,
which give the curve: the recipe records, at each one, the training time so far *without* the
evaluations (``DevCurve`` in run_glue.py), the bytes sent so far and the dev accuracy.

What it reports, per method: the whole run's training time (evaluations excluded), bytes sent by
rank 0 and their ratio to fp32 DDP's, final dev accuracy, and the **time to accuracy**: the
training time at the first evaluation whose accuracy is at least AdamW's final accuracy less
``--tolerance`` points (0.5). The goal is a time to accuracy of at most a quarter of AdamW's whole
run. The curve is sampled every ``--eval-steps`` steps, so a time to accuracy is an upper bound
by up to one interval. One seed: the accuracies of single runs move by ~0.3-0.5 points between
seeds on this task (docs/results.md), so the target is a noisy line, and accuracy against AdamW
is decided by the 3-seed tables, not by this run.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from netbench import LABELS, REPO  # noqa: E402
from netbench.link import Interrupted, Namespaces, _raise_interrupted, parse_rate  # noqa: E402
from netbench.plots import COLORS, save_plot  # noqa: E402

sys.path.insert(0, str(REPO / "recipes"))
from cpu_launch import launch_command, offline_env  # noqa: E402

RECIPE = REPO / "recipes" / "glue" / "run_glue.py"
METHODS = ["adamw_torch", "onebit_adam", "zeroone_adam", "onebit_lamb", "binsgdm"]
BASELINE = "adamw_torch"


def label(method: str) -> str:
    """network.py's name for ``method`` (its AdamW is ``adamw``; ``--optim`` says ``adamw_torch``)."""
    return LABELS["adamw" if method == BASELINE else method]


def color(method: str) -> str:
    return COLORS["adamw" if method == BASELINE else method]


# ====================================================================== running
def run_method(method: str, ns_name: str | None, args, out: Path, log: Path) -> dict:
    """One whole recipe run inside namespace ``ns_name`` (None: the host loopback); its report."""
    env = offline_env()
    prefix = ["ip", "netns", "exec", ns_name] if ns_name else []
    cmd = [*prefix, *launch_command(str(RECIPE), "--optim", method, "--output_dir", str(out), "--eval_strategy", "steps",
                                    "--eval_steps", str(args.eval_steps), "--seed", str(args.seed), *args.extra)]
    load_before = os.getloadavg()
    start = time.perf_counter()
    with open(log, "w") as f:
        f.write(" ".join(cmd) + "\n")
        f.flush()
        proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, env=env, cwd=REPO, start_new_session=True)
        try:
            rc = proc.wait(timeout=args.timeout)
        except (subprocess.TimeoutExpired, Interrupted):
            os.killpg(proc.pid, signal.SIGKILL)
            raise
    wall = time.perf_counter() - start
    report_file = out / "glue_report.json"
    # the run is done once rank 0 has written its report: an abort at interpreter exit after it
    # (gloo, "terminate called without an active exception") does not void the measurement
    if not report_file.is_file():  # (``out`` was emptied before the run)
        raise RuntimeError(f"{method}: exit code {rc} and no report; see {log}")
    report = json.loads(report_file.read_text())
    return {"method": method, "exit_code": rc, "process_seconds": wall, "load_before": load_before,
            "load_after": os.getloadavg(), "command": " ".join(cmd[len(prefix):]), "report": report}


# ====================================================================== summary
def time_to(curve: list[dict], target: float) -> dict | None:
    """The first point of ``curve`` whose accuracy reaches ``target`` (None if none does)."""
    for point in curve:
        if point["accuracy"] >= target:
            return point
    return None


def summarize(runs: dict[str, dict], tolerance: float, budget_fraction: float = 0.25,
              baseline_accuracy: float | None = None) -> dict:
    """Rows of the table and the goal's verdicts, from the runs (``run_method``'s dicts) by method.
    ``baseline_accuracy`` (a fraction): AdamW's final accuracy to aim at instead of its run's own
    (e.g. that of the same command without evaluations)."""
    base = runs[BASELINE]["report"]
    base_acc = base["eval"]["validation"]["accuracy"] if baseline_accuracy is None else baseline_accuracy
    base_time = base["train_seconds_without_eval"]
    target = base_acc - tolerance / 100
    rows = {}
    for method, run in sorted(runs.items(), key=lambda kv: kv[0] != BASELINE):  # AdamW's row first
        r = run["report"]
        hit = time_to(r["curve"], target)
        row = {"label": label(method), "accuracy": r["eval"]["validation"]["accuracy"],
               "train_seconds": r["train_seconds_without_eval"], "bytes_sent": r["wire"]["bytes_sent"],
               "ratio": r["wire"]["ratio"], "freeze_step": r.get("freeze_step") or r.get("var_freeze_step"),
               "speedup": base_time / r["train_seconds_without_eval"],
               "time_to_target": hit["train_seconds"] if hit else None, "step_at_target": hit["step"] if hit else None}
        row["met"] = None if method == BASELINE else (hit is not None and hit["train_seconds"] <= budget_fraction * base_time)
        rows[method] = row
    return {"target": target, "baseline_accuracy": base_acc, "baseline_seconds": base_time,
            "budget_seconds": budget_fraction * base_time, "tolerance_points": tolerance, "rows": rows}


def print_table(summary: dict) -> str:
    lines = [f"target: AdamW's final dev accuracy {100 * summary['baseline_accuracy']:.2f} less"
             f" {summary['tolerance_points']:g} points = {100 * summary['target']:.2f};"
             f" budget: a quarter of AdamW's {summary['baseline_seconds']:.0f} s = {summary['budget_seconds']:.0f} s",
             "",
             "| method | warmup ended | whole run | vs AdamW | bytes sent (rank 0) | vs fp32 DDP | dev accuracy |"
             " time to target | vs AdamW's time to target | vs AdamW's run | goal (<= 1/4) |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    adamw_hit = summary["rows"].get(BASELINE, {}).get("time_to_target")
    for method, r in summary["rows"].items():
        if r["time_to_target"] is None:
            tta, to_target, share = "not reached", "", ""
        else:
            tta = f"{r['time_to_target']:.0f} s (step {r['step_at_target']})"
            # what a user compares: AdamW's own time to the same target, not its whole run
            to_target = f"{adamw_hit / r['time_to_target']:.1f}x" if adamw_hit else "AdamW never reached it"
            share = f"{summary['baseline_seconds'] / r['time_to_target']:.1f}x"
        goal = "" if r["met"] is None else ("met" if r["met"] else "missed")
        lines.append(f"| {r['label']} | {r['freeze_step'] or '-'} | {r['train_seconds']:.0f} s | {r['speedup']:.2f}x |"
                     f" {r['bytes_sent'] / 1e9:.2f} GB | {r['ratio']:.1f}x | {100 * r['accuracy']:.2f} | {tta} |"
                     f" {to_target} | {share} | {goal} |")
    text = "\n".join(lines)
    print(text, flush=True)
    return text


def plot(results: dict, path: Path) -> Path:
    """Dev accuracy (left) and bytes sent (right) against training time, one line per method."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    summary = results["summary"]
    fig, (acc_ax, bytes_ax) = plt.subplots(1, 2, figsize=(11, 4.2))
    for method, run in sorted(results["runs"].items(), key=lambda kv: kv[0] != BASELINE):
        curve = run["report"]["curve"]
        t = [p["train_seconds"] for p in curve]
        kw = dict(color=color(method), label=label(method), marker="o", ms=3)
        acc_ax.plot(t, [100 * p["accuracy"] for p in curve], **kw)
        bytes_ax.plot([0] + t, [0] + [p["bytes_sent"] / 1e9 for p in curve], **kw)
    acc_ax.axhline(100 * summary["target"], color="0.5", ls="--", lw=1,
                   label=f"AdamW's final less {summary['tolerance_points']:g} points")
    for ax in (acc_ax, bytes_ax):
        ax.axvline(summary["budget_seconds"], color="0.5", ls=":", lw=1, label="a quarter of AdamW's run")
        ax.set_xlabel("training time, evaluations excluded (s)")
        ax.set_xlim(left=0)
        ax.grid(alpha=0.3)
    acc_ax.set_ylabel("dev accuracy (%)")
    acc_ax.set_ylim(max(45, min(100 * p["accuracy"] for r in results["runs"].values()
                                for p in r["report"]["curve"]) - 2), None)
    bytes_ax.set_ylabel("bytes sent by rank 0 (GB)")
    acc_ax.legend(fontsize=8, loc="lower right")
    meta = results["meta"]
    fig.suptitle(f"Rotten Tomatoes, MiniLM, 2 CPU processes at {meta['rate']}: the recipe at its defaults,"
                 f" whole runs (warmup included), seed {meta['seed']}", fontsize=10)
    path.parent.mkdir(parents=True, exist_ok=True)
    return save_plot(fig, textwrap.fill(f"{meta['command']}  |  {meta['machine']}", 190), path, bottom=0.08)


# ====================================================================== main
def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rate", default="200mbit", help="the link, e.g. 200mbit, 1gbit or 'unlimited'")
    parser.add_argument("--methods", nargs="+", default=METHODS, choices=METHODS)
    parser.add_argument("--eval-steps", type=int, default=24, help="evaluate every this many steps (the curve)")
    parser.add_argument("--seed", type=int, default=42)
    parser.add_argument("--tolerance", type=float, default=0.5, help="points below AdamW's final accuracy")
    parser.add_argument("--out", type=Path, default=REPO / "outputs" / "time_to_accuracy")
    parser.add_argument("--json", type=Path, default=None, help="write every run's report and the summary here")
    parser.add_argument("--plot", type=Path, default=None, help="write the accuracy/bytes-against-time PNG here")
    parser.add_argument("--report-from", type=Path, default=None, help="only the table (and --plot) of an earlier --json")
    parser.add_argument("--against", type=float, default=None,
                        help="with --report-from: AdamW's final dev accuracy (%%) to aim at instead of the stored run's")
    parser.add_argument("--timeout", type=float, default=5400, help="seconds per method")
    parser.add_argument("extra", nargs="*", help="after --: arguments added to every recipe run")
    args = parser.parse_args()

    if args.report_from:
        results = json.loads(args.report_from.read_text())
        # recomputed from the runs: also a run stopped before its summary (--json is written after each method)
        tolerance = results.get("summary", {}).get("tolerance_points", args.tolerance)
        results["summary"] = summarize(results["runs"], tolerance,
                                       baseline_accuracy=None if args.against is None else args.against / 100)
        print_table(results["summary"])
        if args.plot:
            print(f"wrote {plot(results, args.plot)}")
        return
    if BASELINE not in args.methods:
        raise SystemExit(f"--methods must include {BASELINE}: the target and the budget are AdamW's")
    bits = parse_rate(args.rate)
    ns = Namespaces()
    usable, why = ns.available()
    if not usable:
        raise SystemExit(f"time_to_accuracy.py needs network namespaces ({why}): run it as root")
    args.out.mkdir(parents=True, exist_ok=True)
    results = {"meta": {"command": "python benchmarks/time_to_accuracy.py " + " ".join(sys.argv[1:]),
                        "rate": args.rate, "seed": args.seed, "eval_steps": args.eval_steps,
                        "machine": f"{os.cpu_count()}-core CPU ({platform.machine()}), 2 gloo ranks in one namespace"},
               "runs": {}}
    old = {s: signal.signal(s, _raise_interrupted) for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)}
    try:
        for method in args.methods:
            name = ns.create(bits)
            if name is None:
                raise RuntimeError("could not create a network namespace")
            print(f"[{time.strftime('%H:%M:%S')}] {method} in {name} ({ns.qdisc(name) or 'unthrottled'};"
                  f" load {os.getloadavg()[0]:.1f})", flush=True)
            out = args.out / method
            shutil.rmtree(out, ignore_errors=True)
            try:
                run = run_method(method, name, args, out, args.out / f"{method}.log")
                run["loopback_bytes"] = ns.lo_tx_bytes(name)
            finally:
                ns.delete(name)
            r = run["report"]
            print(f"    {r['train_seconds_without_eval']:.0f} s training, dev accuracy"
                  f" {100 * r['eval']['validation']['accuracy']:.2f}, {r['wire']['bytes_sent'] / 1e9:.2f} GB"
                  f" ({r['wire']['ratio']:.1f}x), exit code {run['exit_code']}", flush=True)
            results["runs"][method] = run
            if args.json:
                args.json.parent.mkdir(parents=True, exist_ok=True)
                args.json.write_text(json.dumps(results, indent=1, default=str))
    except Interrupted as exc:
        print(f"\ninterrupted ({exc}): removing namespaces", file=sys.stderr)
        raise SystemExit(130)
    finally:
        ns.cleanup()
        for s, h in old.items():
            signal.signal(s, h)
    results["summary"] = summarize(results["runs"], args.tolerance)
    print()
    print_table(results["summary"])
    if args.json:
        args.json.write_text(json.dumps(results, indent=1, default=str))
    if args.plot:
        print(f"wrote {plot(results, args.plot)}")


if __name__ == "__main__":
    main()
