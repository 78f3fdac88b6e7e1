"""Data validation with a Great Expectations suite: which rows are fit to train on, and is the table healthy.

Library code (no DVC): `stages/validate.py` reads the splits, calls `validate_splits`, and writes what the
returned `ValidationOutcome` holds. Two kinds of checks, all expressed as GX expectations so that the data docs
show every rule next to its result:

- row-level: a row that fails one of them is quarantined with the names of every check it failed
  (`text_too_short; label_not_in_set`). GX's `unexpected_index_list` (result format COMPLETE, indexed by
  `split` and `source_row`) says which rows failed.
- table-level: shares measured over all splits together (duplicates, missing confidence, mojibake, class
  balance), each compared with a threshold; one failing fails the whole validation. So does `bad_fraction`, the
  share of quarantined rows, the one table-level value computed here rather than by a GX expectation.
"""

from __future__ import annotations

import datetime
import html
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import great_expectations as gx
import great_expectations.expectations as gxe
import numpy as np
import pandas as pd
from great_expectations.core.run_identifier import RunIdentifier
from great_expectations.data_context.types.base import (
    DataContextConfig,
    InMemoryStoreBackendDefaults,
    ProgressBarsConfig,
)


REQUIRED_COLUMNS = ("source_row", "text", "label")
# Rows GX validates at once. GX holds a whole batch and builds its result row by row (a class share lists the other
# classes' rows as unexpected), so more rows than this go through it a chunk at a time; the default run (a few
# thousand rows) is one chunk, and its data docs show every row.
GX_CHUNK_ROWS = 10_000
CONFIDENCE = "confidence"
SPLIT = "split"  # added in front of the columns of the quarantine
_STRIPPED = "text_stripped"  # helper column seen by GX only: the text stripped, null when blank

# Mojibake: UTF-8 bytes that were decoded as latin-1 or cp1252. A text has it when it holds one of:
#   - a C1 control character (U+0080-U+009F): a raw byte 0x80-0x9F read as latin-1; never in real text;
#   - a whole UTF-8 multi-byte sequence seen through latin-1/cp1252: a lead byte (Â-ß: 2 bytes, à-ï: 3, ð-ô: 4)
#     followed by its continuation bytes (0x80-0xBF as latin-1 or cp1252): 'Ã©' (é), 'â€™' (’), 'ðŸ˜€' (😀);
#   - 'Â' before whitespace: a no-break space (Â\xa0) whose second byte was normalised to a space;
#   - UTF-8 mangled twice (through cp1252 and Mac Roman), as in tweet corpora: 'äó' (’ “ ” …), and '_ô', '_Ñ'
#     where the lead byte became '_'.
# Legitimate latin-1 text ('café', 'naïve', 'Ångström') matches none; an accented capital directly before a
# symbol ('É»') would. RE2-compatible (no look-arounds): pandas may run it through pyarrow.
_CONTINUATION = r"[\x80-\xbf€‚ƒ„…†‡ˆ‰Š‹ŒŽ‘’“”•–—˜™š›œžŸ]"
MOJIBAKE_PATTERN = "|".join([
    r"[\x80-\x9f]",
    rf"[\xc2-\xdf]{_CONTINUATION}",
    rf"[\xe0-\xef]{_CONTINUATION}{{2}}",
    rf"[\xf0-\xf4]{_CONTINUATION}{{3}}",
    r"Â\s",
    "äó|_[ôÑ]",
])
@dataclass(frozen=True)
class ValidationRules:
    """The thresholds; field names are those of the `validate` params section (documented there)."""

    min_text_chars: int
    max_text_chars: int
    min_confidence: float
    max_bad_fraction: float
    max_duplicate_fraction: float
    max_missing_confidence_fraction: float
    max_mojibake_fraction: float
    min_class_fraction: float
    drop_duplicates: bool


class DataValidationError(ValueError):
    """The data is unfit to train on; the message names each failed check, its value and the knob to turn."""


