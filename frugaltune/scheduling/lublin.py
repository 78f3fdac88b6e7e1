"""The Lublin-Feitelson workload model as a seeded generator, and load scaling of any trace.

Library code: `lublin_workload(10_000, max_procs=128, seed=7)` -> `Workload`; `scale_load(workload, 1.5)` compresses
its arrivals so the offered load is 1.5x; `at_load(workload, 0.9)` scales it to an offered load of 0.9. As an SWF
file (the scheduling pipeline's `generate_workload` stage calls the same functions):

    python -m frugaltune.scheduling.lublin trace.swf --jobs 10000 --procs 128 --seed 7 --load 0.9

The model: U. Lublin and D. G. Feitelson, "The workload on parallel supercomputers: modeling the characteristics of
rigid jobs", J. Parallel Distrib. Comput. 63(11):1105-1122, 2003. Its parameters here are the "whole sample" ones
(no batch/interactive split) of Lublin's reference generator `lublin99.c`, as read from its Java port in GridSim
(`gridsim.parallel.util.WorkloadLublin99`, constants `SERIAL_PROB` ... `ARAR`, whose comments quote the C code);
the vendored scheduling/data/lublin_256.swf matches them (25% serial jobs; no job types in its queue field).

- **Size**: serial (1 processor) with probability 0.244; otherwise log2(size) ~ two-stage uniform: U(u_low, u_med)
  with probability 0.86, else U(u_med, u_hi), where u_hi = log2(P) (the machine), u_med = u_hi - 2.5 (the paper
  advises u_hi - 1.5 .. u_hi - 3.5) and u_low = 0.8 (so 2 processors is not too rare). With probability 0.576
  (of all jobs) log2(size) is rounded first, giving a power of two; size = round(2^x), at most P.
- **Run time**: ln(run time) ~ hyper-gamma: gamma(4.2, 0.94) with probability p = -0.0054 * size + 0.78 (clipped to
  [0, 1]), else gamma(312, 0.03) (shape, scale): wider jobs run longer. Values of ln above 12 (about 45 h) are
  redrawn, as in lublin99.c; the run time is exp(.) truncated to whole seconds (0 happens and is kept).
- **Arrivals**: ln(inter-arrival seconds at rush hour) ~ gamma(10.2303 x 1.0225, 0.4871) (ARAR turns the rush-hour
  fit into an all-day one), redrawn above 13. The daily cycle: the day is 48 half-hour buckets, bucket i weighing
  cdf(i + 0.5) - cdf(i - 0.5) of gamma(8.1737, 3.9631) for i = 11..58 (moved cyclically onto 0..47), normalised to
  mean 1; each inter-arrival draw buys exp(draw) / 1800 "points", and passing a bucket costs its weight, so busy
  hours get more arrivals. The leftover points and the position inside a bucket carry over between jobs (static
  variables in lublin99.c). The trace starts at midnight.
- Requested time = run time (the model has no user estimates; lublin_256.swf leaves them -1 too): a scheduler
  fed it knows every job's length. `users.with_users` adds users and their estimates to a generated workload.

The random stream is numpy's, not lublin99.c's drand48, so the same seed gives a different (statistically alike)
trace than the C program; a seed always gives the same trace here.

Load scaling (as the learned-scheduler literature does to vary load on one trace): every submit time moves to
first + (submit - first) / factor, so the offered load (processor-seconds asked for over P x the submit span)
grows by the factor; sizes and run times are unchanged.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from frugaltune.scheduling.swf import Workload, workload_from_rows

BUCKETS = 48                    # half hours in a day
SECONDS_IN_BUCKET = 86400 // BUCKETS
CYCLIC_DAY_START = 11           # the fitted day runs over buckets 11..58, moved cyclically onto 0..47
TOO_MUCH_TIME = 12.0            # ln(run time) above this is redrawn
TOO_MUCH_ARRIVE_TIME = 13.0     # ln(inter-arrival) above this is redrawn


@dataclass(frozen=True)
class LublinParams:
    """The model's "whole sample" parameters (lublin99.c via GridSim's WorkloadLublin99; see the module docstring).
    Gammas are (shape, scale); sizes are in log2 of processors."""

    serial_prob: float = 0.244
    pow2_prob: float = 0.576
    u_low: float = 0.8
    u_med_below_hi: float = 2.5
    """u_med = log2(P) - this; the reference trace for 128 processors has u_med 4.5."""
    u_prob: float = 0.86
    a1: float = 4.2
    b1: float = 0.94
    a2: float = 312.0
    b2: float = 0.03
    pa: float = -0.0054
    pb: float = 0.78
    aarr: float = 10.2303 * 1.0225  # AARR x ARAR
    barr: float = 0.4871
    anum: float = 8.1737
    bnum: float = 3.9631


def _truncated_gamma(rng: np.random.Generator, shape: float, scale: float, n: int, limit: float) -> np.ndarray:
    values = rng.gamma(shape, scale, n)
    while (redraw := values > limit).any():
        values[redraw] = rng.gamma(shape, scale, int(redraw.sum()))
    return values


def job_sizes(rng: np.random.Generator, n: int, max_procs: int, p: LublinParams = LublinParams()) -> np.ndarray:
    """`n` job widths from the model's size distribution for a machine of `max_procs` processors."""
    u_hi = math.log2(max_procs)
    u_med = max(u_hi - p.u_med_below_hi, p.u_low)  # a tiny machine: the first uniform degenerates, not inverts
    u = rng.random(n)
    first = rng.random(n) <= p.u_prob
    low = np.where(first, p.u_low, u_med)
    high = np.where(first, u_med, u_hi)
    log_size = low + rng.random(n) * (high - low)
    log_size = np.where(u <= p.serial_prob + p.pow2_prob, np.floor(log_size + 0.5), log_size)
    sizes = np.minimum(np.floor(2.0 ** log_size + 0.5), max_procs).astype(int)
    return np.where(u <= p.serial_prob, 1, sizes)


