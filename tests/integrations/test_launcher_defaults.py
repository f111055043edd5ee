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
    assert args.learning_rate == 5e-4
    assert "hf_onebit: --learning_rate 0.0005 for --optim onebit_lamb (was 5e-05" in capfd.readouterr().err
    assert _parse_stock(monkeypatch, ["--optim", "onebit_lamb", "--learning_rate", "5e-5"]).learning_rate == 5e-5
    assert _parse_stock(monkeypatch, ["--optim", "onebit_adam"]).learning_rate == 5e-5
    from hf_onebit.integrations.options import optimizer_kwargs

    assert optimizer_kwargs("onebit_lamb", args)[1]["lr"] == 5e-4  # what the optimizer gets


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
    ("freeze_step=-1", r"freeze_step must be an integer >= 1"),
    ("freez_step=8", r"unknown key 'freez_step' for --optim onebit_adam.*valid keys: auto_mask, bias_correction"),
    ("freeze_step=ten", r"freeze_step must be an integer >= 1 or 'auto', got 'ten'"),
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
    assert ("onebit_adam: auto_mask, bias_correction, check_finite, defaults, freeze_step, hierarchical,"
            " precondition_exchange, scale_block, scale_per_tensor, total_steps, update_clip, warmup_bits") in text
    assert "zeroone_adam:" in text and "freeze_step (= var_freeze_step)" in text
    assert "hf_onebit (through hf_onebit.run): onebit_adam, zeroone_adam, onebit_lamb, binsgdm" in text
    patched.uninstall()
    assert "onebit_adam" not in HfArgumentParser(TrainingArguments).format_help()


def test_the_optimizer_defaults_come_only_from_the_constructors(monkeypatch):
    """The integration passes only what the user gave; the rest is hf_onebit.optim.defaults.LIBRARY's,
    applied by the constructor as for ``OneBitAdam(params)``: a change there reaches every entry point."""
    import torch

    from hf_onebit.integrations import defaults, options
    from hf_onebit.optim import defaults as optim_defaults

    assert not hasattr(defaults, "default_freeze_arguments") and not hasattr(defaults, "FREEZE_ARGUMENT")

    class Args:
        learning_rate, adam_epsilon, weight_decay, adam_beta1, adam_beta2, optim_args = 1e-3, 1e-8, 0.0, 0.9, 0.999, ""

    for name in options.ONEBIT_OPTIMIZERS:
        cls, kwargs = options.optimizer_kwargs(name, Args())
        assert not set(kwargs) & set(optim_defaults.library_arguments(cls.__name__)), (name, kwargs)
    monkeypatch.setitem(optim_defaults.LIBRARY["OneBitAdam"], "update_clip", 2.0)
    monkeypatch.setitem(optim_defaults.LIBRARY["OneBitAdam"], "freeze_step", 7)
    cls, kwargs = options.optimizer_kwargs("onebit_adam", Args())
    opt = cls([torch.nn.Parameter(torch.zeros(3))], **kwargs)
    assert opt.update_clip == 2.0 and opt.freeze_step == 7 and opt.auto_freeze is None
    Args.optim_args = "freeze_step=3"
    assert options.optimizer_kwargs("onebit_adam", Args())[1]["freeze_step"] == 3  # the user's value wins
    Args.optim_args = "defaults=paper"
    cls, kwargs = options.optimizer_kwargs("onebit_adam", Args())
    opt = cls([torch.nn.Parameter(torch.zeros(3))], **kwargs)
    paper = optim_defaults.PAPER["OneBitAdam"]
    assert (opt.freeze_step, opt.scale_per_tensor, opt.update_clip, opt.warmup_bits) == (
        paper["freeze_step"], paper["scale_per_tensor"], paper["update_clip"], paper["warmup_bits"])


# ----------------------------------------------------------------- the launcher and OneBitTrainer agree
def _tiny_bert():
    import torch
    from transformers import BertConfig, BertForSequenceClassification

    torch.manual_seed(0)
    return BertForSequenceClassification(BertConfig(
        vocab_size=32, hidden_size=16, num_hidden_layers=1, num_attention_heads=2, intermediate_size=16,
        max_position_embeddings=16, num_labels=2))


def _resolved(trainer) -> dict:
    """What the optimizer the Trainer builds resolved its arguments to."""
    from hf_onebit.integrations.accelerate import unwrap_optimizer

    opt = unwrap_optimizer(trainer.create_optimizer())
    out = {"class": type(opt), "groups": [{k: v for k, v in g.items() if k != "params"} for g in opt.param_groups],
           "sizes": [len(g["params"]) for g in opt.param_groups]}
    for attr in ("auto_freeze", "freeze_step", "var_freeze_step", "scale_per_tensor", "scale_block", "update_clip",
                 "warmup_bits",
                 "clip_synced_momentum", "var_update_scaler", "bias_correction", "momentum_correction", "stratified_votes", "fresh_trust_ratio", "precondition_exchange", "step_bound", "seed"):
        out[attr] = getattr(opt, attr, None)
    return out


