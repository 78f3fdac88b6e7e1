"""Scheduling decisions as SFT pairs (frugaltune/scheduling/sft.py): prompt encoding, lookahead teacher, builder.

Run with `pytest tests/unit/test_scheduling_sft.py` (a few seconds). Expected schedules are worked out by hand in
the comments next to them.
"""

from __future__ import annotations

import pytest

from frugaltune.scheduling import FCFS, SJF, simulate, synthetic_workload
from frugaltune.scheduling.evaluation import Protocol, held_out_start
from frugaltune.scheduling.sft import (
    LookaheadTeacher,
    SftConfig,
    build_sft,
    encode_state,
    episode_starts,
    generated_episodes,
    job_labels,
    listed,
    teacher_episode,
)
from frugaltune.scheduling.simulator import Simulator
from frugaltune.scheduling.swf import workload_from_rows


def test_a_decision_is_encoded_in_minutes_with_lettered_jobs():
    # 8 processors. t=0: job 1 (4 procs, 1 h requested) starts, job 2 (8 procs) is committed and waits for it;
    # jobs 3 and 4 arrive at t=120 and 130. At t=3000 job 1 ends, job 2 starts, and 3 and 4 are the decision.
    rows = [(1, 0, 3000, 4, 3600), (2, 0, 100, 8, 120), (3, 120, 50, 2, 61), (4, 130, 10, 1, 60)]
    sim = Simulator(workload_from_rows(rows, max_procs=8).jobs, 8, window=2)
    state = sim.next_decision()            # t=0: jobs 1 and 2 visible
    sim.commit(state.queue[0])             # job 1 starts; 4 procs left
    state = sim.next_decision()            # t=0: job 2 alone
    sim.commit(state.queue[0])             # job 2 (8 procs) committed: waits for job 1
    state = sim.next_decision()            # t=3000: job 1 ended, job 2 starts... then 3 and 4 wait
    assert state.clock == 3000 and [j.job_id for j in state.queue] == [3, 4] and state.queue_length == 2
    text = encode_state(state)
    assert text.splitlines() == [
        "Pick the job to run next. Answer with its letter.",
        "machine 8 procs, 0 free, 2 waiting, time 00:50",
        "running (min left x procs): 2x8",         # job 2: expected end 3000 + 120 s -> 2 min from now
        "waiting (letter procs requested_min waited_min predicted_min user_accuracy):",
        "A 2 2 48 2 -",     # 61 s requested rounds up to 2 min; waited 2880 s = 48 min; no user: the estimate, "-"
        "B 1 1 47 1 -",
    ]


def test_running_jobs_beyond_the_limit_are_summarised():
    rows = [(i, 0, 1000 + i, 1, 1000 + i) for i in range(1, 6)] + [(6, 1, 10, 5, 10), (7, 1, 10, 5, 10)]
    sim = Simulator(workload_from_rows(rows, max_procs=5).jobs, 5, window=8)
    while True:
        state = sim.next_decision()
        if state.clock >= 1:
            break
        sim.commit(state.queue[0])
    assert "running (min left x procs): 17x1 17x1 +3 more" in encode_state(state, max_running=2)


def test_in_sjf_order_a_is_sjfs_choice_and_the_teacher_answers_in_that_lettering():
    # The job of the first test above, where SJF would pick job 4 (1 min requested) over job 3 (2 min).
    rows = [(1, 0, 3000, 4, 3600), (2, 0, 100, 8, 120), (3, 120, 50, 2, 61), (4, 130, 10, 1, 60)]
    sim = Simulator(workload_from_rows(rows, max_procs=8).jobs, 8, window=2)
    for _ in range(2):
        sim.commit(sim.next_decision().queue[0])
    state = sim.next_decision()
    assert [j.job_id for j in listed(state, "SJF")] == [4, 3] and listed(state, "queue") == list(state.queue)
    assert encode_state(state, order="SJF").splitlines()[-2:] == ["A 1 1 47 1 -", "B 2 2 48 2 -"]
    with pytest.raises(ValueError, match="scheduling.order"):
        listed(state, "LIFO")
    # The teacher of the FCFS-beating case picks job 2 (the short one): "B" in queue order, "A" in SJF order.
    jobs = workload_from_rows([(1, 0, 1000, 4, 1000), (2, 0, 10, 1, 10)], max_procs=4).jobs
    for order, answer, long_line in (("queue", "B", "A 4 17 0 17 -"), ("SJF", "A", "B 4 17 0 17 -")):
        _, episode = teacher_episode(jobs, 4, LookaheadTeacher([FCFS], horizon=8), window=4, order=order)
        assert [r["response"] for r in episode] == [answer]
        assert long_line in episode[0]["prompt"].splitlines()  # the 1000 s job on 4 processors


