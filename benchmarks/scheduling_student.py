"""The fine-tuned scheduler alone on the held-out trace, one mode: its avg bsld and how often it departs from F1.

    python benchmarks/scheduling_student.py                  # 20 held-out Lublin sequences, no backfilling
    python benchmarks/scheduling_student.py --sequences 5 --backfill

Run from the repository root after `dvc repro scheduling/dvc.yaml:train` (it reads scheduling/models/base and
scheduling/models/adapter). The quick check of a retrained student, between the train stage and the full
`evaluate_policy` stage, which judges both LLMs in both modes on both workloads (about 1.5 h on a 2-core CPU in
fp32): the same library calls (`load_llm_policy`, `simulate_batch` with a `judge.DepartureLog` asking the pipeline's
teacher at each departure), the same precision (the train report's), for one mode on the trace only. Prints the
student's avg bsld beside F1's on the same sequences (the named baseline), its departures from F1 and the teacher's
agreement with them, and its decisions/s; writes reports/benchmarks/scheduling_student.json with the CPU.
"""

from __future__ import annotations

import argparse
import contextlib
import time

from common import require, write_results

from frugaltune import paths
from frugaltune.config import load_params
from frugaltune.hardware import cpu_facts
from frugaltune.io import read_json
from frugaltune.scheduling.evaluation import sequences
from frugaltune.scheduling.judge import DepartureLog, summarise
from frugaltune.scheduling.llm_policy import load_llm_policy
from frugaltune.scheduling.policies import F1
from frugaltune.scheduling.settings import load_workload, protocol, teacher
from frugaltune.scheduling.simulator import simulate_batch


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sequences", type=int, default=None, help="the first N test sequences (default: all)")
    parser.add_argument("--backfill", action="store_true", help="EASY backfilling (the LLM picks the head job)")
    args = parser.parse_args()
    # The pipeline's relative paths (models/, data/, reports/) start in scheduling/; the results go to the root's.
    with contextlib.chdir(paths.SCHEDULING_DIR):
        require(paths.ADAPTER_DIR, paths.TRACE_COPY, fix="run `dvc repro scheduling/dvc.yaml:train` first")
        sp = load_params().scheduling
        workload, proto = load_workload(paths.TRACE_COPY, sp), protocol(sp)
        tests = sequences(workload, proto)[:args.sequences]
        bf16 = bool(read_json(paths.PIPELINE_RUN.train_report).get("bf16", False))
        student = load_llm_policy(paths.BASE_MODEL, paths.ADAPTER_DIR, name="finetuned",
                                  batch_size=sp.llm.batch_size, threads=sp.llm.threads,
                                  max_running=sp.sft.max_running, bf16=bf16, order=sp.order)
        watch = DepartureLog(teacher(sp))
    began = time.perf_counter()
    runs = simulate_batch(tests, workload.max_procs, student, backfill=args.backfill, window=proto.window,
                          on_decision=watch)
    tuned = summarise(runs, time.perf_counter() - began)
    f1 = summarise(simulate_batch(tests, workload.max_procs, F1, backfill=args.backfill, window=proto.window), 0.0)
    departures = watch.report()
    stats = student.stats() if hasattr(student, "stats") else {}
    print(f"{len(tests)} held-out sequences, {'EASY' if args.backfill else 'no'} backfilling, "
          f"{'bf16' if bf16 else 'fp32'}: student avg bsld {tuned['avg_bsld']:.2f}, F1 {f1['avg_bsld']:.2f} "
          f"(ratio {tuned['avg_bsld'] / f1['avg_bsld']:.3f})")
    print(f"departures from F1: {departures['departures']} of {departures['decisions']} decisions with a choice; "
          f"the teacher agrees with {departures['teacher_agrees']}; {tuned['seconds']:.0f} s, "
          f"{stats.get('decisions_per_s', 0.0):.2f} decisions/s")
    write_results("scheduling_student" + ("_easy" if args.backfill else ""), {
        "cpu": cpu_facts(), "sequences": len(tests), "backfill": args.backfill, "precision": "bf16" if bf16 else "fp32",
        "policy": student.name, "student": tuned, "F1": f1, "departures": departures, "stats": stats})


if __name__ == "__main__":
    main()
