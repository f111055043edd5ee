"""The cost model (``hf_onebit.cost_model``, ``hf-onebit estimate``, ``benchmarks/estimate_check.py``).

Its byte formulas against the library's own counters on real gloo ranks (2 and 4, flat and as 2
nodes of 2), its flag parsing, and the validation command against the stored runs."""

from __future__ import annotations

import json
import math
import re
import sys
from pathlib import Path

import pytest
import torch

from hf_onebit import cost_model as cm
from hf_onebit import estimate as est
from tests.distributed import run_distributed

REPO = Path(__file__).resolve().parent.parent
SIZES = [400, 3, 333, 267, 64, 1]  # tensors laid end to end (1068 elements)
NODES = {"LOCAL_WORLD_SIZE": "2"}


# ---------------------------------------------------------------------------------- bytes
def _library_counts(rank, world_size, by_node):
    """Bytes and rounds the library counts for each exchange, one call each."""
    import torch.distributed as dist

    from hf_onebit.comm import CompressedAllReduce
    from hf_onebit.comm.hierarchical import HierarchicalCompressedAllReduce
    from hf_onebit.comm.topology import node_topology
    from hf_onebit.comm.vote import VoteAllGather

    numel = sum(SIZES)
    out = {}
    x = torch.randn(numel, generator=torch.Generator().manual_seed(rank))
    nodes = node_topology(world_size) if by_node else None
    if nodes is not None:
        nodes.create_groups()
    for width in (1, 8):
        for pieces in (None, SIZES):
            if by_node:
                ex = HierarchicalCompressedAllReduce(numel, "cpu", nodes, piece_sizes=pieces)
            else:
                ex = CompressedAllReduce(numel, "cpu", piece_sizes=pieces)
            ex(x.clone(), width=width)
            s = ex.stats.snapshot()
            inter = s.inter_node_sent if by_node else None
            out[("compressed", width, pieces is not None)] = (s.bytes_sent, s.rounds, inter)
    vote = VoteAllGather(dist.group.WORLD, world_size, nodes)
    padded = vote.padded_length(numel)
    votes = torch.rand(padded, generator=torch.Generator().manual_seed(rank)) < 0.5
    votes[numel:] = False
    kwargs = dict(node_uniform=torch.full((numel,), 0.5), scratch=torch.empty(padded)) if by_node else {}
    vote(votes, torch.tensor(True), numel, **kwargs)
    s = vote.stats.snapshot()
    out[("vote",)] = (s.bytes_sent, s.rounds, s.inter_node_sent if by_node else None)
    return out


@pytest.mark.parametrize("world", [2, 4])
def test_flat_byte_formulas_equal_the_library_counters(world):
    lay = cm.Layout(world, 1)
    numel = sum(SIZES)
    counted = run_distributed(_library_counts, world, False)
    for rank in range(world):  # every rank counts the same
        for width in (1, 8):
            for pieces in (False, True):
                model = cm.compressed(numel, lay, width, tensor_sizes=SIZES if pieces else None)
                sent, rounds, _ = counted[rank][("compressed", width, pieces)]
                assert (model.sent, model.rounds) == (sent, rounds), (world, width, pieces)
        model = cm.vote(numel, lay)
        assert (model.sent, model.rounds) == counted[rank][("vote",)][:2]


def test_by_node_byte_formulas_equal_the_library_counters():
    """4 ranks as 2 nodes of 2: every byte a rank sends, and what crosses between the nodes."""
    lay = cm.Layout(4, 2)
    numel = sum(SIZES)
    counted = run_distributed(_library_counts, 4, True, env=NODES)
    for width in (1, 8):
        model = cm.compressed_by_node(numel, lay, width)
        sent, rounds, inter = counted[0][("compressed", width, False)]
        assert (model.sent, model.rounds) == (sent, rounds)
        assert model.between == lay.per_node * inter  # both ranks of a node cross, each its shard's bytes
        # a scale per tensor: the model takes local rank 0's shard (the others' pieces differ by a few)
        piece_model = cm.compressed_by_node(numel, lay, width, tensor_sizes=SIZES)
        assert piece_model.sent == counted[0][("compressed", width, True)][0]
    model = cm.vote_by_node(numel, lay)
    sent, rounds, inter = counted[0][("vote",)]
    assert (model.sent, model.rounds, model.between) == (sent, rounds, lay.per_node * inter)


