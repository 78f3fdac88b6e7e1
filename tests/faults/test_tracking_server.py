"""The MLflow tracking server under faults: `MLFLOW_TRACKING_URI` names a server that is down. `frugaltune predict`, a
real process, must stop within seconds with one line naming the URI and the fix, not after MLflow's minutes of
retries with a hint to register a model (the registry was never reached); that hint stays for a store that answers
without the model.

Run with `make test` or `pytest -m slow tests/faults/test_tracking_server.py` (seconds). Each test is a row of
docs/FAULTS.md (see table.py).
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from mlflow import MlflowClient

from frugaltune import cli
from tests.faults.helpers import ROOT, env
from tests.faults.table import fault

pytestmark = pytest.mark.slow

DEADLINE_S = 10  # issue 94: predict against a down server exits within this, interpreter start included


def predict(cwd: Path, uri: str) -> tuple[subprocess.CompletedProcess, float]:
    began = time.monotonic()
    done = subprocess.run([sys.executable, "-m", "frugaltune.cli", "predict", "what a great day"], cwd=cwd,
                          env=env(MLFLOW_TRACKING_URI=uri, PYTHONPATH=f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"),
                          capture_output=True, text=True, timeout=60, check=False)
    return done, time.monotonic() - began


@fault("process", "the MLflow tracking server that MLFLOW_TRACKING_URI names is down",
       "`frugaltune predict` (and register, train, `make ui`, the flows) stop within seconds with one line: the URI, "
       "the connection error and the fix (`make mlflow-server`, or `unset MLFLOW_TRACKING_URI`); \"Register a model "
       "first\" only from a store that answers without the model",
       "nothing written; the registry untouched")
def test_predict_against_a_server_that_is_down(tmp_path, monkeypatch, capsys):
    with socket.socket() as sock:  # a port nothing listens on
        sock.bind(("127.0.0.1", 0))
        uri = f"http://127.0.0.1:{sock.getsockname()[1]}"
    done, seconds = predict(tmp_path, uri)
    assert done.returncode == 1 and seconds <= DEADLINE_S, (seconds, done.stderr)
    assert done.stderr.count("\n") == 1 and "Traceback" not in done.stderr, done.stderr
    assert uri in done.stderr and "make mlflow-server" in done.stderr and "unset MLFLOW_TRACKING_URI" in done.stderr
    assert "Register a model first" not in done.stderr

    db = tmp_path / "mlflow.db"  # a real, empty store that answers: registering is the fix (in this process: the
    MlflowClient(f"sqlite:///{db}").search_experiments()  # same code, without a second interpreter's imports)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{db}")
    assert cli.main(["predict", "what a great day"]) == 1
    assert "Register a model first" in capsys.readouterr().err
