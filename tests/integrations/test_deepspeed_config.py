"""`hf-onebit from-deepspeed`: DeepSpeed 1-bit configs converted, each converted run trained on 2
gloo processes, every difference note and every error."""

from __future__ import annotations

import copy
import json
import shutil
import sys
import types
from pathlib import Path

import pytest
import torch
from torch.nn.parallel import DistributedDataParallel as DDP

from hf_onebit.integrations import options
from hf_onebit.integrations.deepspeed_config import ConversionError, convert, load
from hf_onebit.integrations.from_deepspeed import main
from hf_onebit.optim.defaults import LIBRARY
from tests.distributed import run_distributed
from tests.integrations.launch import run

FIXTURES = Path(__file__).resolve().parent / "deepspeed_configs"
#: the DeepSpeed tutorials' configs (1-bit Adam, 0/1 Adam, 1-bit LAMB), each with fp16 and with bf16
CONFIGS = sorted(p.stem for p in FIXTURES.glob("*.json"))
EXPECTED = {"onebit_adam": "OneBitAdam", "zeroone_adam": "ZeroOneAdam", "onebit_lamb": "OneBitLamb"}


def _config(name: str) -> dict:
    return load(str(FIXTURES / f"{name}.json"))


def _with_params(**params) -> dict:
    config = _config("onebit_adam_fp16")
    config["optimizer"]["params"].update(params)
    return config


def _notes(conv) -> dict:
    out: dict = {}
    for key, text in conv.notes:
        out.setdefault(key, []).append(text)
    return {k: " | ".join(v) for k, v in out.items()}


def test_the_six_tutorial_configs_are_there():
    assert CONFIGS == [f"{o}_{p}" for o in ("onebit_adam", "onebit_lamb", "zeroone_adam") for p in ("bf16", "fp16")]


@pytest.mark.parametrize("name", CONFIGS)
def test_the_tutorial_configs_convert(name):
    config = _config(name)
    conv = convert(config)
    optim, precision = name.rsplit("_", 1)
    params = config["optimizer"]["params"]
    assert conv.optim == optim and conv.cls_name == EXPECTED[optim] and conv.precision == precision
    assert conv.kwargs["defaults"] == "paper" and conv.kwargs["lr"] == params["lr"]
    if optim == "zeroone_adam":
        assert conv.kwargs["var_freeze_step"] == params["var_freeze_step"]  # its variance phase ends one count later
    else:
        assert conv.kwargs["freeze_step"] == params["freeze_step"] - 1  # DeepSpeed's counter runs one ahead
    assert ("bias_correction" in conv.kwargs) == (optim != "onebit_lamb")
    assert conv.kwargs.get("bias_correction", False) is False
    assert f"--{precision}" in conv.launcher_args()
    # the printed launcher line builds the same optimizer as the printed constructor call
    args = conv.launcher_args()
    flags = dict(zip(args[::2], args[1::2]))
    training = types.SimpleNamespace(
        learning_rate=float(flags["--learning_rate"]), adam_beta1=float(flags["--adam_beta1"]),
        adam_beta2=float(flags["--adam_beta2"]), adam_epsilon=float(flags["--adam_epsilon"]),
        weight_decay=float(flags["--weight_decay"]), optim_args=flags["--optim_args"], seed=0)
    cls, kwargs = options.optimizer_kwargs(conv.optim, training)
    assert cls is conv.cls
    expected = {"betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.0, **conv.kwargs}
    assert kwargs == expected
    # and the alternative with the library defaults
    _, library = options.optimizer_kwargs(conv.optim, types.SimpleNamespace(
        **{**vars(training), "optim_args": conv.optim_args(library=True)}))
    assert library == {"betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.0, **conv.library_kwargs}
    assert "defaults" not in conv.library_kwargs and "freeze_step" not in conv.library_kwargs


# --------------------------------------------------------------------------- each converted run trains
#: the tutorials' step counts shortened, so a handful of steps passes the freeze (nothing else changed)
SHORT = {"freeze_step": 5, "var_freeze_step": 4, "local_step_scaler": 2, "local_step_clipper": 4}
STEPS = 12  # 0/1 Adam: syncs at steps 5, 6, 8, 12 (intervals 1, 1, 2, 4): the last step is a sync


def _train_converted(rank, world_size, config):
    import hf_onebit
    from hf_onebit.integrations.deepspeed_config import convert

    conv = convert(config)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.Linear(32, 4))
    opt = conv.build(model.parameters())  # the converter's keyword arguments, not a copy
    ddp = DDP(model, bucket_cap_mb=0.002)  # several buckets
    dtype = {"fp16": torch.float16, "bf16": torch.bfloat16}[conv.precision]
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**8) if conv.precision == "fp16" else None
    hf_onebit.attach(ddp, opt, grad_scaler=scaler)
    data = torch.Generator().manual_seed(rank)
    phases, losses = [], []
    for _ in range(STEPS):
        x = torch.randn(16, 16, generator=data)
        with torch.autocast("cpu", dtype=dtype):
            loss = torch.nn.functional.cross_entropy(ddp(x), x[:, :4].argmax(1))
        if scaler is not None:
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
        else:
            loss.backward()
            opt.step()
        opt.zero_grad(set_to_none=True)
        phases.append(opt.phase())
        losses.append(float(loss))
    stats = opt.onebit_stats()
    return dict(phases=phases, losses=losses, steps=opt.steps_done, ratio=stats["compression_ratio"],
                params=[p.detach().clone() for p in model.parameters()])


