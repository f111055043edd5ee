"""1-bit LAMB on gloo ranks (every world size of ``tests/optim/world_sizes.py``, and by node on each
of its node layouts) against an independent numpy simulation of spec §4.

The simulation below is written from the spec's text alone (it shares no code with
``hf_onebit``; the compressor is :class:`tests.simulation.SpecSimulation`, one per compression
segment the run used, or :class:`tests.simulation.PieceSpecSimulation` with ``scale_per_tensor``).
Several configurations share one process launch to keep the file fast.
"""

from __future__ import annotations

import collections
from functools import partial

import numpy as np
import pytest
import torch

from tests.distributed import run_distributed
from tests.optim.harness import FixedGradModel, fixed_grads, train
from tests.optim.world_sizes import NODE_LAYOUTS, WORLD_SIZES, node_env
from tests.simulation import WarmupExchange, exchange, keep_mask

OPT = "hf_onebit.optim.onebit_lamb:OneBitLamb"


# ---------------------------------------------------------------- the simulation (spec §4)
def _norm(x: np.ndarray) -> float:
    return float(np.sqrt(np.sum(x.astype(np.float64) ** 2)))


def _group_norm(xs: list) -> float:
    """The norm of a tensor given as its pieces (one piece: :func:`_norm` itself)."""
    return _norm(xs[0]) if len(xs) == 1 else float(np.sqrt(sum(_norm(x) ** 2 for x in xs)))


