"""The `federated` flow: the federated fine-tuning stage (federated/dvc.yaml) as a Prefect flow. Run it once with:

    python -m flows.federated            # in the project root, after `make flower-env`; `make ui` shows the run

Like the `finetune` flow, the stages run as `dvc repro --single-item federated/dvc.yaml:<stage>` (flows/tasks.py
says why): `federated`, then `federated_register`, so DVC decides whether each is up to date and `dvc status`
stays clean. The upstream stages they read (models/base, data/tokenized) are brought up to date by the `finetune` flow or `make pipeline` first.
"""

from __future__ import annotations

from typing import Any

from prefect import flow

from flows.tasks import check_tracking_server, stage_task
from frugaltune import paths
from frugaltune.config import load_params

STAGE = "federated/dvc.yaml:federated"
REGISTER = "federated/dvc.yaml:federated_register"  # the best global adapter, registered like the centralized one


@flow(name="federated", description="Federated fine-tuning on Flower: partitions, clients, rounds, reports, "
      "registration of the global adapter.")
def federated() -> Any:
    check_tracking_server()
    params = load_params(paths.PARAMS)
    result = stage_task(STAGE, params.schedule)(STAGE)
    registered = stage_task(REGISTER, params.schedule)(REGISTER)
    return {"stage": STAGE, "outcome": result["outcome"], "seconds": result["seconds"],
            "register": registered["outcome"]}


def main() -> None:
    federated()


if __name__ == "__main__":
    main()
