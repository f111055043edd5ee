"""Start-up refusals: each names what is unsupported and the alternative."""

from __future__ import annotations

import types

import pytest
import torch

from tests.integrations.launch import SCRIPTS, accelerate_launch, base_env


def _tiny_bert():
    from transformers import BertConfig, BertForSequenceClassification

    torch.manual_seed(0)
    cfg = BertConfig(vocab_size=32, hidden_size=16, num_hidden_layers=1, num_attention_heads=2, intermediate_size=16,
                     max_position_embeddings=16, num_labels=2)
    return BertForSequenceClassification(cfg)


def _args(tmp_path, **kw):
    from hf_onebit import OneBitTrainingArguments

    return OneBitTrainingArguments(output_dir=str(tmp_path), report_to=[], optim="onebit_adam", **kw)


def test_fsdp_is_refused_naming_plain_ddp(tmp_path):
    from hf_onebit.integrations.checks import UnsupportedSetup

    with pytest.raises(UnsupportedSetup, match="does not support FSDP.*plain DDP.*adamw_torch"):
        _args(tmp_path, fsdp="full_shard")


def test_deepspeed_is_refused_naming_plain_ddp_and_the_converter(tmp_path):
    from hf_onebit.integrations.checks import UnsupportedSetup

    with pytest.raises(UnsupportedSetup, match="does not support DeepSpeed.*plain DDP.*hf-onebit from-deepspeed"):
        _args(tmp_path, deepspeed={"zero_optimization": {"stage": 2}})


def test_accelerate_fsdp_deepspeed_megatron_and_parallelism_config_are_refused():
    from hf_onebit.integrations.checks import UnsupportedSetup, check_distributed_type

    for kind, words in [("FSDP", "FSDP"), ("DEEPSPEED", "DeepSpeed"), ("MEGATRON_LM", "Megatron")]:
        with pytest.raises(UnsupportedSetup, match=words):
            check_distributed_type(kind)
    with pytest.raises(UnsupportedSetup, match="tp_size=2.*one device per process"):
        check_distributed_type("MULTI_GPU", types.SimpleNamespace(tp_size=2, cp_size=1, sp_size=1, dp_shard_size=1))
    check_distributed_type("MULTI_GPU", types.SimpleNamespace(tp_size=1, cp_size=1, sp_size=1, dp_shard_size=1))
    check_distributed_type("MULTI_CPU")


def test_an_fsdp_launch_that_accelerate_runs_as_ddp_is_announced(monkeypatch):
    from hf_onebit.integrations import checks, logs

    monkeypatch.setattr(logs, "_announced", set())
    monkeypatch.setenv("RANK", "0")
    assert checks.note_fsdp_not_run("MULTI_CPU", env={"ACCELERATE_USE_FSDP": "true"})
    monkeypatch.setattr(logs, "_announced", set())
    assert not checks.note_fsdp_not_run("MULTI_CPU", env={})  # no FSDP asked for
    assert not checks.note_fsdp_not_run("FSDP", env={"ACCELERATE_USE_FSDP": "true"})  # refused elsewhere


FSDP2_CPU_CONFIG = """\
compute_environment: LOCAL_MACHINE
distributed_type: FSDP
num_machines: 1
num_processes: 2
machine_rank: 0
use_cpu: true
mixed_precision: 'no'
rdzv_backend: static
same_network: true
main_training_function: main
fsdp_config:
  fsdp_version: 2
  fsdp_auto_wrap_policy: TRANSFORMER_BASED_WRAP
  fsdp_transformer_layer_cls_to_wrap: BertLayer
  fsdp_state_dict_type: SHARDED_STATE_DICT
"""


def test_an_fsdp_config_on_cpu_trains_as_ddp_and_says_so(tmp_path):
    """Accelerate 1.15 runs `distributed_type: FSDP` as DDP on CPU processes; hf_onebit compresses
    that DDP and tells the user the model is not sharded."""
    config = tmp_path / "fsdp2_cpu.yaml"
    config.write_text(FSDP2_CPU_CONFIG)
    res = accelerate_launch(
        [str(SCRIPTS / "onebit_train.py"), "--output_dir", str(tmp_path / "o"), "--optim", "onebit_adam",
         "--freeze_step", "2", "--max_steps", "4", "--report_to", "none", "--use_cpu"],
        config=config, timeout=240,
    ).check()
    assert "the launch asked for FSDP (distributed_type: FSDP), but Accelerate runs MULTI_CPU" in res.output
    assert "entering phase 'compression'" in res.output


@pytest.mark.parametrize("how", ["device_map", "tp_plan"])
def test_model_parallel_models_are_refused(tmp_path, how):
    from hf_onebit import OneBitTrainer
    from hf_onebit.integrations.checks import UnsupportedSetup

    model = _tiny_bert()
    if how == "device_map":  # what from_pretrained(device_map="auto") leaves on a model split over two GPUs
        model.hf_device_map = {"bert.embeddings": 0, "bert.encoder": 1, "classifier": 1}
        match = "device_map.*one device per process"
    else:  # from_pretrained(tp_plan="auto") sets the tensor-parallel degree
        model._tp_size = 2
        match = "tensor parallel.*no tp_plan"
    with pytest.raises(UnsupportedSetup, match=match):
        OneBitTrainer(model=model, args=_args(tmp_path))


