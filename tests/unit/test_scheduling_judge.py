"""Judging in both modes, departures from F1 and the teacher's agreement, the teacher's ceiling
(frugaltune/scheduling/judge.py), and the stages that use them (generate_workload, simulate_baselines,
evaluate_policy) on a synthetic trace with a tiny random llama.

Run with `pytest tests/unit/test_scheduling_judge.py` (about half a minute: a few hundred forwards of a 2-layer model
and small teacher rollouts).
"""

from __future__ import annotations

import json

import pytest

from frugaltune.config import parse_params
from frugaltune.scheduling import F1, SJF, simulate, synthetic_workload
from frugaltune.scheduling.judge import MODES, DepartureLog, judge, teacher_results
from frugaltune.scheduling.llm_policy import load_llm_policy
from frugaltune.scheduling.metrics import sequence_metrics
from frugaltune.scheduling.policies import BASELINES
from frugaltune.scheduling.sft import LookaheadTeacher
from frugaltune.scheduling.simulator import Simulator, simulate_batch
from frugaltune.scheduling.synthetic import write_swf

WINDOW = 4


@pytest.fixture(scope="module")
def sequences():
    jobs = synthetic_workload(120, max_procs=16, seed=2, mean_interarrival=20.0).jobs
    return [jobs[0:40], jobs[40:80], jobs[80:120]]


def test_a_policy_that_copies_f1_never_departs_and_sjf_departs_where_it_differs(sequences):
    copy, sjf = DepartureLog(), DepartureLog()
    simulate_batch(sequences, 16, F1, window=WINDOW, on_decision=copy)
    simulate_batch(sequences, 16, SJF, window=WINDOW, on_decision=sjf)
    assert copy.decisions > 10 and copy.departures == 0 and copy.report()["departure_share"] == 0.0
    assert copy.report()["teacher_agreement_share"] is None  # nothing to agree with
    assert 0 < sjf.departures <= sjf.decisions
    assert sjf.report()["departure_share"] == pytest.approx(sjf.departures / sjf.decisions)


def test_the_teacher_is_asked_only_at_departures_and_agrees_with_itself(sequences):
    teacher = LookaheadTeacher([F1], horizon=8)
    log = DepartureLog(teacher)
    simulate_batch(sequences, 16, SJF, window=WINDOW, on_decision=log)
    report = log.report()
    assert 0 <= report["teacher_agrees"] <= report["departures"] and report["teacher_seconds"] > 0
    # The observer looks ahead on clones: SJF's schedule is the one simulate gives without it
    for jobs, got in zip(sequences, simulate_batch(sequences, 16, SJF, window=WINDOW, on_decision=DepartureLog(
            teacher))):
        assert got.schedule() == simulate(jobs, 16, SJF, window=WINDOW).schedule()

    # The teacher as the policy: wherever it departs from F1, it agrees with itself
    itself = DepartureLog(teacher)
    for jobs in sequences:
        sim = Simulator(jobs, 16, window=WINDOW)
        while (state := sim.next_decision()) is not None:
            job = teacher.choose(sim, state)
            itself(sim, state, job)
            sim.commit(job)
    assert itself.departures > 0 and itself.teacher_agrees == itself.departures


def test_the_teachers_ceiling_is_its_own_schedule_in_each_mode(sequences):
    teacher = LookaheadTeacher([F1], horizon=16)
    for backfill in (False, True):
        results = teacher_results(sequences, 16, teacher, WINDOW, backfill)
        assert [len(r.schedule()) for r in results] == [40, 40, 40] and all(r.backfill is backfill for r in results)
        assert all(sequence_metrics(r).avg_bsld >= 1 for r in results)