def check_columns(frame: pd.DataFrame, source: str | Path) -> None:
    """Raise DataValidationError naming `source` and the column when a required column is missing."""
    for column in REQUIRED_COLUMNS:
        if column not in frame.columns:
            raise DataValidationError(
                f"{source}: required column `{column}` is missing (columns: {', '.join(map(str, frame.columns))}). "
                "The ingest stage writes source_row, text, label: rerun it, or check data.text_column / "
                "data.label_column."
            )
    for column in (SPLIT, _STRIPPED):
        if column in frame.columns:
            raise DataValidationError(f"{source}: column `{column}` is reserved for validation output; rename it.")
    if not pd.api.types.is_integer_dtype(frame["source_row"]):
        raise DataValidationError(f"{source}: column `source_row` must hold the integer row numbers of the raw "
                                  f"input, got dtype {frame['source_row'].dtype}. Rerun the ingest stage.")
    if CONFIDENCE in frame.columns:
        confidence = frame[CONFIDENCE]
        numeric = pd.api.types.is_numeric_dtype(confidence) and not pd.api.types.is_bool_dtype(confidence)
        if not numeric and confidence.notna().any():
            raise DataValidationError(f"{source}: column `{CONFIDENCE}` must hold numbers in [0, 1] (or be missing), "
                                      f"got dtype {confidence.dtype}. Check data.confidence_column.")


# ----------------------------------------------------------------------------------------------------------------
# The suite

# Row-level checks, in the order their names appear in a quarantine reason.
ROW_CHECKS = (
    "text_missing", "text_empty", "text_too_short", "text_too_long", "label_missing", "label_not_in_set",
    "confidence_out_of_range", "confidence_too_low", "duplicate_text",
    # causal_lm pairs: the prompt is checked as the text is, the response as the label, duplicates are whole pairs
    "prompt_missing", "prompt_empty", "prompt_too_short", "prompt_too_long", "response_missing", "response_empty",
    "duplicate_pair",
)
# The classifier's check -> its name for prompt/response pairs (validate_splits(pairs=True))
PAIR_NAMES = {"text_missing": "prompt_missing", "text_empty": "prompt_empty", "text_too_short": "prompt_too_short",
              "text_too_long": "prompt_too_long", "label_missing": "response_missing", "duplicate_text": "duplicate_pair"}
_PAIR_KEY = "pair_stripped"  # helper column seen by GX only: prompt and response stripped, joined


# What each row rule asks of a row, for the data docs (formatted with `rules`)
_ROW_RULES = {
    "text_missing": "the text is present",
    "text_empty": "the text has a character that is not whitespace",
    "text_too_short": "the stripped text has at least {rules.min_text_chars} characters",
    "text_too_long": "the stripped text has at most {rules.max_text_chars} characters",
    "label_missing": "the label is present",
    "label_not_in_set": "the label is one of the declared labels",
    "confidence_out_of_range": "the confidence, when given, is between 0 and 1",
    "confidence_too_low": "the confidence, when given, is at least {rules.min_confidence}",
    "duplicate_text": "the stripped text appears once (the first copy, train before val before test, is kept)",
    "prompt_missing": "the prompt is present",
    "prompt_empty": "the prompt has a character that is not whitespace",
    "prompt_too_short": "the stripped prompt has at least {rules.min_text_chars} characters",
    "prompt_too_long": "the stripped prompt has at most {rules.max_text_chars} characters",
    "response_missing": "the response is present",
    "response_empty": "the response has a character that is not whitespace",
    "duplicate_pair": "the (prompt, response) pair appears once (the first copy, train before val before test, is "
                      "kept)",
}