class OneBitLambSimulation:
    """n ranks of 1-bit LAMB, one compressed buffer per segment (a list of parameter indices).

    ``binds`` counts how often each clip changed its input, so tests can check that a clip was
    really exercised. ``use_scaling=False`` drops the momentum scaling (a sensitivity check).
    ``scale_per_tensor``: one compression scale per tensor piece (the segment's tensor sizes, in
    segment order) instead of one per chunk. ``groups``: lists of parameter indices that are
    pieces of one tensor (FSDP2's shards): trust ratios, factors and momentum scalings are those
    of the whole tensor (default: every parameter a tensor of its own).
    """

    def __init__(self, params, n, segments, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0,
                 freeze_step=100000, max_coeff=10.0, min_coeff=0.01, coeff_beta=0.9, factor_max=4.0,
                 factor_min=0.5, factor_threshold=0.1, auto_mask=True, use_scaling=True,
                 scale_per_tensor=False, update_clip=None, nodes=None, groups=None, warmup_bits=None,
                 warmup_layouts=None, bias_correction=False, fresh_trust_ratio=False, precondition_exchange=False,
                 step_bound=None):
        self.clip = update_clip
        # hf_onebit's option: after the freeze the coefficient c_frozen·f is at most step_bound times
        # LAMB's own ratio clip(‖p‖/‖u‖) of the exchanged update
        self.step_bound = step_bound
        # hf_onebit's option: after the freeze the ranks send x/(sqrt(v̂)+eps) (0 where masked), x
        # the scaled momentum, and the mean times sqrt(v̂)+eps is the scaled momentum
        self.precondition = precondition_exchange
        # hf_onebit's option: after the freeze, LAMB's own ratio clip(‖p‖/‖u‖) of the exchanged update
        self.fresh_trust_ratio = fresh_trust_ratio
        # hf_onebit's option: LAMB on Adam's bias-corrected moments m̂ = m/(1−β1^t), v̂ = v/(1−β2^t)
        # (v̂ frozen at the freeze step, the fresh variance corrected at t), the trust-ratio
        # average starting at the first ratio instead of 0
        self.bias_correction = bias_correction
        # hf_onebit's option: the warmup's gradient exchanged at warmup_bits (spec §1b)
        self.warmup = WarmupExchange([np.asarray(x).size for x in params], n, warmup_bits, warmup_layouts,
                                     scale_per_tensor)  # hf_onebit's option: m/(max(sqrt(v), |m|/c) + eps) after the freeze
        self.p = [np.array(x, np.float32) for x in params]
        K = len(self.p)
        self.groups = [list(g) for g in groups] if groups is not None else [[k] for k in range(K)]
        self.m = [np.zeros_like(x) for x in self.p]
        self.v = [np.zeros_like(x) for x in self.p]
        self.v_fresh = [np.zeros_like(x) for x in self.p]
        self.c_frozen = [0.0] * K
        self.f_last = [1.0] * K
        self.scaling = None
        self.mask = None
        self.seen = [np.zeros(x.shape, bool) for x in self.p]
        self.n, self.segments = n, [list(s) for s in segments]
        self.comm = {tuple(s): exchange(sum(self.p[i].size for i in s), n,
                                        [self.p[i].size for i in s] if scale_per_tensor else None, nodes)
                     for s in self.segments}
        self.lr, self.b1, self.b2, self.eps, self.wd = lr, np.float32(betas[0]), np.float32(betas[1]), eps, weight_decay
        self.F, self.t = freeze_step, 0
        self.max_coeff, self.min_coeff, self.coeff_beta = max_coeff, min_coeff, coeff_beta
        self.factor_max, self.factor_min, self.thr = factor_max, factor_min, factor_threshold
        self.auto_mask, self.use_scaling = auto_mask, use_scaling
        self.binds = collections.Counter()
        self.factors: list[list[float]] = []  # f of every tensor, every compressed step
        self.ratios: list[list[float]] = []  # ‖p‖/‖u‖ of every tensor, every warmup step

    def step(self, grads):  # grads[rank][param]
        self.t += 1
        t, b1, b2, eps, wd = self.t, self.b1, self.b2, self.eps, self.wd
        K = len(self.p)
        if t <= self.F:
            self.ratios.append([])
            u = [None] * K
            averaged = self.warmup(t, grads)
            for k in range(K):
                g = averaged[k]
                self.seen[k] |= g != 0
                self.m[k] = (b1 * self.m[k] + (1 - b1) * g).astype(np.float32)
                self.v[k] = (b2 * self.v[k] + (1 - b2) * g * g).astype(np.float32)
                m_hat, v_hat = self.m[k], self.v[k]
                if self.bias_correction:
                    m_hat, v_hat = m_hat / (1 - b1 ** t), v_hat / (1 - b2 ** t)
                u[k] = (m_hat / (np.sqrt(v_hat) + np.float32(eps)) + np.float32(wd) * self.p[k]).astype(np.float32)
            for group in self.groups:
                wn, un = _group_norm([self.p[k] for k in group]), _group_norm([u[k] for k in group])
                c = 1.0
                if wn > 0 and un > 0:
                    ratio = wn / un
                    self.ratios[-1].append(ratio)
                    c = min(max(ratio, self.min_coeff), self.max_coeff)
                    if c != ratio:
                        self.binds["coeff_max" if ratio > self.max_coeff else "coeff_min"] += 1
                for k in group:
                    if c != 1 and self.bias_correction and self.c_frozen[k] == 0:
                        self.c_frozen[k] = c
                    elif c != 1:
                        self.c_frozen[k] = self.coeff_beta * self.c_frozen[k] + (1 - self.coeff_beta) * c
                    self.p[k] = (self.p[k] - np.float32(self.lr * c) * u[k]).astype(np.float32)
                    if t == self.F:
                        self.v_fresh[k] = self.v[k].copy()
            if t == self.F:
                self.warmup.clear()
            return [x.copy() for x in self.p]

        if self.scaling is None:  # first compressed step: from the momentum before its update
            r = {}
            for group in self.groups:
                size = sum(self.m[k].size for k in group)
                rms = _group_norm([self.m[k] for k in group]) / np.sqrt(size) if size else 0.0
                r.update({k: rms for k in group})
            mean = sum(r[g[0]] for g in self.groups) / len(self.groups)
            self.scaling = [np.float32(mean / r[k]) if (r[k] > 0 and self.use_scaling) else np.float32(1) for k in range(K)]
            if self.auto_mask and self.F > 0:
                # auto_mask: never non-zero, or sqrt(v) below eps/100 (no bias correction in LAMB)
                self.mask = [keep_mask(s, v, self.eps).astype(np.float32) for s, v in zip(self.seen, self.v)]
        m_prev = [x.copy() for x in self.m]
        v_frozen = 1 - b2 ** self.F if self.bias_correction else 1.0
        for seg in self.segments:
            local = [np.concatenate([((b1 * self.m[k] + (1 - b1) * grads[r][k]) * self.scaling[k]).ravel()
                                     for k in seg]).astype(np.float32) for r in range(self.n)]
            if self.precondition:
                d = np.concatenate([(np.sqrt(self.v[k] / np.float32(v_frozen)) + np.float32(eps)).ravel() for k in seg])
                keep = np.concatenate([self.mask[k].ravel() if self.mask is not None else np.ones(self.p[k].size)
                                       for k in seg])
                local = [x / d * keep for x in local]
            avg = local[0] if self.n == 1 else self.comm[tuple(seg)].step(local)
            avg = avg[0] if isinstance(avg, tuple) else avg  # SpecSimulation also returns the packed signs
            if self.precondition:
                avg = avg * d
            off = 0
            for k in seg:
                size = self.p[k].size
                self.m[k] = (avg[off: off + size].reshape(self.p[k].shape) / self.scaling[k]).astype(np.float32)
                if self.mask is not None:
                    self.m[k] = self.m[k] * self.mask[k]
                off += size
        u, prelims, fmax = [None] * K, [None] * K, [None] * K
        for k in range(K):
            g_rec = ((self.m[k] - b1 * m_prev[k]) / (1 - b1)).astype(np.float32)
            self.v_fresh[k] = (b2 * self.v_fresh[k] + (1 - b2) * g_rec * g_rec).astype(np.float32)
            m_hat, v_hat, v_fresh_hat = self.m[k], self.v[k], self.v_fresh[k]
            if self.bias_correction:
                m_hat = m_hat / (1 - b1 ** t)
                v_hat, v_fresh_hat = v_hat / (1 - b2 ** self.F), v_fresh_hat / (1 - b2 ** t)
            denom = (np.sqrt(v_hat) + np.float32(eps)).astype(np.float32)
            prelim = (m_hat / denom).astype(np.float32)
            if self.clip is not None:
                root = np.maximum(np.sqrt(v_hat), np.abs(m_hat) / np.float32(self.clip))
                clipped_prelim = (m_hat / (root + np.float32(eps))).astype(np.float32)
                self.binds["update_clip"] += int(np.sum(clipped_prelim != prelim))
                prelim = clipped_prelim
                assert np.abs(prelim).max(initial=0) <= self.clip * (1 + 1e-6)
            prelims[k] = prelim
            u[k] = (prelim + np.float32(wd) * self.p[k]).astype(np.float32)
            fmax[k] = float(np.max(denom / (np.sqrt(v_fresh_hat) + np.float32(eps)), initial=0.0))
        if self.fresh_trust_ratio:
            for group in self.groups:
                wn, un = _group_norm([self.p[k] for k in group]), _group_norm([u[k] for k in group])
                c = min(max(wn / un, self.min_coeff), self.max_coeff) if wn > 0 and un > 0 else 1.0
                for k in group:
                    self.p[k] = (self.p[k] - np.float32(self.lr * c) * u[k]).astype(np.float32)
            return [x.copy() for x in self.p]
        factors = []
        for group in self.groups:
            f = max(fmax[k] for k in group)
            if wd > 0:
                un = _group_norm([u[k] for k in group])
                rho = min(1.0, _group_norm([prelims[k] for k in group]) / un) if un > 0 else 1.0
                f = rho * f + (1 - rho)
            clipped = min(max(f, self.factor_min), self.factor_max)
            if clipped != f:
                self.binds["factor_max" if f > self.factor_max else "factor_min"] += 1
            last = self.f_last[group[0]]
            lo, hi = last * (1 - self.thr), last * (1 + self.thr)
            f = min(max(clipped, lo), hi)
            if f != clipped:
                self.binds["threshold_up" if clipped > hi else "threshold_down"] += 1
            factors.append(f)
            cap = np.inf
            if self.step_bound is not None:
                wn, un = _group_norm([self.p[k] for k in group]), _group_norm([u[k] for k in group])
                cap = self.step_bound * (min(max(wn / un, self.min_coeff), self.max_coeff) if wn > 0 and un > 0 else 1.0)
            for k in group:
                self.f_last[k] = f
                coeff = self.c_frozen[k] * f
                if coeff > cap:
                    self.binds["step_bound"] += 1
                    coeff = cap
                self.p[k] = (self.p[k] - np.float32(self.lr * coeff) * u[k]).astype(np.float32)
        self.factors.append(factors)
        return [x.copy() for x in self.p]


