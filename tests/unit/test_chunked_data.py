"""The data stages a chunk at a time (ingest, validate, tokenize): the same rows, reasons and ids as the whole-file
path, and quarantine naming the file's rows across chunk boundaries. Tiny files, chunks of a few rows; seconds."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest

from frugaltune.data import (
    assignment,
    iter_table,
    normalize_columns,
    read_table,
    stratified_split,
    write_splits,
)
from frugaltune.validation import ValidationRules, validate_splits
from stages import tokenize as tokenize_stage

LABELS = ["negative", "neutral", "positive"]


def tweets(rows: int, first: int = 0) -> pd.DataFrame:
    return pd.DataFrame({"sentiment": [LABELS[i % 3] for i in range(rows)], "confidence": 0.9,
                         "text": [f"tweet {i} about self-driving cars" for i in range(first, first + rows)]})


def test_chunked_ingest_writes_the_splits_the_whole_file_path_writes(tmp_path):
    source = tmp_path / "tweets.csv"
    tweets(47).to_csv(source, index=False)

    def normalized(chunk: pd.DataFrame) -> pd.DataFrame:
        return normalize_columns(chunk, source, "text", "sentiment", "confidence", first_row=int(chunk.index[0]))

    whole = stratified_split(normalized(read_table(source)), 0.2, 0.2, seed=7)
    for rows, chunk_rows in ((47, 5), (47, 100)):
        keys = pd.concat([normalized(c)[["source_row", "label"]] for c in iter_table(source, chunk_rows=chunk_rows)],
                         ignore_index=True)
        drawn = stratified_split(keys, 0.2, 0.2, seed=7)
        out = {split: tmp_path / f"{split}-{chunk_rows}.parquet" for split in drawn}
        write_splits((normalized(c) for c in iter_table(source, chunk_rows=chunk_rows)), assignment(drawn, rows), out)
        for split, frame in whole.items():
            pd.testing.assert_frame_equal(pd.read_parquet(out[split]), frame)
    for split, frame in whole.items():  # one chunk: the bytes `to_parquet` writes
        frame.to_parquet(tmp_path / f"{split}-whole.parquet", index=False)
        assert (tmp_path / f"{split}-100.parquet").read_bytes() == (tmp_path / f"{split}-whole.parquet").read_bytes()


def test_chunked_validation_counts_every_row_and_quarantines_file_rows_across_chunks():
    frames = {split: normalize_columns(tweets(rows, first), "x", "text", "sentiment", "confidence", first_row=first)
              for split, rows, first in (("train", 20, 0), ("val", 9, 100), ("test", 9, 200))}
    frames["val"].loc[6, "text"] = "  tweet 2 about self-driving cars "  # a copy of train's row 2, chunks apart
    frames["test"].loc[4, "text"] = "ab"  # too short
    frames["test"].loc[7, "label"] = "sarcastic"
    frames["train"].loc[13, "text"] = "itâ€™s a car"  # mojibake: counted, an example
    rules = ValidationRules(min_text_chars=3, max_text_chars=80, min_confidence=0.5, max_bad_fraction=0.35,
                            max_duplicate_fraction=0.2, max_missing_confidence_fraction=0.25,
                            max_mojibake_fraction=0.2, min_class_fraction=0.1, drop_duplicates=True)
    whole = validate_splits(frames, LABELS, rules)
    chunked = validate_splits(frames, LABELS, rules, chunk_rows=4)

    assert chunked.docs_rows == 4 and whole.docs_rows == 38
    quarantine = chunked.quarantine()[["split", "source_row", "reason"]].values.tolist()
    assert quarantine == [["val", 106, "duplicate_text"], ["test", 204, "text_too_short"],
                          ["test", 207, "label_not_in_set"]]
    pd.testing.assert_frame_equal(chunked.quarantine(), whole.quarantine())
    for split in ("train", "val", "test"):
        pd.testing.assert_frame_equal(chunked.validated(split), whole.validated(split))
    assert chunked.metrics() == whole.metrics()
    assert chunked.table_checks == whole.table_checks


def test_chunked_tokenize_gives_the_whole_split_dataset(tmp_path, smol_tokenizer):
    path = tmp_path / "train.parquet"
    normalize_columns(tweets(23), path, "text", "sentiment", "confidence").to_parquet(path, index=False)
    label_ids = {name: i for i, name in enumerate(LABELS)}
    whole, whole_lengths = tokenize_stage._tokenize_split(path, smol_tokenizer, label_ids, LABELS, 128)
    chunked, lengths = tokenize_stage._tokenize_split(path, smol_tokenizer, label_ids, LABELS, 128, chunk_rows=5)
    assert chunked.to_dict() == whole.to_dict() and chunked.features == whole.features
    np.testing.assert_array_equal(lengths, whole_lengths)

    frame = pd.read_parquet(path)
    frame.loc[17, "label"] = "sarcastic"  # in the fourth chunk
    frame.to_parquet(path, index=False)
    with pytest.raises(ValueError, match=r"labels \['sarcastic'\] are not in"):
        tokenize_stage._tokenize_split(path, smol_tokenizer, label_ids, LABELS, 128, chunk_rows=5)