def build_suite(rules: ValidationRules, labels: Sequence[str], has_confidence: bool,
                pairs: bool = False) -> gx.ExpectationSuite:
    """The GX suite; every expectation carries `meta={"check": name, "level": "schema" | "row" | "table"}`.

    `pairs`: causal_lm prompt -> response rows, passed as `text` (the prompt) and `label` (the response): the
    text checks apply to the prompt, the response must be present and not blank, duplicates are whole pairs, and
    there is no label set or class balance to check.
    """
    if pairs:
        return _pair_suite(rules)

    def row(name: str, expectation: gxe.Expectation) -> gxe.Expectation:
        # A row rule quarantines the rows that break it and the run goes on, so in GX it must not read "Failed":
        # mostly=0 makes it succeed whatever the count, while GX still lists every breaking row as unexpected
        # (which is what the stage quarantines). The description says so in the data docs.
        expectation.meta = {"check": name, "level": "row"}
        expectation.mostly = 0.0
        action = ("are quarantined (data/quarantine.parquet) and the run goes on"
                  if name != "duplicate_text" or rules.drop_duplicates else "are counted (validate.drop_duplicates "
                  "is off: they stay)")
        expectation.description = f"Row rule `{name}`: {_ROW_RULES[name].format(rules=rules)}. Rows that break it " \
                                  f"(listed as unexpected) {action}."
        return expectation

    def table(name: str, expectation: gxe.Expectation, note: str) -> gxe.Expectation:
        expectation.meta = {"check": name, "level": "table"}
        expectation.notes = note
        return expectation

    stripped_note = f"`{_STRIPPED}`: the text with surrounding whitespace removed, null when nothing is left."
    expectations: list[gxe.Expectation] = [
        *(gxe.ExpectColumnToExist(column=column, meta={"check": f"column_exists.{column}", "level": "schema"})
          for column in (*REQUIRED_COLUMNS, *((CONFIDENCE,) if has_confidence else ()))),
        row("text_missing", gxe.ExpectColumnValuesToNotBeNull(column="text")),
        row("text_empty", gxe.ExpectColumnValuesToMatchRegex(column="text", regex=r"\S")),
        row("text_too_short", gxe.ExpectColumnValueLengthsToBeBetween(
            column=_STRIPPED, min_value=rules.min_text_chars, notes=stripped_note)),
        row("text_too_long", gxe.ExpectColumnValueLengthsToBeBetween(
            column=_STRIPPED, max_value=rules.max_text_chars, notes=stripped_note)),
        row("label_missing", gxe.ExpectColumnValuesToNotBeNull(column="label")),
        row("label_not_in_set", gxe.ExpectColumnValuesToBeInSet(column="label", value_set=list(labels))),
    ]
    if has_confidence:  # a missing confidence passes these (GX skips nulls); the table check counts them
        expectations += [
            row("confidence_out_of_range", gxe.ExpectColumnValuesToBeBetween(
                column=CONFIDENCE, min_value=0.0, max_value=1.0)),
            row("confidence_too_low", gxe.ExpectColumnValuesToBeBetween(
                column=CONFIDENCE, min_value=rules.min_confidence)),
        ]
    expectations += [
        # GX flags every copy of a repeated text; the first one (train before val before test) is kept.
        row("duplicate_text", gxe.ExpectColumnValuesToBeUnique(
            column=_STRIPPED, notes=stripped_note + " Only copies after the first are quarantined.")),
        table("duplicate_fraction", gxe.ExpectColumnProportionOfUniqueValuesToBeBetween(
            column=_STRIPPED, min_value=1 - rules.max_duplicate_fraction),
            f"Duplicate fraction = 1 - this proportion, at most {rules.max_duplicate_fraction}."),
        table("mojibake_fraction", gxe.ExpectColumnValuesToNotMatchRegex(
            column="text", regex=MOJIBAKE_PATTERN, mostly=1 - rules.max_mojibake_fraction),
            f"Mojibake (UTF-8 decoded as latin-1/cp1252) in at most {rules.max_mojibake_fraction} of the texts."),
    ]
    if has_confidence:
        expectations.append(table("missing_confidence_fraction", gxe.ExpectColumnProportionOfNonNullValuesToBeBetween(
            column=CONFIDENCE, min_value=1 - rules.max_missing_confidence_fraction),
            f"Confidence missing in at most {rules.max_missing_confidence_fraction} of the rows."))
    for label in labels:
        # "label == L for at least min_class_fraction of the rows" is this expectation with `mostly`.
        check = table(f"class_fraction.{label}", gxe.ExpectColumnValuesToBeInSet(
            column="label", value_set=[label], mostly=rules.min_class_fraction),
            f"Class `{label}` holds at least {rules.min_class_fraction} of the labelled rows.")
        # GX's own sentence for in_set + mostly ("values must belong to this set: X, at least 10 % of the time")
        # lists the other classes' rows as "unexpected"; say what the check means instead.
        # GX puts a description into its page as HTML, unescaped: the label is text from the user's data.
        check.description = (f"Class share: `{html.escape(label)}` holds at least {rules.min_class_fraction:.0%} of "
                             f"the labelled rows (validate.min_class_fraction). The rows of the other classes are what "
                             f"GX lists as unexpected; they may be up to {1 - rules.min_class_fraction:.0%}.")
        expectations.append(check)
    return gx.ExpectationSuite(name="validate", expectations=expectations)


