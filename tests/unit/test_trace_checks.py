"""GX checks on a parsed trace (frugaltune/scheduling/trace_checks.py), the scheduling pipeline's validate_trace.

Run with `pytest tests/unit/test_trace_checks.py` (a few seconds, most of it importing Great Expectations).
"""

from __future__ import annotations

from frugaltune.scheduling import synthetic_workload
from frugaltune.scheduling.swf import workload_from_rows
from frugaltune.scheduling.trace_checks import TraceRules, check_trace


def test_a_healthy_trace_passes_every_check():
    workload = synthetic_workload(300, max_procs=32, seed=0)
    checks, failures = check_trace(workload.to_frame(), 32, TraceRules(min_jobs=100))
    assert failures == [] and all(c["success"] for c in checks.values()) and len(checks) == 7


def test_failures_name_the_check_the_observed_value_and_the_knob_to_turn():
    # 4 jobs: too few; job 2 is wider than an 8-processor machine; jobs 3 and 4 run past their request (50%).
    rows = [(1, 0, 100, 4, 100), (2, 10, 50, 16, 60), (3, 20, 90, 2, 60), (4, 30, 70, 1, 60)]
    frame = workload_from_rows(rows, max_procs=16).to_frame()
    checks, failures = check_trace(frame, 8, TraceRules(min_jobs=10, max_overshoot_fraction=0.25))
    assert {name for name, c in checks.items() if not c["success"]} == {"enough_jobs", "procs_within_machine",
                                                                         "overshoot_fraction"}
    joined = "\n".join(failures)
    assert "enough_jobs failed (observed 4)" in joined and "scheduling.validate.min_jobs" in joined
    assert "scheduling.max_procs" in joined and "scheduling.validate.max_overshoot_fraction" in joined
