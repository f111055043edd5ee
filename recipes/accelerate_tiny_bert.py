"""A hand-written Accelerate loop with hf_onebit: a small BERT, 1-bit Adam, save_state / load_state.

    accelerate launch --config_file recipes/accelerate/cpu_2proc.yaml -m hf_onebit.run \
        recipes/accelerate_tiny_bert.py --steps 40 --save_at 20 --out out/loop
    # continue from the saved state:
    accelerate launch --config_file recipes/accelerate/cpu_2proc.yaml -m hf_onebit.run \
        recipes/accelerate_tiny_bert.py --steps 40 --resume out/loop/state --out out/loop

The hf_onebit part is two lines: build the optimizer, and after `accelerator.prepare` call
`hf_onebit.integrations.accelerate.attach(accelerator, model, optimizer)`. It registers the
communication hook on the DDP model Accelerate built, and makes `accelerator.save_state` /
`load_state` carry every rank's compression state.
"""

import argparse
import os

import torch
from accelerate import Accelerator
from accelerate.utils import set_seed
from transformers import BertConfig, BertForSequenceClassification

import hf_onebit
from hf_onebit.integrations.accelerate import attach


def batch(step, micro, rank, n=16, seq=16, vocab=32):
    """This rank's micro-batch of a step: a function of (step, micro, rank), so a resume sees the same data."""
    g = torch.Generator().manual_seed(1000 * step + 10 * micro + rank)
    labels = torch.randint(0, 2, (n,), generator=g)
    half = (vocab - 3) // 2
    ids = torch.randint(0, half, (n, seq), generator=g) + 3 + labels[:, None] * half
    noise = torch.rand(n, seq, generator=g) < 0.3
    ids = torch.where(noise, torch.randint(3, vocab, (n, seq), generator=g), ids)
    ids[:, 0] = 1
    return {"input_ids": ids, "labels": labels}


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--accumulation", type=int, default=2)
    parser.add_argument("--freeze_step", type=int, default=10)
    parser.add_argument("--save_at", type=int, default=0, help="save_state after this step (0: never)")
    parser.add_argument("--resume", default="", help="a directory written by save_state")
    parser.add_argument("--out", default="out/loop")
    args = parser.parse_args()

    accelerator = Accelerator(gradient_accumulation_steps=args.accumulation)
    set_seed(0)
    config = BertConfig(vocab_size=32, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                        intermediate_size=64, max_position_embeddings=32, num_labels=2, initializer_range=0.1)
    model = BertForSequenceClassification(config)
    optimizer = hf_onebit.OneBitAdam(model.parameters(), lr=3e-3, freeze_step=args.freeze_step)
    model, optimizer = accelerator.prepare(model, optimizer)
    onebit = attach(accelerator, model, optimizer)

    start = 0
    if args.resume:
        accelerator.load_state(args.resume)
        start = onebit.optimizer.steps_done
    for step in range(start + 1, args.steps + 1):
        for micro in range(args.accumulation):
            with accelerator.accumulate(model):
                loss = model(**batch(step, micro, accelerator.process_index)).loss
                accelerator.backward(loss)
                optimizer.step()
                optimizer.zero_grad()
        entries = onebit.log_entries()
        if step % 5 == 0 or step == start + 1:
            # the log entries are numbers for reporters (onebit/phase 0 or 1); the console shows the name
            accelerator.print(f"step {step:3d}  loss {loss.item():.4f}  phase {onebit.optimizer.phase():<11}"
                              f"  sent {entries.get('onebit/bytes_per_step', 0) / 1e3:6.1f} kB/step")
        if step == args.save_at:
            accelerator.save_state(os.path.join(args.out, "state"))
            accelerator.print(f"saved {os.path.join(args.out, 'state')} after step {step}")
    ratio = entries.get("onebit/ratio_vs_ddp")
    accelerator.print(f"bytes sent by this rank {entries['onebit/bytes_sent']:,}; fp32 DDP would have sent"
                      f" {ratio:.1f}x as much" if ratio else "nothing sent")


if __name__ == "__main__":
    main()
