"""A small seeded synthetic workload for tests: Poisson arrivals, log-uniform run times, power-of-two widths.

Library code: `synthetic_workload(200, max_procs=64, seed=0)`; as an SWF file (the scheduling pipeline's end-to-end
test feeds it to `dvc repro`):

    python -m frugaltune.scheduling.synthetic trace.swf --jobs 600 --procs 32 --seed 0

It is a toy, not a workload model: for realistic synthetic traces use the Lublin-Feitelson model
(`frugaltune.scheduling.lublin`).
"""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np

from frugaltune.scheduling.swf import Workload, workload_from_rows


def synthetic_workload(n_jobs: int, max_procs: int = 64, seed: int = 0, mean_interarrival: float = 60.0,
                       max_run: float = 4 * 3600.0, overestimate: float = 3.0) -> Workload:
    """`n_jobs` jobs on a machine of `max_procs` processors, reproducible from `seed`.

    Args:
        n_jobs: how many jobs (>= 1).
        max_procs: machine size; job widths are powers of two up to it, narrow ones more likely (as in real logs).
        seed: the numpy Generator seed; the same arguments give the same workload.
        mean_interarrival: mean seconds between submits (exponential gaps, i.e. Poisson arrivals).
        max_run: longest run time in seconds; run times are log-uniform between 1 s and this.
        overestimate: requested time = run time x U(1, overestimate), rounded up to a minute, as users pad their
            estimates; 1.0 gives exact estimates.
    """
    if n_jobs < 1 or max_procs < 1 or mean_interarrival <= 0 or max_run < 1 or overestimate < 1:
        raise ValueError(f"synthetic_workload needs n_jobs >= 1, max_procs >= 1, mean_interarrival > 0, "
                         f"max_run >= 1 and overestimate >= 1; got {n_jobs}, {max_procs}, {mean_interarrival}, "
                         f"{max_run}, {overestimate}.")
    rng = np.random.default_rng(seed)
    submit = np.floor(np.cumsum(rng.exponential(mean_interarrival, n_jobs))).astype(int)
    run = np.ceil(np.exp(rng.uniform(0.0, np.log(max_run), n_jobs))).astype(int)
    exponents = np.arange(int(np.log2(max_procs)) + 1)
    weights = 1.0 / (1.0 + exponents)  # 1 processor most likely, the whole machine least
    procs = 2 ** rng.choice(exponents, size=n_jobs, p=weights / weights.sum())
    requested = np.ceil(run * rng.uniform(1.0, overestimate, n_jobs) / 60.0).astype(int) * 60
    rows = [(i + 1, int(s), int(r), int(p), int(q)) for i, (s, r, p, q) in enumerate(zip(submit, run, procs,
                                                                                            requested))]
    return workload_from_rows(rows, max_procs=max_procs, source=f"<synthetic n={n_jobs} seed={seed}>")


def write_swf(workload: Workload, path: str | Path) -> Path:
    """`workload` as a Standard Workload Format file (MaxProcs header, 18 fields a line, -1 where unknown) that
    `read_swf` reads back to the same jobs."""
    from frugaltune.io import write_text
    from frugaltune.scheduling.swf import SWF_FIELDS

    lines = [f"; Note: {workload.source}", f"; MaxProcs: {workload.max_procs}"]
    for job in workload.jobs:
        lines.append(" ".join(str(int(getattr(job, name))) for name in SWF_FIELDS))
    write_text(path, "\n".join(lines) + "\n")
    return Path(path)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="Write a seeded synthetic workload as an SWF file.")
    parser.add_argument("out", type=Path)
    parser.add_argument("--jobs", type=int, default=1000)
    parser.add_argument("--procs", type=int, default=64)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--interarrival", type=float, default=60.0, help="mean seconds between submits")
    args = parser.parse_args(argv)
    write_swf(synthetic_workload(args.jobs, args.procs, args.seed, args.interarrival), args.out)
    print(f"wrote {args.out}: {args.jobs} jobs on {args.procs} processors (seed {args.seed})")


if __name__ == "__main__":
    main()
