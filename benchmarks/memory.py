"""Extra memory per parameter of each optimizer, measured (not computed from a formula).

    python benchmarks/memory.py [--world-size 2]

Trains a small BERT from a config on ``--world-size`` gloo ranks with each optimizer until it is
in its communication-saving phase (``--phase warmup``: 6 steps into its warmup, at the default
``warmup_bits``, 8 bits; ``--warmup-bits 8|4|none`` for all three), then walks every tensor the
optimizer object holds (optimizer state, compression segments, work buffers, pending buffers;
each storage counted once) and prints bytes per model parameter, beside torch's AdamW for
reference. The model's own weights and gradients are not counted.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch
from torch.nn.parallel import DistributedDataParallel as DDP

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

CONFIGS = {
    "AdamW": {},
    "OneBitAdam": dict(freeze_step=2),
    "ZeroOneAdam": dict(var_freeze_step=2, local_step_scaler=1, local_step_clipper=2),
    "OneBitLamb": dict(freeze_step=2),
    "BinSGDM": {},
}


def tensor_bytes(root) -> int:
    """Bytes of every distinct tensor storage reachable from ``root`` (dicts, lists, objects)."""
    seen_storages, seen_objects = set(), set()
    total = 0
    stack = [root]
    while stack:
        obj = stack.pop()
        if isinstance(obj, torch.Tensor):
            storage = obj.untyped_storage()
            key = (storage.data_ptr(), storage.nbytes())
            if key not in seen_storages:
                seen_storages.add(key)
                total += storage.nbytes()
            continue
        if id(obj) in seen_objects or isinstance(obj, (str, bytes, int, float, bool, type(None))):
            continue
        seen_objects.add(id(obj))
        if isinstance(obj, dict):
            stack.extend(obj.values())
        elif isinstance(obj, (list, tuple, set)):
            stack.extend(obj)
        elif type(obj).__module__.startswith("hf_onebit") or hasattr(obj, "__dataclass_fields__"):
            if hasattr(obj, "__dict__"):
                stack.extend(vars(obj).values())
            for klass in type(obj).__mro__:  # __slots__ classes (BinSGDM's VoteItem) have no __dict__
                stack.extend(getattr(obj, name) for name in getattr(klass, "__slots__", ()) if hasattr(obj, name))
    return total


def _configs(phase: str, warmup_bits) -> dict:
    """The optimizers' arguments: freeze at step 2 (compression phase) or at step 100 (warmup)."""
    if phase == "compression":
        out = {k: dict(v) for k, v in CONFIGS.items()}
    else:
        # 0/1 Adam: variance steps at 1, 2, 4, 6, its 1-bit gradient steps (and their error buffers) at 3, 5
        out = {"AdamW": {}, "OneBitAdam": dict(freeze_step=100), "ZeroOneAdam": dict(var_freeze_step=100, var_update_scaler=2),
               "OneBitLamb": dict(freeze_step=100)}
    if warmup_bits != "default":
        for name in ("OneBitAdam", "ZeroOneAdam", "OneBitLamb"):
            out[name]["warmup_bits"] = warmup_bits
    return out


def _measure(rank, world_size, configs=CONFIGS):
    import hf_onebit
    from transformers import BertConfig, BertForSequenceClassification

    config = BertConfig(vocab_size=1000, hidden_size=128, num_hidden_layers=2, num_attention_heads=2,
                        intermediate_size=512, max_position_embeddings=64, num_labels=2)
    rows = {}
    for name, kwargs in configs.items():
        torch.manual_seed(0)
        model = BertForSequenceClassification(config)
        params = [p for p in model.parameters() if p.requires_grad]
        numel = sum(p.numel() for p in params)
        model_bytes = tensor_bytes(params)
        if name == "AdamW":
            opt = torch.optim.AdamW(params)
            ddp = DDP(model)
        else:
            opt = getattr(hf_onebit, name)(params, **kwargs)
            ddp = DDP(model)
            hf_onebit.attach(ddp, opt)
        g = torch.Generator().manual_seed(rank)
        for _ in range(6):
            ids = torch.randint(0, 1000, (4, 32), generator=g)
            ddp(input_ids=ids, labels=torch.randint(0, 2, (4,), generator=g)).loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
        held = tensor_bytes(opt.state) if name == "AdamW" else tensor_bytes(vars(opt))
        # The optimizer references the parameters themselves (param_groups): do not count them.
        if name != "AdamW":
            held -= model_bytes
        phase = opt.onebit_stats()["phase"] if name != "AdamW" else "-"
        rows[name] = (held / numel, phase, numel)
    return rows


def main() -> None:
    from tests.distributed import run_distributed

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--phase", choices=["compression", "warmup"], default="compression")
    parser.add_argument("--warmup-bits", default="default", choices=["default", "8", "4", "none"],
                        help="the warmups' exchange for all three Adam-family optimizers (default: each one's own)")
    args = parser.parse_args()
    bits = {"none": None, "default": "default"}.get(args.warmup_bits) or int(args.warmup_bits)
    rows = run_distributed(_measure, args.world_size, _configs(args.phase, bits), timeout=900)[0]
    numel = next(iter(rows.values()))[2]
    print(f"model: BERT from a config, {numel:,} parameters; {args.world_size} ranks; fp32 model")
    print(f"{'optimizer':<12} {'phase':<12} {'bytes/param':>12} {'vs AdamW':>9}")
    base = rows["AdamW"][0]
    for name, (per, phase, _) in rows.items():
        print(f"{name:<12} {phase:<12} {per:>12.2f} {per / base:>8.2f}x")


if __name__ == "__main__":
    main()
