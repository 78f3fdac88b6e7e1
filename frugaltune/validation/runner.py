"""Running the suite: `validate_splits` validates every split together through GX, a chunk of rows at a time.

Library code (no DVC): `stages/validate.py` calls `validate_splits` (re-exported by `frugaltune.validation`) and
writes what the returned `ValidationOutcome` holds; `scheduling/trace_checks.py` reuses `_context`.
"""

from __future__ import annotations

import datetime
import html
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import great_expectations as gx
import numpy as np
import pandas as pd
from great_expectations.core.run_identifier import RunIdentifier
from great_expectations.data_context.types.base import (
    DataContextConfig,
    InMemoryStoreBackendDefaults,
    ProgressBarsConfig,
)

from frugaltune.validation.outcome import TableCheck, ValidationOutcome, _examples
from frugaltune.validation.rules import (
    _STRIPPED,
    CONFIDENCE,
    GX_CHUNK_ROWS,
    SPLIT,
    DataValidationError,
    ValidationRules,
    check_columns,
)
from frugaltune.validation.suite import _PAIR_KEY, ROW_CHECKS, build_suite

_DUPLICATE_CHECKS = ("duplicate_text", "duplicate_pair")


def _context(docs_dir: Path | None) -> gx.data_context.EphemeralDataContext:
    """An in-memory GX context (nothing written to the project), with one docs site in `docs_dir` if given."""
    sites = {}
    if docs_dir is not None:
        sites["local_site"] = {
            "class_name": "SiteBuilder",
            "show_how_to_buttons": False,
            "store_backend": {"class_name": "TupleFilesystemStoreBackend", "base_directory": str(docs_dir.resolve())},
            "site_index_builder": {"class_name": "DefaultSiteIndexBuilder"},
        }
    config = DataContextConfig(
        store_backend_defaults=InMemoryStoreBackendDefaults(),
        data_docs_sites=sites,
        analytics_enabled=False,
        progress_bars=ProgressBarsConfig(globally=False),
    )
    return gx.get_context(mode="ephemeral", project_config=config)


def _escape_stored_results(context: gx.data_context.EphemeralDataContext) -> None:
    """HTML-escape every string of the stored results' `result` (unexpected values, their index rows), which the
    data docs are built from.

    GX 1.24 escapes the parameters of its sentences, but puts the cells of its unexpected-values tables into the page
    as they are: a label cell `<img src=x onerror=...>` ran as script there. Only the stored copy is escaped; the
    outcome returned to the caller keeps the values as they are in the data.
    """
    def escaped(value):
        if isinstance(value, str):
            return html.escape(value)
        if isinstance(value, list):
            return [escaped(item) for item in value]
        if isinstance(value, dict):
            return {key: escaped(item) for key, item in value.items()}
        return value

    store = context.validation_results_store
    for key in store.list_keys():
        suite_result = store.get(key)
        for res in suite_result.results:
            res.result = escaped(res.result)
        store.set(key, suite_result)


def _gx_frame(frame: pd.DataFrame, pairs: bool) -> pd.DataFrame:
    """`frame` with the helper columns GX checks: the stripped text (null when blank) and, for pairs, the pair key."""
    stripped = frame["text"].astype("str").str.strip()  # astype keeps nulls null
    gx_frame = frame.assign(**{_STRIPPED: stripped.where(stripped != "")})
    if pairs:
        gx_frame[_PAIR_KEY] = stripped + "\x1f" + frame["label"].astype("str").str.strip()
    return gx_frame


