"""End to end: the `finetune` deployment on a `process` work pool, run by real workers, on a tiny model.

Run with `make test` (or `pytest -m slow tests/e2e/test_prefect_pool.py`). What the README's "A Prefect work
pool" commands do, in a temp git+DVC project, with a Prefect server on 127.0.0.1:

- `python -m flows.deploy --work-pool frugaltune` (make deploy-pool) creates the pool and registers the
  deployment; `python -m flows.worker` (make worker) starts `prefect worker start --pool frugaltune`.
- Run 1 is slowed down (FRUGALTUNE_TEST_STEP_DELAY_S); once training has written a checkpoint, the worker and
  everything under it is SIGKILLed, as when its machine is lost. Nothing is left to report the crash: the
  heartbeat automation marks the run Crashed (here after 60 s of silence instead of 90).
- Run 2, triggered right away on a new worker, waits for the deployment's one slot, then does the work: training
  resumes from run 1's checkpoint, a model is registered, `dvc status` is clean.
- Run 3, with nothing new, does nothing.

The tests share the server and the project and run in file order: each one continues the story.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from tests.e2e.test_prefect import (CRON, SOURCE, dvc_status, env_for_subprocesses, free_port, kill_tree,
                                    make_project, start, task_runs, wait_for)

pytestmark = pytest.mark.slow
POOL = "frugaltune"
DEPLOYMENT = "finetune/scheduled"
CRASH_AFTER_S = 60


@dataclass
class Pool:
    project: Path
    api: str
    home: Path
    logs: Path
    server: subprocess.Popen
    workers: list[subprocess.Popen] = field(default_factory=list)
    runs: dict[str, str] = field(default_factory=dict)

    def log_tails(self) -> str:
        return "\n".join(f"--- {log.name}\n{log.read_text(errors='replace')[-4000:]}"
                         for log in sorted(self.logs.glob("*.log")))

    def start_worker(self, **env: str) -> subprocess.Popen:
        """`make worker`: python -m flows.worker, which execs `prefect worker start --pool frugaltune`."""
        log = self.logs / f"worker{len(self.workers) + 1}.log"
        worker = start([sys.executable, "-m", "flows.worker"], self.project, log,
                       PREFECT_API_URL=self.api, PREFECT_HOME=str(self.home), **env)
        self.workers.append(worker)
        wait_for("the worker polls the pool", lambda: "Worker 'ProcessWorker" in log.read_text(), 120, [log], worker)
        return worker

    def trigger(self) -> str:
        """`prefect deployment run finetune/scheduled`, as the README says; returns the flow run's id."""
        proc = subprocess.run([str(Path(sys.executable).parent / "prefect"), "deployment", "run", DEPLOYMENT],
                              cwd=self.project, env=env_for_subprocesses(PREFECT_API_URL=self.api),
                              capture_output=True, text=True, timeout=180)
        assert proc.returncode == 0, proc.stdout + proc.stderr
        return re.search(r"UUID:\s*([0-9a-f-]{36})", proc.stdout).group(1)

    def state(self, run_id: str):
        from prefect import get_client

        with get_client(sync_client=True) as client:
            return client.read_flow_run(run_id).state

    def wait_final(self, run_id: str, timeout_s: float = 600):
        deadline = time.monotonic() + timeout_s
        while not (state := self.state(run_id)).is_final():
            assert time.monotonic() < deadline, f"run {run_id} not finished: {state}\n{self.log_tails()}"
            time.sleep(2)
        return state


@pytest.fixture(scope="module")
def pool(tmp_path_factory, tiny_model_dir) -> Iterator[Pool]:
    from prefect.settings import PREFECT_API_URL, temporary_settings

    base = tmp_path_factory.mktemp("prefect_pool")
    logs, home = base / "logs", base / "prefect_home"
    logs.mkdir()
    # a checkpoint to resume from mid-training
    project = make_project(base / "project", tiny_model_dir, data_source=SOURCE, max_steps=6, checkpoint_every=2)
    port = free_port()
    api = f"http://127.0.0.1:{port}/api"
    server = start([sys.executable, "-m", "prefect", "server", "start", "--host", "127.0.0.1", "--port", str(port)],
                   project, logs / "server.log", PREFECT_HOME=str(home), PREFECT_SERVER_ANALYTICS_ENABLED="false",
                   PREFECT_UI_ENABLED="false")
    stack = Pool(project, api, home, logs, server)
    try:
        wait_for("the Prefect server answers", lambda: _healthy(api), 180, [logs / "server.log"], server)
        with temporary_settings(updates={PREFECT_API_URL: api}):
            yield stack
    finally:  # nothing may outlive the test
        for proc in [*stack.workers, server]:
            kill_tree(proc)


