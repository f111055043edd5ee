"""``hf-onebit estimate``: bytes and step time of each method before you run it (a cost model).

    hf-onebit estimate --params 7e9 --gpus 16 --nodes 2 --link 100gbit --step-ms 850
    python -m hf_onebit.estimate --params 350m --gpus 8 --nodes 8 --link 10gbit --step-ms 300 --dtype fp32

Pure Python (no torch import). Every figure is a formula of what you give it; nothing is measured
here. ``benchmarks/estimate_check.py`` compares its predictions with this repository's
emulated-network runs (``docs/img``) and prints the error of each point (``docs/cost-model.md``).

Notation
--------
``P`` parameters (all trained), ``g`` bytes per gradient element (``--dtype``: 4 for fp32, 2 for
bf16/fp16), ``n`` ranks, ``M`` nodes, ``k = n / M`` ranks per node. Bytes are counted as
:mod:`hf_onebit.comm.stats` counts them (*bytes sent by one rank* under each collective's
bandwidth-optimal algorithm): all-gather of ``c`` bytes per rank ``(n-1)·c``; all-to-all of ``B``
``(n-1)/n·B``; ring all-reduce of ``B`` ``2·(n-1)/n·B``.

DDP buckets
-----------
DDP cuts the gradient into buckets: the first holds 1 MiB, the others 25 MiB (its defaults), so
``B = 1 + ceil((P·g - 1 MiB) / 25 MiB)`` buckets; every hook-driven exchange below runs once per
bucket (``L_b`` elements). The sizes are DDP's; the exact split depends on tensor boundaries and
is not modelled (the per-bucket terms are padding and scales: bytes, not megabytes).

Bytes per step, per rank, and between nodes
-------------------------------------------
For each exchange: ``sent`` (one rank, what the library's counters show), ``between`` (what
leaves one node on its inter-node link in one step) and ``inside`` (what one rank sends to
ranks of its own node). The flat collectives cross between nodes in shares fixed by their
algorithms, with ranks numbered node by node: a ring (all-reduce, all-gather) has exactly one
edge leaving each node, carrying what every rank sends, so ``between = sent``; an all-to-all
sends ``(n-k)`` of each rank's ``n-1`` chunks off-node, from ``k`` ranks, so
``between = k·(n-k)/(n-1)·sent``. (On 2 nodes of 2 ranks that is 1/2 of all bytes for a ring,
2/3 for the all-to-all, 7/12 for the 1-bit exchange: ``benchmarks/netbench/twonode.py`` and its
veth counters measure those shares.)

* **AdamW** (DDP's ring all-reduce, gradient dtype): ``2·(n-1)/n·g·P``; ``2(n-1)`` latency hops
  per bucket.
* **PowerSGD** (torch's hook, rank ``r``): each weight matrix ``a×b`` sends ``r·(a+b)`` elements
  (its factors ``P`` and ``Q``), vectors are all-reduced whole. The matrices of a transformer of
  width ``d`` are ``4`` of ``d×d`` and ``2`` of ``d×4d`` per ``12d²`` parameters, so the factors
  hold ``P·r·(4·2d + 2·5d)/(12d²) = 1.5·P·r/d`` elements, and the vectors (layer norms, biases:
  ``13d`` per layer) ``13·P/(12d)``; both all-reduced as a ring, 3 collectives per bucket.
  ``--hidden d`` (default: ``d`` from ``P ≈ 12·d²·(d/128)`` layers, i.e. ``(128·P/12)^(1/3)``,
  which gives 4096 at 7e9). Its warmup (torch's ``start_powerSGD_iter``) is AdamW's all-reduce;
  it is put at the same freeze as the 1-bit methods. Its matmuls (``≈ 4·r·P`` flops) are not in
  the time.
* **1-bit exchange, flat** (spec §1; 1-bit Adam's and 1-bit LAMB's compressed phase, 0/1 Adam's
  syncs): per bucket padded to ``L = 8n·ceil(L_b/8n)``, chunk ``C = L/n``; round 1 all-gather of
  ``s`` worker scales ``(n-1)·4s``, round 2 all-to-all of the signs ``(n-1)·C/8``, round 3
  all-gather of ``[server scales | signs of one chunk]`` ``(n-1)·(4s' + C/8)``. So
  ``sent ≈ 2·(n-1)/n·L/8`` (spec §1's ``2·L/8``), ``3(n-1)`` hops. With one scale per tensor
  (the library default) ``s`` is the number of tensor pieces of the bucket and ``s'`` the most
  any chunk holds; this model takes ``s = T_b + n - 1`` and ``s' = s`` for ``T_b`` tensors per
  bucket (``--tensors``, default ``P / 1e6``: an upper bound for a transformer), or ``s = s' = 1``
  for one scale per chunk. Between nodes: round 2 crosses ``k·(n-k)/(n-1)`` of its bytes, rounds 1
  and 3 (rings) all.
* **b-bit exchange** (spec §1b, the warmups at ``warmup_bits``, default 8): the same with ``b``
  bits per element: ``sent ≈ 2·(n-1)/n·L·b/8``. ``--warmup-bits 32`` means the full-precision
  warmup: AdamW's all-reduce.
* **1-bit exchange by node** (``hierarchical=True``, :mod:`hf_onebit.comm.hierarchical`): shard
  ``S = ceil(L_b/k)``; inside the node a reduce-scatter ``(k-1)·4·(S+1)`` and an all-gather
  ``(k-1)·4S`` (fp32), between nodes the flat exchange of ``S`` elements among ``M`` ranks (one
  per node), run by all ``k`` ranks of a node at once: ``between = k·2·(M-1)/M·S/8 ≈
  2·(M-1)/M·L/8`` per node, against ``≈ k·L/8`` for the flat exchange on ``k ≥ 2`` ranks per node.
* **BinSGDM's vote, flat** (:mod:`hf_onebit.comm.vote`): an all-gather of ``[flag | L/8 bits]``:
  ``sent = (n-1)·(4 + L/8)``, which grows with ``n``; ``n-1`` hops. **By node**: intra all-gather
  ``(k-1)·(4+L/8)``, inter all-gather of each rank's slice ``(M-1)·(4 + L/(8k))``, intra
  all-gather ``(k-1)·M·L/(8k)``; ``between = k·(M-1)·(4 + L/(8k))``.

Phases (library defaults, :mod:`hf_onebit.optim.defaults`)
----------------------------------------------------------
* 1-bit Adam, 1-bit LAMB: warmup = the b-bit exchange of the gradient, compressed = the 1-bit
  exchange of the momentum, both in DDP's hook (during backward).
* 0/1 Adam: the variance phase = every step a b-bit exchange in the hook (``var_update_scaler``
  ``None``); the local phase: a 1-bit sync in ``step()`` (after backward: it cannot overlap) on
  sync steps, nothing on the others. The interval doubles after ``local_step_scaler`` (32678)
  local steps, up to 16: below 32678 local steps every step syncs. :func:`zeroone_plans` steps
  through the schedule for any values.
* BinSGDM: a vote every step, no warmup.
* The whole run: the automatic freeze ends the warmup between 10% and 40% of the run
  (:meth:`hf_onebit.optim.freeze.AutoFreeze.for_run`); both bounds are printed.

Time model
----------
::

    step = compute + kernels + exposed(hook exchange) + step() exchange

* ``compute`` = ``--step-ms``: your step with no communication (e.g. one node's step time, or
  ``ddp.no_sync()``), which includes the optimizer's own arithmetic.
* A collective takes ``max(between / link, inside / intra_link) + hops · latency``: the slowest
  link sets the pace of a ring or an all-to-all; the exchange by node runs its intra and inter
  collectives one after the other, so theirs add.
* Overlap: the hook's exchanges (AdamW's all-reduce, PowerSGD, the warmups, 1-bit Adam/LAMB's
  compressed phase, BinSGDM's vote) run while backward still computes, bucket after bucket. The
  model lets them hide behind ``--overlap`` (default 0.5) of ``compute`` (backward is about 2/3 of
  forward + backward, less the optimizer step), except the last bucket's, which starts when
  backward ends: ``exposed = max(comm - overlap·compute, comm / B)``. 0/1 Adam's sync runs in
  ``step()`` and is exposed whole.
* ``kernels``: the compression kernels' time, added whole (on a GPU they share the device with
  backward; on a CPU the cores). Per call of the 1-bit exchange on ``L`` elements
  ``L·(scale + pack + 2·unpack) + C·(scale + pack)`` (the worker compresses ``L``, the server
  decodes ``n`` rows of ``C`` and re-compresses ``C``, every rank decodes ``L``); the b-bit one
  the same with the b-bit scale and pack; the vote ``L·(pack + unpack·(1 + n/32))`` (the vote's
  mean reads ``n`` rows of ``L/8`` bytes, about ``1/32`` of an unpack each). Seconds per element
  from a throughput table: the H100 figures of ``docs/img/gpu_costs_h100.json`` (the default,
  :data:`H100_KERNELS`), or ``--kernels-from`` a JSON of ``hf-onebit check --json`` (your
  machine) or of ``benchmarks/gpu_costs.py``.
* The link: ``--link`` is each node's inter-node bandwidth, each direction (a NIC). Protocol
  headers, a token bucket's burst and congestion are not modelled.
"""

