"""Evaluate the base model (random head) and the fine-tuned model side by side.  Run by DVC as:  python -m stages.evaluate

Reads `evaluate.*`, `common.seed`, `data/tokenized/`, `models/base/`, `models/adapter/` (with its labels.json: the
input template the classifier was trained with, if any), and the precision the model trained in from
`reports/train.json`.
Writes `reports/evaluate.json` ({"baseline": {...}, "finetuned": {...}, "macro_f1_gain": ...}: accuracy, macro-F1,
per-class precision/recall/F1, confusion matrix) and `reports/plots/evaluate_confusion.csv` (actual,predicted per
example, for `dvc plots`' confusion template). `task.type: causal_lm`: loss/perplexity of the reference responses,
exact match and token F1 of the answers (constrained choice among candidates, or generation), the `task.scorer`
mean, and macro-F1 when the responses are a label set (`task.prompt_template`). The baseline is the base model with the classification head that
training started from (same seed), so the gain is what fine-tuning added.
"""

from __future__ import annotations


from frugaltune.entry import stage_main
from frugaltune.recipes.evaluate import run

__all__ = ["main", "run"]


def main() -> None:
    stage_main("evaluate", run, FileNotFoundError, ValueError)


if __name__ == "__main__":
    main()
