"""The HPC scheduling library (frugaltune/scheduling): SWF reader, simulator, policies, backfilling, metrics.

Run with `pytest tests/unit/test_scheduling.py` (a few seconds; part of `make test-fast`). Expected schedules are
worked out by hand in the comments next to them.
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest

from frugaltune.scheduling import (
    F1,
    FCFS,
    HEURISTICS,
    RunningJob,
    SJF,
    UNICEF,
    WFP3,
    SchedulerState,
    SWFError,
    bounded_slowdown,
    queue_length_cdf,
    read_swf,
    sequence_metrics,
    simulate,
    synthetic_workload,
)
from frugaltune.scheduling.evaluation import Protocol, evaluate, held_out_start, sequence_starts, summary_table
from frugaltune.scheduling.metrics import mean_queue_length, utilisation
from frugaltune.scheduling.policies import f1_score, unicef_score, wfp3_score
from frugaltune.scheduling.swf import workload_from_rows

LUBLIN = Path(__file__).resolve().parents[2] / "scheduling" / "data" / "lublin_256.swf"  # the repository's copy


def swf_line(job_id, submit, run, alloc, req_procs=-1, req_time=-1, wait=-1) -> str:
    fields = [job_id, submit, wait, run, alloc, -1, -1, req_procs, req_time, -1, 1, 3, 1, -1, 0, -1, -1, -1]
    return " ".join(str(v) for v in fields)


def write(tmp_path: Path, text: str, name: str = "trace.swf") -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


# ---------------------------------------------------------------------------------------------------- SWF reader

def test_reader_parses_the_header_and_tolerates_published_formatting(tmp_path):
    # As the archive publishes them: header comments, free-text notes, trailing spaces, blank lines, \r\n.
    text = ("; Version: 2.2\r\n; Computer: Test Cluster\r\n; MaxNodes: 64\r\n; MaxProcs: 128\r\n"
            ";   a free-text note: with a colon\r\n;\r\n\r\n"
            + swf_line(1, 0, 100, 8, 8, 200) + "   \r\n\r\n"
            + swf_line(2, 5, 50, 16, 16, 60) + "\r\n")
    workload = read_swf(write(tmp_path, text))
    assert workload.max_procs == 128 and workload.max_nodes == 64  # MaxProcs wins over MaxNodes
    assert workload.header["Computer"] == "Test Cluster" and workload.header["Version"] == "2.2"
    assert "a free-text note: with a colon" in workload.comments
    assert [(j.job_id, j.submit_time, j.run_time, j.requested_procs, j.requested_time) for j in workload.jobs] == \
        [(1, 0, 100, 8, 200), (2, 5, 50, 16, 60)]
    assert list(workload.to_frame().columns)[:5] == ["job_id", "submit_time", "wait_time", "run_time",
                                                     "allocated_procs"]


def test_reader_falls_back_to_allocated_processors_and_run_time_and_counts_skips(tmp_path):
    text = ("; MaxNodes: 32\n"                      # no MaxProcs: the machine is MaxNodes processors
            + swf_line(1, 0, 100, 4) + "\n"         # requested procs and time unknown
            + swf_line(2, 1, -1, 4) + "\n"          # run time unknown: skipped
            + swf_line(3, 2, 30, -1, -1, 40) + "\n"  # processors unknown either way: skipped
            + swf_line(4, 3, 0, 2, 2, -1) + "\n")   # a zero-second job is kept
    workload = read_swf(write(tmp_path, text))
    assert workload.max_procs == 32
    first, zero = workload.jobs
    assert (first.requested_procs, first.requested_time, first.allocated_procs) == (4, 100, 4)
    assert (zero.job_id, zero.run_time, zero.requested_time) == (4, 0, 0)
    assert workload.skipped == {"run time unknown (-1)": 1,
                                "processors unknown (requested and allocated <= 0)": 1}


@pytest.mark.parametrize("bad_line, message", [
    ("1 0 -1 100 4 -1 -1", "7 fields, expected 18"),
    (swf_line(1, 0, "abc", 4), "field 4 (run_time) is 'abc', not a number"),
    (swf_line(1, 0, -5, 4), "negative run time -5"),
    (swf_line(1, 0, 100, 4, 65), "job 1 asks for 65 processors but the machine has 64"),
])
def test_reader_errors_name_the_file_and_line(tmp_path, bad_line, message):
    text = "; MaxProcs: 64\n" + swf_line(7, 0, 10, 1) + "\n\n" + bad_line + "\n"
    path = write(tmp_path, text)
    with pytest.raises(SWFError) as error:
        read_swf(path)
    assert f"{path}:4:" in str(error.value) and message in str(error.value)


def test_reader_skips_too_wide_jobs_only_when_asked(tmp_path):
    path = write(tmp_path, "; MaxProcs: 64\n" + swf_line(1, 0, 10, 1) + "\n" + swf_line(2, 1, 10, 128) + "\n")
    workload = read_swf(path, too_wide="skip")
    assert [j.job_id for j in workload.jobs] == [1]
    assert workload.skipped == {"wider than the machine (64 processors)": 1}
    assert read_swf(path, max_procs=128).max_procs == 128  # the argument overrides the header


@pytest.mark.parametrize("text, message", [
    ("", "the trace is empty"),
    ("; MaxProcs: 64\n; Note: nothing here\n\n", "has header lines but no job lines"),
    (swf_line(1, 0, 10, 1) + "\n", "no `; MaxProcs:` or `; MaxNodes:` header"),
    ("; MaxProcs: 64\n" + swf_line(1, 0, -1, 1) + "\n", "none of the 1 job lines is usable"),
])
def test_reader_rejects_traces_without_usable_jobs(tmp_path, text, message):
    path = write(tmp_path, text)
    with pytest.raises(SWFError, match=message) as error:
        read_swf(path)
    assert str(path) in str(error.value)


def test_reader_reads_the_lublin_trace():
    workload = read_swf(LUBLIN)
    assert (len(workload), workload.max_procs, workload.skipped) == (10000, 256, {})
    first = workload.jobs[0]
    # "1    5094 -1   12072  16 -1 -1 -1 -1 ...": requested procs/time unknown -> allocated procs / run time
    assert (first.job_id, first.submit_time, first.run_time, first.requested_procs, first.requested_time) == \
        (1, 5094, 12072, 16, 12072)


# ------------------------------------------------------------------------------------------------------ policies

O = 100_000  # F1's 870*log10(s) term grows ~0.004 per second here, so procs*log10(r) decides, as intended
T = O + 100  # when the blocker J1 ends


def policy_trace(j5_procs: int):
    """P=4. J1 fills the machine until T; J2 arrives alone at O+10, so every policy commits to it and it runs
    T..T+10. J3, J4, J5 arrive while J2 is committed; the first real choice among them is made at T (right after
    J2 starts), with waits 80, 70, 60."""
    return workload_from_rows([
        (1, O, 100, 4, 100),
        (2, O + 10, 10, 4, 10),
        (3, O + 20, 60, 4, 60),
        (4, O + 30, 20, 4, 20),
        (5, O + 40, 40, j5_procs, 40),
    ], max_procs=4)


# Hand-computed schedules (job id -> start). Trace A has J5 on 2 processors, trace B on 1.
EXPECTED = {
    # In arrival order: J3 at T+10 (ends T+70); J4 needs the whole machine: T+70..T+90; J5 then, T+90.
    ("FCFS", 2): {3: T + 10, 4: T + 70, 5: T + 90},
    # At T, shortest request J4 (20): T+10..T+30. At T+10, J5 (40) before J3 (60): J5 on 2 procs T+30..T+70;
    # J3 needs 4, so it waits for J5: T+70.
    ("SJF", 2): {4: T + 10, 5: T + 30, 3: T + 70},
    # At T: J3 -(80/60)^3*4 = -9.48, J4 -(70/20)^3*4 = -171.5, J5 -(60/40)^3*2 = -6.75 -> J4, T+10..T+30.
    # At T+10: J3 -(90/60)^3*4 = -13.5, J5 -(70/40)^3*2 = -10.72 -> J3, T+30..T+90; then J5 at T+90.
    ("WFP3", 2): {4: T + 10, 3: T + 30, 5: T + 90},
    # procs*log10(r): J3 4*1.778 = 7.11, J4 4*1.301 = 5.20, J5 2*1.602 = 3.20 (+ submit terms 0.08, 0.11,
    # 0.15) -> J5 on 2 procs T+10..T+50; then J4 (5.3 < 7.2) waits for the whole machine: T+50..T+70; J3 T+70.
    ("F1", 2): {5: T + 10, 4: T + 50, 3: T + 70},
    # J5 on one processor: log2(1) ~ 0, so it scores ~ -1e15 and goes first: T+10..T+50. At T+10:
    # J3 -90/(2*60) = -0.75, J4 -80/(2*20) = -2 -> J4 waits for the whole machine: T+50..T+70; J3 at T+70.
    ("UNICEF", 1): {5: T + 10, 4: T + 50, 3: T + 70},
    # The same trace under SJF shows UNICEF's choice is its own: J4 T+10..T+30, J5 T+30..T+70, J3 T+70.
    ("SJF", 1): {4: T + 10, 5: T + 30, 3: T + 70},
}


@pytest.mark.parametrize("name, j5_procs", list(EXPECTED))
def test_each_policy_gives_the_hand_computed_schedule(name, j5_procs):
    workload = policy_trace(j5_procs)
    result = simulate(workload.jobs, workload.max_procs, HEURISTICS[name])
    assert result.schedule() == {1: O, 2: T, **EXPECTED[(name, j5_procs)]}
    assert result.decisions == 5 and result.backfilled == 0


def test_score_functions_match_the_published_formulas():
    job = workload_from_rows([(1, 1000, 50, 8, 100)], max_procs=8).jobs[0]
    clock = 1300  # waited 300 s
    assert wfp3_score(job, clock) == pytest.approx(-((300 / 100) ** 3) * 8)
    assert unicef_score(job, clock) == pytest.approx(-300 / (math.log2(8) * 100))
    assert f1_score(job, clock) == pytest.approx(math.log10(100) * 8 + 870 * math.log10(1000))
    assert (FCFS.score(job, clock), SJF.score(job, clock)) == (1000, 100)


def test_ties_go_to_the_earlier_submit_then_the_lower_id():
    jobs = workload_from_rows([(9, 0, 10, 1, 10), (3, 5, 10, 1, 10), (2, 5, 10, 1, 10)], max_procs=1).jobs
    state = SchedulerState(clock=5, total_procs=1, free_procs=0, queue=jobs, queue_length=3, running={})
    assert SJF.choose(state).job_id == 9
    assert SJF.choose(SchedulerState(5, 1, 0, jobs[1:], 2, {})).job_id == 2


class PickLast:
    """A policy of its own: read the state (the running jobs included), answer with one of the queue's jobs."""

    name = "last"

    def __init__(self):
        self.seen_running = []

    def choose(self, state: SchedulerState):
        self.seen_running.append([(r.job.job_id, r.expected_end) for r in state.running])
        return state.queue[-1]