def _healthy(api: str) -> bool:
    import urllib.request

    with urllib.request.urlopen(f"{api}/health", timeout=5) as response:
        return response.status == 200


def test_deploy_creates_the_pool_and_registers_the_schedule_of_params(pool: Pool):
    from prefect import get_client

    out = subprocess.run([sys.executable, "-m", "flows.deploy", "--work-pool", "--crash-after", str(CRASH_AFTER_S)],
                         cwd=pool.project, env=env_for_subprocesses(PREFECT_API_URL=pool.api), capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 0, out.stdout + out.stderr
    assert f"registered for work pool '{POOL}'" in out.stdout and "make worker" in out.stdout

    with get_client(sync_client=True) as client:
        assert client.read_work_pool(POOL).type == "process"
        deployment = client.read_deployment_by_name(DEPLOYMENT)
        (automation,) = client.read_automations_by_name(f"{DEPLOYMENT}: crash silent runs")
    (schedule,) = deployment.schedules
    assert schedule.schedule.cron == CRON and schedule.schedule.timezone == "UTC"  # from params.yaml
    assert deployment.work_pool_name == POOL and deployment.global_concurrency_limit.limit == 1
    assert deployment.entrypoint == "flows/pipeline.py:finetune"
    assert deployment.pull_steps == [{"prefect.deployments.steps.set_working_directory": {
        "directory": str(pool.project.resolve())}}]  # source: the project itself, not a copy
    assert automation.trigger.within.total_seconds() == CRASH_AFTER_S


def test_a_worker_killed_mid_run_leaves_the_run_crashed_and_the_next_run_does_the_work(pool: Pool):
    worker = pool.start_worker(FRUGALTUNE_TEST_STEP_DELAY_S="1")
    crashed = pool.trigger()
    checkpoints = pool.project / "checkpoints" / "train"
    wait_for("training writes a checkpoint", lambda: any(checkpoints.glob("*/step-*")), 600,
             [pool.logs / "worker1.log"], worker)
    kill_tree(worker)  # the worker, its flow run and the training under it: a machine lost
    killed_at = time.monotonic()
    assert pool.state(crashed).is_running()  # nobody is left to say otherwise

    pool.start_worker()
    retried = pool.trigger()  # queued: the dead run still holds the deployment's one slot

    state = pool.wait_final(crashed, timeout_s=CRASH_AFTER_S + 120)
    assert state.is_crashed() and state.message.startswith(f"No heartbeat for {CRASH_AFTER_S} s"), state
    print(f"run 1 marked Crashed {time.monotonic() - killed_at:.0f} s after the kill")
    state = pool.wait_final(retried)
    assert state.is_completed(), f"{state.message}\n{pool.log_tails()}"
    tasks = task_runs(retried)
    assert tasks["train"].state.is_completed() and tasks["register"].state.is_completed()
    train = json.loads((pool.project / "reports/train.json").read_text())
    assert train["resumed_from_step"] >= 2  # DVC reran train, which resumed from run 1's checkpoint
    assert json.loads((pool.project / "reports/register.json").read_text())["version"] == 1
    assert dvc_status(pool.project) == {}
    pool.runs["done"] = retried


def test_a_second_trigger_with_nothing_new_does_nothing(pool: Pool):
    lock_before = (pool.project / "dvc.lock").read_text()

    run = pool.trigger()
    state = pool.wait_final(run, timeout_s=300)

    assert state.is_completed() and state.message.startswith("Nothing to do"), state.message
    assert all(name.startswith("find-changes") for name in task_runs(run))  # no stage task at all
    assert (pool.project / "dvc.lock").read_text() == lock_before
    assert json.loads((pool.project / "reports/register.json").read_text())["version"] == 1
