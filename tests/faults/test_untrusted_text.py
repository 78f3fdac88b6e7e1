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


@fault("security", "a label that is a spreadsheet formula (`=cmd\\|' /C calc'!A0`, `+`, `-`, `@`, tab, CR) in a CSV the "
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


@fault("params", "a name that is a path, or holds characters a name may not (`register.model_name: ../../evil`, "
       "`train.experiment: team/a`, `register.alias: v2`)",
       "clear error in one line before any compute (the config check and every stage): the key, the value, the rule "
       "and a name that fits", "nothing run: no MLflow experiment or model is created")
def test_names_used_as_identifiers_are_refused_before_any_compute(tmp_path, capsys):
    import yaml

    from frugaltune.config import ParamsError, load_params, main
    from tests.faults.helpers import ROOT, base_params

    for section, key, value, fits in (("register", "model_name", "../../evil", "evil"),
                                      ("register", "model_name", "my model", "my-model"),
                                      ("train", "experiment", "team/a", "team-a"),
                                      ("register", "alias", "v2", None), ("register", "alias", "best model", None)):
        raw = base_params()
        raw[section][key] = value
        path = tmp_path / "params.yaml"
        path.write_text(yaml.safe_dump(raw))
        with pytest.raises(ParamsError) as error:
            load_params(path)
        message = str(error.value)
        assert len(message.splitlines()) == 1 and f"{section}.{key}" in message and repr(value) in message, message
        assert "letters, digits" in message, message  # the rule
        if fits:
            assert f"`{fits}`" in message, message  # the fix
        with pytest.raises(SystemExit) as check:  # `python -m frugaltune.config`, the check users run
            main([str(path)])
        assert str(check.value) == message
    assert not (tmp_path / "mlflow.db").exists() and not (tmp_path / "mlruns").exists()
    for params in (ROOT / "params.yaml", ROOT / "scheduling" / "params.yaml"):  # the shipped names fit the rule
        load_params(params)
    raw = base_params()  # `auto` derives a name from data.source that fits the rule, however long the file's name
    raw["data"]["source"] = "data/" + "very long export name " * 10 + ".csv"
    raw["register"]["model_name"], raw["train"]["experiment"] = "auto", None
    path.write_text(yaml.safe_dump(raw))
    assert len(load_params(path).register_.model_name) <= 100


@fault("data", "labels that cannot name a class: 300 characters, a control character, two labels MLflow keys "
       "cannot tell apart (`a=b` and `a_b`), or `</script>…` (which would run in `dvc plots show`'s page), from the "
       "data or in `data.labels`",
       "clear error in one line naming the label, the file and row (or `data.labels`), the rule and the fix",
       "no split written")
def test_labels_that_cannot_name_a_class_are_refused(tmp_path, monkeypatch):
    import yaml

    from frugaltune import paths
    from frugaltune.config import ParamsError, parse_params
    from frugaltune.data import DataSourceError
    from stages import ingest
    from tests.faults.helpers import base_params, csv_text, params_for, rows

    monkeypatch.chdir(tmp_path)
    long = "x" * 300
    for bad, why in ((long, "300 characters"), ("neg\x07ative", "U+0007"), ("a_b", "`a=b`"),
                     ("</script><img src=x onerror=alert(1)>", "dvc plots show")):
        data = rows() + [(f"a tweet {i} about the weather", label) for i, label in enumerate(["a=b", bad] * 5)]
        source = tmp_path / "labels.csv"
        source.write_text(csv_text(data))
        with pytest.raises(DataSourceError) as error:
            ingest.run(parse_params(params_for(source)))
        message = str(error.value)
        row = next(i for i, (_, label) in enumerate(data) if label == bad) + 1
        assert len(message.splitlines()) == 1 and str(source) in message and f"row {row}" in message, message
        assert repr(bad[:60]).rstrip("'") in message and why in message and "data.label_column" in message, message
        assert not paths.SPLITS_DIR.exists()
    raw = base_params()
    raw["data"]["labels"] = ["positive", "a=b", "a_b"]
    with pytest.raises(ParamsError, match=r"`data.labels` .*'a_b'.*`a=b`") as error:
        parse_params(yaml.safe_load(yaml.safe_dump(raw)))
    assert len(str(error.value).splitlines()) == 1


@fault("data", "labels holding characters MLflow keys refuse (`Sci/Tech`, `x/../y`, `a//b`, `a=b`, spaces)",
       "register logs every per-class figure under a key MLflow accepts (`finetuned.per_class.x_.._y.f1`)",
       "the version and its metrics, as for any label")
def test_any_label_gives_mlflow_keys_register_can_log(tmp_path, monkeypatch):
    from mlflow import MlflowClient

    from frugaltune import registry, tracking

    labels = ["very positive", "a=b", "Sci/Tech", "x/../y", "a//b", FORMULA]
    evaluation = {"finetuned": {"macro_f1": 0.5, "per_class": {label: {"f1": 0.1 * i, "support": i}
                                                               for i, label in enumerate(labels)}}}
    tags = registry.metric_tags(evaluation)
    assert len(tags) == 1 + 2 * len(labels)  # no two labels share a key
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    monkeypatch.delenv("MLFLOW_EXPERIMENT_ID", raising=False)
    try:
        experiment_id = tracking.setup("labels")
        client = MlflowClient()
        run_id = client.create_run(experiment_id).info.run_id
        registry.log_eval_metrics(client, run_id, tags)  # register's two writes of these keys: metrics and tags
        for key, value in tags.items():
            client.set_tag(run_id, key, value)
        logged = client.get_run(run_id).data
    finally:
        import mlflow

        mlflow.set_tracking_uri(None)
    assert logged.metrics["eval.finetuned.per_class.x_.._y.f1"] == pytest.approx(0.3)
    assert set(logged.tags) >= set(tags)
