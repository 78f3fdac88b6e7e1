"""What a validation found: `ValidationOutcome` (the validated rows, the quarantine, the metrics, the summary table,
the failure message) and its `TableCheck`s.

Library code, not run on its own: `runner.validate_splits` returns a `ValidationOutcome`, which `stages/validate.py`
writes out; `frugaltune.validation` re-exports both classes.
"""

from __future__ import annotations

from dataclasses import dataclass

import pandas as pd

from frugaltune.validation.rules import SPLIT, ValidationRules
from frugaltune.validation.suite import PAIR_NAMES


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
