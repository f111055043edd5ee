"""Independent single-process simulations of the spec (``shared/spec/algorithms.md``).

Written with numpy from the spec's text alone; they share no code with ``hf_onebit``, so the
package is checked against a second reading of the spec rather than against itself.
"""

from __future__ import annotations

import numpy as np

def _rms(y: np.ndarray) -> np.float32:
    if y.size == 0:
        return np.float32(0)
    return np.float32(np.sqrt(np.sum(y.astype(np.float64) ** 2) / y.size))


def _sign(y: np.ndarray) -> np.ndarray:
    return np.where(y >= 0, np.float32(1), np.float32(-1)).astype(np.float32)


def keep_mask(seen: np.ndarray, v_hat: np.ndarray, eps: float) -> np.ndarray:
    """hf_onebit's ``auto_mask``: keep coordinates ever non-zero whose ``sqrt(v̂)`` is at least eps/100."""
    return seen & (np.sqrt(v_hat) >= np.float32(0.01 * eps))


class SpecSimulation:
    """n workers and n servers of spec §1 in one process."""

    def __init__(self, numel: int, n: int) -> None:
        unit = 8 * n
        self.n, self.numel = n, numel
        self.L = -(-numel // unit) * unit
        self.C = self.L // n
        self.worker_error = [np.zeros(self.L, np.float32) for _ in range(n)]
        self.server_error = [np.zeros(self.C, np.float32) for _ in range(n)]

    def reset(self) -> None:
        """Zero every error buffer (0/1 Adam, entering its local phase)."""
        self.worker_error = [np.zeros_like(e) for e in self.worker_error]
        self.server_error = [np.zeros_like(e) for e in self.server_error]

    def step(self, xs: list[np.ndarray]) -> tuple[np.ndarray, list[np.ndarray]]:
        n, C = self.n, self.C
        signs, scales, packed = [], [], []
        for i, x in enumerate(xs):
            y = np.zeros(self.L, np.float32)
            y[: x.size] = x
            y = y + self.worker_error[i]
            s = _rms(y)
            sg = _sign(y)
            self.worker_error[i] = (y - s * sg).astype(np.float32)
            signs.append(sg)
            scales.append(s)
            packed.append(np.packbits(y >= 0))
        result = np.zeros(self.L, np.float32)
        for j in range(n):
            acc = np.zeros(C, np.float32)
            for i in range(n):
                acc = (acc + scales[i] * signs[i][j * C : (j + 1) * C]).astype(np.float32)
            z = (acc / np.float32(n)).astype(np.float32) + self.server_error[j]
            t = _rms(z)
            sz = _sign(z)
            self.server_error[j] = (z - t * sz).astype(np.float32)
            result[j * C : (j + 1) * C] = t * sz
        return result[: self.numel], packed


class PieceSpecSimulation:
    """Spec §1 with one scale per piece ("scale per tensor" option), n workers in one process.

    Pieces: the boundaries between the concatenated tensors, each rounded down to a multiple of
    8, together with the chunk boundaries j·C; pieces of length 0 do not exist. Worker i scales
    each piece of ``x_i + e_i`` by its own RMS; server j averages ``s_i[piece]·sign⁺`` in rank
    order, adds its error and scales each of its pieces by the RMS of ``z`` there. A non-finite
    worker scale anywhere makes the whole result NaN and leaves every error as it was.
    """

    def __init__(self, numel: int, n: int, tensor_sizes: list[int]) -> None:
        assert sum(tensor_sizes) == numel
        unit = 8 * n
        self.n, self.numel = n, numel
        self.L = -(-numel // unit) * unit
        self.C = self.L // n
        ends = np.cumsum(np.asarray(tensor_sizes, dtype=np.int64))[:-1]
        cuts = set((ends - ends % 8).tolist()) | {j * self.C for j in range(n + 1)}
        self.cuts = sorted(cuts)
        # piece_of[k]: the piece of element k (0 .. P-1)
        self.piece_of = np.searchsorted(np.asarray(self.cuts), np.arange(self.L), side="right") - 1
        self.P = len(self.cuts) - 1
        self.worker_error = [np.zeros(self.L, np.float32) for _ in range(n)]
        self.server_error = [np.zeros(self.C, np.float32) for _ in range(n)]

    def reset(self) -> None:
        """Zero every error buffer (0/1 Adam, entering its local phase)."""
        self.worker_error = [np.zeros_like(e) for e in self.worker_error]
        self.server_error = [np.zeros_like(e) for e in self.server_error]

    def _piece_rms(self, y: np.ndarray, offset: int) -> np.ndarray:
        """Per-element RMS of the piece each element of ``y`` (starting at ``offset``) is in."""
        ids = self.piece_of[offset: offset + y.size]
        scale = np.zeros(self.P, np.float32)
        for p in np.unique(ids):
            scale[p] = _rms(y[ids == p])
        return scale

    def step(self, xs: list[np.ndarray]) -> np.ndarray:
        n, C = self.n, self.C
        ys, piece_scales = [], []
        for i, x in enumerate(xs):
            y = np.zeros(self.L, np.float32)
            y[: x.size] = x
            y = (y + self.worker_error[i]).astype(np.float32)
            ys.append(y)
            piece_scales.append(self._piece_rms(y, 0))
        if not all(np.isfinite(s).all() for s in piece_scales):
            return np.full(self.numel, np.nan, np.float32)
        for i in range(n):
            self.worker_error[i] = (ys[i] - piece_scales[i][self.piece_of] * _sign(ys[i])).astype(np.float32)
        result = np.zeros(self.L, np.float32)
        for j in range(n):
            part = slice(j * C, (j + 1) * C)
            acc = np.zeros(C, np.float32)
            for i in range(n):
                acc = (acc + piece_scales[i][self.piece_of[part]] * _sign(ys[i][part])).astype(np.float32)
            z = (acc / np.float32(n)).astype(np.float32) + self.server_error[j]
            t = self._piece_rms(z, j * C)[self.piece_of[part]]
            rebuilt = (t * _sign(z)).astype(np.float32)
            if np.isfinite(t).all():
                self.server_error[j] = (z - rebuilt).astype(np.float32)
            result[part] = rebuilt
        return result[: self.numel]


class NodeSpecSimulation:
    """The exchange by node (hf_onebit.comm.hierarchical) of ``nodes × local_size`` workers.

    Worker ``r`` is local rank ``r % k`` of node ``r // k``. The buffer is padded to ``k·S``
    (``S = ceil(numel / k)``); shard ``l`` of each node's fp32 mean ``Σ x_r/k`` (in local-rank
    order) goes through spec §1 among the nodes, with error state of its own (and, with
    ``tensor_sizes``, one scale per tensor piece *of the shard*: the tensors cut at the shard's
    ends, the padding added to the last); the averaged shards, concatenated, are the result.
    A non-finite input anywhere makes every shard's input NaN.
    """

    def __init__(self, numel: int, nodes: int, local_size: int, tensor_sizes: list[int] | None = None) -> None:
        self.numel, self.M, self.k = numel, nodes, local_size
        self.S = -(-numel // local_size)
        self.shards = []
        for l in range(local_size):
            if tensor_sizes is None:
                self.shards.append(SpecSimulation(self.S, nodes))
                continue
            lo, hi, sizes, start = l * self.S, (l + 1) * self.S, [], 0
            for size in tensor_sizes:
                inside = min(hi, start + size) - max(lo, start)
                if inside > 0:
                    sizes.append(inside)
                start += size
            sizes = sizes[:-1] + [sizes[-1] + self.S - sum(sizes)] if sizes else [self.S]
            self.shards.append(PieceSpecSimulation(self.S, nodes, sizes))

    def reset(self) -> None:
        for sim in self.shards:
            sim.reset()

    def step(self, xs: list[np.ndarray]) -> np.ndarray:
        k, S = self.k, self.S
        poisoned = not all(np.isfinite(x).all() for x in xs)
        means = []
        for node in range(self.M):
            acc = np.zeros(k * S, np.float32)
            for r in range(node * k, (node + 1) * k):
                y = np.zeros(k * S, np.float32)
                y[: xs[r].size] = xs[r]
                acc = (acc + (y / np.float32(k)).astype(np.float32)).astype(np.float32)
            means.append(np.full(k * S, np.nan, np.float32) if poisoned else acc)
        result = np.zeros(k * S, np.float32)
        for l, sim in enumerate(self.shards):
            part = slice(l * S, (l + 1) * S)
            out = sim.step([m[part] for m in means])
            result[part] = out[0] if isinstance(out, tuple) else out
        return result[: self.numel]


class QuantizedSpecSimulation:
    """Spec §1b, the b-bit exchange of ``n`` workers in one process (``width`` 8 or 4).

    ``Q_b(y) = s·q``: ``s = max|y| / (2^(b-1) - 1)`` in fp32, ``q = rint(y / s)`` clipped to
    ``±(2^(b-1) - 1)``, ``q = 0`` where ``s`` is 0 or not finite. Worker ``i`` keeps one scale for
    its whole buffer, server ``j`` one for its chunk; with ``tensor_sizes`` both keep one per piece
    (cut as :class:`PieceSpecSimulation` cuts). Server ``j`` averages ``s_i·q_i`` in rank order
    (products rounded to fp32 before the sum). A non-finite worker scale anywhere makes the whole
    result NaN and leaves every error as it was.
    """

    def __init__(self, numel: int, n: int, width: int, tensor_sizes: list[int] | None = None) -> None:
        self.n, self.numel, self.Q = n, numel, np.float32(2 ** (width - 1) - 1)
        unit = 8 * n
        self.L = -(-numel // unit) * unit
        self.C = self.L // n
        chunks = {j * self.C for j in range(n + 1)}
        if tensor_sizes is None:
            worker_cuts, server_cuts = [0, self.L], sorted(chunks)
        else:
            assert sum(tensor_sizes) == numel
            ends = np.cumsum(np.asarray(tensor_sizes, dtype=np.int64))[:-1]
            worker_cuts = server_cuts = sorted(set((ends - ends % 8).tolist()) | chunks)
        self.worker_cuts, self.server_cuts = worker_cuts, server_cuts
        self.worker_error = [np.zeros(self.L, np.float32) for _ in range(n)]
        self.server_error = [np.zeros(self.C, np.float32) for _ in range(n)]

    def _scales(self, y: np.ndarray, cuts: list[int], offset: int = 0) -> np.ndarray:
        """Per-element ``max|y| / Q`` over the piece of each element (``y`` starts at ``offset``)."""
        out = np.zeros(y.size, np.float32)
        for lo, hi in zip(cuts[:-1], cuts[1:]):
            lo, hi = max(lo - offset, 0), min(hi - offset, y.size)
            if hi > lo:
                out[lo:hi] = np.float32(np.max(np.abs(y[lo:hi]))) / self.Q
        return out

    def _levels(self, y: np.ndarray, s: np.ndarray) -> np.ndarray:
        usable = np.isfinite(s) & (s > 0)
        with np.errstate(divide="ignore", invalid="ignore"):
            q = np.clip(np.rint(y / np.where(usable, s, np.float32(1))), -self.Q, self.Q)
        return np.where(usable, q, np.float32(0)).astype(np.float32)

    def step(self, xs: list[np.ndarray]) -> np.ndarray:
        n, C = self.n, self.C
        ys, scales = [], []
        for i, x in enumerate(xs):
            y = np.zeros(self.L, np.float32)
            y[: x.size] = x
            ys.append((y + self.worker_error[i]).astype(np.float32))
            scales.append(self._scales(ys[-1], self.worker_cuts))
        if not all(np.isfinite(s).all() for s in scales):
            return np.full(self.numel, np.nan, np.float32)
        levels = [self._levels(y, s) for y, s in zip(ys, scales)]
        for i in range(n):
            self.worker_error[i] = (ys[i] - (scales[i] * levels[i]).astype(np.float32)).astype(np.float32)
        result = np.zeros(self.L, np.float32)
        for j in range(n):
            part = slice(j * C, (j + 1) * C)
            acc = np.zeros(C, np.float32)
            for i in range(n):
                acc = (acc + (scales[i][part] * levels[i][part]).astype(np.float32)).astype(np.float32)
            z = ((acc / np.float32(n)).astype(np.float32) + self.server_error[j]).astype(np.float32)
            t = self._scales(z, self.server_cuts, j * C)
            rebuilt = (t * self._levels(z, t)).astype(np.float32)
            if np.isfinite(t).all():
                self.server_error[j] = (z - rebuilt).astype(np.float32)
            result[part] = rebuilt
        return result[: self.numel]


class WarmupExchange:
    """The averaged gradient of a warmup step (the exchanges the spec makes at full precision).

    ``bits=None``: the exact mean. Else spec §1b (:class:`QuantizedSpecSimulation`) per DDP bucket
    of ``layouts[t - 1]`` (the bucket keys of step ``t``), with error state per segment kept as
    ``hf_onebit.comm.segments`` keeps it: a key seen for the first time starts from zero errors
    and replaces every segment it overlaps. Its error buffers are its own, apart from any 1-bit
    exchange of the same parameters (0/1 Adam's variance phase alternates the two).
    :meth:`clear` forgets every segment (1-bit Adam's and LAMB's freeze).
    """

    def __init__(self, sizes, n, bits=None, layouts=None, scale_per_tensor=False, scale_block=None) -> None:
        self.sizes, self.n, self.bits, self.layouts = sizes, n, bits, layouts
        self.per_tensor, self.block, self.by_key = scale_per_tensor, scale_block, {}

    def _exchange(self, key):
        if key not in self.by_key:
            for other in [k for k in self.by_key if set(k) & set(key)]:
                del self.by_key[other]
            sizes = [self.sizes[k] for k in key]
            # b bits: blocks b times shorter than the 1-bit exchange's (at least 8 elements)
            block = None if self.block is None else max(8, self.block // self.bits // 8 * 8)
            self.by_key[key] = QuantizedSpecSimulation(sum(sizes), self.n, self.bits,
                                                       scale_pieces(sizes, self.per_tensor, block))
        return self.by_key[key]

    def __call__(self, t, grads):  # grads[rank][param] -> averaged [param]
        P = len(self.sizes)
        if self.bits is None or self.n == 1:
            return [np.mean([grads[r][k] for r in range(self.n)], axis=0).astype(np.float32) for k in range(P)]
        out = [None] * P
        for key in self.layouts[t - 1]:
            key = tuple(key)
            flat = [np.concatenate([grads[r][k].ravel() for k in key]) for r in range(self.n)]
            avg, off = self._exchange(key).step(flat), 0
            for k in key:
                out[k] = avg[off: off + self.sizes[k]].reshape(grads[0][k].shape)
                off += self.sizes[k]
        return out

    def clear(self) -> None:
        self.by_key.clear()


def scale_pieces(sizes: list[int], per_tensor: bool, block: int | None) -> list[int] | None:
    """The sizes of the pieces that get one scale each: the tensors (``per_tensor``) or the whole
    buffer, each cut into blocks of ``block`` elements; ``None``: one scale per chunk."""
    if block is None:
        return list(sizes) if per_tensor else None
    pieces = []
    for size in (sizes if per_tensor else [sum(sizes)]):
        whole, rest = divmod(size, block)
        pieces += [block] * whole + [rest] * (rest > 0)
    return pieces


def exchange(numel: int, n: int, tensor_sizes: list[int] | None = None, nodes: tuple[int, int] | None = None):
    """The simulated exchange of one buffer of ``n`` workers: spec §1 (one scale per chunk, or per
    tensor piece with ``tensor_sizes``), or by node with ``nodes = (M, k)``."""
    if nodes is not None:
        assert nodes[0] * nodes[1] == n
        return NodeSpecSimulation(numel, nodes[0], nodes[1], tensor_sizes)
    if tensor_sizes is not None:
        return PieceSpecSimulation(numel, n, tensor_sizes)
    return SpecSimulation(numel, n)


# ---------------------------------------------------------------- 1-bit Adam (spec §2)
class OneBitAdamSimulation:
    """n ranks of 1-bit Adam, one compressed buffer per segment (a list of parameter indices)."""

    def __init__(self, params, n, segments, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, wd=0.0,
                 freeze_step=10, bias_correction=True, auto_mask=True, scale_per_tensor=False, update_clip=None,
                 nodes=None, warmup_bits=None, warmup_layouts=None, scale_block=None, precondition_exchange=False):
        """``warmup_bits``, ``warmup_layouts``: the warmup's exchange (:class:`WarmupExchange`),
        cleared at the freeze. ``precondition_exchange``: the ranks exchange ``m/d`` with ``d =
        sqrt(v̂)+eps`` of the frozen variance (0 where masked), and the average times ``d`` is the momentum."""
        self.precondition = precondition_exchange
        self.auto_mask, self.update_clip = auto_mask, update_clip
        self.warmup = WarmupExchange([np.asarray(x).size for x in params], n, warmup_bits, warmup_layouts,
                                     scale_per_tensor, scale_block)
        self.p = [np.array(x, np.float32) for x in params]
        self.m = [np.zeros_like(x) for x in self.p]
        self.v = [np.zeros_like(x) for x in self.p]
        self.seen = [np.zeros(x.shape, bool) for x in self.p]  # averaged gradient ever non-zero
        self.n, self.segments = n, segments
        self.comm = {tuple(s): exchange(sum(self.p[i].size for i in s), n,
                                        scale_pieces([self.p[i].size for i in s], scale_per_tensor, scale_block),
                                        nodes)
                     for s in segments}
        self.lr, self.b1, self.b2, self.eps, self.wd = lr, betas[0], betas[1], eps, wd
        self.F, self.bc, self.t = freeze_step, bias_correction, 0

    def step(self, grads):  # grads[rank][param]
        self.t += 1
        t, b1, b2 = self.t, np.float32(self.b1), np.float32(self.b2)
        if t <= self.F:
            averaged = self.warmup(t, grads)
            for k in range(len(self.p)):
                g = averaged[k]
                self.m[k] = (b1 * self.m[k] + (1 - b1) * g).astype(np.float32)
                self.v[k] = (b2 * self.v[k] + (1 - b2) * g * g).astype(np.float32)
                self.seen[k] |= g != 0
        else:
            if t == self.F + 1 and self.auto_mask:  # the mask is fixed when compression starts
                bc2 = (1 - self.b2 ** max(self.F, 1)) if self.bc else 1.0
                self.seen = [keep_mask(s, v / np.float32(bc2), self.eps) for s, v in zip(self.seen, self.v)]
            bc2 = np.float32(np.sqrt((1 - self.b2 ** max(self.F, 1)) if self.bc else 1.0))
            for seg in self.segments:
                d = np.concatenate([(np.sqrt(self.v[k]) / bc2 + np.float32(self.eps)).ravel() for k in seg])
                local = [np.concatenate([(b1 * self.m[k] + (1 - b1) * grads[r][k]).ravel() for k in seg])
                         for r in range(self.n)]
                if self.precondition:  # masked coordinates send 0
                    keep = np.concatenate([self.seen[k].ravel() for k in seg]) if self.auto_mask else 1
                    local = [x / d * keep for x in local]
                avg = self.comm[tuple(seg)].step(local)
                avg = avg[0] if isinstance(avg, tuple) else avg
                if self.precondition:
                    avg = avg * d
                off = 0
                for k in seg:
                    size = self.p[k].size
                    self.m[k] = avg[off: off + size].reshape(self.p[k].shape)
                    if self.auto_mask:  # spec §2 "Mask" (+ tiny RMS gradient): momentum stays at zero
                        self.m[k] = self.m[k] * self.seen[k]
                    off += size
        for k in range(len(self.p)):
            if self.bc:
                bc1 = 1 - self.b1 ** t
                bc2 = 1 - self.b2 ** min(t, self.F)
            else:
                bc1 = bc2 = 1.0
            m_hat = self.m[k] / bc1
            v_hat = self.v[k] / bc2
            root = np.sqrt(v_hat)
            if self.update_clip is not None and t > self.F:  # |step| <= update_clip·lr after the freeze
                root = np.maximum(root, np.abs(m_hat) / np.float32(self.update_clip))
            update = m_hat / (root + self.eps) + self.wd * self.p[k]
            self.p[k] = (self.p[k] - self.lr * update).astype(np.float32)
        if t == self.F:
            self.warmup.clear()  # the compression phase starts from zero errors
        return [x.copy() for x in self.p]
