"""The fine-tuned LLM policy against the untuned base model, the baselines and the teacher, in the simulator.
Run by DVC (in scheduling/) as:  python -m stages.evaluate_policy

Every policy runs on the same test sequences of three workloads (`settings.evaluation_workloads`): the held-out part
of the estimate-and-user workload (`data/user_workload.swf`, `scheduling.evaluation`: the one the SFT episodes'
training part comes from), the second workload (`data/second_workload.swf`, `scheduling.second_workload`, never
trained on) and the held-out part of the trace (`data/trace.swf`; on the Lublin model's, requested time = run time:
the oracle case, where matching F1 is the expected result); at window `scheduling.window`, without backfilling and
with EASY (the policy picks the head job, EASY fills around it; the -pred baselines reserve and backfill on their
predictions, killing a backfilled job at its estimate), in the precision and on the threads training ran with
(`reports/train.json`: the plan's; `scheduling.llm.threads` set wins). The policies: FCFS, SJF, WFP3, UNICEF, F1 on
estimates, SJF-pred and F1-pred on Tsafrir's predictions, the base model with the adapter in `models/adapter`
("finetuned"); the untuned base model ("base") is judged by the evaluate_base stage (cached across retrains) and
read from `reports/evaluate_base.json`; the lookahead teacher's own bsld (its ceiling) from
`reports/simulate_baselines.json`. The LLMs choose by constrained choice among the visible jobs' letters, all
sequences in lockstep; for each LLM, the share of decisions where it departs from F1 and the share of those where
the teacher makes the same choice (`judge.DepartureLog`). When the adapter cannot be loaded, the
`scheduling.llm.fallback` heuristic stands in, its numbers are reported under "fallback" (never "finetuned"), and
the register stage then refuses to register.

Writes `reports/evaluate.json`: at the top, as the reused register stage reads it, the estimate-and-user workload in
the mode `scheduling.backfill` names (`finetuned.avg_bsld` is the registry gate, lower is better; `baseline` is the
base model, as in the classification pipeline; `heuristics`: every baseline), and `targets`: the fine-tuned
model's avg bsld over F1's and F1-pred's per workload and mode (issue 95's done-when: <= 0.90 x F1 and <= F1-pred
on the estimate-and-user workload in both modes, < F1 on the second); under `workloads`, the side-by-side table
(per workload, per mode, per policy: avg bsld mean/std, mean wait, the LLMs' departures).
`reports/metrics/evaluate.json` (numbers only); `reports/plots/evaluate_policy_queue_cdf.csv` and `..._bsld.csv`
(dvc plots); `reports/figures/queue_length_cdf.png` and `reports/figures/policy_bsld.png` (the estimate-and-user
workload, the gate's mode).
"""

from __future__ import annotations


from frugaltune import integrity, paths
from frugaltune.config import Params
from frugaltune.entry import stage_main
from frugaltune.io import read_json, write_json, write_metrics, write_text
from frugaltune.scheduling.judge import MODES, compact, judge_workloads
from frugaltune.scheduling.llm_policy import LLMPolicy, load_llm_policy
from frugaltune.scheduling.plots import plot_bsld, plot_queue_cdf, queue_cdf_table
from frugaltune.scheduling.policies import BASELINES
from frugaltune.scheduling.settings import evaluation_workloads, teacher

CEILINGS = {"user_workload": ("user_workload",), "second_workload": ("second_workload",), "trace": ()}
"""Where each workload's teacher ceiling is in reports/simulate_baselines.json (the trace's at its top level)."""


def table(summaries: dict, ceiling: dict, rename: dict) -> dict:
    """{mode: {policy: compact summary}} with the teacher's ceiling (from simulate_baselines) as a row."""
    return {mode: {rename.get(key, key): compact(s) for key, s in summaries[mode].items()}
            | {"teacher": {"avg_bsld": ceiling[mode]["avg_bsld_mean"], "avg_bsld_std": ceiling[mode]["avg_bsld_std"],
                           "mean_wait": ceiling[mode]["mean_wait_mean"]}} for mode in MODES}


def base_results(workloads: dict) -> tuple[dict, dict] | None:
    """The base model's summaries and queue CDFs per workload and mode from reports/evaluate_base.json (None when
    that stage did not evaluate it); ValueError when they were judged on other sequences than `workloads`'."""
    path = paths.report("evaluate_base")
    if not path.exists():
        raise FileNotFoundError(f"{path}: not found; the untuned base model is judged by its own stage: "
                                "dvc repro scheduling/dvc.yaml:evaluate_base")
    base = read_json(path)
    if not base.get("evaluated"):
        return None
    for name, (workload, proto) in workloads.items():
        judged = base["workloads"].get(name, {})
        here = {"max_procs": workload.max_procs, "sequences": proto.n_sequences,
                "sequence_length": proto.sequence_length}
        if {key: judged.get(key) for key in here} != here or base.get("window") != proto.window:
            raise ValueError(f"{path}: the base model was judged on other {name} sequences than these ({here}, window "
                             f"{proto.window}); rerun it: dvc repro scheduling/dvc.yaml:evaluate_base")
    return ({name: {mode: base["workloads"][name][mode] for mode in MODES} for name in workloads},
            {name: base["queue_cdf"][name] for name in workloads})


