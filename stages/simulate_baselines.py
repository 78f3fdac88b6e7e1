"""The heuristic baselines and the teacher's ceiling.  Run by DVC (in scheduling/) as:  python -m stages.simulate_baselines

FCFS, SJF, WFP3, UNICEF and F1 on the users' estimates, and SJF and F1 on Tsafrir's predictions (`SJF-pred`,
`F1-pred`: the user's last two run times, capped by the estimate), each with and without EASY backfilling (on the
same run times; a backfilled job is killed at its estimate), at `scheduling.window`, on three workloads: the test
sequences of `scheduling.evaluation` (the held-out last part) of `data/trace.swf` and of `data/user_workload.swf`
(generated with users and estimates, `scheduling.user_workload`), and those of `scheduling.second_workload`
(`data/second_workload.swf`, generated, never trained on). On a trace without estimates (the Lublin model's, the
default) requested time = run time: there every policy is fed an oracle. Beside them, the lookahead
teacher (`scheduling.sft.rollout_policies`, `horizon`) scheduling the same sequences itself, in both modes: the
ceiling of what imitating it can reach (evaluate_policy puts it in the LLMs' table; computed here, where it is
cached across retrains). Writes `reports/simulate_baselines.json` (mean/std of avg bsld and mean wait per policy
and mode, per workload; the simulator's jobs/s), `reports/metrics/simulate_baselines.json` (avg bsld per policy
and mode), `reports/baselines.md` (every policy's avg bsld on the three workloads in both modes, and the CPU),
`reports/plots/simulate_baselines_bsld.csv` and `reports/figures/baselines_bsld.png` (the trace).
"""

from __future__ import annotations

import time

from frugaltune import hardware, paths
from frugaltune.config import Params
from frugaltune.entry import stage_main
from frugaltune.io import write_json, write_metrics, write_text
from frugaltune.scheduling.evaluation import Protocol, evaluate, markdown_table, sequences, summary_table
from frugaltune.scheduling.judge import MODES, summarise, teacher_results
from frugaltune.scheduling.plots import plot_bsld
from frugaltune.scheduling.policies import BASELINES
from frugaltune.scheduling.settings import load_workload, protocol, second_protocol, teacher
from frugaltune.scheduling.sft import LookaheadTeacher
from frugaltune.scheduling.swf import Workload, read_swf


def baselines(workload: Workload, proto: Protocol, lookahead: LookaheadTeacher) -> dict:
    """Every heuristic and the teacher, both modes, on `proto`'s sequences of `workload`."""
    frame, _ = evaluate(workload, BASELINES.values(), proto)
    bsld, wait = summary_table(frame, "avg_bsld"), summary_table(frame, "mean_wait")
    policies = {}
    for name in bsld.index:
        policies[name] = {
            mode: {"avg_bsld_mean": float(bsld.loc[name, f"avg_bsld mean{suffix}"]),
                   "avg_bsld_std": float(bsld.loc[name, f"avg_bsld std{suffix}"]),
                   "mean_wait_mean": float(wait.loc[name, f"mean_wait mean{suffix}"])}
            for mode, suffix in (("no_backfill", ""), ("easy", " +EASY"))}
    print(f"{workload.source}: {proto.n_sequences} sequences of {proto.sequence_length} jobs")
    print(markdown_table(bsld))
    tests, ceiling = sequences(workload, proto), {}
    for mode, backfill in MODES.items():
        began = time.perf_counter()
        s = summarise(teacher_results(tests, workload.max_procs, lookahead, proto.window, backfill),
                      time.perf_counter() - began)
        ceiling[mode] = {"avg_bsld_mean": s["avg_bsld"], "avg_bsld_std": s["avg_bsld_std"],
                         "mean_wait_mean": s["mean_wait"], "per_sequence_avg_bsld": s["per_sequence_avg_bsld"],
                         "seconds": s["seconds"]}
        print(f"simulate_baselines: teacher {lookahead.name} {mode}: avg bsld {s['avg_bsld']:.2f} "
              f"({s['seconds']:.1f} s)")
    return {"sequences": proto.n_sequences, "sequence_length": proto.sequence_length, "max_procs":
            workload.max_procs, "policies": policies, "teacher": ceiling,
            "simulated_jobs": int(frame["jobs"].sum()), "jobs_per_s": float(frame["jobs"].sum()
                                                                            / frame["seconds"].sum())}


