"""The ``accelerate launch`` line that the CPU tables and benchmarks run: 2 gloo processes, offline.

Used by recipes/stock_table.py, recipes/glue/run_table.py and benchmarks/time_to_accuracy.py, so
the three measure runs launched the same way a user launches them from a checkout.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

#: the launch config of two CPU processes (docs/getting-started.md)
CONFIG = Path(__file__).resolve().parent / "accelerate" / "cpu_2proc.yaml"


def launch_command(*args: str) -> list[str]:
    """``accelerate launch --config_file cpu_2proc.yaml *args``, by the ``accelerate`` executable
    beside this Python (or its module, where only the package is installed)."""
    exe = Path(sys.executable).with_name("accelerate")
    launcher = [str(exe), "launch"] if exe.exists() else [sys.executable, "-m", "accelerate.commands.launch"]
    return [*launcher, "--config_file", str(CONFIG), *args]


def offline_env(use_cpu: bool = True, **extra: str) -> dict[str, str]:
    """This process's environment, offline (no hub), with ``ACCELERATE_USE_CPU=1`` unless
    ``use_cpu`` is False (``python -m hf_onebit.run`` sets it itself where there is no GPU)."""
    env = dict(os.environ, HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", TOKENIZERS_PARALLELISM="false", **extra)
    if use_cpu:
        env["ACCELERATE_USE_CPU"] = "1"
    return env
