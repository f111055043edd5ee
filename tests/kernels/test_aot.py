"""Every Triton kernel compiles ahead of time to a cubin for sm_80 (A100) and sm_90 (H100), no GPU needed."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

from tests.requirements import require

require("triton", "triton is not installed: the Triton kernels cannot be compiled")

SCRIPT = Path(__file__).with_name("aot_compile.py")
KERNELS = Path(__file__).resolve().parents[2] / "hf_onebit" / "kernels"
#: the backend's modules: triton.py (the public functions) and the triton_*.py it imports
SOURCES = sorted(KERNELS.glob("triton*.py"))


def test_every_triton_kernel_compiles_for_sm80_and_sm90():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    res = subprocess.run([sys.executable, str(SCRIPT), "80", "90"], capture_output=True, text=True, env=env,
                         timeout=900, cwd=KERNELS.parents[1])
    out = res.stdout + res.stderr
    assert res.returncode == 0, out
    # every kernel the modules define was launched and compiled for both targets
    defined = {k for path in SOURCES for k in re.findall(r"^def (_\w+_kernel)\(", path.read_text(), re.M)}
    for sm in (80, 90):
        compiled = set(re.findall(rf"^sm_{sm} ok    (_\w+_kernel) ", out, re.M))
        assert compiled == defined, (sm, sorted(defined - compiled), out[-2000:])
    assert " 0 failed" in out