EXPECTED_MAX_GRAD_NORM = {"onebit_adam": 0.0, "zeroone_adam": 0.0, "onebit_lamb": 1.0, "binsgdm": 0.0}
EXPECTED_LEARNING_RATE = {"onebit_adam": 5e-5, "zeroone_adam": 5e-5, "onebit_lamb": 5e-4, "binsgdm": 1e-4}


@pytest.mark.parametrize("optim", list(EXPECTED_MAX_GRAD_NORM))
@pytest.mark.parametrize("flags, given", [
    ([], {}),
    (["--max_grad_norm", "0.5"], {"max_grad_norm": 0.5}),
    (["--learning_rate", "2e-4"], {"learning_rate": 2e-4}),
    (["--max-grad-norm=1.0", "--learning_rate", "5e-5"], {"max_grad_norm": 1.0, "learning_rate": 5e-5}),  # stock values
    (["--optim_args", "defaults=paper"], {}),
], ids=["none_given", "clipping_given", "lr_given", "both_given_at_stock_values", "paper_defaults"])
def test_the_same_flags_through_the_launcher_and_through_onebit_trainer_give_the_same_run(
        optim, flags, given, monkeypatch, tmp_path, capfd):
    """The issue's test: the same optimizer (class, keyword arguments, what it resolved them to),
    the same clipping and the same learning rate, and the same messages, through a stock script
    under the launcher and through OneBitTrainingArguments / OneBitTrainer."""
    from transformers import HfArgumentParser, Trainer, TrainingArguments

    from hf_onebit import OneBitTrainer, OneBitTrainingArguments
    from hf_onebit.integrations import logs, patch
    from hf_onebit.optim.defaults import LIBRARY, PAPER
    from hf_onebit.optim.freeze import AutoFreeze

    argv = ["--output_dir", str(tmp_path), "--report_to", "none", "--optim", optim, *flags]
    # OneBitTrainingArguments parsed from the command line, as a script does
    logs._announced.clear()
    monkeypatch.setattr(sys, "argv", ["onebit_script.py", *argv])
    (ours,) = HfArgumentParser(OneBitTrainingArguments).parse_args_into_dataclasses()
    ours_said = [x for x in capfd.readouterr().err.splitlines() if x.startswith("hf_onebit:")]
    ours_cls, ours_kwargs = OneBitTrainer.get_optimizer_cls_and_kwargs(ours)
    ours_opt = _resolved(OneBitTrainer(model=_tiny_bert(), args=ours))

    patch.install()
    try:
        logs._announced.clear()
        monkeypatch.setattr(sys, "argv", ["stock_script.py", *argv])  # as the launcher leaves it
        (stock,) = HfArgumentParser(TrainingArguments).parse_args_into_dataclasses()
        stock_said = [x for x in capfd.readouterr().err.splitlines() if x.startswith("hf_onebit:")]
        stock_cls, stock_kwargs = Trainer.get_optimizer_cls_and_kwargs(stock)
        stock_opt = _resolved(Trainer(model=_tiny_bert(), args=stock))
    finally:
        patch.uninstall()

    want_clip = given.get("max_grad_norm", EXPECTED_MAX_GRAD_NORM[optim])
    want_lr = given.get("learning_rate", EXPECTED_LEARNING_RATE[optim])
    assert ours.max_grad_norm == stock.max_grad_norm == want_clip
    assert ours.learning_rate == stock.learning_rate == want_lr
    assert ours_cls is stock_cls and ours_kwargs == stock_kwargs and ours_kwargs["lr"] == want_lr
    assert ours_opt == stock_opt
    assert ours_opt["class"] is ours_cls and all(g["lr"] == want_lr for g in ours_opt["groups"])
    assert ours_said == stock_said  # the same one-line messages, once
    assert len(ours_said) == (want_clip != 1.0 and "max_grad_norm" not in given) + \
        (want_lr != 5e-5 and "learning_rate" not in given)
    table = PAPER if "defaults=paper" in flags else LIBRARY
    for key, value in table.get(ours_cls.__name__, {}).items():  # the constructors' defaults, resolved
        if value == "auto":
            assert ours_opt["auto_freeze"] == AutoFreeze(), key
        else:
            assert ours_opt[key] == value, key