@pytest.mark.parametrize("name", CONFIGS)
def test_each_converted_run_trains_on_two_processes(name):
    config = copy.deepcopy(_config(name))
    params = config["optimizer"]["params"]
    params.update({k: v for k, v in SHORT.items() if k in params})
    outs = run_distributed(_train_converted, 2, config)
    first = outs[0]
    assert first["steps"] == STEPS, "every step taken (no fp16 overflow skipped one)"
    compressed = "local_steps" if name.startswith("zeroone") else "compression"
    assert first["phases"][-1] == compressed and first["phases"].count(compressed) >= 4
    assert first["ratio"] > 1.5, f"compression ran: {first['ratio']}"
    assert all(torch.isfinite(torch.tensor(o["losses"])).all() for o in outs)
    for a, b in zip(first["params"], outs[1]["params"]):
        assert torch.equal(a, b), "ranks end on the same parameters"


# --------------------------------------------------------------------------- the difference notes
def test_freeze_step_notes_the_one_ahead_counter():
    notes = _notes(convert(_config("onebit_adam_fp16")))
    assert "freeze_step 23000 -> freeze_step=22999" in notes["freeze_step"] and "one ahead" in notes["freeze_step"]
    assert 'freeze_step="auto"' in notes["freeze_step"]
    config = _config("onebit_adam_fp16")
    del config["optimizer"]["params"]["freeze_step"]
    conv = convert(config)
    assert conv.kwargs["freeze_step"] == 99999
    assert "not given: DeepSpeed's default 100000" in _notes(conv)["freeze_step"]
    assert convert(_with_params(freeze_step=2)).kwargs["freeze_step"] == 1
    for no_warmup in (0, 1):
        with pytest.raises(ConversionError, match="leaves no warmup step"):
            convert(_with_params(freeze_step=no_warmup))
    lamb = _notes(convert(_config("onebit_lamb_fp16")))
    assert "freeze_step 1000 -> freeze_step=999" in lamb["freeze_step"]


def test_var_freeze_step_keeps_its_number_and_notes_the_shifted_schedules():
    note = _notes(convert(_config("zeroone_adam_fp16")))["var_freeze_step"]
    assert "var_freeze_step 1000 -> var_freeze_step=1000" in note
    assert "one step apart" in note and 'var_freeze_step="auto"' in note


def test_bias_correction_is_off_whatever_deepspeed_said():
    for value in (True, False):
        conv = convert(_with_params(bias_correction=value))
        assert conv.kwargs["bias_correction"] is False
        assert "never applied bias correction" in _notes(conv)["bias_correction"]
    config = _config("onebit_adam_fp16")
    del config["optimizer"]["params"]["bias_correction"]
    assert "not given (DeepSpeed's default true)" in _notes(convert(config))["bias_correction"]
    lamb = _config("onebit_lamb_fp16")
    lamb["optimizer"]["params"]["bias_correction"] = True
    conv = convert(lamb)
    assert "bias_correction" not in conv.kwargs and "never applied bias correction" in _notes(conv)["bias_correction"]


