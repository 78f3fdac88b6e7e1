"""Tokenize the validated splits.  Run by DVC as:  python -m stages.tokenize

Reads `tokenize.*`, `data/validated/`, the label set and the base model's tokenizer. Writes `data/tokenized/`
(a `datasets.DatasetDict` saved with `save_to_disk`: input_ids, labels, length) and `reports/tokenize.json`
(length statistics per split). Truncates at `tokenize.max_length` and pads nothing: batches pad to their own
longest sequence at training time, so no compute is spent on padding to a fixed length. A classifier's split is read
and tokenized a chunk (data.CHUNK_ROWS rows) at a time, so that a million rows need the memory of their token ids.

`task.type: causal_lm`: each row becomes prompt ids (the model's chat template, frugaltune.generation) + response
ids + EOS, with `labels` -100 over the prompt (the loss is on the response only), plus prompt_length, prompt,
reference and candidates for evaluation. A pair longer than `tokenize.max_length` is quarantined in
`data/tokenized/too_long.parquet` and counted in the report, never cut.
"""

from __future__ import annotations

import json

import numpy as np
import pandas as pd
import pyarrow.parquet as pq
from datasets import Dataset, DatasetDict, concatenate_datasets

from frugaltune import generation
from frugaltune.data import CHUNK_ROWS
from frugaltune.entry import stage_main
from frugaltune.io import atomic_dir, read_json, write_json
from frugaltune.models import load_tokenizer
from frugaltune import paths
from frugaltune.config import Params


TOKENIZER_BATCH = 5_000


def length_stats(lengths: np.ndarray, max_length: int) -> dict:
    return {
        "rows": int(len(lengths)),
        "tokens": int(lengths.sum()),
        "mean": round(float(lengths.mean()), 2) if len(lengths) else 0.0,
        "p50": int(np.percentile(lengths, 50)) if len(lengths) else 0,
        "p95": int(np.percentile(lengths, 95)) if len(lengths) else 0,
        "max": int(lengths.max()) if len(lengths) else 0,
        "truncated": int((lengths >= max_length).sum()),
    }


def sft_rows(frame: pd.DataFrame, params: Params, labels: list[str]) -> pd.DataFrame:
    """causal_lm rows as prompt, response, candidates (list) and chat context (`messages` JSON or None)."""
    task = params.task
    if task.prompt_template is not None:  # labelled rows: the label word is the response, the label set the choice
        return pd.DataFrame({"prompt": [task.prompt_template.replace("{text}", text) for text in frame["text"]],
                             "response": frame["label"].tolist(), "candidates": [list(labels)] * len(frame),
                             "messages": [None] * len(frame)})
    return pd.DataFrame({
        "prompt": frame["prompt"].tolist(), "response": frame["response"].tolist(),
        "candidates": [json.loads(c) for c in frame["candidates"]] if "candidates" in frame else [[]] * len(frame),
        "messages": frame["messages"].tolist() if "messages" in frame else [None] * len(frame)})


def tokenize_sft(frame: pd.DataFrame, tokenizer, params: Params) -> tuple[dict, pd.DataFrame]:
    """Prompt ids (chat template when the model has one) + response ids + EOS; labels -100 over the prompt, so the
    loss is on the response only. Pairs longer than tokenize.max_length are quarantined, never cut: a cut response
    would teach the model to stop mid-answer. Returns the columns and the quarantined rows."""
    task, max_length = params.task, params.tokenize.max_length
    templated = generation.uses_chat_template(tokenizer, task.chat_template)
    columns = {k: [] for k in ("input_ids", "labels", "length", "prompt_length", "prompt", "reference", "candidates")}
    dropped = []
    for row in frame.itertuples(index=False):
        if row.messages is not None:
            prompt = generation.messages_prompt_ids(tokenizer, json.loads(row.messages), templated)
        else:
            prompt = generation.prompt_ids(tokenizer, row.prompt, task.system, templated)
        response = generation.response_ids(tokenizer, row.response)
        if len(prompt) + len(response) > max_length:
            dropped.append({"prompt": row.prompt, "response": row.response, "tokens": len(prompt) + len(response)})
            continue
        columns["input_ids"].append(prompt + response)
        columns["labels"].append([-100] * len(prompt) + response)
        columns["length"].append(len(prompt) + len(response))
        columns["prompt_length"].append(len(prompt))
        columns["prompt"].append(row.prompt)
        columns["reference"].append(row.response)
        columns["candidates"].append(list(row.candidates))
    return columns, pd.DataFrame(dropped, columns=["prompt", "response", "tokens"])


