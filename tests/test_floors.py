"""The declared version floors, installed and tested: ``python -m pytest -m floors tests/test_floors.py``.

Not part of CI's run (about 10 minutes on 2 cores; it installs packages): run it when a floor in
pyproject.toml changes, and record the result in tests/test_packaging.py's ``FLOORS_RUN``.

A virtual environment on top of this interpreter's packages (``--system-site-packages``: the torch
installed here) gets exactly the floor of every other declared dependency: numpy, numba and the
``hf`` extra's transformers and accelerate. In it run the self-check (the numba kernels bit for bit
against the reference, a few DDP steps of every optimizer on 2 gloo ranks) and the integration tests
that drive the Trainer, Accelerate and the launcher. torch's own floor needs a CUDA machine (no CPU
wheel of an older torch is on the package indexes here): ``FLOORS_RUN`` says where it ran.
"""

from __future__ import annotations

import os
import subprocess
import sys
import venv
from pathlib import Path

import pytest
from packaging.version import Version

from tests.test_packaging import PYPROJECT, _extra, _floor, _requirements

REPO = Path(__file__).resolve().parents[1]
INTEGRATION_TESTS = [
    "tests/integrations/test_callbacks.py",        # OneBitTrainer: log keys through the reporters
    "tests/integrations/test_launcher.py",         # stock scripts through the launcher, accelerate launch
    "tests/integrations/test_accelerate_plugin.py",  # hand-written Accelerate loops, save/load state
]


@pytest.mark.floors
@pytest.mark.timeout(3600)
def test_the_self_check_and_the_integrations_pass_at_the_declared_floors(tmp_path):
    pins = [f"{r.name}=={_floor(r)}" for r in _requirements(PYPROJECT["dependencies"]) + _extra("hf")
            if r.name != "torch"]
    env_dir = tmp_path / "floors"
    venv.EnvBuilder(system_site_packages=True, with_pip=True).create(env_dir)
    py = env_dir / "bin" / "python"
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env.update(PATH=f"{env_dir / 'bin'}{os.pathsep}{env.get('PATH', '')}", OMP_NUM_THREADS="1", CI="true")

    def run(cmd, timeout):
        res = subprocess.run([str(c) for c in cmd], cwd=REPO, env=env, capture_output=True, text=True,
                             timeout=timeout)
        return res.returncode, res.stdout + res.stderr

    rc, out = run([py, "-m", "pip", "install", *pins], 900)
    assert rc == 0, out[-4000:]
    rc, out = run([py, "-c", "import importlib.metadata as m; print(' '.join(f'{n}=={m.version(n)}' for n in"
                             f" {[p.split('==')[0] for p in pins]!r}))"], 120)
    installed = out.split()
    assert rc == 0 and [i.split("==")[0] for i in installed] == [p.split("==")[0] for p in pins], out
    for have, want in zip(installed, pins):  # ==5.17 is 5.17.0
        assert Version(have.split("==")[1]) == Version(want.split("==")[1]), (have, want)
    print("floors:", " ".join(installed))

    rc, out = run([py, "-m", "hf_onebit.check", "--device", "cpu", "--size", "100000"], 900)
    assert rc == 0 and "verdict: OK" in out, out[-6000:]
    rc, out = run([py, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-o", "addopts=", *INTEGRATION_TESTS], 3000)
    assert rc == 0, out[-8000:]
    print(out.strip().splitlines()[-1])
