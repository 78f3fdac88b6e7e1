"""Serve the `finetune` flow on the cron in params.yaml (`schedule.cron`, `schedule.timezone`).  Run with:

    make serve     # = python -m flows.deploy [--data-source PATH] [--name scheduled]

Runs execute on this machine, in this directory (the project root), one at a time; the Prefect server only
schedules and records them. Start one with `make ui`, or point PREFECT_API_URL at yours (a shared server, Prefect
Cloud). Trigger a run by hand from the UI or with

    prefect deployment run finetune/scheduled [--param data_source=incoming/tweets.csv]

Stopping `make serve` (Ctrl-C) pauses the schedule, so runs do not pile up while nothing serves them.

With a work pool instead, the deployment is registered once and a worker pulls the runs:

    make deploy-pool   # = python -m flows.deploy --work-pool frugaltune [--data-source PATH]; registers and exits
    make worker        # = python -m flows.worker [--pool frugaltune]; a process worker, Ctrl-C stops it

The pool (type `process`) is created when missing. The deployment's source is this directory: a run executes
here, in the project root, with the worker's Python (same schedule, one run at a time, "Nothing to do" when
nothing changed). Its runs send a heartbeat every HEARTBEAT_S seconds, and an automation (`finetune/<name>:
crash silent runs`) marks a run Crashed once it has been silent for `--crash-after` seconds: a worker that dies
mid-run (killed, machine lost) cannot report the crash itself, and its run would hold the deployment's one slot
as Running forever. The next run then redoes what DVC has not recorded, training resumes from its checkpoint.
"""

from __future__ import annotations

import argparse
import signal
import sys
import urllib.request
from pathlib import Path

from datetime import timedelta

from prefect import get_client, serve
from prefect.client.schemas.actions import WorkPoolCreate
from prefect.client.schemas.objects import StateType
from prefect.events.actions import ChangeFlowRunState
from prefect.events.schemas.automations import AutomationCore, EventTrigger, Posture
from prefect.events.schemas.events import ResourceSpecification
from prefect.exceptions import ObjectNotFound
from prefect.schedules import Cron
from prefect.settings import PREFECT_API_URL, temporary_settings

from flows.pipeline import finetune
from flows.ui import prefect_api_url
from frugaltune.config import Params, ParamsError, load_params

DEPLOYMENT_NAME = "scheduled"
WORK_POOL = "frugaltune"
HEARTBEAT_S = 30  # Prefect's minimum; its default (180 s) would leave a dead run Running for minutes
CRASH_AFTER_S = 90  # three missed heartbeats: a busy machine delays one, not three


def _deployment_args(params: Params, data_source: str | None) -> dict:
    return {
        "schedules": [Cron(params.schedule.cron, timezone=params.schedule.timezone)],
        "parameters": {"data_source": data_source} if data_source else {},
        "concurrency_limit": 1,  # two runs in one DVC workspace would fight over its lock
        "tags": ["frugaltune"],
        "description": f"Retrain on new data or changed params ({params.schedule.cron}, {params.schedule.timezone}); "
                       "a run with nothing new finishes at once and registers nothing.",
    }


def build_deployment(params: Params, name: str = DEPLOYMENT_NAME, data_source: str | None = None):
    """The deployment `make serve` serves: schedule and timeouts from params, `data_source` as default parameter."""
    return finetune.to_deployment(name=name, **_deployment_args(params, data_source))


def deploy_to_pool(params: Params, pool: str, name: str = DEPLOYMENT_NAME, data_source: str | None = None,
                   crash_after_s: int = CRASH_AFTER_S):
    """Register the deployment for `pool`'s workers (creating the process pool when missing) and the automation
    that marks its silent runs Crashed. Returns the deployment's id. Needs PREFECT_API_URL set."""
    from prefect.workers.process import ProcessWorker

    with get_client(sync_client=True) as client:
        try:
            client.read_work_pool(pool)
        except ObjectNotFound:
            client.create_work_pool(WorkPoolCreate(
                name=pool, type="process", base_job_template=ProcessWorker.get_default_base_job_template()))
    source = finetune.from_source(source=str(Path.cwd()), entrypoint="flows/pipeline.py:finetune")
    # ignore_warnings: Prefect suggests `serve` for process pools; here the pool is the point.
    deployment_id = source.deploy(
        name=name, work_pool_name=pool, ignore_warnings=True, print_next_steps=False,
        job_variables={"env": {"PREFECT_FLOWS_HEARTBEAT_FREQUENCY": str(HEARTBEAT_S)}},
        **_deployment_args(params, data_source))
    _crash_silent_runs(f"{finetune.name}/{name}", deployment_id, crash_after_s)
    return deployment_id