def run_sft(params: Params, labels: list[str]) -> dict:
    max_length = params.tokenize.max_length
    tokenizer = load_tokenizer(paths.BASE_MODEL)
    splits, metrics, quarantined = {}, {}, []
    for split in paths.SPLITS:
        frame = pd.read_parquet(paths.validated_path(split))
        columns, dropped = tokenize_sft(sft_rows(frame, params, labels), tokenizer, params)
        if not columns["input_ids"]:
            raise ValueError(f"{paths.validated_path(split)}: every one of the {len(frame)} {split} pairs is longer "
                             f"than tokenize.max_length = {max_length} tokens (prompt + response; the longest has "
                             f"{dropped['tokens'].max()}). Raise tokenize.max_length.")
        splits[split] = Dataset.from_dict(columns)
        lengths = np.array(columns["length"], dtype=np.int64)
        metrics[split] = {**length_stats(lengths, max_length + 1), "quarantined_too_long": len(dropped),
                          "response_tokens": int(sum(len(ids) - p for ids, p in zip(columns["input_ids"],
                                                                                     columns["prompt_length"])))}
        quarantined.append(dropped.assign(split=split))
    with atomic_dir(paths.TOKENIZED_DIR) as out:
        DatasetDict(splits).save_to_disk(str(out))
        # Not cut, not silent: the pairs that do not fit, for a person to read (prompt, response, tokens)
        pd.concat(quarantined, ignore_index=True).to_parquet(out / "too_long.parquet", index=False)
    metrics["task"] = "causal_lm"
    metrics["chat_template"] = generation.uses_chat_template(tokenizer, params.task.chat_template)
    write_json(paths.report("tokenize"), metrics)
    for split in paths.SPLITS:
        stats = metrics[split]
        print(f"tokenize: {split}: {stats['rows']} pairs, {stats['tokens']} tokens ({stats['response_tokens']} in "
              f"responses), mean {stats['mean']}, max {stats['max']}, quarantined (longer than {max_length}) "
              f"{stats['quarantined_too_long']}")
    return metrics


def _tokenize_split(path, tokenizer, label_ids: dict[str, int], labels: list[str], max_length: int,
                    chunk_rows: int = CHUNK_ROWS) -> tuple[Dataset, np.ndarray]:
    """One validated split as a Dataset (input_ids, labels, length) and its lengths, read and tokenized a chunk
    (`chunk_rows` rows) at a time: only a chunk's Python lists are held, the rest is Arrow. A split of at most
    `chunk_rows` rows is the Dataset `Dataset.from_dict` makes of the whole split."""
    parts, lengths = [], []
    for batch in pq.ParquetFile(path).iter_batches(batch_size=chunk_rows, columns=["text", "label"]):
        frame = batch.to_pandas()
        unknown = sorted(set(frame["label"]) - set(label_ids))
        if unknown:
            raise ValueError(f"{path}: labels {unknown} are not in {paths.LABELS} ({labels}); "
                             "rerun `dvc repro validate`, which quarantines them.")
        texts = frame["text"].tolist()
        # a few thousand texts per call: a fast tokenizer's result holds an Encoding (tokens, offsets, masks) per text
        encoded = [ids for first in range(0, len(texts), TOKENIZER_BATCH)
                   for ids in tokenizer(texts[first:first + TOKENIZER_BATCH], truncation=True,
                                        max_length=max_length)["input_ids"]]
        lengths.append(np.array([len(ids) for ids in encoded], dtype=np.int64))
        parts.append(Dataset.from_dict({
            "input_ids": encoded,
            "labels": [label_ids[name] for name in frame["label"]],
            "length": lengths[-1].tolist(),
        }))
    if not parts:  # no rows: the Dataset the whole-split path made of an empty frame
        return Dataset.from_dict({"input_ids": [], "labels": [], "length": []}), np.array([], dtype=np.int64)
    return (parts[0] if len(parts) == 1 else concatenate_datasets(parts)), np.concatenate(lengths)


def run(params: Params) -> dict:
    max_length = params.tokenize.max_length
    labels = read_json(paths.LABELS)["labels"]
    if params.task.type == "causal_lm":
        return run_sft(params, labels)
    label_ids = {name: i for i, name in enumerate(labels)}
    tokenizer = load_tokenizer(paths.BASE_MODEL)

    splits, metrics = {}, {}
    for split in paths.SPLITS:
        splits[split], lengths = _tokenize_split(paths.validated_path(split), tokenizer, label_ids, labels, max_length)
        metrics[split] = length_stats(lengths, max_length)

    with atomic_dir(paths.TOKENIZED_DIR) as out:
        DatasetDict(splits).save_to_disk(str(out))
    write_json(paths.report("tokenize"), metrics)
    for split, stats in metrics.items():
        print(f"tokenize: {split}: {stats['rows']} rows, {stats['tokens']} tokens, mean {stats['mean']}, "
              f"p95 {stats['p95']}, max {stats['max']}, truncated {stats['truncated']}")
    return metrics


def main() -> None:
    stage_main("tokenize", run, FileNotFoundError, ValueError)


if __name__ == "__main__":
    main()
