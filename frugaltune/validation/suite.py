"""The Great Expectations suite: every row-level and table-level check as a GX expectation.

Library code, not run on its own: `runner.validate_splits` (called by `stages/validate.py`) validates the splits
against `build_suite`; `frugaltune.validation` re-exports `build_suite`, `ROW_CHECKS` and `PAIR_NAMES`.
"""

from __future__ import annotations

import html
from collections.abc import Sequence

import great_expectations as gx
import great_expectations.expectations as gxe

from frugaltune.validation.rules import (
    _STRIPPED,
    CONFIDENCE,
    MOJIBAKE_PATTERN,
    REQUIRED_COLUMNS,
    ValidationRules,
)


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
