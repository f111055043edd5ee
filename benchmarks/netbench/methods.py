"""The methods side by side: models, optimizers and hooks, their byte counters, and the worker loop."""

from __future__ import annotations

import gc
import json
import os
import statistics
import time
from pathlib import Path

from netbench.data import load_task, load_tokenizer, make_blocks, minilm_dir, mlm_batches, sentiment_batches
from netbench.link import _read_lo_tx, probe_link
from netbench.report import _window_freeze


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


def build_model(kind: str, vocab: int, seq: int, train_key_bias: bool = False, num_labels: int = 2):
    """The benchmark model; ``model(*batch)`` returns the loss. Same initial weights on every call
    (``num_labels``: the classifier's classes, ``minilm`` only)."""
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
                self.net = AutoModelForSequenceClassification.from_pretrained(str(minilm_dir()), num_labels=num_labels)

            def forward(self, input_ids, attention_mask, labels):
                return self.net(input_ids=input_ids, attention_mask=attention_mask, labels=labels).loss

        model = Classifier()
        freeze_dead_parameters(model, freeze_embeddings=True)
    elif kind == "scratch":
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
    elif kind == "tiny":  # wiring smoke tests (two_nodes.py): a 2-layer BERT of width 64 from a config
        from transformers import BertConfig, BertForSequenceClassification

        class Tiny(torch.nn.Module):
            def __init__(self):
                super().__init__()
                config = BertConfig(vocab_size=vocab, hidden_size=64, num_hidden_layers=2, num_attention_heads=2,
                                    intermediate_size=128, max_position_embeddings=max(128, seq), num_labels=2)
                self.net = BertForSequenceClassification(config)

            def forward(self, input_ids, attention_mask, labels):
                return self.net(input_ids=input_ids, attention_mask=attention_mask, labels=labels).loss

        model = Tiny()
        freeze_dead_parameters(model, freeze_embeddings=True)
    else:
        raise ValueError(f"unknown model {kind!r}")
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

    if method == "fsdp_adamw":
        return build_fsdp_adamw(model, args)
    if method.startswith("hsdp_"):
        return build_hsdp(method[len("hsdp_"):], model, args)
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


def build_hsdp(method: str, model, args):
    """Hybrid sharding with FSDP2 over nodes of ``LOCAL_WORLD_SIZE`` ranks (benchmarks/two_nodes.py).

    Both shard the model inside a node (fp32 all-gather of the parameters, fp32 reduce-scatter of
    the gradients, over the fast link). Between the nodes, ``adamw`` is FSDP2's native HSDP (a 2-D
    mesh): an fp32 all-reduce of each rank's gradient shard; the hf_onebit methods shard over the
    node's ranks only and exchange each shard between the nodes by the optimizer's plan
    (:mod:`hf_onebit.hook.fsdp`).
    """
    import torch
    from torch.distributed.fsdp import fully_shard

    import hf_onebit

    mesh = hf_onebit.replica_mesh(int(os.environ["LOCAL_WORLD_SIZE"]), "cpu")
    native = method == "adamw"
    fully_shard(model, mesh=mesh if native else mesh["shard"])  # the 2-D mesh: FSDP2's native HSDP
    params = [p for p in model.parameters() if p.requires_grad]  # after fully_shard, which replaces them
    if native:
        opt = torch.optim.AdamW(params, lr=args.lr, weight_decay=0.0)
    else:
        opt = onebit_optimizer(method, params, args, args.freeze)
        hf_onebit.attach(model, opt)
    return opt, model, HSDPCount(model, opt)


def build_fsdp_adamw(model, args):
    """FSDP2 over every rank (a 1-D mesh of the world) + AdamW: the layout ``hf_onebit.attach``
    refuses (no replica to exchange with), measured as the baseline for that refusal. The fp32
    all-gather of the parameters and reduce-scatter of the gradients both run over all ranks,
    so they cross the slow link."""
    import torch
    from torch.distributed.fsdp import fully_shard

    fully_shard(model)  # the default mesh: every rank
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=args.lr, weight_decay=0.0)
    return opt, model, FlatFSDPCount(model, opt)


