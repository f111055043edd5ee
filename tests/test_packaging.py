"""The package as a user installs it: what it asks pip for, its extras, and the wheel outside the checkout.

* The core dependencies leave the user's torch and its Triton alone (issue: a ``triton>=3.4``
  requirement made pip replace a CUDA torch, or leave it with a Triton it does not support).
* Every declared floor is one that was installed and tested (the record is :data:`FLOORS_RUN`),
  and the torch floor pins a Triton the kernels can use (:data:`TORCH_TRITON_PINS`).
* Without the ``hf`` extra (transformers, accelerate) and without Triton, the core works and the
  parts that need them say what to install; on CUDA a missing Triton is an error, never a silent
  fallback to other kernels.
* The layers import one way: ``kernels -> comm -> exchange -> optim -> hook``.
* The wheel, installed into a fresh virtual environment, runs from a folder outside the checkout:
  ``hf-onebit check``, ``hf-onebit config`` and an unmodified Trainer script through the launcher
  (marked slow: it installs packages).
"""

from __future__ import annotations

import ast
import importlib.metadata
import json
import os
import shutil
import socket
import subprocess
import sys
import textwrap
import time
import venv
import zipfile
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.version import Version

try:
    import tomllib
except ImportError:  # Python 3.10
    tomllib = pytest.importorskip("tomli")

REPO = Path(__file__).resolve().parents[1]
PYPROJECT = tomllib.loads((REPO / "pyproject.toml").read_text(encoding="utf-8"))["project"]

# The Triton that each torch release's CUDA wheels pin (Requires-Dist of the manylinux x86_64 cp311
# wheel on PyPI), read from PyPI's metadata with
#   pip install --dry-run --no-deps --ignore-installed --report out.json torch==X
# (`pip --isolated ...` for 2.13.0, whose on-disk CPU wheel here carries no Triton requirement).
# 2.4 pins it for x86_64 and Python < 3.13 only; from 2.12 on every Linux wheel pins it; 2.14.1 pins
# triton~=3.8.0. The CPU wheels (+cpu, from PyTorch's own index) pin none.
TORCH_TRITON_PINS = {
    "2.4": "3.0.0",
    "2.8": "3.4.0",
    "2.9": "3.5.0",
    "2.10": "3.6.0",
    "2.11": "3.6.0",
    "2.12": "3.7.0",
    "2.13": "3.7.1",
    "2.14": "3.8.0",
}

# Where each declared floor was installed and tested. Lowering a floor in pyproject.toml fails
# test_every_floor_was_installed_and_tested until the lower version has run and is recorded here.
FLOORS_RUN = {
    "torch": ("2.11", "torch 2.11.0+cu130 with its triton 3.6.0 on an NVIDIA H200: the Triton kernel"
                      " contract suite (HF_ONEBIT_TEST_TRITON_DEVICE=cuda); the whole suite runs in CI on 2.13.0+cpu"),
    "numpy": ("2.4", "tests/test_floors.py: numpy 2.4.0 with numba 0.68.0 on torch 2.13.0+cpu (the self-check)"),
    "numba": ("0.68", "tests/test_floors.py: numba 0.68.0 with numpy 2.4.0 on torch 2.13.0+cpu (the self-check)"),
    "transformers": ("5.17", "tests/test_floors.py: transformers 5.17.0 with accelerate 1.3.0 on torch 2.13.0+cpu"),
    "accelerate": ("1.3", "tests/test_floors.py: accelerate 1.3.0 with transformers 5.17.0 on torch 2.13.0+cpu"
                          " (1.1.0 fails: Accelerator.unwrap_model() has no keep_torch_compile)"),
}

# The oldest Triton that compiles every kernel (hf_onebit/kernels/triton*.py) for sm_80/sm_90, by
# tests/kernels/aot_compile.py; 3.0 rejects a tl.arange of ours.
TRITON_FLOOR = Version("3.4")


def _requirements(names: list[str]) -> list[Requirement]:
    return [Requirement(r) for r in names]