def targets(tables: dict) -> dict:
    """The fine-tuned model's avg bsld over F1's and F1-pred's, per workload and mode (lower is better)."""
    return {name: {mode: {f"finetuned_vs_{ref}": rows[mode]["finetuned"]["avg_bsld"] / rows[mode][ref]["avg_bsld"]
                          for ref in ("F1", "F1-pred")} for mode in MODES}
            for name, rows in tables.items() if "finetuned" in rows["no_backfill"]}


def run(params: Params) -> dict:
    sp = params.scheduling
    workloads = evaluation_workloads(sp, paths.USER_WORKLOAD, paths.SECOND_WORKLOAD, paths.TRACE_COPY)
    proto = workloads["user_workload"][1]
    baselines = read_json(paths.report("simulate_baselines"))
    base = base_results(workloads)
    llm = sp.llm
    # As training ran (the plan's precision, measured faster on this CPU, and threads); the train stage records them.
    trained = read_json(paths.PIPELINE_RUN.train_report)
    bf16 = bool(trained.get("bf16", False))
    policies = dict(BASELINES)
    integrity.verify_outs(paths.BASE_MODEL, paths.ADAPTER_DIR)  # as DVC recorded them (frugaltune/integrity.py)
    threads = llm.threads or trained.get("threads")  # None: a train report without them, torch's own count
    policies["finetuned"] = load_llm_policy(paths.BASE_MODEL, paths.ADAPTER_DIR, name="finetuned",
                                            fallback=llm.fallback, threads=threads, batch_size=llm.batch_size,
                                            max_running=sp.sft.max_running, bf16=bf16, order=sp.order)
    # A fallback heuristic's numbers must never pass for the model's: they go under "fallback", so the register
    # stage finds no `finetuned.avg_bsld` and refuses to register an adapter that was never judged.
    loaded = isinstance(policies["finetuned"], LLMPolicy)
    rename = {} if loaded else {"finetuned": "fallback"}
    summaries, cdfs = judge_workloads(workloads, policies, teacher(sp))
    if base is not None:
        for name in workloads:
            for mode in MODES:
                summaries[name][mode]["base"] = base[0][name][mode]
                cdfs[name][mode]["base"] = base[1][name][mode]
    gate = "easy" if sp.backfill else "no_backfill"
    main = summaries["user_workload"][gate]
    heuristics = {name: main[name] for name in BASELINES}
    best = min(heuristics, key=lambda n: heuristics[n]["avg_bsld"])
    tuned = main["finetuned"]["avg_bsld"]
    tables = {}
    for name, (workload, p) in workloads.items():
        ceiling = baselines
        for key in CEILINGS[name]:
            ceiling = ceiling[key]
        tables[name] = {"max_procs": workload.max_procs, "sequences": p.n_sequences,
                        "sequence_length": p.sequence_length, **table(summaries[name], ceiling["teacher"], rename)}
    report = {
        "task": "scheduling",
        "workload": "user_workload",  # the one the gate and the top-level numbers are measured on
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
        "targets": targets(tables),
        "teacher": baselines["teacher_name"],
        "workloads": tables,
    }
    write_json(paths.report("evaluate"), report)
    metrics = {f"{rename.get(k, k)}.avg_bsld": v["avg_bsld"] for k, v in main.items()}
    metrics["finetuned_vs_best_heuristic"] = report["finetuned_vs_best_heuristic"]
    for name, w in tables.items():
        for mode in MODES:
            for key, row in w[mode].items():
                metrics[f"{name}.{mode}.{key}.avg_bsld"] = row["avg_bsld"]
                for share in ("departure_share", "teacher_agreement_share"):
                    if row.get("departures", {}).get(share) is not None:
                        metrics[f"{name}.{mode}.{key}.{share}"] = row["departures"][share]
    for name, modes in report["targets"].items():
        metrics |= {f"{name}.{mode}.{ratio}": value
                    for mode, ratios in modes.items() for ratio, value in ratios.items()}
    write_metrics(paths.metrics("evaluate"), metrics)
    gated = {rename.get(k, k): v for k, v in cdfs["user_workload"][gate].items()}
    write_text(paths.plot("evaluate_policy", "queue_cdf"), queue_cdf_table(gated))
    bars = {k: (v["avg_bsld"], v["avg_bsld_std"]) for k, v in tables["user_workload"][gate].items()}
    write_text(paths.plot("evaluate_policy", "bsld"), "policy,avg_bsld\n" + "".join(
        f"{k},{mean:.4f}\n" for k, (mean, _) in bars.items()))
    title = (f"estimates and users: {proto.n_sequences} held-out sequences of {proto.sequence_length} jobs, window "
             f"{proto.window}")
    plot_queue_cdf(gated, paths.FIGURES / "queue_length_cdf.png", title)
    plot_bsld({k: m for k, (m, _) in bars.items()}, {k: s for k, (_, s) in bars.items()},
              paths.FIGURES / "policy_bsld.png", title)
    for name, w in tables.items():
        print(f"evaluate_policy: {name} ({w['max_procs']} procs), avg bsld without backfilling | with EASY")
        for key in w["no_backfill"]:
            print(f"  {key:10s} {w['no_backfill'][key]['avg_bsld']:10.2f} | {w['easy'][key]['avg_bsld']:10.2f}")
    print(f"evaluate_policy: {policies['finetuned'].name} {tuned:.2f} vs best baseline {best} "
          f"{heuristics[best]['avg_bsld']:.2f} (ratio {report['finetuned_vs_best_heuristic']:.3f}, {gate})")
    return report


def main() -> None:
    stage_main("evaluate_policy", run, ValueError, FileNotFoundError)


if __name__ == "__main__":
    main()
