"""The fine-tuned LLM policy against the untuned base model, the heuristics and the teacher, in the simulator.
Run by DVC (in scheduling/) as:  python -m stages.evaluate_policy

Every policy runs on the same test sequences of two workloads: the held-out part of the trace
(`scheduling.evaluation`) and the generated second workload (`data/second_workload.swf`, `scheduling.second_workload`,
never trained on); at window `scheduling.window`, without backfilling and with EASY (the policy picks the head job,
EASY fills around it), in the precision and on the threads training ran with (`reports/train.json`: the plan's;
`scheduling.llm.threads` set wins). The policies: FCFS, SJF, WFP3,
UNICEF, F1, the base model with the adapter in `models/adapter` ("finetuned") and the base model alone ("base",
when `scheduling.llm.evaluate_base`); the lookahead teacher's own bsld (its ceiling) comes from
`reports/simulate_baselines.json`. The LLMs choose by constrained choice among the visible jobs' letters, all
sequences in lockstep; for each LLM, the share of decisions where it departs from F1 and the share of those where
the teacher makes the same choice (`judge.DepartureLog`). When the adapter cannot be loaded, the
`scheduling.llm.fallback` heuristic stands in, its numbers are reported under "fallback" (never "finetuned"), and
the register stage then refuses to register.

Writes `reports/evaluate.json`: at the top, as the reused register stage reads it, the trace in the mode
`scheduling.backfill` names (`finetuned.avg_bsld` is the registry gate, lower is better; `baseline` is the base
model, as in the classification pipeline; `heuristics`); under `workloads`, the side-by-side table (per workload,
per mode, per policy: avg bsld mean/std, mean wait, the LLMs' departures). `reports/metrics/evaluate.json` (numbers
only); `reports/plots/evaluate_policy_queue_cdf.csv` and `..._bsld.csv` (dvc plots); `reports/figures/
queue_length_cdf.png` and `reports/figures/policy_bsld.png` (the trace, the gate's mode).
"""

from __future__ import annotations


from frugaltune import integrity, paths
from frugaltune.config import Params
from frugaltune.entry import stage_main
from frugaltune.io import read_json, write_json, write_metrics, write_text
from frugaltune.scheduling.evaluation import sequences
from frugaltune.scheduling.judge import MODES, compact, judge
from frugaltune.scheduling.llm_policy import LLMPolicy, load_llm_policy
from frugaltune.scheduling.plots import plot_bsld, plot_queue_cdf, queue_cdf_table
from frugaltune.scheduling.policies import HEURISTICS
from frugaltune.scheduling.settings import load_workload, protocol, second_protocol, teacher
from frugaltune.scheduling.swf import read_swf


def table(summaries: dict, ceiling: dict, rename: dict) -> dict:
    """{mode: {policy: compact summary}} with the teacher's ceiling (from simulate_baselines) as a row."""
    return {mode: {rename.get(key, key): compact(s) for key, s in summaries[mode].items()}
            | {"teacher": {"avg_bsld": ceiling[mode]["avg_bsld_mean"], "avg_bsld_std": ceiling[mode]["avg_bsld_std"],
                           "mean_wait": ceiling[mode]["mean_wait_mean"]}} for mode in MODES}