def _dtensor_model(rank, world_size):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import distribute_tensor

    from hf_onebit.integrations.checks import UnsupportedSetup, check_model

    model = torch.nn.Linear(4, 4)
    mesh = init_device_mesh("cpu", (world_size,))
    model.weight = torch.nn.Parameter(distribute_tensor(model.weight.detach(), mesh))
    try:
        check_model(model)
    except UnsupportedSetup as exc:
        return str(exc)
    return None


def test_dtensor_parameters_are_refused():
    from tests.distributed import run_distributed

    message = run_distributed(_dtensor_model, 1, timeout=120)[0]
    assert message is not None and "DTensor" in message and "one device per process" in message


def test_sparse_gradients_are_refused(tmp_path):
    from hf_onebit import OneBitTrainer
    from hf_onebit.integrations.checks import UnsupportedSetup

    model = _tiny_bert()
    model.bert.embeddings.word_embeddings.sparse = True
    with pytest.raises(UnsupportedSetup, match="sparse gradients.*word_embeddings.*sparse=False"):
        OneBitTrainer(model=model, args=_args(tmp_path))


def test_lone_ranks_are_refused():
    from hf_onebit.integrations.checks import UnsupportedSetup, check_launch

    with pytest.raises(UnsupportedSetup, match="one of 2.*train alone.*ACCELERATE_USE_CPU=1.*hf_onebit.run"):
        check_launch(1, env={"WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2"}, dist_initialized=True)
    with pytest.raises(UnsupportedSetup, match="no torch.distributed process group"):
        check_launch(1, env={"LOCAL_WORLD_SIZE": "4"}, dist_initialized=False)
    check_launch(1, env={}, dist_initialized=False)  # a plain single process is fine
    check_launch(2, env={"WORLD_SIZE": "2"}, dist_initialized=True)
    check_launch(16, env={"WORLD_SIZE": "16", "LOCAL_WORLD_SIZE": "8"}, dist_initialized=True)


def test_lone_ranks_are_refused_for_real(tmp_path):
    """The recipe without ACCELERATE_USE_CPU: two processes, each of which Accelerate runs alone."""
    res = accelerate_launch(
        [str(SCRIPTS / "onebit_train.py"), "--output_dir", str(tmp_path / "o"), "--optim", "onebit_adam",
         "--max_steps", "2", "--report_to", "none"],
        env=base_env(cpu=False), timeout=180,
    )
    assert res.returncode != 0
    assert "UnsupportedSetup: hf_onebit: this process was launched as one of 2" in res.output
    assert "ACCELERATE_USE_CPU=1" in res.output


def test_find_unused_parameters_is_refused_for_cpu_buckets(monkeypatch):
    from hf_onebit.integrations.checks import UnsupportedSetup, check_find_unused

    monkeypatch.setattr(torch.distributed, "is_initialized", lambda: True)
    model = torch.nn.Linear(2, 2)  # CPU parameters: their buckets go through the communication thread
    with pytest.raises(UnsupportedSetup, match="find_unused_parameters=True.*--ddp_find_unused_parameters false"):
        check_find_unused(types.SimpleNamespace(find_unused_parameters=True, process_group=None, module=model))
    check_find_unused(types.SimpleNamespace(find_unused_parameters=False, process_group=None, module=model))
    # Buckets that run inline (CUDA) are fine, whatever the backend is called: the device decides.
    monkeypatch.setattr(torch.distributed, "get_backend", lambda group=None: "gloo")
    monkeypatch.setattr("hf_onebit.hook.attach_checks.runs_inline", lambda device: True)
    check_find_unused(types.SimpleNamespace(find_unused_parameters=True, process_group=None, module=model))


def test_onebit_arguments_default_find_unused_parameters_off(tmp_path):
    assert _args(tmp_path).ddp_find_unused_parameters is False
    assert _args(tmp_path, ddp_find_unused_parameters=True).ddp_find_unused_parameters is True


def test_binsgdm_with_clipping_warns(tmp_path, caplog):
    """Not a refusal: clipping the vote average shrinks BinSGDM's steps; say so. (Left out,
    ``max_grad_norm`` is 0 for BinSGDM: hf_onebit.integrations.defaults; given, it is kept.)"""
    from hf_onebit import OneBitTrainer, OneBitTrainingArguments

    args = OneBitTrainingArguments(output_dir=str(tmp_path), report_to=[], optim="binsgdm", max_steps=1,
                                   per_device_train_batch_size=2, save_strategy="no", max_grad_norm=1.0)
    assert args.max_grad_norm == 1.0
    data = [{"input_ids": torch.tensor([1, 5, 6, 7]), "labels": torch.tensor(1)}] * 2
    trainer = OneBitTrainer(model=_tiny_bert(), args=args, train_dataset=data)
    with caplog.at_level("WARNING", logger="hf_onebit"):
        trainer.train()
    assert "clips BinSGDM's vote average" in caplog.text and "--max_grad_norm 0" in caplog.text


def test_jit_checkpoint_is_refused(tmp_path):
    from hf_onebit import OneBitTrainer
    from hf_onebit.integrations.checks import UnsupportedSetup

    with pytest.raises(UnsupportedSetup, match="--enable_jit_checkpoint.*--save_steps"):
        OneBitTrainer(model=_tiny_bert(), args=_args(tmp_path, enable_jit_checkpoint=True))