def _initial_params():
    torch.manual_seed(0)
    return [p.detach().numpy().copy() for p in FixedGradModel().parameters()]


def _grads(step, n):
    return [[g.numpy() for g in fixed_grads(step, r)] for r in range(n)]


def _simulate(n, segments, kwargs, steps, **extra):
    sim = OneBitLambSimulation(_initial_params(), n, segments, **kwargs, **extra)
    return sim, [sim.step(_grads(step, n)) for step in range(1, steps + 1)]


def _assert_close(got, want):
    # 1e-5 relative to the tensor's scale: an element that crosses zero has no own scale
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * np.abs(want).max())


# ---------------------------------------------------------------- the distributed side
def _train_many(rank, world_size, jobs):
    """Several ``harness.train`` runs in one launch: ``jobs`` is a list of (kwargs, steps, extra)."""
    return [train(rank, world_size, OPT, kwargs, steps, **extra) for kwargs, steps, extra in jobs]


# Configurations for the trajectory test: (name, kwargs, steps); F = 6, weight decay in both.
CONFIGS = [
    # a fast fresh variance and a tight threshold: the ±3% per-step limit on the factor binds
    # at every compressed step
    ("threshold", dict(lr=1e-2, betas=(0.9, 0.9), weight_decay=0.01, freeze_step=6, factor_threshold=0.03), 16),
    # a loose threshold and tight bounds: factor_min binds at the first compressed step,
    # factor_max from a few steps later (in between, f is free and the ρ blend shows); the trust
    # ratio (about 7 falling to 4.5 here) hits max_coeff early and min_coeff late
    ("bounds", dict(lr=1e-2, betas=(0.9, 0.5), weight_decay=0.01, freeze_step=6, max_coeff=6.0, min_coeff=5.0,
                    coeff_beta=0.5, factor_max=3.0, factor_min=1.45, factor_threshold=5.0), 16),
]


