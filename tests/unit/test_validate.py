"""The validate stage: which rows are quarantined and why, and when the whole stage fails.

Real GX runs (no mocks) on small parquet files in a temp project dir, and the library on in-memory frames.
"""

from __future__ import annotations

import json
import re

import pandas as pd
import pytest

from frugaltune.validation import (
    MOJIBAKE_PATTERN,
    DataValidationError,
    ValidationRules,
    validate_splits,
)
from frugaltune import paths
from stages import validate as stage
from frugaltune.config import parse_params

LABELS = ["negative", "neutral", "positive"]


def has_mojibake(text: str) -> bool:
    """Python's reading of `MOJIBAKE_PATTERN` (GX runs it through pandas: the last test below checks they agree)."""
    return re.search(MOJIBAKE_PATTERN, text) is not None
RULES = dict(
    min_text_chars=3, max_text_chars=50, min_confidence=0.5, max_bad_fraction=0.35, max_duplicate_fraction=0.2,
    max_missing_confidence_fraction=0.25, max_mojibake_fraction=0.2, min_class_fraction=0.1, drop_duplicates=True,
)


def good_split(rows: int, start: int = 0, confidence: bool = True) -> pd.DataFrame:
    """Balanced labels, distinct clean texts, high confidence; source_row from `start`."""
    frame = pd.DataFrame({
        "source_row": pd.Series(range(start, start + rows), dtype="int64"),
        "text": [f"tweet number {i} about cars" for i in range(start, start + rows)],
        "label": [LABELS[i % 3] for i in range(start, start + rows)],
    })
    if confidence:
        frame["confidence"] = 0.9
    return frame


def good_splits(**kwargs) -> dict[str, pd.DataFrame]:
    return {"train": good_split(30, 0, **kwargs), "val": good_split(12, 100, **kwargs),
            "test": good_split(12, 200, **kwargs)}


def rules(**overrides) -> ValidationRules:
    return ValidationRules(**{**RULES, **overrides})


def write_project(root, splits: dict[str, pd.DataFrame], labels=LABELS) -> None:
    (root / paths.SPLITS_DIR).mkdir(parents=True)
    for split, frame in splits.items():
        frame.to_parquet(root / paths.split_path(split), index=False)
    (root / paths.LABELS).write_text(json.dumps({"labels": labels, "source": "test"}))


def params(**overrides):
    return parse_params({"validate": {**RULES, **overrides}})


