"""GLUE metrics as a local `evaluate` module: no hub access.

    metric = evaluate.load("recipes/glue/glue_metric.py", config_name="mrpc")
    metric.compute(predictions=[1, 0, 1], references=[1, 1, 1])   # {'accuracy': 0.667, 'f1': 0.8}

Same configurations and output keys as the hub's ``glue`` metric (evaluate-metric/glue):

======================================================= =======================================
config                                                  result
======================================================= =======================================
``cola``                                                ``matthews_correlation``
``stsb``                                                ``pearson``, ``spearmanr`` (predictions are floats)
``mrpc``, ``qqp``                                       ``accuracy``, ``f1`` (of the positive class 1)
``sst2``, ``mnli``, ``mnli_matched``, ``mnli_mismatched``, ``accuracy``
``qnli``, ``rte``, ``wnli``, ``hans``
``multiclass`` (not GLUE: tweets, bbc_news)               ``accuracy``, ``macro_f1`` (unweighted mean of per-class F1)
======================================================= =======================================

Computed with scikit-learn (accuracy, F1, Matthews) and scipy (Pearson, Spearman). The
functions below (``glue_scores`` ...) work without `evaluate` too. Tested against
hand-computed values in ``tests/recipes/test_glue.py``.
"""

from __future__ import annotations

import datasets
import evaluate
import numpy as np

CLASSIFICATION = ("sst2", "mnli", "mnli_matched", "mnli_mismatched", "qnli", "rte", "wnli", "hans")
CONFIGS = ("cola", "stsb", "mrpc", "qqp", *CLASSIFICATION, "multiclass")

_DESCRIPTION = "GLUE metrics (accuracy, F1, Matthews correlation, Pearson/Spearman), computed locally."
_CITATION = """@inproceedings{wang2019glue,
  title={GLUE: A Multi-Task Benchmark and Analysis Platform for Natural Language Understanding},
  author={Wang, Alex and Singh, Amanpreet and Michael, Julian and Hill, Felix and Levy, Omer and Bowman, Samuel R.},
  booktitle={ICLR}, year={2019}}"""
_KWARGS_DESCRIPTION = """
Args:
    predictions: predicted labels (class ids; floats for stsb).
    references: gold labels (class ids; floats for stsb).
Returns: see the module docstring; every value is a Python float.
"""


def simple_accuracy(preds, labels) -> float:
    return float((np.asarray(preds) == np.asarray(labels)).mean())


def acc_and_f1(preds, labels) -> dict:
    from sklearn.metrics import f1_score

    return {"accuracy": simple_accuracy(preds, labels), "f1": float(f1_score(y_true=labels, y_pred=preds))}


def acc_and_macro_f1(preds, labels) -> dict:
    """Accuracy and macro-F1 over the classes present in ``labels`` or ``preds`` (a class never
    predicted has F1 0)."""
    from sklearn.metrics import f1_score

    return {"accuracy": simple_accuracy(preds, labels),
            "macro_f1": float(f1_score(y_true=labels, y_pred=preds, average="macro", zero_division=0))}


def pearson_and_spearman(preds, labels) -> dict:
    from scipy.stats import pearsonr, spearmanr

    return {"pearson": float(pearsonr(preds, labels)[0]), "spearmanr": float(spearmanr(preds, labels)[0])}


def matthews(preds, labels) -> dict:
    from sklearn.metrics import matthews_corrcoef

    return {"matthews_correlation": float(matthews_corrcoef(labels, preds))}


def glue_scores(config: str, predictions, references) -> dict:
    """The GLUE metric of ``config`` (see the module docstring) without `evaluate`."""
    if config == "cola":
        return matthews(predictions, references)
    if config == "stsb":
        return pearson_and_spearman(predictions, references)
    if config in ("mrpc", "qqp"):
        return acc_and_f1(predictions, references)
    if config == "multiclass":
        return acc_and_macro_f1(predictions, references)
    if config in CLASSIFICATION:
        return {"accuracy": simple_accuracy(predictions, references)}
    raise KeyError(f"unknown GLUE metric configuration {config!r}; choose one of {', '.join(CONFIGS)}")


@evaluate.utils.file_utils.add_start_docstrings(_DESCRIPTION, _KWARGS_DESCRIPTION)
class GlueMetric(evaluate.Metric):
    def _info(self):
        if self.config_name not in CONFIGS:
            raise KeyError(f"unknown GLUE metric configuration {self.config_name!r}; choose one of {', '.join(CONFIGS)}")
        dtype = "float32" if self.config_name == "stsb" else "int64"
        return evaluate.MetricInfo(
            description=_DESCRIPTION,
            citation=_CITATION,
            inputs_description=_KWARGS_DESCRIPTION,
            features=datasets.Features({"predictions": datasets.Value(dtype), "references": datasets.Value(dtype)}),
            codebase_urls=[],
            reference_urls=[],
            format="numpy",
        )

    def _compute(self, predictions, references):
        return glue_scores(self.config_name, predictions, references)