def _pair_suite(rules: ValidationRules) -> gx.ExpectationSuite:
    def row(name: str, expectation: gxe.Expectation, column: str = "") -> gxe.Expectation:
        expectation.meta = {"check": name, "level": "row"}
        expectation.mostly = 0.0  # quarantine and go on (see build_suite)
        expectation.description = (f"Row rule `{name}`: {_ROW_RULES[name].format(rules=rules)}. Rows that break it "
                                    f"(listed as unexpected) are quarantined (data/quarantine.parquet)"
                                    + (" and the run goes on." if name != "duplicate_pair" or rules.drop_duplicates
                                       else "; here only counted (validate.drop_duplicates is off)."))
        return expectation

    note = f"`{_STRIPPED}`: the prompt with surrounding whitespace removed, null when nothing is left."
    expectations = [
        *(gxe.ExpectColumnToExist(column=column, meta={"check": f"column_exists.{column}", "level": "schema"})
          for column in REQUIRED_COLUMNS),
        row("prompt_missing", gxe.ExpectColumnValuesToNotBeNull(column="text")),
        row("prompt_empty", gxe.ExpectColumnValuesToMatchRegex(column="text", regex=r"\S")),
        row("prompt_too_short", gxe.ExpectColumnValueLengthsToBeBetween(
            column=_STRIPPED, min_value=rules.min_text_chars, notes=note)),
        row("prompt_too_long", gxe.ExpectColumnValueLengthsToBeBetween(
            column=_STRIPPED, max_value=rules.max_text_chars, notes=note)),
        row("response_missing", gxe.ExpectColumnValuesToNotBeNull(column="label")),
        row("response_empty", gxe.ExpectColumnValuesToMatchRegex(column="label", regex=r"\S")),
        row("duplicate_pair", gxe.ExpectColumnValuesToBeUnique(column=_PAIR_KEY, notes="Only copies after the first "
                                                                "are quarantined.")),
    ]
    duplicates = gxe.ExpectColumnProportionOfUniqueValuesToBeBetween(
        column=_PAIR_KEY, min_value=1 - rules.max_duplicate_fraction,
        meta={"check": "duplicate_fraction", "level": "table"})
    duplicates.notes = f"Duplicate pair fraction = 1 - this proportion, at most {rules.max_duplicate_fraction}."
    mojibake = gxe.ExpectColumnValuesToNotMatchRegex(column="text", regex=MOJIBAKE_PATTERN,
                                                     mostly=1 - rules.max_mojibake_fraction,
                                                     meta={"check": "mojibake_fraction", "level": "table"})
    mojibake.notes = f"Mojibake (UTF-8 decoded as latin-1/cp1252) in at most {rules.max_mojibake_fraction} of prompts."
    return gx.ExpectationSuite(name="validate", expectations=[*expectations, duplicates, mojibake])


# ----------------------------------------------------------------------------------------------------------------
# The outcome


@dataclass(frozen=True)
class TableCheck:
    name: str  # `duplicate_fraction`, `class_fraction.positive`, `bad_fraction`
    measured: float
    threshold: float
    at_most: bool  # measured must be <= threshold (else >=)
    rule: str  # the ValidationRules field that sets the threshold
    passed: bool
    examples: tuple[str, ...] = ()  # `split:source_row` of rows behind the measure


