"""The Prefect flow on a real (temporary) Prefect server and real DVC projects in temp dirs.

Run with `make test-fast` (or `pytest tests/unit/test_flows.py`). `prefect_test_harness` starts a throwaway
Prefect server on 127.0.0.1 for the module (~10 s). The flow runs its stages through `dvc repro`, so each test
builds a small DVC project whose stages are the real stage modules or a stand-in script.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest
import yaml

from frugaltune.config import load_params, parse_params

ROOT = Path(__file__).resolve().parents[2]

# Stands in for `python -m stages.register`: the same idempotent registry write (frugaltune.registry's own
# functions, a real MLflow sqlite store), and on the first attempt only, a failure right after it, as when the
# registry committed the version but the connection dropped before the client heard back.
FLAKY_REGISTER = '''
import sys
from pathlib import Path

from mlflow import MlflowClient

from frugaltune import tracking
from frugaltune.io import write_json
from frugaltune import registry as register
from frugaltune.config import load_params

params = load_params()
client = MlflowClient(tracking.tracking_uri())
experiment_id = tracking.setup(params.train.experiment)
run_id, _ = register.resolve_run(client, None, experiment_id, "0" * 64)  # the same run on every attempt
version = register.register_model_version(client, params.register_.model_name, run_id, f"runs:/{run_id}/model", {})
attempts = Path("attempts.txt")
attempts.write_text(attempts.read_text() + "x" if attempts.exists() else "x")
if len(attempts.read_text()) == 1:
    sys.exit("register: MLflow registry write failed: connection reset by peer")
write_json("reports/register.json", {  # the register stage's report
    "model_name": version.name, "version": int(version.version), "run_id": run_id, "alias": "champion",
    "metric": "macro_f1", "metric_value": 0.5, "promoted": 1, "champion_version": 1, "champion_metric_value": 0.5})
'''


def dvc_project(root: Path, stages: dict, params: dict, files: dict[str, str] | None = None) -> Path:
    """A DVC project (no git) with this dvc.yaml and params.yaml, and the stage modules (a project's own code:
    `python -m stages.<name>` finds them in the project root; only the library is installed)."""
    root.mkdir(parents=True, exist_ok=True)
    shutil.copytree(ROOT / "stages", root / "stages", ignore=shutil.ignore_patterns("__pycache__"))
    (root / "dvc.yaml").write_text(yaml.safe_dump({"stages": stages}, sort_keys=False))
    (root / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))
    for name, text in (files or {}).items():
        (root / name).write_text(text)
    subprocess.run([sys.executable, "-m", "dvc", "init", "--no-scm", "-q"], cwd=root, check=True)
    return root


@pytest.fixture(scope="module")
def prefect_server() -> Iterator[None]:
    from prefect.settings import PREFECT_SERVER_ANALYTICS_ENABLED, temporary_settings
    from prefect.testing.utilities import prefect_test_harness

    with (temporary_settings(updates={PREFECT_SERVER_ANALYTICS_ENABLED: False}),
          prefect_test_harness(server_startup_timeout=120)):
        yield


@pytest.fixture
def in_project(monkeypatch: pytest.MonkeyPatch):
    """chdir into a project; MLflow on the project's own sqlite store."""
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    monkeypatch.setenv("DVC_NO_ANALYTICS", "1")
    return monkeypatch.chdir


def running(pid: int, within_s: float = 5) -> bool:
    """Whether `pid` still runs after `within_s` (a zombie waiting for its new parent to reap it has stopped)."""
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        try:
            if psutil.Process(pid).status() == psutil.STATUS_ZOMBIE:
                return False
        except psutil.NoSuchProcess:
            return False
        time.sleep(0.2)
    return True


def task_runs(flow_run_id) -> dict:
    from prefect import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId

    with get_client(sync_client=True) as client:
        runs = client.read_task_runs(flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[flow_run_id])))
    return {run.name: run for run in runs}