def test_a_custom_policy_plugs_in_and_sees_the_running_jobs_with_expected_ends():
    # P=2. J1 (2 procs, run 5, requested 10) runs 0..5; J2 and J3 arrive at 1 and 2 but J2 is committed at 1
    # (the only waiting job); after J2 starts at 5 the policy picks J3 and sees J2 expected to end at 5+4 = 9.
    workload = workload_from_rows([(1, 0, 5, 2, 10), (2, 1, 3, 2, 4), (3, 2, 1, 1, 1)], max_procs=2)
    policy = PickLast()
    result = simulate(workload.jobs, 2, policy)
    assert result.schedule() == {1: 0, 2: 5, 3: 8}
    assert policy.seen_running == [[], [(1, 10)], [(2, 9)]]


def test_start_time_is_now_when_the_job_fits_else_when_the_running_jobs_give_back_enough():
    jobs = workload_from_rows([(1, 0, 5, 2, 10), (2, 0, 5, 1, 7), (3, 0, 1, 1, 1), (4, 0, 1, 2, 1), (5, 0, 1, 4, 1)],
                              max_procs=4).jobs
    running = {1: RunningJob(jobs[0], 0, 10), 2: RunningJob(jobs[1], 0, 7)}
    state = SchedulerState(clock=5, total_procs=4, free_procs=1, queue=jobs[2:], queue_length=3, running=running)
    assert [state.start_time(job) for job in jobs[2:]] == [5, 7, 10]
    # a run past its expected end is taken to end now, as EASY takes it
    late = SchedulerState(clock=12, total_procs=4, free_procs=1, queue=jobs[2:], queue_length=3, running=running)
    assert late.start_time(jobs[3]) == 12


