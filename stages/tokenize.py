"""Tokenize the validated splits.  Run by DVC as:  python -m stages.tokenize

Reads `tokenize.*`, `data/validated/`, the label set and the base model's tokenizer. Writes `data/tokenized/`
(a `datasets.DatasetDict` saved with `save_to_disk`: input_ids, labels, length) and `reports/tokenize.json`
(length statistics per split). Truncates at `tokenize.max_length` and pads nothing: batches pad to their own
longest sequence at training time, so no compute is spent on padding to a fixed length.
"""

from __future__ import annotations

import sys

import numpy as np
import pandas as pd
from datasets import Dataset, DatasetDict

from frugaltune.faults import stage_errors
from frugaltune.io import atomic_dir, read_json, write_json
from frugaltune.models import load_tokenizer
from frugaltune import paths
from frugaltune.config import Params, ParamsError, load_params


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


def run(params: Params) -> dict:
    max_length = params.tokenize.max_length
    labels = read_json(paths.LABELS)["labels"]
    label_ids = {name: i for i, name in enumerate(labels)}
    tokenizer = load_tokenizer(paths.BASE_MODEL)

    splits, metrics = {}, {}
    for split in paths.SPLITS:
        frame = pd.read_parquet(paths.validated_path(split))
        unknown = sorted(set(frame["label"]) - set(label_ids))
        if unknown:
            raise ValueError(f"{paths.validated_path(split)}: labels {unknown} are not in {paths.LABELS} ({labels}); "
                             "rerun `dvc repro validate`, which quarantines them.")
        encoded = tokenizer(frame["text"].tolist(), truncation=True, max_length=max_length)["input_ids"]
        lengths = np.array([len(ids) for ids in encoded], dtype=np.int64)
        splits[split] = Dataset.from_dict({
            "input_ids": encoded,
            "labels": [label_ids[name] for name in frame["label"]],
            "length": lengths.tolist(),
        })
        metrics[split] = length_stats(lengths, max_length)

    with atomic_dir(paths.TOKENIZED_DIR) as out:
        DatasetDict(splits).save_to_disk(str(out))
    write_json(paths.report("tokenize"), metrics)
    for split, stats in metrics.items():
        print(f"tokenize: {split}: {stats['rows']} rows, {stats['tokens']} tokens, mean {stats['mean']}, "
              f"p95 {stats['p95']}, max {stats['max']}, truncated {stats['truncated']}")
    return metrics


def main() -> None:
    with stage_errors("tokenize"):  # a full disk: one clear line, not a traceback
        try:
            run(load_params())
        except (ParamsError, FileNotFoundError, ValueError) as exc:
            sys.exit(f"tokenize: {exc}")


if __name__ == "__main__":
    main()
