"""Test script: several stock-Trainer runs in one launch, for tests/integrations/test_hf_stack.py.

    accelerate launch --config_file recipes/accelerate/cpu_2proc.yaml -m hf_onebit.run \
        tests/integrations/scripts/stack_train.py CASES.json RESULT_DIR

A stock Trainer script (``HfArgumentParser(TrainingArguments)`` + ``Trainer``) started through the
launcher, like recipes/stock_trainer_tiny_bert.py, but it trains every case of ``CASES.json`` in
turn in the same processes (a fresh model and Trainer each; Accelerate's state is reset between
cases, the process group kept), so that one launch pays Python's and torch's start-up once. A case
is ``{"name": ..., "args": [TrainingArguments flags], "lora": bool, "python_reducer": bool}``.

It imports hf_onebit only to observe it: every rank writes ``RESULT_DIR/<case>_rank{r}.pt`` with
the log history, the communication hook's calls per optimizer step, the optimizer's byte and round
counters after every step, which parameters changed, the wall time, and the error of a run that
was refused.
"""

import json
import os
import sys
import time
import traceback
from collections import Counter

import torch
import torch.distributed as dist
from transformers import (
    BertConfig,
    BertForSequenceClassification,
    HfArgumentParser,
    Trainer,
    TrainerCallback,
    TrainingArguments,
)

from onebit_train import Synthetic, each_run  # the same tiny task and case loop (this script's folder is on sys.path)

from hf_onebit.integrations.accelerate import unwrap_optimizer
from hf_onebit.optim import OneBitOptimizer


class Observer(TrainerCallback):
    """The hook's calls per optimizer step and the optimizer's counters after each step."""

    def __init__(self):
        self.calls = Counter()
        self.stats = {}  # step -> (bytes_sent, rounds, calls, fp32_equivalent), cumulative
        self.opt = None

    def on_train_begin(self, args, state, control, optimizer=None, **kwargs):
        opt = unwrap_optimizer(optimizer)
        if not isinstance(opt, OneBitOptimizer) or opt.hook_state is None:
            return
        self.opt = opt
        original = opt.hook_state.reduce

        def counting(params, buffer, grads):
            self.calls[opt.steps_done + 1] += 1
            return original(params, buffer, grads)

        opt.hook_state.reduce = counting

    def on_step_end(self, args, state, control, **kwargs):
        if self.opt is not None:
            s = self.opt.exchange.stats.snapshot()
            self.stats[state.global_step] = (s.bytes_sent, s.rounds, s.calls, s.fp32_equivalent)


def build_model(lora: bool):
    torch.manual_seed(0)
    config = BertConfig(vocab_size=32, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                        intermediate_size=64, max_position_embeddings=32, num_labels=2, initializer_range=0.1)
    model = BertForSequenceClassification(config)
    if lora:
        from peft import LoraConfig, get_peft_model

        model = get_peft_model(model, LoraConfig(task_type="SEQ_CLS", r=4, lora_alpha=8, lora_dropout=0.0,
                                                 target_modules=["query", "value"]))
    return model


def run_case(case: dict, result_dir: str) -> None:
    torch._dynamo.config.optimize_ddp = "python_reducer" if case.get("python_reducer") else True
    (args,) = HfArgumentParser(TrainingArguments).parse_args_into_dataclasses(args=case["args"])
    model = build_model(case.get("lora", False))
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    trainable = sorted(n for n, p in model.named_parameters() if p.requires_grad)
    observer = Observer()
    trainer = Trainer(model=model, args=args, train_dataset=Synthetic(256, 16), callbacks=[observer])
    if case.get("bucket_kb"):  # several DDP buckets even for this tiny model
        trainer.accelerator.ddp_handler.bucket_cap_mb = case["bucket_kb"] / 1024
    start = time.perf_counter()
    error = None
    try:
        trainer.train()
    except Exception as exc:  # noqa: BLE001 - a refusal is a result
        error = f"{type(exc).__name__}: {exc}"
        if not case.get("expect_error"):
            traceback.print_exc()
    elapsed = time.perf_counter() - start
    changed = sorted(n for n, p in model.named_parameters() if not torch.equal(before[n], p.detach()))
    opt = unwrap_optimizer(trainer.optimizer)
    rank = dist.get_rank() if dist.is_initialized() else 0
    torch.save({
        "log_history": trainer.state.log_history,
        "calls": dict(observer.calls),
        "stats": observer.stats,
        "optimizer": type(opt).__name__,
        "trainable": trainable,
        "changed": changed,
        "seconds": elapsed,
        "error": error,
        "world_size": dist.get_world_size() if dist.is_initialized() else 1,
        "model_type": type(trainer.model_wrapped).__name__,
        "gradient_checkpointing": bool(getattr(trainer.accelerator.unwrap_model(trainer.model),
                                               "is_gradient_checkpointing", False)),
        "mixed_precision": trainer.accelerator.mixed_precision,
    }, os.path.join(result_dir, f"{case['name']}_rank{rank}.pt"))
    if rank == 0:
        print(f"stack_train: case {case['name']}: {elapsed:.1f} s{' (' + error + ')' if error else ''}", flush=True)
    del trainer, model
    torch._dynamo.config.optimize_ddp = True


def main():
    cases_file, result_dir = sys.argv[1], sys.argv[2]
    with open(cases_file) as f:
        cases = json.load(f)
    os.makedirs(result_dir, exist_ok=True)
    for case in each_run(cases, lambda case: case["args"]):
        run_case(case, result_dir)


if __name__ == "__main__":
    main()
