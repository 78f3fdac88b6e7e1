"""Users and runtime estimates (frugaltune/scheduling/users.py), what policies may see (simulator.JobView and the
users' histories), and the baselines on Tsafrir's predictions with EASY (policies.SJF_PRED, F1_PRED).

Run with `pytest tests/unit/test_scheduling_users.py` (a few seconds: small generated workloads).
"""

from __future__ import annotations

import numpy as np
import pytest

from frugaltune.config import SchedulingUsersParams
from frugaltune.scheduling.lublin import lublin_workload
from frugaltune.scheduling.policies import BASELINES, F1, F1_PRED
from frugaltune.scheduling.settings import user_model
from frugaltune.scheduling.sft import encode_state, listed, user_accuracy
from frugaltune.scheduling.simulator import Simulator, simulate
from frugaltune.scheduling.state import Finished
from frugaltune.scheduling.swf import Job, read_swf, workload_from_rows
from frugaltune.scheduling.synthetic import write_swf
from frugaltune.scheduling.users import ROUND_MINUTES, UserModel, with_users


@pytest.fixture(scope="module")
def users_workload():
    return with_users(lublin_workload(3000, 128, seed=5), UserModel(users=32), seed=5)


def test_estimates_are_round_values_never_below_the_run_and_users_differ(users_workload, tmp_path):
    jobs = users_workload.jobs
    runs = np.array([j.run_time for j in jobs], dtype=float)
    requested = np.array([j.requested_time for j in jobs], dtype=float)
    users = np.array([j.user_id for j in jobs])
    assert (runs <= requested).all()
    assert set(requested / 60) <= set(ROUND_MINUTES)
    assert (requested == ROUND_MINUTES[-1] * 60).mean() > 0.02      # the maximum is a popular value
    assert (runs / requested).mean() < 0.6                          # users overestimate
    # A Zipf-like activity: the busiest user submits far more than the median one
    counts = np.bincount(users)[1:]
    assert counts.max() > 4 * np.median(counts[counts > 0])
    # Per-user accuracy: the users' mean accuracies spread out, and their job shapes differ
    busy = [u for u in range(1, 33) if (users == u).sum() >= 30]
    accuracy = [float((runs[users == u] / requested[users == u]).mean()) for u in busy]
    log_runs = [float(np.log1p(runs[users == u]).mean()) for u in busy]
    assert np.std(accuracy) > 0.05 and np.std(log_runs) > 0.5
    assert {j.group_id for j in jobs} == {u % 8 + 1 for u in range(32) if (users == u + 1).any()}
    # The Lublin jobs themselves are unchanged, and the same seed gives the same workload
    plain = lublin_workload(3000, 128, seed=5).jobs
    assert [(j.submit_time, j.requested_procs, j.run_time) for j in plain] == \
        [(j.submit_time, j.requested_procs, j.run_time) for j in jobs]
    again = with_users(lublin_workload(3000, 128, seed=5), UserModel(users=32), seed=5).jobs
    assert [(j.user_id, j.requested_time) for j in again] == [(j.user_id, j.requested_time) for j in jobs]
    # An SWF file keeps them: requested time (field 9), user (12) and group (13)
    back = read_swf(write_swf(users_workload, tmp_path / "users.swf")).jobs
    assert [(j.requested_time, j.user_id, j.group_id) for j in back] == \
        [(j.requested_time, j.user_id, j.group_id) for j in jobs]


def test_the_params_defaults_are_the_models_and_bad_parameters_are_named():
    assert user_model(SchedulingUsersParams()) == UserModel()
    with pytest.raises(ValueError, match="round_minutes"):
        UserModel(round_minutes=(5, 1))


def test_no_policy_and_no_prompt_can_read_a_waiting_or_running_jobs_run_time(users_workload):
    sim = Simulator(users_workload.jobs[:300], users_workload.max_procs, window=8)
    seen = histories = 0
    fields: list[list[str]] = []
    while (state := sim.next_decision()) is not None:
        shown = list(state.queue) + [r.job for r in state.running]
        assert not any(hasattr(job, "run_time") for job in shown)
        if len(state.queue) > 1 and seen < 40:
            seen += 1
            histories += any(state.history(job) for job in state.queue)
            for policy in BASELINES.values():  # reading job.run_time would raise AttributeError here
                assert any(policy.choose(state) is job for job in state.queue)
            for order in ("queue", "F1", "SJF"):
                text = encode_state(state, max_running=4, order=order)  # so would the prompt's, new fields included
                assert {id(j) for j in listed(state, order)} == {id(j) for j in state.queue}
            fields += [line.split() for line in text.splitlines()[4:]]
        sim.commit(F1.choose(state))
    assert seen == 40 and histories > 0
    # The prompts' user fields were exercised: predictions from histories (below the estimate) and accuracies
    assert all(len(f) == 6 for f in fields)
    assert any(int(f[4]) < int(f[2]) for f in fields) and any(f[5].isdigit() for f in fields)


