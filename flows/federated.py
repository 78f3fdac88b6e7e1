"""The `federated` flow: the federated fine-tuning stage (federated/dvc.yaml) as a Prefect flow. Run it once with:

    python -m flows.federated            # in the project root, after `make flower-env`; `make ui` shows the run

Like the `finetune` flow, the stage runs as `dvc repro --single-item federated/dvc.yaml:federated` (flows/tasks.py
says why), so DVC decides whether it is up to date and `dvc status` stays clean. The upstream stages it reads
(models/base, data/tokenized) are brought up to date by the `finetune` flow or `make pipeline` first.
"""

from __future__ import annotations

from typing import Any

from prefect import flow

from flows.tasks import stage_task
from frugaltune import paths
from frugaltune.config import load_params

STAGE = "federated/dvc.yaml:federated"


@flow(name="federated", description="Federated fine-tuning on Flower: partitions, clients, rounds, reports.")
def federated() -> Any:
    params = load_params(paths.PARAMS)
    result = stage_task(STAGE, params.schedule)(STAGE)
    return {"stage": STAGE, "outcome": result["outcome"], "seconds": result["seconds"]}


def main() -> None:
    federated()


if __name__ == "__main__":
    main()
