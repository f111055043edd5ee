"""Test script: a tiny BERT trained by hf_onebit.OneBitTrainer, with instrumentation for the tests.

    accelerate launch --config_file recipes/accelerate/cpu_2proc.yaml \
        tests/integrations/scripts/onebit_train.py --output_dir out --optim onebit_adam --freeze_step 6 ...
    accelerate launch ... tests/integrations/scripts/onebit_train.py CASES.json

The second form runs every argument list of ``CASES.json`` (a JSON list of lists) in turn in the
same processes, Accelerate's state reset between them and the process group kept, so that one
launch pays Python's and torch's start-up once. Every run's rank writes ``<result_dir>/rank{r}.pt``: its final parameters, the log history, every
call of the communication hook (optimizer step, number of parameters in the bucket) and, with
``--check_grad``, the gradient norm of step 1 recomputed as the plain mean over the global batch.
"""

import copy
import json
import os
import sys
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from transformers import (
    BertConfig,
    BertForSequenceClassification,
    HfArgumentParser,
    TrainerCallback,
)

import hf_onebit
from hf_onebit.integrations.accelerate import unwrap_optimizer
from hf_onebit.integrations.defaults import command_line


@dataclass
class TaskArguments:
    n_examples: int = field(default=256)
    seq_len: int = field(default=16)
    dropout: float = field(default=0.1)
    resume: str = field(default="", metadata={"help": "a checkpoint directory, or 'last'"})
    result_dir: str = field(default="")
    check_grad: bool = field(default=False)
    bucket_kb: int = field(default=0, metadata={"help": "DDP bucket size in kB (the Trainer only takes whole MB)"})


class Synthetic(torch.utils.data.Dataset):
    """Label 1: tokens mostly from the upper half of the vocabulary; label 0: mostly the lower half."""

    def __init__(self, n, seq, vocab=32, seed=0):
        g = torch.Generator().manual_seed(seed)
        self.labels = torch.randint(0, 2, (n,), generator=g)
        half = (vocab - 3) // 2
        ids = torch.randint(0, half, (n, seq), generator=g) + 3
        ids += self.labels[:, None] * half
        noise = torch.rand(n, seq, generator=g) < 0.3  # 30% of tokens from anywhere
        self.ids = torch.where(noise, torch.randint(3, vocab, (n, seq), generator=g), ids)
        self.ids[:, 0] = 1

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        return {"input_ids": self.ids[i], "labels": self.labels[i]}


class Recorder(TrainerCallback):
    """Counts the hook's calls per optimizer step (wraps the hook state's reduce)."""

    def __init__(self):
        self.calls = []
        self.numels = []  # (step, elements in the bucket)

    def on_train_begin(self, args, state, control, optimizer=None, **kwargs):
        opt = unwrap_optimizer(optimizer)
        if not isinstance(opt, hf_onebit.OneBitOptimizer):
            return
        original = opt.hook_state.reduce

        def counting(params, buffer, grads):
            self.calls.append((opt.steps_done + 1, len(params)))
            self.numels.append((opt.steps_done + 1, sum(p.numel() for p in params)))
            return original(params, buffer, grads)

        opt.hook_state.reduce = counting


class GradCheckTrainer(hf_onebit.OneBitTrainer):
    """Records the micro-batches of step 1 and recomputes that step's plain-mean gradient norm."""

    check_grad = False
    reference = None
    inputs_step1 = None

    def training_step(self, model, inputs, num_items_in_batch=None):
        if self.check_grad and self.state.global_step == 0:
            if self.inputs_step1 is None:
                self.inputs_step1 = []
                self.reference = copy.deepcopy(self.accelerator.unwrap_model(model))
            self.inputs_step1.append({k: v.clone() for k, v in inputs.items()})
        return super().training_step(model, inputs, num_items_in_batch)

    def plain_mean_grad_norm(self):
        ref = self.reference
        ref.train()
        for batch in self.inputs_step1:  # mean loss of each micro-batch, averaged over micro-batches
            (ref(**batch).loss / len(self.inputs_step1)).backward()
        grads = [p.grad for p in ref.parameters() if p.grad is not None]
        flat = torch.cat([g.reshape(-1) for g in grads])
        dist.all_reduce(flat)  # ... and over ranks
        flat /= dist.get_world_size()
        return float(flat.norm())


def each_run(cases: list, argv_of=lambda case: case):
    """Each case of a cases file, in turn in the same processes: Accelerate's state reset before it
    (a run may ask for another mixed precision; the process group stays), its own arguments
    (``argv_of(case)``) counted as the command line the user gave, not the cases file, and a
    marker line on rank 0 where its console output starts."""
    from accelerate.state import AcceleratorState, GradientState

    for i, case in enumerate(cases):
        AcceleratorState._reset_state()
        GradientState._reset_state()
        if int(os.environ.get("RANK", "0")) == 0:
            print(f"onebit_train: run {i}", flush=True)
        with command_line(argv_of(case)):
            yield case


def train(argv: list[str]) -> None:
    parser = HfArgumentParser((TaskArguments, hf_onebit.OneBitTrainingArguments))
    task, args = parser.parse_args_into_dataclasses(args=argv)
    torch.manual_seed(0)
    config = BertConfig(vocab_size=32, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                        intermediate_size=64, max_position_embeddings=32, num_labels=2, initializer_range=0.1,
                        hidden_dropout_prob=task.dropout, attention_probs_dropout_prob=task.dropout)
    model = BertForSequenceClassification(config)
    recorder = Recorder()
    trainer = GradCheckTrainer(model=model, args=args, train_dataset=Synthetic(task.n_examples, task.seq_len),
                               eval_dataset=Synthetic(64, task.seq_len, seed=1), callbacks=[recorder])
    trainer.check_grad = task.check_grad
    if task.bucket_kb:  # several DDP buckets even for this tiny model
        trainer.accelerator.ddp_handler.bucket_cap_mb = task.bucket_kb / 1024
    resume = {"": None, "last": True}.get(task.resume, task.resume)
    trainer.train(resume_from_checkpoint=resume)

    result = {
        "params": {n: p.detach().clone() for n, p in trainer.model.named_parameters()},
        "log_history": trainer.state.log_history,
        "calls": recorder.calls,
        "bucket_numels": recorder.numels,
        "model_accepts_loss_kwargs": trainer.model_accepts_loss_kwargs,
        "world_size": dist.get_world_size() if dist.is_initialized() else 1,
    }
    if task.check_grad and trainer.reference is not None:
        result["plain_mean_grad_norm_step1"] = trainer.plain_mean_grad_norm()
    if task.result_dir:
        os.makedirs(task.result_dir, exist_ok=True)
        rank = dist.get_rank() if dist.is_initialized() else 0
        torch.save(result, os.path.join(task.result_dir, f"rank{rank}.pt"))


def main():
    if len(sys.argv) == 2 and sys.argv[1].endswith(".json"):
        with open(sys.argv[1]) as f:
            for argv in each_run(json.load(f)):
                train(argv)
    else:
        train(sys.argv[1:])


if __name__ == "__main__":
    main()