@pytest.mark.parametrize("name", ["onebit_adam_fp16", "zeroone_adam_fp16", "onebit_lamb_fp16"])
def test_the_paper_preset_and_what_it_changes_are_stated(name):
    conv = convert(_config(name))
    notes = _notes(conv)
    for words in ("warmup_bits=None", "full precision", "8 sends 3.6x fewer bytes", "update_clip=None",
                  "scale_per_tensor=False"):
        assert words in notes["defaults"], words
    assert ("var_update_scaler=16" in notes["defaults"]) == name.startswith("zeroone")
    assert ("step_bound=None" in notes["defaults"]) == name.startswith("onebit_lamb")
    assert "auto_mask=True" in notes["auto_mask"] and "exp_avg_mask" in notes["auto_mask"]
    assert "DDP buckets" in notes["granularity"]
    opt = conv.build([torch.nn.Parameter(torch.zeros(3))])
    assert opt.warmup_bits is None and opt.update_clip is None and opt.scale_per_tensor is False
    lib = conv.build([torch.nn.Parameter(torch.zeros(3))], library=True)
    assert lib.warmup_bits == 8 and lib.update_clip == LIBRARY[type(lib).__name__]["update_clip"] and lib.scale_per_tensor
    assert getattr(opt, "step_bound", None) is None and getattr(lib, "step_bound", None) == LIBRARY[type(lib).__name__].get("step_bound")
    assert "library defaults" in conv_report(conv)


def conv_report(conv) -> str:
    from hf_onebit.integrations.from_deepspeed import report

    return report(conv, "ds_config.json")


def test_keys_without_an_equivalent_are_ignored_with_a_note():
    conv = convert(_with_params(comm_backend_name="mpi", cuda_aware=True, eps_inside_sqrt=True, max_grad_norm=1.0,
                                amsgrad=False))
    notes = _notes(conv)
    assert "'mpi': no equivalent, ignored" in notes["comm_backend_name"]
    assert "cuda_aware true: no equivalent, ignored" in notes["cuda_aware"] and "process group" in notes["cuda_aware"]
    assert "ignored, as DeepSpeed ignored it" in notes["eps_inside_sqrt"]
    assert "ignored" in notes["max_grad_norm"]
    for key in ("comm_backend_name", "cuda_aware", "eps_inside_sqrt", "max_grad_norm", "amsgrad"):
        assert key not in conv.kwargs and key not in conv.optim_args()
    config = _config("onebit_adam_fp16")
    config.update(wall_clock_breakdown=True, my_extension={"x": 1})
    ignored = _notes(convert(config))["ignored"]
    assert "steps_per_print, prescale_gradients, wall_clock_breakdown: no effect on the optimizer" in ignored
    assert "my_extension: not converted" in ignored


def test_gradient_clipping_is_dropped_for_the_adams_and_kept_for_lamb():
    for name in ("onebit_adam_fp16", "zeroone_adam_fp16"):
        conv = convert(_config(name))
        assert conv.trainer_flags.count(("--max_grad_norm", "0")) == 1
        assert "gradient_clipping 1 -> --max_grad_norm 0" in _notes(conv)["gradient_clipping"]
    lamb = convert(_config("onebit_lamb_fp16"))
    assert ("--max_grad_norm", "1") in lamb.trainer_flags
    assert "holds the averaged momentum" in _notes(lamb)["gradient_clipping"]
    config = _config("onebit_lamb_fp16")
    del config["gradient_clipping"]
    conv = convert(config)
    assert ("--max_grad_norm", "0") in conv.trainer_flags and "as DeepSpeed" in _notes(conv)["gradient_clipping"]


