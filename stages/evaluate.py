"""Evaluate the base model (random head) and the fine-tuned model side by side.  Run by DVC as:  python -m stages.evaluate

Reads `evaluate.*`, `common.seed`, `data/tokenized/`, `models/base/`, `models/adapter/`, and the precision the
model trained in from `reports/train.json`.
Writes `reports/evaluate.json` ({"baseline": {...}, "finetuned": {...}, "macro_f1_gain": ...}: accuracy, macro-F1,
per-class precision/recall/F1, confusion matrix) and `reports/plots/evaluate_confusion.csv` (actual,predicted per
example, for `dvc plots`' confusion template). The baseline is the base model with the classification head that
training started from (same seed), so the gain is what fine-tuning added.
"""

from __future__ import annotations

import sys

import numpy as np
import pandas as pd
import torch
from datasets import load_from_disk

from frugaltune.faults import stage_errors
from frugaltune.io import read_json, write_json, write_metrics, write_text
from frugaltune.metrics import classification_metrics
from frugaltune.models import load_for_classification, load_tokenizer
from frugaltune.training.loop import predict
from frugaltune.training.methods import load_trained
from frugaltune import paths
from frugaltune.config import Params, ParamsError, load_params
from frugaltune.kernels.attention import register_if_used
from stages.train import device, measured_precision_inputs, resolve_threads
from frugaltune import planner


def trained_precision(params: Params, out: paths.RunOutputs) -> bool:
    """bf16? The precision the model was trained in (its train report), so that evaluation sees what training did."""
    if out.train_report.exists() and "bf16" in (report := read_json(out.train_report)):
        return bool(report["bf16"])
    hardware, measured = measured_precision_inputs()
    return planner.recommend_precision(hardware, params.train.precision, measured)[0]


def run(params: Params, out: paths.RunOutputs = paths.PIPELINE_RUN) -> dict:
    ep, seed = params.evaluate, params.common.seed
    bf16 = trained_precision(params, out)
    torch.set_num_threads(resolve_threads(params.train.threads))
    labels = read_json(paths.LABELS)["labels"]
    data = load_from_disk(str(paths.TOKENIZED_DIR))[ep.split]
    y_true = np.asarray(data["labels"])
    tokenizer = load_tokenizer(paths.BASE_MODEL)

    model = load_for_classification(paths.BASE_MODEL, labels, tokenizer.pad_token_id, seed).to(device())
    attention = register_if_used(paths.report("kernels"), paths.KERNEL_BUILD_DIR)
    if attention:  # the kernels stage verified it and measured it faster than SDPA at these shapes
        model.set_attn_implementation(attention)
        print(f"evaluate: attention = {attention} (verified CUDA kernel)")
    baseline_pred = predict(model, data["input_ids"], tokenizer.pad_token_id, ep.batch_size, bf16)
    model = load_trained(model, out.adapter_dir)
    finetuned_pred = predict(model, data["input_ids"], tokenizer.pad_token_id, ep.batch_size, bf16)

    report = {
        "baseline": classification_metrics(y_true, baseline_pred, labels),
        "finetuned": classification_metrics(y_true, finetuned_pred, labels),
    }
    report["macro_f1_gain"] = round(report["finetuned"]["macro_f1"] - report["baseline"]["macro_f1"], 6)
    report["accuracy_gain"] = round(report["finetuned"]["accuracy"] - report["baseline"]["accuracy"], 6)
    report["rows"] = int(len(y_true))
    write_json(out.evaluate_report, report)
    if out.evaluate_metrics is not None:
        write_metrics(out.evaluate_metrics, {
            "accuracy": report["finetuned"]["accuracy"], "macro_f1": report["finetuned"]["macro_f1"],
            "baseline_macro_f1": report["baseline"]["macro_f1"], "macro_f1_gain": report["macro_f1_gain"]})
    confusion = pd.DataFrame({"actual": [labels[i] for i in y_true], "predicted": [labels[i] for i in finetuned_pred]})
    write_text(out.confusion_csv, confusion.to_csv(index=False))
    for name in ("baseline", "finetuned"):
        print(f"evaluate: {name:9s} accuracy {report[name]['accuracy']:.4f}  macro-F1 {report[name]['macro_f1']:.4f}")
    print(f"evaluate: macro-F1 gain {report['macro_f1_gain']:+.4f} on {len(y_true)} {ep.split} examples")
    return report


def main() -> None:
    with stage_errors("evaluate"):  # a full disk: one clear line, not a traceback
        try:
            run(load_params())
        except (ParamsError, FileNotFoundError, ValueError) as exc:
            sys.exit(f"evaluate: {exc}")


if __name__ == "__main__":
    main()
