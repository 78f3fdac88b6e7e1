"""Start a Prefect process worker that runs the `finetune` deployment of a work pool.  Run with:

    make worker    # = python -m flows.worker [--pool frugaltune]; Ctrl-C stops it

Register the deployment first (`make deploy-pool`). The worker polls the server (PREFECT_API_URL, else the one
`make ui` starts) and runs each flow run in a subprocess, in the project directory the deployment names, with
this worker's Python: start it from the project's venv, on the machine that holds the project. It is
`prefect worker start --pool <pool> --type process`, which creates the pool when it is missing.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
from pathlib import Path

from prefect.settings import PREFECT_API_URL

from flows.deploy import WORK_POOL, server_api_url


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Start a process worker for the frugaltune work pool.")
    parser.add_argument("--pool", default=WORK_POOL, help=f"work pool to poll (default: {WORK_POOL})")
    args = parser.parse_args(argv)
    # Without PREFECT_API_URL, `prefect worker start` would poll a temporary server of its own and never see a run.
    api_url = server_api_url("worker")
    if api_url is None:
        return 1
    prefect = shutil.which("prefect", path=str(Path(sys.executable).parent)) or shutil.which("prefect")
    if prefect is None:
        print("worker: no `prefect` command next to this Python or on PATH; run `make install`.", file=sys.stderr)
        return 1
    env = {**os.environ, PREFECT_API_URL.name: api_url}
    os.execve(prefect, [prefect, "worker", "start", "--pool", args.pool, "--type", "process"], env)


if __name__ == "__main__":
    sys.exit(main())