from __future__ import annotations

import argparse
import json
import math
import re
import sys
from dataclasses import dataclass, field

MiB = 1 << 20
#: DDP's bucket sizes: the first bucket (``dist._DEFAULT_FIRST_BUCKET_BYTES``) and the others (``bucket_cap_mb``)
FIRST_BUCKET_BYTES = 1 * MiB
BUCKET_BYTES = 25 * MiB
GRAD_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}
METHODS = ("adamw", "powersgd", "onebit_adam", "zeroone_adam", "onebit_lamb", "binsgdm")
LABELS = {"adamw": "AdamW", "powersgd": "PowerSGD", "onebit_adam": "1-bit Adam",
          "zeroone_adam": "0/1 Adam", "onebit_lamb": "1-bit LAMB", "binsgdm": "BinSGDM"}

#: Seconds per element of each kernel on an NVIDIA H100 (torch 2.11, Triton), from
#: docs/img/gpu_costs_h100.json (``benchmarks/gpu_costs.py``): the 2^26-element rows, ms / 2^26.
H100_KERNELS = {
    "source": "NVIDIA H100 (docs/img/gpu_costs_h100.json, 2^26 elements)",
    "float32": {"worker_scale": 0.223616e-3 / 2**26, "worker_pack": 0.30584e-3 / 2**26,
                "unpack_scaled": 0.155136e-3 / 2**26, "qworker_scale(8)": 0.223104e-3 / 2**26,
                "qworker_pack(8)": 0.326384e-3 / 2**26},
    "bfloat16": {"worker_scale": 0.181984e-3 / 2**26, "worker_pack": 0.261792e-3 / 2**26,
                 "unpack_scaled": 0.118944e-3 / 2**26, "qworker_scale(8)": 0.179584e-3 / 2**26,
                 "qworker_pack(8)": 0.285680e-3 / 2**26},
}


