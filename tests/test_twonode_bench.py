"""benchmarks/netbench/twonode.py's accounting and the ``_nodes`` methods (pure Python, no network)."""

from __future__ import annotations

import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

from netbench import LABELS, NODE_METHODS  # noqa: E402
from netbench.methods import onebit_optimizer  # noqa: E402
from netbench.twonode import RING_SHARE, inter_node_counted, link_summary  # noqa: E402


def rec(bytes_, inter=0, fp32=0, veth=0, lo=0):
    return {"bytes": bytes_, "inter": inter, "fp32": fp32, "veth": veth, "lo_node": lo}


def test_shares():
    assert RING_SHARE == 0.5


def test_counted_per_step_is_the_optimizers_own_count():
    # step 1: fp32 (50 of 100 left the node), step 2: compressed (6 of 10), step 3: a local step
    # (fp32 equivalent only), step 4: nothing
    r = [rec(100, 50, 100), rec(110, 56, 420), rec(110, 56, 740), rec(110, 56, 740)]
    out = inter_node_counted("onebit_adam", [r, r], buffer_bytes=5)
    # the buffer broadcast (2 x 5) once per step, plus each of the 2 ranks' crossing bytes
    assert out == pytest.approx([10 + 2 * 50, 10 + 2 * 6, 10, 10])


def test_counted_hybrid_sharding_is_what_it_counts_as_crossing():
    # step 1: the shard's exchange (inter grew by 6 of 100 sent), step 2: a local step (only
    # FSDP's intra-node collectives grew): nothing crossed, no buffer broadcast either
    r = [rec(100, 6), rec(190, 6)]
    assert inter_node_counted("hsdp_zeroone_adam", [r, r], buffer_bytes=5) == pytest.approx([12, 0])


def test_counted_torch_methods_are_rings():
    r = [rec(40), rec(80)]  # AdamW: no fp32 equivalent counter
    assert inter_node_counted("adamw", [r] * 4) == pytest.approx([80, 80])


def test_link_summary_window_and_heads():
    steps = 5
    recs = []
    for rank in range(4):
        recs.append([rec(100 * (s + 1), veth=(1000 if rank % 2 == 0 else 7) * (s + 1), lo=10 * (s + 1))
                     for s in range(steps)])
    raw = {"methods": {"adamw": {"records": recs}}, "buffer_bytes": 0}
    out = link_summary(raw, {"window": [4, 5]}, local_size=2)["adamw"]
    assert out["inter_measured"] == 2000  # ranks 0 and 2 read their namespaces' veth
    assert out["intra_measured"] == 20
    assert out["inter_counted"] == pytest.approx(200)  # half of 4 x 100
    assert out["intra_counted"] == pytest.approx(200)


@pytest.mark.parametrize("method", NODE_METHODS)
def test_nodes_methods_build_hierarchical(method):
    args = SimpleNamespace(onebit_args=None, steps=20, lr=1e-4, lamb_lr=1e-3)
    params = [torch.nn.Parameter(torch.zeros(8))]
    assert onebit_optimizer(method, params, args, 4).exchange.hierarchical is True
    assert onebit_optimizer(method[: -len("_nodes")], params, args, 4).exchange.hierarchical is False
    assert method in LABELS


def test_binsgdm_stays_flat_unless_asked():
    args = SimpleNamespace(onebit_args=None, steps=20, lr=1e-4, lamb_lr=1e-3)
    params = [torch.nn.Parameter(torch.zeros(8))]
    assert onebit_optimizer("binsgdm", params, args, 4).exchange.hierarchical is False
    args.onebit_args = '{"hierarchical": null}'
    assert onebit_optimizer("binsgdm", params, args, 4).exchange.hierarchical is None