def test_a_policy_that_answers_outside_the_visible_queue_is_an_error():
    class Outsider:
        name = "outsider"

        def choose(self, state):
            return workload_from_rows([(99, 0, 1, 1, 1)], max_procs=1).jobs[0]

    workload = workload_from_rows([(1, 0, 5, 1, 5)], max_procs=1)
    with pytest.raises(ValueError, match="not in the visible queue"):
        simulate(workload.jobs, 1, Outsider())


def test_the_window_limits_what_a_policy_sees():
    # P=1, J1 runs 0..100; J2..J4 wait. With window 1, SJF sees only the oldest waiting job, so it is FCFS.
    workload = workload_from_rows([(1, 0, 100, 1, 100), (2, 1, 50, 1, 50), (3, 2, 5, 1, 5),
                                   (4, 3, 1, 1, 1)], max_procs=1)
    assert simulate(workload.jobs, 1, SJF, window=1).schedule() == {1: 0, 2: 100, 3: 150, 4: 155}
    # J2 is committed at t=1 (alone in the queue); at 150 SJF with the full window picks J4 (1 s) before J3.
    assert simulate(workload.jobs, 1, SJF).schedule() == {1: 0, 2: 100, 4: 150, 3: 151}


# --------------------------------------------------------------------------------------------------- backfilling