# ============================================================================== parsing
class EstimateError(ValueError):
    """A flag the estimate cannot read (its message names the flag and what it accepts)."""


_RATE = re.compile(r"^\s*([0-9]+(?:\.[0-9]+)?(?:e[+-]?[0-9]+)?)\s*([kmgt]?)(bit|bps|bit/s)\s*$", re.IGNORECASE)
_SCALE = {"": 1.0, "k": 1e3, "m": 1e6, "g": 1e9, "t": 1e12}


def parse_rate(text: str, flag: str = "--link") -> float:
    """Bits per second from ``100gbit``, ``200mbit``, ``10Gbps``, ``1.5gbit/s`` (decimal prefixes).

    Bits only: ``100gb``, ``100GB/s`` or a bare ``100`` are refused (bits or bytes? per second?)."""
    m = _RATE.match(str(text))
    if not m:
        raise EstimateError(
            f"{flag}: cannot read {text!r} as a rate; write a number and a unit of bits per second:"
            f" bit, kbit, mbit, gbit, tbit (or kbps, mbps, gbps), e.g. 100gbit, 200mbit, 10gbps")
    value = float(m.group(1)) * _SCALE[m.group(2).lower()]
    if not value > 0 or not math.isfinite(value):
        raise EstimateError(f"{flag}: the rate must be positive, got {text!r}")
    return value


_COUNT = re.compile(r"^\s*([0-9]+(?:\.[0-9]+)?(?:e[+-]?[0-9]+)?)\s*([kmbt]?)\s*$", re.IGNORECASE)


def parse_count(text: str, flag: str = "--params") -> int:
    """A count from ``7e9``, ``7b``, ``350m``, ``1.3B``, ``125000000`` (k, m, b = 1e9, t = 1e12)."""
    m = _COUNT.match(str(text))
    if not m:
        raise EstimateError(f"{flag}: cannot read {text!r} as a count; e.g. 7e9, 7b, 350m, 125000000")
    value = float(m.group(1)) * {"": 1, "k": 1e3, "m": 1e6, "b": 1e9, "t": 1e12}[m.group(2).lower()]
    if not value >= 1 or not math.isfinite(value):
        raise EstimateError(f"{flag}: must be at least 1, got {text!r}")
    return int(round(value))


def fmt_rate(bps: float) -> str:
    if math.isinf(bps):
        return "unlimited"
    for unit, scale in (("Tbit/s", 1e12), ("Gbit/s", 1e9), ("Mbit/s", 1e6), ("kbit/s", 1e3)):
        if bps >= scale:
            return f"{bps / scale:g} {unit}"
    return f"{bps:g} bit/s"


# ============================================================================== layout
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


