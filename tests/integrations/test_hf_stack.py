"""The Hugging Face stack around the Trainer: a stock script through the launcher, on 2 gloo processes.

One launch (`accelerate launch -m hf_onebit.run tests/integrations/scripts/stack_train.py`) trains a
tiny BERT from a config for 24 steps in each configuration below, with `--optim onebit_adam`
(`freeze_step=8`) and, beside it where it matters, `--optim adamw_torch` with the same options:

* `--gradient_checkpointing`: the same trajectory as without it (the recomputed forward is the same);
* `--gradient_accumulation_steps 4`: the hook runs once per bucket per optimizer step, on the sync
  micro-batch only, and sends per step the bytes and rounds of the run without accumulation;
* a peft LoRA model: only the adapters (and peft's trainable classifier copy) are trained and
  compressed, the frozen base never changes;
* `--bf16 --use_cpu` (CPU autocast); `--bf16` alone on a machine without a GPU is refused by
  transformers when the arguments are parsed, naming `--use_cpu`;
* `--torch_compile --torch_compile_backend aot_eager` (dynamo's DDP graph split and AOT autograd,
  without compiling C++); the default inductor backend, which compiles C++ for a few minutes on
  CPU, is the `slow` test at the end;
* 6 steps logged at every step, `--optim adamw_torch` and `--optim onebit_adam` in its warmup:
  the logged loss is a plain mean over the global batch (the launcher applies transformers'
  loss-normalisation fix to every optimizer), and the two runs log the same losses and norms;
* a DDP model built under `torch._dynamo.config.optimize_ddp = "python_reducer"` (compiled
  autograd's reducer): refused when the hook is attached, before the first step, naming the
  alternative.

Resuming mid-run (`resume_from_checkpoint`) is tested once, bitwise, for every optimizer with
gradient accumulation in tests/integrations/test_trainer_distributed.py (and through the launcher
in docs/integrations.md's doctest); it is not repeated here.
"""

from __future__ import annotations

import importlib.util
import json
import math
import subprocess
import sys

import pytest
import torch

from hf_onebit.integrations.logs import PHASE_CODES
from tests.integrations.launch import SCRIPTS, accelerate_launch, base_env
from tests.requirements import require

PEFT = "peft: pip install peft (the dev extra)"

STEPS = 24
COMMON = ["--max_steps", str(STEPS), "--learning_rate", "3e-3", "--logging_steps", "4", "--report_to", "none",
          "--disable_tqdm", "true", "--save_strategy", "no"]


def _case(tmp, name, optim, *extra, batch=16, bucket_kb=24, **kw):
    opt = ["--optim", optim] + (["--optim_args", "freeze_step=8"] if optim == "onebit_adam" else [])
    args = ["--output_dir", str(tmp / f"out_{name}"), *COMMON, "--per_device_train_batch_size", str(batch), *opt, *extra]
    # 24 kB DDP buckets: 3 buckets for this model, so "once per bucket" differs from "once per step"
    # (dynamo's DDP optimizer refuses buckets below its 1 MB first bucket: none for --torch_compile)
    return {"name": name, "args": args, "bucket_kb": bucket_kb, **kw}


def _cases(tmp):
    cases = []
    for optim, tag in (("onebit_adam", ""), ("adamw_torch", "_adamw")):
        cases += [
            _case(tmp, "base" + tag, optim),
            _case(tmp, "ckpt" + tag, optim, "--gradient_checkpointing"),
            _case(tmp, "accum" + tag, optim, "--gradient_accumulation_steps", "4", batch=4),
            # LoRA on a randomly initialised BERT learns slowly: a larger learning rate
            *([_case(tmp, "lora" + tag, optim, "--learning_rate", "1e-2", lora=True)]
              if importlib.util.find_spec("peft") else []),
            _case(tmp, "compile" + tag, optim, "--torch_compile", "--torch_compile_backend", "aot_eager", bucket_kb=0),
        ]
    cases.append(_case(tmp, "bf16", "onebit_adam", "--bf16", "--use_cpu"))
    for optim, tag in (("onebit_adam", ""), ("adamw_torch", "_adamw")):  # later flags override COMMON's
        cases.append(_case(tmp, "logged" + tag, optim, "--max_steps", "6", "--learning_rate", "1e-3", "--logging_steps",
                           "1", "--max_grad_norm", "0", "--seed", "0",
                           *(["--optim_args", "freeze_step=100"] if optim == "onebit_adam" else [])))
    # last: building DDP under the Python reducer changes inductor's and dynamo's global settings
    cases.append(_case(tmp, "python_reducer", "onebit_adam", python_reducer=True, expect_error=True))
    return cases


