"""Does it matter that word-embedding rows first seen after the freeze stay at their pretrained values?

1-bit Adam and 1-bit LAMB freeze the variance at step ``F``; ``auto_mask`` then masks every
coordinate whose averaged gradient was zero on every warmup step. For a word embedding that is
every row whose word did not occur in the first ``F`` batches: those rows keep their pretrained
values for the rest of the run, even when their word occurs later. With no
variance estimate for them, unmasking them would move them by ``±scale/eps``.

This measures what that policy costs *without compression*: AdamW on the recipe's task, once as is
and once with the rows first seen after step ``F`` frozen (their gradient zeroed before every
``step()`` after ``F``; AdamW with zero moments leaves them exactly where they are). Both runs of
a seed see the same batches from the same initial model, so the difference is paired by seed.

    python benchmarks/late_rows.py --stats                      # how many rows and dev tokens are late
    python benchmarks/late_rows.py --freeze 48 --seeds 42 43 44  # the paired runs (about 7 min each)

The AdamW baselines are ``recipes/stock_table.py``'s ``adamw_torch-seed<S>`` runs (same command,
same output tree); this script adds ``adamw_torch-late<F>-seed<S>``. Run under the launcher, with
``HF_ONEBIT_LATE_ROWS=F`` set, this file is itself the training script: it patches
``torch.optim.AdamW.step`` and runs ``recipes/stock_classification.py`` unchanged.
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import runpy
import statistics
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "recipes"))
ENV = "HF_ONEBIT_LATE_ROWS"


def freeze_late_rows(freeze: int) -> None:
    """Patch AdamW so that embedding rows whose gradient was zero on steps 1..freeze never move."""
    import torch

    original = torch.optim.AdamW.step

    def step(self, *args, **kwargs):
        self._late_rows_t = getattr(self, "_late_rows_t", 0) + 1
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None or p.dim() != 2 or p.shape[0] < 10000:  # the word embedding(s) only
                    continue
                masks = self.__dict__.setdefault("_late_rows_seen", {})  # not in self.state: AdamW inits empty state
                seen = masks.setdefault(p, torch.zeros(p.shape[0], dtype=torch.bool, device=p.device))
                if self._late_rows_t <= freeze:
                    seen |= p.grad.ne(0).any(dim=1)
                else:
                    if self._late_rows_t == freeze + 1 and os.environ.get("RANK", "0") == "0":
                        print(f"late_rows: {int((~seen).sum())} of {seen.numel()} rows of a {tuple(p.shape)}"
                              f" embedding had no gradient in steps 1..{freeze}: frozen from now on", flush=True)
                    p.grad[~seen] = 0
        return original(self, *args, **kwargs)

    torch.optim.AdamW.step = step


def stats(seeds: list[int], freezes: list[int], steps: int = 240, batch: int = 32) -> None:
    """Rows first seen after ``F`` and the dev tokens that use them (a random order per seed)."""
    import numpy as np
    from transformers import AutoTokenizer

    import stock_table

    files = stock_table.data_files()
    tok = AutoTokenizer.from_pretrained(stock_table.model_path())

    def ids(path):
        return [tok(r["sentence"], truncation=True, max_length=128)["input_ids"] for r in csv.DictReader(open(path))]

    train, dev = ids(files["train"]), ids(files["validation"])
    dev_tokens = np.concatenate([np.array(x) for x in dev])
    print(f"{len(train)} training and {len(dev)} dev examples, vocabulary {tok.vocab_size}; {steps} steps of {batch}")
    for seed in seeds:
        order = np.random.default_rng(seed).permutation(len(train))
        first: dict[int, int] = {}
        for s in range(steps):
            start = (s * batch) % len(train)
            for i in order[start : start + batch]:
                for t in train[i]:
                    first.setdefault(t, s + 1)
        never = ~np.isin(dev_tokens, list(first))
        for f in freezes:
            late = [t for t, s in first.items() if s > f]
            on_late = np.isin(dev_tokens, late)
            with_late = np.mean([bool(set(x) & set(late)) for x in dev])
            print(f"seed {seed}, F={f}: {sum(s <= f for s in first.values())} rows seen by F, {len(late)} first seen"
                  f" after F; dev tokens on those rows {100 * on_late.mean():.2f}% (never trained:"
                  f" {100 * never.mean():.2f}%); dev examples using one {100 * with_late:.1f}%")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--stats", action="store_true", help="only count late rows and the dev tokens on them")
    parser.add_argument("--freeze", type=int, nargs="*", default=[48], help="the freeze step F (default 48: 20%%)")
    parser.add_argument("--seeds", type=int, nargs="*", default=[42, 43, 44])
    parser.add_argument("--out", default=str(REPO / "outputs" / "stock_table"))
    args = parser.parse_args()
    if args.stats:
        stats(args.seeds, args.freeze)
        return
    import stock_table

    out = Path(args.out)
    files, model = stock_table.data_files(), stock_table.model_path()
    for f in args.freeze:
        rows = []
        for seed in args.seeds:
            run = out / f"adamw_torch-late{f}-seed{seed}"
            if not (run / "all_results.json").is_file():
                print(f"running {run.name}", flush=True)
                stock_table.run_one("adamw_torch", seed, run, files, model, script=Path(__file__).resolve(),
                                    extra_env={ENV: str(f)})
            late = json.loads((run / "all_results.json").read_text())["eval_accuracy"] * 100
            base_file = out / f"adamw_torch-seed{seed}" / "all_results.json"
            base = json.loads(base_file.read_text())["eval_accuracy"] * 100 if base_file.is_file() else None
            rows.append((seed, base, late))
            print(f"seed {seed}: AdamW {base if base is None else f'{base:.2f}'}, late rows frozen {late:.2f}", flush=True)
        diffs = [late - base for _, base, late in rows if base is not None]
        if diffs:
            spread = f" ± {statistics.stdev(diffs):.2f} (sd over seeds)" if len(diffs) > 1 else ""
            print(f"F={f}: late rows frozen minus AdamW, paired by seed: {statistics.mean(diffs):+.2f} points{spread}"
                  f" ({', '.join(f'{d:+.2f}' for d in diffs)})")


if __name__ == "__main__":
    if os.environ.get(ENV):  # launched by the runs above: the training script itself
        freeze_late_rows(int(os.environ[ENV]))
        sys.argv[0] = str(REPO / "recipes" / "stock_classification.py")
        runpy.run_path(sys.argv[0], run_name="__main__")
    else:
        main()
