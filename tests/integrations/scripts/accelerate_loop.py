"""Test script: a hand-written Accelerate loop with hf_onebit's plugin, saved and resumed.

    ACCELERATE_USE_CPU=1 accelerate launch --config_file recipes/accelerate/cpu_2proc.yaml \
        tests/integrations/scripts/accelerate_loop.py --optim zeroone_adam --out DIR

Run 1 trains ``--steps`` optimizer steps (2 micro-batches each, ``accelerator.accumulate``)
and calls ``accelerator.save_state`` after step ``--save_at``. Run 2, in the same process with a
fresh Accelerator, model and optimizer, calls ``accelerator.load_state`` on that checkpoint and
trains the remaining steps. Every rank writes ``DIR/rank{r}.pt``: both runs' final parameters,
the log entries and the hook's calls per step.
"""

import argparse
import os

import torch
from accelerate import Accelerator
from accelerate.utils import set_seed
from transformers import BertConfig, BertForSequenceClassification

import hf_onebit
from hf_onebit.integrations.accelerate import attach

OPTIMIZERS = {
    "onebit_adam": lambda p: hf_onebit.OneBitAdam(p, lr=3e-3, freeze_step=4),
    "zeroone_adam": lambda p: hf_onebit.ZeroOneAdam(p, lr=3e-3, var_freeze_step=4, var_update_scaler=2,
                                                    local_step_scaler=3, local_step_clipper=4),
}


def batch(step, micro, rank, n=8, seq=16, vocab=32):
    g = torch.Generator().manual_seed(1000 * step + 10 * micro + rank)
    labels = torch.randint(0, 2, (n,), generator=g)
    half = (vocab - 3) // 2
    ids = torch.randint(0, half, (n, seq), generator=g) + 3 + labels[:, None] * half
    ids[:, 0] = 1
    return {"input_ids": ids, "labels": labels}


def train(args, start, stop, save_dir=None, load_dir=None):
    accelerator = Accelerator(gradient_accumulation_steps=2)
    set_seed(0)
    config = BertConfig(vocab_size=32, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                        intermediate_size=64, max_position_embeddings=32, num_labels=2, initializer_range=0.1)
    model = BertForSequenceClassification(config)
    optimizer = OPTIMIZERS[args.optim](model.parameters())
    model, optimizer = accelerator.prepare(model, optimizer)
    onebit = attach(accelerator, model, optimizer)
    calls = []
    inner, link = onebit.optimizer, onebit.optimizer.hook_state
    original = link.reduce

    def counting(params, buffer, grads):
        calls.append(inner.steps_done + 1)
        return original(params, buffer, grads)

    link.reduce = counting
    if load_dir:
        accelerator.load_state(load_dir)
    logs = []
    rank = accelerator.process_index
    for step in range(start + 1, stop + 1):
        for micro in range(2):
            with accelerator.accumulate(model):
                loss = model(**batch(step, micro, rank)).loss
                accelerator.backward(loss)
                optimizer.step()
                optimizer.zero_grad()
        logs.append({"step": step, "loss": float(loss), **onebit.log_entries()})
        if save_dir and step == args.save_at:
            accelerator.save_state(save_dir)
    params = {n: p.detach().clone() for n, p in accelerator.unwrap_model(model).named_parameters()}
    summary = onebit.summary()
    accelerator.print(summary)
    onebit.remove()
    return params, logs, calls, summary


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--optim", default="zeroone_adam", choices=sorted(OPTIMIZERS))
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--save_at", type=int, default=9)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    ckpt = os.path.join(args.out, "state")
    full, logs, calls, summary = train(args, 0, args.steps, save_dir=ckpt)
    resumed, logs2, _, _ = train(args, args.save_at, args.steps, load_dir=ckpt)
    rank = torch.distributed.get_rank()
    torch.save({"full": full, "resumed": resumed, "logs": logs, "logs_resumed": logs2, "calls": calls, "summary": summary,
                "files": sorted(os.listdir(os.path.join(ckpt, "hf_onebit")))},
               os.path.join(args.out, f"rank{rank}.pt"))


if __name__ == "__main__":
    main()