def _launch(tmp, cases, timeout):
    (tmp / "cases.json").write_text(json.dumps(cases))
    res = accelerate_launch(["-m", "hf_onebit.run", str(SCRIPTS / "stack_train.py"), str(tmp / "cases.json"),
                             str(tmp / "results")], env=base_env(cpu=False), cwd=tmp, timeout=timeout).check()
    results = {c["name"]: [torch.load(tmp / "results" / f"{c['name']}_rank{r}.pt", weights_only=False)
                           for r in range(2)] for c in cases}
    return res, results


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("hf_stack")
    return _launch(tmp, _cases(tmp), timeout=900)


def _losses(result):
    return [h["loss"] for h in result["log_history"] if "loss" in h]


def _per_step(result, field):
    """Bytes sent (field 0) or rounds (1) in each optimizer step, from the cumulative counters."""
    stats = result["stats"]
    return [stats[s][field] - (stats[s - 1][field] if s > 1 else 0) for s in range(1, STEPS + 1)]


def _check_trains(result, drop=0.1):
    assert result["error"] is None, result["error"]
    assert result["world_size"] == 2
    losses = _losses(result)
    assert len(losses) == STEPS // 4 and all(math.isfinite(x) for x in losses), losses
    assert sum(losses[-2:]) / 2 < sum(losses[:2]) / 2 - drop, f"the loss does not fall: {losses}"
    return losses


def _check_compresses(result):
    """1-bit Adam's warmup (8-bit gradients and a scale per 32 elements, ~3.6x fewer bytes than fp32),
    then 1-bit momentum."""
    assert result["optimizer"] == "OneBitAdam"
    logs = [h for h in result["log_history"] if "loss" in h]
    assert logs[0]["onebit/phase"] == 0 and logs[-1]["onebit/phase"] == 1
    assert logs[0]["onebit/compression_ratio"] == pytest.approx(32 / 9, rel=0.15)
    # 1 bit against 8 (LoRA's small buckets: 5.9x, a few bytes of scales per tensor)
    assert logs[-1]["onebit/bytes_per_step"] < logs[0]["onebit/bytes_per_step"] / 5
    assert logs[-1]["onebit/compression_ratio"] > 8
    sent = _per_step(result, 0)
    assert all(b > 0 for b in sent) and max(sent[8:]) < min(sent[:8]) / 5, sent  # steps 9-24 compressed
    assert sorted(result["calls"]) == list(range(1, STEPS + 1))  # the hook ran at every step


def _beside_adamw(stack, name, margin=0.1):
    """The same options with AdamW: it trains too, and 1-bit Adam ends near it."""
    onebit, adamw = _losses(stack[1][name][0]), _check_trains(stack[1][name + "_adamw"][0], drop=0.0)
    assert stack[1][name + "_adamw"][0]["optimizer"] == "AdamW"
    assert onebit[-1] < adamw[-1] + margin, (onebit, adamw)


def test_baseline_trains_and_compresses(stack):
    for rank in range(2):
        _check_trains(stack[1]["base"][rank])
        _check_compresses(stack[1]["base"][rank])
    calls = stack[1]["base"][0]["calls"]
    assert calls[1] == 1 and {calls[s] for s in range(2, STEPS + 1)} == {3}  # DDP's first iteration: 1 bucket
    _beside_adamw(stack, "base")