# On 3 ranks the run and the simulation part at step 14 through one sign, not through the algorithm
# (both configurations: the compressed momentum does not depend on β2 or the trust ratios).
_SIGN_TIE = pytest.mark.xfail(strict=True, reason=(
    "a sign tie between two fp32 roundings, not an algorithm error: up to step 13 the run and the simulation"
    " differ by <= 7e-7 (rounding); at step 14 (8th compressed step) rank 1's worker input y = x + e at element"
    " 319 of parameter 0's buffer is 8.9e-8 in the simulation (~3 ulp of its terms, |x|, |e| ~ 0.4) and the run's"
    " sign⁺ differs there: server chunk 0's scale t_0 moves by the ratio 0.99830 (measured on the run's step;"
    " flipping that one sign in the simulation predicts 0.99829), so 856 elements of parameter 0 move"
    " differently: max abs diff 5.6e-5 at step 14 ('threshold', tolerance 4.0e-5; 'bounds' 3.1e-4), 2e-2 at"
    " step 15"))


@pytest.mark.parametrize("world_size", [pytest.param(3, marks=_SIGN_TIE) if w == 3 else w for w in WORLD_SIZES])
def test_trajectory_matches_spec_simulation_through_the_freeze(world_size, per_tensor=False):
    jobs = [(dict(kwargs, scale_per_tensor=per_tensor), steps, {}) for _, kwargs, steps in CONFIGS]
    outs = run_distributed(_train_many, world_size, jobs)
    for c, (name, kwargs, steps) in enumerate(CONFIGS):
        runs = [outs[r][c] for r in range(world_size)]
        segments = runs[0]["segments"]
        assert any(len(s) > 1 for s in segments), "the test wants a segment holding several tensors"
        assert len(segments) > 1, "the test wants several DDP buckets"
        sim, expected = _simulate(world_size, segments, kwargs, steps, scale_per_tensor=per_tensor)
        if per_tensor:
            # the option is not silently ignored: the run is far from the per-chunk simulation
            _, per_chunk = _simulate(world_size, segments, kwargs, steps)
            last = runs[0]["history"][-1]
            assert any(not np.allclose(last[k].numpy(), per_chunk[-1][k], rtol=1e-5, atol=1e-5 * np.abs(per_chunk[-1][k]).max())
                       for k in range(len(last))), f"{name}: scale_per_tensor=True ran like the per-chunk scales"
        for step in range(steps):
            for r in range(world_size):
                for k, (got, want) in enumerate(zip(runs[r]["history"][step], expected[step])):
                    try:
                        _assert_close(got.numpy(), want)
                    except AssertionError as e:
                        raise AssertionError(f"{name}: step {step + 1}, rank {r}, parameter {k}") from e
                # parameters are bitwise identical on every rank after every step
                for a, b in zip(runs[r]["history"][step], runs[0]["history"][step]):
                    assert torch.equal(a, b), f"{name}: step {step + 1}: rank {r} differs from rank 0"
        stats = runs[0]["stats"]
        assert stats["phase"] == "compression"
        assert stats["last_step_rounds"] == 3 * len(segments)
        assert stats["compression_ratio"] > 1
        # the momentum scaling matters here: without it the trajectory would differ
        _, unscaled = _simulate(world_size, segments, kwargs, steps, use_scaling=False, scale_per_tensor=per_tensor)
        assert not np.allclose(unscaled[-1][1], expected[-1][1], rtol=1e-4, atol=1e-4 * np.abs(expected[-1][1]).max())
        # the clips were exercised (so this test cannot pass vacuously)
        if name == "threshold":
            assert sim.binds["threshold_up"] + sim.binds["threshold_down"] > 0, sim.binds
        else:
            assert sim.binds["factor_max"] > 0 and sim.binds["factor_min"] > 0, sim.binds
            assert sim.binds["coeff_max"] > 0 and sim.binds["coeff_min"] > 0, sim.binds


@pytest.mark.parametrize("nodes,local_size", NODE_LAYOUTS)
def test_exchange_by_node_matches_its_simulation_through_the_freeze(nodes, local_size):
    """hierarchical=True on ``nodes`` emulated nodes of ``local_size`` ranks: the compression phase
    is spec §1 among the node means, once per shard (the trust ratios and scaling as in the flat run)."""
    name, kwargs, steps = CONFIGS[0]
    n = nodes * local_size
    jobs = [(dict(kwargs, hierarchical=True), steps, {})]
    outs = run_distributed(_train_many, n, jobs, env=node_env(local_size))
    runs = [o[0] for o in outs]
    segments = runs[0]["segments"]
    _, expected = _simulate(n, segments, kwargs, steps, nodes=(nodes, local_size))
    _, flat = _simulate(n, segments, kwargs, steps)
    for step in range(steps):
        for r in range(n):
            for got, want in zip(runs[r]["history"][step], expected[step]):
                _assert_close(got.numpy(), want)
            assert all(torch.equal(a, b) for a, b in zip(runs[r]["history"][step], runs[0]["history"][step]))
    assert any(not np.allclose(e, f, rtol=1e-4, atol=1e-4 * np.abs(f).max()) for e, f in zip(expected[-1], flat[-1]))
    assert runs[0]["stats"]["last_step_rounds"] == 5 * len(segments)


