"""Can a student learn what the lookahead teacher knows? Its answers against what a prompt shows, and teachers that
know only what a policy could know.

    python benchmarks/teacher_learnability.py                 # 8 trace + 10 generated episodes, ~6 min on 2 cores
    python benchmarks/teacher_learnability.py --generated 0 --samples 4
    python benchmarks/teacher_learnability.py --backfill      # EASY episodes: the LLM picks the head job

Run from the repository root. Two measurements on the training episodes `build_sft` labels (the scheduling
pipeline's defaults: `scheduling/data/lublin_256.swf`, window 8, F1 lettering, episodes of 256 jobs):

1. **Learnability.** Every decision's prompt (the text the LLM is fine-tuned on) parsed back into numbers: free
   processors, queue length, time of day, the four listed running jobs, each visible job's processors, requested
   minutes, waited minutes and whether it fits now. A gradient-boosted classifier (scikit-learn) predicts the
   teacher's letter from them, cross-validated by episode (no episode in both folds). If it does no better than
   always answering "A" (F1's pick), the teacher's departures from F1 are not readable from the prompt, and a
   fine-tuned LLM, which sees the same text, should not be expected to learn them either.
2. **Teachers without clairvoyance.** The pipeline's teacher rolls every candidate out over the *true* next
   arrivals. Beside it, on the same episodes: rollouts over no future arrivals (horizon 0: only the jobs already
   known), and over `--samples` imagined futures (windows of `--horizon` consecutive jobs drawn from the training
   part of the trace, moved to the decision's clock; the same futures for every candidate), the cost summed over
   them. Their choices depend only on the state, so a student could learn them; the question is whether they
   beat F1.

Prints both tables with ratios to F1 (the named baseline) and writes reports/benchmarks/teacher_learnability.json.
The CPU it ran on is in the result; the bsld figures do not depend on it, only the seconds do.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import re
import time

import numpy as np
from common import write_results
from sklearn.ensemble import HistGradientBoostingClassifier
from sklearn.model_selection import GroupKFold

from frugaltune import paths
from frugaltune.config import DEFAULT_TRACE
from frugaltune.hardware import cpu_facts
from frugaltune.scheduling.evaluation import Protocol, held_out_start
from frugaltune.scheduling.metrics import BSLD_TAU, sequence_metrics
from frugaltune.scheduling.policies import F1
from frugaltune.scheduling.sft import LookaheadTeacher, SftConfig, build_sft, episode_starts, teacher_episode
from frugaltune.scheduling.simulator import SchedulerState, Simulator, simulate
from frugaltune.scheduling.swf import Job, read_swf

WINDOW = 8


def prompt_features(prompt: str) -> list[float]:
    """The numbers an `sft.encode_state` prompt shows (see the module docstring), -1 where a slot is empty."""
    total = int(re.search(r"machine (\d+) procs", prompt).group(1))
    free = int(re.search(r"(\d+) free", prompt).group(1))
    waiting = int(re.search(r"(\d+) waiting", prompt).group(1))
    hours, minutes = map(int, re.search(r"time (\d+):(\d+)", prompt).groups())
    running = [tuple(map(int, r.split("x"))) for r in
               re.findall(r"\d+x\d+", re.search(r"^running \(min left x procs\): (.*)$", prompt, re.M).group(1))]
    jobs = [tuple(map(int, m)) for m in re.findall(r"^[A-Z] (\d+) (\d+) (\d+)$", prompt, re.M)]
    features = [free / total, waiting, hours * 60 + minutes, len(jobs)]
    for k in range(4):
        features += [running[k][0], running[k][1] / total] if k < len(running) else [-1, -1]
    for k in range(WINDOW):
        features += ([jobs[k][0] / total, jobs[k][1], jobs[k][2], float(jobs[k][0] <= free)] if k < len(jobs)
                     else [-1, -1, -1, -1])
    return features


def learnability(rows: list[dict]) -> dict:
    x = np.array([prompt_features(r["prompt"]) for r in rows])
    y = np.array([ord(r["response"]) - ord("A") for r in rows])
    groups = np.array([r["episode"] for r in rows])
    correct = predicted_departures = right_departures = 0
    for train, test in GroupKFold(5).split(x, y, groups):
        model = HistGradientBoostingClassifier(max_iter=200, learning_rate=0.05, random_state=0)
        guess = model.fit(x[train], y[train]).predict(x[test])
        correct += int((guess == y[test]).sum())
        departs = guess != 0
        predicted_departures += int(departs.sum())
        right_departures += int(((guess == y[test]) & departs).sum())
    return {"rows": len(y), "always_a_accuracy": float((y == 0).mean()), "classifier_accuracy": correct / len(y),
            "teacher_departure_share": float((y != 0).mean()),
            "classifier_departure_share": predicted_departures / len(y),
            "classifier_departure_precision": right_departures / predicted_departures if predicted_departures else None}


@dataclasses.dataclass
class SampledFutureTeacher:
    """Rolls each candidate out with F1 over `samples` imagined futures (windows of the training part moved to the
    clock), or over none when `samples` is 0 (horizon 0); keeps the lowest summed bsld, F1's choice on ties."""

    pool: list[Job]
    samples: int
    horizon: int
    seed: int = 0

    def __post_init__(self) -> None:
        self.rng = np.random.default_rng(self.seed)
        self.name = f"imagined futures (k={self.samples}, h={self.horizon})" if self.samples else "known jobs only"

    def future(self, clock: float) -> list[Job]:
        i = int(self.rng.integers(1, len(self.pool) - self.horizon))
        before = self.pool[i - 1].submit_time
        return [dataclasses.replace(job, submit_time=clock + job.submit_time - before)
                for job in self.pool[i:i + self.horizon]]

    def choose(self, sim: Simulator, state: SchedulerState) -> Job:
        default = F1.choose(state)
        if len(state.queue) == 1:
            return default
        futures = [self.future(state.clock) for _ in range(self.samples)] or [[]]
        best, best_cost = default, math.inf
        for job in [default] + [j for j in state.queue if j is not default]:
            cost = 0.0
            for future in futures:
                trial = sim.clone(future=future)
                trial.commit(job, "rollout")
                trial.run_to_end(F1)
                n = trial.arrival_limit
                submit = np.fromiter((j.submit_time for j in trial.arrivals[:n]), float, n)
                run = np.fromiter((j.run_time for j in trial.arrivals[:n]), float, n)
                cost += float(np.maximum((trial.start[:n] - submit + run) / np.maximum(run, BSLD_TAU), 1.0).sum())
            if cost < best_cost:
                best, best_cost = job, cost
        return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--trace", default=str(paths.SCHEDULING_DIR / DEFAULT_TRACE))
    parser.add_argument("--generated", type=int, default=10, help="generated episodes beside the 8 of the trace")
    parser.add_argument("--samples", type=int, nargs="+", default=[4, 16], help="imagined futures per decision")
    parser.add_argument("--horizon", type=int, default=64, help="jobs in each imagined future")
    parser.add_argument("--backfill", action="store_true", help="EASY backfilling in every episode")
    args = parser.parse_args()
    workload = read_swf(args.trace)
    protocol = Protocol(window=WINDOW)
    cfg = SftConfig(protocol=protocol, episodes=8, episode_length=256, order="F1", generated_episodes=args.generated,
                    generated_procs=(128, 256), generated_loads=(0.9, 1.05, 1.2), backfill=args.backfill)
    began = time.perf_counter()
    rows, report = build_sft(workload, cfg)
    learned = learnability(rows) | {"seconds": time.perf_counter() - began}
    print(f"learnability, {learned['rows']} teacher rows (departing from F1: {learned['teacher_departure_share']:.1%})")
    print(f"  always 'A' (F1): accuracy {learned['always_a_accuracy']:.3f}; classifier on the prompt's numbers: "
          f"{learned['classifier_accuracy']:.3f} ({learned['classifier_accuracy'] / learned['always_a_accuracy']:.3f}"
          f"x), departs at {learned['classifier_departure_share']:.1%} of decisions, right at "
          f"{learned['classifier_departure_precision'] or 0:.0%} of them")

    episodes = [workload.jobs[s:s + 256] for s in episode_starts(workload, cfg)]
    pool = workload.jobs[:held_out_start(workload, protocol)]
    f1 = [sequence_metrics(simulate(jobs, workload.max_procs, F1, window=WINDOW,
                                                        backfill=args.backfill)).avg_bsld for jobs in episodes]
    teachers = [LookaheadTeacher([F1], 128), SampledFutureTeacher(pool, 0, 0)]
    teachers += [SampledFutureTeacher(pool, k, args.horizon) for k in args.samples]
    rows_out = {"F1": {"avg_bsld": float(np.mean(f1)), "vs_f1": 1.0, "seconds": 0.0}}
    print(f"\nteachers on the {len(episodes)} training episodes of the trace, "
          f"{'EASY' if args.backfill else 'no'} backfilling (avg bsld, ratio to F1)")
    print(f"  {'F1':40s} {np.mean(f1):8.1f}  1.000")
    for teacher in teachers:
        began = time.perf_counter()
        bsld = [sequence_metrics(teacher_episode(jobs, workload.max_procs, teacher, WINDOW, args.backfill,
                                                   order="F1")[0]).avg_bsld
                for jobs in episodes]
        name = "true future (the pipeline's), h=128" if isinstance(teacher, LookaheadTeacher) else teacher.name
        rows_out[name] = {"avg_bsld": float(np.mean(bsld)), "vs_f1": float(np.mean(bsld) / np.mean(f1)),
                          "seconds": time.perf_counter() - began}
        print(f"  {name:40s} {np.mean(bsld):8.1f}  {np.mean(bsld) / np.mean(f1):.3f}  "
              f"({rows_out[name]['seconds']:.0f} s)")
    name = "teacher_learnability" + ("_easy" if args.backfill else "")
    write_results(name, {"cpu": cpu_facts(), "trace": args.trace, "backfill": args.backfill,
                         "learnability": learned, "teachers": rows_out, "build_sft": report})


if __name__ == "__main__":
    main()
