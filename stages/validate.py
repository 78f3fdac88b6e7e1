"""Validate the ingested splits with a Great Expectations suite.  Run by DVC as:  python -m stages.validate

Reads `validate.*`, `data/splits/{train,val,test}.parquet` and the label set in `data/splits/labels.json`.
Writes, when the data passes:
  - `data/validated/{split}.parquet`: the rows that pass every row-level check, columns and order unchanged;
  - `data/quarantine.parquet`: the failing rows (split, source_row, text, label[, confidence], reason), where
    reason names every failed check (`text_too_short; label_not_in_set`);
  - `reports/validate.json`: rows/passed/quarantined and failing counts per check, per split and in total, and
    the measured table-level shares (duplicates, missing confidence, mojibake, class shares, bad rows);
  - `reports/data_docs/`: the GX data docs (open index.html), also written when validation fails, to see why.
    GX validates the rows a chunk (validation.GX_CHUNK_ROWS rows) at a time: beyond one chunk, the docs show the first
    chunk's run, while the quarantine and the report cover every row.

causal_lm prompt/response pairs (labels.json `"task": "causal_lm"`) get the pair suite: prompt present, not blank
and within the length bounds, response present and not blank, no duplicate pair (validation.build_suite).

The stage fails, naming the check, the measured value, the threshold and the `validate.*` key to change, when
more than `validate.max_bad_fraction` of the rows are quarantined or a table-level check fails. It then leaves no
validated splits, quarantine or report behind. The checks themselves live in `frugaltune/validation/`.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path

import pandas as pd

from frugaltune.entry import stage_main
from frugaltune.io import atomic_dir, write_json, write_metrics
from frugaltune.validation import DataValidationError, ValidationRules, check_columns, validate_splits
from frugaltune import paths
from frugaltune.config import Params


def _remove_outputs() -> None:
    """Stale outputs of an earlier run must not survive a failing one (DVC does this too; a direct run must)."""
    for path in (paths.VALIDATED_DIR, paths.DATA_DOCS):
        shutil.rmtree(path, ignore_errors=True)
    for path in (paths.QUARANTINE, paths.report("validate")):
        path.unlink(missing_ok=True)


def _read_labels() -> tuple[list[str], bool]:
    """The label set, and whether the rows are causal_lm prompt/response pairs (no label set then)."""
    if not paths.LABELS.is_file():
        raise DataValidationError(f"{paths.LABELS}: not found. Run `dvc repro ingest` first.")
    content = json.loads(paths.LABELS.read_text(encoding="utf-8"))
    if isinstance(content, dict) and content.get("task") == "causal_lm" and "prompt_template" not in content:
        return [], True
    labels = content.get("labels") if isinstance(content, dict) else None
    if not labels or not all(isinstance(label, str) for label in labels):
        raise DataValidationError(f"{paths.LABELS}: `labels` must be a non-empty list of strings, got {labels!r}.")
    return labels, False


# causal_lm pairs go through the checks as text (the prompt) and label (the response), and come out renamed back
AS_CHECKED = {"prompt": "text", "response": "label"}
AS_STORED = {checked: stored for stored, checked in AS_CHECKED.items()}


def _read_split(split: str, pairs: bool = False) -> pd.DataFrame:
    path = paths.split_path(split)
    if not path.is_file():
        raise DataValidationError(f"{path}: not found. Run `dvc repro ingest` first.")
    frame = pd.read_parquet(path)
    if pairs:
        missing = [column for column in AS_CHECKED if column not in frame.columns]
        if missing:
            raise DataValidationError(f"{path}: columns {missing} are missing for task.type causal_lm. Rerun "
                                      "`dvc repro ingest`.")
        frame = frame.rename(columns=AS_CHECKED)
    check_columns(frame, path)  # fail before any GX work, naming the file
    if frame.empty:
        raise DataValidationError(f"{path}: the {split} split has no rows. Rerun `dvc repro ingest` (it refuses "
                                  "empty splits and says which data.split.* to change), or give it more rows.")
    return frame


def _write_parquet(frame: pd.DataFrame, path: Path) -> None:
    """Temp file beside `path`, then rename: a crash leaves no half-written parquet."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}-", dir=path.parent)
    os.close(fd)
    try:
        frame.to_parquet(tmp, index=False)
        os.chmod(tmp, 0o644)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def run(params: Params) -> dict:
    rules = ValidationRules(**params.validate_.model_dump())
    _remove_outputs()
    labels, pairs = _read_labels()
    # this order decides which duplicate is first
    splits = {split: _read_split(split, pairs) for split in paths.SPLITS}

    with atomic_dir(paths.DATA_DOCS) as docs:
        outcome = validate_splits(splits, labels, rules, docs_dir=docs, pairs=pairs)
    del splits  # the outcome holds their rows (a copy): these would stay beside it while the outputs are written
    stored = (lambda frame: frame.rename(columns=AS_STORED)) if pairs else (lambda frame: frame)
    if not outcome.passed:
        raise DataValidationError(
            f"{outcome.failure_message(key_prefix='validate.')}\n\nDetails: {paths.DATA_DOCS / 'index.html'}"
        )

    emptied = [split for split in paths.SPLITS if outcome.validated(split).empty]
    if emptied:
        raise DataValidationError(
            f"no row of the {', '.join(emptied)} split(s) passed validation (all quarantined): nothing to "
            f"{'train on' if 'train' in emptied else 'evaluate on'}. See the checks above and "
            f"{paths.DATA_DOCS / 'index.html'}; fix the source or loosen the validate.* rule that removed them.")
    with atomic_dir(paths.VALIDATED_DIR) as out:
        for split in paths.SPLITS:
            _write_parquet(stored(outcome.validated(split)), out / paths.validated_path(split).name)
    _write_parquet(stored(outcome.quarantine()), paths.QUARANTINE)
    metrics = outcome.metrics()
    write_metrics(paths.metrics("validate"), {k: metrics["total"][k] for k in ("rows", "passed", "quarantined")})
    write_json(paths.report("validate"), metrics)  # last: its presence means the stage finished

    total = metrics["total"]
    print(outcome.summary(key_prefix="validate."))
    per_split = ", ".join(f"{split} {metrics[split]['passed']}/{metrics[split]['rows']}" for split in paths.SPLITS)
    if outcome.docs_rows < total["rows"]:
        print(f"validate: the data docs show GX's run on the first {outcome.docs_rows:,} of the {total['rows']:,} "
              f"rows; every row was checked, {outcome.docs_rows:,} at a time, and {paths.report('validate')} counts "
              "them all")
    print(f"validate: {total['passed']} of {total['rows']} rows pass ({per_split}); {total['quarantined']} "
          f"quarantined in {paths.QUARANTINE}; data docs: {paths.DATA_DOCS / 'index.html'}")
    return metrics


def main() -> None:
    stage_main("validate", run, DataValidationError)


if __name__ == "__main__":
    main()
