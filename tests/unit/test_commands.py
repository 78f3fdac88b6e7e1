"""The e2e tests' command runner (tests/commands.py) says where a hung command hung.

    pytest tests/unit/test_commands.py
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

from tests.commands import Hung, run_command


def test_a_hung_command_is_aborted_with_its_stack_and_a_failed_one_shows_its_output(tmp_path: Path):
    script = tmp_path / "waits.py"
    script.write_text("import time\n\ndef wait_for_ever():\n    time.sleep(600)\n\nwait_for_ever()\n")
    with pytest.raises(Hung) as hung:
        run_command([sys.executable, str(script)], tmp_path, dict(os.environ), timeout=3)
    assert "wait_for_ever" in str(hung.value) and "hung for 3 s" in str(hung.value)
    with pytest.raises(AssertionError, match=r"failed \(3\):\n.*no such row"):
        run_command([sys.executable, "-c", "import sys; print('no such row'); sys.exit(3)"], tmp_path,
                    dict(os.environ), timeout=60)
    # no stdin: a prompt reads end-of-file instead of waiting on the pytest worker's
    assert run_command([sys.executable, "-c", "import sys; print(repr(sys.stdin.read()))"], tmp_path,
                       dict(os.environ), timeout=60).strip() == "''"
