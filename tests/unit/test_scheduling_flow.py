"""The `schedule-llm` Prefect flow's plumbing (flows/scheduling.py, flows/tasks.py) and the scheduling params.

Run with `pytest tests/unit/test_scheduling_flow.py` (a few seconds: DVC reads the real scheduling/dvc.yaml).
The flow's stages themselves run in tests/e2e/test_scheduling_pipeline.py (through `dvc repro`, as the flow's
tasks do).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from frugaltune.config import ParamsError, load_params, parse_params

ROOT = Path(__file__).resolve().parents[2]


def test_the_flow_runs_the_scheduling_stages_upstream_first(monkeypatch):
    from flows.scheduling import SCHEDULING_PIPELINE
    from flows.tasks import pipeline_stages

    monkeypatch.chdir(ROOT)
    stages = [s.split(":", 1)[1] for s in pipeline_stages(SCHEDULING_PIPELINE)]
    assert all(s.startswith("scheduling/dvc.yaml:") for s in pipeline_stages(SCHEDULING_PIPELINE))
    assert sorted(stages) == sorted(["ingest_trace", "validate_trace", "simulate_baselines", "build_sft",
                                     "import_model", "ingest", "validate", "tokenize", "probe", "kernels", "plan",
                                     "train", "evaluate_policy", "register"])
    before = stages.index
    assert before("ingest_trace") < before("validate_trace") < before("build_sft") < before("ingest") \
        < before("tokenize") < before("plan") < before("train") < before("evaluate_policy") < before("register")
    assert before("probe") < before("kernels") < before("plan")  # this machine's precision, measured here


def test_a_scheduling_train_stage_gets_the_training_timeout_and_register_its_retries():
    from flows.tasks import stage_task, stage_timeout

    schedule = parse_params({"schedule": {"stage_timeout_s": 60, "train_timeout_s": 600, "register_retries": 4,
                                          "retry_delay_s": 1}}).schedule
    assert stage_timeout("scheduling/dvc.yaml:train", schedule) == (600, "schedule.train_timeout_s")
    assert stage_timeout("scheduling/dvc.yaml:build_sft", schedule) == (60, "schedule.stage_timeout_s")
    assert stage_task("scheduling/dvc.yaml:register", schedule).retries == 4


def test_the_scheduling_params_file_is_valid_and_gates_on_bsld_lower_is_better():
    params = load_params(ROOT / "scheduling" / "params.yaml")
    assert params.task.type == "causal_lm" and params.task.candidates_column == "candidates"
    assert params.register_.metric == "avg_bsld" and params.register_.higher_is_better is False
    assert params.scheduling.window == 8 and params.scheduling.sft.rollout_policies == ["F1"]


def test_scheduling_params_reject_a_window_prompts_cannot_letter_and_unknown_heuristics():
    with pytest.raises(ParamsError, match="scheduling.window"):
        parse_params({"scheduling": {"window": 27}})
    with pytest.raises(ParamsError, match="scheduling.sft.rollout_policies"):
        parse_params({"scheduling": {"sft": {"rollout_policies": ["LIFO"]}}})
    with pytest.raises(ParamsError, match="scheduling.sft.horizn"):
        parse_params({"scheduling": {"sft": {"horizn": 3}}})
