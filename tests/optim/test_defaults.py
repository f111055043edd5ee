"""The one set of defaults (hf_onebit.optim.defaults): the measured ones by default, the papers'
one switch away, arguments given always kept; the automatic freeze bounded in plain PyTorch."""

from __future__ import annotations

import logging
import math

import pytest
import torch

import hf_onebit
from hf_onebit.optim import defaults as presets
from hf_onebit.optim.base import Plan
from hf_onebit.optim.freeze import DEFAULT_MAX_STEP, AutoFreeze, run_length
from tests.distributed import run_distributed

OPTIMIZERS = {"OneBitAdam": "freeze_step", "OneBitLamb": "freeze_step", "ZeroOneAdam": "var_freeze_step"}


def _param():
    return [torch.nn.Parameter(torch.zeros(4))]


def _resolved(opt, freeze_name):
    auto = opt.auto_freeze
    out = dict(scale_per_tensor=opt.scale_per_tensor, scale_block=opt.scale_block, update_clip=opt.update_clip,
               warmup_bits=opt.warmup_bits,
               **{freeze_name: "auto" if auto is not None else getattr(opt, freeze_name)})
    for own in ("clip_synced_momentum", "var_update_scaler", "bias_correction", "momentum_correction",
                "precondition_exchange", "step_bound"):  # 0/1 Adam's; 1-bit LAMB's; both Adams
        if own in presets.LIBRARY[type(opt).__name__]:
            out[own] = getattr(opt, own)
    return out


@pytest.mark.parametrize("name", OPTIMIZERS)
def test_library_defaults_by_default_and_the_papers_one_switch_away(name):
    cls, freeze_name = getattr(hf_onebit, name), OPTIMIZERS[name]
    assert _resolved(cls(_param()), freeze_name) == presets.LIBRARY[name]
    assert _resolved(cls(_param(), defaults="paper"), freeze_name) == presets.PAPER[name]
    # an argument given is taken as given, under either preset
    given = cls(_param(), defaults="paper", warmup_bits=4, **{freeze_name: 7})
    assert (given.warmup_bits, getattr(given, freeze_name), given.scale_per_tensor) == (4, 7, False)
    given = cls(_param(), scale_per_tensor=False, warmup_bits=None)
    assert (given.scale_per_tensor, given.warmup_bits, given.update_clip) == (False, None, presets.LIBRARY[name]["update_clip"])
    with pytest.raises(ValueError, match="defaults must be one of"):
        cls(_param(), defaults="deepspeed")
    for bad in (0, 12, 256.0, True):
        with pytest.raises(ValueError, match="scale_block must be None or a positive multiple of 8"):
            cls(_param(), scale_block=bad)


def test_binsgdm_takes_the_switch_too():
    assert hf_onebit.BinSGDM(_param(), defaults="paper").plan() is not None
    with pytest.raises(ValueError, match="defaults must be one of"):
        hf_onebit.BinSGDM(_param(), defaults="fast")


def test_total_steps_fits_the_automatic_freeze_to_the_run():
    opt = hf_onebit.OneBitAdam(_param(), total_steps=1000)
    assert (opt.auto_freeze.min_step, opt.auto_freeze.max_step) == (100, 400)
    # bounds the user chose stay as they are
    opt = hf_onebit.OneBitAdam(_param(), freeze_step=AutoFreeze(min_step=5, max_step=9), total_steps=1000)
    assert (opt.auto_freeze.min_step, opt.auto_freeze.max_step) == (5, 9)


def test_run_length_is_read_from_common_schedulers():
    opt = torch.optim.SGD(_param(), lr=0.1)
    assert run_length(torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=0.1, total_steps=321)) == 321
    assert run_length(torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=77)) == 77
    warm = torch.optim.lr_scheduler.LinearLR(opt, start_factor=0.1, total_iters=10)
    seq = torch.optim.lr_scheduler.SequentialLR(
        opt, [warm, torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=90)], milestones=[10])
    assert run_length(seq) == 100
    transformers = pytest.importorskip("transformers")
    hf = transformers.get_linear_schedule_with_warmup(opt, num_warmup_steps=5, num_training_steps=555)
    assert run_length(hf) == 555
    assert run_length(torch.optim.lr_scheduler.StepLR(opt, step_size=3)) is None

    onebit = hf_onebit.ZeroOneAdam(_param())
    assert onebit.fit_to_run(hf) and onebit.auto_freeze.max_step == 222
    with pytest.raises(ValueError, match="cannot read a run length from StepLR"):
        hf_onebit.ZeroOneAdam(_param()).fit_to_run(torch.optim.lr_scheduler.StepLR(opt, step_size=3))


