"""Ingest the dataset: copy the raw input, cap it, split it.  Run by DVC as:  python -m stages.ingest

Reads `data.*` and `common.seed`. Writes `data/raw/` (an exact copy of the input, DVC-tracked),
`data/splits/{train,val,test}.parquet` (columns source_row, text, label[, confidence]), `data/splits/labels.json`
(the label set in class-id order, which travels with the model) and `reports/ingest.json`.
Values are not cleaned here: `validate` judges them, so that what is dropped is counted and explained.

`task.type: causal_lm` with prompt/response (or chat `messages`) rows: the splits hold source_row, prompt, response
[, messages][, candidates], drawn at random (no label to stratify on) and labels.json says `"task": "causal_lm"`.
With `task.prompt_template` the rows are read and split exactly as for the classifier (tokenize writes prompts).
"""

from __future__ import annotations

import shutil

import numpy as np
import pandas as pd

from frugaltune.entry import stage_main
from frugaltune.data import (
    DataSourceError,
    assignment,
    check_split_sizes,
    infer_labels,
    iter_table,
    normalize_columns,
    normalize_pairs,
    random_split,
    read_table,
    resolve_source,
    source_sha256,
    stratified_sample,
    stratified_split,
    write_splits,
)
from frugaltune.io import atomic_dir, write_json
from frugaltune import paths
from frugaltune.config import Params, label_problem


def pairs_mode(params: Params) -> bool:
    """Rows are prompt -> response pairs (causal_lm without a prompt template, which reads labelled rows)."""
    return params.task.type == "causal_lm" and params.task.prompt_template is None


def _read(path, params: Params, encoding: str) -> pd.DataFrame:
    data, task = params.data, params.task
    frame = read_table(path, data.format, encoding)
    if pairs_mode(params):
        return normalize_pairs(frame, path, task.prompt_column, task.response_column, task.messages_column,
                               task.candidates_column)
    return normalize_columns(frame, path, data.text_column, data.label_column, data.confidence_column)


def _chunks(path, params: Params, encoding: str):
    """The file's rows as `normalize_columns` gives them, a chunk (data.CHUNK_ROWS rows) at a time."""
    data = params.data
    for chunk in iter_table(path, data.format, encoding):
        yield normalize_columns(chunk, path, data.text_column, data.label_column, data.confidence_column,
                                first_row=int(chunk.index[0]))


def run_pairs(params: Params) -> dict:
    """causal_lm pairs: read, cap (seeded sample), split at random; no label set (labels.json says the task)."""
    data, task, seed = params.data, params.task, params.common.seed
    source = resolve_source(data.source, data.encoding)
    if source.presplit:
        splits = {split: _read(path, params, source.encoding) for split, path in source.files.items()}
        if data.max_rows and len(splits["train"]) > data.max_rows:
            splits["train"] = splits["train"].sample(n=data.max_rows, random_state=seed).sort_index()
    else:
        (path,) = source.files.values()
        frame = _read(path, params, source.encoding)
        if data.max_rows and len(frame) > data.max_rows:
            frame = frame.sample(n=data.max_rows, random_state=seed).sort_index().reset_index(drop=True)
        splits = random_split(frame, data.split.val, data.split.test, seed)
    empty = [split for split, frame in splits.items() if frame.empty]
    if empty:
        raise DataSourceError(f"{data.source}: the {', '.join(empty)} split(s) would be empty "
                              f"({sum(len(f) for f in splits.values())} rows). Give it more rows or raise data.split.*.")
    _write(source, splits, {"labels": [], "task": "causal_lm", "source": data.source,
                            "prompt_column": task.messages_column or task.prompt_column,
                            "response_column": task.response_column, "raw_sha256": source_sha256(source)})
    metrics = {split: {"rows": len(frame)} for split, frame in splits.items()}
    metrics["rows"] = sum(len(frame) for frame in splits.values())
    metrics["task"] = "causal_lm"
    write_json(paths.report("ingest"), metrics)
    print(f"ingest: {data.source} -> {metrics['rows']} prompt/response pairs "
          f"(train {len(splits['train'])}, val {len(splits['val'])}, test {len(splits['test'])})")
    return metrics


