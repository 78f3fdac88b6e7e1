"""The LLM scheduling policy (frugaltune/scheduling/llm_policy.py) on a tiny random llama with the real SmolLM2
tokenizer: never an invalid job, the model skipped only for one-job windows, batched lockstep simulation, the
named fallback when the model cannot load.

Run with `pytest tests/unit/test_llm_policy.py` (about 10 s: a few hundred forwards of a 2-layer model).
"""

from __future__ import annotations

import pytest

from frugaltune.scheduling import SJF, simulate, synthetic_workload
from frugaltune.scheduling.llm_policy import LLMPolicy, load_llm_policy
from frugaltune.scheduling.policies import ScorePolicy
from frugaltune.scheduling.simulator import Simulator, simulate_batch

WINDOW = 5


@pytest.fixture(scope="module")
def workload():
    # Busy enough that most decisions see several jobs: arrivals every ~20 s on 16 processors.
    return synthetic_workload(90, max_procs=16, seed=2, mean_interarrival=20.0)


@pytest.fixture(scope="module")
def policy(tiny_model_dir):
    return load_llm_policy(tiny_model_dir, None, name="tiny", threads=1)


def test_the_base_model_loads_as_an_llm_policy_with_its_chat_template(policy):
    assert isinstance(policy, LLMPolicy) and policy.name == "tiny" and policy.templated


def test_every_answer_is_a_visible_job_and_only_one_job_windows_skip_the_model(workload, tiny_model_dir):
    policy = load_llm_policy(tiny_model_dir, None, threads=1)
    sim = Simulator(workload.jobs[:40], 16, window=WINDOW)
    decisions = multi = 0
    while (state := sim.next_decision()) is not None:
        job = policy.choose(state)
        assert any(job is visible for visible in state.queue)
        decisions += 1
        multi += len(state.queue) > 1
        sim.commit(job)
    assert multi > 5  # the test exercised the model, not only forced choices
    stats = policy.stats()
    assert stats["decisions"] == decisions and stats["model_calls"] == multi
    assert stats["decisions_per_s"] > 0 and stats["seconds"] > 0


def test_lockstep_batches_schedule_every_sequence_like_simulate(workload, policy):
    sequences = [workload.jobs[0:30], workload.jobs[30:60], workload.jobs[60:90]]
    # A heuristic has no choose_many: the batch driver asks it state by state; schedules must match exactly.
    for got, jobs in zip(simulate_batch(sequences, 16, SJF, window=WINDOW), sequences):
        assert got.schedule() == simulate(jobs, 16, SJF, window=WINDOW).schedule()
    before = policy.stats()["decisions"]
    results = simulate_batch(sequences, 16, policy, window=WINDOW)
    assert [r.policy for r in results] == ["tiny"] * 3
    assert all(len(r.schedule()) == 30 for r in results)  # every job ran: no invalid answer stopped a sequence
    assert policy.stats()["decisions"] - before == sum(r.decisions for r in results)


def test_a_model_that_cannot_load_gives_the_named_fallback(tmp_path, tiny_model_dir, capsys):
    missing = tmp_path / "no_adapter"
    policy = load_llm_policy(tiny_model_dir, missing, fallback="F1")
    assert isinstance(policy, ScorePolicy) and policy.name == "F1 (fallback: model not loaded)"
    assert "fallback heuristic F1" in capsys.readouterr().err
    with pytest.raises(FileNotFoundError, match="no_adapter"):
        load_llm_policy(tiny_model_dir, missing)
    with pytest.raises(ValueError, match="scheduling.llm.fallback"):
        load_llm_policy(tiny_model_dir, missing, fallback="LIFO")