def test_labels_are_letters_and_a_window_beyond_z_is_refused():
    assert job_labels(3) == ["A", "B", "C"]
    with pytest.raises(ValueError, match="at most 26"):
        job_labels(27)


def test_lookahead_beats_fcfs_where_a_short_job_waits_behind_a_long_one():
    # 4 processors, both jobs at t=0: job 1 is 1000 s on all 4, job 2 is 10 s on 1.
    # FCFS: job 1 at 0, job 2 at 1000 -> bsld (1 + 1010/10) / 2 = 51.
    # Lookahead (FCFS rollouts): job 2 first -> job 2 at 0, job 1 at 10 -> bsld (1010/1000 + 1) / 2 = 1.005.
    jobs = workload_from_rows([(1, 0, 1000, 4, 1000), (2, 0, 10, 1, 10)], max_procs=4).jobs
    assert simulate(jobs, 4, FCFS).schedule() == {1: 0.0, 2: 1000.0}
    result, rows = teacher_episode(jobs, 4, LookaheadTeacher([FCFS], horizon=8), window=4)
    assert result.schedule() == {1: 10.0, 2: 0.0}
    assert [(r["response"], r["candidates"]) for r in rows] == [("B", ["A", "B"])]  # one-job decisions: no row


def test_ties_keep_the_rollout_heuristics_own_choice():
    # Two identical jobs: every candidate costs the same, so the teacher answers what SJF answers (job 1).
    jobs = workload_from_rows([(1, 0, 100, 2, 100), (2, 0, 100, 2, 100)], max_procs=2).jobs
    result, rows = teacher_episode(jobs, 2, LookaheadTeacher([SJF], horizon=4), window=2)
    assert result.schedule() == {1: 0.0, 2: 100.0} and rows[0]["response"] == "A"


def test_the_builder_is_deterministic_uses_only_the_training_part_and_answers_within_the_candidates():
    workload = synthetic_workload(600, max_procs=32, seed=1, mean_interarrival=20.0)
    cfg = SftConfig(protocol=Protocol(window=6, held_out_fraction=0.3), episodes=3, episode_length=64, horizon=16)
    rows, report = build_sft(workload, cfg)
    again, report_again = build_sft(workload, cfg)
    assert rows == again and report == report_again
    assert rows and report["rows"] == len(rows) and report["episodes"] == 3
    for start in episode_starts(workload, cfg):
        assert start + cfg.episode_length <= held_out_start(workload, cfg.protocol)
    for row in rows:
        assert row["response"] in row["candidates"] and 2 <= len(row["candidates"]) <= 6
        assert row["prompt"].startswith("Pick the job to run next.")
    assert set(report["avg_bsld"]) == {"teacher", "FCFS", "SJF", "WFP3", "UNICEF", "F1", "SJF-pred", "F1-pred"}


def test_generated_episodes_cycle_sizes_and_loads_have_users_and_never_share_an_evaluation_stream():
    from frugaltune.scheduling.lublin import lublin_workload, offered_load

    cfg = SftConfig(episodes=0, episode_length=64, generated_episodes=4, generated_procs=(32, 64),
                    generated_loads=(0.8, 1.2), seed=5)
    episodes = generated_episodes(cfg)
    assert [w.max_procs for w in episodes] == [32, 64, 32, 64]
    assert [round(offered_load(w), 2) for w in episodes] == pytest.approx([0.8, 0.8, 1.2, 1.2], abs=0.02)
    assert all(len(w.jobs) == 64 for w in episodes)
    # Users and their estimates (users.py), as in the workload the evaluation judges on: estimates never below the
    # run, round values above it for most jobs, several users per episode, each episode its own draw
    for w in episodes:
        assert all(j.user_id >= 1 and j.requested_time >= j.run_time for j in w.jobs)
        assert sum(j.requested_time > j.run_time for j in w.jobs) > 32 and len({j.user_id for j in w.jobs}) > 3
    assert [j.user_id for j in episodes[0].jobs] != [j.user_id for j in episodes[2].jobs]
    # Seed pair (5, i), never an evaluation workload's integer seed: (5, 1) is not seed 5's or 1's stream.
    sizes = [job.requested_procs for job in lublin_workload(64, 64, seed=[5, 1]).jobs]
    for single in (5, 1):
        assert sizes != [job.requested_procs for job in lublin_workload(64, 64, seed=single).jobs]


