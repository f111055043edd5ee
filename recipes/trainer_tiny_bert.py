"""hf_onebit.OneBitTrainer: a small BERT trained with 1-bit Adam (or any --optim) on 2 CPU processes.

    accelerate launch --config_file recipes/accelerate/cpu_2proc.yaml -m hf_onebit.run \
        recipes/trainer_tiny_bert.py --output_dir out/trainer --optim onebit_adam --freeze_step 8 \
        --max_steps 24 --learning_rate 3e-3 --per_device_train_batch_size 16 --logging_steps 4

(`-m hf_onebit.run` is only there to set ACCELERATE_USE_CPU=1 on a machine without a GPU; with
GPUs use `accelerate launch --config_file recipes/accelerate/single_node_multi_gpu.yaml
recipes/trainer_tiny_bert.py ...`.) The only differences from a stock Trainer script are the two
class names: OneBitTrainingArguments (which adds --optim onebit_adam / zeroone_adam /
onebit_lamb / binsgdm and their flags) and OneBitTrainer.
"""

from dataclasses import dataclass, field

import torch
from transformers import BertConfig, BertForSequenceClassification, HfArgumentParser

from hf_onebit import OneBitTrainer, OneBitTrainingArguments


@dataclass
class TaskArguments:
    n_examples: int = field(default=256, metadata={"help": "training examples"})
    seq_len: int = field(default=16, metadata={"help": "tokens per example"})


class Synthetic(torch.utils.data.Dataset):
    """Label 1: tokens mostly from the upper half of the vocabulary; label 0: mostly the lower half."""

    def __init__(self, n, seq, vocab=32, seed=0):
        g = torch.Generator().manual_seed(seed)
        self.labels = torch.randint(0, 2, (n,), generator=g)
        half = (vocab - 3) // 2
        ids = torch.randint(0, half, (n, seq), generator=g) + 3 + self.labels[:, None] * half
        noise = torch.rand(n, seq, generator=g) < 0.3
        self.ids = torch.where(noise, torch.randint(3, vocab, (n, seq), generator=g), ids)
        self.ids[:, 0] = 1

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        return {"input_ids": self.ids[i], "labels": self.labels[i]}


def main():
    task, args = HfArgumentParser((TaskArguments, OneBitTrainingArguments)).parse_args_into_dataclasses()
    torch.manual_seed(0)
    config = BertConfig(vocab_size=32, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                        intermediate_size=64, max_position_embeddings=32, num_labels=2, initializer_range=0.1)
    model = BertForSequenceClassification(config)
    trainer = OneBitTrainer(model=model, args=args, train_dataset=Synthetic(task.n_examples, task.seq_len),
                            eval_dataset=Synthetic(64, task.seq_len, seed=1))
    trainer.train(resume_from_checkpoint=args.resume_from_checkpoint)
    metrics = trainer.evaluate()
    if trainer.is_world_process_zero():
        print(f"eval loss {metrics['eval_loss']:.4f}")


if __name__ == "__main__":
    main()
