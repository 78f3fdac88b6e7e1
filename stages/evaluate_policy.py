"""The fine-tuned LLM policy against the untuned base model and the heuristics, in the simulator.
Run by DVC (in scheduling/) as:  python -m stages.evaluate_policy

Every policy runs on the same held-out test sequences (`scheduling.evaluation`, window `scheduling.window`,
EASY backfilling as `scheduling.backfill`), in the precision training ran in (`reports/train.json`): FCFS, SJF, WFP3, UNICEF, F1, the base model with the adapter in
`models/adapter` ("finetuned") and the base model alone ("base", when `scheduling.llm.evaluate_base`). The LLMs
choose by constrained choice among the visible jobs' letters, all sequences in lockstep (one batched forward per
round). When the adapter cannot be loaded, the `scheduling.llm.fallback` heuristic stands in, its numbers are
reported under "fallback" (never "finetuned"), and the register stage then refuses to register.

Writes `reports/evaluate.json` under the name the reused register stage reads (`finetuned.avg_bsld` is the
registry gate, lower is better; `baseline` is the base model, as in the classification pipeline), with every
policy's mean/std avg bsld, mean wait, per-sequence values and the LLMs' decisions/s; `reports/metrics/evaluate.json`;
`reports/plots/evaluate_policy_queue_cdf.csv` and `..._bsld.csv` (dvc plots); `reports/figures/queue_length_cdf.png`
and `reports/figures/policy_bsld.png`.
"""

from __future__ import annotations

import sys
import time

import numpy as np

from frugaltune import paths
from frugaltune.config import Params, ParamsError, load_params
from frugaltune.faults import stage_errors
from frugaltune.io import read_json, write_json, write_metrics, write_text
from frugaltune.scheduling.evaluation import sequences
from frugaltune.scheduling.llm_policy import LLMPolicy, load_llm_policy
from frugaltune.scheduling.metrics import sequence_metrics
from frugaltune.scheduling.plots import plot_bsld, plot_queue_cdf, queue_cdf_table
from frugaltune.scheduling.policies import HEURISTICS
from frugaltune.scheduling.settings import load_workload, protocol
from frugaltune.scheduling.simulator import simulate_batch


def summarise(results, seconds: float, policy=None) -> dict:
    values = [sequence_metrics(r) for r in results]
    bsld = np.array([m.avg_bsld for m in values])
    summary = {"avg_bsld": float(bsld.mean()), "avg_bsld_std": float(bsld.std(ddof=1)) if len(bsld) > 1 else 0.0,
               "mean_wait": float(np.mean([m.mean_wait for m in values])),
               "mean_queue_length": float(np.mean([m.mean_queue_length for m in values])),
               "decisions": int(sum(r.decisions for r in results)), "seconds": seconds,
               "per_sequence_avg_bsld": [float(v) for v in bsld]}
    if isinstance(policy, LLMPolicy):
        summary.update({k: v for k, v in policy.stats().items() if k != "decisions"})
    return summary


def run(params: Params) -> dict:
    sp = params.scheduling
    workload = load_workload(paths.TRACE_COPY, sp)
    proto = protocol(sp)
    tests = sequences(workload, proto)
    llm = sp.llm
    # As training ran (the plan's precision, measured faster on this CPU); the train stage records it.
    bf16 = bool(read_json(paths.PIPELINE_RUN.train_report).get("bf16", False))
    policies = dict(HEURISTICS)
    policies["finetuned"] = load_llm_policy(paths.BASE_MODEL, paths.ADAPTER_DIR, name="finetuned",
                                            fallback=llm.fallback, threads=llm.threads, batch_size=llm.batch_size,
                                            max_running=sp.sft.max_running, bf16=bf16,
                                            order=sp.order)
    if llm.evaluate_base:
        policies["base"] = load_llm_policy(paths.BASE_MODEL, None, name="base", threads=llm.threads,
                                           batch_size=llm.batch_size, max_running=sp.sft.max_running, bf16=bf16,
                                            order=sp.order)
    results, summaries = {}, {}
    for key, policy in policies.items():
        began = time.perf_counter()
        results[key] = simulate_batch(tests, workload.max_procs, policy, backfill=sp.backfill, window=proto.window)
        summaries[key] = summarise(results[key], time.perf_counter() - began, policy)
        print(f"evaluate_policy: {policy.name:10s} avg bsld {summaries[key]['avg_bsld']:10.2f} "
              f"({summaries[key]['seconds']:.1f} s)", flush=True)
    heuristics = {name: summaries[name] for name in HEURISTICS}
    best = min(heuristics, key=lambda n: heuristics[n]["avg_bsld"])
    tuned = summaries["finetuned"]["avg_bsld"]
    # A fallback heuristic's numbers must never pass for the model's: they go under "fallback", so the register
    # stage finds no `finetuned.avg_bsld` and refuses to register an adapter that was never judged.
    loaded = isinstance(policies["finetuned"], LLMPolicy)
    report = {
        "task": "scheduling",
        "sequences": proto.n_sequences, "sequence_length": proto.sequence_length, "window": proto.window,
        "backfill": sp.backfill,
        "precision": "bf16" if bf16 else "fp32",
        "finetuned_policy": policies["finetuned"].name,  # "F1 (fallback: ...)" when the adapter did not load
        ("finetuned" if loaded else "fallback"): summaries["finetuned"],
        **({"baseline": summaries["base"]} if "base" in summaries else {}),
        "heuristics": heuristics,
        "best_heuristic": best,
        "finetuned_vs_best_heuristic": tuned / heuristics[best]["avg_bsld"],
        "finetuned_beats_fcfs_and_sjf": bool(tuned < heuristics["FCFS"]["avg_bsld"]
                                             and tuned < heuristics["SJF"]["avg_bsld"]),
    }
    write_json(paths.report("evaluate"), report)
    write_metrics(paths.metrics("evaluate"), {f"{k if k != 'finetuned' or loaded else 'fallback'}.avg_bsld":
                                              v["avg_bsld"] for k, v in summaries.items()}
                  | {"finetuned_vs_best_heuristic": report["finetuned_vs_best_heuristic"]})
    write_text(paths.plot("evaluate_policy", "queue_cdf"), queue_cdf_table(results))
    write_text(paths.plot("evaluate_policy", "bsld"), "policy,avg_bsld\n" + "".join(
        f"{k},{v['avg_bsld']:.4f}\n" for k, v in summaries.items()))
    title = f"{proto.n_sequences} held-out sequences of {proto.sequence_length} jobs, window {proto.window}"
    plot_queue_cdf(results, paths.FIGURES / "queue_length_cdf.png", title)
    plot_bsld({k: v["avg_bsld"] for k, v in summaries.items()}, {k: v["avg_bsld_std"] for k, v in summaries.items()},
              paths.FIGURES / "policy_bsld.png", title)
    print(f"evaluate_policy: {policies['finetuned'].name} {tuned:.2f} vs best heuristic {best} "
          f"{heuristics[best]['avg_bsld']:.2f} "
          f"(ratio {report['finetuned_vs_best_heuristic']:.3f})")
    return report


def main() -> None:
    with stage_errors("evaluate_policy"):
        try:
            run(load_params())
        except (ParamsError, ValueError, FileNotFoundError) as exc:
            sys.exit(f"evaluate_policy: {exc}")


if __name__ == "__main__":
    main()
