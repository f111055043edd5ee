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
    opt = getattr(hf_onebit, opt_name)(model.parameters(), **kwargs)
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


# ---------------------------------------------------------------- no warmup (freeze_step=0)
ZERO_WARMUP = {
    "OneBitAdam": dict(lr=1e-2, eps=1.0, freeze_step=0, bias_correction=False, auto_mask=False),
    "OneBitLamb": dict(lr=1e-2, freeze_step=0),
    "ZeroOneAdam": dict(lr=1e-2, var_freeze_step=0, local_step_scaler=2),
}


@pytest.mark.parametrize("name", list(ZERO_WARMUP))
def test_zero_warmup_compresses_from_the_first_step(name):
    """A zero warmup used to raise KeyError('exp_avg') in the first backward."""
    from functools import partial

    from tests.optim.harness import train

    steps = 5
    outs = run_distributed(partial(train, record_steps=True), 2, name, ZERO_WARMUP[name], steps)
    assert outs[0]["steps"][0]["plan"] != "allreduce"
    for step in range(steps):
        if outs[0]["steps"][step]["plan"] != "local":
            assert all(torch.equal(a, b) for a, b in zip(outs[0]["history"][step], outs[1]["history"][step]))
    if name == "OneBitAdam":  # against the spec simulation with F = 0
        import numpy as np

        from tests.optim.harness import FixedGradModel, fixed_grads
        from tests.simulation import OneBitAdamSimulation

        torch.manual_seed(0)
        init = [p.detach().numpy() for p in FixedGradModel().parameters()]
        # Step 1 runs in DDP's one-bucket first iteration (one segment of every parameter); the
        # rebuilt buckets then become new segments with fresh error buffers.
        everything = [list(range(len(init)))]
        sim = OneBitAdamSimulation(init, 2, everything, lr=1e-2, eps=1.0,
                                   freeze_step=0, bias_correction=False, auto_mask=False)
        later = OneBitAdamSimulation(init, 2, [list(s) for s in outs[0]["segments"]], freeze_step=0)
        for step in range(1, steps + 1):
            if step == 2:
                sim.segments, sim.comm = later.segments, later.comm
            expected = sim.step([[g.numpy() for g in fixed_grads(step, r)] for r in range(2)])
            for got, want in zip(outs[0]["history"][step - 1], expected):
                np.testing.assert_allclose(got.numpy(), want, rtol=1e-5, atol=1e-5 * np.abs(want).max())
    else:
        assert outs[0]["stats"]["compression_ratio"] > 1