def test_judge_runs_every_policy_in_both_modes_and_reports_llm_departures(sequences, tiny_model_dir):
    llm = load_llm_policy(tiny_model_dir, None, name="tiny", threads=1, batch_size=8)
    policies = {"F1": F1, "SJF": SJF, "tiny": llm}
    summaries, results = judge(sequences, 16, policies, WINDOW, LookaheadTeacher([F1], horizon=8), log=lambda _: None)
    assert set(summaries) == set(MODES) == {"no_backfill", "easy"}
    for mode, backfill in MODES.items():
        assert set(summaries[mode]) == {"F1", "SJF", "tiny"}
        assert all(r.backfill is backfill for runs in results[mode].values() for r in runs)
        assert len(summaries[mode]["F1"]["per_sequence_avg_bsld"]) == 3
        tiny = summaries[mode]["tiny"]
        assert 0 < tiny["model_calls"] <= tiny["decisions"] and tiny["decisions_per_s"] > 0
        departures = tiny["departures"]
        assert departures["reference"] == "F1" and 0 <= departures["departures"] <= departures["decisions"]
        assert "departures" not in summaries[mode]["SJF"]  # heuristics are not asked what they learned
    # The per-mode stats are this mode's share, not the running total
    assert summaries["no_backfill"]["tiny"]["model_calls"] + summaries["easy"]["tiny"]["model_calls"] \
        == llm.stats()["model_calls"]
    # EASY helps F1 here as on every trace measured
    assert summaries["easy"]["F1"]["avg_bsld"] <= summaries["no_backfill"]["F1"]["avg_bsld"]


def stage_params(trace: str) -> dict:
    return {"scheduling": {
        "trace": trace, "window": WINDOW,
        "evaluation": {"sequence_length": 30, "n_sequences": 2, "held_out_fraction": 0.3, "seed": 0},
        "sft": {"rollout_policies": ["F1"], "horizon": 8},
        "llm": {"threads": 1, "batch_size": 4},
        "user_workload": {"procs": 16, "jobs": 400, "load": 1.1, "seed": 8},
        "second_workload": {"procs": 32, "jobs": 200, "load": 1.2, "seed": 9, "n_sequences": 2,
                            "sequence_length": 30}}}