@pytest.mark.parametrize("policy", list(HEURISTICS.values()), ids=list(HEURISTICS))
def test_easy_backfills_a_small_job_that_ends_before_the_reservation(policy):
    # P=4. J1 (2 procs) runs 0..100. J2 (4 procs) is committed at t=1 and reserved for t=100 (J1's expected end).
    # J3 (2 procs, requested 90) arrives at 2: 2 + 90 = 92 <= 100, so it backfills at 2 and J2 still starts at 100.
    workload = workload_from_rows([(1, 0, 100, 2, 100), (2, 1, 50, 4, 50), (3, 2, 90, 2, 90)], max_procs=4)
    plain = simulate(workload.jobs, 4, policy)
    easy = simulate(workload.jobs, 4, policy, backfill=True)
    assert plain.schedule() == {1: 0, 2: 100, 3: 150}
    assert easy.schedule() == {1: 0, 2: 100, 3: 2} and easy.backfilled == 1


def test_easy_does_not_backfill_a_job_that_would_delay_the_reservation():
    # As above, but J3 requests 150 s: 2 + 150 > 100 and no processor is spare at 100 (J2 takes all 4), so J3
    # waits, although it would actually finish in 50 s: EASY trusts the requested time, not the run time.
    workload = workload_from_rows([(1, 0, 100, 2, 100), (2, 1, 50, 4, 50), (3, 2, 50, 2, 150)], max_procs=4)
    easy = simulate(workload.jobs, 4, FCFS, backfill=True)
    assert easy.schedule() == {1: 0, 2: 100, 3: 150} and easy.backfilled == 0


def test_easy_backfills_a_long_job_on_the_processors_spare_at_the_reservation():
    # P=4. J1 (3 procs) runs 0..100; J2 (2 procs) is reserved at 100, when 4 - 2 = 2 processors are spare.
    # J3 (1 proc, requested 500) ends long after 100 but fits in the spare ones: it starts at 2, J2 still at 100.
    workload = workload_from_rows([(1, 0, 100, 3, 100), (2, 1, 50, 2, 50), (3, 2, 500, 1, 500)], max_procs=4)
    easy = simulate(workload.jobs, 4, FCFS, backfill=True)
    assert easy.schedule() == {1: 0, 2: 100, 3: 2} and easy.backfilled == 1


