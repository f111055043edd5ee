"""What ``hf_onebit.optim.base`` gives all four optimizers: parameter-group checks, lookups."""

from __future__ import annotations

import pytest
import torch

OPTIMIZERS = ["OneBitAdam", "ZeroOneAdam", "OneBitLamb", "BinSGDM"]
#: a bad value for each optimizer's momentum coefficient(s)
BAD_MOMENTUM = {"OneBitAdam": {"betas": (0.9, 1.0)}, "ZeroOneAdam": {"betas": (0.9, 1.0)},
                "OneBitLamb": {"betas": (0.9, 1.0)}, "BinSGDM": {"beta": 1.0}}


@pytest.mark.parametrize("name", OPTIMIZERS)
@pytest.mark.parametrize("bad", [{"lr": -1.0}, {"lr": float("nan")}, {"eps": -1e-8}, {"weight_decay": float("nan")},
                                 "momentum"])
def test_every_parameter_group_is_checked_at_construction_and_when_added(name, bad):
    """One check per optimizer (``_check_group``) on the defaults, on every group given to the
    constructor, and on a group added later, which is then not added."""
    import hf_onebit

    cls = getattr(hf_onebit, name)
    bad = BAD_MOMENTUM[name] if bad == "momentum" else bad
    word = next(iter(bad))
    a, b = torch.nn.Parameter(torch.zeros(3)), torch.nn.Parameter(torch.zeros(3))
    with pytest.raises(ValueError, match=word):
        cls([a], **bad)
    with pytest.raises(ValueError, match=word):
        cls([{"params": [a]}, {"params": [b], **bad}])
    opt = cls([a])
    with pytest.raises(ValueError, match=word):
        opt.add_param_group({"params": [b], **bad})
    assert len(opt.param_groups) == 1


@pytest.mark.parametrize("name", OPTIMIZERS)
def test_a_group_added_after_steps_is_stepped(name):
    """The per-parameter lookups (index, group) follow a group added after the first steps."""
    import hf_onebit

    a, b = torch.nn.Parameter(torch.ones(3)), torch.nn.Parameter(torch.ones(3))
    opt = getattr(hf_onebit, name)([a], lr=0.1)
    a.grad = torch.ones(3)
    opt.step()
    opt.add_param_group({"params": [b], "lr": 0.2})
    a.grad, b.grad = torch.ones(3), torch.ones(3)
    opt.step()
    assert not torch.equal(b.detach(), torch.ones(3))  # b moved, with its own group's lr