def _write(source, splits: dict[str, pd.DataFrame], labels_json: dict,
           stream: tuple[Params, np.ndarray] | None = None) -> None:
    """`stream` (params, each file row's split as `data.assignment` gives it): the splits hold only source_row and
    label, and the rows are streamed from the one source file into them."""
    with atomic_dir(paths.RAW_DIR) as raw:
        for split, path in sorted(source.files.items()):
            name = f"{source.name}{path.suffix}" if split == "all" else f"{source.name}/{path.name}"
            (raw / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(path, raw / name)
    with atomic_dir(paths.SPLITS_DIR) as out:
        if stream is None:
            for split, frame in splits.items():
                frame.to_parquet(out / paths.split_path(split).name, index=False)
        else:
            params, where = stream
            (path,) = source.files.values()
            write_splits(_chunks(path, params, source.encoding), where,
                         {split: out / paths.split_path(split).name for split in splits})
        write_json(out / paths.LABELS.name, labels_json)


def run(params: Params) -> dict:
    if pairs_mode(params):
        return run_pairs(params)
    data, seed = params.data, params.common.seed
    source = resolve_source(data.source, data.encoding)

    # Read everything before writing anything: a bad file must not leave new outputs behind. One file is read a
    # chunk at a time, keeping each row's number and label only (the split is drawn from those), then streamed into
    # the splits: memory is a chunk's, whatever the file's size.
    stream = None
    if source.presplit:
        splits = {split: _read(path, params, source.encoding) for split, path in source.files.items()}
        if data.max_rows:  # benchmark val/test sets stay as given; only training data is capped
            splits["train"] = stratified_sample(splits["train"], data.max_rows, seed)
    else:
        (path,) = source.files.values()
        keys = pd.concat([chunk[["source_row", "label"]] for chunk in _chunks(path, params, source.encoding)],
                         ignore_index=True)
        rows = len(keys)
        if data.max_rows:
            keys = stratified_sample(keys, data.max_rows, seed)
        splits = stratified_split(keys, data.split.val, data.split.test, seed)
        stream = (params, assignment(splits, rows))

    labels = list(data.labels) if data.labels else infer_labels(splits["train"]["label"])
    problem = label_problem(labels)  # labels read from the data (the params check has seen data.labels)
    if problem:
        label, why = problem
        read = splits["train"] if source.presplit else pd.concat(splits.values())  # the file's rows, each once
        row = int(read.loc[read["label"] == label, "source_row"].min())
        path = source.files["train"] if source.presplit else next(iter(source.files.values()))
        raise DataSourceError(f"{path}: row {row + 1}: {why}. Rename the class in column {data.label_column!r} "
                              f"(data.label_column), or list the classes to keep in data.labels.")
    if len(labels) < 2:
        raise DataSourceError(f"{data.source}: found {len(labels)} distinct label(s) in the training data ({labels}); "
                              f"a classifier needs at least 2. Check data.label_column.")
    check_split_sizes({split: len(frame) for split, frame in splits.items()}, labels, data.source,
                      source.presplit, data.split.val, data.split.test)

    _write(source, splits, {
        "labels": labels,
        "source": data.source,
        "text_column": data.text_column,
        "label_column": data.label_column,
        "raw_sha256": source_sha256(source),
        # causal_lm from labelled rows: the same rows and splits as the classifier; tokenize writes the prompts
        **({"task": "causal_lm", "prompt_template": params.task.prompt_template}
           if params.task.type == "causal_lm" else {}),
    }, stream)

    metrics = {
        split: {"rows": len(frame), "labels": {lab: int((frame["label"] == lab).sum()) for lab in labels}}
        for split, frame in splits.items()
    }
    metrics["num_labels"] = len(labels)
    metrics["rows"] = sum(len(frame) for frame in splits.values())
    write_json(paths.report("ingest"), metrics)
    print(f"ingest: {data.source} -> {metrics['rows']} rows "
          f"(train {len(splits['train'])}, val {len(splits['val'])}, test {len(splits['test'])}), labels {labels}")
    return metrics


def main() -> None:
    stage_main("ingest", run, DataSourceError)


if __name__ == "__main__":
    main()
