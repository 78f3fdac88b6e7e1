"""Is there a state-only policy that beats F1 by the margin issue 55 asks of the student? A score function searched on
training episodes, judged on the held-out sequences and on the second workload.

    python benchmarks/scheduling_score_search.py                       # trace + generated episodes, ~3 min on 2 cores
    python benchmarks/scheduling_score_search.py --generated 0 --trace-episodes 100 --name scheduling_score_search_trace
    python benchmarks/scheduling_score_search.py --search-seed 1 --iterations 300
    python benchmarks/scheduling_score_search.py --family running --name scheduling_score_search_running
    python benchmarks/scheduling_score_search.py --family running --fit held_out --random 500 --iterations 800 \
        --search-seed 3 --name scheduling_score_search_bound      # the family's reach: fitted on the judged set

Run from the repository root. A student LLM sees only the state its prompt shows; whatever it learns is at best a
function of that state. This benchmark asks whether any simple such function beats F1 (the named baseline) where the
issue's done-when judges it: on the 20 held-out Lublin sequences without backfilling (the issue asks <= 0.90 x F1)
and on the second workload (<= F1). The family, for a visible job with requested time r, processors n, waited
w seconds, on a machine with `free` processors free now (lower runs first):

    score = log10(r)^a * n^b + c * log10(r) + d * n - e * log10(1 + w) - f * [n <= free]

`--family running` adds what the running jobs tell (the prompt lists them): `delay`, how long until enough
processors are back for the job by the running jobs' expected ends (0 when it fits now), and `q`, the waiting jobs:

    ... + g * log10(1 + delay) + h * log10(1 + delay) * log10(1 + q)

(a, b) = (1, 1) with c..h = 0 is F1 without its submit-time term, where the search starts. The search is a (1+1)
evolution strategy (Gaussian steps, widened on success, narrowed on failure; seeded) minimising the mean avg bsld
over the training episodes: `--trace-episodes` windows of 256 jobs drawn from the trace's training part (seed
`--episode-seed`, never the held-out part) and `--generated` Lublin-Feitelson episodes of 128 and 256 processors at
loads 0.9/1.05/1.2 (seed pairs (77, i): neither the pipeline's training seeds nor the second workload's). The held-out
sequences and the second workload are the scheduling pipeline's own (its params: trace, protocol, window,
`second_workload`) and are evaluated only for the start, F1 and the best found, never during the search.
`--fit held_out` is the exception, and says so in its report: the search minimises the held-out sequences' own
bsld (after `--random` candidates drawn over the whole box), which no student could do. What it finds is a bound on
the family: no score of that form, however chosen, does better on those sequences.

Prints F1, the start and the best found on the three sets with ratios to F1, and writes
reports/benchmarks/<--name>.json (default scheduling_score_search). The bsld figures do not depend on the CPU, only the seconds do.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import time
from pathlib import Path

import numpy as np
from common import write_results

from frugaltune import paths
from frugaltune.config import load_params
from frugaltune.hardware import cpu_facts
from frugaltune.scheduling.evaluation import sequences
from frugaltune.scheduling.metrics import sequence_metrics
from frugaltune.scheduling.policies import F1
from frugaltune.scheduling.settings import generate_second_workload, load_workload, protocol, second_protocol, sft_config
from frugaltune.scheduling.sft import episode_starts, generated_episodes
from frugaltune.scheduling.simulator import SchedulerState, simulate
from frugaltune.scheduling.swf import Job

# (a, b, c, d, e, f, g, h); the state family uses the first six
START = np.array([1.0, 1.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0])
STEP = np.array([0.3, 0.2, 5.0, 0.2, 5.0, 20.0, 20.0, 5.0])  # the first Gaussian step per parameter
LOW = np.array([0.2, 0.2, -100.0, -5.0, -200.0, -500.0, -500.0, -100.0])
HIGH = np.array([3.0, 2.0, 100.0, 5.0, 200.0, 500.0, 500.0, 100.0])
FAMILIES = {"state": "log10(r)^a * n^b + c log10(r) + d n - e log10(1 + w) - f [n <= free]",
            "running": "log10(r)^a * n^b + c log10(r) + d n - e log10(1 + w) - f [n <= free] + g log10(1 + delay) "
                       "+ h log10(1 + delay) log10(1 + q)"}


class SearchedScore:
    """The module docstring's score with parameters `x` = (a, ..., h); g = h = 0 is the state family."""

    name = "searched"

    def __init__(self, x: np.ndarray):
        self.x = [float(v) for v in x]

    def score(self, job: Job, state: SchedulerState) -> float:
        a, b, c, d, e, f, g, h = self.x
        r = math.log10(max(job.requested_time, 1.0))
        n, clock = job.requested_procs, state.clock
        value = r ** a * n ** b + c * r + d * n - e * math.log10(1.0 + max(clock - job.submit_time, 0.0)) \
            - f * (n <= state.free_procs)
        if g or h:
            delay = math.log10(1.0 + state.start_time(job) - clock)
            value += g * delay + h * delay * math.log10(1.0 + state.queue_length)
        return value

    def choose(self, state: SchedulerState) -> Job:
        return min(state.queue, key=lambda job: (self.score(job, state), job.submit_time, job.job_id))


