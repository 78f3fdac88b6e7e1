"""The heuristic baselines on an SWF trace: average bounded slowdown per policy, with and without EASY backfilling.

    python benchmarks/scheduling_heuristics.py                       # Lublin-256, 20 sequences of 256 jobs
    python benchmarks/scheduling_heuristics.py scheduling/data/lublin_256.swf --sequences 50 --out /tmp/sched
    python benchmarks/scheduling_heuristics.py --full-trace          # also time each policy on the whole trace

Run from the repository root. Reads the trace (default `scheduling/data/lublin_256.swf`, the repository's copy of
RLScheduler's Lublin trace, the scheduling pipeline's default), draws `--sequences` start points in its held-out last `--held-out` fraction (seeded),
simulates FCFS, SJF, WFP3, UNICEF and F1 on every sequence, each with and without EASY backfilling
(frugaltune.scheduling.evaluation), then prints the markdown table of mean and std of the per-sequence average
bounded slowdown, the same for mean wait, and the simulator's throughput (simulated jobs per wall-clock second,
summed over all runs). Writes to `--out` (default reports/scheduling/): heuristics.md (the tables and the
settings), heuristics.csv (one row per policy x backfilling x sequence), bsld_by_policy.png (bars with std) and
queue_length_cdf.png (time-weighted CDF of the queue length per policy, pooled over the sequences).
`--full-trace` also simulates the whole trace once per policy and backfilling mode and prints each wall time.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # files only; no display on the build machines
import matplotlib.pyplot as plt

from frugaltune import paths
from frugaltune.config import DEFAULT_TRACE as SCHEDULING_TRACE
from frugaltune.hardware import cpu_facts
from frugaltune.scheduling import HEURISTICS, queue_length_cdf, read_swf, simulate
from frugaltune.scheduling.evaluation import (
    Protocol,
    evaluate,
    markdown_table,
    summary_table,
)

DEFAULT_TRACE = paths.SCHEDULING_DIR / SCHEDULING_TRACE  # scheduling.trace's default, from the repository root
DEFAULT_OUT = Path("reports/scheduling")


def plot_bsld(table, path: Path) -> None:
    names = list(table.index)
    x = range(len(names))
    width = 0.4
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.bar([i - width / 2 for i in x], table["avg_bsld mean"], width, yerr=table["avg_bsld std"], capsize=3,
           label="no backfilling")
    ax.bar([i + width / 2 for i in x], table["avg_bsld mean +EASY"], width, yerr=table["avg_bsld std +EASY"],
           capsize=3, label="EASY backfilling")
    ax.set_xticks(list(x), names)
    ax.set_yscale("log")  # without backfilling FCFS is orders of magnitude worse than F1 with it
    ax.set_ylabel("average bounded slowdown (log scale)")
    ax.set_title("mean over sequences, bars = std")
    ax.legend()
    ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def plot_queue_cdf(results, path: Path) -> None:
    fig, axes = plt.subplots(1, 2, figsize=(10, 4), sharey=True)
    for ax, backfill in zip(axes, (False, True)):
        for name in HEURISTICS:
            runs = [r for r in results if r.policy == name and r.backfill == backfill]
            values, fractions = queue_length_cdf(runs)
            ax.step(values, fractions, where="post", label=name)
        ax.set_xscale("symlog")
        ax.set_xlabel("waiting jobs")
        ax.set_title("EASY backfilling" if backfill else "no backfilling")
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("fraction of time the queue is at most this long")
    axes[1].legend(loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("trace", nargs="?", type=Path, default=DEFAULT_TRACE, help="an SWF file")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help="where the table, CSV and plots go")
    parser.add_argument("--sequences", type=int, default=20, help="test sequences (>= 20 for the report)")
    parser.add_argument("--length", type=int, default=256, help="jobs per sequence")
    parser.add_argument("--held-out", type=float, default=0.3, help="last fraction of the trace to sample from")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--window", type=int, default=Protocol.window, help="waiting jobs a policy sees")
    parser.add_argument("--full-trace", action="store_true", help="also time one simulation of the whole trace")
    args = parser.parse_args()

    workload = read_swf(args.trace)
    protocol = Protocol(sequence_length=args.length, n_sequences=args.sequences, held_out_fraction=args.held_out,
                        seed=args.seed, window=args.window)
    began = time.perf_counter()
    frame, results = evaluate(workload, HEURISTICS.values(), protocol, keep_results=True)
    wall = time.perf_counter() - began
    jobs_per_second = frame["jobs"].sum() / frame["seconds"].sum()

    settings = (f"trace {args.trace} ({len(workload)} jobs, {workload.max_procs} processors, skipped "
                f"{workload.skipped or 'none'}); {protocol.n_sequences} sequences of {protocol.sequence_length} "
                f"jobs from the last {protocol.held_out_fraction:.0%}, seed {protocol.seed}, window "
                f"{protocol.window}")
    bsld = markdown_table(summary_table(frame, "avg_bsld"))
    wait = markdown_table(summary_table(frame, "mean_wait"), digits=0)
    speed = (f"simulator: {frame['jobs'].sum()} jobs in {frame['seconds'].sum():.2f} s of simulation "
             f"= {jobs_per_second:,.0f} jobs/s ({len(frame)} runs, {wall:.1f} s wall in all) on {cpu_facts()['model']}")
    print(settings, "", "Average bounded slowdown (tau = 10 s), mean and std over sequences:", "", bsld, "",
          "Mean wait (s):", "", wait, "", speed, sep="\n")

    if args.full_trace:
        print(f"\nwhole trace ({len(workload)} jobs) in one simulation:")
        for backfill in (False, True):
            for policy in HEURISTICS.values():
                began = time.perf_counter()
                simulate(workload.jobs, workload.max_procs, policy, backfill=backfill, window=args.window)
                seconds = time.perf_counter() - began
                print(f"  {policy.name:7s} {'+EASY' if backfill else '     '} {seconds:5.2f} s "
                      f"({len(workload) / seconds:,.0f} jobs/s)")

    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "heuristics.md").write_text(
        f"{settings}\n\nAverage bounded slowdown (tau = 10 s), mean and std over sequences:\n\n{bsld}\n\n"
        f"Mean wait (s):\n\n{wait}\n\n{speed}\n")
    frame.to_csv(args.out / "heuristics.csv", index=False)
    plot_bsld(summary_table(frame, "avg_bsld"), args.out / "bsld_by_policy.png")
    plot_queue_cdf(results, args.out / "queue_length_cdf.png")
    print(f"wrote {args.out}/heuristics.md, heuristics.csv, bsld_by_policy.png, queue_length_cdf.png")


if __name__ == "__main__":
    main()
