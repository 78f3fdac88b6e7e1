"""Can a student learn what the lookahead teacher knows? Its answers against what a prompt shows, and teachers that
know only what a policy could know.

    python benchmarks/teacher_learnability.py                 # the params' episodes (8 trace + 10 generated), ~8 min on 2 cores
    python benchmarks/teacher_learnability.py --generated 0 --samples 4
    python benchmarks/teacher_learnability.py --backfill      # EASY episodes: the LLM picks the head job

Run from the repository root. Two measurements on the training episodes `build_sft` labels, as the scheduling
pipeline's `--params` (default scheduling/params.yaml: its trace, window, lettering, episodes, generated episodes
and teacher) make it label them, every row kept (no `agree_share`):

1. **Learnability.** Every decision's prompt (the text the LLM is fine-tuned on) parsed back into numbers: free
   processors, queue length, time of day, the four listed running jobs, each visible job's processors, requested
   minutes, waited minutes and whether it fits now. A gradient-boosted classifier (scikit-learn) predicts the
   teacher's letter from them, cross-validated by episode (no episode in both folds). If it does no better than
   always answering "A" (F1's pick), the teacher's departures from F1 are not readable from the prompt, and a
   fine-tuned LLM, which sees the same text, should not be expected to learn them either.
2. **Teachers without clairvoyance.** The pipeline's teacher rolls every candidate out over the *true* next
   arrivals. Beside it, on the trace's training episodes: the same teacher at horizon 0 (no arrivals: only the jobs
   already known), and over `--samples` imagined futures (windows of `--horizon` consecutive jobs drawn from the training
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
from pathlib import Path

import numpy as np
from common import write_results
from sklearn.ensemble import HistGradientBoostingClassifier
from sklearn.model_selection import GroupKFold

from frugaltune import paths
from frugaltune.config import load_params
from frugaltune.hardware import cpu_facts
from frugaltune.scheduling.evaluation import held_out_start
from frugaltune.scheduling.metrics import sequence_metrics
from frugaltune.scheduling.policies import ScorePolicy
from frugaltune.scheduling.settings import load_workload, sft_config, teacher
from frugaltune.scheduling.sft import LookaheadTeacher, build_sft, episode_starts, rollout_cost, teacher_episode
from frugaltune.scheduling.simulator import SchedulerState, Simulator, simulate
from frugaltune.scheduling.swf import Job


def prompt_features(prompt: str, window: int) -> list[float]:
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
    for k in range(window):
        features += ([jobs[k][0] / total, jobs[k][1], jobs[k][2], float(jobs[k][0] <= free)] if k < len(jobs)
                     else [-1, -1, -1, -1])
    return features


def learnability(rows: list[dict], window: int) -> dict:
    x = np.array([prompt_features(r["prompt"], window) for r in rows])
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
    """Rolls each candidate out with `policy` over `samples` imagined futures (windows of `horizon` jobs of the
    training part moved to the clock, the same for every candidate); keeps the lowest summed bsld, the policy's own
    choice on ties (as `LookaheadTeacher`, whose rollouts see the true future)."""

    pool: list[Job]
    samples: int
    horizon: int
    policy: ScorePolicy
    seed: int = 0

    def __post_init__(self) -> None:
        self.rng = np.random.default_rng(self.seed)
        self.name = f"imagined futures (k={self.samples}, h={self.horizon})"

    def future(self, clock: float) -> list[Job]:
        i = int(self.rng.integers(1, len(self.pool) - self.horizon))
        before = self.pool[i - 1].submit_time
        return [dataclasses.replace(job, submit_time=clock + job.submit_time - before)
                for job in self.pool[i:i + self.horizon]]

    def choose(self, sim: Simulator, state: SchedulerState) -> Job:
        default = self.policy.choose(state)
        if len(state.queue) == 1:
            return default
        futures = [self.future(state.clock) for _ in range(self.samples)]
        best, best_cost = default, math.inf
        for job in [default] + [j for j in state.queue if j is not default]:
            cost = sum(rollout_cost(sim, job, self.policy, 0, future=future) for future in futures)
            if cost < best_cost:
                best, best_cost = job, cost
        return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--params", default=str(paths.SCHEDULING_DIR / "params.yaml"),
                        help="the scheduling pipeline's params: its trace, window, episodes and teacher")
    parser.add_argument("--generated", type=int, default=None, help="generated episodes (default: the params')")
    parser.add_argument("--samples", type=int, nargs="+", default=[4, 16], help="imagined futures per decision")
    parser.add_argument("--horizon", type=int, default=64, help="jobs in each imagined future")
    parser.add_argument("--backfill", action="store_true", help="EASY backfilling in every episode")
    args = parser.parse_args()
    sp = load_params(args.params).scheduling
    workload = load_workload(Path(args.params).parent / sp.trace, sp)
    cfg = dataclasses.replace(sft_config(sp), backfill=args.backfill, agree_share=None,
                              generated_episodes=sft_config(sp).generated_episodes if args.generated is None
                              else args.generated)
    window = cfg.protocol.window
    began = time.perf_counter()
    rows, report = build_sft(workload, cfg)
    learned = learnability(rows, window) | {"seconds": time.perf_counter() - began}
    print(f"learnability, {learned['rows']} teacher rows (departing from F1: {learned['teacher_departure_share']:.1%})")
    print(f"  always 'A' (F1): accuracy {learned['always_a_accuracy']:.3f}; classifier on the prompt's numbers: "
          f"{learned['classifier_accuracy']:.3f} ({learned['classifier_accuracy'] / learned['always_a_accuracy']:.3f}"
          f"x), departs at {learned['classifier_departure_share']:.1%} of decisions, right at "
          f"{learned['classifier_departure_precision'] or 0:.0%} of them")

    episodes = [workload.jobs[s:s + cfg.episode_length] for s in episode_starts(workload, cfg)]
    pool = workload.jobs[:held_out_start(workload, cfg.protocol)]
    pipeline = teacher(sp)
    policy = pipeline.rollout_policies[0]
    baseline = [sequence_metrics(simulate(jobs, workload.max_procs, policy, window=window,
                                          backfill=args.backfill)).avg_bsld for jobs in episodes]
    teachers = {f"true future (the pipeline's), h={pipeline.horizon}": pipeline,
                "known jobs only": LookaheadTeacher(pipeline.rollout_policies, 0)}
    teachers |= {f"imagined futures (k={k}, h={args.horizon})": SampledFutureTeacher(pool, k, args.horizon, policy)
                 for k in args.samples}
    rows_out = {policy.name: {"avg_bsld": float(np.mean(baseline)), "vs_f1": 1.0, "seconds": 0.0}}
    print(f"\nteachers on the {len(episodes)} training episodes of the trace, "
          f"{'EASY' if args.backfill else 'no'} backfilling (avg bsld, ratio to {policy.name})")
    print(f"  {policy.name:40s} {np.mean(baseline):8.1f}  1.000")
    for name, chooser in teachers.items():
        began = time.perf_counter()
        bsld = [sequence_metrics(teacher_episode(jobs, workload.max_procs, chooser, window, args.backfill,
                                                 order=cfg.order)[0]).avg_bsld for jobs in episodes]
        rows_out[name] = {"avg_bsld": float(np.mean(bsld)), "vs_f1": float(np.mean(bsld) / np.mean(baseline)),
                          "seconds": time.perf_counter() - began}
        print(f"  {name:40s} {np.mean(bsld):8.1f}  {np.mean(bsld) / np.mean(baseline):.3f}  "
              f"({rows_out[name]['seconds']:.0f} s)")
    name = "teacher_learnability" + ("_easy" if args.backfill else "")
    write_results(name, {"cpu": cpu_facts(), "params": args.params, "backfill": args.backfill,
                         "learnability": learned, "teachers": rows_out, "build_sft": report})


if __name__ == "__main__":
    main()