def mean_bsld(policy, episodes: list[tuple[list[Job], int]], window: int) -> float:
    return float(np.mean([sequence_metrics(simulate(jobs, procs, policy, window=window)).avg_bsld
                          for jobs, procs in episodes]))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--params", default=str(paths.SCHEDULING_DIR / "params.yaml"),
                        help="the scheduling pipeline's params: its trace, protocol, window and second workload")
    parser.add_argument("--trace-episodes", type=int, default=60, help="training windows from the trace")
    parser.add_argument("--generated", type=int, default=40, help="generated training episodes")
    parser.add_argument("--episode-seed", type=int, default=7)
    parser.add_argument("--iterations", type=int, default=200)
    parser.add_argument("--search-seed", type=int, default=0)
    parser.add_argument("--family", choices=sorted(FAMILIES), default="state")
    parser.add_argument("--fit", choices=("train", "held_out"), default="train",
                        help="held_out: fit on the judged sequences themselves, a bound on the family (see above)")
    parser.add_argument("--random", type=int, default=0, help="candidates drawn over the whole box before the search")
    parser.add_argument("--name", default="scheduling_score_search", help="reports/benchmarks/<name>.json")
    args = parser.parse_args()

    sp = load_params(args.params).scheduling
    workload = load_workload(Path(args.params).parent / sp.trace, sp)
    prot = protocol(sp)
    # the episodes build_sft draws (sft.episode_starts, sft.generated_episodes), from this benchmark's own seeds
    cfg = dataclasses.replace(sft_config(sp), episode_length=256, generated_procs=(128, 256),
                              generated_loads=(0.9, 1.05, 1.2))
    starts = episode_starts(workload, dataclasses.replace(cfg, seed=args.episode_seed, episodes=args.trace_episodes))
    train = [(workload.jobs[s:s + 256], workload.max_procs) for s in starts]
    train += [(g.jobs, g.max_procs) for g in
              generated_episodes(dataclasses.replace(cfg, seed=77, generated_episodes=args.generated))]
    second = generate_second_workload(sp)
    judged = {"held_out": [(jobs, workload.max_procs) for jobs in sequences(workload, prot)],
              "second_workload": [(jobs, second.max_procs) for jobs in sequences(second, second_protocol(sp))]}

    began = time.perf_counter()
    fit = train if args.fit == "train" else judged["held_out"]
    size = 6 if args.family == "state" else 8
    f1_fit = mean_bsld(F1, fit, sp.window)
    x, fx = START.copy(), mean_bsld(SearchedScore(START), fit, sp.window)
    rng, step = np.random.default_rng(args.search_seed), STEP[:size].copy()
    print(f"fitted on {args.fit}: {len(fit)} episodes"
          + (f" ({args.trace_episodes} trace, {args.generated} generated)" if args.fit == "train" else "")
          + f": F1 {f1_fit:.1f}, start {fx:.1f}", flush=True)
    for i in range(args.random):  # over the whole box; every other one keeps (a, b) near the start's
        y = START.copy()
        y[:size] = LOW[:size] + (HIGH[:size] - LOW[:size]) * rng.random(size)
        if i % 2:
            y[:2] = START[:2] + 0.5 * rng.standard_normal(2)
        y = np.clip(y, LOW, HIGH)
        fy = mean_bsld(SearchedScore(y), fit, sp.window)
        if fy < fx:
            x, fx = y, fy
            print(f"  drawn {i}: {fy:.1f} ({fy / f1_fit:.3f} x F1) at {np.round(x[:size], 3).tolist()}", flush=True)
    for i in range(args.iterations):
        y = x.copy()
        y[:size] = np.clip(x[:size] + step * rng.standard_normal(size), LOW[:size], HIGH[:size])
        fy = mean_bsld(SearchedScore(y), fit, sp.window)
        if fy < fx:
            x, fx, step = y, fy, step * 1.3
            print(f"  {i}: {fy:.1f} ({fy / f1_fit:.3f} x F1) at {np.round(x[:size], 3).tolist()}", flush=True)
        else:
            step = step * 0.97
    searched = time.perf_counter() - began

    table = {}
    for name, episodes in {"train": train, **judged}.items():
        table[name] = {"F1": mean_bsld(F1, episodes, sp.window),
                       "start": mean_bsld(SearchedScore(START), episodes, sp.window),
                       "best": mean_bsld(SearchedScore(x), episodes, sp.window)}
    print(f"\n{'avg bsld (window ' + str(sp.window) + ', no backfilling)':<44}{'F1':>9}{'start':>16}{'best found':>18}")
    for name, row in table.items():
        print(f"{name:<44}{row['F1']:>9.1f}{row['start']:>9.1f} ({row['start'] / row['F1']:.3f}){row['best']:>10.1f} "
              f"({row['best'] / row['F1']:.3f})")
    print(f"best parameters ({', '.join('abcdefgh'[:size])}): {np.round(x[:size], 3).tolist()}; fitted on {args.fit}; "
          f"search {searched:.0f} s, {cpu_facts()['model']}")
    write_results(args.name, {
        "cpu": cpu_facts()["model"], "search_seconds": round(searched, 1), "args": vars(args),
        "family": FAMILIES[args.family], "fitted_on": args.fit,
        "is_a_bound": args.fit == "held_out",  # fitted on the judged sequences: no student's result
        "best_parameters": [round(float(v), 4) for v in x[:size]], "avg_bsld": table,
        "ratio_to_f1": {name: {k: row[k] / row["F1"] for k in ("start", "best")} for name, row in table.items()}})


if __name__ == "__main__":
    main()
