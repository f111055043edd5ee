"""benchmarks/convergence.py's data, optimizers and seed summary (no training, no network)."""

from __future__ import annotations

import sys
from types import SimpleNamespace

import pytest
import torch

from tests.benchmark_scripts import BENCHMARKS as BENCH
from tests.benchmark_scripts import load_benchmark

sys.path.insert(0, str(BENCH))

from netbench.data import load_task  # noqa: E402
from netbench.methods import onebit_optimizer  # noqa: E402


@pytest.fixture(scope="module")
def conv():
    return load_benchmark("convergence")


def test_tweets_are_the_recipes_split_with_label_indices():
    train, dev, classes = load_task(10**9, "tweets")
    assert classes == ("negative", "neutral", "positive")
    assert {y for _, y in train} == {0, 1, 2} == {y for _, y in dev}
    assert not {t for t, _ in train} & {t for t, _ in dev}  # the recipe's dedup split: disjoint
    sys.path.insert(0, str(BENCH.parent / "recipes" / "glue"))
    import glue_data

    items, _ = glue_data.read_tweets(glue_data.find_source("tweets"))
    recipe_train, recipe_dev, _ = glue_data.dedup_split(items, 0.1, glue_data.tweet_key)
    assert len(train) == len(recipe_train) and len(dev) == len(recipe_dev)


def test_rotten_tomatoes_eval_is_a_fixed_prefix():
    train, dev, classes = load_task(100)
    assert classes == ("rotten", "fresh") and len(dev) == 100
    assert load_task(50)[1] == dev[:50]
    assert {y for _, y in train} == {0, 1}


def test_plain_defaults_give_zeroone_adam_the_library_defaults():
    args = SimpleNamespace(onebit_args=None, steps=150, lr=1e-4, lamb_lr=1e-3)
    params = [torch.nn.Parameter(torch.zeros(8))]
    scaled = onebit_optimizer("zeroone_adam", params, args, 30)  # the published schedule scaled to the run
    assert scaled.var_update_scaler == 7 and scaled.defaults["betas"] == (0.9, 0.99)
    args.plain_defaults = True
    plain = onebit_optimizer("zeroone_adam", params, args, 30)
    import hf_onebit

    user = hf_onebit.ZeroOneAdam([torch.nn.Parameter(torch.zeros(8))], lr=1e-4, var_freeze_step=30)
    names = ("var_update_scaler", "local_step_scaler", "local_step_clipper", "clip_synced_momentum",
             "update_clip", "warmup_bits", "scale_per_tensor", "var_freeze_step")
    assert [getattr(plain, n) for n in names] == [getattr(user, n) for n in names]
    assert plain.defaults["betas"] == user.defaults["betas"]


def test_binsgdm_takes_its_own_lr_when_given_one():
    params = [torch.nn.Parameter(torch.zeros(8))]
    args = SimpleNamespace(onebit_args=None, steps=150, lr=1e-4, lamb_lr=1e-3, plain_defaults=True)
    assert onebit_optimizer("binsgdm", params, args, 30).defaults["lr"] == 1e-4  # as before: --lr
    args.binsgdm_lr = 2e-4
    assert onebit_optimizer("binsgdm", params, args, 30).defaults["lr"] == 2e-4
    assert onebit_optimizer("onebit_adam", params, args, 30).defaults["lr"] == 1e-4


def report(seed, accs, freeze=30, stats=4.0):
    return {"meta": {"seed": seed, "dataset": "tweets", "steps": 150, "freeze": freeze, "plain_defaults": True,
                     "eval_examples": 900},
            "methods": {m: {"evals": [[150, 0.5, a]], "stats": {"compression_ratio": stats} if m != "adamw" else None,
                            "freeze_step": 30 if m != "adamw" else None} for m, a in accs.items()}}


def test_summary_pairs_each_seed_with_its_own_adamw(conv):
    runs = [report(1, {"adamw": 0.70, "onebit_adam": 0.71}), report(2, {"adamw": 0.60, "onebit_adam": 0.60}),
            report(3, {"adamw": 0.65, "onebit_adam": 0.67})]
    table = conv.summary_table(runs)
    row = next(line for line in table.splitlines() if line.startswith("1-bit Adam"))
    # paired differences 1, 0, 2 points: mean +1.00, sd 1, SE 1/sqrt(3)
    assert "71.00 / 60.00 / 67.00" in row and "+1.00" in row and "0.58" in row and "4.0x" in row
    assert "30,30,30" in row


def test_summary_refuses_runs_that_are_not_alike(conv):
    with pytest.raises(ValueError, match="freeze"):
        conv.summary_table([report(1, {"adamw": 0.7}), report(2, {"adamw": 0.7}, freeze="auto")])
    with pytest.raises(ValueError, match="AdamW"):
        conv.summary_table([report(1, {"onebit_adam": 0.7})])
