"""Parameters stored channels_last (or as a transposed view) train exactly like contiguous ones.

DDP lays a bucket out in each parameter's *memory* order (it matches the parameter's strides);
the optimizers' state and the compression work in *logical* order. Every optimizer, through
its phase changes, on 2 gloo ranks: the parameters after every step must be bitwise equal
between a model whose parameters are contiguous and the same values stored channels_last.

The loss is ``Σ_k (p_k · c_k).sum()`` with fixed coefficients (as in ``harness.py``), so every
gradient is exactly ``c_k`` whatever the layout: a real conv's backward picks other kernels for
channels_last and rounds differently, which would hide what the optimizer does.
"""

from __future__ import annotations

import pytest
import torch
from torch.nn.parallel import DistributedDataParallel as DDP

from tests.distributed import run_distributed


class ConvModel(torch.nn.Module):
    """A small conv net's parameters plus a transposed (non-contiguous) matrix."""

    def __init__(self, transposed: bool) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.conv1 = torch.nn.Conv2d(3, 8, 3)
        self.conv2 = torch.nn.Conv2d(8, 6, 3, bias=False)
        self.conv3 = torch.nn.Conv2d(6, 5, 1)
        w = torch.randn(7, 12)
        self.proj = torch.nn.Parameter(w.t() if transposed else w.t().contiguous())

    def forward(self, coeffs):
        return sum((p * c).sum() for p, c in zip(self.parameters(), coeffs))


def _coeffs(model, step, rank):
    g = torch.Generator().manual_seed(1009 * step + 7 * rank)
    return [torch.randn(p.shape, generator=g) * (1 + rank) for p in model.parameters()]


def train_layout(rank, world_size, opt_name, kwargs, steps, channels_last):
    import hf_onebit

    model = ConvModel(transposed=channels_last)
    if channels_last:
        model = model.to(memory_format=torch.channels_last)
        assert model.conv1.weight.is_contiguous(memory_format=torch.channels_last)
        assert not model.conv1.weight.is_contiguous() and not model.proj.is_contiguous()
    opt = getattr(hf_onebit, opt_name)(model.parameters(), **{"defaults": "paper", **kwargs})  # the spec's
    ddp = DDP(model, bucket_cap_mb=0.001)
    hf_onebit.attach(ddp, opt)
    history, plans = [], []
    for step in range(1, steps + 1):
        plans.append(opt.plan().value)
        ddp(_coeffs(model, step, rank)).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        history.append([p.detach().contiguous().clone() for p in model.parameters()])
    return {"history": history, "plans": plans}


CASES = {
    "OneBitAdam": dict(lr=1e-2, freeze_step=2),
    "OneBitAdam-per-tensor": dict(lr=1e-2, freeze_step=2, scale_per_tensor=True),
    "OneBitLamb": dict(lr=1e-2, freeze_step=2, weight_decay=0.01),
    "ZeroOneAdam": dict(lr=1e-2, var_freeze_step=3, var_update_scaler=1, local_step_scaler=2, local_step_clipper=4),
    "BinSGDM": dict(lr=1e-2),
}


@pytest.mark.parametrize("case", list(CASES))
def test_channels_last_trains_bitwise_like_contiguous(case):
    name = case.split("-")[0]
    steps = 8
    plain = run_distributed(train_layout, 2, name, CASES[case], steps, False)
    strided = run_distributed(train_layout, 2, name, CASES[case], steps, True)
    assert len(set(plain[0]["plans"])) >= (1 if name == "BinSGDM" else 2)  # phase changes were crossed
    for rank in range(2):
        assert strided[rank]["plans"] == plain[rank]["plans"]
        for step, (a, b) in enumerate(zip(plain[rank]["history"], strided[rank]["history"]), 1):
            for k, (x, y) in enumerate(zip(a, b)):
                assert torch.equal(x, y), (
                    f"rank {rank} step {step} ({plain[rank]['plans'][step - 1]}) parameter {k}:"
                    f" max difference {(x - y).abs().max().item():.3g}"
                )
    for step in range(steps):  # the synced plans leave ranks identical (0/1 Adam's local steps do not)
        if plain[0]["plans"][step] in ("allreduce", "compress_momentum", "vote"):
            assert all(torch.equal(x, y) for x, y in zip(plain[0]["history"][step], plain[1]["history"][step]))