def run_times(rng: np.random.Generator, sizes: np.ndarray, p: LublinParams = LublinParams()) -> np.ndarray:
    """Run times (whole seconds) for jobs of `sizes`: the hyper-gamma whose mix depends on the size."""
    first_prob = np.clip(p.pa * sizes + p.pb, 0.0, 1.0)
    log_run = np.empty(len(sizes))
    todo = np.arange(len(sizes))
    while len(todo):  # redraw the branch and the value, as lublin99.c's do-while does
        first = rng.random(len(todo)) <= first_prob[todo]
        draw = np.where(first, rng.gamma(p.a1, p.b1, len(todo)), rng.gamma(p.a2, p.b2, len(todo)))
        log_run[todo] = draw
        todo = todo[draw > TOO_MUCH_TIME]
    return np.floor(np.exp(log_run)).astype(int)


def bucket_weights(p: LublinParams = LublinParams()) -> np.ndarray:
    """Each half hour's share of the day's arrivals, normalised to mean 1 (index 0 = 00:00-00:30)."""
    from scipy.special import gammainc  # the regularised lower incomplete gamma: the gamma cdf at x / scale

    i = np.arange(CYCLIC_DAY_START, BUCKETS + CYCLIC_DAY_START, dtype=float)
    weights = np.empty(BUCKETS)
    weights[(i.astype(int) - 1) % BUCKETS] = gammainc(p.anum, (i + 0.5) / p.bnum) - gammainc(p.anum, (i - 0.5)
                                                                                              / p.bnum)
    return weights / weights.mean()


def arrival_times(rng: np.random.Generator, n: int, p: LublinParams = LublinParams()) -> np.ndarray:
    """`n` submit times (seconds from midnight of day 0): gamma inter-arrivals stretched by the daily cycle."""
    weights = bucket_weights(p)
    draws = np.exp(_truncated_gamma(rng, p.aarr, p.barr, n, TOO_MUCH_ARRIVE_TIME))
    times = np.empty(n)
    clock, bucket, points, reminder = 0.0, 0, 0.0, 0.0
    for k in range(n):  # sequential by nature: each gap depends on the bucket the last one ended in
        points += draws[k] / SECONDS_IN_BUCKET
        gap = 0.0
        while points > weights[bucket]:
            points -= weights[bucket]
            bucket = (bucket + 1) % BUCKETS
            gap += SECONDS_IN_BUCKET
        new_reminder = points / weights[bucket]
        gap += SECONDS_IN_BUCKET * (new_reminder - reminder)
        reminder = new_reminder
        clock += gap
        times[k] = clock
    return times


