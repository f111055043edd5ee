"""``hf-onebit estimate``: bytes and step time of each method before you run it (a cost model).

    hf-onebit estimate --params 7e9 --gpus 16 --nodes 2 --link 100gbit --step-ms 850
    python -m hf_onebit.estimate --params 350m --gpus 8 --nodes 8 --link 10gbit --step-ms 300 --dtype fp32

The flags in, a table out; the formulas are :mod:`hf_onebit.cost_model`'s.
"""

from __future__ import annotations

import argparse
import math
import re
import sys
from dataclasses import dataclass

from hf_onebit.cost_model import (
    DEFAULT_KERNELS,
    GRAD_BYTES,
    METHOD_PLANS,
    METHODS,
    RING_ONLY,
    Config,
    EstimateError,
    Kernels,
    Layout,
    Phase,
    ddp_buckets,
    mean_phase,
    method_plans,
    plan_phase,
)
from hf_onebit.optim.freeze import AutoFreeze


# ============================================================================== flags
_NUMBER = r"^\s*([0-9]+(?:\.[0-9]+)?(?:e[+-]?[0-9]+)?)\s*"
_RATE = re.compile(_NUMBER + r"([kmgt]?)(bit|bps|bit/s)\s*$", re.IGNORECASE)
_COUNT = re.compile(_NUMBER + r"([kmbt]?)\s*$", re.IGNORECASE)
_PREFIX = {"": 1.0, "k": 1e3, "m": 1e6, "g": 1e9, "b": 1e9, "t": 1e12}


def _parse(text, pattern: re.Pattern, flag: str, what: str, valid, bound: str) -> float:
    """The number ``pattern`` reads in ``text``, times its decimal prefix; ``valid`` and finite."""
    m = pattern.match(str(text))
    if not m:
        raise EstimateError(f"{flag}: cannot read {text!r} as {what}")
    value = float(m.group(1)) * _PREFIX[m.group(2).lower()]
    if not (valid(value) and math.isfinite(value)):
        raise EstimateError(f"{flag}: {bound}, got {text!r}")
    return value


def parse_rate(text: str, flag: str = "--link") -> float:
    """Bits per second from ``100gbit``, ``200mbit``, ``10Gbps``, ``1.5gbit/s`` (decimal prefixes).

    Bits only: ``100gb``, ``100GB/s`` or a bare ``100`` are refused (bits or bytes? per second?)."""
    what = ("a rate; write a number and a unit of bits per second: bit, kbit, mbit, gbit, tbit (or kbps, mbps, gbps),"
            " e.g. 100gbit, 200mbit, 10gbps")
    return _parse(text, _RATE, flag, what, lambda v: v > 0, "the rate must be positive")


def parse_count(text: str, flag: str = "--params") -> int:
    """A count from ``7e9``, ``7b``, ``350m``, ``1.3B``, ``125000000`` (k, m, b = 1e9, t = 1e12)."""
    what = "a count; e.g. 7e9, 7b, 350m, 125000000"
    return int(round(_parse(text, _COUNT, flag, what, lambda v: v >= 1, "must be at least 1")))


def _in_units(x: float, units: tuple, spec: str) -> str:
    """``x`` in the first of ``units`` (name, size; largest first) it reaches, else in the last."""
    name, size = next((u for u in units if x >= u[1]), units[-1])
    return f"{x / size:{spec}} {name}"


def fmt_rate(bps: float) -> str:
    units = (("Tbit/s", 1e12), ("Gbit/s", 1e9), ("Mbit/s", 1e6), ("kbit/s", 1e3), ("bit/s", 1))
    return "unlimited" if math.isinf(bps) else _in_units(bps, units, "g")


# ============================================================================== the table
@dataclass
class Row:
    method: str
    exchange: str  # "ring", "flat", "by node"
    warmup: Phase | None
    compressed: Phase
    run_s: dict  # freeze step -> seconds of the whole run
    run_bytes: dict  # freeze step -> bytes leaving one node (one node: one rank sends) in the whole run


def freeze_bounds(steps: int) -> tuple[int, int]:
    """The automatic freeze's bounds for a run of ``steps``, the two the table prices."""
    rule = AutoFreeze.for_run(steps)
    return rule.min_step, rule.max_step


