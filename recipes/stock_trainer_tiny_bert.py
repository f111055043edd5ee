"""A stock Hugging Face Trainer script (no hf_onebit import): run it through hf_onebit's launcher.

    accelerate launch --config_file recipes/accelerate/cpu_2proc.yaml -m hf_onebit.run \
        recipes/stock_trainer_tiny_bert.py --output_dir out/stock --optim onebit_adam \
        --optim_args "freeze_step=8" --max_steps 24 --learning_rate 3e-3 --per_device_train_batch_size 16

It stands for scripts like transformers' run_glue.py: HfArgumentParser over its own dataclass
and the stock TrainingArguments, a model, the stock Trainer. Here the model is a small BERT built
from a config and the task is synthetic (label 1: tokens mostly from the upper half of the
vocabulary), so it needs no download. The tests run a copy of this file, unmodified.
"""

from dataclasses import dataclass, field

import torch
from transformers import (
    BertConfig,
    BertForSequenceClassification,
    HfArgumentParser,
    Trainer,
    TrainingArguments,
)


@dataclass
class TaskArguments:
    n_examples: int = field(default=256, metadata={"help": "training examples"})
    seq_len: int = field(default=16, metadata={"help": "tokens per example"})


class Synthetic(torch.utils.data.Dataset):
    def __init__(self, n, seq, vocab=32, seed=0):
        g = torch.Generator().manual_seed(seed)
        self.labels = torch.randint(0, 2, (n,), generator=g)
        half = (vocab - 3) // 2
        ids = torch.randint(0, half, (n, seq), generator=g) + 3 + self.labels[:, None] * half
        noise = torch.rand(n, seq, generator=g) < 0.3  # 30% of the tokens from anywhere
        self.ids = torch.where(noise, torch.randint(3, vocab, (n, seq), generator=g), ids)
        self.ids[:, 0] = 1  # [CLS]

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        return {"input_ids": self.ids[i], "labels": self.labels[i]}


def main():
    task, training_args = HfArgumentParser((TaskArguments, TrainingArguments)).parse_args_into_dataclasses()
    torch.manual_seed(0)
    config = BertConfig(vocab_size=32, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                        intermediate_size=64, max_position_embeddings=32, num_labels=2, initializer_range=0.1)
    model = BertForSequenceClassification(config)
    trainer = Trainer(model=model, args=training_args, train_dataset=Synthetic(task.n_examples, task.seq_len),
                      eval_dataset=Synthetic(64, task.seq_len, seed=1))
    trainer.train(resume_from_checkpoint=training_args.resume_from_checkpoint)
    metrics = trainer.evaluate()
    if trainer.is_world_process_zero():
        print(f"eval loss {metrics['eval_loss']:.4f}")
    trainer.save_model()
    trainer.save_state()


if __name__ == "__main__":
    main()
