"""Every Triton kernel compiles ahead of time to a cubin for sm_80 (A100) and sm_90 (H100), no GPU
needed: in the self-test's launches, and in the variants training launches besides."""

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


def _compile(*args: str) -> str:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    root = str(KERNELS.parents[1])  # the script imports hf_onebit from this checkout
    env["PYTHONPATH"] = os.pathsep.join([root, *filter(None, [env.get("PYTHONPATH")])])
    res = subprocess.run([sys.executable, str(SCRIPT), *args, "80", "90"], capture_output=True, text=True, env=env,
                         timeout=1500, cwd=root)
    out = res.stdout + res.stderr
    assert res.returncode == 0, out[-4000:]
    assert re.search(r" 0 failed \(", out), out[-2000:]
    return out


def test_every_triton_kernel_compiles_for_sm80_and_sm90():
    out = _compile()
    # every kernel the modules define was launched and compiled for both targets
    defined = {k for path in SOURCES for k in re.findall(r"^def (_\w+_kernel)\(", path.read_text(), re.M)}
    for sm in (80, 90):
        compiled = set(re.findall(rf"^sm_{sm} ok    (_\w+_kernel) ", out, re.M))
        assert compiled == defined, (sm, sorted(defined - compiled), out[-2000:])


def test_the_variants_training_launches_compile_for_sm80_and_sm90():
    """The second list: what CompressedAllReduce and BinSGDM's layouts launch in training that the
    self-test does not (worlds of 8 and 64, rank 1 made a constant, divisibility hints, 64-bit sizes)."""
    out = _compile("--list", "training")
    summary = out.strip().splitlines()[-1]
    count = int(re.search(r"(\d+) specialisations \(training\)", summary).group(1))
    assert count > 100, summary
    for sm in (80, 90):
        lines = [ln for ln in out.splitlines() if ln.startswith(f"sm_{sm} ok    ")]
        assert len(lines) == count, (sm, len(lines), summary)
        assert any("'N_PAD': 8" in ln for ln in lines) and any("'N_PAD': 64" in ln for ln in lines)
        assert any("'rank': 1" in ln for ln in lines)  # Triton makes an int argument of 1 a constant
        assert any(re.search(r"i64=\['N', 'L'\]", ln) for ln in lines)  # a bucket of 2^31 elements or more
        assert any(re.search(r"divisible=\[[^\]]*'x_ptr'", ln) for ln in lines)  # an aligned bucket
        assert any(ln.startswith(f"sm_{sm} ok    _worker_pack_kernel ") and "divisible=[" in ln
                   and "'x_ptr'" not in ln.split("divisible=")[1] for ln in lines)  # one that starts off 16 bytes
        # every kernel of the exchange (1-bit and codes, by chunk and by piece) is among them
        kernels = {ln.split()[2] for ln in lines}
        assert {"_worker_pack_kernel", "_worker_pack_pieces_kernel", "_qworker_pack_kernel",
                "_qworker_pack_pieces_kernel", "_unpack_scaled_kernel", "_qunpack_pieces_kernel"} <= kernels
        # and BinSGDM's worker math, with 64-bit sizes and off a 16-byte boundary (its draws compile
        # to one variant whatever their arguments: the self-test's)
        votes = [ln for ln in lines if ln.startswith(f"sm_{sm} ok    _vote_threshold_kernel ")]
        assert any("i64=['numel']" in ln for ln in votes) and any("'m_ptr'" not in ln for ln in votes)
    print(summary)  # the compile time, for the record (pytest -s)