def test_a_failing_stage_fails_the_flow_run_with_the_stages_own_message(prefect_server, in_project, tmp_path):
    from flows.pipeline import finetune

    project = dvc_project(tmp_path / "p", {
        "ingest": {"cmd": "python -m stages.ingest", "params": ["data", "common.seed"],
                   "outs": ["data/raw", "data/splits"]},
    }, {"data": {"source": "missing.csv"}})
    in_project(project)

    state = finetune(return_state=True)

    assert state.is_failed()
    assert "ingest: data.source = 'missing.csv': no such file or directory" in state.message, state.message
    assert "failed to reproduce 'ingest'" in state.message  # and DVC's own line, for the command to rerun
    ingest = task_runs(state.state_details.flow_run_id)["ingest"]
    assert ingest.state.is_failed() and ingest.run_count == 1  # no retries for a stage that fails for good


def test_a_tracking_server_that_is_down_fails_the_flow_before_any_stage(prefect_server, in_project, tmp_path,
                                                                         monkeypatch):
    """Issue 94: the flow checks MLFLOW_TRACKING_URI's server first, not the train stage minutes later."""
    import socket

    from flows.pipeline import finetune

    project = dvc_project(tmp_path / "p", {"first": {"cmd": "python -c \"open('ran', 'w')\"", "outs": ["ran"]}}, {})
    in_project(project)
    with socket.socket() as sock:  # a port nothing listens on
        sock.bind(("127.0.0.1", 0))
        uri = f"http://127.0.0.1:{sock.getsockname()[1]}"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)

    began = time.monotonic()
    state = finetune(return_state=True)

    assert state.is_failed() and time.monotonic() - began < 30, state.message
    assert f"the MLflow tracking server {uri} (MLFLOW_TRACKING_URI) does not answer" in state.message, state.message
    assert "make mlflow-server" in state.message and not (project / "ran").exists()


def test_make_ui_with_a_tracking_server_that_is_down_says_so_and_starts_nothing(monkeypatch, capsys):
    import socket

    from flows import ui

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        uri = f"http://127.0.0.1:{sock.getsockname()[1]}"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    monkeypatch.setattr(ui, "start", lambda *args: pytest.fail("a server was started"))
    assert ui.main([]) == 1
    err = capsys.readouterr().err
    assert err.startswith(f"ui: the MLflow tracking server {uri} (MLFLOW_TRACKING_URI) does not answer"), err
    assert "unset MLFLOW_TRACKING_URI" in err and err.count("\n") == 1


def test_register_is_retried_and_the_retry_leaves_exactly_one_model_version(prefect_server, in_project, tmp_path):
    from mlflow import MlflowClient

    from flows.pipeline import finetune

    project = dvc_project(tmp_path / "p", {
        "register": {"cmd": "python flaky_register.py", "deps": ["flaky_register.py"],
                     "params": ["register", "train.experiment"],
                     "outs": [{"reports/register.json": {"cache": False}}]},
    }, {"register": {"model_name": "flaky-model"}, "train": {"experiment": "flaky"},
        "schedule": {"register_retries": 2, "retry_delay_s": 0}}, {"flaky_register.py": FLAKY_REGISTER})
    in_project(project)

    state = finetune(return_state=True)

    assert state.is_completed(), state.message
    assert (project / "attempts.txt").read_text() == "xx"
    register = task_runs(state.state_details.flow_run_id)["register"]
    assert register.state.is_completed() and register.run_count == 2
    versions = MlflowClient(f"sqlite:///{project / 'mlflow.db'}").search_model_versions("name = 'flaky-model'")
    assert [str(v.version) for v in versions] == ["1"]
    status = subprocess.run([sys.executable, "-m", "dvc", "status", "--json"], cwd=project, capture_output=True,
                            text=True, check=True)
    assert status.stdout.strip() == "{}"  # dvc.lock records the retried stage: DVC and Prefect agree


