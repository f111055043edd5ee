"""The log keys reach every reporter (they run after hf_onebit's callback) and the saved log history."""

from __future__ import annotations

import torch
from transformers import TrainerCallback


class Reporter(TrainerCallback):
    """Stands for TensorBoard / W&B: records what on_log hands it."""

    def __init__(self):
        self.seen = []

    def on_log(self, args, state, control, logs=None, **kwargs):
        self.seen.append(dict(logs))


def test_log_keys_reach_reporters_and_log_history(tmp_path):
    from transformers import BertConfig, BertForSequenceClassification

    from hf_onebit import OneBitTrainer, OneBitTrainingArguments
    from hf_onebit.integrations.callbacks import OneBitCallback

    torch.manual_seed(0)
    model = BertForSequenceClassification(BertConfig(
        vocab_size=32, hidden_size=16, num_hidden_layers=1, num_attention_heads=2, intermediate_size=16,
        max_position_embeddings=16, num_labels=2))
    data = [{"input_ids": torch.tensor([1, 5 + i % 3, 6, 7]), "labels": torch.tensor(i % 2)} for i in range(16)]
    args = OneBitTrainingArguments(output_dir=str(tmp_path), report_to=[], optim="onebit_adam", freeze_step=2,
                                   max_steps=4, logging_steps=2, per_device_train_batch_size=4, save_strategy="no",
                                   disable_tqdm=True)
    reporter = Reporter()
    trainer = OneBitTrainer(model=model, args=args, train_dataset=data, callbacks=[reporter])
    assert isinstance(trainer.callback_handler.callbacks[0], OneBitCallback)
    trainer.train()
    train_logs = [entry for entry in reporter.seen if "loss" in entry]
    assert len(train_logs) == 2
    for entry in train_logs:
        assert {"onebit/phase", "onebit/bytes_sent"} <= set(entry)
    # one process: nothing is communicated, and the phases still advance (0: warmup, 1: compression)
    assert [e["onebit/phase"] for e in train_logs] == [0, 1]
    assert all(e["onebit/bytes_sent"] == 0 for e in train_logs)
    # every value is a number (a string would be a text entry in TensorBoard, dropped by MLflow)
    assert all(isinstance(v, (int, float)) for e in train_logs for k, v in e.items() if k.startswith("onebit/"))
    history = [h for h in trainer.state.log_history if "loss" in h]
    assert all("onebit/phase" in h for h in history)


def test_a_freeze_step_past_max_steps_is_warned_about(tmp_path, caplog):
    import logging

    from transformers import BertConfig, BertForSequenceClassification

    from hf_onebit import OneBitTrainer, OneBitTrainingArguments

    model = BertForSequenceClassification(BertConfig(
        vocab_size=32, hidden_size=16, num_hidden_layers=1, num_attention_heads=2, intermediate_size=16,
        max_position_embeddings=16, num_labels=2))
    data = [{"input_ids": torch.tensor([1, 5, 6, 7]), "labels": torch.tensor(i % 2)} for i in range(8)]
    args = OneBitTrainingArguments(output_dir=str(tmp_path), report_to=[], optim="onebit_adam", freeze_step=10,
                                   max_steps=2, per_device_train_batch_size=4, save_strategy="no", disable_tqdm=True)
    with caplog.at_level(logging.WARNING, logger="hf_onebit"):
        OneBitTrainer(model=model, args=args, train_dataset=data).train()
    assert "freeze_step=10 >= max_steps=2" in caplog.text
