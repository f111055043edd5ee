"""The parts of ``benchmarks/network.py``: link (namespaces, tc), data, methods (with their counters),
report (summaries, tables, plots). Run the benchmark as ``python benchmarks/network.py``; twonode
holds the two-node emulation of ``benchmarks/two_nodes.py``."""

from __future__ import annotations

from pathlib import Path

REPO = Path(__file__).resolve().parents[2]  # the repository (benchmarks/netbench/__init__.py)
METHODS = ["adamw", "fp16", "powersgd", "onebit_adam", "zeroone_adam", "onebit_lamb", "binsgdm"]
LABELS = {
    "adamw": "AdamW (fp32 all-reduce)",
    "fp16": "AdamW + fp16 hook",
    "powersgd": "AdamW + PowerSGD r4",
    "onebit_adam": "1-bit Adam",
    "zeroone_adam": "0/1 Adam",
    "onebit_lamb": "1-bit LAMB",
    "binsgdm": "BinSGDM",
    "onebit_adam_nodes": "1-bit Adam by node",
    "zeroone_adam_nodes": "0/1 Adam by node",
    "onebit_lamb_nodes": "1-bit LAMB by node",
    "hsdp_adamw": "HSDP + AdamW",
    "hsdp_onebit_adam": "HSDP + 1-bit Adam",
    "hsdp_zeroone_adam": "HSDP + 0/1 Adam",
    "fsdp_adamw": "FSDP (1-D) + AdamW",
}
#: The exchange by node (``hierarchical=True``): only with several nodes (benchmarks/two_nodes.py).
NODE_METHODS = ["onebit_adam_nodes", "zeroone_adam_nodes", "onebit_lamb_nodes"]
#: FSDP2 hybrid sharding: shard inside a node, exchange between nodes (benchmarks/two_nodes.py).
HSDP_METHODS = ["hsdp_adamw", "hsdp_onebit_adam", "hsdp_zeroone_adam"]
#: FSDP2 sharded over every rank (no replica to exchange with): the layout hf_onebit refuses, as a baseline.
FSDP_METHODS = ["fsdp_adamw"]


def is_fsdp_method(method: str) -> bool:
    """Whether ``method`` trains with FSDP2 (no DDP, no DDP buffer broadcast)."""
    return method.startswith(("hsdp_", "fsdp_"))
