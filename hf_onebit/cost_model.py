"""The cost model behind ``hf-onebit estimate`` (:mod:`hf_onebit.estimate`): bytes, kernel time and
step time of each method's exchanges, from formulas alone. ``benchmarks/estimate_check.py`` compares
them with this repository's emulated-network runs (``docs/cost-model.md``).

Bytes. ``P`` parameters, ``g`` bytes per gradient element (4 fp32, 2 bf16/fp16), ``n`` ranks on
``M`` nodes, ``k = n/M`` per node, numbered node by node. Bytes are what one rank sends, as
:mod:`hf_onebit.comm.stats` counts them: all-gather of ``c`` bytes per rank ``(n-1)·c``, all-to-all
of ``B`` ``(n-1)/n·B``, ring all-reduce of ``B`` ``2·(n-1)/n·B``. DDP's buckets hold 1 MiB, then
25 MiB each; every hook exchange runs once per bucket of ``L_b`` elements, padded to
``L = 8n·ceil(L_b/8n)``, chunk ``C = L/n``. Of what a rank sends, ``between`` leaves its node and
``inside`` stays in it: a ring has one edge leaving each node (``between = sent``); an all-to-all
sends ``n-k`` of each rank's ``n-1`` chunks off-node from ``k`` ranks (``between =
k·(n-k)/(n-1)·sent``; on 2 nodes of 2 the 1-bit exchange sends 7/12 of its bytes between them, as
``benchmarks/netbench/twonode.py`` measures). Per bucket:

* AdamW: ring all-reduce of ``g·L_b``, ``2(n-1)`` hops.
* PowerSGD, rank ``r``: a matrix ``a×b`` sends ``r·(a+b)`` elements. A transformer of width ``d``
  has 4 ``d×d`` and 2 ``d×4d`` matrices per ``12d²`` parameters: factors of
  ``P·r·(4·2d + 2·5d)/(12d²) = 1.5·P·r/d`` elements, vectors (``13d`` a layer) of ``13·P/(12d)``, in
  3 ring all-reduces. ``d`` defaults to ``(128·P/12)^(1/3)`` (``d/128`` layers). Its warmup is
  AdamW's, put at the 1-bit methods' freeze; its matmuls (``≈ 4·r·P`` flops) are not timed.
* 1-bit exchange (:mod:`hf_onebit.comm.compressed`), one scale per chunk: all-gather of the scales ``(n-1)·4``,
  all-to-all of the signs ``(n-1)·C/8``, all-gather of ``[scale | C/8 signs]`` ``(n-1)·(4 + C/8)``; ``sent ≈
  2·(n-1)/n·L/8``, ``3(n-1)`` hops. A scale per piece (the library's: tensors cut into blocks
  of 256): round 1 gathers a flag ``(n-1)·4``, and the all-to-all carries each chunk's ``s'``
  scales beside its signs, ``(n-1)·(4s' + C/8)``, ``s' = T_b + C/256 + 1`` for ``T_b`` tensors
  (``--tensors``, default ``P/1e6``: an upper bound); a scale per chunk (``--tensors 0``): ``s' = 1``.
  b-bit (the warmups): ``C·b/8`` for ``C/8``. ``--warmup-bits 32``: AdamW's all-reduce.
* 1-bit exchange by node: shard ``S = ceil(L_b/k)``; fp32 reduce-scatter ``(k-1)·4·(S+1)`` and
  all-gather ``(k-1)·4S`` inside the node, the flat exchange of ``S`` among ``M`` between nodes,
  run by all ``k`` ranks of a node: ``between ≈ 2·(M-1)/M·L/8``, against ``≈ k·L/8`` flat.
* BinSGDM's vote: all-gather of ``[flag | L/8]``, ``(n-1)·(4 + L/8)``, ``n-1`` hops. By node:
  ``(k-1)·(4 + L/8)`` inside, each rank's slice ``(M-1)·(4 + L/(8k))`` between, ``(k-1)·M·L/(8k)``
  inside.

Phases (:mod:`hf_onebit.optim.defaults`). 1-bit Adam and LAMB: the b-bit exchange until the freeze,
then the 1-bit one, in DDP's hook. 0/1 Adam: a b-bit exchange every step of its variance phase,
then a 1-bit sync in ``step()`` on sync steps only (:func:`zeroone_plans`). BinSGDM: a vote every
step.

Time: ``step = compute + kernels + exposed + step() exchanges``. ``compute`` is ``--step-ms``, a
step without communication. A collective takes ``max(between/link, inside/intra_link) +
hops·latency``: its slowest link sets the pace (``--link``: each node's, each way; headers and
congestion are not modelled); the exchange by node runs its collectives one after another. The
hook's exchanges run during backward and hide behind ``--overlap`` of ``compute``, but for the last
bucket's: ``exposed = max(comm - overlap·compute, comm/B)`` for ``B`` buckets; a sync in ``step()``
is exposed whole, and so are the kernels, which share the device with backward. A call on ``L``
elements costs the 1-bit exchange's kernels ``L·(scale + pack + 2·unpack) + C·(scale + pack)`` (the
worker compresses ``L``, the server decodes ``n`` rows of ``C`` and re-compresses ``C``, every rank
decodes ``L``), the b-bit one's the same with its own scale and pack, the vote's
``L·(pack + unpack·(1 + n/32))`` (its mean reads ``n`` rows of ``L/8`` bytes); seconds per element
from :data:`H100_KERNELS` or ``--kernels-from``.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field, fields

from hf_onebit.comm.pieces import padded_length, piece_bounds, width_block
from hf_onebit.comm.hierarchical import shard_piece_sizes
from hf_onebit.comm.stats import allreduce_bytes
from hf_onebit.optim.defaults import LIBRARY

MiB = 1 << 20
#: DDP's bucket sizes: the first bucket (``dist._DEFAULT_FIRST_BUCKET_BYTES``) and the others (``bucket_cap_mb``)
FIRST_BUCKET_BYTES, BUCKET_BYTES = 1 * MiB, 25 * MiB
GRAD_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}
#: method -> (label, the warmup's plan or None, the plan after the freeze; None: 0/1 Adam's schedule)
METHOD_PLANS = {
    "adamw": ("AdamW", None, "allreduce"),
    "powersgd": ("PowerSGD", "allreduce", "powersgd"),
    "onebit_adam": ("1-bit Adam", "warmup", "onebit"),
    "zeroone_adam": ("0/1 Adam", "variance", None),
    "onebit_lamb": ("1-bit LAMB", "warmup", "onebit"),
    "binsgdm": ("BinSGDM", None, "vote"),
}
METHODS = tuple(METHOD_PLANS)
RING_ONLY = ("adamw", "powersgd")  # DDP's all-reduce and torch's PowerSGD hook have no exchange by node


class EstimateError(ValueError):
    """An input the model cannot use; its message names the flag that gave it."""


_KERNEL_OPS = ("worker_scale", "worker_pack", "unpack_scaled", "qworker_scale(8)", "qworker_pack(8)")
#: Seconds per element of each kernel on an NVIDIA H100 (torch 2.11, Triton), from
#: docs/img/gpu_costs_h100.json (``benchmarks/gpu_costs.py``): the 2^26-element rows, ms / 2^26.
H100_KERNELS = {
    "source": "NVIDIA H100 (docs/img/gpu_costs_h100.json, 2^26 elements)",
    **{dtype: {op: ms / 2**26 for op, ms in zip(_KERNEL_OPS, row)} for dtype, row in (
        ("float32", (0.223616e-3, 0.30584e-3, 0.155136e-3, 0.223104e-3, 0.326384e-3)),
        ("bfloat16", (0.181984e-3, 0.261792e-3, 0.118944e-3, 0.179584e-3, 0.285680e-3)))},
}


# ============================================================================== bytes
@dataclass(frozen=True)
class Layout:
    """``ranks`` data-parallel ranks on ``nodes`` nodes, ``ranks / nodes`` on each, numbered node by node."""

    ranks: int
    nodes: int = 1

    def __post_init__(self) -> None:
        if self.ranks < 1 or self.nodes < 1:
            raise EstimateError(f"--gpus and --nodes must be at least 1, got {self.ranks} and {self.nodes}")
        if self.ranks % self.nodes:
            raise EstimateError(f"--gpus {self.ranks} is not a multiple of --nodes {self.nodes}:"
                                " the model needs the same number of ranks on every node")

    @property
    def per_node(self) -> int:
        return self.ranks // self.nodes


@dataclass
class Leg:
    """One collective: bytes one rank sends, of them those leaving its node (``between``: what
    crosses a node's link, all its ranks together) and those to its own node (``inside``); hops."""

    sent: float
    between: float
    inside: float
    hops: int


@dataclass
class Traffic:
    """The collectives of one exchange (a bucket, or a whole step); ``rounds`` as the library counts them."""

    legs: list = field(default_factory=list)
    rounds: int = 0

    def __iadd__(self, other: "Traffic") -> "Traffic":
        self.legs += other.legs
        self.rounds += other.rounds
        return self

    sent = property(lambda self: sum(l.sent for l in self.legs))
    between = property(lambda self: sum(l.between for l in self.legs))
    inside = property(lambda self: sum(l.inside for l in self.legs))


def _ring(sent: float, lay: Layout, hops: int) -> Leg:
    if lay.ranks == 1:
        return Leg(0, 0, 0, 0)
    return Leg(sent, sent if lay.nodes > 1 else 0.0, sent if lay.per_node > 1 else 0.0, hops)


def _all_to_all(sent: float, lay: Layout) -> Leg:
    n, k = lay.ranks, lay.per_node
    if n == 1:
        return Leg(0, 0, 0, 0)
    return Leg(sent, k * (n - k) / (n - 1) * sent, (k - 1) / (n - 1) * sent, n - 1)


def ring_allreduce(nbytes: float, lay: Layout) -> Traffic:
    n = lay.ranks
    return Traffic([_ring(allreduce_bytes(nbytes, n), lay, 2 * (n - 1))], 1 if n > 1 else 0)


#: elements per compression scale at the library's defaults (``scale_block``)
SCALE_BLOCK = LIBRARY["OneBitAdam"]["scale_block"]


def chunk_scales(numel: int, n: int, tensor_sizes=None, tensors: int | None = None,
                 block: int | None = SCALE_BLOCK) -> int:
    """``s'``, the most scales of one chunk in one call (worker scales in round 2, server scales in
    round 3): exact for ``tensor_sizes`` (the piece sizes a :class:`~hf_onebit.comm.CompressedAllReduce`
    is given, cut as it cuts them), the bound for a count of ``tensors`` cut into blocks of
    ``block``, one scale per chunk for neither."""
    L = padded_length(int(numel), n)
    C = L // n
    if tensor_sizes is not None:
        bounds = piece_bounds(list(tensor_sizes), L, n)
        return max(sum(1 for a in bounds[:-1] if j * C <= a < (j + 1) * C) for j in range(n))
    if not tensors:
        return 1
    return int(tensors) + (-(-C // block) if block else 0) + 1


def compressed(numel: int, lay: Layout, width: int = 1, tensor_sizes=None, tensors: int | None = None,
               block: int | None = SCALE_BLOCK) -> Traffic:
    """The 1-bit (``width`` 1) or b-bit exchange of ``numel`` elements among all ranks (``block``:
    the 1-bit calls' scale block; a b-bit call's is ``width`` times shorter)."""
    n = lay.ranks
    if n == 1:
        return Traffic()
    C = padded_length(int(numel), n) // n
    s_max = chunk_scales(numel, n, tensor_sizes, tensors, width_block(block, width))
    if tensor_sizes is None and not tensors:  # one scale per rank and chunk: all-gathered in round 1
        scales, codes, payload = (n - 1) * 4, (n - 1) * (C * width // 8), (n - 1) * (4 + C * width // 8)
    else:  # a finiteness flag, then each chunk's piece scales beside its codes
        scales, codes = (n - 1) * 4, (n - 1) * (4 * s_max + C * width // 8)
        payload = codes
    return Traffic([_ring(scales, lay, n - 1), _all_to_all(codes, lay), _ring(payload, lay, n - 1)], 3)


def compressed_by_node(numel: int, lay: Layout, width: int = 1, tensor_sizes=None,
                       tensors: int | None = None, block: int | None = SCALE_BLOCK) -> Traffic:
    """:mod:`hf_onebit.comm.hierarchical`'s exchange; with ``tensor_sizes``, local rank 0's shard."""
    k, M = lay.per_node, lay.nodes
    S = -(-int(numel) // k)
    shard_sizes = None if tensor_sizes is None else shard_piece_sizes(tensor_sizes, 0, S)
    inner = compressed(S, Layout(M, M), width, shard_sizes, None if tensors is None else -(-tensors // k), block)
    rs, ag = (k - 1) * 4 * (S + 1), (k - 1) * 4 * S
    legs = [Leg(l.sent, k * l.sent, 0, l.hops) for l in inner.legs]  # every rank of the node runs one
    return Traffic([Leg(rs, 0, rs, k - 1), *legs, Leg(ag, 0, ag, k - 1)], 2 + inner.rounds)


def vote(numel: int, lay: Layout) -> Traffic:
    n = lay.ranks
    if n == 1:
        return Traffic()
    return Traffic([_ring((n - 1) * (4 + padded_length(int(numel), 1) // 8), lay, n - 1)], 1)


def vote_by_node(numel: int, lay: Layout) -> Traffic:
    k, M = lay.per_node, lay.nodes
    nbytes = padded_length(int(numel), k) // 8
    r1, r2, r3 = (k - 1) * (4 + nbytes), (M - 1) * (4 + nbytes // k), (k - 1) * M * (nbytes // k)
    return Traffic([Leg(r1, 0, r1, k - 1), Leg(r2, k * r2, 0, M - 1), Leg(r3, 0, r3, k - 1)], 3)


def ddp_buckets(params: int, grad_bytes: int) -> list[int]:
    """Elements per DDP bucket: 1 MiB, then 25 MiB each, the rest in the last."""
    sizes, left, cap = [], params * grad_bytes, FIRST_BUCKET_BYTES
    while left > 0:
        take = min(cap, left)
        sizes.append(max(1, take // grad_bytes))
        left, cap = left - take, BUCKET_BYTES
    return sizes or [1]


def default_hidden(params: int) -> int:
    """A transformer's width for ``params``: ``P ≈ 12·d²·(d/128)``, rounded to a multiple of 64."""
    return max(64, int(round((128 * params / 12) ** (1 / 3) / 64)) * 64)


def powersgd_elements(params: int, rank: int, hidden: int) -> int:
    return int(round(1.5 * params * rank / hidden + 13 * params / (12 * hidden)))


def zeroone_plans(steps: int, var_freeze_step: int, var_update_scaler: int | None = None,
                  local_step_scaler: int = 32678, local_step_clipper: int = 16) -> list[str]:
    """Each step's plan, by :class:`hf_onebit.optim.ZeroOneAdam`'s counters: ``"variance"`` (b-bit),
    ``"onebit"`` (a 1-bit gradient step), ``"sync"`` or ``"local"``."""
    plans, var_interval, var_counter, local_interval, local_counter = [], 1, 0, 1, 0
    for t in range(1, steps + 1):
        if t > var_freeze_step:
            plans.append("sync" if t % local_interval == 0 else "local")
            local_counter += 1
            if local_counter == local_step_scaler:
                local_counter, local_interval = 0, min(local_step_clipper, 2 * local_interval)
        elif t % var_interval:
            plans.append("onebit")
        else:
            plans.append("variance")
            var_counter += 1
            if var_counter == var_update_scaler:  # never with None
                var_counter, var_interval = 0, var_interval * 2
    return plans


# ============================================================================== kernels
@dataclass
class Kernels:
    """Seconds per element of the compression kernels, by gradient dtype (``float32``, ``bfloat16``)."""

    table: dict
    source: str

    def per_element(self, dtype: str, op: str) -> float:
        """``op``'s time; an 8-bit op missing from the table takes its 1-bit counterpart's."""
        row = self.table.get("bfloat16" if dtype in ("bf16", "fp16") else "float32") or self.table["float32"]
        return row[op] if op in row else row[{"qworker_scale(8)": "worker_scale", "qworker_pack(8)": "worker_pack"}[op]]

    @classmethod
    def load(cls, path: str) -> "Kernels":
        """From ``hf-onebit check --json`` or ``benchmarks/gpu_costs.py``'s JSON (its largest buffers)."""
        def fail(what):
            return EstimateError(f"--kernels-from: {path}{what}")

        try:
            with open(path, encoding="utf-8") as f:
                data = json.load(f)
        except (OSError, ValueError) as exc:
            raise EstimateError(f"--kernels-from: cannot read {path}: {exc}") from None
        rows = data.get("kernels") if isinstance(data, dict) else None
        if not isinstance(rows, list) or not rows:
            raise fail(" has no 'kernels' list (write one with `hf-onebit check --no-train --json PATH`)")
        table, largest = {}, {}
        for r in rows:
            try:
                dtype, op, ms, numel = r.get("dtype", "float32"), r["op"], float(r["ms"]), int(r.get("numel") or 2 ** r["log2"])
            except (KeyError, TypeError, ValueError):
                raise fail(f": a row lacks op, ms and numel (or log2): {r!r}") from None
            if numel >= largest.get((dtype, op), 0):
                largest[(dtype, op)] = numel
                table.setdefault(dtype, {})[op] = ms / 1e3 / numel
        for dtype, row in table.items():
            if set(_KERNEL_OPS[:3]) - set(row):
                raise fail(f" has no {', '.join(sorted(set(_KERNEL_OPS[:3]) - set(row)))} for {dtype}")
        if "float32" not in table:
            raise fail(" has no float32 rows")
        return cls(table, f"{data.get('device', 'unknown device')} ({path})")


DEFAULT_KERNELS = Kernels({k: v for k, v in H100_KERNELS.items() if k != "source"}, H100_KERNELS["source"])


def kernel_seconds(kind: str, numel: int, n: int, dtype: str, kernels: Kernels, width: int = 1) -> float:
    if n == 1 or kind == "allreduce":
        return 0.0
    pe = kernels.per_element
    if kind == "vote":
        return numel * (pe(dtype, "worker_pack") + pe(dtype, "unpack_scaled") * (1 + n / 32))
    scale, pack = ("worker_scale", "worker_pack") if width == 1 else ("qworker_scale(8)", "qworker_pack(8)")
    compress = pe(dtype, scale) + pe(dtype, pack)
    return numel * (compress + 2 * pe(dtype, "unpack_scaled")) + numel / n * compress


# ============================================================================== per step
@dataclass
class Config:
    params: int
    layout: Layout
    link_bps: float
    intra_bps: float = 2.4e12  # NVLink-class: 300 GB/s each way per GPU
    latency_s: float = 1e-5
    compute_s: float = 1.0
    overlap: float = 0.5
    dtype: str = "bf16"
    warmup_bits: int = 8  # 32: the full-precision warmup
    tensors: int | None = None  # parameter tensors (one scale each); None: P / 1e6; 0: one scale per chunk
    scale_block: int | None = SCALE_BLOCK  # each tensor cut into blocks of this many elements, a scale each
    hidden: int | None = None  # PowerSGD's matrices
    powersgd_rank: int = 4
    kernels: Kernels = field(default_factory=lambda: DEFAULT_KERNELS)
    shared_link: bool = False  # every rank's traffic through one link (benchmarks/network.py's loopback)

    @property
    def grad_bytes(self) -> int:
        return GRAD_BYTES[self.dtype]

    @property
    def width(self) -> int:
        return self.hidden or default_hidden(self.params)


@dataclass
class Phase:
    """One phase's per-step figures: bytes (mean per step) and seconds (``comm``: before overlap)."""

    sent: float
    between: float
    rounds: float
    time: float
    comm: float
    kernels: float


def exchange(cfg: Config, kind: str, by_node: bool) -> tuple[Traffic, float, int]:
    """``(traffic, kernel seconds, buckets)`` of one step's exchange ``kind``:
    ``allreduce``, ``powersgd``, ``onebit``, ``bbit`` (warmup width), ``vote``."""
    lay, g = cfg.layout, cfg.grad_bytes
    buckets = ddp_buckets(cfg.params, g)
    tensors = cfg.tensors if cfg.tensors is not None else max(1, round(cfg.params / 1e6))
    by_node = by_node and lay.nodes > 1 and lay.per_node > 1
    ranks = lay.nodes if by_node else lay.ranks  # by node the kernels run on the inter-node exchange
    kind = "allreduce" if kind == "bbit" and cfg.warmup_bits == 32 else kind
    total, kern = Traffic(), 0.0
    for b in buckets:
        if kind == "allreduce":
            total += ring_allreduce(b * g, lay)
        elif kind == "powersgd":  # vectors, P and Q: 3 all-reduces
            t = ring_allreduce(powersgd_elements(cfg.params, cfg.powersgd_rank, cfg.width) * b / cfg.params * g, lay)
            total += Traffic([Leg(l.sent, l.between, l.inside, 3 * l.hops) for l in t.legs], 3 * t.rounds)
        elif kind == "vote":
            total += vote_by_node(b, lay) if by_node else vote(b, lay)
            kern += kernel_seconds("vote", b, ranks, cfg.dtype, cfg.kernels)
        elif kind in ("onebit", "bbit"):
            width = 1 if kind == "onebit" else cfg.warmup_bits
            tb = 0 if cfg.tensors == 0 else max(1, round(tensors * b / cfg.params))  # 0: a scale per chunk
            total += (compressed_by_node if by_node else compressed)(b, lay, width, tensors=tb, block=cfg.scale_block)
            kdtype = cfg.dtype if width != 1 else "fp32"  # the 1-bit calls compress fp32 buffers (momenta)
            kern += kernel_seconds("compressed", -(-b // lay.per_node) if by_node else b, ranks, kdtype,
                                   cfg.kernels, width)
        else:
            raise ValueError(kind)
    return total, kern, len(buckets)


def comm_seconds(traffic: Traffic, cfg: Config) -> float:
    total = 0.0
    for leg in traffic.legs:
        between = leg.between * (cfg.layout.nodes if cfg.shared_link else 1)
        t_link = 8 * between / cfg.link_bps if between else 0.0
        t_intra = 8 * leg.inside / cfg.intra_bps if leg.inside else 0.0
        total += max(t_link, t_intra) + leg.hops * cfg.latency_s
    return total


def plan_phase(cfg: Config, plan: str, by_node: bool) -> Phase:
    """One step of ``plan``: ``allreduce``, ``powersgd``, ``warmup``/``variance`` (b-bit), ``onebit``
    (hook), ``vote``, ``sync`` (0/1 Adam: 1-bit in ``step()``), ``local`` (nothing)."""
    if plan == "local":
        return Phase(0, 0, 0, cfg.compute_s, 0.0, 0.0)
    kind = {"warmup": "bbit", "variance": "bbit", "sync": "onebit"}.get(plan, plan)
    traffic, kern, buckets = exchange(cfg, kind, by_node)
    comm = comm_seconds(traffic, cfg)
    exposed = comm if plan == "sync" else max(comm - cfg.overlap * cfg.compute_s, comm / buckets) if comm else 0.0
    return Phase(traffic.sent, traffic.between, traffic.rounds, cfg.compute_s + kern + exposed, comm, kern)


def mean_phase(phases: list[Phase]) -> Phase:
    n = max(1, len(phases))
    return Phase(*(sum(getattr(p, f.name) for p in phases) / n for f in fields(Phase)))


def method_plans(method: str, steps: int, freeze: int, zeroone: dict | None = None) -> list[str]:
    """The plan of every step of a run of ``steps`` with the warmup ending at ``freeze``."""
    if method == "zeroone_adam":
        return zeroone_plans(steps, freeze, **(zeroone or {}))
    _, warm, comp = METHOD_PLANS[method]
    freeze = min(freeze, steps) if warm else 0
    return [warm] * freeze + [comp] * (steps - freeze)
