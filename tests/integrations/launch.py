"""Start `accelerate launch` / `python` subprocesses for the integration tests, with a timeout."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
SCRIPTS = Path(__file__).resolve().parent / "scripts"
CPU_RECIPE = REPO / "recipes" / "accelerate" / "cpu_2proc.yaml"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class Result:
    returncode: int
    output: str

    def check(self) -> Result:
        assert self.returncode == 0, f"exit code {self.returncode}; output tail:\n{self.output[-6000:]}"
        return self


def base_env(cpu: bool = True) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE",
                                                            "MASTER_ADDR", "MASTER_PORT", "ACCELERATE_USE_CPU")}
    # PYTHONFAULTHANDLER: a process that aborts (SIGABRT) prints every thread's Python stack
    env.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", HF_DATASETS_OFFLINE="1", OMP_NUM_THREADS="1",
               TOKENIZERS_PARALLELISM="false", PYTHONPATH=str(REPO), WANDB_DISABLED="true", PYTHONFAULTHANDLER="1")
    if cpu:
        env["ACCELERATE_USE_CPU"] = "1"
    return env


def run(cmd: list, env: dict | None = None, cwd: str | Path | None = None, timeout: float = 240) -> Result:
    """Run ``cmd`` in its own process group; on timeout kill the whole group and fail."""
    proc = subprocess.Popen(
        [str(c) for c in cmd], env=env if env is not None else base_env(), cwd=cwd, stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT, text=True, start_new_session=True,
    )
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        raise AssertionError(f"timed out after {timeout}s: {' '.join(map(str, cmd))}\n{(out or '')[-6000:]}") from None
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    return Result(proc.returncode, out)


def accelerate_launch(args: list, env: dict | None = None, cwd=None, timeout: float = 240, config=CPU_RECIPE) -> Result:
    """``accelerate launch --config_file <recipe> --main_process_port <free> ARGS`` (2 CPU processes)."""
    exe = Path(sys.executable).with_name("accelerate")
    launcher = [str(exe), "launch"] if exe.exists() else [sys.executable, "-m", "accelerate.commands.launch"]
    cmd = [*launcher, "--config_file", str(config), "--main_process_port", str(free_port()), *args]
    return run(cmd, env=env, cwd=cwd, timeout=timeout)