def test_update_clip_matches_its_simulation_and_binds():
    """update_clip=c: |m/(max(sqrt(v), |m|/c) + eps)| <= c after the freeze, on 2 ranks like the simulation."""
    name, kwargs, steps = CONFIGS[0]
    kwargs = dict(kwargs, scale_per_tensor=True, update_clip=0.5)
    outs = run_distributed(_train_many, 2, [(kwargs, steps, {})])
    runs = [o[0] for o in outs]
    segments = runs[0]["segments"]
    sim, expected = _simulate(2, segments, kwargs, steps)  # asserts the bound at every compressed step
    for step in range(steps):
        for r in range(2):
            for got, want in zip(runs[r]["history"][step], expected[step]):
                _assert_close(got.numpy(), want)
    assert sim.binds["update_clip"] > 0, sim.binds  # the bound changed some coordinates' updates
    _, unclipped = _simulate(2, segments, dict(kwargs, update_clip=None), steps)
    assert any(not np.allclose(a, b) for a, b in zip(unclipped[-1], expected[-1]))


def _two_ranks_match_the_simulation(kwargs, steps):
    """Train ``kwargs`` on 2 ranks, check every step against the simulation; ``(segments, sim, expected)``."""
    outs = run_distributed(_train_many, 2, [(kwargs, steps, {})])
    runs = [o[0] for o in outs]
    segments = runs[0]["segments"]
    sim, expected = _simulate(2, segments, kwargs, steps)
    for step in range(steps):
        for r in range(2):
            for got, want in zip(runs[r]["history"][step], expected[step]):
                _assert_close(got.numpy(), want)
    return segments, sim, expected


def test_bias_correction_matches_its_simulation_with_the_update_clip():
    """bias_correction=True (the library default) with the update clip: LAMB on m̂ and v̂, the
    clip and the factor on the corrected moments, the trust-ratio average from the first ratio."""
    kwargs, steps = dict(CONFIGS[0][1], scale_per_tensor=True, update_clip=0.5, bias_correction=True), CONFIGS[0][2]
    segments, sim, expected = _two_ranks_match_the_simulation(kwargs, steps)
    assert sim.binds["update_clip"] > 0, sim.binds
    _, uncorrected = _simulate(2, segments, dict(kwargs, bias_correction=False), steps)
    assert any(not np.allclose(a, b, rtol=1e-4) for a, b in zip(uncorrected[-1], expected[-1]))
    assert all(c > 0 for c in sim.c_frozen)


def test_fresh_trust_ratio_matches_its_simulation_and_keeps_lambs_step_size():
    """fresh_trust_ratio=True: after the freeze each tensor steps by LAMB's
    own ratio of the exchanged update, so ‖Δp‖ = lr·clip(‖p‖/‖u‖)·‖u‖, lr·‖p‖ where unclipped."""
    kwargs = dict(CONFIGS[0][1], scale_per_tensor=True, update_clip=0.5, bias_correction=True, fresh_trust_ratio=True)
    steps = CONFIGS[0][2]
    segments, _, expected = _two_ranks_match_the_simulation(kwargs, steps)
    _, frozen = _simulate(2, segments, dict(kwargs, fresh_trust_ratio=False), steps)
    assert any(not np.allclose(a, b, rtol=1e-4) for a, b in zip(frozen[-1], expected[-1]))
    # the last (compressed) step of each tensor: ‖Δp‖/(lr·‖p‖) is 1 unless the ratio was clipped
    rel = [np.linalg.norm(a - b) / (kwargs["lr"] * np.linalg.norm(b)) for a, b in zip(expected[-1], expected[-2])]
    assert sum(r == pytest.approx(1.0, rel=1e-3) for r in rel) >= len(rel) / 2, rel