def _floor(req: Requirement) -> Version:
    """The lower bound of ``req`` (``>=X``); fails on any other kind of specifier."""
    bounds = [s for s in req.specifier]
    assert [s.operator for s in bounds] == [">="], f"{req}: declare a floor only (>=), no pin or ceiling"
    return Version(bounds[0].version)


def _extra(name: str) -> list[Requirement]:
    return _requirements(PYPROJECT["optional-dependencies"][name])


#: The package's lower layers, lowest first: each imports from the package only layers before it.
LAYERS = ["kernels", "comm", "exchange", "optim", "hook"]
#: lower layers a layer still may not import: the optimizers reach the network only through
#: their exchange
BYPASSES = {"optim": {"comm"}}


def _package_imports(path: Path) -> set[str]:
    """The ``hf_onebit`` subpackages and modules a file imports, anywhere in it (functions included)."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.ImportFrom):
            modules = [node.module or ""] if node.level == 0 else []
        elif isinstance(node, ast.Import):
            modules = [a.name for a in node.names]
        else:
            continue
        names.update(m.split(".")[1] for m in modules if m.startswith("hf_onebit."))
    return names


def test_the_layers_import_one_way():
    package = REPO / "hf_onebit"
    wrong = []
    for k, layer in enumerate(LAYERS):
        files = sorted((package / layer).rglob("*.py")) if (package / layer).is_dir() else [package / f"{layer}.py"]
        allowed = set(LAYERS[: k + 1]) - BYPASSES.get(layer, set())
        for path in files:
            wrong += [f"{path.relative_to(REPO)} imports hf_onebit.{m}" for m in sorted(_package_imports(path) - allowed)]
    assert not wrong, wrong


def test_core_dependencies_are_floors_of_torch_numpy_numba_only():
    core = _requirements(PYPROJECT["dependencies"])
    assert sorted(r.name for r in core) == ["numba", "numpy", "torch"]  # no triton, transformers, accelerate
    for req in core:
        assert req.marker is None, f"{req}: the core asks every platform for the same"
        _floor(req)


def test_the_hf_extra_holds_transformers_and_accelerate_and_dev_installs_every_extra_the_tests_use():
    assert sorted(r.name for r in _extra("hf")) == ["accelerate", "transformers"]
    dev = _extra("dev")
    self_refs = [r for r in dev if r.name == "hf-onebit"]
    assert self_refs and {"hf", "recipes"} <= set().union(*(r.extras for r in self_refs))
    triton = [r for r in dev if r.name == "triton"]
    assert len(triton) == 1 and _floor(triton[0]) == TRITON_FLOOR  # the interpreter tests on CPU
    for extra in ("recipes", "bench"):  # run_glue.py is a Trainer script; the benchmarks' models are transformers'
        assert any("hf" in r.extras for r in _extra(extra) if r.name == "hf-onebit"), extra


def test_every_floor_was_installed_and_tested():
    declared = {r.name: _floor(r) for r in _requirements(PYPROJECT["dependencies"]) + _extra("hf")}
    assert set(declared) == set(FLOORS_RUN)
    for name, floor in declared.items():
        assert floor == Version(FLOORS_RUN[name][0]), (
            f"{name}>={floor} is declared, {FLOORS_RUN[name][0]} was run ({FLOORS_RUN[name][1]}): install and test"
            " the new floor, then record it in FLOORS_RUN"
        )


def test_the_torch_floor_pins_a_triton_the_kernels_compile_with():
    floor = _floor(next(r for r in _requirements(PYPROJECT["dependencies"]) if r.name == "torch"))
    key = f"{floor.major}.{floor.minor}"
    assert key in TORCH_TRITON_PINS, f"torch>={floor}: look up the Triton its CUDA wheels pin and add it"
    for torch_version, pin in TORCH_TRITON_PINS.items():
        if Version(torch_version) >= Version(key):
            assert Version(pin) >= TRITON_FLOOR, (
                f"torch {torch_version} pins triton {pin}, older than the {TRITON_FLOOR} the kernels need:"
                f" a CUDA user at the torch floor {floor} would get kernels that do not compile"
            )
    # and the floor is where it is for a reason: the oldest torch in the table whose pin compiles
    oldest_usable = min((Version(t) for t, p in TORCH_TRITON_PINS.items() if Version(p) >= TRITON_FLOOR))
    assert floor >= oldest_usable


def test_the_installed_torchs_own_triton_pin_meets_the_kernels_floor():
    """On a CUDA wheel of torch (the GPU machines): its pin, and the Triton it brought, are new enough."""
    pins = [Requirement(r) for r in importlib.metadata.requires("torch") or []]
    pins = [r for r in pins if r.name == "triton" and (r.marker is None or r.marker.evaluate({"extra": ""}))]
    if not pins:
        pytest.skip(f"torch {torch_version()} (a CPU wheel) pins no Triton: nothing to compare")
    for pin in pins:
        lowest = min(Version(s.version) for s in pin.specifier if s.operator in ("==", "~=", ">="))
        assert lowest >= TRITON_FLOOR, f"torch {torch_version()} requires {pin}; the kernels need >= {TRITON_FLOOR}"
    installed = Version(importlib.metadata.version("triton"))
    assert installed >= TRITON_FLOOR and all(installed in pin.specifier for pin in pins)


def torch_version() -> str:
    return importlib.metadata.version("torch")


# ------------------------------------------------------------------ without the extras, without Triton
# One Python process (importing torch costs seconds) in which transformers, accelerate and triton
# cannot be imported, as if not installed; each test below reads its own section of the output.
_WITHOUT_EXTRAS = textwrap.dedent("""
    import sys
    for _name in ("transformers", "accelerate", "triton"):
        sys.modules[_name] = None

    import torch, hf_onebit
    from hf_onebit.integrations.launcher import config_names, main
    from hf_onebit.kernels import get_backend, load_backend

    model = torch.nn.Linear(8, 2)
    opt = hf_onebit.OneBitAdam(model.parameters(), lr=1e-3)
    model(torch.randn(4, 8)).sum().backward()
    opt.step()                                     # one process: uncompressed, but a real step
    print("core: backend", get_backend("cpu").__name__)
    print("core: configs", config_names())

    for what, pick in (("get_backend(cuda)", lambda: get_backend(torch.device("cuda", 0))),
                       ("load_backend(triton)", lambda: load_backend("triton"))):
        try:
            print("cuda:", what, "fell back to", pick().__name__)
        except ImportError as exc:
            print("cuda:", what, "ImportError:", exc)

    import hf_onebit.integrations as integrations
    for what, pick in (("hf_onebit.OneBitTrainer", lambda: hf_onebit.OneBitTrainer),
                       ("OneBitAccelerator()", lambda: integrations.OneBitAccelerator()),
                       ("integrations.OneBitCallback", lambda: integrations.OneBitCallback)):
        try:
            print("lazy:", what, "imported", pick())
        except ImportError as exc:
            print("lazy:", what, "ImportError:", exc)

    try:
        main(["run", sys.argv[1], "--output_dir", "out", "--optim", "onebit_adam"])
        print("launcher: ran")
    except BaseException as exc:                   # PatchError, or SystemExit
        print("launcher:", type(exc).__name__, str(exc).replace("\\n", " "))
    print("core: loaded", sorted(m for m in ("transformers", "accelerate", "triton") if sys.modules.get(m)))
