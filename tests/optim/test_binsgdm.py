"""BinSGDM (spec §5): flat votes on 2 gloo ranks, hierarchical votes on 2 nodes of 2 ranks, and
the replay alone at the other world sizes and node layouts of ``tests/optim/world_sizes.py``.

The distributed runs are few and shared (module fixtures): each costs seconds of start-up.
They train :class:`tests.optim.harness.FixedGradModel` (gradients fixed per step and rank)
with a ``GradScaler`` and inject an infinite gradient on one rank at one iteration, and record
``.grad`` after every backward (the vote average ``q̄``), the parameters after every step and
the traffic counters. The checks compare them against :class:`VoteSimulation`, a float32 numpy
re-implementation of spec §5 written here, which replays the *documented* random streams
(Philox-4x64, key ``(seed, stream)``, counter ``[0, 0, param index, step]``; stream = rank for
worker votes, ``2**32 + node`` for node votes), and test unbiasedness statistically against the
exact ``z = m/(b+eps)`` of every rank, which depends on the gradients only. The statistical
checks (z-score of the summed deviation, variance ratio, both at 5 standard errors) would detect a
bias of about 0.01 in ``E[q̄]`` at these sizes (checked by planting one); the replay is exact.
"""

from __future__ import annotations

import math
import os

import numpy as np
import pytest
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from tests.distributed import run_distributed
from tests.optim.harness import FixedGradModel, fixed_grads
from tests.optim.world_sizes import NODE_LAYOUTS, WORLD_SIZES, node_env

SEED = 20231
NODE_STREAM = 2**32
STRATIFIED_STREAM = 2**33
KWARGS = dict(lr=0.05, beta=0.9, eps=1e-8, weight_decay=0.01, seed=SEED)
F32 = np.float32


# ------------------------------------------------------------------------------------------
# The independent simulation


def philox_uniform(seed: int, stream: int, step: int, index: int, n: int) -> np.ndarray:
    key = np.array([seed, stream], dtype=np.uint64)
    counter = np.array([0, 0, index, step], dtype=np.uint64)
    return np.random.Generator(np.random.Philox(key=key, counter=counter)).random(n, dtype=np.float32)


