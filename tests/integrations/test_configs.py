"""The launch configs ship with the package (`hf-onebit config`), and the forgotten launcher is explained."""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

import pytest

from tests.integrations.launch import REPO, base_env, run

NAMES = ["cpu_2proc", "multi_node", "single_node_multi_gpu"]


def _console():
    exe = shutil.which("hf-onebit", path=str(Path(sys.executable).parent))
    return [exe] if exe else [sys.executable, "-m", "hf_onebit.integrations.launcher"]


def test_config_list_print_and_write(tmp_path):
    res = run([*_console(), "config", "--list"], cwd=tmp_path, timeout=60).check()
    assert res.output.split() == NAMES
    printed = run([*_console(), "config", "cpu_2proc"], cwd=tmp_path, timeout=60).check().output
    target = tmp_path / "sub" / "cpu.yaml"
    res = run([*_console(), "config", "cpu_2proc", "--write", str(target)], cwd=tmp_path, timeout=60).check()
    assert f"wrote {target}" in res.output
    shipped = (REPO / "hf_onebit" / "integrations" / "configs" / "cpu_2proc.yaml").read_text()
    assert target.read_text() == shipped and printed == shipped
    res = run([*_console(), "config", "cpu_3proc"], cwd=tmp_path, timeout=60)
    assert res.returncode != 0 and "no config 'cpu_3proc'; shipped: cpu_2proc, multi_node" in res.output


@pytest.mark.parametrize("name", NAMES)
def test_checkout_configs_are_the_shipped_files(name):
    """recipes/accelerate/*.yaml are links to the package data: one source, nothing to drift."""
    recipe = REPO / "recipes" / "accelerate" / f"{name}.yaml"
    shipped = REPO / "hf_onebit" / "integrations" / "configs" / f"{name}.yaml"
    assert recipe.resolve() == shipped.resolve()
    from accelerate.commands.config.config_args import load_config_from_file

    assert load_config_from_file(str(shipped)).num_processes >= 2
    assert f"hf-onebit config {name} --write {name}.yaml" in shipped.read_text()


def test_package_data_is_declared():
    text = (REPO / "pyproject.toml").read_text()
    assert '"hf_onebit.integrations" = ["configs/*.yaml"]' in text


def test_launcher_help_explains_the_forgotten_launcher(tmp_path):
    res = run([*_console(), "--help"], cwd=tmp_path, timeout=60).check()
    assert "invalid choice: 'onebit_adam'" in res.output and "-m hf_onebit.run" in res.output
    assert "hf_onebit.integrations.patch.install()" in res.output and "hf-onebit config --list" in res.output


def test_forgotten_launcher_fails_and_the_sitecustomize_route_fixes_it(tmp_path):
    script = tmp_path / "run_stock.py"
    shutil.copy(REPO / "recipes" / "stock_trainer_tiny_bert.py", script)
    argv = [sys.executable, str(script), "--output_dir", str(tmp_path / "out"), "--optim", "onebit_adam",
            "--optim_args", "freeze_step=2", "--max_steps", "4", "--per_device_train_batch_size", "16",
            "--report_to", "none", "--disable_tqdm", "true", "--save_strategy", "no", "--learning_rate", "3e-3"]
    res = run(argv, env=base_env(cpu=False), cwd=tmp_path, timeout=120)
    assert res.returncode != 0 and "invalid choice: 'onebit_adam'" in res.output
    # docs/integrations.md, Troubleshooting: a sitecustomize.py on PYTHONPATH, no change to the script
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text("import hf_onebit.integrations.patch\nhf_onebit.integrations.patch.install()\n")
    env = base_env(cpu=False)
    env["PYTHONPATH"] = f"{site}:{env['PYTHONPATH']}"
    res = run(argv, env=env, cwd=tmp_path, timeout=180).check()
    assert "eval loss" in res.output
    assert (tmp_path / "out" / "trainer_state.json").exists()
