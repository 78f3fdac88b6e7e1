"""The evaluate recipe: the base model (its fresh head) and the fine-tuned model side by side on the evaluation split.

Library code. The `evaluate` stage (`python -m stages.evaluate`) and the `compare` stage call `run`; the stage file
documents its inputs and outputs.
"""

from __future__ import annotations

import numpy as np
import torch
from datasets import load_from_disk

from frugaltune.classify import classify
from frugaltune.input_template import from_manifest, wrapped
from frugaltune.io import csv_text, read_json, write_json, write_metrics, write_text
from frugaltune.metrics import classification_metrics
from frugaltune.models import load_for_classification, load_tokenizer
from frugaltune.training.inference import bar
from frugaltune.training.methods import load_trained
from frugaltune import paths
from frugaltune.config import Params
from frugaltune.kernels.attention import register_if_used
from frugaltune import integrity, resolve
from frugaltune.planner.machine import keep_sdpa_off_cudnn


def trained_precision(params: Params, out: paths.RunOutputs) -> bool:
    """bf16? The precision the model was trained in (its train report), so that evaluation sees what training did."""
    if out.train_report.exists() and "bf16" in (report := read_json(out.train_report)):
        return bool(report["bf16"])
    return resolve.machine(params.train.precision)["bf16"]


def threads(params: Params) -> int:
    """The plan's thread count (planner.machine.decide_machine), as training used it."""
    tp = params.train
    return resolve.machine(tp.precision, ranks=tp.distributed.nproc_per_node, threads=tp.threads)["threads"]


def confusion_csv(actual: list[str], predicted: list[str]) -> str:
    """`actual,predicted`, one row per example, for dvc plots' confusion template; labels and answers are the
    user's text, so the cells go through `csv_text` (a label `=cmd|...` is not a formula when the file is opened)."""
    return csv_text(({"actual": a, "predicted": p} for a, p in zip(actual, predicted, strict=True)),
                    ["actual", "predicted"])


def generative_metrics(model, tokenizer, data, params: Params, bf16: bool, labels: list[str], name: str) -> tuple[
        dict, list[str]]:
    """One model on the evaluation split: loss and perplexity of the reference responses, then its answers (the
    most likely candidate where candidates are known and task.constrained, else greedy/sampled generation) scored
    by exact match, token F1, the task.scorer if any, and macro-F1 over the label set when there is one."""
    import math
    import time

    from frugaltune import generation
    from frugaltune.training.inference import lm_loss

    task, ep = params.task, params.evaluate
    loss, tokens = lm_loss(model, data["input_ids"], data["labels"], tokenizer.pad_token_id, ep.batch_size, bf16)
    prompts = [ids[:n] for ids, n in zip(data["input_ids"], data["prompt_length"])]
    candidates = list(data["candidates"])
    references = list(data["reference"])
    constrained = task.constrained and all(candidates)
    start = time.perf_counter()
    if constrained:
        chosen, _ = generation.choose(model, tokenizer, prompts, candidates, batch_size=ep.batch_size)
        answers = [options[i] for options, i in zip(candidates, chosen)]
    else:
        answers = generation.generate(model, tokenizer, prompts, task.max_new_tokens, task.temperature,
                                      batch_size=ep.batch_size, seed=params.common.seed)
    seconds = time.perf_counter() - start
    metrics = {
        "loss": round(loss, 6), "perplexity": round(math.exp(min(loss, 50)), 4), "response_tokens": tokens,
        "exact_match": round(float(np.mean([generation.exact_match(a, r) for a, r in zip(answers, references)])), 6),
        "token_f1": round(float(np.mean([generation.token_f1(a, r) for a, r in zip(answers, references)])), 6),
        "answered_by": "constrained choice" if constrained else "generation",
        "answer_seconds": round(seconds, 2),
    }
    if task.scorer:
        score = generation.load_scorer(task.scorer)
        metrics["score"] = round(float(np.mean([float(score(p, a, r)) for p, a, r in zip(
            data["prompt"], answers, references)])), 6)
    if any(candidates):  # answers from a finite set: how often one of them, and per-class figures
        metrics["valid_fraction"] = round(float(np.mean([generation.normalize_answer(a) in {
            generation.normalize_answer(c) for c in options} for a, options in zip(answers, candidates)])), 6)
    if labels:
        index = {generation.normalize_answer(label): i for i, label in enumerate(labels)}
        y_true = np.array([index.get(generation.normalize_answer(r), len(labels)) for r in references])
        y_pred = np.array([index.get(generation.normalize_answer(a), len(labels)) for a in answers])  # other: wrong
        metrics.update(classification_metrics(y_true, y_pred, labels))
    print(f"evaluate: {name:9s} loss {metrics['loss']:.4f}  exact match {metrics['exact_match']:.4f}  token F1 "
          f"{metrics['token_f1']:.4f}" + (f"  macro-F1 {metrics['macro_f1']:.4f}" if labels else "")
          + f"  ({metrics['answered_by']}, {seconds:.1f} s)")
    return metrics, answers