class VoteSimulation:
    """Spec §5 in float32 numpy for ``n`` ranks; ``local_size=k`` adds the hierarchical exchange."""

    def __init__(self, params, n, lr, beta, eps, weight_decay, seed, local_size=None, stratified=True):
        self.p = [np.array(x, dtype=F32) for x in params]
        self.n, self.lr, self.beta, self.eps, self.wd, self.seed = n, lr, beta, eps, weight_decay, seed
        self.k = local_size
        self.stratified = stratified
        self.m = [[np.zeros_like(x) for x in self.p] for _ in range(n)]
        self.b = [[np.zeros_like(x) for x in self.p] for _ in range(n)]
        self.t = 0

    def step(self, grads):
        """``grads[rank][param]``; returns (q̄ per param, z per rank per param) and updates p."""
        self.t += 1
        beta, one_minus = F32(self.beta), F32(1.0 - self.beta)
        qbars, zs = [], [[None] * len(self.p) for _ in range(self.n)]
        for j, p in enumerate(self.p):
            votes = []
            for r in range(self.n):
                g = np.asarray(grads[r][j], dtype=F32)
                self.m[r][j] = self.m[r][j] * beta + g * one_minus
                self.b[r][j] = self.b[r][j] * beta + np.abs(g) * one_minus
                z = self.m[r][j] / (self.b[r][j] + F32(self.eps))
                if self.eps == 0:
                    z = np.nan_to_num(z, nan=0.0)
                zs[r][j] = z
                u = self._uniform(r, j, p)
                votes.append(np.where(u < (z + F32(1)) * F32(0.5), F32(1), F32(-1)))
            if self.k is None:
                qbar = np.sum(votes, axis=0, dtype=F32) / F32(self.n)
            else:
                bits = []
                for node in range(self.n // self.k):
                    mu = np.sum(votes[node * self.k : (node + 1) * self.k], axis=0, dtype=F32) / F32(self.k)
                    u = self._uniform(None, j, p, node=node)
                    bits.append(np.where(u < (mu + F32(1)) * F32(0.5), F32(1), F32(-1)))
                qbar = np.sum(bits, axis=0, dtype=F32) / F32(len(bits))
            qbars.append(qbar)
            if self.wd:
                p = p * F32(1.0 - self.lr * self.wd)
            self.p[j] = p - qbar * F32(self.lr)
        return qbars, zs

    def _uniform(self, rank, j, p, node=None):
        """The uniforms of ``rank``'s vote (``rank=None``: of ``node``'s vote) for parameter ``j``:
        independent streams, or one stream shared by the group averaged together, shifted by the
        place in it (``stratified``)."""
        if not self.stratified:
            stream = rank if rank is not None else NODE_STREAM + node
            return philox_uniform(self.seed, stream, self.t, j, p.size).reshape(p.shape)
        if rank is None:
            stream, place, size = STRATIFIED_STREAM + NODE_STREAM, node, self.n // self.k
        elif self.k is None:
            stream, place, size = STRATIFIED_STREAM, rank, self.n
        else:
            stream, place, size = STRATIFIED_STREAM + rank // self.k, rank % self.k, self.k
        u = philox_uniform(self.seed, stream, self.t, j, p.size).reshape(p.shape) + F32(place / size)
        return u - np.trunc(u)


def _initial_params():
    torch.manual_seed(0)
    return [p.detach().numpy().copy() for p in FixedGradModel().parameters()]


def _grads(it, n, nan_at=None, nan_rank=None):
    out = []
    for r in range(n):
        g = fixed_grads(it, r)
        if it == nan_at and r == nan_rank:
            g[0][0, 0] = float("inf")
        out.append([x.numpy() for x in g])
    return out


# ------------------------------------------------------------------------------------------
# What every rank runs


def _build(kwargs, rank, resume_dir=None):
    import hf_onebit
    from hf_onebit.optim.binsgdm import BinSGDM

    torch.manual_seed(0)
    model = FixedGradModel()
    opt = BinSGDM(model.parameters(), **kwargs)
    scaler = torch.amp.GradScaler("cpu", init_scale=8.0, growth_interval=10**6)
    if resume_dir is not None:
        model.load_state_dict(torch.load(os.path.join(resume_dir, "model.pt"), weights_only=True))
        opt.load_state_dict(torch.load(os.path.join(resume_dir, "optimizer.pt"), weights_only=True))
        scaler.load_state_dict(torch.load(os.path.join(resume_dir, "scaler.pt"), weights_only=True))
    ddp = DDP(model, bucket_cap_mb=0.01)
    hf_onebit.attach(ddp, opt, grad_scaler=scaler)
    if resume_dir is not None:
        opt.load_rank_state_dict(torch.load(os.path.join(resume_dir, f"rank{rank}.pt"), weights_only=True))
    return model, ddp, opt, scaler


def _iterate(rank, model, ddp, opt, scaler, iterations, cfg):
    records = []
    for it in iterations:
        coeffs = fixed_grads(it, rank)
        if it == cfg.get("nan_at") and rank == cfg.get("nan_rank"):
            coeffs[0][0, 0] = float("inf")
        before = (opt.steps_done, opt.exchange.stats.snapshot())
        scaler.scale(ddp(coeffs)).backward()
        scale = scaler.get_scale()
        qbar = [p.grad.detach().clone() / scale for p in model.parameters()]
        scaler.step(opt)
        scaler.update()
        opt.zero_grad(set_to_none=True)
        comm = opt.exchange.stats.snapshot()
        records.append(dict(
            it=it, qbar=qbar, params=[p.detach().clone() for p in model.parameters()],
            stepped=opt.steps_done == before[0] + 1, steps_done=opt.steps_done,
            sent=comm.bytes_sent - before[1].bytes_sent, rounds=comm.rounds - before[1].rounds,
            calls=comm.calls - before[1].calls, fp32=comm.fp32_equivalent - before[1].fp32_equivalent,
            inter_sent=comm.inter_node_sent - before[1].inter_node_sent,
        ))
        if it == cfg.get("save_at"):
            d = cfg["save_dir"]
            if rank == 0:
                torch.save(model.state_dict(), os.path.join(d, "model.pt"))
                torch.save(opt.state_dict(), os.path.join(d, "optimizer.pt"))
                torch.save(scaler.state_dict(), os.path.join(d, "scaler.pt"))
            torch.save(opt.rank_state_dict(), os.path.join(d, f"rank{rank}.pt"))
            dist.barrier()
    return records


def _vote_worker(rank, world_size, cfg):
    from hf_onebit.optim.binsgdm import BinSGDM

    out = {}
    if cfg.get("check_hierarchical_error"):
        try:
            BinSGDM(FixedGradModel().parameters(), hierarchical=True)
        except ValueError as exc:
            out["hierarchical_error"] = str(exc)
    iters = range(cfg.get("first", 1), cfg["last"] + 1)
    model, ddp, opt, scaler = _build(cfg["kwargs"], rank, cfg.get("resume_dir"))
    out["records"] = _iterate(rank, model, ddp, opt, scaler, iters, cfg)
    out["hierarchical"] = opt.exchange.vote_collective().hierarchical
    out["state_keys"] = sorted({k for s in opt.state_dict()["state"].values() for k in s})
    if cfg.get("bf16_iters"):  # bf16 parameters and buckets, no GradScaler
        import hf_onebit
        from hf_onebit.optim.binsgdm import BinSGDM

        torch.manual_seed(0)
        model = FixedGradModel().to(torch.bfloat16)
        opt = BinSGDM(model.parameters(), **cfg["kwargs"])
        ddp16 = DDP(model, bucket_cap_mb=0.01)
        hf_onebit.attach(ddp16, opt)
        recs = []
        for it in range(1, cfg["bf16_iters"] + 1):
            coeffs = [c.to(torch.bfloat16) for c in fixed_grads(it, rank)]
            if it == cfg["bf16_nan_at"] and rank == 1:
                coeffs[0][0, 0] = float("inf")
            ddp16(coeffs).backward()
            qbar = [p.grad.detach().clone() for p in model.parameters()]
            skip = not all(bool(q.isfinite().all()) for q in qbar)  # skipped by hand, no GradScaler
            if not skip:
                opt.step()
            opt.zero_grad(set_to_none=True)
            recs.append(dict(qbar=qbar, params=[p.detach().clone() for p in model.parameters()], skipped=skip))
        out["bf16"] = recs
    if cfg.get("resume_in_process"):
        del ddp
        model, ddp, opt, scaler = _build(cfg["kwargs"], rank, cfg["save_dir"])
        rest = range(cfg["save_at"] + 1, cfg["last"] + 1)
        out["resumed"] = _iterate(rank, model, ddp, opt, scaler, rest, {**cfg, "save_at": None})
    return out


# ------------------------------------------------------------------------------------------
# Shared runs

FLAT = dict(kwargs=KWARGS, last=40, nan_at=6, nan_rank=1, save_at=3, check_hierarchical_error=True,
            bf16_iters=5, bf16_nan_at=2)
HIER = dict(kwargs=KWARGS, last=30, nan_at=5, nan_rank=2, save_at=3, resume_in_process=True)


@pytest.fixture(scope="module")
def flat_run(tmp_path_factory):
    d = str(tmp_path_factory.mktemp("binsgdm_flat"))
    # LOCAL_WORLD_SIZE == world size: one node, so auto mode stays flat and True is refused.
    return run_distributed(_vote_worker, 2, {**FLAT, "save_dir": d}, env={"LOCAL_WORLD_SIZE": "2"}), d


@pytest.fixture(scope="module")
def hier_run(tmp_path_factory):
    d = str(tmp_path_factory.mktemp("binsgdm_hier"))
    return run_distributed(_vote_worker, 4, {**HIER, "save_dir": d}, env={"LOCAL_WORLD_SIZE": "2"})


def _simulate(cfg, n, local_size=None):
    """Replay the run: skipped iterations (the injected inf) change nothing."""
    kw = cfg["kwargs"]
    sim = VoteSimulation(_initial_params(), n, kw["lr"], kw["beta"], kw["eps"], kw["weight_decay"], kw["seed"],
                         local_size, stratified=kw.get("stratified_votes", True))
    out = {}
    for it in range(1, cfg["last"] + 1):
        if it == cfg["nan_at"]:
            continue
        qbars, zs = sim.step(_grads(it, n))
        out[it] = (qbars, zs, [p.copy() for p in sim.p])
    return out


def _check_against_simulation(outs, cfg, n, local_size=None, key="records"):
    expected = _simulate(cfg, n, local_size)
    for r in range(n):
        for rec in outs[r][key]:
            it = rec["it"]
            for a, b in zip(rec["params"], outs[0][key][rec["it"] - outs[0][key][0]["it"]]["params"]):
                assert torch.equal(a, b), f"rank {r} differs from rank 0 after iteration {it}"
            if it == cfg["nan_at"]:
                continue
            qbars, _, params = expected[it]
            for j, (got_q, want_q, got_p, want_p) in enumerate(zip(rec["qbar"], qbars, rec["params"], params)):
                np.testing.assert_array_equal(got_q.numpy(), want_q, err_msg=f"q̄ of param {j}, iteration {it}")
                np.testing.assert_array_equal(got_p.numpy(), want_p, err_msg=f"param {j}, iteration {it}")
    return expected


def _unbiasedness(outs, expected, cfg, n, local_size=None):
    """Z-score of Σ(q̄ - z̄) and the ratio Σ(q̄ - z̄)² / ΣVar[q̄] over all elements and steps, ``Var``
    that of independent votes: about 1 for them, well below 1 for stratified votes (which vary
    less; the z-score is then conservative)."""
    diff = sq = var = 0.0
    for rec in outs[0]["records"]:
        if rec["it"] == cfg["nan_at"]:
            continue
        _, zs, _ = expected[rec["it"]]
        for j, q in enumerate(rec["qbar"]):
            z = np.stack([zs[r][j] for r in range(n)]).astype(np.float64)
            zbar = z.mean(0)
            if local_size is None:
                v = (1 - z**2).sum(0) / n**2
            else:  # one stochastic bit per node: Var = 1 - (node mean of z)²
                mu = z.reshape(n // local_size, local_size, *z.shape[1:]).mean(1)
                v = (1 - mu**2).sum(0) / (n // local_size) ** 2
            d = q.numpy().astype(np.float64) - zbar
            diff += d.sum()
            sq += (d**2).sum()
            var += v.sum()
    z_score = diff / math.sqrt(var)
    ratio = sq / var
    # (q̄ - z̄)² <= 4, so Var[Σ(q̄ - z̄)²] <= 4·ΣVar: the ratio's standard error is <= 2/sqrt(ΣVar).
    assert abs(z_score) < 5, f"mean vote is biased: z-score {z_score:.2f} over total variance {var:.0f}"
    if cfg["kwargs"].get("stratified_votes", True):
        assert ratio < 1 - 5 * 2 / math.sqrt(var), f"stratified votes do not vary less: ratio {ratio:.4f}, ΣVar {var:.0f}"
    else:
        assert abs(ratio - 1) < 5 * 2 / math.sqrt(var), f"vote variance off: ratio {ratio:.4f}, ΣVar {var:.0f}"
    return z_score, ratio


# ------------------------------------------------------------------------------------------
# Flat, 2 ranks


def test_flat_identical_on_all_ranks_and_equal_to_the_simulation(flat_run):
    outs, _ = flat_run
    assert not outs[0]["hierarchical"]
    _check_against_simulation(outs, FLAT, 2)
    for rec in outs[0]["records"]:
        if rec["stepped"]:
            for q in rec["qbar"]:
                assert set(q.unique().tolist()) <= {-1.0, 0.0, 1.0}  # means of two ±1 votes
    # per-rank tensors are not in state_dict(): it holds what every rank shares
    assert outs[0]["state_keys"] == []


def test_flat_votes_are_unbiased(flat_run):
    outs, _ = flat_run
    expected = _simulate(FLAT, 2)
    _unbiasedness(outs, expected, FLAT, 2)


def test_nonfinite_gradient_on_one_rank_skips_the_step_on_every_rank(flat_run):
    outs, _ = flat_run
    for r in range(2):
        recs = {rec["it"]: rec for rec in outs[r]["records"]}
        bad = recs[FLAT["nan_at"]]
        assert not bad["stepped"]
        # the bucket holding parameter 0 voted NaN everywhere; the step was skipped by GradScaler
        assert torch.isnan(bad["qbar"][0]).all()
        for a, b in zip(bad["params"], recs[FLAT["nan_at"] - 1]["params"]):
            assert torch.equal(a, b)
        assert recs[FLAT["last"]]["steps_done"] == FLAT["last"] - 1


def test_flat_traffic_is_one_bit_per_element_per_rank(flat_run):
    outs, _ = flat_run
    n = 2
    numel = sum(p.size for p in _initial_params())
    for rec in outs[0]["records"][1:]:  # after DDP's first-iteration bucket layout
        calls = rec["calls"]
        assert calls > 1 and rec["rounds"] == calls  # one all-gather per bucket
        bits = 8 * (rec["sent"] / (n - 1) - 4 * calls)  # minus the fp32 flags
        assert numel <= bits <= numel + 7 * calls
        assert rec["fp32"] == 4 * numel  # allreduce_bytes(4·N, 2) summed over buckets


def test_bf16_parameters_vote_and_update_in_fp32(flat_run):
    outs, _ = flat_run
    kw = KWARGS
    sim = VoteSimulation(_initial_params(), 2, kw["lr"], kw["beta"], kw["eps"], kw["weight_decay"], kw["seed"])
    torch.manual_seed(0)
    p = [x.detach().to(torch.bfloat16) for x in FixedGradModel().parameters()]
    for it, (rec0, rec1) in enumerate(zip(outs[0]["bf16"], outs[1]["bf16"]), start=1):
        # an infinite gradient on rank 1 makes the vote NaN on both ranks; the step is skipped by
        # hand and the retried hook for the same step is admitted (no "hook ran twice" error)
        assert rec0["skipped"] == rec1["skipped"] == (it == FLAT["bf16_nan_at"])
        if rec0["skipped"]:
            assert torch.isnan(rec0["qbar"][0]).all() and torch.isnan(rec1["qbar"][0]).all()
            continue
        grads = [[c.to(torch.bfloat16).float().numpy() for c in fixed_grads(it, r)] for r in range(2)]
        qbars, _ = sim.step(grads)  # m, b, z in fp32 from the bf16 gradients
        for j, (a, b) in enumerate(zip(rec0["params"], rec1["params"])):
            assert a.dtype == torch.bfloat16 and torch.equal(a, b)
            np.testing.assert_array_equal(rec0["qbar"][j].float().numpy(), qbars[j])
            # the update is computed in fp32 and rounded to bf16 once
            want = p[j].float() * F32(1 - kw["lr"] * kw["weight_decay"]) - torch.from_numpy(qbars[j]) * F32(kw["lr"])
            p[j] = want.to(torch.bfloat16)
            assert torch.equal(a, p[j])


def test_resume_in_new_processes_continues_bitwise(flat_run):
    outs, d = flat_run
    cfg = {**FLAT, "resume_dir": d, "first": FLAT["save_at"] + 1, "save_at": None, "check_hierarchical_error": False}
    resumed = run_distributed(_vote_worker, 2, cfg, env={"LOCAL_WORLD_SIZE": "2"})
    for r in range(2):
        full = {rec["it"]: rec for rec in outs[r]["records"]}
        for rec in resumed[r]["records"]:
            assert rec["stepped"] == full[rec["it"]]["stepped"]
            for a, b in zip(rec["params"], full[rec["it"]]["params"]):
                assert torch.equal(a, b), f"rank {r}, iteration {rec['it']}"


def test_hierarchical_true_needs_nodes(flat_run):
    outs, _ = flat_run
    msg = outs[0]["hierarchical_error"]
    assert "LOCAL_WORLD_SIZE" in msg and "world size" in msg


# ------------------------------------------------------------------------------------------
# Hierarchical, 4 ranks = 2 nodes of 2


def test_hierarchical_identical_on_all_ranks_and_equal_to_the_simulation(hier_run):
    outs = hier_run
    assert all(o["hierarchical"] for o in outs)
    _check_against_simulation(outs, HIER, 4, local_size=2)
    for r in range(4):
        bad = next(rec for rec in outs[r]["records"] if rec["it"] == HIER["nan_at"])
        assert not bad["stepped"] and torch.isnan(bad["qbar"][0]).all()


def test_hierarchical_votes_are_unbiased(hier_run):
    expected = _simulate(HIER, 4, local_size=2)
    _unbiasedness(hier_run, expected, HIER, 4, local_size=2)


def test_hierarchical_inter_node_traffic_is_one_bit_per_element_per_node(hier_run):
    outs = hier_run
    k, nodes = 2, 2
    numel = sum(p.size for p in _initial_params())
    for i in range(1, len(outs[0]["records"])):
        for node in range(nodes):
            recs = [outs[node * k + j]["records"][i] for j in range(k)]
            calls = recs[0]["calls"]
            assert calls > 1 and all(r["calls"] == calls for r in recs)
            assert recs[0]["inter_sent"] == recs[1]["inter_sent"]  # the node's ranks share the load
            assert all(r["rounds"] == 3 * calls for r in recs)
            node_bytes = sum(r["inter_sent"] for r in recs) / (nodes - 1)  # sent to each other node
            bits = 8 * (node_bytes - 4 * k * calls)  # minus one fp32 flag per rank and bucket
            assert numel <= bits <= numel + (8 * k - 1) * calls
            assert recs[0]["fp32"] == 6 * numel  # allreduce_bytes(4·N, 4) summed over buckets


def test_hierarchical_false_on_several_nodes_votes_flat_and_sends_more_between_nodes(hier_run):
    outs = run_distributed(_vote_worker, 4, dict(kwargs={**KWARGS, "hierarchical": False}, last=3), env=node_env(2))
    assert not any(o["hierarchical"] for o in outs)
    flat, by_node = outs[0]["records"][2], hier_run[0]["records"][2]  # iteration 3 of both
    assert flat["calls"] == by_node["calls"] and flat["fp32"] == by_node["fp32"]
    # flat: half of each rank's (n-1)/8 bytes per element leave the node; by node (M-1)/(8k)
    assert flat["inter_sent"] > 2.5 * by_node["inter_sent"] > 0


def test_hierarchical_resume_continues_bitwise(hier_run):
    for r in range(4):
        full = {rec["it"]: rec for rec in hier_run[r]["records"]}
        for rec in hier_run[r]["resumed"]:
            assert rec["stepped"] == full[rec["it"]]["stepped"]
            for a, b in zip(rec["params"], full[rec["it"]]["params"]):
                assert torch.equal(a, b), f"rank {r}, iteration {rec['it']}"


# ------------------------------------------------------------------------------------------
# Other world sizes and node layouts: the replay (2 ranks and 2 nodes of 2 are the shared runs above)

SIZED = dict(kwargs=KWARGS, last=8, nan_at=None)
INDEPENDENT = dict(SIZED, kwargs=dict(KWARGS, stratified_votes=False), last=20)  # the paper's votes


def _check_vote_values(outs, voters):
    """Every q̄ is a mean of ``voters`` ±1 votes: ``voters·(q̄ + 1)/2`` is a whole number in [0, voters]
    (up to q̄'s fp32 rounding, e.g. of 1/3)."""
    for rec in outs[0]["records"]:
        for q in rec["qbar"]:
            ups = (q.double() + 1) * voters / 2
            assert (ups - ups.round()).abs().max() < 1e-5 and 0 <= ups.min() and ups.max() <= voters + 1e-5, rec["it"]


@pytest.mark.parametrize("world_size", [w for w in WORLD_SIZES if w != 2])
def test_flat_votes_replay_the_simulation_at_every_world_size(world_size):
    outs = run_distributed(_vote_worker, world_size, SIZED, env=node_env(world_size))  # one node: flat
    assert not any(o["hierarchical"] for o in outs)
    _check_against_simulation(outs, SIZED, world_size)
    _check_vote_values(outs, world_size)


def test_independent_votes_replay_the_simulation_with_the_binomial_variance():
    outs = run_distributed(_vote_worker, 3, INDEPENDENT, env=node_env(3))
    _check_against_simulation(outs, INDEPENDENT, 3)
    _unbiasedness(outs, _simulate(INDEPENDENT, 3), INDEPENDENT, 3)


@pytest.mark.parametrize("nodes,local_size", [p for p in NODE_LAYOUTS if p.values != (2, 2)])
def test_hierarchical_votes_replay_the_simulation_at_every_node_layout(nodes, local_size):
    n = nodes * local_size
    outs = run_distributed(_vote_worker, n, SIZED, env=node_env(local_size))
    assert all(o["hierarchical"] for o in outs)
    _check_against_simulation(outs, SIZED, n, local_size=local_size)
    _check_vote_values(outs, nodes)  # one vote per node


# ------------------------------------------------------------------------------------------
# One process (no torch.distributed): the algorithm with n = 1


def _single_process(kwargs, steps, start=None):
    from hf_onebit.optim.binsgdm import BinSGDM

    torch.manual_seed(0)
    model = FixedGradModel()
    opt = BinSGDM(model.parameters(), **kwargs)
    if start is not None:
        model.load_state_dict(start[0])
        opt.load_state_dict(start[1])
        opt.load_rank_state_dict(start[2])
    history = []
    for step in steps:
        for p, g in zip(model.parameters(), fixed_grads(step, 0)):
            p.grad = g.clone()
        opt.step()
        history.append([p.detach().clone() for p in model.parameters()])
    return model, opt, history


def test_single_process_is_the_local_vote_and_resumes_bitwise(tmp_path):
    _, opt, history = _single_process(KWARGS, range(1, 7))
    assert opt.phase() == "local"
    sim = VoteSimulation(_initial_params(), 1, **{k: KWARGS[k] for k in ("lr", "beta", "eps", "weight_decay", "seed")})
    for step, got in zip(range(1, 7), history):
        sim.step(_grads(step, 1))
        for a, b in zip(got, sim.p):
            np.testing.assert_array_equal(a.numpy(), b)
    # resume from step 3 through files read with weights_only=True
    _, opt3, _ = _single_process(KWARGS, range(1, 4))
    torch.save(opt3.rank_state_dict(), tmp_path / "rank0.pt")
    torch.save(opt3.state_dict(), tmp_path / "opt.pt")
    start = (dict(zip([f"ps.{i}" for i in range(5)], [p.clone() for p in history[2]])),
             torch.load(tmp_path / "opt.pt", weights_only=True), torch.load(tmp_path / "rank0.pt", weights_only=True))
    _, _, rest = _single_process({**KWARGS, "seed": 999}, range(4, 7), start)  # the saved seed wins
    for a, b in zip(rest[-1], history[-1]):
        assert torch.equal(a, b)


def test_fixed_ratio_votes_average_to_the_ratio():
    """With g = 0 and eps = 0, m/b stays fixed at z0: the mean vote over many steps -> z0."""
    from hf_onebit.optim.binsgdm import BinSGDM

    z0 = torch.linspace(-0.95, 0.95, 2001)
    p = torch.nn.Parameter(torch.zeros(2001))
    opt = BinSGDM([p], lr=1.0, beta=0.99, eps=0.0, seed=5)
    p.grad = torch.zeros(2001)
    opt.step()  # materialise the state, then overwrite m and b through the per-rank state API
    state = opt.rank_state_dict()
    b = torch.linspace(0.5, 2.0, 2001)
    state["binsgdm"]["params"][0] = {"momentum": z0 * b, "abs_momentum": b}
    opt.load_rank_state_dict(state)
    start = p.detach().clone()
    steps = 400
    for _ in range(steps):
        p.grad = torch.zeros(2001)
        opt.step()
    mean_vote = ((start - p.detach()) / steps).double()  # lr = 1, wd = 0: p moves by -q each step
    se = ((1 - z0.double() ** 2) / steps).sqrt()
    standardized = (mean_vote - z0.double()) / se
    assert standardized.abs().max() < 5.5
    assert abs(standardized.mean()) < 5 / math.sqrt(2001)
    assert abs((standardized**2).mean() - 1) < 5 * math.sqrt(2 / 2001)


def test_construction_errors():
    from hf_onebit.optim.binsgdm import BinSGDM

    params = [torch.nn.Parameter(torch.zeros(3))]
    for kwargs, exc, text in [
        (dict(lr=-1.0), ValueError, "lr"),
        (dict(beta=1.0), ValueError, "beta"),
        (dict(beta=-0.1), ValueError, "beta"),
        (dict(beta=(0.9, 0.999)), TypeError, "single momentum coefficient"),
        (dict(eps=-1e-8), ValueError, "eps"),
        (dict(weight_decay=-0.1), ValueError, "weight_decay"),
        (dict(hierarchical="auto"), TypeError, "hierarchical"),
        (dict(hierarchical=1), TypeError, "hierarchical"),
        (dict(seed=-1), ValueError, "seed"),
        (dict(seed=1.5), ValueError, "seed"),
        (dict(seed=2**64), ValueError, "seed"),
        (dict(seed=True), ValueError, "seed"),
    ]:
        with pytest.raises(exc, match=text):
            BinSGDM(params, **kwargs)
    with pytest.raises(TypeError):
        BinSGDM(params, betas=(0.9, 0.999))
    with pytest.raises(ValueError, match="sparse"):
        BinSGDM([torch.nn.Parameter(torch.zeros(3).to_sparse())])