@dataclass(frozen=True)
class ValidationOutcome:
    frame: pd.DataFrame  # all splits, in order, with the `split` column first
    reasons: pd.Series  # per row of `frame`: failed row checks joined by "; ", "" when the row passed
    row_failures: dict[str, pd.Series]  # check -> boolean mask over `frame` (duplicates: copies after the first)
    table_checks: tuple[TableCheck, ...]
    rules: ValidationRules
    labels: tuple[str, ...]
    docs_rows: int = 0  # the rows the data docs' run holds: the first ones, all of them when they fit one chunk

    @property
    def passed(self) -> bool:
        return all(check.passed for check in self.table_checks)

    @property
    def quarantined(self) -> pd.Series:
        return self.reasons != ""

    def validated(self, split: str) -> pd.DataFrame:
        """The rows of `split` that passed every row check, input columns and order unchanged."""
        keep = (self.frame[SPLIT] == split) & ~self.quarantined
        return self.frame.loc[keep].drop(columns=SPLIT).reset_index(drop=True)

    def quarantine(self) -> pd.DataFrame:
        """Failing rows: split, the input columns, reason."""
        return self.frame.loc[self.quarantined].assign(reason=self.reasons[self.quarantined]).reset_index(drop=True)

    def metrics(self) -> dict:
        """Numbers only, nested: per split and `total`; table-level values under `total`."""

        def counts(mask: pd.Series) -> dict:
            bad = self.quarantined & mask
            return {
                "rows": int(mask.sum()),
                "passed": int((mask & ~bad).sum()),
                "quarantined": int(bad.sum()),
                "checks": {name: int((failed & mask).sum()) for name, failed in self.row_failures.items()},
            }

        out = {split: counts(self.frame[SPLIT] == split) for split in self.frame[SPLIT].unique()}
        total = counts(pd.Series(True, index=self.frame.index))
        for check in self.table_checks:
            if check.name.startswith("class_fraction."):
                total.setdefault("class_fraction", {})[check.name.split(".", 1)[1]] = round(check.measured, 6)
            else:
                total[check.name] = round(check.measured, 6)
        out["total"] = total
        return out

    def summary(self, key_prefix: str = "") -> str:
        """A table: each check, failing rows, share, threshold (and the params key), examples."""
        n = max(len(self.frame), 1)
        r = self.rules
        row_rules = {
            "text_missing": "not null",
            "text_empty": "not blank",
            "text_too_short": f">= {r.min_text_chars} chars ({key_prefix}min_text_chars)",
            "text_too_long": f"<= {r.max_text_chars} chars ({key_prefix}max_text_chars)",
            "label_missing": "not null",
            "label_not_in_set": f"in {', '.join(self.labels)}",
            "confidence_out_of_range": "in [0, 1] when present",
            "confidence_too_low": f">= {r.min_confidence} when present ({key_prefix}min_confidence)",
            "duplicate_text": "first copy only" + ("" if r.drop_duplicates else
                                                  f" (not quarantined: {key_prefix}drop_duplicates=false)"),
        }
        row_rules |= {pair: row_rules[text] for text, pair in PAIR_NAMES.items()}
        row_rules |= {"response_empty": "not blank"}
        lines = [f"{'check':<32} {'rows':>7} {'share':>8}  {'threshold':<56} examples (split:source_row)"]
        for name, failed in self.row_failures.items():
            lines.append(f"{name:<32} {int(failed.sum()):>7} {failed.sum() / n:>8.2%}  {row_rules[name]:<56} "
                         f"{', '.join(_examples(self.frame, failed))}")
        for check in self.table_checks:
            sign = "<=" if check.at_most else ">="
            status = "ok" if check.passed else "FAILED"
            threshold = f"{sign} {check.threshold:g} ({key_prefix}{check.rule})"
            lines.append(f"{check.name:<32} {'':>7} {check.measured:>8.2%}  {threshold:<56} "
                         f"{status:<6} {', '.join(check.examples)}")
        return "\n".join(lines)

    def failure_message(self, key_prefix: str = "") -> str:
        """One line per failed table-level check (value, threshold, key to change), then the summary table."""
        lines = []
        for check in self.table_checks:
            if check.passed:
                continue
            sign = ">" if check.at_most else "<"
            knob = f"{key_prefix}{check.rule}"
            lines.append(f"- {check.name} = {check.measured:.4f} {sign} {check.threshold:g}: {_ADVICE[check.rule]} "
                         f"(or {'raise' if check.at_most else 'lower'} `{knob}` if this is expected)")
        return "\n".join(["data validation failed:", *lines, "", self.summary(key_prefix)])


