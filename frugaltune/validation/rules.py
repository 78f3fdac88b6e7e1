"""The validation's vocabulary: its thresholds, the required columns, the mojibake pattern, the columns check.

Library code, not run on its own: `frugaltune.validation` re-exports these names; `runner.validate_splits` (called by
`stages/validate.py`) checks the columns with `check_columns` and builds its suite from `ValidationRules`.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import pandas as pd


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
