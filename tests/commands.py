"""One way for the end-to-end tests to run a command: no stdin, and a hang that says where it hung.

Imported by tests/e2e/test_pipeline.py and test_prefect.py (`run_command`); not a test module itself.
"""

from __future__ import annotations

import os
import signal
import subprocess
from pathlib import Path


class Hung(AssertionError):
    """A command that did not end in its time; the message holds the stacks it printed when aborted."""


def run_command(cmd: list[str], cwd: Path, env: dict[str, str], timeout: float) -> str:
    """`cmd`'s stdout + stderr; a failure (its exit status and output's tail) or `Hung` otherwise.

    A command that hangs is aborted with SIGABRT, on which Python (PYTHONFAULTHANDLER) prints every thread's stack:
    the failure then says where it hung, not only that it did. No stdin: a prompt gets end-of-file, not the pytest
    worker's."""
    proc = subprocess.Popen(cmd, cwd=cwd, env={**env, "PYTHONFAULTHANDLER": "1"}, stdin=subprocess.DEVNULL,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        stdout, stderr = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGABRT)
        try:
            stdout, stderr = proc.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            stdout, stderr = proc.communicate()
        raise Hung(f"{' '.join(cmd)} hung for {timeout:.0f} s; the stacks when aborted:\n{(stdout + stderr)[-12000:]}")
    output = stdout + stderr
    assert proc.returncode == 0, f"{' '.join(cmd)} failed ({proc.returncode}):\n{output[-6000:]}"
    return output