def _ddp_steps(rank, world_size, steps):
    """1-bit Adam through DDP's hook on a model of one bucket: bytes counted per step."""
    import hf_onebit
    from torch.nn.parallel import DistributedDataParallel as DDP

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 3))
    opt = hf_onebit.OneBitAdam(model.parameters(), lr=1e-3, freeze_step=3, scale_per_tensor=False, scale_block=None)
    ddp = DDP(model)
    hf_onebit.attach(ddp, opt)
    data = torch.Generator().manual_seed(rank)
    per_step, before = [], 0
    for _ in range(steps):
        x = torch.randn(8, 32, generator=data)
        torch.nn.functional.cross_entropy(ddp(x), (x[:, 0] > 0).long()).backward()
        opt.step()
        opt.zero_grad()
        total = opt.exchange.stats.snapshot().bytes_sent
        per_step.append(total - before)
        before = total
    return {"per_step": per_step, "params": sum(p.numel() for p in model.parameters())}


def test_a_training_run_sends_what_the_model_predicts_in_each_phase():
    out = run_distributed(_ddp_steps, 2, 6)[0]
    cfg = cm.Config(params=out["params"], layout=cm.Layout(2, 1), link_bps=1e9, dtype="fp32", tensors=0)
    warm = cm.plan_phase(cfg, "warmup", False)
    comp = cm.plan_phase(cfg, "onebit", False)
    assert out["per_step"] == [warm.sent] * 3 + [comp.sent] * 3


def test_ring_allreduce_is_the_counters_rule_and_by_node_sends_fewer_bytes_between_nodes():
    from hf_onebit.comm.stats import allreduce_bytes

    for n in (2, 3, 4, 16):
        assert cm.ring_allreduce(4 * 1000, cm.Layout(n, 1)).sent == pytest.approx(allreduce_bytes(4000, n), abs=1)
    lay = cm.Layout(16, 2)
    numel = 25 * 2**20
    flat, by_node = cm.compressed(numel, lay), cm.compressed_by_node(numel, lay)
    assert flat.sent == pytest.approx(2 * 15 / 16 * numel / 8, rel=1e-3)  # spec §1: ≈ 2·(n-1)/n·L/8
    assert by_node.between == pytest.approx(8 * 2 * (1 / 2) * (numel / 8) / 8, rel=1e-3)  # k·2(M-1)/M·S/8
    assert by_node.between < flat.between / 3


def test_zeroone_schedule_follows_the_optimizer_counters():
    plans = cm.zeroone_plans(12, 4, var_update_scaler=2, local_step_scaler=2, local_step_clipper=4)
    assert plans[:4] == ["variance", "variance", "onebit", "variance"]
    # local phase: interval 1 for 2 steps, then 2 (steps 7, 8), then 4
    assert plans[4:] == ["sync", "sync", "local", "sync", "local", "local", "local", "sync"]
    assert cm.zeroone_plans(5, 2) == ["variance", "variance", "sync", "sync", "sync"]


# ---------------------------------------------------------------------------------- parsing
@pytest.mark.parametrize("text,bps", [("100gbit", 1e11), ("200mbit", 2e8), ("10Gbps", 1e10), ("1.5gbit/s", 1.5e9),
                                      ("500kbit", 5e5)])
def test_rates_parse(text, bps):
    assert est.parse_rate(text) == bps


@pytest.mark.parametrize("text", ["100gb", "100GB/s", "100", "fast", "-5gbit", "0gbit", "1e999gbit"])
def test_rates_that_are_refused(text):
    with pytest.raises(est.EstimateError, match="--link"):
        est.parse_rate(text)


@pytest.mark.parametrize("text,count", [("7e9", 7_000_000_000), ("7b", 7_000_000_000), ("350m", 350_000_000),
                                        ("1.3B", 1_300_000_000), ("125000000", 125_000_000)])
def test_counts_parse(text, count):
    assert est.parse_count(text) == count


@pytest.mark.parametrize("argv,message", [
    (["--params", "7x", "--gpus", "16", "--link", "100gbit", "--step-ms", "850"], "--params: cannot read '7x'"),
    (["--params", "7e9", "--gpus", "16", "--nodes", "3", "--link", "100gbit", "--step-ms", "850"],
     "not a multiple of --nodes 3"),
    (["--params", "7e9", "--gpus", "16", "--link", "100gigabit", "--step-ms", "850"], "--link: cannot read"),
    (["--params", "7e9", "--gpus", "16", "--link", "100gbit", "--intra-link", "fast", "--step-ms", "850"],
     "--intra-link: cannot read"),
    (["--params", "7e9", "--gpus", "16", "--link", "100gbit", "--step-ms", "850", "--overlap", "2"],
     "--overlap must be between 0 and 1"),
    (["--params", "7e9", "--gpus", "16", "--link", "100gbit", "--step-ms", "850", "--kernels-from", "/nonexistent.json"],
     "--kernels-from: cannot read"),
])
def test_cli_errors_name_the_flag(argv, message, capsys):
    with pytest.raises(SystemExit) as exc:
        est.main(argv)
    assert exc.value.code == 2
    assert message in capsys.readouterr().err