def test_without_the_runs_length_the_first_step_bounds_the_freeze_and_says_so(caplog):
    p = _param()
    opt = hf_onebit.OneBitAdam(p)
    assert opt.auto_freeze.max_step is None
    with caplog.at_level(logging.INFO, logger="hf_onebit"):
        for _ in range(3):
            p[0].grad = torch.ones(4)
            opt.step()
    assert opt.auto_freeze.max_step == DEFAULT_MAX_STEP
    said = [r.getMessage() for r in caplog.records if "without the run's length" in r.getMessage()]
    assert len(said) == 1 and f"by step {DEFAULT_MAX_STEP}" in said[0]


# ---------------------------------------------------------------- robust defaults
LAYERS = 100


class DeepLinear(torch.nn.Module):
    """100 linear layers (200 tensors) whose gradients span ~25 orders of magnitude."""

    def __init__(self) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.layers = torch.nn.ModuleList(torch.nn.Linear(8, 8) for _ in range(LAYERS))
        with torch.no_grad():
            for layer in self.layers:
                layer.weight.copy_(torch.randn(8, 8, generator=g) * 0.2)
                layer.bias.zero_()

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return x


def _train_deep(rank, world_size, preset, name="OneBitAdam", kwargs=None):
    from torch.nn.parallel import DistributedDataParallel as DDP

    torch.manual_seed(0)
    model = DeepLinear()
    kwargs = {"freeze_step": 2} if kwargs is None else kwargs
    opt = getattr(hf_onebit, name)(model.parameters(), lr=1e-3, defaults=preset, **kwargs)
    ddp = DDP(model)
    hf_onebit.attach(ddp, opt)
    data = torch.Generator().manual_seed(rank)
    losses, grad_range = [], None
    for step in range(12):
        x = torch.randn(16, 8, generator=data)
        loss = (ddp(x) - x.flip(1)).square().mean()
        loss.backward()
        if step == 0:
            norms = [p.grad.abs().max().item() for p in model.parameters()]
            grad_range = (min(v for v in norms if v > 0), max(norms))
        losses.append(loss.item())
        if not math.isfinite(loss.item()):
            break
        opt.step()
        opt.zero_grad()
    return {"losses": losses, "grad_range": grad_range}


def test_the_deep_stack_trains_at_the_library_defaults_and_not_at_the_papers():
    """A 200-tensor stack, 1-bit Adam with an early freeze: one scale per bucket rebuilds the
    tiny-gradient layers at their neighbours' magnitude (the papers' arithmetic diverges); the
    library's per-tensor scales and update clip train it."""
    library = run_distributed(_train_deep, 2, "library")
    lo, hi = library[0]["grad_range"]
    assert hi / lo > 1e15, (lo, hi)  # the test's premise: gradients over many orders of magnitude
    for out in library:
        assert len(out["losses"]) == 12 and all(math.isfinite(v) for v in out["losses"])
        assert out["losses"][-1] < 1.5 * out["losses"][0]
    paper = run_distributed(_train_deep, 2, "paper")
    assert not all(math.isfinite(v) and v < 1e6 for v in paper[0]["losses"]), paper[0]["losses"]


@pytest.mark.parametrize("name,kwargs", [("ZeroOneAdam", {"var_freeze_step": 2}), ("OneBitLamb", {"freeze_step": 2}),
                                         ("BinSGDM", {})], ids=["zeroone_adam", "onebit_lamb", "binsgdm"])
def test_the_other_optimizers_train_the_deep_stack_at_the_library_defaults(name, kwargs):
    """No default configuration diverges where AdamW trains: the same stack, the same early freeze."""
    for out in run_distributed(_train_deep, 2, "library", name, kwargs):
        assert len(out["losses"]) == 12 and all(math.isfinite(v) for v in out["losses"]), out["losses"]
        assert out["losses"][-1] < 1.5 * out["losses"][0]


@pytest.mark.parametrize("preset,first_one_bit", [("library", 21), ("paper", 17)])
def test_zeroone_adam_variance_phase_has_no_one_bit_step_by_default(preset, first_one_bit):
    """Library: every step of the variance phase is a variance step (b bits), the first 1-bit
    exchange is the local phase's; the paper's ``var_update_scaler=16``: 1-bit gradient steps
    from step 17, between variance steps 18, 20, ..."""
    p = torch.nn.Parameter(torch.zeros(4))
    opt = hf_onebit.ZeroOneAdam([p], defaults=preset, var_freeze_step=20, warmup_bits=8)
    plans = []
    for _ in range(24):
        plans.append(opt.plan())
        p.grad = torch.ones(4)
        opt.step()
    variance, one_bit = Plan.QUANTIZE_GRADIENT, Plan.COMPRESS_GRADIENT
    assert plans[:16] == [variance] * 16
    first = next(t for t, plan in enumerate(plans, 1) if plan is not variance)
    assert first == first_one_bit
    if preset == "library":
        assert opt.var_updates == 20 and one_bit not in plans
    else:
        assert plans[16:20] == [one_bit, variance, one_bit, variance] and opt.var_updates == 18
