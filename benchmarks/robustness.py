"""Each optimizer against its own uncompressed baseline, over a grid of lr, run length, world size and freeze.

    python benchmarks/robustness.py --task bow --json bow.json            # the full grid on the fast classifier
    python benchmarks/robustness.py --task lm --json lm.json              # the small causal LM from scratch
    python benchmarks/robustness.py --task minilm --steps 60 240 --lr-mults 1 --world-sizes 2 --json corners.json
    python benchmarks/robustness.py --report bow.json lm.json [--plot docs/img/robustness.png]
                                   (a later file's run of a cell replaces an earlier one)

A method is judged against the method it compresses, at the **same** hyperparameters (lr, run
length, world size, global batch, seed, data order): 1-bit Adam and 0/1 Adam against AdamW, 1-bit
LAMB against uncompressed LAMB (``OneBitLamb(freeze_step=10**9, warmup_bits=None)``: exact LAMB on
the averaged gradient, the warmup arithmetic of 1-bit LAMB), BinSGDM against AdamW at BinSGDM's
own lr, and against two uncompressed forms of its own update (:func:`binsgdm_baseline`): "vs exact
mean", each rank's ``m_i/(b_i + eps)`` averaged exactly by an fp32 all-reduce (the vote's
expectation: its gap is what the 1-bit vote costs), and "vs no vote", ``m/(b + eps)`` of the
averaged gradient (what BinSGDM's per-rank normalization costs on top). Every hf_onebit optimizer runs at the library's defaults: only ``lr``, ``total_steps``
and, for the ``0.2`` freeze, the published 20% (``freeze_step`` / ``var_freeze_step``) are given.
The lr decays linearly to 0 over the run (transformers' default schedule), for every method.

The grid: ``--lr-mults`` x the task's advised lr (one per method family, :data:`TASKS`),
``--steps`` (run length), ``--world-sizes`` (gloo ranks on this machine; the global batch is
fixed, so each rank's batch is ``--global-batch / n``), ``--freezes`` (``auto``, the library's
automatic freeze fitted to the run, or a fraction of the run) and ``--seeds``.

Tasks (real data installed by pip, nothing from a hub, but for the synthetic ``teacher``):

* ``bow``: a classifier of Rotten Tomatoes snippets (``--dataset tweets``: 3-class tweets), the
  GLUE recipe's split; hashed unigram and bigram features (2^11 buckets) into a 2-layer MLP
  (2048-64-classes), trained from a seeded initialisation. Accuracy on 1,000 held-out snippets.
* ``minilm``: the pretrained all-MiniLM-L6-v2 fine-tuned in full (word embedding and key biases
  frozen, as in benchmarks/convergence.py), max length 48. Accuracy on ``--eval-size`` dev snippets.
* ``lm``: a Llama-style causal LM (2 layers, hidden 64) from scratch on the BBC news corpus
  (benchmarks/pretrain.py's data and tokenizer, 64-token blocks). Held-out loss.
* ``teacher``: the README's DDP loop with a second hidden layer (32-256-256-4), noisy labels of a
  random linear teacher, global batch 256. Accuracy on 4,000 clean held-out points (synthetic).

The gap of a cell is the baseline's accuracy minus the method's (points; positive = the method
is worse), or the method's held-out loss above the baseline's in percent. ``--report`` prints
every method's worst cell and a table, and ``--plot`` draws the gaps as a heat map.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import platform
import socket
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))

#: the compressed methods and the baseline each is judged against
BASELINE = {"onebit_adam": "adamw", "zeroone_adam": "adamw", "onebit_lamb": "lamb", "binsgdm": "adamw_binsgdm"}
METHODS = list(BASELINE)
#: further baselines: the method's own update with its compression taken out, by the gap's label
MORE_BASELINES = {"binsgdm": {"binsgdm_mean": "mean_vote_binsgdm", "binsgdm_novote": "unvoted_binsgdm"}}
LABELS = {"onebit_adam": "1-bit Adam", "zeroone_adam": "0/1 Adam", "onebit_lamb": "1-bit LAMB", "binsgdm": "BinSGDM",
          "binsgdm_mean": "BinSGDM vs exact mean", "binsgdm_novote": "BinSGDM vs no vote"}

#: per task: the advised lr of each method family, the global batch, the metric
TASKS = {
    "bow": dict(lr=dict(adam=5e-3, lamb=2e-2, binsgdm=1e-2), global_batch=64, metric="accuracy"),
    "minilm": dict(lr=dict(adam=1e-4, lamb=1e-3, binsgdm=2e-4), global_batch=16, metric="accuracy"),
    "lm": dict(lr=dict(adam=3e-3, lamb=3e-2, binsgdm=6e-3), global_batch=16, metric="loss"),
    "teacher": dict(lr=dict(adam=1e-3, lamb=1e-3, binsgdm=2e-3), global_batch=256, metric="accuracy"),
}


def family(name: str) -> str:
    return {"onebit_lamb": "lamb", "lamb": "lamb", "binsgdm": "binsgdm", "adamw_binsgdm": "binsgdm",
            "unvoted_binsgdm": "binsgdm", "mean_vote_binsgdm": "binsgdm"}.get(name, "adam")


# ====================================================================== tasks
class BowTask:
    """Hashed unigram+bigram features of the recipe's split, a 2-layer MLP."""

    buckets = 2**11

    def __init__(self, dataset: str, eval_size: int):
        from netbench.data import load_task

        train, held, classes = load_task(eval_size, dataset)
        self.classes = len(classes)
        self.train = self._featurize(train)
        self.held = self._featurize(held)

    def _featurize(self, items):
        import zlib

        import torch

        x = torch.zeros(len(items), self.buckets)
        for i, (text, _) in enumerate(items):
            words = text.lower().split()
            for w in words + [a + " " + b for a, b in zip(words, words[1:])]:
                x[i, zlib.crc32(w.encode()) % self.buckets] = 1.0
        return x, torch.tensor([y for _, y in items])

    def model(self, seed: int):
        import torch

        torch.manual_seed(seed)
        return torch.nn.Sequential(torch.nn.Linear(self.buckets, 64), torch.nn.ReLU(), torch.nn.Linear(64, self.classes))

    def batches(self, steps, batch, rank, world, seed):
        import torch

        x, y = self.train
        shard = torch.arange(rank, x.shape[0], world)
        g = torch.Generator().manual_seed(7919 * seed + rank)
        order = torch.cat([shard[torch.randperm(shard.numel(), generator=g)] for _ in range(-(-steps * batch // shard.numel()))])
        for s in range(steps):
            idx = order[s * batch:(s + 1) * batch]
            yield x[idx], y[idx]

    @staticmethod
    def loss(model, batch):
        import torch

        x, y = batch
        return torch.nn.functional.cross_entropy(model(x), y)

    def evaluate(self, model) -> float:
        import torch

        x, y = self.held
        with torch.no_grad():
            return float((model(x).argmax(-1) == y).float().mean()) * 100


class MiniLMTask:
    """The pretrained MiniLM, fine-tuned in full on the recipe's split."""

    max_len = 48

    def __init__(self, dataset: str, eval_size: int):
        from netbench.data import encode, load_task, load_tokenizer

        self.tok = load_tokenizer()
        train, held, classes = load_task(eval_size, dataset)
        self.train_items, self.classes = train, len(classes)
        self.held = [encode(self.tok, held[i:i + 64], self.max_len) for i in range(0, len(held), 64)]

    def model(self, seed: int):
        import torch

        from netbench.methods import build_model

        model = build_model("minilm", 0, self.max_len, False, self.classes)
        torch.manual_seed(seed)
        model.net.classifier.reset_parameters()
        return model

    def batches(self, steps, batch, rank, world, seed):
        from netbench.data import sentiment_batches

        yield from sentiment_batches(self.tok, self.train_items, steps, batch, rank, world, seed, self.max_len)

    @staticmethod
    def loss(model, batch):
        return model(*batch)

    def evaluate(self, model) -> float:
        import torch

        right = total = 0
        model.eval()
        with torch.no_grad():
            for ids, att, y in self.held:
                right += int((model.net(input_ids=ids, attention_mask=att).logits.argmax(-1) == y).sum())
                total += len(y)
        model.train()
        return right / total * 100


class LMTask:
    """A small Llama-style decoder from scratch on benchmarks/pretrain.py's data."""

    seq, vocab = 64, 2048

    def __init__(self, dataset: str, eval_size: int):
        import pretrain

        self.pretrain = pretrain
        self.data = pretrain.prepare_data(self.vocab, self.seq)
        self.held = self.data["held_blocks"][:eval_size]

    def model(self, seed: int):
        cfg = argparse.Namespace(hidden=64, ffn=176, layers=2, heads=4, seq=self.seq)
        return self.pretrain.build_model(self.data["vocab_size"], cfg, seed)

    def batches(self, steps, batch, rank, world, seed):
        blocks = self.data["train_blocks"]
        for idx in self.pretrain.rank_batches(blocks.shape[0], steps, batch, rank, world, seed):
            yield blocks[idx]

    @staticmethod
    def loss(model, batch):
        return model(input_ids=batch, labels=batch).loss

    def evaluate(self, model) -> float:
        total, count = self.pretrain._loss_sum(model, self.held, 32)
        return total / count


class TeacherTask(BowTask):
    """The README's DDP loop grown by a layer: a 32-256-256-4 MLP learns a random linear teacher's
    class from noisy labels; accuracy on 4,000 clean held-out points (``--dataset`` is not read).
    The loss and the evaluation are the bag-of-words task's: a batch and ``held`` are ``(x, y)``."""

    def __init__(self, dataset: str, eval_size: int):
        import torch

        self.teacher = torch.randn(32, 4, generator=torch.Generator().manual_seed(7))
        x = torch.randn(4000, 32, generator=torch.Generator().manual_seed(12345))
        self.held = x, (x @ self.teacher).argmax(-1)

    def model(self, seed: int):
        import torch

        torch.manual_seed(seed)
        return torch.nn.Sequential(torch.nn.Linear(32, 256), torch.nn.GELU(), torch.nn.Linear(256, 256),
                                   torch.nn.GELU(), torch.nn.Linear(256, 4))

    def batches(self, steps, batch, rank, world, seed):
        import torch

        g = torch.Generator().manual_seed(7919 * seed + rank)
        for _ in range(steps):
            x = torch.randn(batch, 32, generator=g)
            yield x, (x @ self.teacher + 0.5 * torch.randn(batch, 4, generator=g)).argmax(-1)


TASK_CLASSES = {"bow": BowTask, "minilm": MiniLMTask, "lm": LMTask, "teacher": TeacherTask}


# ====================================================================== one cell
def binsgdm_baseline(params, lr: float, exact_mean: bool):
    """BinSGDM's update at its defaults with the 1-bit vote taken out: ``m = β·m + (1-β)·g``,
    ``b = β·b + (1-β)·|g|``, ``p -= lr·(z + wd·p)`` with

    * ``exact_mean``: ``z = mean_i m_i/(b_i + eps)``, each rank's own ``m_i, b_i`` from its own
      gradient (DDP's averaging is replaced by :func:`local_gradients`), averaged by an fp32
      all-reduce: the expectation of the vote average ``q̄``, so the gap is the vote's noise alone;
    * else ``z = m/(b + eps)`` of the averaged gradient: what one process at the global batch would
      step, so the gap adds what normalizing each rank's smaller batch by its own ``b_i`` costs."""
    import torch
    import torch.distributed as dist

    class BinSGDMBaseline(torch.optim.Optimizer):
        def __init__(self, params, lr, beta=0.9, eps=1e-8, weight_decay=0.0):
            super().__init__(params, dict(lr=lr, beta=beta, eps=eps, weight_decay=weight_decay))

        @torch.no_grad()
        def step(self):
            for group in self.param_groups:
                beta = group["beta"]
                for p in group["params"]:
                    if p.grad is None:
                        continue
                    st = self.state[p]
                    if not st:
                        st["m"], st["b"] = torch.zeros_like(p), torch.zeros_like(p)
                    st["m"].mul_(beta).add_(p.grad, alpha=1 - beta)
                    st["b"].mul_(beta).add_(p.grad.abs(), alpha=1 - beta)
                    z = st["m"] / (st["b"] + group["eps"])
                    if exact_mean:
                        dist.all_reduce(z)
                        z /= dist.get_world_size()
                    p.add_(z + group["weight_decay"] * p, alpha=-group["lr"])

    return BinSGDMBaseline(params, lr)


def local_gradients(_, bucket):
    """A DDP communication hook that leaves each rank its own gradients (nothing is sent)."""
    import torch

    fut = torch.futures.Future()
    fut.set_result(bucket.buffer())
    return fut


def build(name: str, params, lr: float, steps: int, freeze, extra: dict | None = None):
    """(optimizer, uses the hf_onebit hook) for ``name`` at the library's defaults (``extra``:
    keyword arguments for the compressed method, ``--optim-args``)."""
    import torch

    import hf_onebit

    if name in ("adamw", "adamw_binsgdm"):
        return torch.optim.AdamW(params, lr=lr, weight_decay=0.0), False
    if name in ("unvoted_binsgdm", "mean_vote_binsgdm"):
        return binsgdm_baseline(params, lr, exact_mean=name == "mean_vote_binsgdm"), False
    if name == "lamb":
        return hf_onebit.OneBitLamb(params, lr=lr, freeze_step=10**9, warmup_bits=None), True
    if name == "binsgdm":  # no warmup, no freeze
        return hf_onebit.BinSGDM(params, lr=lr, **(extra or {})), True
    at = {} if freeze == "auto" else {"var_freeze_step" if name == "zeroone_adam" else "freeze_step":
                                      max(2, round(float(freeze) * steps))}
    cls = {"onebit_adam": hf_onebit.OneBitAdam, "zeroone_adam": hf_onebit.ZeroOneAdam, "onebit_lamb": hf_onebit.OneBitLamb}[name]
    return cls(params, lr=lr, total_steps=steps, **at, **(extra or {})), True


def run_cell(task, cell: dict, rank: int, world: int) -> dict:
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    import hf_onebit

    model = task.model(cell["seed"])
    opt, hooked = build(cell["method"], [p for p in model.parameters() if p.requires_grad], cell["lr"],
                        cell["steps"], cell["freeze"], cell.get("optim_args"))
    ddp = DDP(model)
    if hooked:
        hf_onebit.attach(ddp, opt)
    elif cell["method"] == "mean_vote_binsgdm":
        ddp.register_comm_hook(None, local_gradients)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1 - s / cell["steps"])
    t0 = time.perf_counter()
    loss = None
    for batch in task.batches(cell["steps"], cell["batch"], rank, world, cell["seed"]):
        loss = task.loss(ddp, batch)
        loss.backward()
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
    # each rank's own parameters (0/1 Adam's may differ between syncs), averaged over the ranks
    score = torch.tensor([task.evaluate(model), float(loss.detach())], dtype=torch.float64)
    dist.all_reduce(score)
    score /= world
    freeze = getattr(opt, "var_freeze_step", getattr(opt, "freeze_step", None))
    out = dict(cell, score=float(score[0]), train_loss=float(score[1]), seconds=time.perf_counter() - t0,
               freeze_step=freeze if isinstance(freeze, int) and freeze < 10**9 else None)
    if hooked and hasattr(opt, "onebit_stats"):
        out["compression_ratio"] = opt.onebit_stats().get("compression_ratio")
    del ddp, opt, model
    return out


def _worker(rank, world, port, args, cells, queue):
    import torch
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    import logging

    logging.getLogger("hf_onebit").setLevel(logging.WARNING)
    task = TASK_CLASSES[args.task](args.dataset, args.eval_size)
    for cell in cells:
        out = run_cell(task, cell, rank, world)
        if rank == 0:
            queue.put(out)
    dist.destroy_process_group()


def baselines_of(methods) -> list[str]:
    """The uncompressed runs that ``methods`` are judged against."""
    return sorted({BASELINE[m] for m in methods} | {b for m in methods for b in MORE_BASELINES.get(m, {}).values()})


def cells_of(args, world: int) -> list[dict]:
    """Every run at one world size: each method at each freeze, each baseline once."""
    spec = TASKS[args.task]
    out = []
    for seed, steps, mult in itertools.product(args.seeds, args.steps, args.lr_mults):
        for name in args.baselines + args.methods:
            freezes = args.freezes if name in ("onebit_adam", "zeroone_adam", "onebit_lamb") else ["-"]
            for freeze in freezes:
                out.append(dict(method=name, seed=seed, steps=steps, lr_mult=mult, freeze=freeze, world=world,
                                lr=mult * spec["lr"][family(name)], batch=spec["global_batch"] // world,
                                optim_args=args.optim_args if name in BASELINE else None))
    return out


def _next_result(queue, procs) -> dict:
    """The next cell's result from rank 0; a rank that exits first (its traceback is above) stops
    the grid at once instead of leaving the others waiting in a collective."""
    import queue as queues

    while True:
        try:
            return queue.get(timeout=2)
        except queues.Empty:
            gone = [(rank, p.exitcode) for rank, p in enumerate(procs) if p.exitcode is not None]
            if gone:
                for p in procs:
                    p.kill()
                rank, code = gone[0]
                raise SystemExit(f"rank {rank} exited with {code} before the grid was done") from None


def run_grid(args) -> list[dict]:
    import torch.multiprocessing as mp

    results = []
    for world in args.world_sizes:
        cells = cells_of(args, world)
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        ctx = mp.get_context("spawn")
        queue = ctx.Queue()
        procs = [ctx.Process(target=_worker, args=(r, world, port, args, cells, queue)) for r in range(world)]
        for p in procs:
            p.start()
        for i in range(len(cells)):
            r = _next_result(queue, procs)
            results.append(r)
            print(f"[{i + 1}/{len(cells)}] n={world} {r['method']:<13} lr x{r['lr_mult']:<4g} {r['steps']:>5} steps"
                  f" freeze {r['freeze']:<4} seed {r['seed']}: {r['score']:.3f} ({r['seconds']:.0f} s)", flush=True)
        for p in procs:
            p.join()
            if p.exitcode:
                raise SystemExit(f"a rank exited with {p.exitcode}")
    return results


# ====================================================================== the report
def gaps(runs: list[dict], metric: str) -> list[dict]:
    """Each compressed run against its baseline at the same lr, steps, world size and seed."""
    base = {(r["method"], r["lr_mult"], r["steps"], r["world"], r["seed"]): r["score"] for r in runs}
    out = []
    for r in runs:
        if r["method"] not in BASELINE:
            continue
        pairs = [(r["method"], BASELINE[r["method"]]), *MORE_BASELINES.get(r["method"], {}).items()]
        for label, baseline in pairs:
            b = base.get((baseline, r["lr_mult"], r["steps"], r["world"], r["seed"]))
            if b is not None:
                gap = b - r["score"] if metric == "accuracy" else (r["score"] - b) / b * 100
                out.append(dict(r, method=label, baseline=b, gap=gap))
    return out


def task_name(meta: dict) -> str:
    """The task and, where it is not the task's first, the dataset: ``minilm``, ``minilm-tweets``."""
    dataset = meta.get("dataset")
    return meta["task"] if dataset in (None, "rotten_tomatoes") or meta["task"] == "lm" else f"{meta['task']}-{dataset}"


def merged(results: list[dict]) -> list[dict]:
    """One result per task, a later file's run replacing an earlier one of the same cell (a re-run
    of one method after a change of its defaults)."""
    by_task: dict[str, dict] = {}
    for res in results:
        task = by_task.setdefault(task_name(res["meta"]), dict(meta=res["meta"], runs={}))
        for r in res["runs"]:
            task["runs"][(r["method"], r["lr_mult"], r["steps"], r["world"], r["seed"], r["freeze"])] = r
    return [dict(meta=t["meta"], runs=list(t["runs"].values())) for t in by_task.values()]


def summarize(results: list[dict]) -> dict:
    """Per (task, method, freeze, lr_mult, steps, world): the mean gap over seeds; per method its worst cell."""
    cells = {}
    for res in merged(results):
        metric = res["meta"]["metric"]
        for g in gaps(res["runs"], metric):
            key = (task_name(res["meta"]), g["method"], g["freeze"], g["lr_mult"], g["steps"], g["world"])
            cells.setdefault(key, []).append(g["gap"])
    table = {k: (statistics.fmean(v), len(v)) for k, v in cells.items()}
    worst = {}
    for (task, method, *rest), (gap, n) in table.items():
        if (task, method) not in worst or gap > worst[(task, method)][0]:
            worst[(task, method)] = (gap, rest, n)
    return {"cells": table, "worst": worst}


def print_report(results: list[dict]) -> None:
    s = summarize(results)
    units = {task_name(r["meta"]): ("points" if r["meta"]["metric"] == "accuracy" else "% loss") for r in results}
    print("worst gap to the method's own uncompressed baseline (positive: worse), mean over seeds:")
    for (task, method), (gap, (freeze, mult, steps, world), n) in sorted(s["worst"].items()):
        print(f"  {task:<13} {LABELS[method]:<21} {gap:+7.2f} {units[task]:<7} at lr x{mult:g}, {steps} steps,"
              f" {world} ranks, freeze {freeze} ({n} seed{'s' if n > 1 else ''})")


def plot(results: list[dict], path: Path) -> None:
    """One row of heat maps per task, one map per method (and freeze): lr against run length and ranks."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    s = summarize(results)["cells"]
    tasks = sorted({k[0] for k in s})
    panels = {t: sorted({(k[1], k[2]) for k in s if k[0] == t}) for t in tasks}
    ncols = max(len(p) for p in panels.values())
    fig, axes = plt.subplots(len(tasks), ncols, figsize=(2.7 * ncols, 2.6 * len(tasks)), squeeze=False)
    for row, task in enumerate(tasks):
        mults = sorted({k[3] for k in s if k[0] == task})
        cols = sorted({(k[4], k[5]) for k in s if k[0] == task})
        limit = 2.0 if task.startswith("lm") else 1.0
        for ax in axes[row, len(panels[task]):]:
            ax.axis("off")
        for ax, (method, freeze) in zip(axes[row], panels[task]):
            grid = np.full((len(mults), len(cols)), np.nan)
            for i, m in enumerate(mults):
                for j, (steps, world) in enumerate(cols):
                    grid[i, j] = s.get((task, method, freeze, m, steps, world), (np.nan,))[0]
            ax.imshow(grid, cmap="RdYlGn_r", vmin=-2 * limit, vmax=2 * limit, aspect="auto")
            for i, j in itertools.product(range(len(mults)), range(len(cols))):
                if not np.isnan(grid[i, j]):
                    ax.text(j, i, f"{grid[i, j]:+.1f}", ha="center", va="center", fontsize=7)
            ax.set_yticks(range(len(mults)), [f"lr x{m:g}" for m in mults], fontsize=7)
            ax.set_xticks(range(len(cols)), [f"{st} st\n{w} ranks" for st, w in cols], fontsize=6)
            ax.set_title(f"{task}: {LABELS[method]}" + (f", freeze {freeze}" if freeze != "-" else ""), fontsize=8)
    fig.suptitle("gap to the method's own uncompressed baseline (points; lm: % held-out loss); > 0: worse",
                 fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--task", choices=list(TASKS), default="bow")
    p.add_argument("--dataset", default="rotten_tomatoes", choices=["rotten_tomatoes", "tweets"])
    p.add_argument("--methods", nargs="+", default=METHODS, choices=METHODS)
    p.add_argument("--lr-mults", nargs="+", type=float, default=[0.25, 1.0, 4.0])
    p.add_argument("--steps", nargs="+", type=int, default=[40, 60, 240, 1000])
    p.add_argument("--world-sizes", nargs="+", type=int, default=[2, 8])
    p.add_argument("--freezes", nargs="+", default=["auto", "0.2"])
    p.add_argument("--seeds", nargs="+", type=int, default=[1])
    p.add_argument("--eval-size", type=int, default=1000)
    p.add_argument("--optim-args", type=json.loads, default=None, metavar="JSON",
                   help='keyword arguments for the compressed methods, e.g. \'{"update_clip": null}\' (an experiment)')
    p.add_argument("--json", type=Path, default=None)
    p.add_argument("--no-baselines", action="store_true",
                   help="run only the methods (a re-run after a change of their defaults; --report pairs them"
                        " with the baselines of earlier files)")
    p.add_argument("--report", type=Path, nargs="+", default=None, metavar="JSON")
    p.add_argument("--plot", type=Path, default=None)
    args = p.parse_args(argv)
    if args.report:
        results = [json.loads(f.read_text()) for f in args.report]
    else:
        for f in args.freezes:
            if f != "auto" and not 0 < float(f) < 1:
                p.error(f"--freezes takes 'auto' or a fraction of the run in (0, 1), got {f!r}")
        for w in args.world_sizes:
            if TASKS[args.task]["global_batch"] % w:
                p.error(f"--world-sizes: {w} does not divide the task's global batch {TASKS[args.task]['global_batch']}")
        args.baselines = [] if args.no_baselines else baselines_of(args.methods)
        t0 = time.time()
        runs = run_grid(args)
        meta = dict(task=args.task, dataset=args.dataset, metric=TASKS[args.task]["metric"], argv=sys.argv[1:],
                    seconds=time.time() - t0, python=platform.python_version())
        results = [dict(meta=meta, runs=runs)]
        if args.json:
            args.json.write_text(json.dumps(results[0], indent=1))
    print_report(results)
    if args.plot:
        plot(results, args.plot)


if __name__ == "__main__":
    main()
