"""The policy comparison's plot data (frugaltune/scheduling/plots.py): the queue-length CDF table `dvc plots` draws.

Run with `pytest tests/unit/test_scheduling_plots.py` (about a second). The expected CDF is worked out by hand; the
figures themselves are drawn (and checked) by tests/e2e/test_scheduling_pipeline.py.
"""

from __future__ import annotations

import numpy as np

from frugaltune.scheduling import FCFS, SJF, simulate
from frugaltune.scheduling.metrics import queue_length_cdf
from frugaltune.scheduling.plots import cdf_on_grid, queue_cdf_table
from frugaltune.scheduling.swf import workload_from_rows


def test_the_cdf_table_weighs_queue_lengths_by_time():
    # One processor, two 10 s jobs at t=0: job 2 waits 0-10 s (1 waiting), then nothing waits until 20 s.
    # P(queue <= 0) = 10/20, P(queue <= 1) = 1. SJF makes the same schedule here.
    jobs = workload_from_rows([(1, 0, 10, 1, 10), (2, 0, 10, 1, 10)], max_procs=1).jobs
    cdfs = {"FCFS": queue_length_cdf([simulate(jobs, 1, FCFS)]), "SJF": queue_length_cdf([simulate(jobs, 1, SJF)])}
    assert queue_cdf_table(cdfs) == "queue_length,FCFS,SJF\n0,0.500000,0.500000\n1,1.000000,1.000000\n"
    # Beyond the longest queue seen the CDF stays at 1; below zero it is 0; a CDF stored as lists (evaluate_base's
    # report) draws the same.
    assert list(cdf_on_grid(cdfs["FCFS"], np.array([-1, 0, 5]))) == [0.0, 0.5, 1.0]
    stored = {name: ([int(v) for v in values], [float(f) for f in fractions]) for name, (values, fractions) in
              cdfs.items()}
    assert queue_cdf_table(stored) == queue_cdf_table(cdfs)