# ============================================================================== bytes
@dataclass
class Leg:
    """One collective: bytes one rank sends (``sent``), bytes leaving one node between nodes
    (``between``), bytes one rank sends inside its node (``inside``), latency ``hops``."""

    sent: float
    between: float
    inside: float
    hops: int


@dataclass
class Traffic:
    """The collectives of one exchange (a bucket, or a whole step)."""

    legs: list = field(default_factory=list)
    rounds: int = 0  # collective calls, as the library counts them

    def __iadd__(self, other: "Traffic") -> "Traffic":
        self.legs += other.legs
        self.rounds += other.rounds
        return self

    def scaled(self, factor: float) -> "Traffic":
        """The per-step mean of an exchange made on ``factor`` of the steps."""
        return Traffic([Leg(l.sent * factor, l.between * factor, l.inside * factor, l.hops) for l in self.legs],
                       self.rounds * factor)

    @property
    def sent(self) -> float:
        return sum(l.sent for l in self.legs)

    @property
    def between(self) -> float:
        return sum(l.between for l in self.legs)

    @property
    def inside(self) -> float:
        return sum(l.inside for l in self.legs)


def _ring(sent: float, lay: Layout, hops: int) -> Leg:
    """A ring collective (all-reduce, all-gather): one edge leaves each node, carrying ``sent``."""
    if lay.ranks == 1:
        return Leg(0, 0, 0, 0)
    between = sent if lay.nodes > 1 else 0.0
    inside = sent if lay.per_node > 1 else 0.0
    return Leg(sent, between, inside, hops)


def _all_to_all(sent: float, lay: Layout) -> Leg:
    """A pairwise all-to-all: ``n-k`` of each rank's ``n-1`` chunks go off-node."""
    n, k = lay.ranks, lay.per_node
    if n == 1:
        return Leg(0, 0, 0, 0)
    return Leg(sent, k * (n - k) / (n - 1) * sent, (k - 1) / (n - 1) * sent, n - 1)


def ring_allreduce(nbytes: float, lay: Layout) -> Traffic:
    """A ring all-reduce of ``nbytes``: ``2·(n-1)/n·nbytes`` per rank, ``2(n-1)`` hops."""
    n = lay.ranks
    return Traffic([_ring(2 * (n - 1) / n * nbytes, lay, 2 * (n - 1))], 1 if n > 1 else 0)