def validate_splits(
    splits: Mapping[str, pd.DataFrame],
    labels: Sequence[str],
    rules: ValidationRules,
    docs_dir: Path | None = None,
    pairs: bool = False,
    chunk_rows: int = GX_CHUNK_ROWS,
) -> ValidationOutcome:
    """Run the suite over all splits together (in the mapping's order, which decides which duplicate is first).

    Args:
        splits: split name -> frame with at least source_row, text, label (and optionally confidence).
        labels: the declared label set, in class-id order.
        rules: thresholds.
        docs_dir: where GX writes the data docs site (HTML) for this run; None writes none.
        pairs: causal_lm prompt -> response rows given as `text` (prompt) and `label` (response); see build_suite.
        chunk_rows: rows GX validates at once. More rows than that: every chunk is validated, the row and table
            checks count every row, and the data docs show the first chunk's run (`ValidationOutcome.docs_rows`).

    Raises:
        DataValidationError: a required column is missing, or `(split, source_row)` is not unique.
    """
    frame = _all_splits(splits)
    has_confidence = CONFIDENCE in frame.columns
    key_column = _PAIR_KEY if pairs else _STRIPPED  # what the duplicate checks compare

    context = _context(docs_dir)
    found = _run_chunks(context, frame, labels, rules, has_confidence, pairs, chunk_rows, key_column)
    if docs_dir is not None:
        _build_docs(context, docs_dir)

    duplicate = _duplicates(frame, found, pairs, key_column)
    row_failures = {}
    for name in ROW_CHECKS:
        if name in found.first:
            row_failures[name] = pd.Series(duplicate if name in _DUPLICATE_CHECKS else found.failed[name],
                                           index=frame.index)
    reasons = _reasons(row_failures, frame.index, rules)
    results = _table_results(frame, found, duplicate, whole=len(frame) <= chunk_rows)
    table_checks = _table_checks(frame, reasons, rules, results, found, row_failures, has_confidence)
    return ValidationOutcome(frame, reasons, row_failures, table_checks, rules, tuple(labels),
                             min(len(frame), chunk_rows))


def _all_splits(splits: Mapping[str, pd.DataFrame]) -> pd.DataFrame:
    """Every split's rows in one frame, the `split` column first; raises DataValidationError on a bad column, no
    rows at all, or a `(split, source_row)` seen twice."""
    for split, frame in splits.items():
        check_columns(frame, split)
    columns = {tuple(frame.columns) for frame in splits.values()}
    if len({CONFIDENCE in c for c in columns}) > 1:
        raise DataValidationError(f"`{CONFIDENCE}` is in some splits but not all: {sorted(columns)}.")
    frame = pd.concat([f.assign(**{SPLIT: s}) for s, f in splits.items()], ignore_index=True)
    frame = frame[[SPLIT, *(c for c in frame.columns if c != SPLIT)]]
    if frame.empty:
        raise DataValidationError("no rows to validate: every split is empty.")
    if frame.duplicated([SPLIT, "source_row"]).any():
        twice = frame.loc[frame.duplicated([SPLIT, "source_row"]), [SPLIT, "source_row"]].head(3).values.tolist()
        raise DataValidationError(f"(split, source_row) must identify a row; repeated: {twice}.")
    return frame


@dataclass
class _Found:
    """What the chunks' GX runs found, over every row of the combined frame (`rows` of them)."""

    rows: int
    # check -> mask over frame (row checks and mojibake, whose rows are the examples)
    failed: dict = field(default_factory=dict)
    # mostly-type table check -> [element_count, missing_count, unexpected_count]
    counts: dict = field(default_factory=dict)
    first: dict = field(default_factory=dict)  # check -> the first chunk's GX result, in suite order
    present: np.ndarray = field(init=False)  # the duplicate key is not null
    hashes: np.ndarray = field(init=False)  # the duplicate key's hash

    def __post_init__(self) -> None:
        self.present, self.hashes = np.zeros(self.rows, dtype=bool), np.zeros(self.rows, dtype=np.uint64)

    def add(self, part: pd.DataFrame, gx_part: pd.DataFrame, start: int, by_check: dict, key_column: str) -> None:
        """Count one chunk's results (`by_check`: check name -> GX result) for its rows, from `start` on."""
        position = {key: start + i for i, key in enumerate(zip(part[SPLIT], part["source_row"].tolist()))}
        for name, res in by_check.items():
            if name in ROW_CHECKS or name == "mojibake_fraction":
                hits = [position[(d[SPLIT], int(d["source_row"]))] for d in res.result.get("unexpected_index_list")
                        or []]
                self.failed.setdefault(name, np.zeros(self.rows, dtype=bool))[hits] = True
            if "unexpected_count" in res.result and res.expectation_config.meta["level"] == "table":
                tally = self.counts.setdefault(name, [0, 0, 0])
                for i, field_name in enumerate(("element_count", "missing_count", "unexpected_count")):
                    tally[i] += res.result.get(field_name, 0)
        self.first = self.first or by_check
        key = gx_part[key_column]
        self.present[start:start + len(part)] = key.notna().to_numpy()
        self.hashes[start:start + len(part)] = pd.util.hash_array(key.fillna("").to_numpy(dtype=object))