def test_a_stage_past_its_timeout_is_stopped_with_its_whole_process_tree(prefect_server, in_project, tmp_path):
    from flows.pipeline import finetune

    sleeper = "import os, time; open('stage.pid', 'w').write(str(os.getpid())); time.sleep(300)"
    project = dvc_project(tmp_path / "p", {"slow": {"cmd": f'python -c "{sleeper}"', "outs": ["never"]}},
                          {"schedule": {"stage_timeout_s": 8}})
    in_project(project)

    state = finetune(return_state=True)

    assert state.is_failed(), state.message
    assert "slow: stopped after 8 s, the limit that schedule.stage_timeout_s sets in params.yaml" in state.message
    stage = int((project / "stage.pid").read_text())  # the stage itself, not only the dvc process that started it
    assert not running(stage)


def test_stage_tasks_take_timeouts_and_retries_from_params():
    from flows.tasks import stage_task, stage_timeout

    schedule = parse_params({"schedule": {"stage_timeout_s": 60, "train_timeout_s": 600, "register_retries": 4,
                                          "retry_delay_s": 7}}).schedule
    assert stage_timeout("train", schedule) == (600, "schedule.train_timeout_s")
    assert stage_timeout("evaluate", schedule) == (60, "schedule.stage_timeout_s")
    train, register = stage_task("train", schedule), stage_task("register", schedule)
    assert (train.name, train.retries) == ("train", 0)
    assert (register.name, register.retries, register.retry_delay_seconds) == ("register", 4, 7)


def test_stages_run_upstream_first_as_in_dvc_yaml(in_project):
    from flows.tasks import pipeline_stages

    in_project(ROOT)
    stages = pipeline_stages()
    declared = list(yaml.safe_load((ROOT / "dvc.yaml").read_text())["stages"])
    assert sorted(stages) == sorted(declared)  # the root dvc.yaml only, as plain `dvc repro` (not compare/dvc.yaml)
    position = stages.index
    for before, after in [("import_model", "tokenize"), ("ingest", "validate"), ("validate", "tokenize"),
                          ("tokenize", "train"), ("probe", "train"), ("train", "evaluate"), ("evaluate", "register")]:
        assert position(before) < position(after), stages


def test_deployment_uses_the_cron_and_timezone_of_params_and_the_data_source_parameter(in_project):
    from flows.deploy import build_deployment

    in_project(ROOT)
    params = parse_params({"schedule": {"cron": "30 2 * * 1-5", "timezone": "Europe/Paris"}})
    deployment = build_deployment(params, data_source="incoming/tweets.csv")

    (schedule,) = deployment.schedules
    assert (schedule.schedule.cron, schedule.schedule.timezone) == ("30 2 * * 1-5", "Europe/Paris")
    assert deployment.parameters == {"data_source": "incoming/tweets.csv"}
    assert deployment.entrypoint == "flows/pipeline.py:finetune"


def test_a_crash_delay_within_one_heartbeat_is_refused_before_anything_is_registered(in_project, capsys):
    from flows.deploy import HEARTBEAT_S, main

    in_project(ROOT)
    with pytest.raises(SystemExit) as exit_:
        main(["--work-pool", "--crash-after", str(HEARTBEAT_S)])
    assert exit_.value.code == 2
    assert f"--crash-after must exceed the heartbeat interval ({HEARTBEAT_S} s)" in capsys.readouterr().err


def test_a_new_data_source_is_written_into_params_yaml_keeping_its_comments(in_project, tmp_path):
    from flows.tasks import use_data_source

    original = (ROOT / "params.yaml").read_text()
    (tmp_path / "params.yaml").write_text(original)
    in_project(tmp_path)

    assert use_data_source("incoming/tweets.csv") is True
    assert use_data_source("incoming/tweets.csv") is False  # already there: the file is not touched again
    text = (tmp_path / "params.yaml").read_text()
    assert load_params().data.source == "incoming/tweets.csv"
    assert "# stratified cap so the default run fits" in text  # the comments survive
    changed = [(a, b) for a, b in zip(original.splitlines(), text.splitlines(), strict=True) if a != b]
    assert len(changed) == 1 and "source: incoming/tweets.csv" in changed[0][1], changed


def test_flow_outside_a_project_says_where_to_run_it(prefect_server, in_project, tmp_path):
    from flows.pipeline import finetune

    in_project(tmp_path)
    state = finetune(return_state=True)
    assert state.is_failed() and "run the flow (or `make serve`) from the project root" in state.message
