"""The `schedule-llm` flow: the scheduling pipeline (scheduling/dvc.yaml) as a Prefect flow. Run it once with:

    python -m flows.scheduling          # in the project root; `make ui` shows the run

Like the `finetune` flow (flows/pipeline.py), each stage is a task that runs `dvc repro --single-item
scheduling/dvc.yaml:<stage>` in DAG order, so DVC alone decides what is up to date and `dvc status` is clean
after a run; a run that finds nothing changed finishes at once with "Nothing to do". Timeouts and register's
retries come from the root params.yaml's `schedule` section, as for the finetune flow.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from prefect import flow, get_run_logger
from prefect.states import Completed

from flows.tasks import check_tracking_server, find_changes, pipeline_stages, stage_task
from frugaltune import paths
from frugaltune.config import load_params
from frugaltune.io import read_json

SCHEDULING_PIPELINE = paths.SCHEDULING_DIR / "dvc.yaml"


@flow(name="schedule-llm", description="Build SFT data from a trace, fine-tune, judge and register an LLM scheduler.")
def schedule_llm() -> Any:
    """Bring scheduling/dvc.yaml up to date; return what each stage did and the policy comparison."""
    if not SCHEDULING_PIPELINE.is_file():
        raise FileNotFoundError(f"no {SCHEDULING_PIPELINE} in {Path.cwd()}: run the flow from the project root")
    check_tracking_server()
    logger = get_run_logger()
    schedule = load_params(paths.PARAMS).schedule
    stages = pipeline_stages(SCHEDULING_PIPELINE)
    # The trace is a dependency DVC hashes itself, so `dvc status` sees a changed trace: no source check here.
    changes = find_changes(load_params(paths.SCHEDULING_DIR / paths.PARAMS), check_source=False,
                           pipeline=SCHEDULING_PIPELINE)
    if not changes["stages"]:
        logger.info(f"Nothing to do: {changes['reason']}")
        return Completed(message=f"Nothing to do: {changes['reason']}", data={"nothing_to_do": True, "stages": {}})
    results = {stage: stage_task(stage, schedule)(stage) for stage in stages}
    evaluation = paths.SCHEDULING_DIR / paths.report("evaluate")
    summary = {}
    if evaluation.is_file():
        report = read_json(evaluation)
        summary = {name: report[key]["avg_bsld"] for name, key in (("finetuned", "finetuned"), ("base", "baseline"))
                   if key in report} | {name: v["avg_bsld"] for name, v in report["heuristics"].items()}
        logger.info("avg bsld: " + ", ".join(f"{name} {value:.2f}" for name, value in summary.items()))
    return {"nothing_to_do": False, "stages": {stage: r["outcome"] for stage, r in results.items()},
            "avg_bsld": summary}


if __name__ == "__main__":
    schedule_llm()
