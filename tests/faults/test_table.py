"""docs/FAULTS.md is what the fault tests say: regenerate with `python -m tests.faults.table`."""

from __future__ import annotations

import pytest

from tests.faults.table import FAULTS_MD, load_rows, render

pytestmark = pytest.mark.slow


def test_faults_md_is_generated_from_the_tests_and_has_30_rows():
    rows = load_rows()
    assert len(rows) >= 30, len(rows)
    assert len({r.test for r in rows}) == len(rows), "one test per row"
    assert FAULTS_MD.read_text(encoding="utf-8") == render(rows), "run `python -m tests.faults.table`"