# ------------------------------------------------------------------------------------------------------- metrics

def test_bounded_slowdown_formula():
    # max((wait + run) / max(run, 10), 1)
    assert bounded_slowdown([0, 90, 100, 0], [5, 5, 100, 100]).tolist() == [1.0, 9.5, 2.0, 1.0]


def test_utilisation_and_time_weighted_queue_length():
    # P=1: J1 runs 0..10 while J2 waits; J2 runs 10..20. Queue: 1 job for 10 s, then 0 for 10 s.
    workload = workload_from_rows([(1, 0, 10, 1, 10), (2, 0, 10, 1, 10)], max_procs=1)
    result = simulate(workload.jobs, 1, FCFS)
    assert utilisation(result) == 1.0 and mean_queue_length(result) == 0.5
    values, fractions = queue_length_cdf([result])
    assert values.tolist() == [0, 1] and fractions.tolist() == [0.5, 1.0]
    metrics = sequence_metrics(result)
    assert (metrics.avg_bsld, metrics.mean_wait, metrics.makespan) == (1.5, 5.0, 20.0)  # bsld 1 and 20/10
    half = simulate(workload_from_rows([(1, 0, 100, 2, 100)], max_procs=4).jobs, 4, FCFS)
    assert utilisation(half) == 0.5


# ------------------------------------------------------------------------------- determinism, generator, protocol

def test_simulation_is_deterministic_and_independent_of_input_order():
    workload = synthetic_workload(400, max_procs=32, seed=3)
    first = simulate(workload.jobs, 32, WFP3, backfill=True)
    again = simulate(list(reversed(workload.jobs)), 32, WFP3, backfill=True)
    assert np.array_equal(first.start, again.start) and np.array_equal(first.job_ids, again.job_ids)
    assert not np.isnan(first.start).any() and (first.start >= first.submit).all()


def test_schedules_never_oversubscribe_the_machine():
    workload = synthetic_workload(300, max_procs=16, seed=5, mean_interarrival=20)
    for policy in (FCFS, UNICEF, F1):
        for backfill in (False, True):
            r = simulate(workload.jobs, 16, policy, backfill=backfill)
            events = sorted([(s, p) for s, p in zip(r.start, r.procs)] + [(e, -p) for e, p in zip(r.end, r.procs)],
                            key=lambda e: (e[0], e[1]))  # ends before starts at the same instant
            assert max(np.cumsum([p for _, p in events])) <= 16


def test_synthetic_workload_is_seeded_and_well_formed():
    a, b = synthetic_workload(200, max_procs=64, seed=1), synthetic_workload(200, max_procs=64, seed=1)
    fields = lambda w: [(j.submit_time, j.run_time, j.requested_procs, j.requested_time) for j in w.jobs]  # noqa
    assert fields(a) == fields(b) != fields(synthetic_workload(200, max_procs=64, seed=2))
    assert len(a) == 200 and a.max_procs == 64
    for job in a.jobs:
        assert 1 <= job.requested_procs <= 64 and job.requested_procs & (job.requested_procs - 1) == 0
        assert job.requested_time >= job.run_time >= 1 and job.requested_time % 60 == 0
    assert [j.submit_time for j in a.jobs] == sorted(j.submit_time for j in a.jobs)


def test_protocol_draws_seeded_sequences_inside_the_held_out_part():
    workload = synthetic_workload(1000, max_procs=32, seed=0)
    protocol = Protocol(sequence_length=50, n_sequences=3, held_out_fraction=0.3, seed=7)
    starts = sequence_starts(workload, protocol)
    assert held_out_start(workload, protocol) == 700
    assert ((starts >= 700) & (starts + 50 <= 1000)).all()
    assert np.array_equal(starts, sequence_starts(workload, protocol))
    frame, _ = evaluate(workload, [FCFS, SJF], protocol)
    assert len(frame) == 2 * 2 * 3 and set(frame["start_index"]) == set(starts.tolist())
    table = summary_table(frame)
    assert list(table.index) == ["FCFS", "SJF"]
    assert list(table.columns) == ["avg_bsld mean", "avg_bsld std", "avg_bsld mean +EASY", "avg_bsld std +EASY"]
    with pytest.raises(ValueError, match="fewer than sequence_length=500"):
        sequence_starts(workload, Protocol(sequence_length=500, held_out_fraction=0.3))