def test_step_bound_matches_its_simulation_and_binds():
    """step_bound=b: after the freeze a tensor's coefficient c_frozen·f is at most b times LAMB's own
    ratio clip(‖p‖/‖u‖) of the exchanged update, so ‖Δp‖ <= b·lr·‖p‖ where that ratio is unclipped."""
    kwargs = dict(CONFIGS[0][1], scale_per_tensor=True, update_clip=0.5, bias_correction=True, step_bound=0.6)
    steps = CONFIGS[0][2]
    segments, sim, expected = _two_ranks_match_the_simulation(kwargs, steps)
    assert 0 < sim.binds["step_bound"] < 5 * (steps - kwargs["freeze_step"]), sim.binds  # some steps of 5 tensors
    _, unbounded = _simulate(2, segments, dict(kwargs, step_bound=None), steps)
    assert any(not np.allclose(a, b, rtol=1e-4) for a, b in zip(unbounded[-1], expected[-1]))
    rel = [np.linalg.norm(a - b) / (kwargs["lr"] * np.linalg.norm(b)) for a, b in zip(expected[-1], expected[-2])]
    assert max(rel) <= 0.6 * (1 + 1e-4), rel


@pytest.mark.parametrize("fresh", [True, False])
def test_the_preconditioned_exchange_matches_its_simulation(fresh):
    """precondition_exchange=True at the library's settings (and with the frozen ratio): the
    ranks exchange the scaled momentum over sqrt(v̂)+eps, which the simulation models."""
    kwargs = dict(CONFIGS[0][1], scale_per_tensor=True, update_clip=0.5, bias_correction=True,
                  fresh_trust_ratio=fresh, precondition_exchange=True)
    steps = CONFIGS[0][2]
    segments, _, expected = _two_ranks_match_the_simulation(kwargs, steps)
    _, plain = _simulate(2, segments, dict(kwargs, precondition_exchange=False), steps)
    assert any(not np.allclose(a, b, rtol=1e-4) for a, b in zip(plain[-1], expected[-1]))


@pytest.mark.parametrize("name", ["update_clip", "step_bound"])
def test_the_bounds_are_validated(name):
    from hf_onebit.optim.onebit_lamb import OneBitLamb

    for bad in (0, -1.0, float("nan"), True, "1"):
        with pytest.raises(ValueError, match=f"{name} must be a positive number or None"):
            OneBitLamb([torch.nn.Parameter(torch.ones(2))], **{name: bad})
    assert getattr(OneBitLamb([torch.nn.Parameter(torch.ones(2))], **{name: 2}), name) == 2.0


@pytest.mark.parametrize("world_size", [2, 3])
def test_scale_per_tensor_trajectory_matches_piece_simulation(world_size):
    test_trajectory_matches_spec_simulation_through_the_freeze(world_size, per_tensor=True)


def test_resume_from_the_compression_phase_continues_bitwise(tmp_path):
    # saved after the first compressed step and later in the compression phase: scaling ratios,
    # v_fresh, c_frozen, f_last (the threshold binds here, so f_last matters), error buffers and
    # segments must all come back. (Not tested: a checkpoint taken at t == freeze_step itself.
    # No segment exists yet, so the resumed run's first compressed step meets DDP's one-bucket
    # first iteration and builds a different segment layout; OneBitAdam has the same limit. A
    # fix belongs in base.py: remember the warmup's bucket layout in the per-rank state.)
    kwargs = dict(lr=1e-2, betas=(0.9, 0.9), weight_decay=0.01, freeze_step=5, factor_threshold=0.03)
    steps, points = 12, (6, 9)
    dirs = {s: tmp_path / f"at{s}" for s in points}
    for d in dirs.values():
        d.mkdir()
    full = run_distributed(_train_many, 2, [(kwargs, steps, dict(save_dir=str(dirs[s]), save_at=s)) for s in points])
    resumed = run_distributed(
        _train_many, 2, [(kwargs, steps - s, dict(resume_dir=str(dirs[s]), start_step=s)) for s in points]
    )
    for j, s in enumerate(points):
        for r in range(2):
            assert len(resumed[r][j]["history"]) == steps - s
            for i, after in enumerate(resumed[r][j]["history"]):
                for a, b in zip(full[r][j]["history"][s + i], after):
                    assert torch.equal(a, b), f"saved at {s}: rank {r} differs at step {s + i + 1}"
        assert resumed[0][j]["stats"]["phase"] == "compression"


# ---------------------------------------------------------------- one process, no hook
def _run_local(kwargs, steps, dtype=torch.float32):
    from hf_onebit.optim.onebit_lamb import OneBitLamb

    torch.manual_seed(0)
    model = FixedGradModel().to(dtype)
    opt = OneBitLamb(model.parameters(), **{"defaults": "paper", **kwargs})
    history = []
    for step in range(1, steps + 1):
        for p, g in zip(model.parameters(), fixed_grads(step, 0)):
            p.grad = g.to(dtype)
        opt.step()
        history.append([p.detach().float().clone() for p in model.parameters()])
    return opt, model, history


