"""What the launcher does when a stock script's TrainingArguments are parsed, and what it says.

In-process (the patch installed, a stock ``HfArgumentParser(TrainingArguments)``) for the table of
defaults, the parse-time checks and the help text; through ``hf-onebit run`` on one process and
``accelerate launch -m hf_onebit.run`` on two for the stock-script behaviour.
"""

from __future__ import annotations

import json
import shutil
import sys

import pytest

from tests.integrations.launch import REPO, accelerate_launch, base_env, run


@pytest.fixture
def patched():
    from hf_onebit.integrations import logs, patch

    patch.install()
    logs._announced.clear()
    try:
        yield patch
    finally:
        patch.uninstall()


def _parse_stock(monkeypatch, argv):
    """Parse ``argv`` as a stock script does, with ``sys.argv`` as the launcher leaves it."""
    from transformers import HfArgumentParser, TrainingArguments

    argv = ["--output_dir", "/tmp/hf_onebit_test", "--report_to", "none", *argv]
    monkeypatch.setattr(sys, "argv", ["stock_script.py", *argv])
    (args,) = HfArgumentParser(TrainingArguments).parse_args_into_dataclasses(argv)
    return args


def test_no_clipping_for_binsgdm_and_the_adams_unless_given(patched, monkeypatch, capfd):
    args = _parse_stock(monkeypatch, ["--optim", "binsgdm"])
    assert args.max_grad_norm == 0.0
    err = capfd.readouterr().err
    assert "hf_onebit: --max_grad_norm 0 for --optim binsgdm (was 1.0)" in err and "Pass --max_grad_norm" in err
    assert _parse_stock(monkeypatch, ["--optim", "onebit_adam"]).max_grad_norm == 0.0
    assert _parse_stock(monkeypatch, ["--optim", "zeroone_adam"]).max_grad_norm == 0.0
    # given explicitly, in any spelling argparse accepts: kept
    for flag in (["--max_grad_norm", "1.0"], ["--max-grad-norm=1.0"], ["--max_grad", "1.0"]):
        assert _parse_stock(monkeypatch, ["--optim", "binsgdm", *flag]).max_grad_norm == 1.0, flag
    # not ours, or not in the table (1-bit LAMB): untouched
    assert _parse_stock(monkeypatch, ["--optim", "adamw_torch"]).max_grad_norm == 1.0
    assert _parse_stock(monkeypatch, ["--optim", "onebit_lamb"]).max_grad_norm == 1.0


def test_lamb_learning_rate_unless_given(patched, monkeypatch, capfd):
    args = _parse_stock(monkeypatch, ["--optim", "onebit_lamb"])
    assert args.learning_rate == 1e-3
    assert "hf_onebit: --learning_rate 0.001 for --optim onebit_lamb (was 5e-05" in capfd.readouterr().err
    assert _parse_stock(monkeypatch, ["--optim", "onebit_lamb", "--learning_rate", "5e-5"]).learning_rate == 5e-5
    assert _parse_stock(monkeypatch, ["--optim", "onebit_adam"]).learning_rate == 5e-5
    from hf_onebit.integrations.options import optimizer_kwargs

    assert optimizer_kwargs("onebit_lamb", args)[1]["lr"] == 1e-3  # what the optimizer gets


def test_binsgdm_learning_rate_unless_given(patched, monkeypatch, capfd):
    args = _parse_stock(monkeypatch, ["--optim", "binsgdm"])
    assert args.learning_rate == 1e-4 and args.max_grad_norm == 0.0
    assert "hf_onebit: --learning_rate 0.0001 for --optim binsgdm (was 5e-05" in capfd.readouterr().err
    assert _parse_stock(monkeypatch, ["--optim", "binsgdm", "--learning_rate", "5e-5"]).learning_rate == 5e-5


def test_a_json_arguments_file_counts_as_given(patched, monkeypatch, tmp_path):
    from transformers import HfArgumentParser, TrainingArguments

    config = tmp_path / "args.json"
    config.write_text(json.dumps({"output_dir": str(tmp_path), "optim": "onebit_lamb", "learning_rate": 5e-5,
                                  "report_to": "none"}))
    monkeypatch.setattr(sys, "argv", ["stock_script.py", str(config)])
    (args,) = HfArgumentParser(TrainingArguments).parse_json_file(str(config))
    assert args.learning_rate == 5e-5 and args.max_grad_norm == 1.0  # LAMB is not in the no-clipping table