def _crash_silent_runs(deployment: str, deployment_id, crash_after_s: int) -> None:
    """Prefect's documented zombie detection ("detect zombie flows"), for this deployment's runs only: after a
    heartbeat, expect another heartbeat or a final state within `crash_after_s`, else propose Crashed. Replaces
    the automation of an earlier `deploy` (same name), so redeploying with another delay leaves one."""
    name = f"{deployment}: crash silent runs"
    automation = AutomationCore(
        name=name,
        description=f"Marks a run of {deployment} Crashed when it sends no heartbeat for {crash_after_s} s "
                    "(its worker died); the deployment's one concurrency slot is then free for the next run.",
        trigger=EventTrigger(
            match=ResourceSpecification({"prefect.resource.id": "prefect.flow-run.*"}),
            match_related=ResourceSpecification({"prefect.resource.id": f"prefect.deployment.{deployment_id}"}),
            after={"prefect.flow-run.heartbeat"},
            expect={"prefect.flow-run.heartbeat", "prefect.flow-run.Completed", "prefect.flow-run.Failed",
                    "prefect.flow-run.Cancelled", "prefect.flow-run.Crashed"},
            for_each={"prefect.resource.id"},
            posture=Posture.Proactive,
            threshold=1,
            within=timedelta(seconds=crash_after_s),
        ),
        actions=[ChangeFlowRunState(state=StateType.CRASHED,
                                    message=f"No heartbeat for {crash_after_s} s: the worker or its machine died "
                                            "mid-run. The next run redoes what DVC has not recorded.")],
    )
    with get_client(sync_client=True) as client:
        for old in client.read_automations_by_name(name):
            client.delete_automation(old.id)
        client.create_automation(automation)


def _server_is_up(api_url: str) -> bool:
    try:
        with urllib.request.urlopen(f"{api_url}/health", timeout=5) as response:
            return response.status == 200
    except OSError:
        return False


def server_api_url(command: str) -> str | None:
    """PREFECT_API_URL, else the server `make ui` starts when it answers; None (and why, on stderr) otherwise."""
    api_url = PREFECT_API_URL.value() or prefect_api_url()
    if not PREFECT_API_URL.value() and not _server_is_up(api_url):
        print(f"{command}: no Prefect server at {api_url}. Start one with `make ui` (another terminal), or set "
              "PREFECT_API_URL to your server.", file=sys.stderr)
        return None
    return api_url


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Serve the finetune flow on the cron in params.yaml.")
    parser.add_argument("--data-source", help="default `data_source` parameter of the runs (a file or directory); "
                                              "default: params.yaml's data.source")
    parser.add_argument("--name", default=DEPLOYMENT_NAME, help=f"deployment name (default: {DEPLOYMENT_NAME})")
    parser.add_argument("--work-pool", nargs="?", const=WORK_POOL, metavar="POOL",
                        help=f"register the deployment for this work pool's workers and exit (default pool: "
                             f"{WORK_POOL}; created when missing); start a worker with `make worker`")
    parser.add_argument("--crash-after", type=int, default=CRASH_AFTER_S, metavar="SECONDS",
                        help="with --work-pool: mark a run Crashed after this long without a heartbeat "
                             f"(default: {CRASH_AFTER_S}; heartbeats every {HEARTBEAT_S} s)")
    args = parser.parse_args(argv)
    if not Path("dvc.yaml").is_file():
        print(f"serve: no dvc.yaml in {Path.cwd()}; run from the project root.", file=sys.stderr)
        return 1
    if args.crash_after <= HEARTBEAT_S:
        parser.error(f"--crash-after must exceed the heartbeat interval ({HEARTBEAT_S} s); a run between two "
                     "heartbeats would be marked Crashed")
    try:
        params = load_params()
    except ParamsError as exc:
        print(f"serve: {exc}", file=sys.stderr)
        return 1

    api_url = server_api_url("serve")
    if api_url is None:
        return 1
    with temporary_settings(updates={PREFECT_API_URL: api_url}):
        if args.work_pool:
            deploy_to_pool(params, args.work_pool, args.name, args.data_source, args.crash_after)
            print(f"Deployment '{finetune.name}/{args.name}' registered for work pool '{args.work_pool}' "
                  f"({params.schedule.cron}, {params.schedule.timezone}). Start a worker: make worker"
                  f"{'' if args.work_pool == WORK_POOL else f' POOL={args.work_pool}'}")
            return 0
        # Started in the background (nohup, `&` in a script), a process inherits SIGINT *ignored* and Python then
        # installs no KeyboardInterrupt handler: restore it so that Ctrl-C / `kill -INT` always stops serving.
        signal.signal(signal.SIGINT, signal.default_int_handler)
        serve(build_deployment(params, args.name, args.data_source), limit=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
