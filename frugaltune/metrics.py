"""Classification metrics: accuracy, macro-F1, per-class precision/recall/F1, confusion matrix.

Library code used by the `evaluate` stage.
"""

from __future__ import annotations

import numpy as np
from sklearn.metrics import accuracy_score, confusion_matrix, f1_score, precision_recall_fscore_support


def classification_metrics(y_true: np.ndarray, y_pred: np.ndarray, labels: list[str]) -> dict:
    ids = list(range(len(labels)))
    precision, recall, f1, support = precision_recall_fscore_support(
        y_true, y_pred, labels=ids, zero_division=0
    )
    return {
        "accuracy": round(float(accuracy_score(y_true, y_pred)), 6),
        "macro_f1": round(float(f1_score(y_true, y_pred, labels=ids, average="macro", zero_division=0)), 6),
        "per_class": {
            name: {"precision": round(float(precision[i]), 6), "recall": round(float(recall[i]), 6),
                   "f1": round(float(f1[i]), 6), "support": int(support[i])}
            for i, name in enumerate(labels)
        },
        "confusion_matrix": confusion_matrix(y_true, y_pred, labels=ids).tolist(),
    }