COLUMNS = (("user_workload", "estimates and users"), ("second_workload", "second workload"),
           ("trace", "trace"))


def baselines_table(report: dict, cpu: str) -> str:
    """Markdown: avg bsld (mean over the test sequences) per policy, per workload and mode."""
    sections = {"trace": report} | {key: report[key] for key, _ in COLUMNS[:2]}
    header = ["policy"] + [f"{label}{suffix}" for _, label in COLUMNS for suffix in ("", " +EASY")]
    lines = ["# Baselines: average bounded slowdown (tau 10 s), mean over each workload's test sequences", "",
             "| " + " | ".join(header) + " |", "|" + "|".join(["---"] + ["---:"] * (len(header) - 1)) + "|"]
    for name in [*BASELINES, "teacher"]:
        cells = []
        for key, _ in COLUMNS:
            row = sections[key]["policies"].get(name) or sections[key]["teacher"]
            cells += [f"{row[mode]['avg_bsld_mean']:.2f}" for mode in MODES]
        lines.append("| " + " | ".join([name, *cells]) + " |")
    notes = [f"- {label}: {sections[key]['sequences']} sequences of {sections[key]['sequence_length']} jobs on "
             f"{sections[key]['max_procs']} processors" for key, label in COLUMNS]
    return "\n".join(lines + ["", f"- teacher: {report['teacher_name']} (sees actual run times: the ceiling)",
                               "- trace: requested time = run time where the trace has no estimates (the Lublin "
                               "model's): every policy is fed an oracle there",
                               "- -pred: Tsafrir's prediction (mean of the user's last two finished run times, "
                               "capped by the estimate) in place of the estimate, in the score and in EASY",
                               *notes, f"- window {report['window']}; CPU: {cpu}"]) + "\n"


def run(params: Params) -> dict:
    sp = params.scheduling
    proto, lookahead = protocol(sp), teacher(sp)
    report = {"window": proto.window, "held_out_fraction": proto.held_out_fraction, "teacher_name": lookahead.name,
              **baselines(load_workload(paths.TRACE_COPY, sp), proto, lookahead),
              "user_workload": baselines(read_swf(paths.USER_WORKLOAD), proto, lookahead),
              "second_workload": baselines(read_swf(paths.SECOND_WORKLOAD), second_protocol(sp), lookahead)}
    policies = report["policies"]
    write_json(paths.report("simulate_baselines"), report)
    metrics = {f"{name}.{mode}.avg_bsld": v[mode]["avg_bsld_mean"] for name, v in policies.items() for mode in v}
    metrics |= {f"teacher.{mode}.avg_bsld": v["avg_bsld_mean"] for mode, v in report["teacher"].items()}
    for key in ("user_workload", "second_workload"):
        other = report[key]
        metrics |= {f"{key}.{name}.{mode}.avg_bsld": v[mode]["avg_bsld_mean"]
                    for name, v in (other["policies"] | {"teacher": other["teacher"]}).items() for mode in MODES}
    write_metrics(paths.metrics("simulate_baselines"), metrics)
    cpu = hardware.cpu_facts()
    write_text(paths.REPORTS / "baselines.md",
               baselines_table(report, f"{cpu['model']} ({cpu['usable_cores']} usable cores)"))
    write_text(paths.plot("simulate_baselines", "bsld"), "policy,avg_bsld,avg_bsld_easy\n" + "".join(
        f"{name},{v['no_backfill']['avg_bsld_mean']:.4f},{v['easy']['avg_bsld_mean']:.4f}\n"
        for name, v in (policies | {"teacher": report["teacher"]}).items()))
    plot_bsld({n: v["no_backfill"]["avg_bsld_mean"] for n, v in policies.items()}
              | {f"{n}+EASY": v["easy"]["avg_bsld_mean"] for n, v in policies.items()},
              {n: v["no_backfill"]["avg_bsld_std"] for n, v in policies.items()}
              | {f"{n}+EASY": v["easy"]["avg_bsld_std"] for n, v in policies.items()},
              paths.FIGURES / "baselines_bsld.png",
              f"{proto.n_sequences} held-out sequences of {proto.sequence_length} jobs, window {proto.window}")
    print(f"simulate_baselines: {report['simulated_jobs']} jobs at {report['jobs_per_s']:,.0f} jobs/s")
    return report


def main() -> None:
    stage_main("simulate_baselines", run, ValueError)


if __name__ == "__main__":
    main()
