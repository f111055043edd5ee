"""Each optimizer trains a small MLP on 2 ranks to within 5% of AdamW's final loss.

The task is fixed and noisy (a random teacher network with 10% label noise), so the best
possible loss is well above zero and a 5% margin is meaningful. Every optimizer sees the same
data, seeds and number of steps; the hyperparameters are the ones a user would pick from the
published guidance (freeze after ~20% of the steps).
"""

from __future__ import annotations

import torch
from torch.nn.parallel import DistributedDataParallel as DDP

from tests.distributed import run_distributed

STEPS = 300
CONFIGS = {
    "AdamW": dict(lr=3e-3),
    "OneBitAdam": dict(lr=3e-3, freeze_step=60),
    # 0/1 Adam applies no bias correction and updates the variance on a thinning schedule: in a
    # 60-step variance phase v gets ~20 updates, so with β2 = 0.999 it is ~50x too small and the
    # steps too large. Short runs need a shorter variance memory (β2 = 0.99).
    "ZeroOneAdam": dict(lr=3e-3, betas=(0.9, 0.99), var_freeze_step=60, var_update_scaler=8,
                        local_step_scaler=40, local_step_clipper=4),
    "OneBitLamb": dict(lr=1e-2, freeze_step=60),  # LAMB's trust ratio wants a larger lr
    "BinSGDM": dict(lr=1e-3),
}


def make_data(n: int, seed: int):
    """``n`` examples labelled by one fixed teacher (same for every seed), 10% labels flipped."""
    teacher_gen = torch.Generator().manual_seed(12345)
    teacher = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 4))
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in teacher.parameters():
            p.copy_(torch.randn(p.shape, generator=teacher_gen) * 1.5)
        x = torch.randn(n, 16, generator=g)
        y = teacher(x).argmax(-1)
    flip = torch.rand(n, generator=g) < 0.1
    y[flip] = torch.randint(0, 4, (int(flip.sum()),), generator=g)
    return x, y


def _train_all(rank, world_size, configs, steps):
    import hf_onebit

    x, y = make_data(4096, 0)
    x_eval, y_eval = make_data(2048, 1)
    results = {}
    for name, kwargs in configs.items():
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.GELU(), torch.nn.Linear(64, 4))
        if name == "AdamW":
            opt = torch.optim.AdamW(model.parameters(), **kwargs)
            ddp = DDP(model)
        else:
            opt = getattr(hf_onebit, name)(model.parameters(), **kwargs)
            ddp = DDP(model)
            hf_onebit.attach(ddp, opt)
        g = torch.Generator().manual_seed(100 + rank)
        for _ in range(steps):
            idx = torch.randint(0, x.shape[0], (32,), generator=g)
            loss = torch.nn.functional.cross_entropy(ddp(x[idx]), y[idx])
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
        with torch.no_grad():
            eval_loss = float(torch.nn.functional.cross_entropy(model(x_eval), y_eval))
        stats = opt.onebit_stats() if hasattr(opt, "onebit_stats") else None
        results[name] = (eval_loss, stats)
    return results


def test_every_optimizer_reaches_adamw_loss_within_5_percent():
    out = run_distributed(_train_all, 2, CONFIGS, STEPS, timeout=600)[0]
    reference = out["AdamW"][0]
    report = {name: round(loss, 4) for name, (loss, _) in out.items()}
    print("final eval losses:", report)
    assert reference < 1.0, f"AdamW did not learn the task (chance: ln 4 = 1.386): {report}"
    for name, (loss, stats) in out.items():
        assert loss <= reference * 1.05, f"{name} ended at {loss:.4f}, AdamW at {reference:.4f}: {report}"
        if stats is not None:
            assert stats["compression_ratio"] > 1.5, f"{name} barely compressed: {stats}"
