"""recipes/ddp_gpu.py, the GPU quick start of docs/getting-started.md, on its CPU fallback:
``torchrun --nproc-per-node 2`` without CUDA runs it over gloo on CPU tensors."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest

from tests.integrations.launch import REPO, base_env, free_port, run

torch = pytest.importorskip("torch")


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU fallback; on a GPU machine it would take the GPUs")
def test_the_gpu_recipe_falls_back_to_gloo_on_cpu():
    torchrun = Path(sys.executable).with_name("torchrun")
    launcher = [str(torchrun)] if torchrun.exists() else [sys.executable, "-m", "torch.distributed.run"]
    env = base_env(cpu=False)
    res = run([*launcher, "--nproc-per-node", "2", "--master-port", str(free_port()), "recipes/ddp_gpu.py",
               "--examples", "4096"], env=env, cwd=REPO, timeout=240).check()
    out = res.output
    assert "2 processes, gloo on cpu, bf16 autocast, 128 steps of 2 x 32" in out
    assert re.search(r"epoch 2  loss \d\.\d{4}  phase compression", out), out[-3000:]
    # total_steps=128 bounds the automatic freeze to steps 13-51 (10-40% of the run)
    freeze = int(re.search(r"warmup ended after step (\d+)", out).group(1))
    assert 13 <= freeze <= 51, out[-3000:]
    accuracy = float(re.search(r"dev accuracy (\d\.\d+)", out).group(1))
    assert accuracy > 0.7, out[-3000:]  # 8 classes: chance is ~0.125
    ratio = float(re.search(r"fp32 all-reduce would have sent [\d,]+ B \((\d+\.\d)x\)", out).group(1))
    assert ratio > 4.0, out[-3000:]  # an 8-bit warmup (4x) then 1-bit steps (32x)