@pytest.mark.parametrize("freeze_step", [1, 4])
def test_one_process_matches_simulation_without_compression(freeze_step):
    kwargs = dict(lr=1e-2, betas=(0.9, 0.9), weight_decay=0.01, freeze_step=freeze_step, factor_threshold=0.05)
    opt, _, history = _run_local(kwargs, 10)
    _, expected = _simulate(1, [list(range(5))], kwargs, 10)
    for step in range(10):
        for got, want in zip(history[step], expected[step]):
            _assert_close(got.numpy(), want)
    assert opt.phase() == "compression"


def test_clipped_trust_ratio_of_exactly_one_is_not_averaged():
    # min_coeff == 1 and every ratio ‖p‖/‖u‖ about 0.3 here: c == 1 at every warmup step, so
    # c_frozen keeps its initial 0 and the compression phase does not move the parameters
    # (spec §4 read literally, as DeepSpeed does)
    opt, _, history = _run_local(dict(lr=1e-2, freeze_step=3, min_coeff=1.0), 6)
    assert not torch.equal(history[0][0], history[2][0])  # the warmup did move them
    assert all(float(opt.state[p]["coeff_frozen"]) == 0.0 for p in opt.params_in_order())
    for a, b in zip(history[2], history[5]):
        assert torch.equal(a, b)


def test_state_is_fp32_and_survives_state_dict_for_bf16_parameters():
    from hf_onebit.optim.onebit_lamb import OneBitLamb

    kwargs = dict(lr=1e-2, freeze_step=3)
    opt, model, _ = _run_local(kwargs, 5, dtype=torch.bfloat16)
    sd = opt.state_dict()
    fresh = OneBitLamb(model.parameters(), **kwargs)
    fresh.load_state_dict(sd)
    for p in model.parameters():
        for key in ("exp_avg", "exp_avg_sq", "exp_avg_sq_fresh", "coeff_frozen", "last_factor", "scaling"):
            assert fresh.state[p][key].dtype == torch.float32, key
            assert torch.equal(fresh.state[p][key], opt.state[p][key]), key
    assert fresh.state[model.ps[1]]["mask"].dtype == torch.bool  # masks are 1 byte per coordinate
    assert fresh.steps_done == 5 and fresh.phase() == "compression"


def test_the_fresh_variance_exists_only_where_the_frozen_ratio_reads_it():
    """With ``fresh_trust_ratio`` no ``v_fresh`` is kept (a model's worth of
    fp32); a checkpoint saved so resumes with the frozen ratio from ``v_fresh = v``, as at the freeze."""
    from hf_onebit.optim.onebit_lamb import OneBitLamb

    kwargs = dict(lr=1e-2, freeze_step=3, fresh_trust_ratio=True)
    opt, model, _ = _run_local(kwargs, 5)
    assert all("exp_avg_sq_fresh" not in opt.state[p] for p in model.parameters())
    switched = OneBitLamb(model.parameters(), **dict(kwargs, fresh_trust_ratio=False, defaults="paper"))
    switched.load_state_dict(opt.state_dict())
    for p, g in zip(model.parameters(), fixed_grads(6, 0)):
        p.grad = g
    frozen_v = {p: opt.state[p]["exp_avg_sq"].clone() for p in model.parameters()}
    switched.step()
    for p in model.parameters():
        st = switched.state[p]
        assert torch.isfinite(p).all() and not torch.equal(st["exp_avg_sq_fresh"], frozen_v[p])
        assert torch.equal(st["exp_avg_sq"], frozen_v[p])  # v stays frozen; v_fresh moved on from it


# ---------------------------------------------------------------- construction
def test_defaults_are_the_spec_defaults():
    from hf_onebit.optim.onebit_lamb import OneBitLamb

    opt = OneBitLamb([torch.nn.Parameter(torch.zeros(3))], defaults="paper")
    assert (opt.scale_per_tensor, opt.update_clip, opt.warmup_bits, opt.auto_freeze) == (False, None, None, None)
    d = opt.defaults
    assert (d["lr"], d["betas"], d["eps"], d["weight_decay"]) == (1e-3, (0.9, 0.999), 1e-8, 0.0)
    assert (d["max_coeff"], d["min_coeff"], d["coeff_beta"]) == (10.0, 0.01, 0.9)
    assert (d["factor_max"], d["factor_min"], d["factor_threshold"]) == (4.0, 0.5, 0.1)
    assert opt.freeze_step == 100000 and opt.phase() == "warmup"


