"""--optim names, hyperparameters from the command line, the loss-scaling fix, lazy imports, recipes."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from tests.integrations.launch import REPO, base_env


def _parse(argv):
    from transformers import HfArgumentParser

    from hf_onebit import OneBitTrainingArguments

    (args,) = HfArgumentParser(OneBitTrainingArguments).parse_args_into_dataclasses(
        ["--output_dir", "/tmp/hf_onebit_test", "--report_to", "none", *argv]
    )
    return args


def test_flags_and_optim_args_become_typed_constructor_arguments():
    from hf_onebit import OneBitAdam, OneBitTrainer

    args = _parse(["--optim", "onebit_adam", "--freeze_step", "400", "--learning_rate", "2e-5",
                   "--adam_beta1", "0.8", "--adam_beta2", "0.99", "--adam_epsilon", "1e-6", "--weight_decay", "0.01",
                   "--optim_args", "auto_mask=false, bias_correction=False"])
    assert args.optim == "onebit_adam"
    cls, kwargs = OneBitTrainer.get_optimizer_cls_and_kwargs(args)
    assert cls is OneBitAdam
    assert kwargs == {"lr": 2e-5, "betas": (0.8, 0.99), "eps": 1e-6, "weight_decay": 0.01, "freeze_step": 400,
                      "auto_mask": False, "bias_correction": False}  # the rest: the constructor's defaults
    opt = cls([torch.nn.Parameter(torch.zeros(3))], **kwargs)
    assert opt.freeze_step == 400 and opt.auto_mask is False and opt.auto_freeze is None
    assert opt.scale_per_tensor is True and opt.update_clip == 1.0 and opt.warmup_bits == 8  # optim/defaults.py


@pytest.mark.parametrize("argv", [[], ["--freeze_step", "auto"], ["--optim_args", "freeze_step=auto"]])
def test_the_warmup_is_automatic_unless_given(argv):
    from hf_onebit import OneBitTrainer
    from hf_onebit.optim.freeze import AutoFreeze

    cls, kwargs = OneBitTrainer.get_optimizer_cls_and_kwargs(_parse(["--optim", "onebit_adam", *argv]))
    assert kwargs.get("freeze_step") == ("auto" if argv else None)  # not given: the constructor's default, "auto"
    opt = cls([torch.nn.Parameter(torch.zeros(3))], **kwargs)
    assert opt.auto_freeze == AutoFreeze() and opt.scale_per_tensor is True
    cls, kwargs = OneBitTrainer.get_optimizer_cls_and_kwargs(_parse(["--optim", "binsgdm"]))
    assert "freeze_step" not in kwargs and "scale_per_tensor" not in kwargs  # BinSGDM has no warmup


def test_zeroone_lamb_and_binsgdm_arguments():
    from hf_onebit import BinSGDM, OneBitLamb, OneBitTrainer, ZeroOneAdam

    cls, kw = OneBitTrainer.get_optimizer_cls_and_kwargs(
        _parse(["--optim", "zeroone_adam", "--var_freeze_step", "100", "--local_step_clipper", "8",
                "--optim_args", "var_update_scaler=4,local_step_scaler=1000"]))
    assert cls is ZeroOneAdam and kw["var_freeze_step"] == 100 and kw["local_step_clipper"] == 8
    assert kw["var_update_scaler"] == 4 and kw["local_step_scaler"] == 1000
    cls, kw = OneBitTrainer.get_optimizer_cls_and_kwargs(
        _parse(["--optim", "onebit_lamb", "--freeze_step", "10", "--optim_args", "max_coeff=0.3,min_coeff=0.01"]))
    assert cls is OneBitLamb and kw["max_coeff"] == 0.3 and isinstance(kw["max_coeff"], float)
    cls, kw = OneBitTrainer.get_optimizer_cls_and_kwargs(
        _parse(["--optim", "binsgdm", "--adam_beta1", "0.95", "--seed", "7", "--optim_args", "hierarchical=auto"]))
    assert cls is BinSGDM and kw["beta"] == 0.95 and "betas" not in kw and kw["seed"] == 7 and kw["hierarchical"] is None


def test_stock_names_still_work():
    from hf_onebit import OneBitTrainer

    args = _parse(["--optim", "adamw_torch", "--learning_rate", "1e-3"])
    cls, kw = OneBitTrainer.get_optimizer_cls_and_kwargs(args)
    assert cls is torch.optim.AdamW and kw["lr"] == 1e-3


@pytest.mark.parametrize("argv, message", [
    (["--optim", "onebit_adamm"], r"'onebit_adamm' is not a known optimizer.*onebit_adam, zeroone_adam, onebit_lamb, binsgdm.*adamw_torch"),
    (["--optim", "onebit_adam", "--optim_args", "freez_step=3"],
     r"unknown key 'freez_step' for --optim onebit_adam.*valid keys: auto_mask, bias_correction, check_finite, defaults, freeze_step, hierarchical, precondition_exchange, scale_block, scale_per_tensor, total_steps, update_clip, warmup_bits"),
    (["--optim", "onebit_adam", "--optim_args", "freeze_step=ten"], r"freeze_step must be an integer >= 1 or 'auto', got 'ten'"),
    (["--optim", "onebit_adam", "--optim_args", "auto_mask=maybe"], r"auto_mask='maybe' is not a boolean"),
    (["--optim", "onebit_adam", "--optim_args", "lr=3"], r"lr comes from the training arguments.*--learning_rate"),
    (["--optim", "binsgdm", "--optim_args", "beta=0.9"], r"beta comes from.*--adam_beta1"),
    (["--optim", "onebit_adam", "--freeze_step", "3", "--optim_args", "freeze_step=4"], r"also set by --freeze_step"),
    (["--optim", "zeroone_adam", "--freeze_step", "3"], r"--freeze_step does not apply to --optim zeroone_adam.*--var_freeze_step"),
    (["--optim", "adamw_torch", "--freeze_step", "3"], r"--freeze_step only apply to hf_onebit optimizers"),
    (["--optim", "onebit_adam", "--optim_args", "freeze_step"], r"'freeze_step' is not of the form key=value"),
    (["--optim", "onebit_adam", "--freeze_step", "-1"], r"freeze_step must be an integer >= 1"),
])
def test_bad_optimizer_arguments_fail_at_parse_time_listing_what_is_valid(argv, message):
    with pytest.raises(ValueError, match=message):
        _parse(argv)


def test_loss_kwargs_detection():
    from transformers import (
        BertConfig,
        BertForSequenceClassification,
        GPT2Config,
        GPT2LMHeadModel,
        LlamaConfig,
        LlamaForCausalLM,
        LlamaForSequenceClassification,
    )

    from hf_onebit.integrations.trainer_quirks import loss_uses_num_items

    bert = BertConfig(vocab_size=32, hidden_size=16, num_hidden_layers=1, num_attention_heads=2, intermediate_size=16)
    llama = LlamaConfig(vocab_size=32, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                        num_key_value_heads=2, intermediate_size=16, pad_token_id=0)
    assert loss_uses_num_items(BertForSequenceClassification(bert)) is False  # CrossEntropyLoss() mean in forward
    assert loss_uses_num_items(LlamaForSequenceClassification(llama)) is False  # loss function without the count
    assert loss_uses_num_items(LlamaForCausalLM(llama)) is True
    assert loss_uses_num_items(GPT2LMHeadModel(GPT2Config(vocab_size=32, n_embd=16, n_layer=1, n_head=2))) is True

    class Declared(torch.nn.Module):
        accepts_loss_kwargs = True

        def forward(self, **kwargs):
            return None

    assert loss_uses_num_items(Declared()) is True


def test_import_hf_onebit_does_not_import_transformers():
    code = ("import sys, hf_onebit; assert 'transformers' not in sys.modules, 'imported too early';"
            " hf_onebit.OneBitTrainer; assert 'transformers' in sys.modules; print('ok')")
    out = subprocess.run([sys.executable, "-c", code], env=base_env(), capture_output=True, text=True, timeout=120,
                         check=False)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr[-2000:]


@pytest.mark.parametrize("name", ["cpu_2proc", "single_node_multi_gpu", "multi_node"])
def test_recipes_load_with_accelerates_own_parser(name):
    from accelerate.commands.config.config_args import load_config_from_file

    path = REPO / "recipes" / "accelerate" / f"{name}.yaml"
    text = path.read_text()
    assert text.startswith("#") and "accelerate launch --config_file recipes/accelerate/" in text
    config = load_config_from_file(str(path))  # unknown keys are an error here
    assert str(config.distributed_type) in ("MULTI_GPU", "DistributedType.MULTI_GPU")
    assert config.num_processes >= 2