def _run_chunks(context: gx.data_context.EphemeralDataContext, frame: pd.DataFrame, labels: Sequence[str],
                rules: ValidationRules, has_confidence: bool, pairs: bool, chunk_rows: int,
                key_column: str) -> _Found:
    """The suite over `frame`, `chunk_rows` rows at a time; the first chunk's run is stored for the data docs.

    GX holds a whole batch and every unexpected row of it (a class share lists the other classes' rows), so the rows
    go through it `chunk_rows` at a time: row failures are kept as masks over `frame`, table-level counts are summed,
    and the duplicate checks, which span chunks, are decided over every row afterwards (`_duplicates`). The first
    chunk's run is the one stored for the data docs (the whole table when it fits one chunk).
    """
    batch = (context.data_sources.add_pandas("frugaltune").add_dataframe_asset("splits")
             .add_batch_definition_whole_dataframe("all_splits"))
    suite = context.suites.add(build_suite(rules, labels, has_confidence, pairs))
    definition = context.validation_definitions.add(gx.ValidationDefinition(name="validate", data=batch, suite=suite))
    result_format = {"result_format": "COMPLETE", "unexpected_index_column_names": [SPLIT, "source_row"]}
    order = [expectation.meta["check"] for expectation in suite.expectations]
    if len(frame) > chunk_rows:  # the suite again, as the chunks after the first run it (see below)
        row_suite, share_suite = _chunk_suites(rules, labels, has_confidence, pairs)

    found = _Found(len(frame))
    for start in range(0, len(frame), chunk_rows):
        part = frame.iloc[start:start + chunk_rows]
        gx_part = _gx_frame(part, pairs)
        if start == 0:
            outcomes = definition.run(batch_parameters={"dataframe": gx_part}, result_format=result_format,
                                      run_id=RunIdentifier(run_name="validate",
                                                           run_time=datetime.datetime.now(datetime.timezone.utc))
                                      ).results
        else:  # not stored: only the first chunk's run is shown in the data docs
            # GX lists a check's unexpected rows one pandas lookup at a time, and a class share's are the other
            # classes' rows, most of the chunk: those checks only need their counts (BASIC)
            part_batch = batch.get_batch(batch_parameters={"dataframe": gx_part})
            outcomes = [*part_batch.validate(row_suite, result_format=result_format).results,
                        *part_batch.validate(share_suite, result_format={"result_format": "BASIC"}).results]
        found.add(part, gx_part, start, _by_check(outcomes, order), key_column)
    return found


def _chunk_suites(rules: ValidationRules, labels: Sequence[str], has_confidence: bool,
                  pairs: bool) -> tuple[gx.ExpectationSuite, gx.ExpectationSuite]:
    """The suite split in two for the chunks after the first: every check but the class shares, and the shares."""
    again = build_suite(rules, labels, has_confidence, pairs).expectations
    share = [e.meta["check"].startswith("class_fraction.") for e in again]
    row_suite = gx.ExpectationSuite(name="validate-rows", expectations=[
        e for e, is_share in zip(again, share) if not is_share])
    share_suite = gx.ExpectationSuite(name="validate-shares", expectations=[
        e for e, is_share in zip(again, share) if is_share])
    return row_suite, share_suite


def _by_check(outcomes: list, order: list[str]) -> dict:
    """Check name -> GX result, in suite order (GX returns them in its own order); raises when GX could not
    evaluate an expectation."""
    by_check = {}
    for res in sorted(outcomes, key=lambda res: order.index(res.expectation_config.meta["check"])):
        config = res.expectation_config
        if (res.exception_info or {}).get("raised_exception"):
            raise RuntimeError(f"GX could not evaluate {config.type} {config.kwargs}: "
                               f"{res.exception_info['exception_message']}")
        by_check[config.meta["check"]] = res
    return by_check


def _build_docs(context: gx.data_context.EphemeralDataContext, docs_dir: Path) -> None:
    """The data docs site in `docs_dir`, its stored results escaped and its scripts and styles vendored."""
    _escape_stored_results(context)
    context.build_data_docs()
    from frugaltune.offline import vendor_data_docs  # GX's pages load Bootstrap/jQuery/Vega from CDNs

    for url in vendor_data_docs(docs_dir):
        print(f"validate: data docs still load {url} from the network", file=sys.stderr)


def _duplicates(frame: pd.DataFrame, found: _Found, pairs: bool, key_column: str) -> np.ndarray:
    """Copies after the first of a key, over every row: equal hashes first, then the keys of those rows compared."""
    duplicate = np.zeros(found.rows, dtype=bool)
    maybe = np.flatnonzero(found.present & pd.Series(found.hashes).duplicated(keep=False).to_numpy())
    if len(maybe):
        duplicate[maybe] = _gx_frame(frame.iloc[maybe], pairs)[key_column].duplicated().to_numpy()
    return duplicate