def test_precision_notes():
    notes = _notes(convert(_config("onebit_adam_fp16")))
    assert "GradScaler" in notes["fp16"] and "grad_scaler=scaler" in notes["fp16"] and "static" not in notes["fp16"]
    config = _config("onebit_lamb_fp16")
    config["fp16"].update(loss_scale=128, initial_scale_power=12, loss_scale_window=500, hysteresis=2)
    notes = _notes(convert(config))
    assert "loss_scale 128 (static): not carried over" in notes["fp16"]
    assert "GradScaler(init_scale=2**12)" in notes["fp16"]
    assert "hysteresis, loss_scale_window: not carried over" in notes["fp16"]
    assert "dynamic loss scaling" in notes["loss_scale"]
    bf16 = convert(_config("zeroone_adam_bf16"))
    assert "--bf16" in bf16.launcher_args() and "fp16 only" in _notes(bf16)["bf16"]
    config = _config("onebit_adam_fp16")
    del config["fp16"]
    conv = convert(config)
    assert conv.precision is None and "--fp16" not in conv.launcher_args() and "fp16" not in _notes(conv)


def test_batch_sizes_schedule_weight_decay_and_missing_hyperparameters():
    conv = convert(_config("onebit_adam_fp16"))
    notes = _notes(conv)
    assert ("--per_device_train_batch_size", "16") in conv.trainer_flags
    assert "4096/(16 x processes)" in notes["train_batch_size"]
    assert ("--lr_scheduler_type", "constant") in conv.trainer_flags and "constant" in notes["scheduler"]
    assert "exempts biases" in notes["weight_decay"]
    assert "betas, eps not given" in notes["optimizer.params"]
    assert [f for f, _ in conv.trainer_flags][:5] == ["--learning_rate", "--adam_beta1", "--adam_beta2",
                                                       "--adam_epsilon", "--weight_decay"]
    config = _config("onebit_adam_fp16")
    config["gradient_accumulation_steps"] = 32
    config["scheduler"] = {"type": "WarmupLR", "params": {"warmup_num_steps": 1000}}
    conv = convert(config)
    assert ("--gradient_accumulation_steps", "32") in conv.trainer_flags
    assert "16 x 32 x the number of processes" in _notes(conv)["train_batch_size"]
    assert "'WarmupLR': not converted" in _notes(conv)["scheduler"]
    assert not any(f == "--lr_scheduler_type" for f, _ in conv.trainer_flags)


def test_auto_values_are_left_to_the_training_arguments():
    config = _config("onebit_adam_fp16")
    config["optimizer"]["params"].update(lr="auto", weight_decay="auto")
    config.update(gradient_clipping="auto", train_micro_batch_size_per_gpu="auto", fp16={"enabled": "auto"})
    conv = convert(config)
    notes = _notes(conv)
    assert "lr" not in conv.kwargs and "weight_decay" not in conv.kwargs
    flags = [f for f, _ in conv.trainer_flags]
    for flag in ("--learning_rate", "--weight_decay", "--max_grad_norm", "--per_device_train_batch_size", "--fp16"):
        assert flag not in flags, flag
    assert "left to the training arguments" in notes["lr"] and "as your --max_grad_norm" in notes["gradient_clipping"]
    assert 'fp16.enabled "auto"' in notes["fp16"]


def test_what_the_optimizer_warns_about_becomes_a_note():
    warning = _notes(convert(_config("zeroone_adam_fp16")))["warning"]
    assert "bias_correction=False" in warning and "96 update(s)" in warning


