"""No orphans: a stage (any process in `faults.stage_errors`, also behind a shell that does not exec it) and a program
the library starts with `processes.child_dies_with_parent()` die when their parent is killed -9; `frugaltune exp-clean` marks the MLflow runs
of processes that are gone KILLED and leaves the others.

Run with `pytest tests/unit/test_processes.py` (seconds; Linux: elsewhere there is no parent-death signal).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from frugaltune import processes

ROOT = Path(__file__).resolve().parents[2]
linux_only = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux's")

# The grandchild, started by the parent below: a stage-like process, or a program that is not Python's
STAGE = textwrap.dedent("""
    import os, sys, time
    from pathlib import Path
    from frugaltune.faults import stage_errors
    with stage_errors("test"):
        Path(sys.argv[1] + ".tmp").write_text(str(os.getpid()))
        os.replace(sys.argv[1] + ".tmp", sys.argv[1])
        time.sleep(120)
""")
PARENT = textwrap.dedent("""
    import subprocess, sys, time
    from pathlib import Path
    from frugaltune import processes
    kind, marker = sys.argv[1], sys.argv[2]
    if kind == "stage":
        child = subprocess.Popen([sys.executable, "-c", sys.argv[3], marker])
    elif kind == "stage behind a shell":  # two commands: the shell cannot exec the first, as fish never does
        child = subprocess.Popen(["sh", "-c", '"$0" -c "$1" "$2"; true', sys.executable, sys.argv[3], marker])
    else:  # a program: armed before exec, so the marker is written once it runs
        child = subprocess.Popen(["sh", "-c", 'echo $$ > "$0.tmp"; mv "$0.tmp" "$0"; exec sleep 120', marker],
                                 preexec_fn=processes.child_dies_with_parent())
    print(child.pid, flush=True)
    time.sleep(120)
""")


@linux_only
@pytest.mark.parametrize("kind", ["stage", "stage behind a shell", "program"])
def test_a_child_dies_when_its_parent_is_killed(tmp_path, kind):
    marker = tmp_path / "armed"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    parent = subprocess.Popen([sys.executable, "-c", PARENT, kind, str(marker), STAGE], stdout=subprocess.PIPE,
                              text=True, env=env, cwd=ROOT)
    try:
        parent.stdout.readline()  # started
        deadline = time.monotonic() + 60
        while not marker.exists():
            assert time.monotonic() < deadline and parent.poll() is None, "the child never started"
            time.sleep(0.05)
        child = int(marker.read_text())  # the armed process itself, not the shell before it
        started = processes.started(child)
        parent.kill()
        parent.wait()
        deadline = time.monotonic() + 5
        while processes.alive(child, started) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not processes.alive(child, started), f"{kind} {child} outlived its parent killed -9"
    finally:
        parent.kill()
        if "child" in locals() and processes.alive(child, None):
            os.kill(child, signal.SIGKILL)


def test_exp_clean_marks_runs_of_gone_processes_killed(tmp_path):
    """A run left RUNNING by a process that is gone is marked KILLED; a run whose process runs (this one) and a run
    without process tags (logged before them) are left RUNNING."""
    from mlflow import MlflowClient

    from frugaltune import exp_clean, tracking

    finished = subprocess.Popen(["sleep", "0.3"])
    gone_tags = {**tracking.process_tags(), tracking.PID_TAG: str(finished.pid),
                 tracking.STARTED_TAG: f"{processes.started(finished.pid):.3f}"}
    finished.wait()
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    client = MlflowClient(uri)
    experiment = client.create_experiment("e")
    runs = {name: client.create_run(experiment, run_name=name, tags=tags).info.run_id
            for name, tags in (("gone", gone_tags), ("live", tracking.process_tags()), ("untagged", {}))}
    lines = exp_clean.mark_killed_runs(uri)
    status = {name: client.get_run(run_id).info.status for name, run_id in runs.items()}
    assert status == {"gone": "KILLED", "live": "RUNNING", "untagged": "RUNNING"}, status
    assert len(lines) == 1 and runs["gone"] in lines[0] and "KILLED" in lines[0], lines
    assert exp_clean.mark_killed_runs(uri) == []  # done once
