"""HPC batch scheduling: SWF reader, event-driven cluster simulator, heuristic policies, metrics, evaluation.

Library code, no entry point of its own. The heuristic table is produced by
`python benchmarks/scheduling_heuristics.py` (see docs/SCHEDULING.md); the unit tests run with
`pytest tests/unit/test_scheduling.py`.

The pieces, in the order data flows through them:
    swf.read_swf            a Parallel Workloads Archive trace -> Workload (typed jobs + header)
    synthetic.synthetic_workload   a seeded toy workload for tests
    lublin.lublin_workload  the Lublin-Feitelson workload model for a machine of P processors; load scaling
    users.with_users        users (Zipf-like activity, characteristic job shapes) and their runtime estimates
    simulator.simulate      Workload jobs + Policy (+ EASY backfilling) -> SimulationResult; policies see JobViews
    state                   what a policy sees (JobView, SchedulerState, Policy), re-exported by simulator
    policies                FCFS, SJF, WFP3, UNICEF, F1 (score functions, lower runs first); SJF/F1 on predictions
    metrics                 bounded slowdown, waits, utilisation, queue length over time
    evaluation              N-job sequences from the held-out part of a trace, every policy on the same ones
"""

from frugaltune.scheduling.metrics import (
    BSLD_TAU,
    SequenceMetrics,
    bounded_slowdown,
    queue_length_cdf,
    sequence_metrics,
)
from frugaltune.scheduling.policies import F1, FCFS, HEURISTICS, SJF, UNICEF, WFP3, ScorePolicy
from frugaltune.scheduling.simulator import (
    DEFAULT_WINDOW,
    Policy,
    RunningJob,
    SchedulerState,
    SimulationResult,
    simulate,
)
from frugaltune.scheduling.swf import Job, SWFError, Workload, read_swf
from frugaltune.scheduling.synthetic import synthetic_workload

__all__ = [
    "BSLD_TAU", "DEFAULT_WINDOW", "F1", "FCFS", "HEURISTICS", "SJF", "UNICEF", "WFP3", "Job", "Policy",
    "RunningJob", "SWFError", "SchedulerState", "ScorePolicy", "SequenceMetrics", "SimulationResult", "Workload",
    "bounded_slowdown", "queue_length_cdf", "read_swf", "sequence_metrics", "simulate", "synthetic_workload",
]