# ---------------------------------------------------------------- the property test over layouts
# One 2-rank run per optimizer trains, with gradients fixed by the test (loss Σ (p·c).sum()):
#
# * "mixed": a channels_last 4-d weight, a bias, a transposed (non-contiguous) matrix, an empty
#   (0, 4) parameter and a weight *tied* between two modules (model.parameters() and DDP see it
#   once; its gradient is the sum of the two uses' coefficients, exactly);
# * "plain": the same values, contiguous, without the empty parameter, the tied weight used once
#   with the summed coefficient. Every non-empty parameter is its own DDP bucket (1-byte cap; the
#   empty one joins a neighbour's bucket without changing its contents), so compression scales
#   see the same numbers in both: "mixed" must train every parameter bitwise like "plain";
# * "frozen": "plain" with one parameter frozen mid-run the way stage-wise fine-tuning does it
#   (requires_grad_(False), a new DDP, hf_onebit.attach again with the same optimizer), against
#   "rebuilt": the same DDP rebuild without freezing. With one bucket per parameter the other
#   parameters do not depend on the frozen one, so they must train bitwise alike;
# * "frozen_from_start": the optimizer built over every parameter, one with requires_grad=False;
# * "no_rebuild": a parameter frozen between steps without touching DDP: its bucket never
#   completes, so DDP keeps other parameters' gradients local; step() must refuse at once,
#   before any state changes (it used to apply the unexchanged gradients silently).
#
# OneBitAdam and BinSGDM "mixed" runs are also compared with the independent simulations.

ROLES = [("conv", (8, 6, 3, 3)), ("bias", (8,)), ("mat", (20, 12)), ("empty", (0, 4)), ("emb", (16, 10)),
         ("vec", (300,))]
MIXED_ORDER = ["conv", "bias", "mat", "empty", "emb", "vec"]  # optimizer order (the tied weight once)
PLAIN_ORDER = ["conv", "bias", "mat", "emb", "vec"]
FROZEN = "mat"  # frozen mid-run (index 2 in both orders)
NO_REBUILD_FROZEN = "vec"  # the last parameter: its bucket is the one DDP launches first
TINY_BUCKETS = 1e-6  # MB: every non-empty parameter its own bucket


class Use(torch.nn.Module):
    """One use of a weight: ``(weight · c).sum()``; two ``Use``s may share one Parameter."""

    def __init__(self, weight: torch.nn.Parameter) -> None:
        super().__init__()
        self.weight = weight

    def forward(self, c):
        return (self.weight * c).sum()


def _values():
    g = torch.Generator().manual_seed(5)
    return {name: torch.randn(shape, generator=g) for name, shape in ROLES}


