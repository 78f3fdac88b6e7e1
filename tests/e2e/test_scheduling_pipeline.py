"""End to end: the scheduling pipeline (scheduling/dvc.yaml) through `dvc repro` on a tiny random llama, a small
synthetic trace and small generated workloads with users, in a temp git+DVC project (the root pipeline's probe and
kernels run first: the plan reads their report); then a second `dvc repro` runs only the probes (always_changed,
byte-identical facts) and nothing after them.

Run with `make test` (or `pytest -m slow tests/e2e/test_scheduling_pipeline.py`); about a minute and a half on
2 cores: a synthetic 400-job trace, a 400-job estimate-and-user workload, window 4, 2 + 2 teacher episodes, 4
training steps, 2 test sequences of 32 jobs per workload (three workloads, both modes, two LLMs).
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import pandas as pd
import pytest
import yaml

from frugaltune.scheduling.synthetic import synthetic_workload, write_swf
from tests import tiny_project
from tests.e2e.test_pipeline import ran_stages

pytestmark = pytest.mark.slow
# `probe` twice (the root pipeline's and this one's) and the root's `kernels`: the plan reads the root's kernels report
STAGES = ["ingest_trace", "validate_trace", "generate_workload", "simulate_baselines", "build_sft", "import_model",
          "ingest", "validate", "tokenize", "probe", "probe", "kernels", "plan", "train", "evaluate_base",
          "evaluate_policy", "register"]


@pytest.fixture(scope="module")
def project(tmp_path_factory, tiny_model_dir) -> Path:
    repo = tiny_project.build(tmp_path_factory.mktemp("sched"), tiny_model_dir, calibrate=False)
    shutil.copytree(tiny_project.ROOT / "scheduling", repo / "scheduling",
                    # not what a local `make schedule` left there
                    ignore=shutil.ignore_patterns("data", "models", "reports", "*.db", "mlartifacts", "checkpoints",
                                                  "dvc.lock", ".gitignore"))
    # Busy enough that windows hold several jobs: 16 processors, a job every ~25 s.
    write_swf(synthetic_workload(400, max_procs=16, seed=0, mean_interarrival=25.0), repo / "traces/synthetic.swf")
    path = repo / "scheduling/params.yaml"
    params = yaml.safe_load(path.read_text())
    params["model"]["source"] = str(tiny_model_dir)
    params["train"].update({"max_steps": 4, "batch_size": 4, "log_every": 1, "threads": 1})
    params["tokenize"]["max_length"] = 256
    params["scheduling"].update({
        "trace": "../traces/synthetic.swf", "window": 4,
        "evaluation": {"sequence_length": 32, "n_sequences": 2, "held_out_fraction": 0.3, "seed": 0},
        "sft": {**params["scheduling"]["sft"], "episodes": 2, "episode_length": 60, "horizon": 16,
                "generated_episodes": 2, "generated_procs": [16, 32]},
        "llm": {**params["scheduling"]["llm"], "threads": 1},
        "user_workload": {"procs": 32, "jobs": 400, "load": 1.1, "seed": 8},
        "second_workload": {"procs": 32, "jobs": 300, "load": 1.2, "seed": 9, "n_sequences": 2,
                            "sequence_length": 32},
        "validate": {"min_jobs": 100, "max_overshoot_fraction": 0.5},
    })
    path.write_text(yaml.safe_dump(params, sort_keys=False))
    tiny_project.run(["git", "add", "-A"], repo)
    tiny_project.run(["git", "commit", "-qm", "scheduling"], repo)
    return repo


def test_scheduling_repro_builds_sft_trains_judges_registers_then_is_a_no_op(project: Path):
    first = tiny_project.run([sys.executable, "-m", "dvc", "repro", "scheduling/dvc.yaml"], project,
                             OMP_NUM_THREADS="1")
    assert sorted(ran_stages(first)) == sorted(STAGES), first
    out = project / "scheduling"
    reports = {name: json.loads((out / f"reports/{name}.json").read_text())
               for name in ("ingest_trace", "validate_trace", "simulate_baselines", "build_sft", "train",
                            "evaluate_base", "evaluate", "register")}
    assert reports["ingest_trace"]["jobs"] == 400 and reports["ingest_trace"]["max_procs"] == 16
    assert reports["validate_trace"]["failures"] == [] and len(reports["validate_trace"]["checks"]) == 7
    baselines = ["FCFS", "SJF", "WFP3", "UNICEF", "F1", "SJF-pred", "F1-pred"]
    for workload in (reports["simulate_baselines"], reports["simulate_baselines"]["user_workload"]):
        assert set(workload["policies"]) == set(baselines)
    assert (out / "reports/baselines.md").is_file()
    assert reports["simulate_baselines"]["jobs_per_s"] > 0

    rows = pd.read_json(out / "data/sft.jsonl", lines=True)
    assert len(rows) == reports["build_sft"]["rows"] > 10
    # agree_share (0.6 in the params file): rows answering "A" sampled down, every departure kept; the episodes
    # come from the estimate-and-user workload's training part and the generated workloads with users
    assert reports["build_sft"]["generated_episodes"] == 2 and set(reports["build_sft"]["avg_bsld_by_source"]) == {
        "workload", "generated"}
    waiting = [line.split() for prompt in rows["prompt"] for line in prompt.splitlines()[4:]]
    assert all(len(fields) == 6 for fields in waiting) and any(fields[5] != "-" for fields in waiting)
    assert (rows["response"] != "A").sum() == reports["build_sft"]["departures"] > 0
    assert reports["build_sft"]["rows_departure_share"] >= 0.4 - 1e-9
    assert all(r in c and 2 <= len(c) <= 4 for r, c in zip(rows["response"], rows["candidates"]))
    assert reports["train"]["steps"] == 4
    # Training and the policies run in the precision the plan resolved from this machine's measurements
    plan = json.loads((out / "reports/plan.json").read_text())["run"]
    assert plan["precision"] in ("fp32", "bf16")
    assert reports["train"]["bf16"] == (plan["precision"] == "bf16")
    assert reports["train"]["micro_batch_size"] == plan["micro_batch_size"]

    evaluation = reports["evaluate"]
    assert evaluation["precision"] == plan["precision"]
    # The base model's stage runs in the plan's precision, read from the two keys of its report it depends on
    assert reports["evaluate_base"]["evaluated"] and reports["evaluate_base"]["precision"] == plan["precision"]
    assert evaluation["finetuned_policy"] == "finetuned"  # the adapter loaded: no fallback
    assert evaluation["workload"] == "user_workload"
    for name in ("finetuned", "baseline"):
        assert len(evaluation[name]["per_sequence_avg_bsld"]) == 2 and evaluation[name]["avg_bsld"] >= 1
        assert 0 < evaluation[name]["model_calls"] <= evaluation[name]["decisions"] == 64  # one per job
        assert evaluation[name]["decisions_per_s"] > 0
    # Every policy, the teacher's ceiling beside them, on the three workloads and in both modes
    assert list(evaluation["workloads"]) == ["user_workload", "second_workload", "trace"]
    for workload in ("user_workload", "second_workload", "trace"):
        for mode in ("no_backfill", "easy"):
            rows = evaluation["workloads"][workload][mode]
            assert list(rows) == [*baselines, "finetuned", "base", "teacher"]
            assert 0 <= rows["finetuned"]["departures"]["departure_share"] <= 1
            assert rows["base"]["avg_bsld"] == reports["evaluate_base"]["workloads"][workload][mode]["avg_bsld"]
            assert evaluation["targets"][workload][mode]["finetuned_vs_F1-pred"] == pytest.approx(
                rows["finetuned"]["avg_bsld"] / rows["F1-pred"]["avg_bsld"])
    assert evaluation["workloads"]["second_workload"]["max_procs"] == 32
    assert evaluation["workloads"]["user_workload"]["max_procs"] == 32
    cdf = pd.read_csv(out / "reports/plots/evaluate_policy_queue_cdf.csv")
    assert list(cdf.columns) == ["queue_length", *baselines, "finetuned", "base"]
    assert (cdf.iloc[-1, 1:] == 1.0).all()
    for figure in ("queue_length_cdf.png", "policy_bsld.png", "baselines_bsld.png"):
        assert (out / "reports/figures" / figure).stat().st_size > 1000
    assert reports["register"]["metric"] == "avg_bsld" and reports["register"]["version"] == 1
    assert reports["register"]["metric_value"] == pytest.approx(evaluation["finetuned"]["avg_bsld"])

    # The registered champion schedules, loaded from the registry in a fresh process
    served = tiny_project.run([sys.executable, "-c", (
        "from frugaltune.scheduling import simulate, synthetic_workload\n"
        "from frugaltune.scheduling.llm_policy import load_registered_llm_policy\n"
        "p = load_registered_llm_policy('models:/frugaltune-scheduler@champion', name='champion')\n"
        "r = simulate(synthetic_workload(20, 16, seed=5, mean_interarrival=5.0).jobs, 16, p, window=4)\n"
        "print(p.name, r.decisions, p.stats()['model_calls'])")], out, PYTHONPATH="..")
    name, decisions, calls = served.strip().splitlines()[-1].split()
    assert name == "champion" and int(decisions) == 20 and int(calls) > 0

    # As in the root pipeline: only the probes run (always_changed, the root's and this one's), their facts are
    # byte-identical, nothing reruns: the kernels stage measured this machine once.
    second = tiny_project.run([sys.executable, "-m", "dvc", "repro", "scheduling/dvc.yaml"], project)
    assert ran_stages(second) == ["probe", "probe"], second