# --------------------------------------------------------------------------- errors
@pytest.mark.parametrize("config, words", [
    ([1, 2], "a JSON object"),
    ({"train_batch_size": 8}, 'no "optimizer"'),
    ({"optimizer": {"params": {}}}, 'no "optimizer"'),
    ({"optimizer": {"type": "Adam", "params": {}}}, "'Adam' is not one of DeepSpeed's 1-bit optimizers"),
    ({"optimizer": {"type": "OneBitAdam", "params": [1]}}, "params must be an object"),
    ({"optimizer": {"type": "OneBitAdam", "params": {"freez_step": 3}}}, "has no parameter 'freez_step'"),
    ({"optimizer": {"type": "OneBitAdam", "params": {"var_freeze_step": 3}}}, "has no parameter 'var_freeze_step'"),
    ({"optimizer": {"type": "OneBitAdam", "params": {"amsgrad": True}}}, "AMSGrad"),
    ({"optimizer": {"type": "OneBitAdam", "params": {"lr": "fast"}}}, "lr must be a number"),
    ({"optimizer": {"type": "OneBitAdam", "params": {"freeze_step": -1}}}, "freeze_step must be a non-negative integer"),
    ({"optimizer": {"type": "OneBitAdam", "params": {"freeze_step": 2.5}}}, "freeze_step must be a non-negative integer"),
    ({"optimizer": {"type": "OneBitAdam", "params": {"betas": [0.9]}}}, "betas must be a pair"),
    ({"optimizer": {"type": "OneBitLamb", "params": {"min_coeff": 2.0, "max_coeff": 1.0}}}, "refuses them: min_coeff"),
    ({"optimizer": {"type": "OneBitAdam"}, "zero_optimization": {"stage": 2}}, "zero_optimization.stage 2"),
    ({"optimizer": {"type": "OneBitAdam"}, "amp": {"enabled": True}}, "apex AMP"),
    ({"optimizer": {"type": "OneBitAdam"}, "sparse_gradients": True}, "sparse gradients"),
    ({"optimizer": {"type": "OneBitAdam"}, "fp16": {"enabled": True}, "bf16": {"enabled": True}}, "both enabled"),
    ({"optimizer": {"type": "OneBitAdam"}, "fp16": True}, "fp16 must be an object"),
    ({"optimizer": {"type": "OneBitAdam"}, "gradient_clipping": "yes"}, "gradient_clipping must be a number"),
])
def test_what_cannot_be_honoured_is_an_error(config, words):
    with pytest.raises(ConversionError, match=None) as info:
        convert(config)
    assert words in str(info.value)


def test_stage_0_and_any_case_of_the_type_convert():
    conv = convert({"optimizer": {"type": "onebitlamb"}, "zero_optimization": {"stage": 0}})
    assert conv.cls_name == "OneBitLamb" and conv.kwargs["freeze_step"] == 99999


def test_the_command_prints_the_conversion_and_fails_clearly(tmp_path, capsys):
    path = FIXTURES / "onebit_adam_fp16.json"
    assert main([str(path)]) == 0
    out = capsys.readouterr().out
    assert '--optim onebit_adam --optim_args "defaults=paper,lr=' not in out  # lr travels as --learning_rate
    assert '--optim onebit_adam --optim_args "defaults=paper,freeze_step=22999,bias_correction=false"' in out
    assert "opt = hf_onebit.OneBitAdam(model.parameters(), defaults='paper', lr=0.0004" in out
    for bad, words in (("{", "is not JSON"), ('{"optimizer": {"type": "Adam"}}', "'Adam' is not one of")):
        (tmp_path / "ds.json").write_text(bad)
        assert main([str(tmp_path / "ds.json")]) == 2
        assert words in capsys.readouterr().err
    assert main([str(tmp_path / "missing.json")]) == 2 and "cannot read" in capsys.readouterr().err
    assert main([]) == 2 and main(["a.json", "b.json"]) == 2


def test_the_console_script_has_the_command(tmp_path):
    exe = shutil.which("hf-onebit", path=str(Path(sys.executable).parent))
    cmd = [exe] if exe else [sys.executable, "-m", "hf_onebit.integrations.launcher"]
    res = run([*cmd, "from-deepspeed", str(FIXTURES / "zeroone_adam_bf16.json")], cwd=tmp_path, timeout=120).check()
    assert "--optim zeroone_adam" in res.output and "hf_onebit.ZeroOneAdam(model.parameters()" in res.output
    (tmp_path / "bad.json").write_text(json.dumps({"optimizer": {"type": "OneBitAdam"}, "zero_optimization": {"stage": 3}}))
    res = run([*cmd, "from-deepspeed", "bad.json"], cwd=tmp_path, timeout=120)
    assert res.returncode == 2 and "error: zero_optimization.stage 3" in res.output
    from hf_onebit.integrations.launcher import USAGE

    assert "hf-onebit from-deepspeed DS_CONFIG.json" in USAGE  # what --help prints
