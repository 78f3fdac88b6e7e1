"""The fault table: each test of tests/faults registers its row with @fault; `python -m tests.faults.table` writes
docs/FAULTS.md from them (tests/faults/test_table.py checks that the committed file is what the rows say).

Rows whose test lives elsewhere (written before this suite) are listed in EARLIER with their test's path.
"""

from __future__ import annotations

import importlib
import inspect
import sys
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
FAULTS_MD = ROOT / "docs" / "FAULTS.md"
CATEGORIES = ("process", "disk", "data", "params", "security")


@dataclass(frozen=True)
class Row:
    category: str
    case: str
    happens: str  # what the user sees
    kept: str  # what is kept / how it recovers
    test: str  # tests/...py::name


ROWS: list[Row] = []


def fault(category: str, case: str, happens: str, kept: str):
    """Register the decorated test as the row for `case`."""
    assert category in CATEGORIES, category

    def mark(fn):
        path = Path(inspect.getfile(fn)).resolve().relative_to(ROOT)
        ROWS.append(Row(category, case, happens, kept, f"{path}::{fn.__name__}"))
        return fn

    return mark


EARLIER = [
    Row("process", "kill -9 / SIGTERM (or Ctrl-C) during training, resumed with `dvc repro`",
        "the stage dies (SIGTERM: a checkpoint first, then exit; its MLflow run is marked KILLED, not FAILED)",
        "recovered, nothing lost: the rerun resumes from the last complete checkpoint to the same final loss, in the "
        "same MLflow run (reopened: the whole loss history, no failed twin)",
        "tests/e2e/test_pipeline.py::test_killed_and_terminated_training_resumes_to_the_same_final_loss"),
    Row("process", "a checkpoint truncated on disk", "a warning naming the checkpoint",
        "recovered: the previous complete checkpoint is used",
        "tests/unit/test_training.py::test_truncated_checkpoint_is_skipped_with_a_warning"),
    Row("process", "out of memory in a training step", "an event in the log and the MLflow run",
        "recovered, nothing lost: micro-batch halved, effective batch kept, the run goes on",
        "tests/unit/test_training.py::test_injected_oom_halves_micro_batch_and_keeps_the_effective_batch"),
    Row("process", "out of memory at micro-batch 1", "clear error: the step, and what to change",
        "no model written; checkpoints kept",
        "tests/unit/test_training.py::test_oom_at_batch_one_fails_clearly"),
    Row("process", "loss becomes NaN/inf", "clear error naming the step and the fix (lower train.lr)",
        "no model written; checkpoints before the divergence kept",
        "tests/unit/test_training.py::test_divergence_stops_with_the_step"),
]


def load_rows() -> list[Row]:
    """Import every test module of this folder (which registers its rows) and return all rows, sorted."""
    for module in sorted(Path(__file__).parent.glob("test_*.py")):
        importlib.import_module(f"tests.faults.{module.stem}")
    seen: dict[str, Row] = {}
    for row in ROWS:  # a module imported twice (pytest and importlib) registers twice
        seen.setdefault(row.test, row)
    rows = list(seen.values()) + EARLIER
    return sorted(rows, key=lambda r: (CATEGORIES.index(r.category), r.test))


def render(rows: list[Row]) -> str:
    lines = [
        "# What frugaltune survives",
        "",
        "Every row is a test (`pytest -m slow tests/faults`, part of `make test`; rows marked with another path "
        "predate the suite). Generated from the tests by `python -m tests.faults.table`; do not edit by hand.",
        "",
    ]
    for category in CATEGORIES:
        chosen = [r for r in rows if r.category == category]
        if not chosen:
            continue
        lines += [f"## {category}", "", "| case | what happens | what is kept | test |", "| --- | --- | --- | --- |"]
        lines += [f"| {r.case} | {r.happens} | {r.kept} | `{r.test}` |" for r in chosen]
        lines.append("")
    lines.append(f"{len(rows)} rows.")
    return "\n".join(lines) + "\n"


def main() -> int:
    from tests.faults import table  # the module the tests register into (this file runs as __main__)

    rows = table.load_rows()
    FAULTS_MD.write_text(table.render(rows), encoding="utf-8")
    print(f"wrote {FAULTS_MD.relative_to(ROOT)} ({len(rows)} rows)")
    return 0


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))
    sys.exit(main())