@pytest.mark.parametrize("optim_args, message", [
    ("freeze_step=-1", r"freeze_step must be an integer >= 0"),
    ("freez_step=8", r"unknown key 'freez_step' for --optim onebit_adam.*valid keys: auto_mask, bias_correction"),
    ("freeze_step=ten", r"freeze_step must be an integer >= 0 or 'auto', got 'ten'"),
    ("lr=3", r"lr comes from the training arguments.*--learning_rate"),
])
def test_optim_args_mistakes_fail_when_the_arguments_are_parsed(patched, monkeypatch, optim_args, message):
    with pytest.raises(ValueError, match=message):
        _parse_stock(monkeypatch, ["--optim", "onebit_adam", "--optim_args", optim_args])


def test_freeze_step_means_var_freeze_step_for_zeroone_adam(patched, monkeypatch, capfd):
    from transformers import Trainer

    args = _parse_stock(monkeypatch, ["--optim", "zeroone_adam", "--optim_args", "freeze_step=10"])
    cls, kwargs = Trainer.get_optimizer_cls_and_kwargs(args)
    assert cls.__name__ == "ZeroOneAdam" and kwargs["var_freeze_step"] == 10 and "freeze_step" not in kwargs
    assert "hf_onebit: --optim_args freeze_step=10 means var_freeze_step=10 for --optim zeroone_adam" in capfd.readouterr().err
    with pytest.raises(ValueError, match="var_freeze_step is given twice|also set"):
        _parse_stock(monkeypatch, ["--optim", "zeroone_adam", "--optim_args", "freeze_step=10,var_freeze_step=4"])


def test_help_lists_our_names_and_their_optim_args(patched):
    from transformers import HfArgumentParser, TrainingArguments

    text = " ".join(HfArgumentParser(TrainingArguments).format_help().split())
    assert "onebit_adam: auto_mask, bias_correction, check_finite, freeze_step, hierarchical, scale_per_tensor, update_clip" in text
    assert "zeroone_adam:" in text and "freeze_step (= var_freeze_step)" in text
    assert "hf_onebit (through hf_onebit.run): onebit_adam, zeroone_adam, onebit_lamb, binsgdm" in text
    patched.uninstall()
    assert "onebit_adam" not in HfArgumentParser(TrainingArguments).format_help()


def test_default_freeze_arguments_is_the_one_place_the_warmup_default_is_decided(monkeypatch):
    from hf_onebit.integrations import defaults, options

    class Args:
        learning_rate, adam_epsilon, weight_decay, adam_beta1, adam_beta2, optim_args = 1e-3, 1e-8, 0.0, 0.9, 0.999, ""

    assert defaults.default_freeze_arguments("onebit_adam") == {"freeze_step": "auto", "scale_per_tensor": True,
                                                                "update_clip": 1.0}
    assert defaults.default_freeze_arguments("zeroone_adam") == {"var_freeze_step": "auto", "scale_per_tensor": True,
                                                                 "update_clip": 1.0, "clip_synced_momentum": False}
    assert defaults.default_freeze_arguments("onebit_lamb") == {"freeze_step": "auto", "scale_per_tensor": True,
                                                                "update_clip": 1.0}
    assert defaults.default_freeze_arguments("binsgdm") == {}
    monkeypatch.setattr(options, "default_freeze_arguments", lambda name: {"freeze_step": 7})
    assert options.optimizer_kwargs("onebit_adam", Args())[1]["freeze_step"] == 7
    Args.optim_args = "freeze_step=3"
    assert options.optimizer_kwargs("onebit_adam", Args())[1]["freeze_step"] == 3  # the user's value wins


def _stock_script(tmp_path):
    script = tmp_path / "run_stock.py"
    shutil.copy(REPO / "recipes" / "stock_trainer_tiny_bert.py", script)
    return script


def _console():
    exe = shutil.which("hf-onebit", path=str(__import__("pathlib").Path(sys.executable).parent))
    return [exe] if exe else [sys.executable, "-m", "hf_onebit.integrations.launcher"]


def test_stock_script_on_one_process_binsgdm_learns_and_says_nothing_is_communicated(tmp_path):
    script = _stock_script(tmp_path)
    res = run([*_console(), "run", str(script), "--output_dir", str(tmp_path / "out"), "--optim", "binsgdm",
               "--max_steps", "16", "--learning_rate", "3e-3", "--per_device_train_batch_size", "16",
               "--logging_steps", "4", "--report_to", "none", "--disable_tqdm", "true", "--save_strategy", "no",
               "--fp16", "--use_cpu"], env=base_env(cpu=False), cwd=tmp_path, timeout=180).check()
    assert "hf_onebit: --max_grad_norm 0 for --optim binsgdm" in res.output
    assert res.output.count("nothing is communicated or compressed") == 1
    assert res.output.count("--fp16 on cpu: Accelerate runs this in fp32") == 1
    state = json.loads((tmp_path / "out" / "trainer_state.json").read_text())
    logs = [h for h in state["log_history"] if "loss" in h]
    assert all(h["onebit/communication"] == "none (single process)" and h["onebit/bytes_sent"] == 0 for h in logs)
    assert logs[-1]["loss"] < logs[0]["loss"] - 0.1, [h["loss"] for h in logs]  # unclipped BinSGDM learns


