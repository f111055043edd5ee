"""The stock table: a stock classification script at the Trainer's defaults, only ``--optim X``.

    python recipes/stock_table.py                       # AdamW and the four optimizers, seed 42
    python recipes/stock_table.py --seeds 42 43 44 --only adamw_torch binsgdm
    python recipes/stock_table.py --summarize           # the table from the results already written
    python recipes/stock_table.py --dataset tweets --seeds 42 43    # another embedded task
    python recipes/stock_table.py --freeze 48 --only onebit_adam    # the published 20% freeze, fixed

Each run is ``accelerate launch --config_file <cpu_2proc> -m hf_onebit.run
recipes/stock_classification.py`` on the GLUE recipe's default task (Rotten Tomatoes, the files
``recipes/glue/glue_data.build_embedded`` writes) with MiniLM, and the *same* command line for every
optimizer except ``--optim``: no ``--optim_args``, no learning rate, no clipping setting. Only the
budget is fixed (240 steps of 2 x 16 examples, as the recipe's quick budget) and the seed. What
each hf_onebit optimizer needs is supplied by the launcher (``hf_onebit.integrations.defaults``).

``--dataset tweets`` / ``bbc_news`` runs the same command on another embedded task (results under
``outputs/stock_table/<dataset>/``). ``--freeze N`` adds ``--optim_args freeze_step=N`` for the
optimizers with a warmup (1-bit Adam, 0/1 Adam, 1-bit LAMB): a fixed freeze instead of the automatic
one (run directories ``<optim>-freezeN-seed<S>``); the command line is then still the same for
every optimizer except ``--optim``. ``--optim-args`` (an experiment, with its own ``--out``) adds
more ``--optim_args`` for those three; ``--train-args`` (an experiment too) adds arguments of the
stock script (``--learning_rate 1e-4``) for every run; ``--adamw-from outputs/stock_table`` then
pairs the experiment's runs with the stock table's AdamW runs of the same seeds.

Results land in ``outputs/stock_table/<optim>-seed<N>/all_results.json`` (written by the stock
``Trainer.save_metrics``) with the run's log beside it; the table (markdown) is printed and
written to ``outputs/stock_table/table.md``.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "recipes" / "stock_classification.py"
sys.path.insert(0, str(REPO / "recipes"))
from cpu_launch import launch_command, offline_env  # noqa: E402

OPTIMS = ["adamw_torch", "onebit_adam", "zeroone_adam", "onebit_lamb", "binsgdm"]
BUDGET = ["--max_steps", "240", "--per_device_train_batch_size", "16", "--per_device_eval_batch_size", "64",
          "--logging_steps", "40", "--save_strategy", "no", "--report_to", "none", "--disable_tqdm", "true"]
#: what the launcher decided, as the logs say it (the warmup's end, settings it changed)
DECISIONS = re.compile(r"(auto freeze chose.*|hf_onebit: --\S+ \S+ for --optim.*?\))")


#: optimizers that take a freeze step (BinSGDM has no warmup; AdamW no phases)
FREEZES = ("onebit_adam", "zeroone_adam", "onebit_lamb")


def data_files(dataset: str | None = None) -> dict:
    sys.path.insert(0, str(REPO / "recipes" / "glue"))
    import glue_data

    return glue_data.build_embedded(dataset=dataset or glue_data.EMBEDDED)["files"]


def run_name(optim: str, seed: int, freeze: int | None = None) -> str:
    """``<optim>[-freezeN]-seed<S>``: a fixed freeze only for the optimizers that have one."""
    tag = f"-freeze{freeze}" if freeze is not None and optim in FREEZES else ""
    return f"{optim}{tag}-seed{seed}"


def freeze_args(optim: str, freeze: int | None, extra: str | None = None) -> list[str]:
    """``--optim_args`` for the optimizers with a warmup: a fixed freeze and/or ``extra``
    (``"update_clip=2.0"``); nothing for AdamW and BinSGDM."""
    if optim not in FREEZES:
        return []
    items = ([f"freeze_step={freeze}"] if freeze is not None else []) + ([extra] if extra else [])
    return ["--optim_args", ",".join(items)] if items else []


def model_path() -> str:
    sys.path.insert(0, str(REPO / "recipes" / "glue"))
    from run_glue import default_model_path

    return default_model_path()


def run_one(optim: str, seed: int, out: Path, files: dict, model: str, budget: list[str] = BUDGET,
            script: Path = SCRIPT, extra_env: dict | None = None) -> dict:
    """One training run; ``script`` and ``extra_env`` let an experiment wrap the stock script."""
    env = offline_env(use_cpu=False, **(extra_env or {}))  # the launcher sets ACCELERATE_USE_CPU itself
    cmd = launch_command("-m", "hf_onebit.run", str(script), "--model_name_or_path", model,
                         "--train_file", files["train"], "--validation_file", files["validation"],
                         "--output_dir", str(out), "--seed", str(seed), *budget, "--optim", optim)
    out.mkdir(parents=True, exist_ok=True)
    log = out / "run.log"
    start = time.perf_counter()
    with open(log, "w") as f:
        f.write(" ".join(cmd) + "\n")
        f.flush()
        rc = subprocess.call(cmd, stdout=f, stderr=subprocess.STDOUT, env=env, cwd=REPO)
    if rc != 0:
        raise SystemExit(f"{optim} seed {seed}: exit code {rc}; see {log}")
    result = json.loads((out / "all_results.json").read_text())
    result["wall_seconds"] = time.perf_counter() - start
    (out / "all_results.json").write_text(json.dumps(result, indent=2))
    return result


def summary(out: Path, optim: str, seed: int, freeze: int | None = None) -> dict | None:
    f = out / run_name(optim, seed, freeze) / "all_results.json"
    if not f.is_file():
        return None
    r = json.loads(f.read_text())
    log = (f.parent / "run.log").read_text(errors="replace") if (f.parent / "run.log").is_file() else ""
    return {"accuracy": 100 * r["eval_accuracy"], "loss": r["eval_loss"],
            "ratio": float(r.get("onebit/ratio_vs_ddp", 1.0)),
            "decisions": sorted({m.group(1).strip() for m in DECISIONS.finditer(log)})}


def table(out: Path, seeds: list[int], freeze: int | None = None, within: float = 1.0,
          adamw_from: Path | None = None) -> str:
    """The markdown table; ``within``: the band around AdamW's mean that counts as matching it, in
    points. The spread is the sample standard deviation over the seeds.
    ``adamw_from``: the folder of the AdamW runs to compare with (default ``out``), so that an
    experiment written to its own ``--out`` is still paired with the stock table's AdamW."""
    rows = ["| --optim | " + " | ".join(f"seed {s}" for s in seeds) + " | mean dev accuracy (sd) | Δ vs AdamW (points)"
            f" | whole-run ratio vs fp32 all-reduce | goal (within {within:g} point; ratio ≥ 1.5x, BinSGDM ≥ 10x) |",
            "|---|" + "---|" * len(seeds) + "---|---|---|---|"]
    base = None
    notes = []
    for optim in OPTIMS:
        folder = (adamw_from or out) if optim == "adamw_torch" else out
        got = {s: summary(folder, optim, s, freeze) for s in seeds}
        accs = [g["accuracy"] for g in got.values() if g]
        if not accs:
            continue
        mean = statistics.mean(accs)
        spread = f" ({statistics.stdev(accs):.2f})" if len(accs) > 1 else ""
        ratios = [g["ratio"] for g in got.values() if g]
        if optim == "adamw_torch":
            base, delta, verdict = mean, "—", "—"
        elif base is None:  # a verdict needs AdamW's runs of the same seeds
            delta, verdict = "—", f"no AdamW run in {adamw_from or out} (see --adamw-from)"
        else:
            d = mean - base
            delta = f"{d:+.2f}"
            need = 10.0 if optim == "binsgdm" else 1.5
            complete = len(accs) == len(seeds)
            ok = d >= -within and min(ratios) >= need
            verdict = ("met" if ok else "**missed**") + ("" if complete else f" ({len(accs)} of {len(seeds)} seeds)")
        cells = [f"{g['accuracy']:.1f}" if g else "" for g in got.values()]
        ratio = f"{min(ratios):.1f}x" if min(ratios) == max(ratios) else f"{min(ratios):.1f}-{max(ratios):.1f}x"
        rows.append(f"| {optim} | " + " | ".join(cells) + f" | {mean:.2f}{spread} | {delta} | {ratio} | {verdict} |")
        for s, g in got.items():
            if g and g["decisions"]:
                notes.append(f"- {optim}, seed {s}: " + "; ".join(g["decisions"]))
    return "\n".join(rows + ([""] + notes if notes else []))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", nargs="*", default=None, choices=OPTIMS, help="optimizers to run (default: all)")
    parser.add_argument("--seeds", nargs="*", type=int, default=[42])
    parser.add_argument("--dataset", default=None, choices=["rotten_tomatoes", "tweets", "bbc_news"],
                        help="embedded task (default: the recipe's, Rotten Tomatoes)")
    parser.add_argument("--freeze", type=int, default=None,
                        help="fixed freeze step for 1-bit Adam, 0/1 Adam, 1-bit LAMB (default: the automatic one)")
    parser.add_argument("--optim-args", default=None,
                        help="an experiment: more --optim_args for 1-bit Adam, 0/1 Adam, 1-bit LAMB (e.g."
                             " 'update_clip=2.0'); the stock table itself passes none. Use with --out")
    parser.add_argument("--train-args", default=None,
                        help="an experiment: more arguments of the stock script for every optimizer run (e.g."
                             " '--learning_rate 1e-4'); the stock table itself passes none. Use with --out")
    parser.add_argument("--out", default=str(REPO / "outputs" / "stock_table"))
    parser.add_argument("--summarize", action="store_true", help="only print the table of existing results")
    parser.add_argument("--adamw-from", default=None,
                        help="the folder of the AdamW runs to compare with (default: --out), e.g. the stock"
                             " table's own when an experiment has its own --out (same --dataset subfolder rule)")
    parser.add_argument("--within", type=float, default=1.0,
                        help="the band around AdamW that counts as matching it, in points (default 1)")
    args = parser.parse_args()
    out = Path(args.out)
    adamw_from = Path(args.adamw_from) if args.adamw_from else None
    if args.dataset not in (None, "rotten_tomatoes"):
        out = out / args.dataset
        adamw_from = adamw_from / args.dataset if adamw_from else None
    if not args.summarize:
        files, model = data_files(args.dataset), model_path()
        for seed in args.seeds:
            for optim in args.only or OPTIMS:
                print(f"[{time.strftime('%H:%M:%S')}] {optim} seed {seed} (load {os.getloadavg()[0]:.1f})", flush=True)
                r = run_one(optim, seed, out / run_name(optim, seed, args.freeze), files, model,
                            [*BUDGET, *freeze_args(optim, args.freeze, args.optim_args),
                             *(args.train_args or "").split()])
                print(f"    dev accuracy {100 * r['eval_accuracy']:.1f}  loss {r['eval_loss']:.3f}"
                      f"  ratio {float(r.get('onebit/ratio_vs_ddp', 1.0)):.2f}x  wall {r['wall_seconds']:.0f} s",
                      flush=True)
    text = table(out, args.seeds, args.freeze, args.within, adamw_from)
    print(text)
    out.mkdir(parents=True, exist_ok=True)
    (out / ("table.md" if args.freeze is None else f"table-freeze{args.freeze}.md")).write_text(text + "\n")


if __name__ == "__main__":
    main()
