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


def test_info_messages_reach_the_console_unless_a_level_was_chosen(capsys):
    """hf_onebit's INFO lines (phase change, chosen freeze step, summary) show on the main process by
    default; a level the user set on the logger, or the Trainer's --log_level, wins."""
    import logging

    from hf_onebit.integrations.logs import logger, show_info

    saved = logger.level, list(logger.handlers), logger.propagate
    try:
        for main, level, expected in ((True, None, logging.INFO), (False, None, logging.WARNING),
                                      (True, logging.ERROR, logging.ERROR)):
            logger.setLevel(logging.NOTSET)
            show_info(main, level)
            assert logger.level == expected, (main, level)
        logger.setLevel(logging.WARNING)  # the user's own choice stays
        show_info(True)
        assert logger.level == logging.WARNING
        # a script that configured no logging: hf_onebit adds a handler of its own (stderr)
        logger.setLevel(logging.NOTSET)
        logger.handlers[:] = []
        logger.propagate = False  # stands for "no handler on the root logger" (pytest installs one)
        show_info(True)
        logger.info("hf_onebit X: step 4 done, entering phase 'compression'")
        assert "entering phase 'compression'" in capsys.readouterr().err
    finally:
        logger.setLevel(saved[0])
        logger.handlers[:] = saved[1]
        logger.propagate = saved[2]
