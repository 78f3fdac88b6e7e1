"""Bad data: every file a user may point `data.source` at, read by the real ingest (and validate) stages.

Run with `make test` or `pytest -m slow tests/faults`. Each test is a row of docs/FAULTS.md (see table.py).
"""

from __future__ import annotations

import json
import os

import pandas as pd
import pytest

from frugaltune import paths
from frugaltune.config import parse_params
from frugaltune.data import DataSourceError
from frugaltune.validation import DataValidationError
from stages import ingest, validate
from tests.faults.helpers import csv_text, params_for, rows
from tests.faults.table import fault

pytestmark = pytest.mark.slow


@pytest.fixture
def project(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    return tmp_path


def ingest_fails(source, match: list[str], **data) -> str:
    """Ingest refuses `source` with a message holding every string of `match`, and writes nothing."""
    with pytest.raises(DataSourceError) as error:
        ingest.run(parse_params(params_for(source, **data), "params.yaml"))
    message = str(error.value)
    for part in match:
        assert part in message, message
    assert not paths.SPLITS_DIR.exists() and not paths.report("ingest").exists()
    return message


def ingest_and_validate(source, **data) -> dict:
    params = parse_params(params_for(source, **data), "params.yaml")
    ingest.run(params)
    return validate.run(params)


@fault("data", "a CSV with an unbalanced quote", "clear error: the file, the row, and how to close the quote",
       "no split written")
def test_unbalanced_quote(project):
    source = project / "quotes.csv"
    source.write_text(csv_text(rows()).replace("tweet number 5", '"tweet number 5'))
    ingest_fails(source, [str(source), "row", "never closes"])


@fault("data", "non-UTF-8 bytes where UTF-8 is declared", "clear error: the file, the line, the byte, `data.encoding`",
       "no split written")
def test_not_utf8(project):
    source = project / "latin1.csv"
    source.write_bytes(csv_text(rows()).replace("tweet number 7 ", "caf\xe9 number 7 ").encode("latin-1"))
    ingest_fails(source, [str(source), "line 9", "data.encoding"])


@fault("data", "labels outside `data.labels`", "rows quarantined as `label_not_in_set` (the stage fails instead when "
       "they exceed `validate.max_bad_fraction`)", "the valid rows go on; the others, with the reason, in "
       "data/quarantine.parquet")
def test_labels_outside_the_set(project):
    source = project / "extra.csv"
    source.write_text(csv_text(rows() + [(f"an angry tweet {i} about the weather", "angry") for i in range(6)]))
    report = ingest_and_validate(source, labels=["negative", "neutral", "positive"])
    quarantine = pd.read_parquet(paths.QUARANTINE)
    assert (quarantine["reason"] == "label_not_in_set").sum() == 6 and set(quarantine["label"]) == {"angry"}
    assert report["total"]["passed"] == 90


@fault("data", "30 % empty texts", "those rows quarantined as `text_empty`/`text_missing`; the count in the report",
       "the other 70 % go on (over `validate.max_bad_fraction` the stage fails naming it)")
def test_thirty_percent_empty_texts(project):
    source = project / "empty_texts.csv"
    source.write_text(csv_text([("" if i % 10 < 3 else t, l) for i, (t, l) in enumerate(rows(120))]))
    report = ingest_and_validate(source)
    assert report["total"]["quarantined"] == 36 and report["total"]["passed"] == 84
    assert set(pd.read_parquet(paths.QUARANTINE)["reason"]) <= {"text_missing", "text_empty"}


@fault("data", "a 10 MB line", "that row quarantined as `text_too_long`", "the other rows go on")
def test_a_ten_megabyte_line(project):
    source = project / "long.csv"
    source.write_text(csv_text(rows()) + '"' + "x" * 10_000_000 + '",negative\n')
    report = ingest_and_validate(source)
    quarantine = pd.read_parquet(paths.QUARANTINE)
    assert list(quarantine["reason"]) == ["text_too_long"] and report["total"]["passed"] == 90


@fault("data", "a header and no rows", "clear error: the file has a header but no rows", "no split written")
def test_header_only(project):
    (project / "header.csv").write_text("text,label\n")
    ingest_fails(project / "header.csv", ["header.csv", "no rows"])


@fault("data", "an empty file", "clear error: the file is empty, point data.source at a file with rows",
       "no split written")
def test_empty_file(project):
    (project / "empty.csv").write_text("")
    ingest_fails(project / "empty.csv", ["empty.csv", "empty", "data.source"])


@fault("data", "binary garbage named .csv", "clear error: not a csv text file (binary data), check the export or "
       "data.format", "no split written")
def test_binary_garbage(project):
    (project / "garbage.csv").write_bytes(os.urandom(2000) + b"\x00" + os.urandom(2000))
    ingest_fails(project / "garbage.csv", ["garbage.csv", "binary data", "data.format"])


@fault("data", "JSONL with one broken line", "clear error naming the line number and its start", "no split written")
def test_jsonl_with_a_broken_line(project):
    lines = [json.dumps({"text": t, "label": l}) for t, l in rows()]
    lines.insert(40, '{"text": "oops", "label": ')
    (project / "broken.jsonl").write_text("\n".join(lines) + "\n")
    ingest_fails(project / "broken.jsonl", ["broken.jsonl", "line 41", "not valid JSON", "fix or delete"])


@fault("data", "a Parquet file whose label column is float", "integral floats are class ids (0.0 -> \"0\"); a "
       "fractional one is refused naming the column", "no split written for the refused file")
def test_parquet_with_float_labels(project):
    pairs = rows()
    pd.DataFrame({"text": [t for t, _ in pairs], "label": [float(i % 3) for i in range(90)]}).to_parquet(
        project / "ids.parquet")
    report = ingest.run(parse_params(params_for(project / "ids.parquet"), "params.yaml"))
    assert report["train"]["labels"].keys() == {"0", "1", "2"}
    for path in (paths.SPLITS_DIR, paths.report("ingest")):
        (path.unlink() if path.is_file() else __import__("shutil").rmtree(path))
    pd.DataFrame({"text": [t for t, _ in pairs], "label": [0.5 * (i % 3) for i in range(90)]}).to_parquet(
        project / "scores.parquet")
    ingest_fails(project / "scores.parquet", ["scores.parquet", "label"])


@fault("data", "a split directory missing one split", "clear error naming the missing split and the naming rule",
       "no split written")
def test_split_directory_missing_a_split(project):
    folder = project / "splits"
    folder.mkdir()
    for split in ("train", "val"):
        (folder / f"{split}.csv").write_text(csv_text(rows()))
    ingest_fails(folder, ["missing: test", "train/val/test"])


@fault("data", "a path that does not exist", "clear error: no such file or directory, and what data.source accepts",
       "no split written")
def test_missing_path(project):
    ingest_fails(project / "nope.csv", ["nope.csv", "no such file or directory"])


@fault("data", "a source so small a split comes out empty (issue #19)", "clear error: rows per split, "
       "`data.split.*`, and the fix (more rows, other fractions, a split directory)", "no split written")
def test_a_split_comes_out_empty(project):
    (project / "small.csv").write_text(csv_text(rows(12)))
    ingest_fails(project / "small.csv", ["12 rows", "val has 0", "data.split.val", "Fix"])


@fault("data", "every row of a split quarantined (issue #19)", "clear error: no row of the split passed, the checks "
       "and the data docs to read", "no validated data written")
def test_every_row_of_a_split_quarantined(project):
    pairs = rows()
    (project / "d").mkdir()
    for split in ("train", "val", "test"):
        text = [(f"{t} {split}", l) for t, l in pairs] if split != "val" else [("ab", l) for _, l in pairs[:3]]
        (project / "d" / f"{split}.csv").write_text(csv_text(text))
    params = parse_params(params_for(project / "d"), "params.yaml")
    ingest.run(params)
    with pytest.raises(DataValidationError, match="val") as error:
        validate.run(params)
    assert "quarantined" in str(error.value) or "passed validation" in str(error.value)
    assert not paths.VALIDATED_DIR.exists()