class HSDPCount:
    """Bytes each rank sends per step under hybrid sharding, from the collectives' sizes.

    Inside the node: FSDP's fp32 all-gather of every parameter (once, in the forward) and
    reduce-scatter of the trained ones' gradients, ``(L-1)/L`` of their bytes each. Between the
    nodes: native HSDP's fp32 ring all-reduce of the rank's ``1/L`` gradient shard, or what the
    hf_onebit optimizer counts of its own exchange (all of which crosses: its group holds one rank
    per node). For the baselines the crossing bytes are counted in ``opt.inter_node_stats``, which the
    two-node probe reads (hf_onebit's optimizers count their own, ``onebit_stats()``).
    """

    def __init__(self, model, opt) -> None:
        import torch.distributed as dist

        from hf_onebit.comm import allreduce_bytes
        from hf_onebit.comm.stats import CommRecord, CommStats

        local = int(os.environ["LOCAL_WORLD_SIZE"])
        nodes = dist.get_world_size() // local
        every, trained = _param_bytes(model)
        self.intra = (local - 1) * (every + trained) // local
        self.onebit = hasattr(opt, "exchange")
        if not self.onebit:  # hf_onebit counts its own (its group holds one rank per node: all of it crosses)
            opt.inter_node_stats = CommStats()
            self.record = CommRecord(bytes_sent=allreduce_bytes(trained // local, nodes), rounds=1)
        self.opt, self.steps = opt, 0

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        pass

    def after_step(self) -> None:
        self.steps += 1
        if not self.onebit:
            self.opt.inter_node_stats.record(self.record)

    def read(self) -> tuple[int, int]:
        inter = self.opt.exchange.stats.snapshot() if self.onebit else self.opt.inter_node_stats.snapshot()
        return self.steps * self.intra + inter.bytes_sent, 2 * self.steps + inter.rounds


class FlatFSDPCount(HSDPCount):
    """Bytes each rank sends per step under FSDP2 over all ``W`` ranks: ``(W-1)/W`` of every
    parameter's bytes (the all-gather) and of the trained ones' (the reduce-scatter). Half of them
    count as crossing between the nodes (a ring in rank order over 2 nodes crosses on 2 of its 4
    hops), the other half as staying inside; the veth column measures what does cross."""

    def __init__(self, model, opt) -> None:
        import torch.distributed as dist

        from hf_onebit.comm.stats import CommRecord, CommStats

        world = dist.get_world_size()
        every, trained = _param_bytes(model)
        sent = (world - 1) * (every + trained) // world
        self.intra, self.onebit = sent - sent // 2, False
        opt.inter_node_stats = CommStats()
        self.record = CommRecord(bytes_sent=sent // 2, rounds=0)
        self.opt, self.steps = opt, 0


def _param_bytes(model) -> tuple[int, int]:
    """Bytes of every parameter and of the trained ones."""
    every = sum(p.numel() * p.element_size() for p in model.parameters())
    trained = sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)
    return every, trained


def onebit_optimizer(method: str, params, args, freeze: int):
    """The hf_onebit optimizer of ``method`` as the benchmarks configure it (also convergence.py's).

    Hyperparameters follow the published guidance scaled to a run of ``args.steps`` steps (0/1
    Adam's schedules at a given freeze step), the library's defaults under the automatic freeze
    or with ``args.plain_defaults``;
    ``args.onebit_args`` (JSON) adds keyword arguments, e.g. ``{"bias_correction": true}``;
    ``clip_synced_momentum`` goes to 0/1 Adam only. A ``_nodes`` suffix (``onebit_adam_nodes``)
    builds the same optimizer with ``hierarchical=True`` (the exchange by node, which needs
    ``LOCAL_WORLD_SIZE``: two_nodes.py); without it ``hierarchical=False`` unless ``args.onebit_args``
    says otherwise (BinSGDM's default, ``None``, would go by node wherever ``LOCAL_WORLD_SIZE``
    gives several nodes).
    """
    import hf_onebit

    extra = json.loads(args.onebit_args or "{}")
    if method.endswith("_nodes"):
        method, extra["hierarchical"] = method[: -len("_nodes")], True
    else:
        extra.setdefault("hierarchical", False)
    only_zeroone = {k: extra.pop(k) for k in ("clip_synced_momentum",) if k in extra}  # 0/1 Adam's own option
    # every method at the library's defaults: under the automatic freeze, or when asked for
    # (``args.plain_defaults``: a user's ``ZeroOneAdam(params, lr=..., var_freeze_step=30)``)
    library = freeze == "auto" or getattr(args, "plain_defaults", False)
    if freeze == "auto":  # the automatic freeze with the bounds the HF integration fits to a run
        from hf_onebit.optim.freeze import AutoFreeze

        freeze = AutoFreeze.for_run(args.steps)
    # 0/1 Adam's schedules are set from the freeze step; under "auto" from its 20% estimate
    estimate = freeze if isinstance(freeze, int) else max(2, round(0.2 * args.steps))
    if method == "onebit_adam":
        return hf_onebit.OneBitAdam(params, lr=args.lr, freeze_step=freeze, **extra)
    if method == "zeroone_adam":
        if library:
            return hf_onebit.ZeroOneAdam(params, lr=args.lr, var_freeze_step=freeze, **{**extra, **only_zeroone})
        scaled = dict(betas=(0.9, 0.99), var_update_scaler=max(1, estimate // 4),
                      local_step_scaler=max(1, args.steps // 10), local_step_clipper=16)
        return hf_onebit.ZeroOneAdam(params, lr=args.lr, var_freeze_step=freeze,
                                     **{**scaled, **extra, **only_zeroone})  # --onebit-args wins
    if method == "onebit_lamb":
        return hf_onebit.OneBitLamb(params, lr=args.lamb_lr, freeze_step=freeze, **extra)
    if method == "binsgdm":  # its vote sends signs only: no scale to take per tensor, no variance to clip by
        lr = getattr(args, "binsgdm_lr", args.lr)  # convergence.py --binsgdm-lr; network.py has none
        return hf_onebit.BinSGDM(params, lr=lr, **{k: v for k, v in extra.items()
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
        s = self.opt.exchange.stats.snapshot()
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


def run_method(method: str, model_fn, batches, args, probe=None) -> dict:
    """Train ``method`` on ``batches``; per step and rank a record of times, loss and counters.

    ``probe(opt)``, if given, returns a dict of running totals (e.g. a device's tx bytes) that every
    rank reads after every step: each record gets their growth since the start of the run.
    """
    import torch.distributed as dist

    rank = dist.get_rank()
    model = model_fn()
    opt, ddp, counter = build_method(method, model, args)
    records = []
    with counter:
        dist.barrier()
        base = probe(opt) if probe else {}
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
            if hasattr(counter, "after_step"):
                counter.after_step()
            td = time.perf_counter()
            t = td - t0
            b, r = counter.read()
            lo = _read_lo_tx() if rank == 0 else None
            records.append({"t": t, "loss": float(loss.detach()), "bytes": b, "rounds": r, "phase": phase,
                            "fwd": tb - ta, "bwd": tc - tb, "opt": td - tc,
                            "lo": None if lo is None or lo0 is None else lo - lo0})
            if probe:
                records[-1].update({k: v - base[k] for k, v in probe(opt).items()})
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


def worker(args, step_probe=None) -> None:
    """One rank: every method of ``args.methods`` in turn (``step_probe``: see :func:`run_method`)."""
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
    if args.model in ("minilm", "tiny"):
        train, _, _ = load_task(512)
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
    # DDP broadcasts these from rank 0 before every forward (broadcast_buffers=True): uncounted traffic
    buffer_bytes = sum(b.numel() * b.element_size() for b in probe.buffers())
    del probe

    # Warm-up outside every timed window: numba kernels (JIT cache), gloo's all-to-all path.
    from hf_onebit.comm import CompressedAllReduce

    warm = CompressedAllReduce(4096)
    for _ in range(2):
        warm(torch.randn(4096))
    dist.barrier()
    compute = measure_compute(model_fn, batches, args)
    out = {"params": n_params, "params_total": n_total, "buffer_bytes": buffer_bytes, "examples": n_examples,
           "compute_s": compute, "methods": {}}
    out["repeats"] = {}
    for rep in range(args.repeats):  # round-robin: a slow spell of the machine hits every method
        for method in args.methods:
            if rank == 0:
                print(f"  [{method}]" + (f" repeat {rep + 1}/{args.repeats}" if args.repeats > 1 else ""), flush=True)
            res = run_method(method, model_fn, batches, args, step_probe)
            if rep == 0:
                out["methods"][method] = res
            else:
                out["repeats"].setdefault(method, []).append(res)
            dist.barrier()
    if rank == 0:
        Path(args.worker_out).write_text(json.dumps(out))
    dist.destroy_process_group()
