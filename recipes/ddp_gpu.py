"""Plain DDP on GPUs with 1-bit Adam: one process per GPU, NCCL, bf16 autocast.

    torchrun --nproc-per-node 8 recipes/ddp_gpu.py            # one node, 8 GPUs
    torchrun --nproc-per-node 2 recipes/ddp_gpu.py            # no CUDA: 2 CPU processes over gloo
    torchrun --nnodes 2 --nproc-per-node 8 ... recipes/ddp_gpu.py --hierarchical   # by node (docs/multi-node.md)

Without CUDA it falls back to gloo and CPU tensors, so the same file runs anywhere (the test suite
runs it on 2 CPU processes). A small classification task is built here from a seeded random
"teacher" (no download), split by a ``DistributedSampler``; 1-bit Adam is told the run's length
(``total_steps``), so its automatic freeze ends the warmup within 10-40% of the run. At the end
rank 0 prints the dev accuracy and ``opt.onebit_stats()``.
"""

from __future__ import annotations

import argparse
import os

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

import hf_onebit


def make_task(n: int, features: int = 64, classes: int = 8, seed: int = 0):
    """``n`` examples of a noisy linear teacher: the same tensors on every rank."""
    g = torch.Generator().manual_seed(seed)
    teacher = torch.randn(features, classes, generator=g)
    x = torch.randn(n, features, generator=g)
    y = (x @ teacher + 0.5 * torch.randn(n, classes, generator=g)).argmax(-1)
    return x, y


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--batch-size", type=int, default=32, help="examples per rank per step")
    parser.add_argument("--examples", type=int, default=8192, help="training examples (1,024 more for dev)")
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--hierarchical", action="store_true",
                        help="the exchange by node: fp32 inside a node, 1 bit between nodes (needs several nodes)")
    args = parser.parse_args()

    cuda = torch.cuda.is_available()
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    if cuda:
        torch.cuda.set_device(local_rank)  # before anything touches the GPU
        device = torch.device("cuda", local_rank)
    else:
        device = torch.device("cpu")
    dist.init_process_group("nccl" if cuda else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()

    x, y = make_task(args.examples + 1024)
    train = TensorDataset(x[: args.examples], y[: args.examples])
    dev_x, dev_y = x[args.examples:].to(device), y[args.examples:].to(device)
    sampler = DistributedSampler(train, num_replicas=world, rank=rank, shuffle=True, seed=0, drop_last=True)
    loader = DataLoader(train, batch_size=args.batch_size, sampler=sampler, drop_last=True)
    total_steps = args.epochs * len(loader)

    torch.manual_seed(0)  # the same initial weights on every rank
    model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.GELU(), torch.nn.Linear(256, 256),
                                torch.nn.GELU(), torch.nn.Linear(256, 8)).to(device)
    opt = hf_onebit.OneBitAdam(model.parameters(), lr=args.lr, total_steps=total_steps,
                                 hierarchical=args.hierarchical)
    ddp = DDP(model, device_ids=[local_rank] if cuda else None)
    hf_onebit.attach(ddp, opt)  # after DDP, before the first backward
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1 - s / total_steps)  # decay to 0
    if rank == 0:
        print(f"{world} processes, {dist.get_backend()} on {device.type}, bf16 autocast,"
              f" {total_steps} steps of {world} x {args.batch_size}", flush=True)

    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)  # a new shuffle each epoch, the same on every rank
        for xb, yb in loader:
            xb, yb = xb.to(device, non_blocking=True), yb.to(device, non_blocking=True)
            with torch.autocast(device.type, dtype=torch.bfloat16):
                loss = torch.nn.functional.cross_entropy(ddp(xb), yb)
            loss.backward()  # each bucket is compressed and exchanged during backward
            opt.step()
            sched.step()
            opt.zero_grad(set_to_none=True)
        if rank == 0:
            print(f"epoch {epoch + 1}  loss {loss.item():.4f}  phase {opt.phase()}", flush=True)

    with torch.no_grad(), torch.autocast(device.type, dtype=torch.bfloat16):
        accuracy = (ddp.module(dev_x).argmax(-1) == dev_y).float().mean().item()
    if rank == 0:
        s = opt.onebit_stats()
        print(f"dev accuracy {accuracy:.4f}  warmup ended after step {opt.freeze_step}")
        print(f"sent {s['bytes_sent']:,} B per rank; an fp32 all-reduce would have sent"
              f" {s['fp32_allreduce_bytes']:,} B ({s['fp32_allreduce_bytes'] / s['bytes_sent']:.1f}x)", flush=True)
        if s["inter_node_ratio"] is not None:  # several nodes: the slow link's share, and the rest
            inside = s["intra_node_ratio"]
            print(f"between nodes {s['inter_node_bytes_sent']:,} B ({s['inter_node_ratio']:.1f}x fewer than fp32 DDP's);"
                  f" inside the node {s['intra_node_bytes_sent']:,} B"
                  + (f" ({inside:.1f}x)" if inside is not None else ""), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