def run(params: Params) -> dict:
    sp = params.scheduling
    workload, proto = load_workload(paths.TRACE_COPY, sp), protocol(sp)
    second, second_proto = read_swf(paths.SECOND_WORKLOAD), second_protocol(sp)
    baselines = read_json(paths.report("simulate_baselines"))
    llm = sp.llm
    # As training ran (the plan's precision, measured faster on this CPU, and threads); the train stage records them.
    trained = read_json(paths.PIPELINE_RUN.train_report)
    bf16 = bool(trained.get("bf16", False))
    policies = dict(HEURISTICS)
    integrity.verify_outs(paths.BASE_MODEL, paths.ADAPTER_DIR)  # as DVC recorded them (frugaltune/integrity.py)
    threads = llm.threads or trained.get("threads")  # None: a train report without them, torch's own count
    options = {"threads": threads, "batch_size": llm.batch_size, "max_running": sp.sft.max_running,
               "bf16": bf16, "order": sp.order}
    policies["finetuned"] = load_llm_policy(paths.BASE_MODEL, paths.ADAPTER_DIR, name="finetuned",
                                            fallback=llm.fallback, **options)
    if llm.evaluate_base:
        policies["base"] = load_llm_policy(paths.BASE_MODEL, None, name="base", **options)
    # A fallback heuristic's numbers must never pass for the model's: they go under "fallback", so the register
    # stage finds no `finetuned.avg_bsld` and refuses to register an adapter that was never judged.
    loaded = isinstance(policies["finetuned"], LLMPolicy)
    rename = {} if loaded else {"finetuned": "fallback"}
    lookahead = teacher(sp)
    summaries, results = judge(sequences(workload, proto), workload.max_procs, policies, proto.window, lookahead)
    second_summaries, _ = judge(sequences(second, second_proto), second.max_procs, policies, second_proto.window,
                                lookahead)
    gate = "easy" if sp.backfill else "no_backfill"
    main = summaries[gate]
    heuristics = {name: main[name] for name in HEURISTICS}
    best = min(heuristics, key=lambda n: heuristics[n]["avg_bsld"])
    tuned = main["finetuned"]["avg_bsld"]
    workloads = {
        "trace": {"max_procs": workload.max_procs, "sequences": proto.n_sequences,
                  "sequence_length": proto.sequence_length, **table(summaries, baselines["teacher"], rename)},
        "second_workload": {"max_procs": second.max_procs, "sequences": second_proto.n_sequences,
                            "sequence_length": second_proto.sequence_length,
                            **table(second_summaries, baselines["second_workload"]["teacher"], rename)}}
    report = {
        "task": "scheduling",
        "sequences": proto.n_sequences, "sequence_length": proto.sequence_length, "window": proto.window,
        "backfill": sp.backfill,
        "precision": "bf16" if bf16 else "fp32",
        "threads": threads,
        "finetuned_policy": policies["finetuned"].name,  # "F1 (fallback: ...)" when the adapter did not load
        ("finetuned" if loaded else "fallback"): main["finetuned"],
        **({"baseline": main["base"]} if "base" in main else {}),
        "heuristics": heuristics,
        "best_heuristic": best,
        "finetuned_vs_best_heuristic": tuned / heuristics[best]["avg_bsld"],
        "finetuned_beats_fcfs_and_sjf": bool(tuned < heuristics["FCFS"]["avg_bsld"]
                                             and tuned < heuristics["SJF"]["avg_bsld"]),
        "teacher": baselines["teacher_name"],
        "workloads": workloads,
    }
    write_json(paths.report("evaluate"), report)
    metrics = {f"{rename.get(k, k)}.avg_bsld": v["avg_bsld"] for k, v in main.items()}
    metrics["finetuned_vs_best_heuristic"] = report["finetuned_vs_best_heuristic"]
    for name, w in workloads.items():
        for mode in MODES:
            for key, row in w[mode].items():
                metrics[f"{name}.{mode}.{key}.avg_bsld"] = row["avg_bsld"]
                for share in ("departure_share", "teacher_agreement_share"):
                    if row.get("departures", {}).get(share) is not None:
                        metrics[f"{name}.{mode}.{key}.{share}"] = row["departures"][share]
    write_metrics(paths.metrics("evaluate"), metrics)
    gated = {rename.get(k, k): v for k, v in results[gate].items()}
    write_text(paths.plot("evaluate_policy", "queue_cdf"), queue_cdf_table(gated))
    bars = {k: (v["avg_bsld"], v["avg_bsld_std"]) for k, v in workloads["trace"][gate].items()}
    write_text(paths.plot("evaluate_policy", "bsld"), "policy,avg_bsld\n" + "".join(
        f"{k},{mean:.4f}\n" for k, (mean, _) in bars.items()))
    title = f"{proto.n_sequences} held-out sequences of {proto.sequence_length} jobs, window {proto.window}"
    plot_queue_cdf(gated, paths.FIGURES / "queue_length_cdf.png", title)
    plot_bsld({k: m for k, (m, _) in bars.items()}, {k: s for k, (_, s) in bars.items()},
              paths.FIGURES / "policy_bsld.png", title)
    for name, w in workloads.items():
        print(f"evaluate_policy: {name} ({w['max_procs']} procs), avg bsld without backfilling | with EASY")
        for key in w["no_backfill"]:
            print(f"  {key:10s} {w['no_backfill'][key]['avg_bsld']:10.2f} | {w['easy'][key]['avg_bsld']:10.2f}")
    print(f"evaluate_policy: {policies['finetuned'].name} {tuned:.2f} vs best heuristic {best} "
          f"{heuristics[best]['avg_bsld']:.2f} (ratio {report['finetuned_vs_best_heuristic']:.3f}, {gate})")
    return report


def main() -> None:
    stage_main("evaluate_policy", run, ValueError, FileNotFoundError)


if __name__ == "__main__":
    main()