def test_stock_script_with_a_bad_optim_args_fails_before_the_model_is_built(tmp_path):
    script = _stock_script(tmp_path)
    res = run([*_console(), "run", str(script), "--output_dir", str(tmp_path / "out"), "--optim", "onebit_adam",
               "--optim_args", "freeze_step=-1"], env=base_env(cpu=False), cwd=tmp_path, timeout=120)
    assert res.returncode != 0
    assert "freeze_step must be an integer >= 0" in res.output
    assert "parse_args_into_dataclasses" in res.output and "BertForSequenceClassification(" not in res.output
    assert not (tmp_path / "out").exists()


def _logged(out):
    state = json.loads((out / "trainer_state.json").read_text())
    return [h for h in state["log_history"] if "loss" in h]


def test_logged_loss_of_adamw_and_onebit_adam_warmup_agree_on_two_processes(tmp_path):
    """The launcher applies transformers' loss-normalisation fix to every optimizer: same numbers."""
    script = _stock_script(tmp_path)
    common = [str(script), "--max_steps", "6", "--learning_rate", "1e-3", "--per_device_train_batch_size", "16",
              "--logging_steps", "1", "--report_to", "none", "--disable_tqdm", "true", "--save_strategy", "no",
              "--max_grad_norm", "0", "--seed", "0"]
    env = base_env(cpu=False)
    accelerate_launch(["-m", "hf_onebit.run", *common, "--output_dir", str(tmp_path / "adamw"), "--optim",
                       "adamw_torch"], env=env, cwd=tmp_path).check()
    accelerate_launch(["-m", "hf_onebit.run", *common, "--output_dir", str(tmp_path / "onebit"), "--optim",
                       "onebit_adam", "--optim_args", "freeze_step=100,bias_correction=true"], env=env,
                      cwd=tmp_path).check()
    adamw, onebit = _logged(tmp_path / "adamw"), _logged(tmp_path / "onebit")
    assert [h["step"] for h in adamw] == [h["step"] for h in onebit] == [1, 2, 3, 4, 5, 6]
    assert adamw[0]["loss"] < 0.8  # a plain mean (ln 2 = 0.69 at the start), not multiplied by the 2 processes
    for a, b in zip(adamw, onebit):
        assert b["onebit/phase"] == "warmup"
        assert b["loss"] == pytest.approx(a["loss"], rel=2e-3), (a, b)
        assert b["grad_norm"] == pytest.approx(a["grad_norm"], rel=2e-3), (a, b)


def test_the_freeze_warning_names_the_option_a_stock_script_accepts(patched, monkeypatch, tmp_path, caplog):
    import logging

    import torch
    from transformers import BertConfig, BertForSequenceClassification, Trainer

    args = _parse_stock(monkeypatch, ["--optim", "onebit_adam", "--optim_args", "freeze_step=10", "--max_steps", "2",
                                      "--per_device_train_batch_size", "4", "--save_strategy", "no",
                                      "--disable_tqdm", "true", "--output_dir", str(tmp_path)])
    model = BertForSequenceClassification(BertConfig(
        vocab_size=32, hidden_size=16, num_hidden_layers=1, num_attention_heads=2, intermediate_size=16,
        max_position_embeddings=16, num_labels=2))
    data = [{"input_ids": torch.tensor([1, 5, 6, 7]), "labels": torch.tensor(i % 2)} for i in range(8)]
    with caplog.at_level(logging.WARNING, logger="hf_onebit"):
        Trainer(model=model, args=args, train_dataset=data).train()
    assert "freeze_step=10 >= max_steps=2" in caplog.text
    assert 'Set --optim_args "freeze_step=1"' in caplog.text and "--freeze_step " not in caplog.text


def test_the_onebit_training_arguments_help_formats():
    """argparse formats help with '%': a bare percent sign in any of our help texts breaks --help."""
    from transformers import HfArgumentParser

    from hf_onebit.integrations.trainer import OneBitTrainingArguments

    text = " ".join(HfArgumentParser(OneBitTrainingArguments).format_help().split())
    assert "--freeze_step" in text and "between 10 and 40 percent of the run" in text