def estimate(cfg: Config, steps: int, methods=METHODS) -> list[Row]:
    """Every method, flat and (on several nodes of several ranks) by node."""
    rows, lay, bounds = [], cfg.layout, freeze_bounds(steps)
    for method in methods:
        _, warm, comp = METHOD_PLANS[method]
        ring = method in RING_ONLY
        for by_node in [False, True] if not ring and lay.nodes > 1 and lay.per_node > 1 else [False]:
            cache: dict = {}

            def phase(plan, by_node=by_node):
                if plan not in cache:
                    cache[plan] = plan_phase(cfg, plan, by_node)
                return cache[plan]

            plans = {f: method_plans(method, steps, f) for f in bounds}
            run_s = {f: sum(phase(p).time for p in plans[f]) for f in bounds}
            run_bytes = {f: sum(phase(p).between if lay.nodes > 1 else phase(p).sent for p in plans[f]) for f in bounds}
            # 0/1 Adam's compressed phase: the mean step after its variance phase
            after = phase(comp) if comp else mean_phase([phase(p) for p in plans[bounds[0]][bounds[0]:]])
            rows.append(Row(method, "ring" if ring else ("by node" if by_node else "flat"),
                            phase(warm) if warm else None, after, run_s, run_bytes))
    return rows


def _mb(x: float) -> str:
    return f"{x / 1e6:,.1f}" if x >= 1e5 else f"{x / 1e6:.3f}"


def render(cfg: Config, steps: int, rows: list[Row]) -> str:
    lay, (lo, hi) = cfg.layout, freeze_bounds(steps)
    base = next(r for r in rows if r.method == "adamw")
    out = [
        f"hf-onebit estimate: {cfg.params:.3g} parameters, {cfg.dtype} gradients ({cfg.grad_bytes} bytes), "
        f"{lay.ranks} ranks on {lay.nodes} node(s) ({lay.per_node} per node), "
        f"{len(ddp_buckets(cfg.params, cfg.grad_bytes))} DDP buckets",
        f"  link between nodes {fmt_rate(cfg.link_bps)} each way per node"
        + (" (shared by every rank)" if cfg.shared_link else "")
        + f"; inside a node {fmt_rate(cfg.intra_bps)}; latency {cfg.latency_s * 1e3:g} ms per hop",
        f"  compute {cfg.compute_s * 1e3:g} ms per step (--step-ms); the hook's exchanges hide behind"
        f" {cfg.overlap:.0%} of it (--overlap); kernels: {cfg.kernels.source}",
        f"  warmup at {cfg.warmup_bits if cfg.warmup_bits != 32 else 'full precision (32)'} bits;"
        f" {steps} steps, the automatic freeze between steps {lo} and {hi} (10-40%)",
        "",
        "MB per step: 'sent' by one rank (what the library's counters show), 'between' leaving one node on its"
        " link; 'GB run': the whole run's bytes " + ("between nodes, per node" if lay.nodes > 1 else "sent by one rank")
        + ", at both freeze bounds.",
        f"{'method':<11} {'exchange':<8} | {'warmup: sent':>12} {'between':>9} {'step ms':>9} | "
        f"{'compressed: sent':>16} {'between':>9} {'step ms':>9} | {'run @' + str(lo):>10} {'run @' + str(hi):>10}"
        f" {'x AdamW':>11} {'GB run':>13}",
    ]
    out.append("-" * len(out[-1]))
    durations = (("h", 3600), ("min", 60), ("s", 1))
    for r in rows:
        w, c = r.warmup, r.compressed
        wcols = (f"{_mb(w.sent):>12} {_mb(w.between):>9} {w.time * 1e3:>9,.0f}" if w is not None
                 else f"{'-':>12} {'-':>9} {'-':>9}")
        speed = "-".join(f"{base.run_s[f] / r.run_s[f]:.2f}" for f in (lo, hi))
        # a method without a warmup sends the same at either freeze
        gb = "-".join(f"{r.run_bytes[f] / 1e9:,.0f}" for f in ((lo, hi) if w is not None else (lo,)))
        run = " ".join(f"{_in_units(r.run_s[f], durations, '.1f'):>10}" for f in (lo, hi))
        out.append(f"{METHOD_PLANS[r.method][0]:<11} {r.exchange:<8} | {wcols} | {_mb(c.sent):>16} {_mb(c.between):>9}"
                   f" {c.time * 1e3:>9,.0f} | {run} {speed:>11} {gb:>13}")
    out += ["", "x AdamW: AdamW's whole run over this one's, at the freeze's lower and upper bound. PowerSGD:"
            f" rank {cfg.powersgd_rank}, width {cfg.width} (--hidden), its all-reduce warmup put at the same freeze."
            " 0/1 Adam: variance phase in the warmup columns, its syncs in step() (not overlapped). A model, not a"
            " measurement: docs/cost-model.md says how close it came on this repository's emulated networks."]
    return "\n".join(out)