# ---------------------------------------------------------------------------------------------- stepping, cloning

def test_stepping_the_simulator_with_clones_gives_the_schedule_simulate_gives():
    # A clone taken at every decision and run to the end under the same policy must reproduce the original's
    # schedule exactly, and must not disturb the original (the lookahead teacher relies on both).
    from frugaltune.scheduling.simulator import Simulator

    workload = synthetic_workload(120, max_procs=32, seed=3, mean_interarrival=30.0)
    for backfill in (False, True):
        expected = simulate(workload.jobs, 32, SJF, backfill=backfill, window=8)
        sim = Simulator(workload.jobs, 32, backfill=backfill, window=8)
        checked = 0
        while (state := sim.next_decision()) is not None:
            if checked < 5 and len(state.queue) > 2:
                trial = sim.clone()
                trial.run_to_end(SJF)
                assert trial.result("SJF").schedule() == expected.schedule()
                checked += 1
            sim.commit(SJF.choose(state))
        got = sim.result("SJF")
        assert checked == 5
        assert got.schedule() == expected.schedule() and got.decisions == expected.decisions
        assert np.array_equal(got.queue_lengths, expected.queue_lengths)


def test_a_clone_over_a_given_future_schedules_it_and_the_true_future_reproduces_a_cut_clone():
    # A sampled-future teacher (the answered experiment `git show fbec6eb:benchmarks/teacher_learnability.py`) rolls
    # out over jobs that never arrive in the original: given the true next arrivals as the future, the clone must
    # schedule exactly as clone(h) does.
    import dataclasses

    from frugaltune.scheduling.simulator import Simulator

    workload = synthetic_workload(120, max_procs=32, seed=3, mean_interarrival=30.0)
    sim = Simulator(workload.jobs, 32, window=8)
    for _ in range(30):
        sim.commit(SJF.choose(sim.next_decision()))
    state = sim.next_decision()
    true_next = sim.arrivals[sim.next_arrival:sim.next_arrival + 16]
    cut, given = sim.clone(future_arrivals=16), sim.clone(future=true_next)
    cut.run_to_end(SJF)
    given.run_to_end(SJF)
    started = {job: t for job, t in cut.result("SJF").schedule().items() if not np.isnan(t)}  # the cut: never run
    assert len(started) == sim.next_arrival + 16  # every job known at the decision, and the 16 admitted
    assert given.result("SJF").schedule() == started
    imagined = [dataclasses.replace(job, job_id=1000 + i, submit_time=state.clock + 60.0 * i)
                for i, job in enumerate(workload.jobs[:5])]
    other = sim.clone(future=imagined)
    other.run_to_end(SJF)
    ids = set(other.result("SJF").schedule())
    assert {1000, 1001, 1002, 1003, 1004} <= ids and not ids & {j.job_id for j in true_next}
    assert sim.next_decision() is state  # the original is untouched
    with pytest.raises(ValueError, match="before the clock"):
        sim.clone(future=[dataclasses.replace(workload.jobs[0], submit_time=state.clock - 1)])


def test_commit_rejects_a_job_outside_the_visible_window():
    from frugaltune.scheduling.simulator import Simulator

    jobs = workload_from_rows([(1, 0, 100, 4, 100), (2, 0, 10, 4, 10), (3, 0, 10, 4, 10)], max_procs=4).jobs
    sim = Simulator(jobs, 4, window=2)
    state = sim.next_decision()
    assert [j.job_id for j in state.queue] == [1, 2]
    with pytest.raises(ValueError, match="not in the visible queue"):
        sim.commit(jobs[2])