_ADVICE = {
    "max_bad_fraction": "too many rows fail row-level checks; see the table and the quarantine reasons",
    "max_duplicate_fraction": "too many texts repeat an earlier one; deduplicate the source",
    "max_missing_confidence_fraction": "too many rows lack a confidence; fix the source or set "
                                       "data.confidence_column to null",
    "max_mojibake_fraction": "too many texts look like UTF-8 decoded as latin-1/cp1252; check data.encoding",
    "min_class_fraction": "a class is too rare to learn; rebalance the data or drop the class from data.labels",
}


def _examples(frame: pd.DataFrame, mask: pd.Series, limit: int = 3) -> tuple[str, ...]:
    rows = frame.loc[mask, [SPLIT, "source_row"]].head(limit)
    return tuple(f"{split}:{source_row}" for split, source_row in rows.itertuples(index=False))


# ----------------------------------------------------------------------------------------------------------------
# Running it


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
    has_confidence = CONFIDENCE in frame.columns
    key_column = _PAIR_KEY if pairs else _STRIPPED  # what the duplicate checks compare

    context = _context(docs_dir)
    batch = (context.data_sources.add_pandas("frugaltune").add_dataframe_asset("splits")
             .add_batch_definition_whole_dataframe("all_splits"))
    suite = context.suites.add(build_suite(rules, labels, has_confidence, pairs))
    definition = context.validation_definitions.add(gx.ValidationDefinition(name="validate", data=batch, suite=suite))
    result_format = {"result_format": "COMPLETE", "unexpected_index_column_names": [SPLIT, "source_row"]}
    order = [expectation.meta["check"] for expectation in suite.expectations]
    if len(frame) > chunk_rows:  # the suite again, as the chunks after the first run it (see below)
        again = build_suite(rules, labels, has_confidence, pairs).expectations
        share = [e.meta["check"].startswith("class_fraction.") for e in again]
        row_suite = gx.ExpectationSuite(name="validate-rows", expectations=[
            e for e, is_share in zip(again, share) if not is_share])
        share_suite = gx.ExpectationSuite(name="validate-shares", expectations=[
            e for e, is_share in zip(again, share) if is_share])

    # GX holds a whole batch and every unexpected row of it (a class share lists the other classes' rows), so the
    # rows go through it `chunk_rows` at a time: row failures are kept as masks over `frame`, table-level counts are
    # summed, and the duplicate checks, which span chunks, are decided over every row below. The first chunk's run
    # is the one stored for the data docs (the whole table when it fits one chunk).
    rows = len(frame)
    failed = {}  # check -> mask over frame (row checks and mojibake, whose rows are the examples)
    counts = {}  # mostly-type table check -> [element_count, missing_count, unexpected_count]
    present, hashes = np.zeros(rows, dtype=bool), np.zeros(rows, dtype=np.uint64)
    first: dict = {}
    for start in range(0, rows, chunk_rows):
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
        position = {key: start + i for i, key in enumerate(zip(part[SPLIT], part["source_row"].tolist()))}
        by_check = {}  # check name -> GX result, in suite order (GX returns them in its own order)
        for res in sorted(outcomes, key=lambda res: order.index(res.expectation_config.meta["check"])):
            config = res.expectation_config
            if (res.exception_info or {}).get("raised_exception"):
                raise RuntimeError(f"GX could not evaluate {config.type} {config.kwargs}: "
                                   f"{res.exception_info['exception_message']}")
            by_check[config.meta["check"]] = res
        for name, res in by_check.items():
            if name in ROW_CHECKS or name == "mojibake_fraction":
                hits = [position[(d[SPLIT], int(d["source_row"]))] for d in res.result.get("unexpected_index_list")
                        or []]
                failed.setdefault(name, np.zeros(rows, dtype=bool))[hits] = True
            if "unexpected_count" in res.result and res.expectation_config.meta["level"] == "table":
                tally = counts.setdefault(name, [0, 0, 0])
                for i, field in enumerate(("element_count", "missing_count", "unexpected_count")):
                    tally[i] += res.result.get(field, 0)
        first = first or by_check
        key = gx_part[key_column]
        present[start:start + len(part)] = key.notna().to_numpy()
        hashes[start:start + len(part)] = pd.util.hash_array(key.fillna("").to_numpy(dtype=object))
    if docs_dir is not None:
        _escape_stored_results(context)
        context.build_data_docs()
        from frugaltune.offline import vendor_data_docs  # GX's pages load Bootstrap/jQuery/Vega from CDNs

        for url in vendor_data_docs(docs_dir):
            print(f"validate: data docs still load {url} from the network", file=sys.stderr)

    # Copies after the first of a key, over every row: equal hashes first, then the keys of those rows compared
    duplicate = np.zeros(rows, dtype=bool)
    maybe = np.flatnonzero(present & pd.Series(hashes).duplicated(keep=False).to_numpy())
    if len(maybe):
        duplicate[maybe] = _gx_frame(frame.iloc[maybe], pairs)[key_column].duplicated().to_numpy()

    row_failures = {}
    for name in ROW_CHECKS:
        if name in first:
            row_failures[name] = pd.Series(duplicate if name in ("duplicate_text", "duplicate_pair") else failed[name],
                                           index=frame.index)
    quarantining = [n for n in row_failures if n not in ("duplicate_text", "duplicate_pair") or rules.drop_duplicates]
    reasons = pd.Series("", index=frame.index, dtype=object)
    for name in quarantining:
        reasons[row_failures[name]] += name + "; "
    reasons = reasons.str.removesuffix("; ").astype(str)

    whole = rows <= chunk_rows  # GX saw every row at once: its own results and verdicts
    results = {}  # table check -> (result as GX gives it, over every row; passed)
    for name, res in first.items():
        if res.expectation_config.meta["level"] != "table":
            continue
        kwargs = res.expectation_config.kwargs
        if whole:
            results[name] = (res.result, bool(res.success))
        elif name in counts:  # `mostly`: the share of non-null rows that are as expected
            element, missing, unexpected = counts[name]
            considered = element - missing
            results[name] = ({"element_count": element, "missing_count": missing, "unexpected_count": unexpected},
                             not considered or (considered - unexpected) / considered >= kwargs["mostly"])
        else:  # a proportion of unique / of non-null values, at least min_value
            if name == "duplicate_fraction":  # no text at all: nothing repeats
                observed = (present.sum() - duplicate.sum()) / present.sum() if present.any() else 1.0
            else:
                observed = frame[CONFIDENCE].notna().sum() / rows
            results[name] = ({"observed_value": float(observed)}, bool(observed >= kwargs["min_value"]))

    table_checks = [_bad_fraction(frame, reasons, rules)]
    behind = {  # rows that make up each measured share, for the examples in the summary
        "duplicate_fraction": row_failures.get("duplicate_text", row_failures.get("duplicate_pair")),
        "missing_confidence_fraction": frame[CONFIDENCE].isna() if has_confidence else None,
    }
    for name, (result, passed) in results.items():
        rule, at_most = _TABLE_RULES[name.split(".")[0]]
        rows_behind = (pd.Series(failed[name], index=frame.index) if name == "mojibake_fraction"
                       else behind.get(name))
        examples = _examples(frame, rows_behind) if rows_behind is not None else ()
        table_checks.append(TableCheck(name, _measured(name, result), getattr(rules, rule), at_most, rule, passed,
                                       examples))
    return ValidationOutcome(frame, reasons, row_failures, tuple(table_checks), rules, tuple(labels),
                             min(rows, chunk_rows))


# table check (prefix before ".") -> (the ValidationRules field with its threshold, measured must be <= threshold)
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