@pytest.fixture
def project(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    return tmp_path


# ---------------------------------------------------------------------------------------------------------------
# mojibake


@pytest.mark.parametrize("text", [
    "cafÃ© au lait",  # é as UTF-8 read as latin-1
    "itâ€™s broken",  # ’ read as cp1252
    "itâ\x80\x99s broken",  # ’ read as latin-1 (C1 controls)
    "price:Â 5",  # no-break space, second byte normalised
    "nice ðŸ˜€",  # emoji read as cp1252
    "Patriotsäó» #DeflateGate",  # the tweet corpus: ’ mangled twice
    "lineup _ôÖÍ",  # the tweet corpus: an emoji mangled twice
])
def test_mojibake_pattern_flags_utf8_read_as_latin1(text):
    assert has_mojibake(text)


@pytest.mark.parametrize("text", [
    "plain ascii tweet #cars", "café au lait", "naïve Ångström façade", "Ça coûte 5 €", "über straße",
    "smart “quotes” and ’apostrophes’", "emoji 😀 as it should be",
])
def test_mojibake_pattern_spares_clean_text(text):
    assert not has_mojibake(text)


def test_mojibake_pattern_means_the_same_to_pandas_as_to_python():
    # GX runs the pattern through pandas, which may use pyarrow's RE2 rather than Python's `re`.
    texts = ["cafÃ© au lait", "itâ€™s", "a\x85b", "café", "naïve", "Â x", "äó»", "_ôÖ", "plain", "ðŸ˜€", "É»"]
    assert pd.Series(texts, dtype="str").str.contains(MOJIBAKE_PATTERN).tolist() == [has_mojibake(t) for t in texts]


# ---------------------------------------------------------------------------------------------------------------
# row-level checks (library, one GX run each)


@pytest.mark.parametrize("column, value, reason", [
    ("text", "   \t ", "text_empty"),
    ("text", None, "text_missing"),
    ("text", " ab ", "text_too_short"),
    ("text", "x" * 51, "text_too_long"),
    ("label", "sarcastic", "label_not_in_set"),
    ("label", None, "label_missing"),
    ("confidence", 1.5, "confidence_out_of_range"),
    ("confidence", 0.3, "confidence_too_low"),
])
def test_each_bad_row_kind_is_quarantined_with_its_reason(column, value, reason):
    splits = good_splits()
    splits["train"].loc[4, column] = value
    outcome = validate_splits(splits, LABELS, rules())
    quarantine = outcome.quarantine()
    assert quarantine[["split", "source_row", "reason"]].values.tolist() == [["train", 4, reason]]
    assert outcome.metrics()["train"]["checks"][reason] == 1
    assert outcome.passed


def test_negative_confidence_fails_range_and_minimum():
    splits = good_splits()
    splits["val"].loc[0, "confidence"] = -0.1
    reason = validate_splits(splits, LABELS, rules()).quarantine()["reason"].tolist()
    assert reason == ["confidence_out_of_range; confidence_too_low"]


def test_missing_confidence_is_allowed_row_by_row():
    splits = good_splits()
    splits["train"].loc[[0, 1], "confidence"] = float("nan")
    outcome = validate_splits(splits, LABELS, rules())
    assert outcome.quarantine().empty
    assert outcome.metrics()["total"]["missing_confidence_fraction"] == pytest.approx(2 / 54, abs=1e-6)


def test_duplicates_keep_the_first_copy_across_splits_in_order():
    splits = good_splits()
    splits["val"].loc[3, "text"] = "  " + splits["train"].loc[7, "text"] + " "  # same text after stripping
    splits["test"].loc[5, "text"] = splits["train"].loc[7, "text"]
    outcome = validate_splits(splits, LABELS, rules())
    assert outcome.quarantine()[["split", "source_row", "reason"]].values.tolist() == [
        ["val", 103, "duplicate_text"], ["test", 205, "duplicate_text"]]
    assert 7 in outcome.validated("train")["source_row"].tolist()
    assert outcome.metrics()["total"]["duplicate_fraction"] == pytest.approx(2 / 54, abs=1e-6)


def test_duplicates_are_only_counted_when_drop_duplicates_is_false():
    splits = good_splits()
    splits["test"].loc[5, "text"] = splits["train"].loc[7, "text"]
    outcome = validate_splits(splits, LABELS, rules(drop_duplicates=False))
    assert outcome.quarantine().empty
    assert outcome.metrics()["total"]["checks"]["duplicate_text"] == 1
    assert len(outcome.validated("test")) == 12


def test_a_source_without_confidence_skips_the_confidence_checks():
    outcome = validate_splits(good_splits(confidence=False), LABELS, rules())
    assert outcome.passed
    assert "confidence_too_low" not in outcome.metrics()["total"]["checks"]
    assert "missing_confidence_fraction" not in outcome.metrics()["total"]
    assert list(outcome.quarantine().columns) == ["split", "source_row", "text", "label", "reason"]


# ---------------------------------------------------------------------------------------------------------------
# table-level checks


def test_mojibake_over_threshold_fails_naming_value_threshold_and_key():
    splits = good_splits()
    splits["train"]["text"] = splits["train"]["text"] + " itâ€™s"  # 30 of 54 rows
    outcome = validate_splits(splits, LABELS, rules())
    assert not outcome.passed
    assert outcome.quarantine().empty  # mojibake is measured, not quarantined
    message = outcome.failure_message("validate.")
    assert "mojibake_fraction = 0.5556 > 0.2" in message
    assert "`validate.max_mojibake_fraction`" in message
    assert "train:0" in message  # an example row


def test_a_class_under_its_minimum_share_fails():
    splits = good_splits()
    for frame in splits.values():
        frame.loc[frame["label"] == "positive", "label"] = "negative"
    splits["train"].loc[2, "label"] = "positive"  # 1 of 54 rows
    outcome = validate_splits(splits, LABELS, rules())
    failed = [check.name for check in outcome.table_checks if not check.passed]
    assert failed == ["class_fraction.positive"]
    assert outcome.metrics()["total"]["class_fraction"]["positive"] == pytest.approx(1 / 54, abs=1e-6)
    assert "class_fraction.positive = 0.0185 < 0.1" in outcome.failure_message("validate.")
    assert "`validate.min_class_fraction`" in outcome.failure_message("validate.")


def test_too_much_missing_confidence_fails():
    splits = good_splits()
    splits["train"]["confidence"] = float("nan")  # 30 of 54
    outcome = validate_splits(splits, LABELS, rules())
    assert [c.name for c in outcome.table_checks if not c.passed] == ["missing_confidence_fraction"]


def test_too_many_duplicates_fail_even_when_kept():
    splits = good_splits()
    splits["train"]["text"] = "the same tweet every time"
    outcome = validate_splits(splits, LABELS, rules(drop_duplicates=False))
    assert [c.name for c in outcome.table_checks if not c.passed] == ["duplicate_fraction"]


# ---------------------------------------------------------------------------------------------------------------
# the stage: files in, files out


def test_good_data_passes_and_is_written_unchanged(project):
    splits = good_splits()
    write_project(project, splits)
    metrics = stage.run(params())
    for split, frame in splits.items():
        pd.testing.assert_frame_equal(pd.read_parquet(paths.validated_path(split)), frame)
    assert pd.read_parquet(paths.QUARANTINE).empty
    report = json.loads(paths.report("validate").read_text())
    assert report == metrics
    assert report["total"]["rows"] == report["total"]["passed"] == 54
    assert report["val"]["quarantined"] == 0 and report["total"]["bad_fraction"] == 0
    thirds = {"negative": 1 / 3, "neutral": 1 / 3, "positive": 1 / 3}
    assert report["total"]["class_fraction"] == pytest.approx(thirds, abs=1e-6)
    assert (paths.DATA_DOCS / "index.html").is_file()
    assert not list(project.glob("**/gx"))  # the GX context lives in memory


def test_quarantine_file_names_every_failed_check(project):
    splits = good_splits()
    splits["train"].loc[3, ["text", "label"]] = ["ab", "mixed"]
    splits["test"].loc[0, "confidence"] = 0.1
    write_project(project, splits)
    stage.run(params())
    quarantine = pd.read_parquet(paths.QUARANTINE)
    assert list(quarantine.columns) == ["split", "source_row", "text", "label", "confidence", "reason"]
    assert quarantine.to_dict("records") == [
        {"split": "train", "source_row": 3, "text": "ab", "label": "mixed", "confidence": 0.9,
         "reason": "text_too_short; label_not_in_set"},
        {"split": "test", "source_row": 200, "text": "tweet number 200 about cars", "label": "positive",
         "confidence": 0.1, "reason": "confidence_too_low"},
    ]
    train = pd.read_parquet(paths.validated_path("train"))
    assert len(train) == 29 and 3 not in train["source_row"].tolist()
    assert json.loads(paths.report("validate").read_text())["total"]["quarantined"] == 2
    assert json.loads(paths.metrics("validate").read_text()) == {"rows": 54, "passed": 52, "quarantined": 2}

    # The data docs say what happened: the run passed (rows were quarantined, not a failure), each row rule says it
    # quarantines, the class-share check says what it means; and every page renders with no network.
    from frugaltune.offline import remote_urls

    result_page = next((paths.DATA_DOCS / "validations").rglob("*.html")).read_text()
    assert re.search(r"Status:</span>[^<]*<i [^>]*></i>\s*(\w+)", result_page).group(1) == "Succeeded"
    assert "Row rule `confidence_too_low`" in result_page and "are quarantined" in result_page
    assert "Class share: `negative` holds at least" in result_page
    assert "at least 10 % of the time" not in result_page
    for page in paths.DATA_DOCS.rglob("*.html"):
        assert remote_urls(page.read_text()) == [], page
    index = (paths.DATA_DOCS / "index.html").read_text()
    assert "static/vendor/bootstrap-table-offline.js" in index and "static/vendor/jquery.min.js" in index
    assert (paths.DATA_DOCS / "static/vendor/font-awesome/webfonts").is_dir()


def test_over_max_bad_fraction_fails_and_leaves_no_outputs(project):
    splits = good_splits()
    splits["train"].loc[:19, "confidence"] = 0.2  # 20 of 54 rows = 37% > 35%
    write_project(project, splits)
    for stale in (paths.validated_path("train"), paths.QUARANTINE, paths.report("validate")):
        stale.parent.mkdir(parents=True, exist_ok=True)
        stale.write_text("from an earlier run")
    with pytest.raises(DataValidationError) as error:
        stage.run(params())
    message = str(error.value)
    assert "bad_fraction = 0.3704 > 0.35" in message and "`validate.max_bad_fraction`" in message
    assert "confidence_too_low" in message and "train:0, train:1, train:2" in message
    assert not paths.VALIDATED_DIR.exists()
    assert not paths.QUARANTINE.exists()
    assert not paths.report("validate").exists()
    assert (paths.DATA_DOCS / "index.html").is_file()  # the data docs show what failed


def test_missing_text_column_fails_naming_column_and_file(project):
    splits = good_splits()
    splits["val"] = splits["val"].rename(columns={"text": "tweet"})
    write_project(project, splits)
    with pytest.raises(DataValidationError, match=r"data/splits/val.parquet: required column `text` is missing"):
        stage.run(params())
    assert not paths.DATA_DOCS.exists() and not paths.VALIDATED_DIR.exists()


def test_missing_splits_say_which_stage_to_run(project):
    with pytest.raises(DataValidationError, match="dvc repro ingest"):
        stage.run(params())