def test_agreeing_rows_are_sampled_down_to_their_share_and_every_departure_is_kept():
    workload = synthetic_workload(600, max_procs=32, seed=1, mean_interarrival=20.0)
    base = dict(protocol=Protocol(window=6, held_out_fraction=0.3), episodes=3, episode_length=64, horizon=16,
                order="F1", generated_episodes=2, generated_procs=(32,), generated_loads=(1.1,))
    every, report = build_sft(workload, SftConfig(**base))
    fewer, fewer_report = build_sft(workload, SftConfig(**base, agree_share=0.5))
    departures = [row for row in every if row["response"] != "A"]
    assert report["departures"] == len(departures) > 0 and report["labelled_rows"] == len(every)
    assert set(report["avg_bsld_by_source"]) == {"workload", "generated"}
    assert [row for row in fewer if row["response"] != "A"] == departures  # all kept, in order
    agreeing = sum(row["response"] == "A" for row in fewer)
    assert agreeing == min(len(every) - len(departures), len(departures))  # 50%: as many as departures
    assert fewer_report["rows"] == len(fewer) and fewer_report["rows_departure_share"] >= 0.5
    with pytest.raises(ValueError, match="agree_share = 1.5"):
        build_sft(workload, SftConfig(**base, agree_share=1.5))


def test_the_builder_names_the_fix_when_the_training_part_is_too_short():
    workload = synthetic_workload(100, max_procs=8, seed=0)
    with pytest.raises(ValueError, match="episode_length=256"):
        build_sft(workload, SftConfig(episodes=1, episode_length=256))
    with pytest.raises(ValueError, match="scheduling.window = 27"):
        build_sft(workload, SftConfig(protocol=Protocol(window=27), episodes=1, episode_length=16))
    with pytest.raises(ValueError, match="rollout_policies"):
        build_sft(workload, SftConfig(episodes=1, episode_length=16, rollout_policies=("LIFO",)))


def test_the_stage_draws_its_episodes_from_the_user_workloads_training_part(tmp_path, monkeypatch):
    import json

    from frugaltune.config import parse_params
    from frugaltune.scheduling.evaluation import held_out_start
    from frugaltune.scheduling.settings import generate_user_workload, sft_config
    from frugaltune.scheduling.synthetic import write_swf
    from stages import build_sft as stage

    monkeypatch.chdir(tmp_path)  # no data/trace.swf here: only the estimate-and-user workload
    params = parse_params({"scheduling": {
        "window": 4, "evaluation": {"held_out_fraction": 0.5},
        "sft": {"episodes": 2, "episode_length": 40, "horizon": 8, "generated_episodes": 1,
                "generated_procs": [16]},
        "user_workload": {"procs": 16, "jobs": 200, "load": 1.2, "seed": 8}}})
    workload = generate_user_workload(params.scheduling)
    write_swf(workload, tmp_path / "data/user_workload.swf")
    report = stage.run(params)
    assert set(report["avg_bsld_by_source"]) == {"workload", "generated"}
    cfg = sft_config(params.scheduling)
    assert all(start + 40 <= held_out_start(workload, cfg.protocol) for start in episode_starts(workload, cfg))
    rows = [json.loads(line) for line in (tmp_path / "data/sft.jsonl").read_text().splitlines()]
    assert len(rows) == report["rows"] > 0
    waiting = [line.split() for row in rows for line in row["prompt"].splitlines()[4:]]
    assert all(len(fields) == 6 for fields in waiting)
    # The episodes' users have histories: some prompts show a user's accuracy and a prediction below the estimate
    assert any(fields[5] != "-" for fields in waiting) and any(int(f[4]) < int(f[2]) for f in waiting)