def padded(numel: int, unit: int) -> int:
    return -(-int(numel) // unit) * unit


def piece_counts(numel: int, n: int, tensor_sizes=None, tensors: int | None = None) -> tuple[int, int]:
    """``(s, s')``: worker scales per rank and the most server scales of one chunk in one call.

    ``tensor_sizes`` (the bucket's tensors in order): exact, as :func:`hf_onebit.comm.compressed.piece_bounds`
    cuts them (tensor ends rounded down to a multiple of 8, with the ``n`` chunk boundaries).
    ``tensors`` (a count): the bound ``s = s' = tensors + n - 1``. Neither: one scale per chunk."""
    if tensor_sizes is not None:
        L = padded(numel, 8 * n)
        C = L // n
        cuts = {j * C for j in range(n + 1)}
        offset = 0
        for size in list(tensor_sizes)[:-1]:
            offset += int(size)
            cuts.add(min(offset // 8 * 8, L))
        bounds = sorted(cuts)
        per_chunk = [sum(1 for a in bounds[:-1] if j * C <= a < (j + 1) * C) for j in range(n)]
        return len(bounds) - 1, max(per_chunk)
    if tensors:
        s = int(tensors) + n - 1
        return s, s
    return 1, 1


def compressed(numel: int, lay: Layout, width: int = 1, tensor_sizes=None, tensors: int | None = None) -> Traffic:
    """Spec §1 (``width`` 1) or §1b (8, 4) on ``numel`` elements among all ranks: 3 rounds."""
    n = lay.ranks
    if n == 1:
        return Traffic()
    L = padded(numel, 8 * n)
    C = L // n
    s, s_max = piece_counts(numel, n, tensor_sizes, tensors)
    scales = (n - 1) * 4 * s
    codes = (n - 1) * (C * width // 8)
    payload = (n - 1) * (4 * s_max + C * width // 8)
    return Traffic([_ring(scales, lay, n - 1), _all_to_all(codes, lay), _ring(payload, lay, n - 1)], 3)


def compressed_by_node(numel: int, lay: Layout, width: int = 1, tensor_sizes=None,
                       tensors: int | None = None) -> Traffic:
    """:mod:`hf_onebit.comm.hierarchical`: fp32 reduce-scatter in the node, §1 among the nodes, fp32 all-gather."""
    k, M = lay.per_node, lay.nodes
    S = -(-int(numel) // k)
    shard_sizes = None
    if tensor_sizes is not None:  # the shard of local rank 0 (its pieces; other shards differ by a few)
        from_zero, start = [], 0
        for size in tensor_sizes:
            overlap = min(S, start + size) - max(0, start)
            if overlap > 0:
                from_zero.append(overlap)
            start += size
        shard_sizes = from_zero or [S]
        shard_sizes[-1] += S - sum(shard_sizes)
    inner = compressed(S, Layout(M, M), width, shard_sizes, None if tensors is None else -(-tensors // k))
    rs, ag = (k - 1) * 4 * (S + 1), (k - 1) * 4 * S
    legs = [Leg(rs, 0, rs, k - 1)]
    legs += [Leg(l.sent, k * l.sent, 0, l.hops) for l in inner.legs]  # every rank of the node runs one
    legs += [Leg(ag, 0, ag, k - 1)]
    return Traffic(legs, 2 + inner.rounds)


def vote(numel: int, lay: Layout) -> Traffic:
    """BinSGDM's flat vote: an all-gather of ``[flag | bits]``."""
    n = lay.ranks
    if n == 1:
        return Traffic()
    nbytes = padded(numel, 8) // 8
    return Traffic([_ring((n - 1) * (4 + nbytes), lay, n - 1)], 1)


def vote_by_node(numel: int, lay: Layout) -> Traffic:
    """BinSGDM's vote by node: intra all-gather, inter all-gather of slices, intra all-gather."""
    k, M = lay.per_node, lay.nodes
    nbytes = padded(numel, 8 * k) // 8
    sl = nbytes // k
    r1, r2, r3 = (k - 1) * (4 + nbytes), (M - 1) * (4 + sl), (k - 1) * M * sl
    return Traffic([Leg(r1, 0, r1, k - 1), Leg(r2, k * r2, 0, M - 1), Leg(r3, 0, r3, k - 1)], 3)


def ddp_buckets(params: int, grad_bytes: int) -> list[int]:
    """Elements per DDP bucket: 1 MiB, then 25 MiB each, the rest in the last."""
    total = params * grad_bytes
    sizes, left, cap = [], total, FIRST_BUCKET_BYTES
    while left > 0:
        take = min(cap, left)
        sizes.append(max(1, take // grad_bytes))
        left -= take
        cap = BUCKET_BYTES
    return sizes or [1]


def default_hidden(params: int) -> int:
    """A transformer's width for ``params``: ``P ≈ 12·d²·(d/128)``, rounded to a multiple of 64."""
    return max(64, int(round((128 * params / 12) ** (1 / 3) / 64)) * 64)


def powersgd_elements(params: int, rank: int, hidden: int) -> int:
    """Elements PowerSGD all-reduces per step: factors ``1.5·P·r/d`` and vectors ``13·P/(12d)``."""
    return int(round(1.5 * params * rank / hidden + 13 * params / (12 * hidden)))


# ============================================================================== 0/1 Adam's schedule
def zeroone_plans(steps: int, var_freeze_step: int, var_update_scaler: int | None = None,
                  local_step_scaler: int = 32678, local_step_clipper: int = 16) -> list[str]:
    """The plan of each step ``1..steps`` (:class:`hf_onebit.optim.ZeroOneAdam`'s counters):
    ``"variance"`` (b-bit), ``"onebit"`` (1-bit gradient step), ``"sync"``, ``"local"``."""
    plans, var_interval, var_counter, local_interval, local_counter = [], 1, 0, 1, 0
    for t in range(1, steps + 1):
        if t <= var_freeze_step:
            if t % var_interval == 0:
                plans.append("variance")
                var_counter += 1
                if var_update_scaler is not None and var_counter == var_update_scaler:
                    var_counter, var_interval = 0, var_interval * 2
            else:
                plans.append("onebit")
        else:
            plans.append("sync" if t % local_interval == 0 else "local")
            local_counter += 1
            if local_counter == local_step_scaler:
                local_counter, local_interval = 0, min(local_step_clipper, 2 * local_interval)
    return plans


# ============================================================================== kernels
@dataclass
class Kernels:
    """Seconds per element of the compression kernels, by gradient dtype (``float32``, ``bfloat16``)."""

    table: dict
    source: str

    def per_element(self, dtype: str, op: str) -> float:
        key = "bfloat16" if dtype in ("bf16", "fp16") else "float32"
        row = self.table.get(key) or self.table["float32"]
        if op in row:
            return row[op]
        base = {"qworker_scale(8)": "worker_scale", "qworker_pack(8)": "worker_pack"}[op]
        return row[base]

    @classmethod
    def load(cls, path: str) -> "Kernels":
        """From ``hf-onebit check --json`` or ``benchmarks/gpu_costs.py``'s JSON (its largest buffers)."""
        try:
            with open(path, encoding="utf-8") as f:
                data = json.load(f)
        except (OSError, ValueError) as exc:
            raise EstimateError(f"--kernels-from: cannot read {path}: {exc}") from None
        table: dict = {}
        rows = data.get("kernels") if isinstance(data, dict) else None
        if not isinstance(rows, list) or not rows:
            raise EstimateError(f"--kernels-from: {path} has no 'kernels' list (write one with"
                                " `hf-onebit check --no-train --json PATH`)")
        best: dict = {}
        for r in rows:
            try:
                dtype, op, ms, numel = r.get("dtype", "float32"), r["op"], float(r["ms"]), int(r.get("numel") or 2 ** r["log2"])
            except (KeyError, TypeError, ValueError):
                raise EstimateError(f"--kernels-from: {path}: a row lacks op, ms and numel (or log2): {r!r}") from None
            if numel >= best.get((dtype, op), 0):
                best[(dtype, op)] = numel
                table.setdefault(dtype, {})[op] = ms / 1e3 / numel
        for dtype, row in table.items():
            missing = {"worker_scale", "worker_pack", "unpack_scaled"} - set(row)
            if missing:
                raise EstimateError(f"--kernels-from: {path} has no {', '.join(sorted(missing))} for {dtype}")
        if "float32" not in table:
            raise EstimateError(f"--kernels-from: {path} has no float32 rows")
        return cls(table, f"{data.get('device', 'unknown device')} ({path})")


DEFAULT_KERNELS = Kernels({k: v for k, v in H100_KERNELS.items() if k != "source"}, H100_KERNELS["source"])


def kernel_seconds(kind: str, numel: int, n: int, dtype: str, kernels: Kernels, width: int = 1) -> float:
    """The kernels of one exchange of ``numel`` elements (see the module docstring)."""
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
    hidden: int | None = None  # PowerSGD's matrices
    powersgd_rank: int = 4
    kernels: Kernels = field(default_factory=lambda: DEFAULT_KERNELS)
    shared_link: bool = False  # every rank's traffic through one link (benchmarks/network.py's loopback)

    @property
    def grad_bytes(self) -> int:
        return GRAD_BYTES[self.dtype]


@dataclass
class Phase:
    """One phase's per-step figures: bytes (mean per step) and seconds."""

    sent: float
    between: float
    rounds: float
    time: float
    comm: float  # seconds of communication before overlap
    kernels: float


def _bucket_tensors(cfg: Config, buckets: list[int]) -> list[int]:
    if cfg.tensors == 0:  # one scale per chunk (scale_per_tensor=False)
        return [0] * len(buckets)
    tensors = cfg.tensors if cfg.tensors is not None else max(1, round(cfg.params / 1e6))
    return [max(1, round(tensors * b / cfg.params)) for b in buckets]


def exchange(cfg: Config, kind: str, by_node: bool) -> tuple[Traffic, float, int]:
    """``(traffic, kernel seconds, buckets)`` of one step's exchange ``kind``:
    ``allreduce``, ``powersgd``, ``onebit``, ``bbit`` (warmup width), ``vote``."""
    lay, g = cfg.layout, cfg.grad_bytes
    buckets = ddp_buckets(cfg.params, g)
    tensors = _bucket_tensors(cfg, buckets)
    by_node = by_node and lay.nodes > 1 and lay.per_node > 1
    total, kern = Traffic(), 0.0
    if kind == "bbit" and cfg.warmup_bits == 32:
        kind = "allreduce"
    if kind == "powersgd":
        elements = powersgd_elements(cfg.params, cfg.powersgd_rank, cfg.hidden or default_hidden(cfg.params))
        for b in buckets:
            t = ring_allreduce(elements * b / cfg.params * g, lay)
            t.rounds = 3 if lay.ranks > 1 else 0  # vectors, P, Q
            t.legs[0].hops *= 3
            total += t
        return total, 0.0, len(buckets)
    for b, tb in zip(buckets, tensors):
        if kind == "allreduce":
            total += ring_allreduce(b * g, lay)
        elif kind in ("onebit", "bbit"):
            width = 1 if kind == "onebit" else cfg.warmup_bits
            fn = compressed_by_node if by_node else compressed
            total += fn(b, lay, width, tensors=tb)
            kdtype = cfg.dtype if width != 1 else "fp32"  # the 1-bit calls compress fp32 buffers (momenta)
            if by_node:
                kern += kernel_seconds("compressed", -(-b // lay.per_node), lay.nodes, kdtype, cfg.kernels, width)
            else:
                kern += kernel_seconds("compressed", b, lay.ranks, kdtype, cfg.kernels, width)
        elif kind == "vote":
            total += vote_by_node(b, lay) if by_node else vote(b, lay)
            kern += kernel_seconds("vote", b, lay.nodes if by_node else lay.ranks, cfg.dtype, cfg.kernels)
        else:
            raise ValueError(kind)
    return total, kern, len(buckets)


def comm_seconds(traffic: Traffic, cfg: Config) -> float:
    """Each collective at the pace of its slowest link, plus its latency hops."""
    total = 0.0
    for leg in traffic.legs:
        between = leg.between * (cfg.layout.nodes if cfg.shared_link else 1)
        t_link = 8 * between / cfg.link_bps if between else 0.0
        t_intra = 8 * leg.inside / cfg.intra_bps if leg.inside else 0.0
        total += max(t_link, t_intra) + leg.hops * cfg.latency_s
    return total


def step_seconds(cfg: Config, hook: Traffic | None, hook_buckets: int, kernels: float,
                 in_step: Traffic | None = None) -> tuple[float, float]:
    """``(step time, communication time before overlap)``: see "Time model"."""
    t_hook = comm_seconds(hook, cfg) if hook is not None else 0.0
    exposed = max(t_hook - cfg.overlap * cfg.compute_s, t_hook / max(1, hook_buckets)) if t_hook else 0.0
    t_step = comm_seconds(in_step, cfg) if in_step is not None else 0.0
    return cfg.compute_s + kernels + exposed + t_step, t_hook + t_step


def plan_phase(cfg: Config, plan: str, by_node: bool, method: str = "") -> Phase:
    """One step of ``plan``: ``allreduce``, ``powersgd``, ``warmup`` (b-bit), ``onebit`` (hook),
    ``vote``, ``sync`` (0/1 Adam: 1-bit in ``step()``), ``local`` (nothing)."""
    if plan == "local":
        return Phase(0, 0, 0, cfg.compute_s, 0.0, 0.0)
    kind = {"warmup": "bbit", "variance": "bbit", "sync": "onebit"}.get(plan, plan)
    traffic, kern, nb = exchange(cfg, kind, by_node)
    if plan == "sync":
        time, comm = step_seconds(cfg, None, 0, kern, traffic)
    else:
        time, comm = step_seconds(cfg, traffic, nb, kern)
    return Phase(traffic.sent, traffic.between, traffic.rounds, time, comm, kern)


def mean_phase(phases: list[Phase]) -> Phase:
    n = max(1, len(phases))
    return Phase(*(sum(getattr(p, f) for p in phases) / n for f in ("sent", "between", "rounds", "time", "comm", "kernels")))


def method_plans(method: str, steps: int, freeze: int, zeroone: dict | None = None) -> list[str]:
    """The plan of every step of a run of ``steps`` with the warmup ending at ``freeze``."""
    if method == "adamw":
        return ["allreduce"] * steps
    if method == "powersgd":
        return ["allreduce"] * min(freeze, steps) + ["powersgd"] * max(0, steps - freeze)
    if method in ("onebit_adam", "onebit_lamb"):
        return ["warmup"] * min(freeze, steps) + ["onebit"] * max(0, steps - freeze)
    if method == "zeroone_adam":
        return zeroone_plans(steps, freeze, **(zeroone or {}))
    if method == "binsgdm":
        return ["vote"] * steps
    raise ValueError(method)


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
    """:meth:`hf_onebit.optim.freeze.AutoFreeze.for_run`'s bounds (10% and 40% of the run)."""
    total = max(1, int(steps))
    lo = max(1, round(0.10 * total))
    return lo, max(lo, round(0.40 * total))


def estimate(cfg: Config, steps: int, methods=METHODS) -> list[Row]:
    """Every method, flat and (on several nodes of several ranks) by node."""
    rows = []
    lay = cfg.layout
    node_options = [False, True] if lay.nodes > 1 and lay.per_node > 1 else [False]
    bounds = freeze_bounds(steps)
    for method in methods:
        for by_node in node_options if method not in ("adamw", "powersgd") else [False]:
            cache: dict = {}

            def phase(plan):
                if plan not in cache:
                    cache[plan] = plan_phase(cfg, plan, by_node, method)
                return cache[plan]

            run_s, run_bytes = {}, {}
            for f in bounds:
                plans = method_plans(method, steps, f)
                run_s[f] = sum(phase(p).time for p in plans)
                run_bytes[f] = sum(phase(p).between if lay.nodes > 1 else phase(p).sent for p in plans)
            warm = {"adamw": None, "binsgdm": None}.get(method, phase("warmup" if method != "powersgd" else "allreduce"))
            if method == "zeroone_adam":
                comp = mean_phase([phase(p) for p in method_plans(method, steps, bounds[0])[bounds[0]:]])
                warm = phase("variance")
            else:
                comp = phase({"adamw": "allreduce", "powersgd": "powersgd", "binsgdm": "vote"}.get(method, "onebit"))
            label = "ring" if method in ("adamw", "powersgd") else ("by node" if by_node else "flat")
            rows.append(Row(method, label, warm, comp, run_s, run_bytes))
    return rows


def _mb(x: float) -> str:
    return f"{x / 1e6:,.1f}" if x >= 1e5 else f"{x / 1e6:.3f}"


def _dur(s: float) -> str:
    if s >= 3600:
        return f"{s / 3600:.1f} h"
    if s >= 60:
        return f"{s / 60:.1f} min"
    return f"{s:.1f} s"


def render(cfg: Config, steps: int, rows: list[Row]) -> str:
    lay = cfg.layout
    lo, hi = freeze_bounds(steps)
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
    for r in rows:
        w = r.warmup
        wcols = (f"{_mb(w.sent):>12} {_mb(w.between):>9} {w.time * 1e3:>9,.0f}" if w is not None
                 else f"{'-':>12} {'-':>9} {'-':>9}")
        c = r.compressed
        speed = "-".join(f"{base.run_s[f] / r.run_s[f]:.2f}" for f in (lo, hi))
        gb = "-".join(f"{r.run_bytes[f] / 1e9:,.0f}" for f in (lo, hi)) if r.method not in ("adamw", "binsgdm") \
            else f"{r.run_bytes[lo] / 1e9:,.0f}"
        out.append(f"{LABELS[r.method]:<11} {r.exchange:<8} | {wcols} | {_mb(c.sent):>16} {_mb(c.between):>9}"
                   f" {c.time * 1e3:>9,.0f} | {_dur(r.run_s[lo]):>10} {_dur(r.run_s[hi]):>10} {speed:>11} {gb:>13}")
    out.append("")
    out.append("x AdamW: AdamW's whole run over this one's, at the freeze's lower and upper bound. PowerSGD:"
               f" rank {cfg.powersgd_rank}, width {cfg.hidden or default_hidden(cfg.params)} (--hidden), its"
               " all-reduce warmup put at the same freeze. 0/1 Adam: variance phase in the warmup columns, its"
               " syncs in step() (not overlapped). A model, not a measurement: docs/cost-model.md says how"
               " close it came on this repository's emulated networks.")
    return "\n".join(out)


# ============================================================================== CLI
def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="hf-onebit estimate", description=__doc__.splitlines()[0],
                                epilog="The formulas and the time model: python -c 'import hf_onebit.estimate as e;"
                                       " help(e)', or docs/cost-model.md.")
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
    params = parse_count(args.params)
    steps = parse_count(args.steps, "--steps")
    intra = math.inf if str(args.intra_link).strip().lower() == "unlimited" else parse_rate(args.intra_link, "--intra-link")
    for flag, value in (("--step-ms", args.step_ms), ("--latency-ms", args.latency_ms)):
        if not (value >= 0 and math.isfinite(value)):
            raise EstimateError(f"{flag} must be a finite number >= 0, got {value}")
    if not 0 <= args.overlap <= 1:
        raise EstimateError(f"--overlap must be between 0 and 1, got {args.overlap}")
    if args.hidden is not None and args.hidden < 1:
        raise EstimateError(f"--hidden must be at least 1, got {args.hidden}")
    cfg = Config(
        params=params, layout=Layout(args.gpus, args.nodes), link_bps=parse_rate(args.link), intra_bps=intra,
        latency_s=args.latency_ms / 1e3, compute_s=args.step_ms / 1e3, overlap=args.overlap, dtype=args.dtype,
        warmup_bits=args.warmup_bits, tensors=None if args.tensors is None else parse_count(args.tensors, "--tensors"),
        hidden=args.hidden, powersgd_rank=args.powersgd_rank,
        kernels=Kernels.load(args.kernels_from) if args.kernels_from else DEFAULT_KERNELS,
    )
    return cfg, steps


def main(argv=None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        cfg, steps = config_from_args(args)
    except EstimateError as exc:
        parser.error(str(exc))
    if "adamw" not in args.methods:
        args.methods = ["adamw", *args.methods]
    print(render(cfg, steps, estimate(cfg, steps, args.methods)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
