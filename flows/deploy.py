"""Serve the `finetune` flow on the cron in params.yaml (`schedule.cron`, `schedule.timezone`).  Run with:

    make serve     # = python -m flows.deploy [--data-source PATH] [--name scheduled]

Runs execute on this machine, in this directory (the project root), one at a time; the Prefect server only
schedules and records them. Start one with `make ui`, or point PREFECT_API_URL at yours (a shared server, Prefect
Cloud). Trigger a run by hand from the UI or with

    prefect deployment run finetune/scheduled [--param data_source=incoming/tweets.csv]

Stopping `make serve` (Ctrl-C) pauses the schedule, so runs do not pile up while nothing serves them.

With a work pool instead, a worker pulls the runs; it must run in this project directory (a process worker on
this machine, or a machine where the same path holds the project):

    prefect work-pool create frugaltune --type process
    python -m flows.deploy --work-pool frugaltune     # registers the deployment and exits
    prefect worker start --pool frugaltune            # on the machine that trains
"""

from __future__ import annotations

import argparse
import signal
import sys
import urllib.request
from pathlib import Path

from prefect import serve
from prefect.schedules import Cron
from prefect.settings import PREFECT_API_URL, temporary_settings

from flows.pipeline import finetune
from flows.ui import prefect_api_url
from frugaltune.config import Params, ParamsError, load_params

DEPLOYMENT_NAME = "scheduled"


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


def _server_is_up(api_url: str) -> bool:
    try:
        with urllib.request.urlopen(f"{api_url}/health", timeout=5) as response:
            return response.status == 200
    except OSError:
        return False


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Serve the finetune flow on the cron in params.yaml.")
    parser.add_argument("--data-source", help="default `data_source` parameter of the runs (a file or directory); "
                                              "default: params.yaml's data.source")
    parser.add_argument("--name", default=DEPLOYMENT_NAME, help=f"deployment name (default: {DEPLOYMENT_NAME})")
    parser.add_argument("--work-pool", help="register the deployment for this work pool's workers and exit")
    args = parser.parse_args(argv)
    if not Path("dvc.yaml").is_file():
        print(f"serve: no dvc.yaml in {Path.cwd()}; run from the project root.", file=sys.stderr)
        return 1
    try:
        params = load_params()
    except ParamsError as exc:
        print(f"serve: {exc}", file=sys.stderr)
        return 1

    api_url = PREFECT_API_URL.value() or prefect_api_url()
    if not PREFECT_API_URL.value() and not _server_is_up(api_url):
        print(f"serve: no Prefect server at {api_url}. Start one with `make ui` (another terminal), or set "
              "PREFECT_API_URL to your server.", file=sys.stderr)
        return 1
    with temporary_settings(updates={PREFECT_API_URL: api_url}):
        if args.work_pool:
            source = finetune.from_source(source=str(Path.cwd()), entrypoint="flows/pipeline.py:finetune")
            # ignore_warnings: Prefect suggests `serve` for process pools; here the pool is the point.
            source.deploy(name=args.name, work_pool_name=args.work_pool, ignore_warnings=True,
                          **_deployment_args(params, args.data_source))
            return 0
        # Started in the background (nohup, `&` in a script), a process inherits SIGINT *ignored* and Python then
        # installs no KeyboardInterrupt handler: restore it so that Ctrl-C / `kill -INT` always stops serving.
        signal.signal(signal.SIGINT, signal.default_int_handler)
        serve(build_deployment(params, args.name, args.data_source), limit=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