def test_the_prompt_shows_each_jobs_user_prediction_and_accuracy_from_finished_jobs_only():
    # As in the prediction test below: user 1 finished runs of 100, 300 and 500 s, each of 1000 s requested
    # (accuracies 0.1, 0.3, 0.5: median 0.3); job 4 (user 1) still runs and is not in the history.
    jobs = rows((1, 0, 100, 1, 1000, 1), (2, 200, 300, 1, 1000, 1), (3, 600, 500, 1, 1000, 1),
                (4, 1200, 9000, 1, 9000, 1), (5, 1300, 10, 4, 1000, 1), (6, 1300, 10, 4, 350, 1),
                (7, 1300, 10, 4, 1000, 2), (8, 1300, 10, 4, 1000, -1))
    sim = Simulator(jobs, 4, window=8)
    while (state := sim.next_decision()) is not None and len(state.queue) < 4:
        sim.commit(state.queue[0])
    assert state is not None and state.clock == 1300
    assert encode_state(state).splitlines()[2:] == [
        "running (min left x procs): 149x1",                 # job 4: expected end 1200 + 9000 s
        "waiting (letter procs requested_min waited_min predicted_min user_accuracy):",
        "A 4 17 0 7 3",    # job 5: 1000 s asked (17 min); predicted (300 + 500) / 2 = 400 s (7 min); median 0.3
        "B 4 6 0 6 3",     # job 6: the prediction capped by its 350 s estimate
        "C 4 17 0 17 -",   # job 7: user 2 has finished nothing: the estimate, no accuracy
        "D 4 17 0 17 -",   # job 8: no user
    ]
    assert user_accuracy([Finished(150, 100, 1)]) == "9"     # a run past its request (real logs): at most 9
    assert user_accuracy([Finished(5, 100, 1), Finished(95, 100, 1)]) == "5" and user_accuracy(()) == "-"


def rows(*jobs: tuple) -> list[Job]:
    """(id, submit, run, procs, requested, user) -> jobs."""
    import dataclasses

    base = workload_from_rows([j[:5] for j in jobs], max_procs=4).jobs
    users = {j[0]: j[5] for j in jobs}
    return [dataclasses.replace(job, user_id=users[job.job_id]) for job in base]


def test_the_prediction_is_the_mean_of_the_users_last_two_finished_runs_capped_by_the_estimate():
    # User 1 finishes runs of 100, 300 and 500 s; job 5 (user 1) is decided while job 4 (user 1) still runs.
    jobs = rows((1, 0, 100, 1, 1000, 1), (2, 200, 300, 1, 1000, 1), (3, 600, 500, 1, 1000, 1),
                (4, 1200, 9000, 1, 9000, 1), (5, 1300, 10, 4, 1000, 1), (6, 1300, 10, 4, 350, 1),
                (7, 1300, 10, 4, 1000, 2), (8, 1300, 10, 4, 1000, -1))
    sim = Simulator(jobs, 4, window=8)
    while (state := sim.next_decision()) is not None:
        if len(state.queue) == 4:
            by_id = {job.job_id: job for job in state.queue}
            assert [f.run_time for f in state.history(by_id[5])] == [100, 300, 500]
            assert state.predicted_time(by_id[5]) == 400       # (300 + 500) / 2; job 4 has not finished
            assert state.predicted_time(by_id[6]) == 350       # capped by the estimate
            assert state.predicted_time(by_id[7]) == 1000      # no history: the estimate
            assert state.predicted_time(by_id[8]) == 1000      # user unknown
            assert state.history(by_id[5])[0].accuracy == pytest.approx(0.1)
            break
        sim.commit(state.queue[0])
    else:
        pytest.fail("no decision with the four jobs waiting")


def test_easy_on_predictions_backfills_by_the_prediction_and_kills_a_backfilled_job_at_its_estimate():
    # P = 4. User 1's first job ran 10 s. Job 3 (4 procs) waits for job 2 (ends at 120). Job 4 (user 1, 1 proc,
    # estimate 1000 s) arrives at 30: on its estimate it would delay job 3, on its prediction (10 s) it fits.
    def jobs(run4: int) -> list[Job]:
        return rows((1, 0, 10, 1, 1000, 1), (2, 20, 100, 3, 100, 2), (3, 25, 10, 4, 10, 3),
                    (4, 30, run4, 1, 1000, 1))

    on_estimates = simulate(jobs(50), 4, F1, backfill=True)
    assert on_estimates.schedule() == {1: 0, 2: 20, 3: 120, 4: 130} and on_estimates.backfilled == 0
    on_predictions = simulate(jobs(50), 4, F1_PRED, backfill=True)
    assert on_predictions.schedule() == {1: 0, 2: 20, 3: 120, 4: 30} and on_predictions.backfilled == 1
    # A run past its estimate (as in real logs): backfilled, it is killed at the estimate, and the reservation,
    # its prediction past, waits for that estimate; not backfilled, it runs in full
    killed = simulate(jobs(2000), 4, F1_PRED, backfill=True)
    assert killed.schedule()[3] == 1030 and killed.run[3] == 1000 and killed.end[3] == 1030
    assert simulate(jobs(2000), 4, F1, backfill=True).run[3] == 2000
