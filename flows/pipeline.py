"""The `finetune` flow: the DVC pipeline as a Prefect flow (schedules, retries, a UI). Run it once with:

    python -m flows.pipeline [--data-source PATH]     # in the project root; `make ui` shows the run

`make serve` serves it on the cron in params.yaml (flows/deploy.py). Each stage is a task that runs
`dvc repro --single-item <stage>` in DAG order (see flows/tasks.py for why), so DVC alone decides what is up to
date and `dvc status` is clean after a run. A run first asks `dvc status` and hashes the data source: when
neither shows a change it finishes at once with "Nothing to do" and registers nothing. When the file that
`data.source` names has changed (new rows landed), ingest is forced and DVC reruns whatever that changes.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from prefect import flow, get_run_logger
from prefect.states import Completed

from flows.tasks import check_tracking_server, find_changes, pipeline_stages, publish_reports, stage_task, use_data_source
from frugaltune import paths
from frugaltune.config import load_params


@flow(name="finetune", description="Fine-tune and register the model when data, params or code changed.")
def finetune(data_source: str | None = None) -> Any:
    """Bring the DVC pipeline up to date and return what each stage did.

    Args:
        data_source: a file or a train/val/test directory, relative to the project root; written into
            params.yaml's `data.source` when it differs. None keeps what params.yaml says.
    """
    if not Path("dvc.yaml").is_file():
        raise FileNotFoundError(f"no dvc.yaml in {Path.cwd()}: run the flow (or `make serve`) from the project root")
    check_tracking_server()
    logger = get_run_logger()
    if data_source and use_data_source(data_source):
        logger.info(f"params.yaml: data.source = {data_source!r}")
    params = load_params(paths.PARAMS)
    stages = pipeline_stages()
    changes = find_changes(params, check_source="ingest" in stages)
    if not changes["stages"] and not changes["source_changed"]:
        logger.info(f"Nothing to do: {changes['reason']}")
        return Completed(message=f"Nothing to do: {changes['reason']}", data={"nothing_to_do": True, "stages": {}})

    results = {}
    for stage in stages:
        force = stage == "ingest" and changes["source_changed"]
        results[stage] = stage_task(stage, params.schedule)(stage, force=force)
    publish_reports(results)
    return {"nothing_to_do": False, "stages": {stage: result["outcome"] for stage, result in results.items()}}


def main() -> None:
    parser = argparse.ArgumentParser(description="Run the finetune flow once, here.")
    parser.add_argument("--data-source", help="file or directory to train on (default: params.yaml's data.source)")
    finetune(data_source=parser.parse_args().data_source)


if __name__ == "__main__":
    main()
