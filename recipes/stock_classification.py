"""A stock text-classification script (no hf_onebit import), shaped like transformers' run_classification.py.

    accelerate launch --config_file cpu_2proc.yaml -m hf_onebit.run recipes/stock_classification.py \
        --model_name_or_path <model> --train_file train.csv --validation_file validation.csv \
        --output_dir out/cls --optim onebit_adam

It is the stock path of the stock table (``recipes/stock_table.py`` runs it once per
optimizer): ``HfArgumentParser`` over its own dataclasses and the stock ``TrainingArguments``,
CSV files with a text column and a ``label`` column, ``AutoModelForSequenceClassification``, the
stock ``Trainer``, and ``all_results.json`` written by ``Trainer.save_metrics`` (the train metrics
carry hf_onebit's ``onebit/*`` counters when its optimizers ran). Every training argument keeps the
Trainer's default unless given on the command line, which is the point: the launcher supplies what
each hf_onebit optimizer needs.
"""

from dataclasses import dataclass, field
from typing import Optional

import numpy as np
from datasets import load_dataset
from transformers import (
    AutoModelForSequenceClassification,
    AutoTokenizer,
    DataCollatorWithPadding,
    HfArgumentParser,
    Trainer,
    TrainingArguments,
    set_seed,
)


@dataclass
class ModelArguments:
    model_name_or_path: str = field(metadata={"help": "a local model directory or a Hub name"})


@dataclass
class DataArguments:
    train_file: str = field(metadata={"help": "CSV file: a text column and a 'label' column"})
    validation_file: str = field(metadata={"help": "CSV file, same columns"})
    text_column: str = field(default="sentence", metadata={"help": "the column holding the text"})
    max_seq_length: int = field(default=128, metadata={"help": "longer texts are truncated"})
    max_eval_samples: Optional[int] = field(default=None, metadata={"help": "evaluate on the first N only"})


def main():
    model_args, data_args, training_args = HfArgumentParser(
        (ModelArguments, DataArguments, TrainingArguments)).parse_args_into_dataclasses()
    set_seed(training_args.seed)  # before the model, whose new head is drawn from it (as run_classification.py)
    raw = load_dataset("csv", data_files={"train": data_args.train_file, "validation": data_args.validation_file})
    labels = sorted(set(raw["train"]["label"]))
    label_id = {label: i for i, label in enumerate(labels)}
    tokenizer = AutoTokenizer.from_pretrained(model_args.model_name_or_path)
    model = AutoModelForSequenceClassification.from_pretrained(model_args.model_name_or_path, num_labels=len(labels))

    def tokenize(batch):
        out = tokenizer(batch[data_args.text_column], truncation=True, max_length=data_args.max_seq_length)
        out["labels"] = [label_id[label] for label in batch["label"]]
        return out

    with training_args.main_process_first(desc="tokenizing"):
        data = raw.map(tokenize, batched=True, remove_columns=raw["train"].column_names)
    validation = data["validation"]
    if data_args.max_eval_samples is not None:
        validation = validation.select(range(min(len(validation), data_args.max_eval_samples)))

    def accuracy(p):
        return {"accuracy": float((np.argmax(p.predictions, axis=1) == p.label_ids).mean())}

    trainer = Trainer(model=model, args=training_args, train_dataset=data["train"], eval_dataset=validation,
                      processing_class=tokenizer, data_collator=DataCollatorWithPadding(tokenizer),
                      compute_metrics=accuracy)
    result = trainer.train(resume_from_checkpoint=training_args.resume_from_checkpoint)
    trainer.save_metrics("train", result.metrics)
    metrics = trainer.evaluate()
    trainer.save_metrics("eval", metrics)
    if trainer.is_world_process_zero():
        print(f"eval accuracy {metrics['eval_accuracy']:.4f}  eval loss {metrics['eval_loss']:.4f}")


if __name__ == "__main__":
    main()
