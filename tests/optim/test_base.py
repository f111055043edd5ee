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


def test_per_rank_state_of_another_node_layout_is_refused_unless_there_are_no_error_buffers():
    """The error buffers belong to the exchange that filled them: state saved by the flat exchange
    is refused by a run by node (and vice versa); BinSGDM keeps none, so its state loads either way."""
    from hf_onebit import BinSGDM, OneBitAdam
    from hf_onebit.comm.topology import NodeTopology
    from hf_onebit.optim import saved_state

    params = [torch.nn.Parameter(torch.zeros(8))]
    flat = OneBitAdam(params)
    saved = saved_state.save(flat)
    assert saved["nodes"] is None
    by_node = OneBitAdam(params)
    by_node.exchange._nodes = NodeTopology(local_size=2, nodes=2, node=0, local_rank=0)  # as decided under 2 x 2
    with pytest.raises(ValueError, match=r"saved with the flat exchange, this run uses the exchange by node \(2 nodes of 2"):
        saved_state.load(by_node, saved)
    assert saved_state.save(by_node)["nodes"] == [2, 2]
    with pytest.raises(ValueError, match=r"saved with the exchange by node .* this run uses the flat exchange.*on_mismatch='reset'"):
        saved_state.load(flat, saved_state.save(by_node))
    votes = BinSGDM(params)
    votes.exchange._nodes = NodeTopology(local_size=2, nodes=2, node=0, local_rank=0)
    state = votes.rank_state_dict()
    assert state["nodes"] is None
    votes.load_rank_state_dict(state)