def test_onebit_training_arguments_built_in_python_keep_what_was_given(capfd):
    """In Python a keyword passed to the constructor is given, whatever its value; one left out is not."""
    from hf_onebit import OneBitTrainingArguments
    from hf_onebit.integrations import logs

    logs._announced.clear()
    common = dict(output_dir="/tmp/hf_onebit_test", report_to="none")
    args = OneBitTrainingArguments(optim="zeroone_adam", **common)
    assert args.max_grad_norm == 0.0 and args.learning_rate == 5e-5
    assert capfd.readouterr().err.count("hf_onebit: --max_grad_norm 0 for --optim zeroone_adam (was 1.0)") == 1
    OneBitTrainingArguments(optim="zeroone_adam", **common)
    assert "hf_onebit:" not in capfd.readouterr().err  # once per process
    args = OneBitTrainingArguments(optim="zeroone_adam", max_grad_norm=1.0, **common)  # the field's default, given
    assert args.max_grad_norm == 1.0
    args = OneBitTrainingArguments("/tmp/hf_onebit_test", optim="onebit_lamb", learning_rate=5e-5, report_to="none")
    assert args.learning_rate == 5e-5 and args.max_grad_norm == 1.0
    args = OneBitTrainingArguments(optim="onebit_lamb", **common)
    assert args.learning_rate == 5e-4
    assert "--learning_rate 0.0005 for --optim onebit_lamb (was 5e-05, the Trainer's default)" in capfd.readouterr().err
    # set_optimizer: an hf_onebit name gets the same settings unless given (here or at construction)
    args = OneBitTrainingArguments(max_grad_norm=2.0, **common)
    args.set_optimizer("binsgdm")
    assert args.optim == "binsgdm" and args.learning_rate == 1e-4 and args.max_grad_norm == 2.0
    args.set_optimizer("binsgdm", learning_rate=3e-5)
    assert args.learning_rate == 3e-5
    args = OneBitTrainingArguments(**common).set_optimizer("adamw_torch")
    assert args.learning_rate == 5e-5 and args.max_grad_norm == 1.0


def test_onebit_training_arguments_from_a_file_and_from_parser_defaults(tmp_path, capfd, monkeypatch):
    from transformers import HfArgumentParser

    from hf_onebit import OneBitTrainingArguments

    config = tmp_path / "args.json"
    config.write_text(json.dumps({"output_dir": str(tmp_path), "optim": "binsgdm", "learning_rate": 5e-5,
                                  "report_to": "none"}))
    (args,) = HfArgumentParser(OneBitTrainingArguments).parse_json_file(str(config))
    assert args.learning_rate == 5e-5 and args.max_grad_norm == 0.0  # the file's keys are given, no more
    # a script's own parser default is not given (the GLUE recipe's learning_rate=1e-4 for 1-bit LAMB)
    parser = HfArgumentParser(OneBitTrainingArguments)
    parser.set_defaults(learning_rate=1e-4)
    monkeypatch.setattr(sys, "argv", ["script.py", "--output_dir", str(tmp_path), "--optim", "onebit_lamb",
                                      "--report_to", "none"])
    (args,) = parser.parse_args_into_dataclasses()
    assert args.learning_rate == 5e-4
    assert "--learning_rate 0.0005 for --optim onebit_lamb (was 0.0001, the script's default)" in capfd.readouterr().err
    monkeypatch.setattr(sys, "argv", ["script.py", "--output_dir", str(tmp_path), "--optim", "onebit_lamb",
                                      "--learning_r", "1e-4", "--report_to", "none"])
    (args,) = parser.parse_args_into_dataclasses()
    assert args.learning_rate == 1e-4
    # a script parsing a list of its own names it, so that the list is what was given
    from hf_onebit.integrations.defaults import command_line

    own = ["--output_dir", str(tmp_path), "--optim", "binsgdm", "--max_grad_norm", "1", "--report_to", "none"]
    with command_line(own):
        (args,) = parser.parse_args_into_dataclasses(args=own)
    assert args.max_grad_norm == 1.0
    (args,) = parser.parse_args_into_dataclasses(args=own)  # without it sys.argv decides: not given there
    assert args.max_grad_norm == 0.0


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
    assert all(h["onebit/bytes_sent"] == 0 and "onebit/compression_ratio" not in h for h in logs)
    assert "communication: none (single process)" in res.output  # the end-of-training summary says why
    assert logs[-1]["loss"] < logs[0]["loss"] - 0.1, [h["loss"] for h in logs]  # unclipped BinSGDM learns


def test_stock_script_with_a_bad_optim_args_fails_before_the_model_is_built(tmp_path):
    script = _stock_script(tmp_path)
    res = run([*_console(), "run", str(script), "--output_dir", str(tmp_path / "out"), "--optim", "onebit_adam",
               "--optim_args", "freeze_step=-1"], env=base_env(cpu=False), cwd=tmp_path, timeout=120)
    assert res.returncode != 0
    assert "freeze_step must be an integer >= 1" in res.output
    assert "parse_args_into_dataclasses" in res.output and "BertForSequenceClassification(" not in res.output
    assert not (tmp_path / "out").exists()


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
