"""Two emulated nodes of two ranks: the exchange by node (hierarchical 1-bit Adam) against the flat ones.

    python benchmarks/two_nodes.py --rates 100mbit 1gbit [--steps 20] [--freeze 4] [--json two_nodes.json] [--plot two_nodes.png]
    (as root; the options: --help)

What it does
------------
For each rate (the inter-node link's) it creates two network namespaces, ``hfob<pid>n<i>a`` (node
0) and ``...b`` (node 1), each with its loopback up and unthrottled (the fast intra-node link),
joined by a veth pair with 10.213.X.1 and 10.213.X.2 (X from the pid; these addresses exist only
inside the two namespaces). Both veth ends are rate-limited like network.py's loopback::

    tc qdisc add dev <veth> root tbf rate RATE burst max(256kb, 2 ms of RATE) latency 50ms

so each direction of the inter-node link carries RATE. A TCP connection each way and ``ip route
get`` check the link before any rank starts. 4 gloo ranks then run as 2 nodes x 2: ranks 0, 1 in
A, ranks 2, 3 in B (``ip netns exec``), ``MASTER_ADDR`` = A's veth address, ``LOCAL_WORLD_SIZE=2``,
``LOCAL_RANK = rank % 2``, and ``GLOO_SOCKET_IFNAME`` = the namespace's veth: gloo binds every rank
to its veth address, so two ranks of one namespace talk to a local address, which the kernel
delivers over the loopback (unthrottled), and ranks of different namespaces talk across the veth
(throttled). Each rank reads its namespace's veth and loopback tx counters after every step,
which shows where the bytes went. Both namespaces (and the veth with them) are deleted when the
rate is done, on failure and on Ctrl-C / SIGTERM too.

Same model, task, data and window as network.py (``--model minilm``: 11.0M trainable parameters,
8 snippets per rank per step; ``--model tiny``: a 2-layer BERT of width 64 for wiring smoke tests).
The methods run one after the other in the same processes:

adamw              DDP + torch AdamW, DDP's fp32 all-reduce (gloo's ring over the 4 ranks)
powersgd           DDP + AdamW + torch's PowerSGD hook, as network.py configures it
onebit_adam        hf_onebit.OneBitAdam, freeze_step = --freeze: the flat exchange among 4 ranks
onebit_adam_nodes  the same with hierarchical=True: fp32 mean inside each node, 1 bit between nodes
(optional: fp16, zeroone_adam(_nodes), onebit_lamb(_nodes), as network.py configures them)
hsdp_adamw         FSDP2 hybrid sharding (2-D mesh) + AdamW: fp32 reduce-scatter inside a node, fp32
                   all-reduce of each rank's gradient shard between the nodes
hsdp_onebit_adam   FSDP2 sharded inside each node + hf_onebit.OneBitAdam: the same reduce-scatter, then
                   the shard exchanged with 1 bit between the nodes (hf_onebit.hook.fsdp); also
                   hsdp_zeroone_adam
fsdp_adamw         FSDP2 over all 4 ranks (1-D mesh) + AdamW: the fp32 all-gather and reduce-scatter run
                   across the nodes; the layout hf_onebit.attach refuses, measured as its baseline

Reported per method: samples/s in the compression phase (steps freeze+3 .. steps) and its ratio
to AdamW and to flat 1-bit Adam; bytes sent per rank per step (the counters of network.py);
bytes per step on the inter-node link, counted and measured (both veth ends' tx: both
directions, TCP/IP headers and ACKs included); the loopbacks' bytes (intra-node); rounds per
step. Counted inter-node bytes: hf_onebit's own count (``inter_node_bytes_sent``: the exchange by
node exactly, the flat collectives by gloo's algorithms on 2x2 ranks in rank order, ring 1/2,
pairwise all-to-all 2/3, flat 1-bit exchange ~7/12; the baselines' rings 1/2; see
netbench/twonode.py); the veth column measures it.

Time: AdamW's ring all-reduce sends 1.5 x 44 MB per rank and step, and one rank's share
(66 MB) crosses each direction of the link: 5.3 s per step at 100 Mbit/s, on top of ~1 s of
compute for 4 ranks on 2 cores. 20 steps with the freeze at 4 (20%, network.py's proportion)
keep one 100 Mbit rate near 6 minutes (AdamW ~2 min, each other method ~1 min incl. the warmup
steps at AdamW's speed and DDP's initial broadcast), the 1 Gbit rate near 3.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import os
import platform
import shutil
import signal
import sys
import tempfile
from pathlib import Path

from netbench import FSDP_METHODS, HSDP_METHODS, LABELS, METHODS, NODE_METHODS, REPO
from netbench.link import Interrupted, _raise_interrupted, kill_running, launch_rank, parse_rate, stop_ranks, wait_for_ranks
from netbench.methods import worker
from netbench.plots import two_node_plot
from netbench.report import _window_freeze, fmt_bytes, summarize
from netbench.twonode import TwoNodes, link_summary, markdown_table, node_probe
from network import _freeze_arg, worker_args

WORLD, LOCAL = 4, 2  # 2 nodes x 2 ranks
CHOICES = [m for m in METHODS if m != "binsgdm"] + NODE_METHODS + HSDP_METHODS + FSDP_METHODS
DEFAULT_METHODS = ["adamw", "powersgd", "onebit_adam", "onebit_adam_nodes"]


def run_rate(rate: str, bits: float | None, nodes: TwoNodes, args, tmp: Path, procs: list) -> dict:
    pair = nodes.create(bits)
    started: list = []
    try:
        check = nodes.check(pair)
        qdisc = nodes.qdisc(pair)
        print(f"\n--- rate {rate}: nodes {pair.names[0]} ({pair.addrs[0]}) and {pair.names[1]} ({pair.addrs[1]})"
              f"\n    qdisc {qdisc}", flush=True)
        for line in check:
            print(f"    {line}", flush=True)
        out = tmp / f"worker_{len(procs)}.json"
        before = nodes.counters(pair)
        load = os.getloadavg()
        for rank in range(WORLD):
            node = rank // LOCAL
            env = dict(os.environ, MASTER_ADDR=pair.addrs[0], MASTER_PORT="29500", RANK=str(rank),
                       WORLD_SIZE=str(WORLD), LOCAL_RANK=str(rank % LOCAL), LOCAL_WORLD_SIZE=str(LOCAL),
                       GLOO_SOCKET_IFNAME=pair.veths[node], OMP_NUM_THREADS=str(args.threads),
                       HF_HUB_OFFLINE="1", PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
            cmd = ["ip", "netns", "exec", pair.names[node], sys.executable, str(Path(__file__).resolve()),
                   "--worker", "--worker-out", str(out), *worker_args(args)]
            started.append(launch_rank(cmd, env, rank, tmp / f"rank{rank}_{len(procs)}.log"))
            procs.append(started[-1][0])
        wait_for_ranks(started, rate, args.timeout)
        raw = json.loads(out.read_text())
        after = nodes.counters(pair)
        raw["link_total"] = {k: after[k] - before[k] for k in before}  # whole rate: setup, DDP broadcasts too
        raw["load_before"] = [round(v, 2) for v in load]
        raw["load_after"] = [round(v, 2) for v in os.getloadavg()]
        raw["qdisc"] = qdisc
        raw["check"] = check
        raw["nodes"] = {"namespaces": list(pair.names), "addresses": list(pair.addrs), "veths": list(pair.veths)}
        return raw
    finally:
        stop_ranks(started)
        nodes.delete(pair)


def print_rate(entry: dict) -> None:
    summary, link = entry["summary"], entry["link"]
    first, n = summary["window"]
    print(f"\n=== {entry['rate']} between the nodes (compression-phase window: steps {first}..{n};"
          f" compute-only step {1e3 * entry['compute_s']:.0f} ms; load avg before {entry['load_before']},"
          f" after {entry['load_after']}) ===")
    for line in markdown_table(entry["rate"], summary, link):
        print(line)
    print("samples/s: compression-phase window, all ranks (vs AdamW: FSDP2 rows against HSDP + AdamW);"
          " B/step per rank: what each rank sends (its counters, intra- and inter-node); inter-node B/step: both directions, all ranks, counted (inter_node_bytes_sent"
          " for the exchange by node, gloo's algorithm shares for the flat collectives, DDP's buffer broadcast)"
          " and measured on the veth (tx of both ends: TCP/IP headers and ACKs included); intra-node: the counted"
          " bytes that stay inside a node, and both namespaces' loopback tx")
    tot = entry.get("link_total")
    if tot:
        print("whole rate (setup, DDP's initial broadcasts and the compute probe included): "
              + ", ".join(f"{k} {fmt_bytes(v)}" for k, v in tot.items()))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rates", nargs="+", default=["100mbit", "1gbit"],
                        help="the inter-node link's tc rate (e.g. 100mbit, 1gbit) or 'unlimited'")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--freeze", type=_freeze_arg, default=4, help="warmup/freeze steps (default 20%% of 20)")
    parser.add_argument("--model", choices=["minilm", "scratch", "tiny"], default="minilm",
                        help="minilm: network.py's model and task; tiny: a 2-layer BERT of width 64 (smoke tests)")
    parser.add_argument("--batch", type=int, default=8,
                        help="examples (minilm, tiny) or blocks (scratch) per rank per step")
    parser.add_argument("--seq", type=int, default=None, help="max tokens (default 48) or block length (scratch, 64)")
    parser.add_argument("--lr", type=float, default=None, help="default 1e-4 (minilm, tiny), 1e-3 (scratch)")
    parser.add_argument("--lamb-lr", type=float, default=None, help="1-bit LAMB's lr; default 10x --lr")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=None, help="torch threads per rank (default cores / 4)")
    parser.add_argument("--methods", nargs="+", default=DEFAULT_METHODS, choices=CHOICES)
    parser.add_argument("--onebit-args", default=None,
                        help="JSON of extra keyword arguments for the hf_onebit optimizers")
    parser.add_argument("--json", type=Path, default=None, help="write all results here")
    parser.add_argument("--report-from", type=Path, default=None, help="only print the tables of an earlier --json")
    parser.add_argument("--plot", type=Path, default=None, help="write a PNG: samples/s and inter-node bytes per method")
    parser.add_argument("--timeout", type=float, default=3600, help="seconds per rate")
    parser.add_argument("--pg-timeout", type=float, default=600, help="gloo timeout (s)")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--worker-out", default=None, help=argparse.SUPPRESS)
    # network.py's worker options that this benchmark keeps at their defaults
    parser.add_argument("--repeats", type=int, default=1, help=argparse.SUPPRESS)
    parser.add_argument("--probe", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--train-key-bias", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.threads is None:
        args.threads = max(1, (os.cpu_count() or 2) // WORLD)
    if args.seq is None:
        args.seq = 64 if args.model == "scratch" else 48
    if args.lr is None:
        args.lr = 1e-3 if args.model == "scratch" else 1e-4
    if args.lamb_lr is None:
        args.lamb_lr = 10 * args.lr
    if args.worker:
        worker(args, node_probe(os.environ["GLOO_SOCKET_IFNAME"]))
        return
    if args.report_from:
        results = json.loads(args.report_from.read_text())
        print(results["meta"]["command"])
        for entry in results["rates"]:
            print_rate(entry)
        if args.plot:
            print(f"plot: {two_node_plot(results, args.plot)}")
        return
    if _window_freeze(args) + 3 > args.steps:
        raise SystemExit("--steps must exceed --freeze + 2 (the compression-phase window starts at freeze + 3)")
    ok, why = TwoNodes.available()
    if not ok:
        raise SystemExit(f"two_nodes.py needs network namespaces: {why}")
    bits = {r: parse_rate(r) for r in args.rates}
    nodes = TwoNodes()
    procs: list = []
    old = {s: signal.signal(s, _raise_interrupted) for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)}
    tmp = Path(tempfile.mkdtemp(prefix="hf_onebit_nodes_"))
    load_start = " ".join(f"{v:.2f}" for v in os.getloadavg())
    results = {"meta": {"command": "python benchmarks/two_nodes.py " + " ".join(sys.argv[1:]),
                        "date": _dt.date.today().isoformat(), "world_size": WORLD, "local_world_size": LOCAL,
                        "steps": args.steps, "freeze": args.freeze, "batch": args.batch, "seq": args.seq,
                        "model": args.model, "lr": args.lr, "lamb_lr": args.lamb_lr, "threads": args.threads,
                        "methods": args.methods, "labels": {m: LABELS[m] for m in args.methods},
                        "machine": f"{os.cpu_count()}-core CPU ({platform.machine()})", "load_start": load_start},
               "rates": []}
    try:
        print(f"hf_onebit two-node benchmark: 2 nodes x 2 gloo ranks, {args.threads} torch thread(s) each,"
              f" {os.cpu_count()} cores; load average {load_start}")
        for rate, b in bits.items():
            raw = run_rate(rate, b, nodes, args, tmp, procs)
            target = results["rates"][0]["summary"]["target"] if results["rates"] else None
            summary = summarize(raw, args, WORLD, target)
            link = link_summary(raw, summary, LOCAL)
            entry = {"rate": rate, "bits_per_s": b, "compute_s": raw["compute_s"], "summary": summary, "link": link,
                     "stats": {m: res["stats"] for m, res in raw["methods"].items()},
                     "link_total": raw["link_total"], "load_before": raw["load_before"],
                     "load_after": raw["load_after"], "qdisc": raw["qdisc"], "check": raw["check"],
                     "nodes": raw["nodes"]}
            results["params"] = raw["params"]
            results["rates"].append(entry)
            print_rate(entry)
            if args.json:
                args.json.parent.mkdir(parents=True, exist_ok=True)
                args.json.write_text(json.dumps(results, indent=1))
        print(f"load average at the end: {' '.join(f'{v:.2f}' for v in os.getloadavg())}")
        if args.plot:
            print(f"plot: {two_node_plot(results, args.plot)}")
    except Interrupted as exc:
        print(f"\ninterrupted ({exc}): stopping ranks and removing namespaces", file=sys.stderr)
        raise SystemExit(130)
    finally:
        kill_running(procs)
        nodes.cleanup()
        for s, h in old.items():
            signal.signal(s, h)
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
