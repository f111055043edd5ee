"""Thousands of small parameter tensors (layer norms, biases): correct, bucket by bucket."""

from __future__ import annotations

import numpy as np
import torch
from torch.nn.parallel import DistributedDataParallel as DDP

from tests.distributed import run_distributed
from tests.simulation import OneBitAdamSimulation

COUNT, SIZE = 3000, 7


def _grads(step, rank):
    g = torch.Generator().manual_seed(31 * step + rank)
    return torch.randn(COUNT, SIZE, generator=g) * (1 + rank)


class ManySmall(torch.nn.Module):
    def __init__(self):
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.ps = torch.nn.ParameterList([torch.nn.Parameter(torch.randn(SIZE, generator=g)) for _ in range(COUNT)])

    def forward(self, coeffs):
        return (torch.stack(list(self.ps)) * coeffs).sum()


def _train(rank, world_size, steps):
    import hf_onebit

    model = ManySmall()
    opt = hf_onebit.OneBitAdam(model.parameters(), lr=1e-2, freeze_step=2, defaults="paper")
    ddp = DDP(model, bucket_cap_mb=0.02)  # ~700 tensors per bucket
    hf_onebit.attach(ddp, opt)
    for step in range(1, steps + 1):
        ddp(_grads(step, rank)).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    return torch.stack([p.detach() for p in model.parameters()]), sorted(opt.exchange.segments.keys())


def test_three_thousand_tensors_match_the_spec_simulation():
    steps = 5
    outs = run_distributed(_train, 2, steps)
    (p0, segments), (p1, _) = outs
    assert torch.equal(p0, p1)
    assert len(segments) >= 3
    init = [p.detach().numpy() for p in ManySmall().parameters()]
    sim = OneBitAdamSimulation(init, 2, [list(s) for s in segments], lr=1e-2, freeze_step=2)
    for step in range(1, steps + 1):
        grads = [[g.numpy() for g in _grads(step, r)] for r in range(2)]
        expected = sim.step(grads)
    np.testing.assert_allclose(p0.numpy(), np.stack(expected), rtol=1e-5, atol=1e-5)