@pytest.mark.parametrize("bad, match", [
    (dict(lr=-1.0), "lr"),
    (dict(eps=-1e-8), "eps"),
    (dict(weight_decay=-0.1), "weight_decay"),
    (dict(betas=(0.9, 1.0)), "betas"),
    (dict(betas=(-0.1, 0.999)), "betas"),
    (dict(betas=(0.9,)), "betas"),
    (dict(freeze_step=-1), "freeze_step"),
    (dict(freeze_step=2.5), "freeze_step"),
    (dict(min_coeff=0.0), "min_coeff"),
    (dict(min_coeff=2.0, max_coeff=1.0), "min_coeff must be <= max_coeff"),
    (dict(coeff_beta=1.0), "coeff_beta"),
    (dict(coeff_beta=-0.1), "coeff_beta"),
    (dict(factor_min=0.0), "factor_min"),
    (dict(factor_min=2.0, factor_max=1.0), "factor_min must be <= factor_max"),
    (dict(factor_threshold=-0.1), "factor_threshold"),
    (dict(factor_max=float("nan")), "factor_max"),
])
def test_bad_hyperparameters_are_refused(bad, match):
    from hf_onebit.optim.onebit_lamb import OneBitLamb

    with pytest.raises(ValueError, match=match):
        OneBitLamb([torch.nn.Parameter(torch.zeros(3))], **bad)


def test_bad_hyperparameters_in_a_param_group_are_refused():
    from hf_onebit.optim.onebit_lamb import OneBitLamb

    a, b = torch.nn.Parameter(torch.zeros(3)), torch.nn.Parameter(torch.zeros(3))
    with pytest.raises(ValueError, match="factor_min must be <= factor_max"):
        OneBitLamb([{"params": [a]}, {"params": [b], "factor_min": 5.0}])
    opt = OneBitLamb([a])
    with pytest.raises(ValueError, match="min_coeff"):
        opt.add_param_group({"params": [b], "min_coeff": 100.0})
    assert len(opt.param_groups) == 1


def test_hook_side_sends_scaled_momentum_and_returns_it_unscaled():
    # prepare_bucket / finish_bucket on one parameter, with a loss scale as under fp16 GradScaler
    from hf_onebit.optim.base import Plan

    opt, model, _ = _run_local(dict(lr=1e-2, freeze_step=3, betas=(0.8, 0.99)), 3)
    scalings = [float(opt.state[p]["scaling"]) for p in model.parameters()]
    rms = [float(opt.state[p]["exp_avg"].pow(2).mean().sqrt()) for p in model.parameters()]
    for s, r in zip(scalings, rms):  # scaling_p = mean_q RMS(m_q) / RMS(m_p)
        assert s == pytest.approx(np.mean(rms) / r, rel=1e-6)
    assert len(set(scalings)) > 1
    p, loss_scale = model.ps[3], 1024.0
    m = opt.state[p]["exp_avg"].clone()
    g = torch.randn(p.shape)
    out = torch.empty(p.numel())
    opt.prepare_bucket(Plan.COMPRESS_MOMENTUM, [p], [g * loss_scale], [out.view(p.shape)], 1 / loss_scale)
    torch.testing.assert_close(out, ((0.8 * m + 0.2 * g) * scalings[3]).reshape(-1), rtol=1e-6, atol=1e-7)
    grad = torch.empty(p.shape)
    opt.finish_bucket(Plan.COMPRESS_MOMENTUM, [p], [out.clone().view(p.shape)], [grad], loss_scale)
    torch.testing.assert_close(grad, (0.8 * m + 0.2 * g) * loss_scale, rtol=1e-6, atol=1e-5)


@pytest.mark.parametrize("world_size,width", [(2, 8), (3, 4)])
def test_b_bit_warmup_trajectory_matches_simulation_through_the_freeze(world_size, width):
    """warmup_bits: LAMB's warmup takes the gradient of spec §1b's exchange (per DDP bucket, error
    state per segment, forgotten at the freeze); the compression phase is the spec's."""
    steps, freeze = 14, 6
    kwargs = dict(lr=1e-2, weight_decay=0.01, freeze_step=freeze, scale_per_tensor=True, update_clip=1.0,
                  warmup_bits=width)
    outs = run_distributed(partial(train, record_steps=True), world_size, "OneBitLamb", kwargs, steps)
    layouts = [s["layout"] for s in outs[0]["steps"]]
    torch.manual_seed(0)
    init = [p.detach().numpy() for p in FixedGradModel().parameters()]
    sim = OneBitLambSimulation(init, world_size, outs[0]["segments"], lr=1e-2, weight_decay=0.01,
                               freeze_step=freeze, scale_per_tensor=True, update_clip=1.0, warmup_bits=width,
                               warmup_layouts=layouts)
    for step in range(1, steps + 1):
        expected = sim.step([[g.numpy() for g in fixed_grads(step, r)] for r in range(world_size)])
        for r in range(world_size):
            for got, want in zip(outs[r]["history"][step - 1], expected):
                np.testing.assert_allclose(got.numpy(), want, rtol=1e-5, atol=1e-5 * np.abs(want).max())
            for a, b in zip(outs[r]["history"][step - 1], outs[0]["history"][step - 1]):
                assert torch.equal(a, b)
    assert [s["plan"] for s in outs[0]["steps"]] == ["quantize_gradient"] * freeze + ["compress_momentum"] * (steps - freeze)