def test_the_stages_generate_judge_on_every_workload_and_write_numbers_only_metrics(tmp_path, monkeypatch,
                                                                                      tiny_model_dir):
    from stages import evaluate_base, evaluate_policy, generate_workload, simulate_baselines

    monkeypatch.chdir(tmp_path)
    write_swf(synthetic_workload(300, max_procs=16, seed=0, mean_interarrival=25.0), tmp_path / "data/trace.swf")
    (tmp_path / "models").mkdir()
    (tmp_path / "models/base").symlink_to(tiny_model_dir)
    (tmp_path / "reports").mkdir()
    (tmp_path / "reports/train.json").write_text(json.dumps({"bf16": False, "threads": 1}))
    raw = stage_params("data/trace.swf")
    raw["scheduling"]["llm"]["threads"] = None  # the plan's, as training ran them (reports/train.json)
    params = parse_params(raw)

    generated = generate_workload.run(params)
    second = generated["second_workload"]
    assert second["max_procs"] == 32 and second["jobs"] == 200
    assert second["offered_load"] == pytest.approx(1.2, rel=0.01)
    assert generated["user_workload"]["jobs"] == 400 and generated["user_workload"]["users"]["count"] > 1
    for report in generated.values():  # both have users' estimates, never below the run
        assert report["estimates"]["run_over_estimate_jobs"] == 0 and report["estimates"]["mean_accuracy"] < 1

    baselines = simulate_baselines.run(params)
    for report in (baselines, baselines["user_workload"], baselines["second_workload"]):
        assert set(report["policies"]) == set(BASELINES) and set(report["teacher"]) == set(MODES)
    assert baselines["second_workload"]["max_procs"] == 32
    table = (tmp_path / "reports/baselines.md").read_text()
    assert "| F1-pred |" in table and "CPU: " in table

    # The untuned base model in its own stage: the plan's precision, read, never decided (no plan: it stops, saying
    # what to run); scheduling.llm.threads set: its threads
    from frugaltune.planner.assembly import PlanError
    from frugaltune.planner.machine import decide_machine

    with pytest.raises(PlanError, match="dvc repro"):
        evaluate_base.run(parse_params(stage_params("data/trace.swf")))
    (tmp_path / "reports/plan.json").write_text(json.dumps({"machine": decide_machine({}, None, "auto", methods=())}))
    base = evaluate_base.run(parse_params(stage_params("data/trace.swf")))
    assert base["evaluated"] and base["threads"] == 1 and base["precision"] in ("fp32", "bf16")
    assert set(base["workloads"]) == {"user_workload", "second_workload", "trace"}
    for name, w in base["workloads"].items():
        for mode in MODES:
            assert 0 < w[mode]["model_calls"] <= w[mode]["decisions"] and w[mode]["avg_bsld"] >= 1
            assert base["queue_cdf"][name][mode][1][-1] == pytest.approx(1.0)
    # evaluate_policy reads the base model's numbers from that report, never judging it again
    stored = json.loads((tmp_path / "reports/evaluate_base.json").read_text())
    stored["workloads"]["second_workload"]["easy"]["avg_bsld"] = 12345.0
    (tmp_path / "reports/evaluate_base.json").write_text(json.dumps(stored))

    # No adapter here: the F1 fallback stands in under its own name
    report = evaluate_policy.run(params)
    assert "finetuned" not in report and report["fallback"]["avg_bsld"] >= 1 and report["targets"] == {}
    assert report["threads"] == 1  # the fine-tuned policy chooses on the threads the train stage read from the plan
    assert report["workload"] == "user_workload" and set(report["heuristics"]) == set(BASELINES)
    assert report["baseline"]["avg_bsld"] == base["workloads"]["user_workload"]["no_backfill"]["avg_bsld"]
    assert report["workloads"]["second_workload"]["easy"]["base"]["avg_bsld"] == 12345.0
    assert list(report["workloads"]) == ["user_workload", "second_workload", "trace"]
    for name in ("user_workload", "second_workload", "trace"):
        for mode in MODES:
            rows = report["workloads"][name][mode]
            assert list(rows) == [*BASELINES, "fallback", "base", "teacher"]
            assert rows["teacher"]["avg_bsld"] >= 1
            assert 0 <= rows["base"]["departures"]["departure_share"] <= 1
    metrics = json.loads((tmp_path / "reports/metrics/evaluate.json").read_text())
    assert all(isinstance(v, (int, float)) for v in metrics.values())
    assert {"fallback.avg_bsld", "trace.easy.base.avg_bsld", "second_workload.no_backfill.teacher.avg_bsld",
            "user_workload.no_backfill.base.departure_share", "user_workload.easy.F1-pred.avg_bsld"} <= set(metrics)
    assert metrics["trace.no_backfill.teacher.avg_bsld"] == baselines["teacher"]["no_backfill"]["avg_bsld_mean"]
    assert metrics["user_workload.easy.teacher.avg_bsld"] == \
        baselines["user_workload"]["teacher"]["easy"]["avg_bsld_mean"]
    # The queue-length CDF of the estimate-and-user workload, every policy and the base model drawn
    cdf = (tmp_path / "reports/plots/evaluate_policy_queue_cdf.csv").read_text().splitlines()
    assert cdf[0] == ",".join(["queue_length", *BASELINES, "fallback", "base"]) and cdf[-1].endswith(",1.000000")

    # A base report judged on other sequences is refused, naming its stage; one not evaluated leaves its rows out
    stored["workloads"]["user_workload"]["sequences"] = 3
    (tmp_path / "reports/evaluate_base.json").write_text(json.dumps(stored))
    with pytest.raises(ValueError, match="dvc repro scheduling/dvc.yaml:evaluate_base"):
        evaluate_policy.run(params)
    skipped = parse_params({**raw, "scheduling": {**raw["scheduling"], "llm": {"evaluate_base": False}}})
    assert evaluate_base.run(skipped) == {"evaluated": False, "why": "scheduling.llm.evaluate_base is false"}
    report = evaluate_policy.run(params)
    assert "baseline" not in report and "base" not in report["workloads"]["trace"]["easy"]
