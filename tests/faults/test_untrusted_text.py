"""Untrusted text stays text: what a data file or a params file holds never runs as HTML, a spreadsheet formula, a
path or an MLflow key it was not meant to be.

Run with `make test` or `pytest -m slow tests/faults`. Each test is a row of docs/FAULTS.md (see table.py). The data
docs are opened in Debian's chromium through Playwright, as tests/e2e/test_ui_browser.py does (skipped, saying why,
where no chromium is installed).
"""

from __future__ import annotations

import pandas as pd
import pytest

from frugaltune.validation import ValidationRules, validate_splits
from tests.faults.helpers import LABELS
from tests.faults.table import fault

pytestmark = pytest.mark.slow

XSS = "<img src=x onerror=alert(document.domain)>"  # the label cell
SCRIPT = "<script>alert('text')</script> and the rest of the tweet"
FORMULA = "=cmd|' /C calc'!A0"  # the label class


def splits_holding(cells: dict[tuple[str, int, str], str]) -> dict[str, pd.DataFrame]:
    """Balanced, clean splits with `cells` ((split, row, column) -> value) set."""
    def split(rows: int, start: int) -> pd.DataFrame:
        return pd.DataFrame({"source_row": pd.Series(range(start, start + rows), dtype="int64"),
                             "text": [f"tweet number {i} about cars" for i in range(start, start + rows)],
                             "label": [LABELS[i % 3] for i in range(start, start + rows)]})

    splits = {"train": split(30, 0), "val": split(12, 100), "test": split(12, 200)}
    for (name, row, column), value in cells.items():
        splits[name].loc[row, column] = value
    return splits


RULES = ValidationRules(min_text_chars=3, max_text_chars=40, min_confidence=0.5, max_bad_fraction=0.35,
                        max_duplicate_fraction=0.2, max_missing_confidence_fraction=0.25, max_mojibake_fraction=0.2,
                        min_class_fraction=0.1, drop_duplicates=True)


@fault("security", "HTML in the data (`<img src=x onerror=alert(…)>` as a label cell, `<script>` in a text, a declared "
       "label holding markup) shown in the data docs",
       "shown as the text it is: every data value and label is escaped before GX renders it; no script runs in the "
       "browser", "the data docs, with the row quarantined as ever")
def test_html_in_the_data_is_text_in_the_data_docs(tmp_path):
    from tests.e2e.test_ui_browser import CHROMIUM, FLAGS

    if not CHROMIUM.exists():
        pytest.skip(f"no {CHROMIUM}: `make chromium` installs it (needs root and apt-get)")
    from playwright.sync_api import sync_playwright

    declared = "<b onmouseover=alert(3)>positive</b>"  # a label of data.labels, in the docs' descriptions
    splits = splits_holding({("train", 0, "label"): XSS, ("train", 1, "text"): SCRIPT})
    for frame in splits.values():
        frame.loc[frame["label"] == "positive", "label"] = declared
    docs = tmp_path / "data_docs"
    outcome = validate_splits(splits, [*LABELS[:2], declared], RULES, docs_dir=docs)
    assert set(outcome.quarantine()["source_row"]) == {0, 1}  # the rows themselves are judged as before

    pages = sorted(docs.rglob("*.html"))
    assert any(page.name == "frugaltune-splits.html" for page in pages), pages
    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=str(CHROMIUM), args=FLAGS)
        try:
            page = browser.new_page()
            dialogs: list[str] = []
            page.on("dialog", lambda dialog: (dialogs.append(dialog.message), dialog.dismiss()))
            shown = {}
            for path in pages:
                page.goto(path.as_uri())
                page.wait_for_load_state("load")
                page.wait_for_timeout(300)  # an onerror fires once the broken image has failed to load
                shown[path.name] = page.inner_text("body")
        finally:
            browser.close()
    assert dialogs == [], f"a value from the data ran as script in the data docs: alert({dialogs})"
    results = shown["frugaltune-splits.html"]
    for text in (XSS, SCRIPT.split(" and")[0], declared):
        assert text in results, f"{text!r} is not shown as text in the data docs"
    assert "&lt;" not in "".join(shown.values()), "escaped twice: the page shows `&lt;` instead of `<`"


def _dvc_confusion_data(csv: str) -> list[dict]:
    """The rows of a confusion CSV as `dvc plots show` embeds them in its page, through DVC's own CSV reader and its
    `confusion` template (dvc-render)."""
    import json

    from dvc.repo.plots import _load_sv  # what `dvc plots` reads a .csv plot file with
    from dvc_render import VegaRenderer

    datapoints = _load_sv(csv)
    spec = json.loads(VegaRenderer(datapoints, "confusion.csv", template="confusion", x="actual",
                                   y="predicted").partial_html())
    return spec["data"]["values"]


@fault("security", "a label that is a spreadsheet formula (`=cmd|' /C calc'!A0`, `+`, `-`, `@`, tab, CR) in a CSV the "
       "project writes (evaluate's and compare's confusion CSVs, the federated label counts)",
       "the cell starts with `'` (OWASP): a spreadsheet shows it as text and runs nothing; numbers, `-1` as a label "
       "included, stay numbers", "the CSV, still a plot: `dvc plots show` draws the confusion matrix with the labels")
def test_csv_cells_that_start_a_formula_are_neutralised():
    import csv
    import io

    from frugaltune.io import csv_text
    from frugaltune.recipes.evaluate import confusion_csv

    labels = [FORMULA, "+1+1", "@SUM(A1)", "\tleading tab", "\rleading CR", "-1", "neutral", "-2+3"]
    text = confusion_csv(labels, list(reversed(labels)))
    read = list(csv.DictReader(io.StringIO(text)))
    assert [row["actual"] for row in read] == ["'" + FORMULA, "'+1+1", "'@SUM(A1)", "'\tleading tab",
                                               "'\nleading CR", "-1", "neutral", "'-2+3"]  # a bare CR ends a row
    assert [row["predicted"] for row in read] == [row["actual"] for row in reversed(read)]
    assert all(not cell.startswith(("=", "+", "@", "\t", "\r")) for row in read for cell in row.values())
    shown = _dvc_confusion_data(text)
    assert {row["actual"] for row in shown} == {row["actual"] for row in read}  # every label drawn, readable
    # the federated stage's per-client label counts: a label is a cell, a count stays a number
    counts = list(csv.reader(io.StringIO(csv_text([{"client": 0, "label": FORMULA, "count": -3}],
                                                  ["client", "label", "count"]))))
    assert counts == [["client", "label", "count"], ["0", "'" + FORMULA, "-3"]]