def test_the_example_command_prints_every_method_through_the_launcher(capsys):
    from hf_onebit.integrations.launcher import main

    with pytest.raises(SystemExit) as exc:
        main(["estimate", "--params", "7e9", "--gpus", "16", "--nodes", "2", "--link", "100gbit", "--step-ms", "850"])
    assert exc.value.code == 0
    out = capsys.readouterr().out
    for label in ("AdamW", "PowerSGD", "1-bit Adam", "0/1 Adam", "1-bit LAMB", "BinSGDM"):
        assert label in out
    assert out.count("by node") == 4 and "between steps 1000 and 4000" in out


def test_kernels_from_reads_the_check_json(tmp_path):
    path = tmp_path / "k.json"
    rows = [{"dtype": "float32", "op": op, "numel": 1000, "ms": ms}
            for op, ms in (("copy_", 1.0), ("worker_scale", 1.0), ("worker_pack", 2.0), ("unpack_scaled", 3.0))]
    path.write_text(json.dumps({"device": "cpu", "kernels": rows}))
    k = cm.Kernels.load(str(path))
    assert k.per_element("fp32", "worker_pack") == pytest.approx(2e-6)
    # 1-bit exchange of 1000 elements on 2 ranks: L·(scale + pack + 2·unpack) + L/n·(scale + pack)
    assert cm.kernel_seconds("compressed", 1000, 2, "fp32", k) == pytest.approx(1000 * 9e-6 + 500 * 3e-6)


# ---------------------------------------------------------------------------------- validation
def test_the_validation_prints_the_errors_of_the_stored_runs(tmp_path, capsys):
    sys.path.insert(0, str(REPO / "benchmarks"))
    import estimate_check

    assert estimate_check.main(["--json", str(tmp_path / "points.json")]) == 0
    printed = capsys.readouterr().out
    points = json.loads((tmp_path / "points.json").read_text())
    throttled = [p for p in points if p["rate"] != "unlimited"]
    assert len(throttled) >= 6
    for p in points:
        assert p["error"] == pytest.approx(p["predicted_ms"] / p["measured_ms"] - 1)
        assert f"{100 * p['error']:+6.0f}%" in printed
        # the formulas reproduce the runs' own byte counters (the configuration is the run's)
        assert p["run_bytes_predicted"] == pytest.approx(p["run_bytes_counted"], rel=2e-3)
        if p["bytes_counted"] is not None:
            assert p["bytes_predicted"] == pytest.approx(p["bytes_counted"], rel=2e-3)
    # the measured figures are the stored ones
    stored = json.loads((REPO / "docs/img/defaults/network.json").read_text())
    row = stored["rates"][0]["summary"]["rows"]["onebit_adam"]
    mine = next(p for p in points if p["file"] == "defaults/network.json" and p["rate"] == "200mbit"
                and p["method"] == "onebit_adam" and p["phase"] == "compressed")
    assert mine["measured_ms"] == pytest.approx(1e3 * row["step_s_compress"])
    ok = [p for p in throttled if abs(p["error"]) <= 0.25]
    assert f"throttled points within ±25%: {len(ok)} of {len(throttled)}" in printed
    assert len({p["rate"] for p in ok}) >= 3 and len({p["layout"] for p in ok}) >= 2
    assert not math.isnan(sum(p["error"] for p in points))


def test_the_cost_model_page_reprints_both_commands(capsys):
    """docs/cost-model.md: the example's output and the validation table are the commands' own."""
    page = (REPO / "docs/cost-model.md").read_text()
    assert est.main(["--params", "7e9", "--gpus", "16", "--nodes", "2", "--link", "100gbit", "--step-ms", "850"]) == 0
    for line in capsys.readouterr().out.splitlines():
        assert line in page, line
    sys.path.insert(0, str(REPO / "benchmarks"))
    import estimate_check

    estimate_check.main(["--markdown"])
    lines = capsys.readouterr().out.splitlines()
    for line in lines[: lines.index("")]:  # the table, line for line
        assert line in page, line
    # the two summary lines, as the page's sentence quotes them
    summary = " ".join(lines[lines.index("") + 1: lines.index("") + 3])
    counts = re.findall(r"\d+ of \d+", summary)
    assert len(counts) == 2 and re.search(r"median \|error\| \d+%", summary), summary
    for figure in counts + re.findall(r"median \|error\| \d+%", summary):
        assert figure in " ".join(page.split()), figure