def test_logged_loss_is_a_plain_mean_and_the_warmup_logs_adamws_numbers(stack):
    adamw, onebit = ([h for h in stack[1][name][0]["log_history"] if "loss" in h] for name in ("logged_adamw", "logged"))
    assert [h["step"] for h in adamw] == [h["step"] for h in onebit] == [1, 2, 3, 4, 5, 6]
    assert adamw[0]["loss"] < 0.8  # a plain mean (ln 2 = 0.69 at the start), not multiplied by the 2 processes
    for a, b in zip(adamw, onebit):
        assert b["onebit/phase"] == PHASE_CODES["warmup"]
        assert b["loss"] == pytest.approx(a["loss"], rel=2e-3), (a, b)
        assert b["grad_norm"] == pytest.approx(a["grad_norm"], rel=2e-3), (a, b)


def test_gradient_checkpointing(stack):
    result, base = stack[1]["ckpt"][0], stack[1]["base"][0]
    assert result["gradient_checkpointing"] and not base["gradient_checkpointing"]
    _check_trains(result)
    _check_compresses(result)
    # recomputing the forward in backward changes nothing: the same losses and bytes as without it
    assert _losses(result) == pytest.approx(_losses(base), rel=1e-5, abs=1e-6)
    assert result["stats"] == base["stats"] and result["calls"] == base["calls"]
    assert stack[1]["ckpt_adamw"][0]["gradient_checkpointing"]
    _beside_adamw(stack, "ckpt")


def test_gradient_accumulation_compresses_once_per_optimizer_step(stack):
    result, base = stack[1]["accum"][0], stack[1]["base"][0]
    _check_trains(result)
    _check_compresses(result)
    # 4 micro-batches of 4 per optimizer step against 1 of 16: the hook runs once per bucket per
    # optimizer step (the Trainer's no_sync on the first 3), sending the same bytes in the same rounds
    assert result["calls"] == base["calls"]
    assert _per_step(result, 0) == _per_step(base, 0)
    assert _per_step(result, 1) == _per_step(base, 1)
    assert result["stats"][STEPS][2] == base["stats"][STEPS][2]  # collectives counted
    _beside_adamw(stack, "accum")


def test_lora_trains_only_the_adapters_and_compresses_them(stack):
    require("peft", PEFT)  # an error under CI
    for rank in range(2):
        result = stack[1]["lora"][rank]
        _check_trains(result, drop=0.02)
        _check_compresses(result)
        trainable = result["trainable"]
        assert trainable and all("lora_" in n or "modules_to_save" in n for n in trainable), trainable
        # every trainable parameter moved, no frozen one did
        assert result["changed"] == trainable
    # the bytes are those of the adapters alone: far fewer than the whole model's
    assert _per_step(stack[1]["lora"][0], 0)[1] < _per_step(stack[1]["base"][0], 0)[1] / 10
    assert stack[1]["lora_adamw"][0]["changed"] == stack[1]["lora_adamw"][0]["trainable"]
    _beside_adamw(stack, "lora", margin=0.05)


def test_bf16_on_cpu(stack):
    result = stack[1]["bf16"][0]
    assert result["mixed_precision"] == "bf16"
    _check_trains(result)
    _check_compresses(result)
    assert _losses(result) != _losses(stack[1]["base"][0])  # autocast really ran


@pytest.mark.skipif(torch.cuda.is_available(), reason="bf16 without --use_cpu is accepted on a GPU")
def test_bf16_without_use_cpu_is_refused_on_a_machine_without_gpu(tmp_path):
    from hf_onebit import OneBitTrainingArguments

    with pytest.raises(ValueError, match="doesn't support bf16/gpu. You need to assign use_cpu"):
        OneBitTrainingArguments(output_dir=str(tmp_path), report_to=[], optim="onebit_adam", bf16=True)