class MixedModel(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        v = _values()
        self.conv = Use(torch.nn.Parameter(v["conv"].contiguous(memory_format=torch.channels_last)))
        self.bias = Use(torch.nn.Parameter(v["bias"].clone()))
        self.mat = Use(torch.nn.Parameter(v["mat"].t().contiguous().t()))  # a transposed view
        self.empty = Use(torch.nn.Parameter(v["empty"].clone()))
        self.enc = Use(torch.nn.Parameter(v["emb"].clone()))
        self.vec = Use(torch.nn.Parameter(v["vec"].clone()))
        self.dec = Use(self.enc.weight)  # tied: registered twice, a parameter once

    def forward(self, cs):
        return (self.conv(cs["conv"]) + self.bias(cs["bias"]) + self.mat(cs["mat"]) + self.empty(cs["empty"])
                + self.enc(cs["emb_in"]) + self.vec(cs["vec"]) + self.dec(cs["emb_out"]))


class PlainModel(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        v = _values()
        for name in PLAIN_ORDER:
            setattr(self, name, Use(torch.nn.Parameter(v[name].clone())))

    def forward(self, cs):
        return sum(getattr(self, name)(cs["emb_in"] + cs["emb_out"] if name == "emb" else cs[name])
                   for name in PLAIN_ORDER)


def role_coeffs(step: int, rank: int) -> dict:
    g = torch.Generator().manual_seed(7919 * step + 104729 * (rank + 1))
    shapes = dict(ROLES)
    out = {}
    for name in ["conv", "bias", "mat", "empty", "emb_in", "emb_out", "vec"]:
        out[name] = torch.randn(shapes.get(name, shapes["emb"]), generator=g) * (0.5 + rank)
    return out


def role_grads(step: int, rank: int, order) -> list:
    """The gradient of every parameter of ``order`` (the tied weight: the sum of both uses)."""
    cs = role_coeffs(step, rank)
    cs["emb"] = cs["emb_in"] + cs["emb_out"]
    return [cs[name] for name in order]


def _snapshot_state(opt, p) -> dict:
    return {k: (v.clone() if isinstance(v, torch.Tensor) else v) for k, v in opt.state.get(p, {}).items()}


def _train(opt_name, kwargs, model, steps, rank, freeze_at=None, frozen=None, rebuild_at=None):
    import hf_onebit

    opt = getattr(hf_onebit, opt_name)(model.parameters(), **{"defaults": "paper", **kwargs})  # the spec's
    ddp = DDP(model, bucket_cap_mb=TINY_BUCKETS)
    hf_onebit.attach(ddp, opt)
    params = list(model.parameters())
    out = {"history": [], "plans": [], "frozen_state": None, "end_state": None}
    for step in range(1, steps + 1):
        if step == rebuild_at:
            if step == freeze_at:
                frozen.requires_grad_(False)
                out["frozen_state"] = _snapshot_state(opt, frozen)
            ddp = DDP(model, bucket_cap_mb=TINY_BUCKETS)
            hf_onebit.attach(ddp, opt)  # the same optimizer, its state kept
        out["plans"].append(opt.plan().value)
        ddp(role_coeffs(step, rank)).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        out["history"].append([p.detach().contiguous().clone() for p in params])
    out["segments"] = sorted(opt.exchange.segments.keys())
    if frozen is not None:
        out["end_state"] = _snapshot_state(opt, frozen)
    return out


def _freeze_without_rebuild(opt_name, kwargs, rank, at):
    """Freeze a parameter between steps, DDP untouched: step() must refuse, changing nothing."""
    import hf_onebit

    model = PlainModel()
    opt = getattr(hf_onebit, opt_name)(model.parameters(), **{"defaults": "paper", **kwargs})  # the spec's
    ddp = DDP(model, bucket_cap_mb=TINY_BUCKETS)
    hf_onebit.attach(ddp, opt)
    for step in range(1, at + 1):
        if step == at:
            getattr(model, NO_REBUILD_FROZEN).weight.requires_grad_(False)
            before = [p.detach().clone() for p in model.parameters()]
            states = [_snapshot_state(opt, p) for p in model.parameters()]
            steps_done = opt.steps_done
        ddp(role_coeffs(step, rank)).backward()
        try:
            opt.step()
        except RuntimeError as exc:
            unchanged = all(torch.equal(a, p) for a, p in zip(before, model.parameters())) and opt.steps_done == steps_done
            unchanged = unchanged and all(_same_state(s, _snapshot_state(opt, p)) for s, p in zip(states, model.parameters()))
            return {"error": str(exc), "step": step, "unchanged": unchanged}
        opt.zero_grad(set_to_none=True)
    return {"error": None, "step": at, "unchanged": None}


def _same_state(a: dict, b: dict, keys=None) -> bool:
    for k in (keys if keys is not None else set(a) | set(b)):
        if k not in a or k not in b:
            return False
        x, y = a[k], b[k]
        if isinstance(x, torch.Tensor):
            if not torch.equal(x, y):
                return False
        elif x != y:
            return False
    return True


def layout_property_run(rank, world_size, opt_name, kwargs, steps, freeze_at):
    """Every scenario of one optimizer; a scenario that raises is returned as its traceback, so
    that only the tests reading it fail."""
    import traceback

    def frozen_mid_run():
        m = PlainModel()
        return _train(opt_name, kwargs, m, steps, rank, freeze_at, getattr(m, FROZEN).weight, freeze_at)

    def frozen_from_start():
        m = PlainModel()
        getattr(m, FROZEN).weight.requires_grad_(False)
        return _train(opt_name, kwargs, m, steps, rank, frozen=getattr(m, FROZEN).weight)

    scenarios = {
        "mixed": lambda: _train(opt_name, kwargs, MixedModel(), steps, rank),
        "plain": lambda: _train(opt_name, kwargs, PlainModel(), steps, rank),
        "frozen": frozen_mid_run,
        "rebuilt": lambda: _train(opt_name, kwargs, PlainModel(), steps, rank, rebuild_at=freeze_at),
        "frozen_from_start": frozen_from_start,
        "no_rebuild": lambda: _freeze_without_rebuild(opt_name, kwargs, rank, 3),
    }
    out = {}
    for key, run in scenarios.items():
        try:
            out[key] = run()
        except Exception:  # noqa: BLE001 - reported by the tests that read this scenario
            out[key] = traceback.format_exc()
    return out


PROPERTY_CASES = {  # (kwargs, the step before which a parameter is frozen: after a phase change)
    "OneBitAdam": (dict(lr=1e-2, freeze_step=2, weight_decay=0.01), 5),
    "OneBitLamb": (dict(lr=1e-2, freeze_step=2, weight_decay=0.01), 5),
    # variance steps 1, 2; a 1-bit step 3; syncs at 4, 5, 6 and 8 (6: the first with the frozen one)
    "ZeroOneAdam": (dict(lr=1e-2, var_freeze_step=3, var_update_scaler=1, local_step_scaler=2,
                         local_step_clipper=4), 6),
    "BinSGDM": (dict(lr=1e-2, weight_decay=0.01), 5),
}
PROPERTY_STEPS = 8
SYNCED = ("allreduce", "compress_momentum", "compress_gradient", "sync_after_step", "vote")


def _assert_equal(a, b, where):
    assert a.shape == b.shape and torch.equal(a, b), (
        f"{where}: max difference {(a - b).abs().max().item() if a.numel() else 0:.3g}")


def every_optimizer(rank, world_size, steps):
    """All optimizers in one pair of processes (start-up and kernel compilation paid once)."""
    out = {}
    for name, (kwargs, freeze_at) in PROPERTY_CASES.items():
        out[name] = layout_property_run(rank, world_size, name, kwargs, steps, freeze_at)
    return out


@pytest.fixture(scope="module")
def property_runs():
    return run_distributed(every_optimizer, 2, PROPERTY_STEPS, timeout=400, pg_timeout=60)


@pytest.fixture(params=list(PROPERTY_CASES))
def property_run(request, property_runs):
    name = request.param
    return name, [_Scenarios(name, rank, property_runs[rank][name]) for rank in range(2)]


class _Scenarios(dict):
    """One rank's scenarios; reading one that raised fails the test with its traceback."""

    def __init__(self, name, rank, runs):
        super().__init__(runs)
        self.where = f"{name} on rank {rank}"

    def __getitem__(self, key):
        value = super().__getitem__(key)
        assert not isinstance(value, str), f"scenario {key!r} of {self.where} raised:\n{value}"
        return value


def test_mixed_layouts_tied_and_empty_train_bitwise_like_plain(property_run):
    name, outs = property_run
    to_plain = {i: PLAIN_ORDER.index(n) for i, n in enumerate(MIXED_ORDER) if n != "empty"}
    empty = MIXED_ORDER.index("empty")
    v0 = _values()
    for rank in range(2):
        mixed, plain = outs[rank]["mixed"], outs[rank]["plain"]
        assert mixed["plans"] == plain["plans"]
        assert len(set(plain["plans"])) >= (1 if name == "BinSGDM" else 2)  # phase changes were crossed
        for step in range(PROPERTY_STEPS):
            got, want = mixed["history"][step], plain["history"][step]
            assert got[empty].shape == (0, 4)
            for i, j in to_plain.items():
                if name == "BinSGDM" and i > empty:
                    continue  # its random streams follow the parameter index: compared with the simulation below
                _assert_equal(got[i], want[j], f"rank {rank} step {step + 1} ({plain['plans'][step]}) {MIXED_ORDER[i]}")
            if plain["plans"][step] in SYNCED and plain["plans"][step] != "compress_gradient" or rank == 0:
                for a, b in zip(got, outs[0]["mixed"]["history"][step]):
                    if plain["plans"][step] in SYNCED:
                        assert torch.equal(a, b)  # ranks identical after synced steps
        # every parameter moved (the tied one by both uses' gradients)
        for i, n in enumerate(MIXED_ORDER):
            if n != "empty":
                assert not torch.equal(mixed["history"][-1][i], v0[n])
    # the empty parameter shared a compression segment or bucket with a neighbour, not alone
    if name in ("OneBitAdam", "OneBitLamb", "ZeroOneAdam"):
        assert any(empty in key and len(key) > 1 for key in outs[0]["mixed"]["segments"])


def test_freezing_mid_run_by_rebuilding_ddp_leaves_the_rest_bitwise(property_run):
    name, outs = property_run
    _, freeze_at = PROPERTY_CASES[name]
    k = PLAIN_ORDER.index(FROZEN)
    for rank in range(2):
        frozen, rebuilt = outs[rank]["frozen"], outs[rank]["rebuilt"]
        assert frozen["plans"] == rebuilt["plans"]
        for step in range(PROPERTY_STEPS):
            for j, n in enumerate(PLAIN_ORDER):
                got, want = frozen["history"][step][j], rebuilt["history"][step][j]
                if n == FROZEN and step + 1 >= freeze_at:  # unchanged from the freeze on
                    _assert_equal(got, frozen["history"][freeze_at - 2][j], f"frozen {n}, rank {rank}, step {step + 1}")
                else:
                    _assert_equal(got, want, f"rank {rank} step {step + 1} ({frozen['plans'][step]}) {n}")
        # the frozen parameter kept training in the rebuilt run (the comparison above is not vacuous)
        assert not torch.equal(rebuilt["history"][-1][k], frozen["history"][-1][k])
        # its optimizer state is untouched: every entry it had at the freeze, bitwise
        had = frozen["frozen_state"]
        keys = list(had)
        if name != "BinSGDM":
            assert {"exp_avg", "exp_avg_sq"} <= set(keys)
        else:
            assert {"momentum", "abs_momentum"} <= set(keys)
        assert _same_state(had, frozen["end_state"], keys), f"rank {rank}: state of the frozen parameter changed"


def test_frozen_from_the_start_in_the_optimizer(property_run):
    name, outs = property_run
    k = PLAIN_ORDER.index(FROZEN)
    for rank in range(2):
        run, ref = outs[rank]["frozen_from_start"], outs[rank]["rebuilt"]
        _assert_equal(run["history"][-1][k], _values()[FROZEN], f"frozen {FROZEN}, rank {rank}")
        # no state beyond 0/1 Adam's local-phase bookkeeping (zeros and the unchanged point)
        state = run["end_state"]
        for key, value in state.items():
            if isinstance(value, torch.Tensor) and key != "synced_param":
                assert not value.any(), f"{key} of the frozen parameter is not zero"
        if "synced_param" in state:
            _assert_equal(state["synced_param"], _values()[FROZEN], "synced point of the frozen parameter")
        for step in range(PROPERTY_STEPS):
            if run["plans"][step] in SYNCED:
                for a, b in zip(run["history"][step], outs[0]["frozen_from_start"]["history"][step]):
                    assert torch.equal(a, b)
            # 1-bit LAMB's momentum scaling averages the RMS over the trained tensors, so there the
            # other parameters depend on which ones train; elsewhere they train as in "rebuilt" up
            # to its rebuild (which changes nothing: the one-bucket step is split along segments)
            if name != "OneBitLamb":
                for j in range(len(PLAIN_ORDER)):
                    if j != k:
                        _assert_equal(run["history"][step][j], ref["history"][step][j],
                                      f"rank {rank} step {step + 1} {PLAIN_ORDER[j]}")


def test_freezing_without_rebuilding_ddp_fails_at_once_and_changes_nothing(property_run):
    _, outs = property_run
    for rank in range(2):
        res = outs[rank]["no_rebuild"]
        assert res["error"] is not None, f"rank {rank}: step() applied gradients that were never exchanged"
        assert res["step"] == 3 and res["unchanged"] is True
        assert "hf_onebit.attach(new_ddp, optimizer)" in res["error"] and "[0, 1, 2, 3]" in res["error"]


@pytest.mark.parametrize("name", ["OneBitAdam", "BinSGDM"])
def test_mixed_layouts_match_the_simulation(name, property_runs):
    """The mixed model against the independent simulations, in logical coordinates.

    1-bit Adam: one compressed buffer per segment the run used (the warmup's one-bucket first
    iteration communicates at full precision, so only rebuilt buckets are segments), the empty
    parameter concatenated with its neighbour. BinSGDM: exact, with the random stream of every
    coordinate at its *logical* position (the channels_last weight, the transposed view).
    """
    import numpy as np

    outs = [_Scenarios(name, rank, property_runs[rank][name]) for rank in range(2)]
    v0 = _values()
    init = [v0[n].numpy() for n in MIXED_ORDER]
    kwargs, _ = PROPERTY_CASES[name]
    if name == "OneBitAdam":
        from tests.simulation import OneBitAdamSimulation

        segments = [list(s) for s in outs[0]["mixed"]["segments"]]
        assert sorted(i for s in segments for i in s) == list(range(len(MIXED_ORDER)))
        sim = OneBitAdamSimulation(init, 2, segments, lr=kwargs["lr"], wd=kwargs["weight_decay"],
                                   freeze_step=kwargs["freeze_step"])
    else:
        from tests.optim.test_binsgdm import VoteSimulation

        sim = VoteSimulation(init, 2, kwargs["lr"], 0.9, 1e-8, kwargs["weight_decay"], 0, stratified=False)  # the paper's
    for step in range(1, PROPERTY_STEPS + 1):
        grads = [[g.numpy() for g in role_grads(step, r, MIXED_ORDER)] for r in range(2)]
        expected = sim.step(grads) if name == "OneBitAdam" else [p.copy() for p in (sim.step(grads), sim.p)[1]]
        for rank in range(2):
            for n, got, want in zip(MIXED_ORDER, outs[rank]["mixed"]["history"][step - 1], expected):
                where = f"{name} rank {rank} step {step} {n}"
                if name == "BinSGDM":
                    np.testing.assert_array_equal(got.numpy(), want, err_msg=where)
                else:
                    scale = np.abs(want).max() if want.size else 1.0
                    np.testing.assert_allclose(got.numpy(), want, rtol=1e-5, atol=1e-5 * scale, err_msg=where)
