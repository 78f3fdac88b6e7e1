"""The scheduling pipeline's trace: the default is in the repository, and a missing one is named before any compute.

Run with `pytest tests/unit/test_scheduling_trace.py` (a few seconds: ingest_trace reads the 10,000-job default).
The issue: `scheduling.trace` defaulted to ../../shared/..., a file no clone has, and the params check said OK.
"""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from frugaltune.config import (
    DEFAULT_TRACE,
    DEFAULT_TRACE_SHA256,
    ParamsError,
    SchedulingParams,
    load_params,
    parse_params,
)

ROOT = Path(__file__).resolve().parents[2]
SCHEDULING = ROOT / "scheduling"


def scheduling_project(tmp_path: Path, trace: str | None = None) -> Path:
    """A copy of scheduling/params.yaml (with `trace` when given) and the default trace, in a fresh directory with
    no ../shared beside it: what a user's clone holds."""
    project = tmp_path / "clone" / "scheduling"
    (project / "data").mkdir(parents=True)
    shutil.copy(SCHEDULING / DEFAULT_TRACE, project / DEFAULT_TRACE)
    params = yaml.safe_load((SCHEDULING / "params.yaml").read_text())
    if trace is not None:
        params["scheduling"]["trace"] = trace
    (project / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))
    return project


def test_the_default_trace_is_in_the_repository_with_the_recorded_sha256():
    params = load_params(SCHEDULING / "params.yaml")
    assert params.scheduling.trace == DEFAULT_TRACE == SchedulingParams().trace  # params file and schema agree
    path = (SCHEDULING / params.scheduling.trace).resolve()
    assert path.is_relative_to(ROOT) and path.is_file()
    assert hashlib.sha256(path.read_bytes()).hexdigest() == DEFAULT_TRACE_SHA256
    assert DEFAULT_TRACE_SHA256 in (path.parent / "README.md").read_text()  # the README records the same bytes


def test_the_params_check_names_the_key_the_path_and_the_fix_when_the_trace_is_missing(tmp_path):
    project = scheduling_project(tmp_path, trace="../../shared/data/swf/lublin_256.swf")  # the old default
    with pytest.raises(ParamsError) as error:
        load_params(project / "params.yaml")
    message = str(error.value)
    looked_at = (project / "../../shared/data/swf/lublin_256.swf").resolve()
    assert "`scheduling.trace` = '../../shared/data/swf/lublin_256.swf'" in message
    assert f"no such file: {looked_at}" in message and "Point it at an SWF trace" in message
    # the command-line check (`python -m frugaltune.config <file>`) fails with the same message, not "OK"
    checked = subprocess.run([sys.executable, "-m", "frugaltune.config", str(project / "params.yaml")],
                             capture_output=True, text=True, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert checked.returncode == 1 and "`scheduling.trace`" in checked.stderr and "OK" not in checked.stdout


def test_the_trace_is_resolved_from_the_params_file_directory_not_the_working_directory(tmp_path, monkeypatch):
    project = scheduling_project(tmp_path)
    monkeypatch.chdir(tmp_path)  # no data/lublin_256.swf here: only beside the params file
    assert load_params(project / "params.yaml").scheduling.trace == DEFAULT_TRACE


def test_params_built_in_memory_name_no_file_and_are_not_checked_against_the_disk():
    assert parse_params({"scheduling": {"trace": "nowhere/at_all.swf"}}).scheduling.trace == "nowhere/at_all.swf"


def test_ingest_trace_reads_the_default_trace_in_a_clone_without_shared(tmp_path):
    project = scheduling_project(tmp_path)
    assert not (tmp_path / "shared").exists()
    # as scheduling/dvc.yaml runs it: in scheduling/, PYTHONPATH=.. (here the repository, where `stages` lives)
    subprocess.run([sys.executable, "-m", "stages.ingest_trace"], cwd=project, check=True, capture_output=True,
                   env={**os.environ, "PYTHONPATH": str(ROOT)})
    report = yaml.safe_load((project / "reports" / "ingest_trace.json").read_text())
    assert (report["source"], report["jobs"], report["max_procs"]) == (DEFAULT_TRACE, 10000, 256)
    assert (project / "data" / "trace.swf").read_bytes() == (project / DEFAULT_TRACE).read_bytes()


def test_ingest_trace_refuses_a_default_trace_whose_bytes_changed(tmp_path, monkeypatch):
    from stages.ingest_trace import TraceChanged, run

    project = scheduling_project(tmp_path)
    trace = project / DEFAULT_TRACE
    trace.write_bytes(trace.read_bytes().replace(b"\n", b"\r\n"))  # as a checkout with converted line endings
    monkeypatch.chdir(project)
    with pytest.raises(TraceChanged, match=rf"scheduling.trace = '{DEFAULT_TRACE}': sha256 .*expected "
                       rf"{DEFAULT_TRACE_SHA256}.*Restore it"):
        run(load_params())


def test_ingest_trace_names_the_key_and_the_path_when_the_trace_is_missing(tmp_path, monkeypatch):
    from stages.ingest_trace import run

    monkeypatch.chdir(tmp_path)
    looked_at = tmp_path.resolve() / "gone.swf"
    with pytest.raises(FileNotFoundError, match=re.escape(f"scheduling.trace = 'gone.swf': no such file: {looked_at}")):
        run(parse_params({"scheduling": {"trace": "gone.swf"}}))
