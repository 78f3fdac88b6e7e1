"""The LLM's evaluation in one process with every thread (A, the baseline) against one single-threaded process per
thread (B, what `judge.evaluation_workers` chooses): decisions per second of wall time, alternated A B A B.

    python benchmarks/scheduling_eval_workers.py                     # 10 held-out sequences of 96 jobs, 2 pairs
    python benchmarks/scheduling_eval_workers.py --sequences 20 --jobs 256 --pairs 1 --base-model

Run from the repository root after `dvc repro scheduling/dvc.yaml:train` (it reads scheduling/models/ and the
plan's threads in scheduling/reports/plan.json). Both arms call `judge.judge_llms`, the evaluate_policy stage's
own function, with the fine-tuned model (`--base-model`: the untuned one) in the train report's precision, on the
first `--sequences` held-out Lublin sequences cut to `--jobs` jobs, without backfilling. B's workers include their
start (spawning, importing torch, loading the model), as in the stage. Prints each pair's ratio B/A and how many
sequences were scheduled differently (a near tie can go the other way in another batch); writes
reports/benchmarks/scheduling_eval_workers.json with the CPU.
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import time

from common import require, write_results

from frugaltune import paths
from frugaltune.config import load_params
from frugaltune.hardware import cpu_facts
from frugaltune.io import read_json
from frugaltune.resolve import machine, read_plan
from frugaltune.scheduling.evaluation import sequences
from frugaltune.scheduling.judge import LLMSpec, evaluation_workers, judge_llms
from frugaltune.scheduling.settings import load_workload, protocol


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sequences", type=int, default=10)
    parser.add_argument("--jobs", type=int, default=96, help="jobs per sequence (the first of each test sequence)")
    parser.add_argument("--pairs", type=int, default=2)
    parser.add_argument("--base-model", action="store_true", help="the untuned model instead of the fine-tuned")
    args = parser.parse_args()
    with contextlib.chdir(paths.SCHEDULING_DIR):
        require(paths.ADAPTER_DIR, paths.TRACE_COPY, fix="run `dvc repro scheduling/dvc.yaml:train` first")
        params = load_params()
        sp = params.scheduling
        workload, proto = load_workload(paths.TRACE_COPY, sp), protocol(sp)
        tests = [jobs[:args.jobs] for jobs in sequences(workload, proto)[:args.sequences]]
        bf16 = bool(read_json(paths.PIPELINE_RUN.train_report).get("bf16", False))
        threads = machine(params.train.precision, plan=read_plan())["threads"]
        adapter = None if args.base_model else str(paths.ADAPTER_DIR)
        spec = LLMSpec(str(paths.BASE_MODEL.resolve()), adapter and str(paths.ADAPTER_DIR.resolve()),
                       "base" if args.base_model else "finetuned", None,
                       {"batch_size": sp.llm.batch_size, "max_running": sp.sft.max_running, "bf16": bf16,
                        "order": sp.order})
    workers = evaluation_workers(threads, len(tests))
    arms = {"A": (1, threads), "B": (workers, max(1, threads // workers))}
    print(f"{len(tests)} sequences of {args.jobs} jobs, {'bf16' if bf16 else 'fp32'}, {spec.name}: "
          f"A = 1 process x {threads} threads, B = {workers} processes x {arms['B'][1]} thread(s)")
    rates: dict[str, list[float]] = {"A": [], "B": []}
    schedules: dict[str, list] = {}
    for pair in range(args.pairs):
        for arm, (processes, per_process) in arms.items():
            began = time.perf_counter()
            summaries, results, _ = judge_llms({"trace": (tests, workload.max_procs, proto.window)}, {"llm": spec},
                                               None, processes, per_process, modes={"no_backfill": False},
                                               log=lambda _: None)
            wall = time.perf_counter() - began
            summary = summaries["trace"]["no_backfill"]["llm"]
            rates[arm].append(summary["decisions"] / wall)
            schedules[arm] = [r.schedule() for r in results["trace"]["no_backfill"]["llm"]]
            print(f"pair {pair} {arm}: {summary['decisions']} decisions ({summary['model_calls']} model calls) in "
                  f"{wall:.1f} s = {rates[arm][-1]:.2f} decisions/s, avg bsld {summary['avg_bsld']:.2f}", flush=True)
        print(f"pair {pair}: B/A {rates['B'][-1] / rates['A'][-1]:.2f}x")
    ratios = [b / a for a, b in zip(rates["A"], rates["B"])]
    differ = sum(a != b for a, b in zip(schedules["A"], schedules["B"]))
    print(f"B/A median {statistics.median(ratios):.2f}x over {args.pairs} pairs; {differ} of {len(tests)} sequences "
          f"scheduled differently by A and B")
    write_results("scheduling_eval_workers", {
        "cpu": cpu_facts(), "sequences": len(tests), "jobs": args.jobs, "precision": "bf16" if bf16 else "fp32",
        "policy": spec.name, "threads": threads, "arms": {k: {"processes": p, "threads": t} for k, (p, t) in arms.items()},
        "decisions_per_s": rates, "ratios_b_over_a": ratios, "sequences_scheduled_differently": differ})


if __name__ == "__main__":
    main()
