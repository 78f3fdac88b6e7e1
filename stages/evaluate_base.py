"""The untuned base model as a scheduling policy, in the simulator.  Run by DVC (in scheduling/) as:
python -m stages.evaluate_base

The comparison the study makes (a model that was never fine-tuned), in a stage of its own so that DVC keeps its
result across retrains: it reads the base model, the three evaluation workloads and the params that shape their
sequences and prompts, and nothing training writes (not models/adapter, reports/train.json, reports/plan.json or
the SFT data). evaluate_policy puts its numbers in the table beside the fine-tuned model's.

The base model (`models/base`, prompts templated as training's "auto" would) chooses by constrained choice among
the visible jobs' letters (`llm_policy.LLMPolicy`, the same prompt as the fine-tuned model's, `sft.encode_state`),
on the same test sequences as every policy (`settings.evaluation_workloads`: the estimate-and-user workload's held-out
part, the second workload, the trace), at `scheduling.window`, without backfilling and with EASY; the lookahead
teacher is asked at its departures from F1 (`judge.DepartureLog`). Precision and threads are the plan's, read from
reports/plan.json (`frugaltune.resolve.machine`; `scheduling.llm.threads` set wins): DVC depends on those two keys
of the plan only (`reports/plan.json: machine.precision, machine.threads` in dvc.yaml), which a retrain on the same
machine leaves as they were, though the rest of the plan changes with the training data. With
`scheduling.llm.evaluate_base: false` the model is not loaded and the report says so.

Writes `reports/evaluate_base.json`: per workload its machine size and sequences, per mode the base model's
summary (avg bsld mean/std and per sequence, mean wait, decisions, model calls, decisions/s, departures) and its
queue-length CDF (`queue_cdf`: lengths and fractions, which evaluate_policy draws beside the other policies').
"""

from __future__ import annotations

from frugaltune import integrity, paths, resolve
from frugaltune.config import Params
from frugaltune.entry import stage_main
from frugaltune.io import write_json
from frugaltune.planner.assembly import PlanError
from frugaltune.scheduling.judge import MODES, judge_workloads
from frugaltune.scheduling.llm_policy import load_llm_policy
from frugaltune.scheduling.settings import evaluation_workloads, teacher


def run(params: Params) -> dict:
    sp = params.scheduling
    if not sp.llm.evaluate_base:
        report = {"evaluated": False, "why": "scheduling.llm.evaluate_base is false"}
        write_json(paths.report("evaluate_base"), report)
        print("evaluate_base: not evaluated (scheduling.llm.evaluate_base: false)")
        return report
    decided = resolve.machine(params.train.precision, threads=sp.llm.threads)  # the plan's, read (PlanError if none)
    integrity.verify_outs(paths.BASE_MODEL)  # as DVC recorded it (frugaltune/integrity.py)
    policy = load_llm_policy(paths.BASE_MODEL, None, name="base", threads=decided["threads"],
                             batch_size=sp.llm.batch_size, max_running=sp.sft.max_running, bf16=decided["bf16"],
                             order=sp.order)
    workloads = evaluation_workloads(sp, paths.USER_WORKLOAD, paths.SECOND_WORKLOAD, paths.TRACE_COPY)
    summaries, cdfs = judge_workloads(workloads, {"base": policy}, teacher(sp))
    report = {
        "evaluated": True, "policy": "base", "window": sp.window, "precision": decided["precision"],
        "precision_why": decided["precision_why"], "threads": decided["threads"],
        "workloads": {name: {"max_procs": workload.max_procs, "sequences": proto.n_sequences,
                             "sequence_length": proto.sequence_length,
                             **{mode: summaries[name][mode]["base"] for mode in MODES}}
                      for name, (workload, proto) in workloads.items()},
        "queue_cdf": {name: {mode: cdfs[name][mode]["base"] for mode in MODES} for name in workloads},
    }
    write_json(paths.report("evaluate_base"), report)
    for name, w in report["workloads"].items():
        print(f"evaluate_base: {name} ({w['max_procs']} procs): avg bsld {w['no_backfill']['avg_bsld']:.2f} without "
              f"backfilling, {w['easy']['avg_bsld']:.2f} with EASY ({decided['precision']}, {decided['threads']} "
              f"threads)")
    return report


def main() -> None:
    stage_main("evaluate_base", run, ValueError, FileNotFoundError, PlanError)


if __name__ == "__main__":
    main()
