"""The `schedule-llm` Prefect flow's plumbing (flows/scheduling.py, flows/tasks.py) and the scheduling params.

Run with `pytest tests/unit/test_scheduling_flow.py` (a few seconds: DVC reads the real scheduling/dvc.yaml).
The flow's stages themselves run in tests/e2e/test_scheduling_pipeline.py (through `dvc repro`, as the flow's
tasks do).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from frugaltune.config import ParamsError, load_params, parse_params

ROOT = Path(__file__).resolve().parents[2]


def test_the_flow_runs_the_scheduling_stages_upstream_first(monkeypatch):
    from flows.scheduling import SCHEDULING_PIPELINE
    from flows.tasks import pipeline_stages

    monkeypatch.chdir(ROOT)
    addressed = pipeline_stages(SCHEDULING_PIPELINE)
    stages = [s.removeprefix("scheduling/dvc.yaml:") for s in addressed]
    assert sorted(stages) == sorted(["ingest_trace", "validate_trace", "generate_workload", "simulate_baselines",
                                     "build_sft",
                                     "import_model", "ingest", "validate", "tokenize", "probe", "plan",
                                     "train", "evaluate_base", "evaluate_policy", "register", "kernels",
                                     "probe"])
    before = stages.index
    assert before("ingest_trace") < before("validate_trace") < before("ingest") \
        < before("tokenize") < before("plan") < before("train") < before("evaluate_policy") < before("register")
    assert before("generate_workload") < before("build_sft") < before("ingest")
    assert before("generate_workload") < before("simulate_baselines") < before("evaluate_policy")
    assert before("evaluate_base") < before("evaluate_policy")
    # This machine's precision is measured once, by the root pipeline's kernels stage (after the root's probe):
    # the scheduling plan reads that report and the pipeline has no kernels stage of its own.
    assert "scheduling/dvc.yaml:kernels" not in addressed
    assert addressed.index("probe") < addressed.index("kernels") < addressed.index("scheduling/dvc.yaml:plan")
    assert addressed.index("scheduling/dvc.yaml:probe") < addressed.index("scheduling/dvc.yaml:plan")


def test_the_base_models_evaluation_outlives_retrains_and_the_episodes_come_from_the_user_workload():
    import yaml

    stages = yaml.safe_load((ROOT / "scheduling/dvc.yaml").read_text())["stages"]
    outs = lambda stage: {next(iter(o)) if isinstance(o, dict) else o for o in stages[stage]["outs"]}  # noqa: E731
    base_deps = set(stages["evaluate_base"]["deps"])
    # Nothing training writes, nor what it reads, is a dependency of the base model's evaluation
    for stage in ("build_sft", "ingest", "validate", "tokenize", "plan", "train"):
        assert not outs(stage) & base_deps, stage
    assert {"models/base", "data/user_workload.swf", "data/second_workload.swf", "data/trace.swf"} <= base_deps
    named = [p for p in stages["evaluate_base"]["params"] if isinstance(p, str)]
    assert not any(p.startswith(("train.", "data.", "tokenize.", "scheduling.sft.agree", "scheduling.sft.episode"))
                   and p != "train.precision" for p in named)
    # of the plan, which changes with the training data, only the two decisions the policy runs with
    from_plan = [p for p in stages["evaluate_base"]["params"] if isinstance(p, dict)]
    assert from_plan == [{"reports/plan.json": ["machine.precision", "machine.threads"]}]
    assert "reports/evaluate_base.json" in stages["evaluate_policy"]["deps"]
    assert {"data/user_workload.swf", "data/second_workload.swf"} <= set(stages["evaluate_policy"]["deps"])
    build_deps = stages["build_sft"]["deps"]
    assert "data/user_workload.swf" in build_deps and "data/trace.swf" not in build_deps


def test_the_scheduling_plan_reads_the_root_pipelines_kernels_report(tmp_path, monkeypatch):
    """From scheduling/ (where its stages run) the kernels report is the root's, as scheduling/dvc.yaml declares."""
    import yaml

    from frugaltune import paths, resolve
    from frugaltune.planner.machine import recommend_precision

    stages = yaml.safe_load((ROOT / "scheduling/dvc.yaml").read_text())["stages"]
    assert "kernels" not in stages and "../reports/kernels.json" in stages["plan"]["deps"]
    (tmp_path / ".dvc").mkdir()
    (tmp_path / "scheduling/reports").mkdir(parents=True)
    (tmp_path / "reports").mkdir()
    cpu = {"model": "This CPU"}
    (tmp_path / "scheduling/reports/hardware.json").write_text(json.dumps({"cpu": cpu}))
    measured = {"preferred_precision": "bf16", "reason": "bf16 2x fp32", "cpu_model": "This CPU"}
    (tmp_path / "reports/kernels.json").write_text(json.dumps({"cpu": measured}))
    monkeypatch.chdir(tmp_path / "scheduling")
    assert paths.kernels_report() == Path("../reports/kernels.json")
    hardware, found = resolve.machine_facts()
    assert found == measured and recommend_precision(hardware, "auto", found)[0] is True


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
    with pytest.raises(ParamsError, match="generated_procs"):
        parse_params({"scheduling": {"sft": {"generated_procs": [1, 64]}}})
    with pytest.raises(ParamsError, match="generated_loads"):
        parse_params({"scheduling": {"sft": {"generated_loads": [0.0]}}})
    with pytest.raises(ParamsError, match="scheduling.sft.agree_share"):
        parse_params({"scheduling": {"sft": {"agree_share": 1.2}}})
