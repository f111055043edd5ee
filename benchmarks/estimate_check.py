"""The cost model (``hf-onebit estimate``) against this repository's emulated-network runs.

    python benchmarks/estimate_check.py [--img docs/img] [--kernels-from docs/img/kernels_cpu.json] [--json out.json]

For every stored run of ``benchmarks/network.py`` (2 gloo ranks whose traffic shares one
rate-limited loopback) and ``benchmarks/two_nodes.py`` (2 nodes of 2 ranks joined by a veth
pair rate-limited each way), every method the model covers and each of its phases, it predicts
the step time with :mod:`hf_onebit.cost_model` and prints it beside the measured one.

What the prediction is given (what a user would know, nothing fitted to a point):

* the run's layout (ranks, nodes, how the emulated link is shared) and the link's rate;
* ``compute``: the run's own ``compute_s`` at that rate, the median AdamW step with no
  communication (``ddp.no_sync()``) measured in the same processes (``--step-ms``);
* the model (``P`` from the JSON, MiniLM's width 384 for PowerSGD, about 100 parameter tensors)
  and the optimizer configuration the run used (below);
* the kernels' speed from ``--kernels-from`` (default ``docs/img/kernels_cpu.json``, written by
  ``hf-onebit check --device cpu --no-train --json docs/img/kernels_cpu.json`` on a 2-core machine
  like the runs'), and the model's defaults for everything else (overlap 0.5, 0.05 ms per hop:
  TCP; the loopback inside an emulated node unlimited).

Measured: the compressed phase is the JSON's ``step_s_compress`` (mean over steps ``freeze+3 ..
steps``); the warmup is the median step time of the warmup steps after the first (which pays
DDP's setup). PowerSGD's warmup is network.py's ``start_powerSGD_iter`` (``--freeze``, or 20% of the
run under ``--freeze auto``). Beside each point: the machine's load average before and after that
rate (2 cores shared with other jobs: ``compute`` is measured once, at the rate's start), and the
bytes per step the model predicts against the run's counters, for the phase and for the whole
run (a check that the configuration below is the run's). The run's configuration, from its command and its code's date (the counted bytes
beside each point confirm it):

* ``network.json`` (2026-11-22, ``--freeze 8``): full-precision warmups (before the 8-bit default),
  one scale per chunk; 0/1 Adam with network.py's schedule for a fixed freeze (``var_update_scaler
  2``, ``local_step_scaler 4``, ``local_step_clipper 16``, full-precision variance steps);
* ``defaults/network.json`` (``--freeze auto``): the library defaults (8-bit warmups, a scale per
  tensor) but 0/1 Adam still on network.py's schedule for short runs (its counted bytes: 1-bit
  steps in the variance phase, syncs on ~27% of the local steps); ``defaults/network_rerun.json``, ``network_zeroone.json``, ``network_warmup.json``: the
  library defaults throughout (0/1 Adam syncs every step);
* ``two_nodes_hsdp.json``: full-precision warmups; its HSDP rows (FSDP2) are outside the model,
  only the flat 1-bit Adam row is predicted.

Unthrottled ("unlimited") points test only compute + kernels; the summary counts them apart.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from hf_onebit.cost_model import Config, Kernels, Layout, mean_phase, method_plans, plan_phase, zeroone_plans  # noqa: E402

TOLERANCE = 0.25
HIDDEN = 384  # all-MiniLM-L6-v2
TENSORS = 100  # its trained parameter tensors (about)
LATENCY_S = 5e-5  # TCP
NETWORK_ZEROONE = dict(var_update_scaler=2, local_step_scaler=4, local_step_clipper=16)  # network.py, 40 steps

#: the stored runs: file -> how the run was configured (see the module docstring); without a
#: ``scale_block`` a run kept one scale per tensor
RUNS = {
    "network.json": dict(layout=(2, 2), shared=True, warmup_bits=32, tensors=None, zeroone=NETWORK_ZEROONE),
    "defaults/network.json": dict(layout=(2, 2), shared=True, warmup_bits=8, tensors=TENSORS,
                                  zeroone=NETWORK_ZEROONE),
    "defaults/network_rerun.json": dict(layout=(2, 2), shared=True, warmup_bits=8, tensors=TENSORS, zeroone={}),
    "defaults/network_zeroone.json": dict(layout=(2, 2), shared=True, warmup_bits=8, tensors=TENSORS, zeroone={}),
    "defaults/network_warmup.json": dict(layout=(2, 2), shared=True, warmup_bits=8, tensors=TENSORS, zeroone={}),
    "two_nodes_hsdp.json": dict(layout=(4, 2), shared=False, warmup_bits=32, tensors=None, zeroone={}),
}
MODELLED = ("adamw", "powersgd", "onebit_adam", "zeroone_adam", "onebit_lamb", "binsgdm")


@dataclass
class Point:
    file: str
    rate: str
    layout: str
    method: str
    phase: str
    compute_ms: float
    predicted_ms: float
    measured_ms: float
    error: float  # predicted / measured - 1
    bytes_predicted: float | None
    bytes_counted: float | None
    run_bytes_predicted: float  # mean per step over the whole run
    run_bytes_counted: float
    load: str  # the machine's 1-minute load average before and after the rate

    @property
    def throttled(self) -> bool:
        return self.rate != "unlimited"


def _step_times(row: dict) -> list[float]:
    t = row["t"]
    return [t[0]] + [b - a for a, b in zip(t, t[1:])]


def _freeze(row: dict) -> int:
    """Steps before the compressed phase (the run's chosen freeze; 0/1 Adam: its variance phase)."""
    return sum(1 for p in row["phases"] if p in ("warmup", "variance"))


def points_of(name: str, data: dict, kernels: Kernels) -> list[Point]:
    conf = RUNS[name]
    n, m = conf["layout"]
    layout_label = f"{n} ranks, " + ("1 shared link" if conf["shared"] else f"{m} nodes x {n // m}")
    steps = data["meta"]["steps"]
    params = data["params"]
    out = []
    for entry in data["rates"]:
        bps = entry["bits_per_s"] or math.inf
        cfg = Config(params=params, layout=Layout(n, m), link_bps=bps, intra_bps=math.inf, latency_s=LATENCY_S,
                     compute_s=entry["compute_s"], dtype="fp32", warmup_bits=conf["warmup_bits"],
                     tensors=conf["tensors"], scale_block=conf.get("scale_block"), hidden=HIDDEN, kernels=kernels,
                     shared_link=conf["shared"])
        lo, hi = entry["summary"]["window"]
        load = f"{entry['load_before'][0]:.1f}-{entry['load_after'][0]:.1f}"
        for method, row in entry["summary"]["rows"].items():
            if method not in MODELLED:
                continue
            if method == "powersgd":  # network.py's start_powerSGD_iter: --freeze, or 20% of the run under auto
                f = data["meta"]["freeze"]
                freeze = max(2, f if isinstance(f, int) else round(0.2 * steps))
            else:
                freeze = _freeze(row)
            if method == "zeroone_adam":
                plans = zeroone_plans(steps, freeze, **conf["zeroone"])
            else:
                plans = method_plans(method, steps, freeze)
            phases = {p: plan_phase(cfg, p, False) for p in set(plans)}
            dts = _step_times(row)
            run_mb = (sum(phases[p].sent for p in plans) / steps, row["bytes_run"])  # the configuration's check
            # compressed phase: the window's mean, predicted over the same steps
            window = [phases[p] for p in plans[lo - 1 : hi]]
            comp = mean_phase(window)
            out.append(Point(name, entry["rate"], layout_label, method, "step" if method in ("adamw", "binsgdm")
                             else "compressed", cfg.compute_s * 1e3, comp.time * 1e3, row["step_s_compress"] * 1e3,
                             comp.time / row["step_s_compress"] - 1, comp.sent, row["bytes_compress"], *run_mb, load))
            if method in ("adamw", "binsgdm") or freeze < 3:
                continue
            # warmup: steps 2 .. freeze (step 1 pays DDP's setup), medians
            warm_steps = list(range(2, freeze + 1))
            measured = statistics.median(dts[s - 1] for s in warm_steps)
            predicted = statistics.median(phases[plans[s - 1]].time for s in warm_steps)
            sent = statistics.median(phases[plans[s - 1]].sent for s in warm_steps)
            counted = None
            if method != "zeroone_adam":  # every step after the freeze sends the window's bytes
                counted = (row["bytes_run"] * steps - row["bytes_compress"] * (steps - freeze)) / freeze
            out.append(Point(name, entry["rate"], layout_label, method, "warmup", cfg.compute_s * 1e3,
                             predicted * 1e3, measured * 1e3, predicted / measured - 1, sent, counted, *run_mb, load))
    return out


def collect(img: Path, kernels: Kernels) -> list[Point]:
    points = []
    for name in RUNS:
        path = img / name
        if path.exists():
            points += points_of(name, json.loads(path.read_text()), kernels)
    return points


def summary(points: list[Point]) -> list[str]:
    throttled = [p for p in points if p.throttled]
    ok = [p for p in throttled if abs(p.error) <= TOLERANCE]
    rates = sorted({p.rate for p in ok}, key=lambda r: float(r.rstrip("mgbit")) * (1e3 if "gbit" in r else 1))
    layouts = sorted({p.layout for p in ok})
    unl = [p for p in points if not p.throttled]
    lines = [
        f"throttled points within ±{TOLERANCE:.0%}: {len(ok)} of {len(throttled)}"
        f" (median |error| {100 * statistics.median(abs(p.error) for p in throttled):.0f}%);"
        f" their rates: {', '.join(rates)}; their layouts: {'; '.join(layouts)}",
    ]
    if unl:
        within = sum(abs(p.error) <= TOLERANCE for p in unl)
        lines.append(f"unthrottled points (compute + kernels only) within ±{TOLERANCE:.0%}: {within} of {len(unl)}")
    miss = [p for p in throttled if abs(p.error) > TOLERANCE]
    if miss:
        lines.append("missed (throttled): " + "; ".join(f"{p.file} {p.rate} {p.method} {p.phase} {100 * p.error:+.0f}%"
                                                        for p in miss))
    return lines


def render(points: list[Point], kernels: Kernels) -> str:
    head = (f"{'run':<30} {'rate':>9} {'layout':<22} {'method':<13} {'phase':<10} {'compute':>8} {'predicted':>10}"
            f" {'measured':>9} {'error':>7} | {'load':>8} | {'phase MB':>8} {'counted':>8} | {'run MB':>6} {'counted':>7}")
    out = [f"cost model vs the stored emulated-network runs (kernels: {kernels.source}); ms per step", head,
           "-" * len(head)]
    for p in points:
        mb = (f"{p.bytes_predicted / 1e6:>8.3f} {p.bytes_counted / 1e6:>8.3f}" if p.bytes_counted is not None
              else f"{p.bytes_predicted / 1e6:>8.3f} {'-':>8}")
        out.append(f"{p.file:<30} {p.rate:>9} {p.layout:<22} {p.method:<13} {p.phase:<10} {p.compute_ms:>8.0f}"
                   f" {p.predicted_ms:>10.0f} {p.measured_ms:>9.0f} {100 * p.error:>+6.0f}% | {p.load:>8} | {mb} |"
                   f" {p.run_bytes_predicted / 1e6:>6.2f} {p.run_bytes_counted / 1e6:>7.2f}")
    return "\n".join(out + [""] + summary(points))


def markdown(points: list[Point]) -> str:
    """The throttled points as one row per run and rate, one column per method (compressed / warmup)."""
    cols = [m for m in MODELLED if any(p.method == m for p in points)]
    names = {"adamw": "AdamW", "powersgd": "PowerSGD", "onebit_adam": "1-bit Adam", "zeroone_adam": "0/1 Adam",
             "onebit_lamb": "1-bit LAMB", "binsgdm": "BinSGDM"}
    out = ["| run | rate | layout | compute ms | " + " | ".join(names[m] for m in cols) + " |",
           "|---|---|---|---|" + "---|" * len(cols)]
    keys = list(dict.fromkeys((p.file, p.rate) for p in points if p.throttled))
    for file, rate in keys:
        mine = [p for p in points if (p.file, p.rate) == (file, rate)]
        cells = []
        for m in cols:
            errs = [f"{100 * p.error:+.0f}%" for phase in ("step", "compressed", "warmup")
                    for p in mine if p.method == m and p.phase == phase]
            cells.append(" / ".join(errs).replace("-", "−") or "–")
        out.append(f"| `{file}` | {rate} | {mine[0].layout} | {mine[0].compute_ms:.0f} | " + " | ".join(cells) + " |")
    return "\n".join(out + [""] + summary(points))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--img", type=Path, default=REPO / "docs" / "img")
    parser.add_argument("--kernels-from", type=Path, default=REPO / "docs" / "img" / "kernels_cpu.json")
    parser.add_argument("--json", type=Path, default=None, help="also write every point here")
    parser.add_argument("--markdown", action="store_true",
                        help="print the throttled points' errors as one table row per run and rate (docs/cost-model.md)")
    args = parser.parse_args(argv)
    path = args.kernels_from.resolve()
    kernels = Kernels.load(str(path))
    if path.is_relative_to(REPO):  # the same text wherever it runs from
        kernels.source = kernels.source.replace(str(path), str(path.relative_to(REPO)))
    points = collect(args.img, kernels)
    if not points:
        raise SystemExit(f"no stored runs under {args.img} ({', '.join(RUNS)})")
    print(markdown(points) if args.markdown else render(points, kernels))
    if args.json:
        args.json.write_text(json.dumps([asdict(p) for p in points], indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