# ============================================================================== CLI
def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="hf-onebit estimate", description=__doc__.splitlines()[0],
                                epilog="The formulas and the time model: python -c 'import hf_onebit.cost_model as m;"
                                       " help(m)', or docs/cost-model.md.")
    p.add_argument("--params", required=True, help="trained parameters: 7e9, 7b, 350m, 125000000")
    p.add_argument("--gpus", required=True, type=int, help="data-parallel ranks in all (GPUs or processes)")
    p.add_argument("--nodes", type=int, default=1, help="nodes the ranks are spread over (default 1)")
    p.add_argument("--link", required=True, help="each node's bandwidth to the others, each way: 100gbit,"
                                                  " 200mbit, 10gbps (bits per second)")
    p.add_argument("--intra-link", default="2400gbit", help="bandwidth between the ranks of one node, per rank"
                   " (default 2400gbit = 300 GB/s, NVLink-class; 'unlimited' for none)")
    p.add_argument("--latency-ms", type=float, default=0.01,
                   help="latency per hop of a collective (default 0.01 ms: NCCL over InfiniBand/RoCE; TCP: ~0.05)")
    p.add_argument("--step-ms", required=True, type=float,
                   help="your step's time without communication (compute, incl. the optimizer)")
    p.add_argument("--overlap", type=float, default=0.5,
                   help="share of --step-ms that the hook's communication can hide behind (backward; default 0.5)")
    p.add_argument("--steps", default="10000", help="steps in the run (default 10000)")
    p.add_argument("--dtype", choices=sorted(GRAD_BYTES), default="bf16", help="gradient dtype (default bf16)")
    p.add_argument("--warmup-bits", type=int, choices=(4, 8, 32), default=8,
                   help="the warmup's exchange (library default 8; 32 = full precision)")
    p.add_argument("--tensors", default=None, help="parameter tensors (one compression scale each; default params/1e6)")
    p.add_argument("--hidden", type=int, default=None, help="model width, for PowerSGD's factors (default from --params)")
    p.add_argument("--powersgd-rank", type=int, default=4)
    p.add_argument("--kernels-from", default=None,
                   help="kernel times: JSON of `hf-onebit check --no-train --json PATH` or benchmarks/gpu_costs.py"
                        " (default: the stored H100 figures)")
    p.add_argument("--methods", nargs="+", choices=METHODS, default=list(METHODS))
    return p


def config_from_args(args) -> tuple[Config, int]:
    params, steps = parse_count(args.params), parse_count(args.steps, "--steps")
    intra = math.inf if str(args.intra_link).strip().lower() == "unlimited" else parse_rate(args.intra_link, "--intra-link")
    for flag, value in (("--step-ms", args.step_ms), ("--latency-ms", args.latency_ms)):
        if not (value >= 0 and math.isfinite(value)):
            raise EstimateError(f"{flag} must be a finite number >= 0, got {value}")
    if not 0 <= args.overlap <= 1:
        raise EstimateError(f"--overlap must be between 0 and 1, got {args.overlap}")
    if args.hidden is not None and args.hidden < 1:
        raise EstimateError(f"--hidden must be at least 1, got {args.hidden}")
    return Config(
        params=params, layout=Layout(args.gpus, args.nodes), link_bps=parse_rate(args.link), intra_bps=intra,
        latency_s=args.latency_ms / 1e3, compute_s=args.step_ms / 1e3, overlap=args.overlap, dtype=args.dtype,
        warmup_bits=args.warmup_bits, tensors=None if args.tensors is None else parse_count(args.tensors, "--tensors"),
        hidden=args.hidden, powersgd_rank=args.powersgd_rank,
        kernels=Kernels.load(args.kernels_from) if args.kernels_from else DEFAULT_KERNELS,
    ), steps


def main(argv=None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        cfg, steps = config_from_args(args)
    except EstimateError as exc:
        parser.error(str(exc))
    methods = args.methods if "adamw" in args.methods else ["adamw", *args.methods]
    print(render(cfg, steps, estimate(cfg, steps, methods)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
