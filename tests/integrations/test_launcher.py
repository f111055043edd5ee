"""Unmodified stock scripts through the launcher (`-m hf_onebit.run`, `hf-onebit run`) and the patch."""

from __future__ import annotations

import json
import shutil
import sys

import pytest

from tests.integrations.launch import REPO, accelerate_launch, base_env, run


def test_stock_script_trains_with_onebit_adam_through_the_launcher(tmp_path):
    script = tmp_path / "run_stock.py"
    shutil.copy(REPO / "recipes" / "stock_trainer_tiny_bert.py", script)
    source = script.read_text()
    assert "import hf_onebit" not in source and "from hf_onebit" not in source  # really a stock script
    # No ACCELERATE_USE_CPU in the environment: the launcher sets it (no GPU, 2 processes).
    res = accelerate_launch(
        ["-m", "hf_onebit.run", str(script), "--output_dir", str(tmp_path / "out"), "--optim", "onebit_adam",
         "--optim_args", "freeze_step=8", "--max_steps", "24", "--save_steps", "12",
         "--per_device_train_batch_size", "16", "--learning_rate", "3e-3", "--logging_steps", "4",
         "--report_to", "none", "--disable_tqdm", "true"],
        env=base_env(cpu=False), cwd=tmp_path,
    ).check()
    assert "setting ACCELERATE_USE_CPU=1" in res.output
    assert "'onebit/phase': 1" in res.output  # the progress output shows the figures (1: compression)
    # hf_onebit's INFO messages reach a stock script's console: the phase change and the summary, once each
    assert res.output.count("entering phase 'compression'") == 1
    assert res.output.count("hf_onebit OneBitAdam on 2 ranks, 24 steps, ending in phase 'compression'") == 1
    state = json.loads((tmp_path / "out" / "trainer_state.json").read_text())
    logs = [h for h in state["log_history"] if "loss" in h]
    assert logs[0]["onebit/phase"] == 0 and logs[-1]["onebit/phase"] == 1  # warmup, then compression
    # the warmup's gradient goes at 8 bits (warmup_bits=8, the library default) plus a 4-byte scale per 32
    # elements: ~32/9 = 3.6x fewer bytes than fp32;
    # the 1-bit compression phase another ~8x fewer than that
    assert logs[0]["onebit/compression_ratio"] == pytest.approx(32 / 9, rel=0.15)
    assert logs[-1]["onebit/bytes_per_step"] < logs[0]["onebit/bytes_per_step"] / 6
    assert logs[0]["loss"] < 0.8 and logs[-1]["loss"] < logs[0]["loss"] - 0.2, [h["loss"] for h in logs]
    ranks = sorted(p.name for p in (tmp_path / "out" / "checkpoint-12" / "hf_onebit").iterdir())
    assert ranks == ["hf_onebit_rank0_of2.json", "hf_onebit_rank0_of2.pt", "hf_onebit_rank1_of2.json", "hf_onebit_rank1_of2.pt"]


def test_hf_onebit_console_script_runs_a_script_and_rejects_a_wrong_name(tmp_path):
    script = tmp_path / "run_stock.py"
    shutil.copy(REPO / "recipes" / "stock_trainer_tiny_bert.py", script)
    exe = shutil.which("hf-onebit", path=str(__import__("pathlib").Path(sys.executable).parent))
    cmd = [exe] if exe else [sys.executable, "-m", "hf_onebit.integrations.launcher"]
    res = run([*cmd, "run", str(script), "--output_dir", str(tmp_path / "o"), "--optim", "onebit_adamm"], cwd=tmp_path,
              timeout=120)
    assert res.returncode != 0
    assert "invalid choice: 'onebit_adamm'" in res.output and "'onebit_adam'" in res.output and "'binsgdm'" in res.output


@pytest.fixture
def patched():
    from hf_onebit.integrations import patch

    patch.install()
    try:
        yield patch
    finally:
        patch.uninstall()


def test_patch_makes_stock_arguments_accept_the_names_and_is_reversible(patched):
    from transformers import HfArgumentParser, Trainer, TrainingArguments
    from transformers.training_args import OptimizerNames

    import hf_onebit

    (args,) = HfArgumentParser(TrainingArguments).parse_args_into_dataclasses(
        ["--output_dir", "/tmp/x", "--optim", "binsgdm", "--adam_beta1", "0.8", "--optim_args", "seed=3",
         "--report_to", "none"]
    )
    assert args.optim == "binsgdm" and isinstance(args.optim, OptimizerNames)
    cls, kwargs = Trainer.get_optimizer_cls_and_kwargs(args)
    assert cls is hf_onebit.BinSGDM and kwargs["beta"] == 0.8 and kwargs["seed"] == 3
    assert Trainer.get_optimizer_cls_and_kwargs(TrainingArguments("/tmp/x", optim="sgd"))[0].__name__ == "SGD"
    with pytest.raises(ValueError, match="onebit_lamb"):  # a wrong name lists the valid ones, ours included
        TrainingArguments("/tmp/x", optim="onebit_lam")
    patched.uninstall()
    assert "onebit_adam" not in [m.value for m in OptimizerNames]
    with pytest.raises(ValueError):
        TrainingArguments("/tmp/x", optim="onebit_adam")
    assert not hasattr(Trainer.train, "__wrapped__")
