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

The rooms, each importing only those below it (an import-linter `layers` contract): `runner.py` (`validate_splits`:
the suite run a chunk of rows at a time, the data docs, the verdicts), `outcome.py` (`ValidationOutcome`,
`TableCheck`: the validated rows, the quarantine, the metrics, the summary), `suite.py` (`build_suite`: every
check as a GX expectation), `rules.py` (`ValidationRules`, the columns check, the mojibake pattern). This module
re-exports their public names, so callers import from `frugaltune.validation`.
"""

from frugaltune.validation.outcome import TableCheck, ValidationOutcome
from frugaltune.validation.rules import (
    CONFIDENCE,
    GX_CHUNK_ROWS,
    MOJIBAKE_PATTERN,
    REQUIRED_COLUMNS,
    SPLIT,
    DataValidationError,
    ValidationRules,
    check_columns,
)
from frugaltune.validation.runner import _context as _context  # the scheduling trace checks' GX context
from frugaltune.validation.runner import validate_splits
from frugaltune.validation.suite import PAIR_NAMES, ROW_CHECKS, build_suite

__all__ = [
    "CONFIDENCE", "GX_CHUNK_ROWS", "MOJIBAKE_PATTERN", "PAIR_NAMES", "REQUIRED_COLUMNS", "ROW_CHECKS", "SPLIT",
    "DataValidationError", "TableCheck", "ValidationOutcome", "ValidationRules", "build_suite", "check_columns",
    "validate_splits",
]
