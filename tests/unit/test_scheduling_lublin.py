"""The Lublin-Feitelson generator and load scaling (frugaltune/scheduling/lublin.py): the same seed gives the same
trace, sizes stay within the machine, the statistics are the model's, scaling multiplies the offered load.

Run with `pytest tests/unit/test_scheduling_lublin.py` (a few seconds: 4,000-job traces).
"""

from __future__ import annotations

import numpy as np
import pytest

from frugaltune.scheduling.lublin import at_load, bucket_weights, lublin_workload, offered_load, scale_load
from frugaltune.scheduling.swf import read_swf
from frugaltune.scheduling.synthetic import write_swf


@pytest.fixture(scope="module")
def trace():
    return lublin_workload(4000, max_procs=128, seed=3)


def columns(workload):
    jobs = workload.jobs
    return (np.array([j.requested_procs for j in jobs]), np.array([j.run_time for j in jobs]),
            np.array([j.submit_time for j in jobs]))


def test_a_seed_gives_the_same_trace_and_another_seed_another(trace):
    again = lublin_workload(4000, max_procs=128, seed=3)
    other = lublin_workload(4000, max_procs=128, seed=4)
    assert [np.array_equal(a, b) for a, b in zip(columns(trace), columns(again))] == [True] * 3
    assert not np.array_equal(columns(trace)[2], columns(other)[2])


def test_sizes_stay_within_the_machine_and_reach_it(trace):
    procs, runs, submits = columns(trace)
    assert procs.min() == 1 and procs.max() == 128
    assert (runs >= 0).all() and (np.diff(submits) >= 0).all()
    assert columns(lublin_workload(500, max_procs=48, seed=0))[0].max() <= 48  # P not a power of two: capped at P


def test_the_statistics_are_the_models(trace):
    procs, runs, submits = columns(trace)
    serial = (procs == 1).mean()
    power_of_two = ((procs & (procs - 1)) == 0).mean()  # serial jobs count: 1 is 2^0
    assert serial == pytest.approx(0.244, abs=0.03)
    assert 0.80 <= power_of_two <= 0.92   # 0.244 serial + 0.576 rounded + some unrounded that land on 2^k
    # Wider jobs run longer (the hyper-gamma's mix moves with the size): the model's size/run-time correlation
    assert np.median(runs[procs >= 32]) > 3 * np.median(runs[procs == 1])
    assert 30 <= np.median(runs) <= 1000    # the vendored lublin_256.swf: 137 s
    assert 300 <= np.diff(submits).mean() <= 2000  # lublin_256.swf: 771 s


def test_the_daily_cycle_brings_more_arrivals_by_day_than_by_night(trace):
    weights = bucket_weights()
    assert weights.shape == (48,) and weights.mean() == pytest.approx(1.0)
    hours = (columns(trace)[2] % 86400) // 3600
    assert ((hours >= 9) & (hours < 17)).mean() > 2 * ((hours >= 0) & (hours < 8)).mean()


def test_load_scaling_multiplies_the_offered_load_and_keeps_the_jobs(trace):
    doubled = scale_load(trace, 2.0)
    assert offered_load(doubled) / offered_load(trace) == pytest.approx(2.0, rel=1e-3)
    assert [(j.job_id, j.run_time, j.requested_procs) for j in doubled.jobs] == \
        [(j.job_id, j.run_time, j.requested_procs) for j in trace.jobs]
    assert doubled.jobs[0].submit_time == trace.jobs[0].submit_time
    assert offered_load(at_load(trace, 0.9)) == pytest.approx(0.9, rel=1e-3)
    with pytest.raises(ValueError, match="factor > 0"):
        scale_load(trace, 0)


def test_the_generated_trace_round_trips_through_swf(tmp_path):
    workload = at_load(lublin_workload(300, max_procs=64, seed=1), 1.2)
    back = read_swf(write_swf(workload, tmp_path / "lublin.swf"))
    assert back.max_procs == 64 and [j.submit_time for j in back.jobs] == [j.submit_time for j in workload.jobs]


def test_a_machine_the_model_cannot_size_is_refused():
    with pytest.raises(ValueError, match="max_procs >= 2"):
        lublin_workload(10, max_procs=1)


def test_the_pipelines_second_workload_comes_from_its_params_and_is_all_test_data():
    from frugaltune.config import ParamsError, parse_params
    from frugaltune.scheduling.settings import generate_second_workload, second_protocol

    sp = parse_params({"scheduling": {"second_workload": {"procs": 32, "jobs": 300, "load": 1.1, "seed": 5}}}).scheduling
    first, again = generate_second_workload(sp), generate_second_workload(sp)
    assert first.max_procs == 32 and len(first) == 300 and offered_load(first) == pytest.approx(1.1, rel=1e-3)
    assert [j.submit_time for j in first.jobs] == [j.submit_time for j in again.jobs]
    proto = second_protocol(sp)
    assert proto.held_out_fraction == 1.0 and proto.window == sp.window and proto.n_sequences == 10
    with pytest.raises(ParamsError, match="scheduling.second_workload.procs"):
        parse_params({"scheduling": {"second_workload": {"procs": 1}}})