def lublin_workload(n_jobs: int, max_procs: int, seed: int | Sequence[int] = 0,
                    params: LublinParams = LublinParams()) -> Workload:
    """`n_jobs` jobs of the Lublin-Feitelson model for a machine of `max_procs` processors, reproducible from `seed`
    (see the module docstring): an integer, or a sequence of them (numpy's SeedSequence entropy, so the training
    episodes' seed pairs never give the stream of an evaluation workload's single-integer seed). Submit times are
    whole seconds, the first job's is its first inter-arrival."""
    if n_jobs < 1 or max_procs < 2:
        raise ValueError(f"lublin_workload needs n_jobs >= 1 and max_procs >= 2 (the model sizes parallel jobs in "
                         f"log2 of the machine); got n_jobs={n_jobs}, max_procs={max_procs}.")
    rng = np.random.default_rng(seed)
    sizes = job_sizes(rng, n_jobs, max_procs, params)
    runs = run_times(rng, sizes, params)
    submits = np.floor(arrival_times(rng, n_jobs, params)).astype(int)
    rows = [(i + 1, int(s), int(r), int(n), int(r)) for i, (s, r, n) in enumerate(zip(submits, runs, sizes))]
    named = seed if isinstance(seed, int) else list(seed)
    return workload_from_rows(rows, max_procs=max_procs,
                              source=f"<lublin-feitelson n={n_jobs} procs={max_procs} seed={named}>")


def offered_load(workload: Workload) -> float:
    """Processor-seconds the jobs ask for (run time x processors) over P x (last submit - first submit)."""
    jobs = workload.jobs
    span = jobs[-1].submit_time - jobs[0].submit_time
    if span <= 0:
        raise ValueError(f"{workload.source}: every job is submitted at the same time, so the offered load is "
                         f"undefined; give a workload with at least two submit times.")
    work = sum(job.run_time * job.requested_procs for job in jobs)
    return float(work / (workload.max_procs * span))


def scale_load(workload: Workload, factor: float) -> Workload:
    """`workload` with every gap between submits divided by `factor` (whole seconds, floored): the offered load
    times `factor`, the jobs' sizes, run times and order unchanged."""
    if factor <= 0:
        raise ValueError(f"load factor {factor}: give a factor > 0 (> 1 compresses arrivals, raising the load).")
    first = workload.jobs[0].submit_time
    jobs = [dataclasses.replace(job, submit_time=first + math.floor((job.submit_time - first) / factor))
            for job in workload.jobs]
    return dataclasses.replace(workload, jobs=jobs, source=f"{workload.source} x load {factor:g}")


def at_load(workload: Workload, load: float) -> Workload:
    """`workload` scaled (`scale_load`) to an offered load of `load`."""
    if load <= 0:
        raise ValueError(f"offered load {load}: give a load > 0 (1.0 asks for the whole machine on average).")
    return scale_load(workload, load / offered_load(workload))


def main(argv: list[str] | None = None) -> None:
    from frugaltune.scheduling.synthetic import write_swf

    parser = argparse.ArgumentParser(description="Write a Lublin-Feitelson model workload as an SWF file.")
    parser.add_argument("out", type=Path)
    parser.add_argument("--jobs", type=int, default=10_000)
    parser.add_argument("--procs", type=int, default=256)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--load", type=float, default=None, help="scale arrivals to this offered load")
    args = parser.parse_args(argv)
    workload = lublin_workload(args.jobs, args.procs, args.seed)
    if args.load is not None:
        workload = at_load(workload, args.load)
    write_swf(workload, args.out)
    print(f"wrote {args.out}: {args.jobs} jobs on {args.procs} processors (seed {args.seed}), offered load "
          f"{offered_load(workload):.3f}")


if __name__ == "__main__":
    main()