""")


@pytest.fixture(scope="module")
def without_extras(tmp_path_factory) -> dict[str, list[str]]:
    folder = tmp_path_factory.mktemp("without_extras")
    script = folder / "run_stock.py"
    shutil.copy(REPO / "recipes" / "stock_trainer_tiny_bert.py", script)
    env = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", "HF_ONEBIT_KERNELS")}
    env.update(PYTHONPATH=str(REPO), OMP_NUM_THREADS="1")
    res = subprocess.run([sys.executable, "-c", _WITHOUT_EXTRAS, str(script)], cwd=folder, env=env,
                         capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stdout + res.stderr
    sections: dict[str, list[str]] = {}
    for line in res.stdout.splitlines():
        tag, _, rest = line.partition(": ")
        sections.setdefault(tag, []).append(rest)
    return sections


def test_the_core_works_without_transformers_accelerate_and_triton(without_extras):
    assert without_extras["core"] == [
        "backend hf_onebit.kernels.cpu",
        "configs ['cpu_2proc', 'multi_node', 'single_node_multi_gpu']",
        "loaded []",
    ]


def test_the_launcher_without_the_hf_extra_names_it(without_extras):
    (line,) = without_extras["launcher"]
    assert line.startswith("PatchError") and "pip install 'hf-onebit[hf]'" in line, line


def test_cuda_tensors_without_triton_raise_instead_of_falling_back(without_extras):
    """No CUDA needed: choosing the backend for a CUDA device imports the Triton kernels."""
    lines = without_extras["cuda"]
    assert [line.split(" ")[0] for line in lines] == ["get_backend(cuda)", "load_backend(triton)"]
    assert all(" ImportError: " in line and "reinstall your CUDA build of torch" in line for line in lines), lines


def test_the_hf_names_without_the_hf_extra_name_it(without_extras):
    """``hf_onebit.OneBitTrainer``, the integrations' lazy names and ``OneBitAccelerator()`` (its
    module imports without accelerate: its functions only need the objects) say which extra to install."""
    lines = without_extras["lazy"]
    assert len(lines) == 3, lines
    assert all(" ImportError: " in line and "pip install 'hf-onebit[hf]'" in line for line in lines), lines


# ------------------------------------------------------------------ the wheel, outside the checkout
def _run(cmd: list, cwd: Path, env: dict, timeout: float) -> subprocess.CompletedProcess:
    """Run ``cmd``; print how long it took (``-s`` shows where this test's minutes go)."""
    start = time.perf_counter()
    res = subprocess.run([str(c) for c in cmd], cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    res.output = res.stdout + res.stderr  # type: ignore[attr-defined]
    words = [Path(str(c)).name if i == 0 else str(c) for i, c in enumerate(cmd[:4])]
    print(f"  {time.perf_counter() - start:6.1f} s  {' '.join(words)}", flush=True)
    return res


def _link_installed_torch(site_packages: Path) -> None:
    """Put the torch this test runs on into a fresh venv, file by file from its RECORD (hard links,
    else copies): the same files ``pip install torch==<this version>`` would write, in a second
    instead of minutes. pip then sees it installed and resolves everything else itself."""
    dist = importlib.metadata.distribution("torch")
    root = Path(dist.locate_file("")).resolve()
    for f in dist.files or []:
        src = Path(dist.locate_file(f)).resolve()
        try:
            rel = src.relative_to(root)
        except ValueError:  # console scripts in bin/: not needed here
            continue
        if not src.is_file() or "__pycache__" in rel.parts:
            continue
        dst = site_packages / rel
        dst.parent.mkdir(parents=True, exist_ok=True)
        try:
            os.link(src, dst)
        except OSError:
            shutil.copy2(src, dst)


@pytest.mark.slow
@pytest.mark.timeout(1800)
def test_the_wheel_installs_into_a_fresh_venv_and_works_outside_the_checkout(tmp_path):
    # 1. Build the wheel from a copy of what it packages (the checkout is left untouched).
    src = tmp_path / "src"
    src.mkdir()
    for name in ("pyproject.toml", "README.md", "LICENSE"):
        shutil.copy(REPO / name, src / name)
    shutil.copytree(REPO / "hf_onebit", src / "hf_onebit", ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    dist = tmp_path / "dist"
    built = _run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-w", dist, src],
                 tmp_path, dict(os.environ), 600)
    assert built.returncode == 0, built.output[-4000:]
    (wheel,) = dist.glob("hf_onebit-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    assert any(n.endswith(".dist-info/licenses/LICENSE") for n in names), "LICENSE is not in the wheel"
    assert {n.rsplit("/", 1)[-1] for n in names if "/configs/" in n} >= {"cpu_2proc.yaml", "multi_node.yaml",
                                                                         "single_node_multi_gpu.yaml"}
    assert not [n for n in names if n.split("/")[0] in ("tests", "docs", "recipes", "benchmarks")]

    # 2. A fresh venv (not the suite's site-packages): torch as installed here, the rest by pip.
    env_dir = tmp_path / "venv"
    start = time.perf_counter()
    venv.EnvBuilder(with_pip=True).create(env_dir)
    bindir = env_dir / "bin"
    py = bindir / "python"
    site = Path(_run([py, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"], tmp_path,
                     dict(os.environ), 60).stdout.strip())
    _link_installed_torch(site)
    print(f"  {time.perf_counter() - start:6.1f} s  venv with pip, and torch {torch_version()} linked in", flush=True)
    env = {k: v for k, v in os.environ.items()
           if k not in ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV", "TRITON_INTERPRET", "HF_ONEBIT_KERNELS",
                        "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
                        "ACCELERATE_USE_CPU")}
    env.update(PATH=f"{bindir}{os.pathsep}{env.get('PATH', '')}", VIRTUAL_ENV=str(env_dir), OMP_NUM_THREADS="1",
               HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", TOKENIZERS_PARALLELISM="false", WANDB_DISABLED="true")
    core = _run([py, "-m", "pip", "install", wheel], tmp_path, env, 900)
    assert core.returncode == 0, core.output[-4000:]

    # 3. From a folder outside the checkout, with the core install only.
    outside = tmp_path / "outside"
    outside.mkdir()
    where = _run([py, "-c", "import importlib.util as u, hf_onebit; print(hf_onebit.__file__);"
                            " print([m for m in ('transformers', 'accelerate', 'triton') if u.find_spec(m)])"],
                 outside, env, 120)
    assert where.returncode == 0, where.output
    assert where.stdout.splitlines() == [str(site / "hf_onebit" / "__init__.py"), "[]"], where.output

    check = _run([bindir / "hf-onebit", "check", "--no-train", "--size", "100000"], outside, env, 600)
    assert check.returncode == 0 and "[kernels ] ok" in check.stdout and "verdict: OK" in check.stdout, check.output
    listed = _run([bindir / "hf-onebit", "config", "--list"], outside, env, 120)
    assert listed.returncode == 0 and listed.stdout.split() == ["cpu_2proc", "multi_node", "single_node_multi_gpu"]
    wrote = _run([bindir / "hf-onebit", "config", "cpu_2proc", "--write", "cpu_2proc.yaml"], outside, env, 120)
    assert wrote.returncode == 0 and "num_processes: 2" in (outside / "cpu_2proc.yaml").read_text(), wrote.output

    script = outside / "run_stock.py"
    shutil.copy(REPO / "recipes" / "stock_trainer_tiny_bert.py", script)
    no_hf = _run([bindir / "hf-onebit", "run", script.name, "--output_dir", "o", "--optim", "onebit_adam"],
                 outside, env, 120)
    assert no_hf.returncode != 0 and "pip install 'hf-onebit[hf]'" in no_hf.output, no_hf.output[-3000:]

    # 4. With the hf extra: an unmodified Trainer script on 2 processes, through the shipped config.
    hf = _run([py, "-m", "pip", "install", f"hf-onebit[hf] @ {wheel.as_uri()}"], tmp_path, env, 900)
    assert hf.returncode == 0, hf.output[-4000:]
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    trained = _run([bindir / "accelerate", "launch", "--config_file", "cpu_2proc.yaml", "--main_process_port", port,
                    "-m", "hf_onebit.run", script.name, "--output_dir", "out", "--optim", "onebit_adam",
                    "--optim_args", "freeze_step=4", "--max_steps", "8", "--save_steps", "8",
                    "--per_device_train_batch_size", "16", "--learning_rate", "3e-3", "--logging_steps", "4",
                    "--report_to", "none", "--disable_tqdm", "true"], outside, env, 600)
    assert trained.returncode == 0, trained.output[-6000:]
    assert "eval loss" in trained.stdout  # the stock script ran to its end
    state = json.loads((outside / "out" / "trainer_state.json").read_text())
    logged = [h for h in state["log_history"] if "loss" in h]
    assert logged and all(any(k.startswith("onebit/") for k in h) for h in logged), logged
    saved = sorted(p.name for p in (outside / "out" / "checkpoint-8" / "hf_onebit").iterdir())
    assert saved == ["hf_onebit_rank0_of2.json", "hf_onebit_rank0_of2.pt", "hf_onebit_rank1_of2.json",
                     "hf_onebit_rank1_of2.pt"]