def _reasons(row_failures: dict[str, pd.Series], index: pd.Index, rules: ValidationRules) -> pd.Series:
    """Per row: the row checks that quarantine it, joined by "; " ("" when none); duplicates only when dropped."""
    quarantining = [n for n in row_failures if n not in _DUPLICATE_CHECKS or rules.drop_duplicates]
    reasons = pd.Series("", index=index, dtype=object)
    for name in quarantining:
        reasons[row_failures[name]] += name + "; "
    return reasons.str.removesuffix("; ").astype(str)


def _table_results(frame: pd.DataFrame, found: _Found, duplicate: np.ndarray, whole: bool) -> dict:
    """Table check -> (result as GX gives it, over every row; passed). `whole`: GX saw every row at once, so its
    own results and verdicts stand; otherwise they are computed from the chunks' counts and the rows."""
    results = {}
    for name, res in found.first.items():
        if res.expectation_config.meta["level"] != "table":
            continue
        kwargs = res.expectation_config.kwargs
        if whole:
            results[name] = (res.result, bool(res.success))
        elif name in found.counts:  # `mostly`: the share of non-null rows that are as expected
            element, missing, unexpected = found.counts[name]
            considered = element - missing
            results[name] = ({"element_count": element, "missing_count": missing, "unexpected_count": unexpected},
                             not considered or (considered - unexpected) / considered >= kwargs["mostly"])
        else:  # a proportion of unique / of non-null values, at least min_value
            present = found.present
            if name == "duplicate_fraction":  # no text at all: nothing repeats
                observed = (present.sum() - duplicate.sum()) / present.sum() if present.any() else 1.0
            else:
                observed = frame[CONFIDENCE].notna().sum() / found.rows
            results[name] = ({"observed_value": float(observed)}, bool(observed >= kwargs["min_value"]))
    return results


def _table_checks(frame: pd.DataFrame, reasons: pd.Series, rules: ValidationRules, results: dict, found: _Found,
                  row_failures: dict[str, pd.Series], has_confidence: bool) -> tuple[TableCheck, ...]:
    """`bad_fraction`, then each table check's measure, threshold and verdict, with examples of the rows behind."""
    table_checks = [_bad_fraction(frame, reasons, rules)]
    behind = {  # rows that make up each measured share, for the examples in the summary
        "duplicate_fraction": row_failures.get("duplicate_text", row_failures.get("duplicate_pair")),
        "missing_confidence_fraction": frame[CONFIDENCE].isna() if has_confidence else None,
    }
    for name, (result, passed) in results.items():
        rule, at_most = _TABLE_RULES[name.split(".")[0]]
        rows_behind = (pd.Series(found.failed[name], index=frame.index) if name == "mojibake_fraction"
                       else behind.get(name))
        examples = _examples(frame, rows_behind) if rows_behind is not None else ()
        table_checks.append(TableCheck(name, _measured(name, result), getattr(rules, rule), at_most, rule, passed,
                                       examples))
    return tuple(table_checks)


_TABLE_RULES = {
    "duplicate_fraction": ("max_duplicate_fraction", True),
    "missing_confidence_fraction": ("max_missing_confidence_fraction", True),
    "mojibake_fraction": ("max_mojibake_fraction", True),
    "class_fraction": ("min_class_fraction", False),
}


def _measured(name: str, result: dict) -> float:
    """The share a table-level GX result stands for (GX itself decides pass or fail)."""
    if "observed_value" in result:  # proportion of unique / of non-null values: we report the complement
        return 1.0 - float(result["observed_value"])
    considered = result["element_count"] - result.get("missing_count", 0)  # `mostly` counts non-null values
    unexpected = result["unexpected_count"] / considered if considered else 0.0
    return unexpected if name == "mojibake_fraction" else 1.0 - unexpected  # class share: the rows in the set


def _bad_fraction(frame: pd.DataFrame, reasons: pd.Series, rules: ValidationRules) -> TableCheck:
    """Not a GX expectation: the share of rows quarantined by the row-level checks together."""
    bad = reasons != ""
    share = float(bad.mean())
    return TableCheck("bad_fraction", share, rules.max_bad_fraction, True, "max_bad_fraction",
                      share <= rules.max_bad_fraction, _examples(frame, bad))
