"""The heuristic baselines on the held-out sequences.  Run by DVC (in scheduling/) as:  python -m stages.simulate_baselines

FCFS, SJF, WFP3, UNICEF and F1, each with and without EASY backfilling, on the test sequences of
`scheduling.evaluation` (the held-out last part of `data/trace.swf`) at `scheduling.window`. Writes
`reports/simulate_baselines.json` (mean/std of avg bsld and mean wait per policy and mode, the simulator's
jobs/s), `reports/metrics/simulate_baselines.json` (avg bsld per policy and mode),
`reports/plots/simulate_baselines_bsld.csv` and `reports/figures/baselines_bsld.png`.
"""

from __future__ import annotations

import sys

from frugaltune import paths
from frugaltune.config import Params, ParamsError, load_params
from frugaltune.faults import stage_errors
from frugaltune.io import write_json, write_metrics, write_text
from frugaltune.scheduling.evaluation import evaluate, markdown_table, summary_table
from frugaltune.scheduling.plots import plot_bsld
from frugaltune.scheduling.policies import HEURISTICS
from frugaltune.scheduling.settings import load_workload, protocol


def run(params: Params) -> dict:
    sp = params.scheduling
    workload = load_workload(paths.TRACE_COPY, sp)
    proto = protocol(sp)
    frame, _ = evaluate(workload, HEURISTICS.values(), proto)
    bsld, wait = summary_table(frame, "avg_bsld"), summary_table(frame, "mean_wait")
    policies = {}
    for name in bsld.index:
        policies[name] = {
            mode: {"avg_bsld_mean": float(bsld.loc[name, f"avg_bsld mean{suffix}"]),
                   "avg_bsld_std": float(bsld.loc[name, f"avg_bsld std{suffix}"]),
                   "mean_wait_mean": float(wait.loc[name, f"mean_wait mean{suffix}"])}
            for mode, suffix in (("no_backfill", ""), ("easy", " +EASY"))}
    report = {"sequences": proto.n_sequences, "sequence_length": proto.sequence_length, "window": proto.window,
              "held_out_fraction": proto.held_out_fraction, "policies": policies,
              "simulated_jobs": int(frame["jobs"].sum()),
              "jobs_per_s": float(frame["jobs"].sum() / frame["seconds"].sum())}
    write_json(paths.report("simulate_baselines"), report)
    write_metrics(paths.metrics("simulate_baselines"),
                  {f"{name}.{mode}.avg_bsld": v[mode]["avg_bsld_mean"] for name, v in policies.items() for mode in v})
    write_text(paths.plot("simulate_baselines", "bsld"), "policy,avg_bsld,avg_bsld_easy\n" + "".join(
        f"{name},{v['no_backfill']['avg_bsld_mean']:.4f},{v['easy']['avg_bsld_mean']:.4f}\n"
        for name, v in policies.items()))
    plot_bsld({n: v["no_backfill"]["avg_bsld_mean"] for n, v in policies.items()}
              | {f"{n}+EASY": v["easy"]["avg_bsld_mean"] for n, v in policies.items()},
              {n: v["no_backfill"]["avg_bsld_std"] for n, v in policies.items()}
              | {f"{n}+EASY": v["easy"]["avg_bsld_std"] for n, v in policies.items()},
              paths.FIGURES / "baselines_bsld.png",
              f"{proto.n_sequences} held-out sequences of {proto.sequence_length} jobs, window {proto.window}")
    print(markdown_table(bsld))
    print(f"simulate_baselines: {report['simulated_jobs']} jobs at {report['jobs_per_s']:,.0f} jobs/s")
    return report


def main() -> None:
    with stage_errors("simulate_baselines"):
        try:
            run(load_params())
        except (ParamsError, ValueError) as exc:
            sys.exit(f"simulate_baselines: {exc}")


if __name__ == "__main__":
    main()