def test_torch_compile(stack):
    result = stack[1]["compile"][0]
    assert result["model_type"] == "OptimizedModule"  # Accelerate compiled the DDP model
    _check_trains(result)
    _check_compresses(result)
    _beside_adamw(stack, "compile")


def test_python_reducer_is_refused_at_attach_naming_the_alternative(stack):
    for rank in range(2):
        result = stack[1]["python_reducer"][rank]
        error = result["error"] or ""
        assert error.startswith("UnsupportedSetup: hf_onebit does not support compiled autograd or DDP's Python reducer")
        assert "optimize_ddp = True" in error and "compiled_autograd = False" in error
        assert result["stats"] == {} and result["changed"] == []  # before any step


def test_compiled_autograd_and_the_python_reducer_are_refused_by_attach(monkeypatch):
    """The check attach runs (the real DDP under the Python reducer: the launch above)."""
    import types

    from hf_onebit.hook.attach_checks import UnsupportedSetup, check_compiled_autograd

    monkeypatch.setattr(torch._dynamo.config, "compiled_autograd", False)
    check_compiled_autograd(types.SimpleNamespace(_use_python_reducer=False))  # the default: fine
    with pytest.raises(UnsupportedSetup, match="built while torch._dynamo.config.optimize_ddp was 'python_reducer'"
                                               ".*optimize_ddp = True"):
        check_compiled_autograd(types.SimpleNamespace(_use_python_reducer=True))
    # a torch whose DDP does not say: the mode now
    monkeypatch.setattr(torch._dynamo.config, "optimize_ddp", "python_reducer")
    with pytest.raises(UnsupportedSetup, match="python_reducer"):
        check_compiled_autograd(types.SimpleNamespace())
    monkeypatch.setattr(torch._dynamo.config, "optimize_ddp", True)
    check_compiled_autograd(types.SimpleNamespace())
    # compiled autograd on: DDP's C++ reducer refuses it at the first backward, hf_onebit at attach
    monkeypatch.setattr(torch._dynamo.config, "compiled_autograd", True)
    with pytest.raises(UnsupportedSetup, match="compiled_autograd is True.*compiled_autograd = False"):
        check_compiled_autograd(types.SimpleNamespace(_use_python_reducer=False))


def test_the_check_does_not_import_dynamo_where_nothing_did():
    """Neither setting can be on unless torch._dynamo was imported: attach does not pay its import."""
    code = ("import sys, types, torch.nn.parallel; from hf_onebit.hook.attach_checks import check_compiled_autograd; "
            "check_compiled_autograd(types.SimpleNamespace(_use_python_reducer=False)); "
            "print('torch._dynamo' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "False"


def test_the_hook_refuses_a_per_parameter_call():
    """What DDP's Python reducer passes (compiled autograd): (grad, param), not a bucket."""
    from hf_onebit.hook.state import onebit_hook
    from hf_onebit.hook.attach_checks import UnsupportedSetup

    p = torch.nn.Parameter(torch.zeros(3))
    with pytest.raises(UnsupportedSetup, match="Python reducer called the communication hook with .grad, param."):
        onebit_hook(None, (torch.zeros(3), p))


@pytest.mark.slow
def test_torch_compile_with_inductor(tmp_path):
    """`--torch_compile` with its default backend (inductor): on CPU it compiles C++. Measured on 2 busy
    cores: 152 s for the 1-bit Adam run with a cold inductor cache, 82 s for the whole test with a warm one."""
    cases = [_case(tmp_path, "inductor", "onebit_adam", "--torch_compile", bucket_kb=0),
             _case(tmp_path, "inductor_adamw", "adamw_torch", "--torch_compile", bucket_kb=0)]
    _, results = _launch(tmp_path, cases, timeout=900)
    result = results["inductor"][0]
    assert result["model_type"] == "OptimizedModule"
    _check_trains(result)
    _check_compresses(result)
    adamw = _check_trains(results["inductor_adamw"][0], drop=0.0)
    assert _losses(result)[-1] < adamw[-1] + 0.1