def run_sft(params: Params, out: paths.RunOutputs) -> dict:
    """causal_lm: the base model (its own LM head, untouched) and the fine-tuned one, side by side."""
    from frugaltune.models import load_for_causal_lm

    ep, seed = params.evaluate, params.common.seed
    bf16 = trained_precision(params, out)
    torch.set_num_threads(threads(params))
    keep_sdpa_off_cudnn()  # as in training: cuDNN's attention costs host time per call
    labels = read_json(paths.LABELS)["labels"] if params.task.prompt_template is not None else []
    data = load_from_disk(str(paths.TOKENIZED_DIR))[ep.split]
    tokenizer = load_tokenizer(paths.BASE_MODEL)
    model = load_for_causal_lm(paths.BASE_MODEL, tokenizer.pad_token_id, seed).to(resolve.device())
    baseline, _ = generative_metrics(model, tokenizer, data, params, bf16, labels, "baseline")
    model = load_trained(model, out.adapter_dir)
    finetuned, answers = generative_metrics(model, tokenizer, data, params, bf16, labels, "finetuned")
    report = {"task": "causal_lm", "baseline": baseline, "finetuned": finetuned, "rows": len(data)}
    headline = ["exact_match", "token_f1", "loss"] + (["macro_f1", "accuracy"] if labels else []) + (
        ["score"] if params.task.scorer else [])
    for key in headline:
        report[f"{key}_gain"] = round(finetuned[key] - baseline[key], 6)
    write_json(out.evaluate_report, report)
    if out.evaluate_metrics is not None:
        write_metrics(out.evaluate_metrics, {**{key: finetuned[key] for key in headline},
                                             **{f"baseline_{key}": baseline[key] for key in headline}})
    # actual,predicted per example: dvc plots' confusion template (meaningful when the answers are a label set)
    write_text(out.confusion_csv, confusion_csv(data["reference"], answers))
    print(f"evaluate: exact match gain {report['exact_match_gain']:+.4f}"
          + (f", macro-F1 gain {report['macro_f1_gain']:+.4f}" if labels else "") + f" on {len(data)} {ep.split} pairs")
    return report


def run(params: Params, out: paths.RunOutputs = paths.PIPELINE_RUN) -> dict:
    # The files as DVC recorded them, not a damaged cache copy that `dvc checkout` restored (the comparison's
    # adapter is its own stage's output, written just before: integrity skips it)
    integrity.verify_outs(paths.BASE_MODEL, out.adapter_dir)
    if params.task.type == "causal_lm":
        return run_sft(params, out)
    ep, seed = params.evaluate, params.common.seed
    bf16 = trained_precision(params, out)
    torch.set_num_threads(threads(params))
    keep_sdpa_off_cudnn()  # as in training: cuDNN's attention costs host time per call
    labels = read_json(paths.LABELS)["labels"]
    data = load_from_disk(str(paths.TOKENIZED_DIR))[ep.split]
    y_true = np.asarray(data["labels"])
    tokenizer = load_tokenizer(paths.BASE_MODEL)

    model = load_for_classification(paths.BASE_MODEL, labels, tokenizer.pad_token_id, seed).to(resolve.device())
    attention = register_if_used(paths.report("kernels"), paths.KERNEL_BUILD_DIR)
    if attention:  # the kernels stage verified it and measured it faster than SDPA at these shapes
        model.set_attn_implementation(attention)
        print(f"evaluate: attention = {attention} (verified CUDA kernel)")
    # The inputs as the model was trained on them: its adapter's labels.json says whether they were wrapped in a
    # template (train.input_template), so that evaluation agrees with serving whatever params.yaml says now.
    manifest = read_json(out.adapter_dir / "labels.json")
    rows = wrapped(data["input_ids"], from_manifest(manifest, tokenizer), int(manifest.get("max_length") or 0)
                   or params.tokenize.max_length)
    baseline_pred = classify(model, rows, tokenizer.pad_token_id, ep.batch_size, bf16,
                             progress=bar("predict")).predictions
    model = load_trained(model, out.adapter_dir)
    finetuned_pred = classify(model, rows, tokenizer.pad_token_id, ep.batch_size, bf16,
                              progress=bar("predict")).predictions

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
    write_text(out.confusion_csv, confusion_csv([labels[i] for i in y_true], [labels[i] for i in finetuned_pred]))
    for name in ("baseline", "finetuned"):
        print(f"evaluate: {name:9s} accuracy {report[name]['accuracy']:.4f}  macro-F1 {report[name]['macro_f1']:.4f}")
    print(f"evaluate: macro-F1 gain {report['macro_f1_gain']:+.4f} on {len(y_true)} {ep.split} examples")
    return report
