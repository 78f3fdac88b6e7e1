"""The generated workloads.  Run by DVC (in scheduling/) as:  python -m stages.generate_workload

Generates, each by the Lublin-Feitelson model (frugaltune/scheduling/lublin.py) for a machine of `procs`
processors, `jobs` jobs from generator seed `seed`, arrivals scaled to the offered load `load`, then users and their
runtime estimates (frugaltune/scheduling/users.py, `users`):

- `scheduling.user_workload` -> `data/user_workload.swf`: the estimate-and-user workload. Its held-out part
  (`scheduling.evaluation`) is what the baselines are judged on; unlike the Lublin trace, a job's requested time is
  the user's estimate, not its run time.
- `scheduling.second_workload` -> `data/second_workload.swf`: another machine size, load and users' parameters. No
  stage trains on it: simulate_baselines and evaluate_policy judge every policy on it beside the trace, so a policy
  tuned on the trace meets a machine size and load it has never seen.

Writes `reports/generate_workload.json`: per workload its size, load, the share of serial and power-of-two jobs, and
its estimates (mean accuracy, the share at the maximum, the share the 20 most used values cover, the users).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from frugaltune import paths
from frugaltune.config import Params
from frugaltune.entry import stage_main
from frugaltune.io import write_json
from frugaltune.scheduling.lublin import offered_load
from frugaltune.scheduling.settings import generate_second_workload, generate_user_workload
from frugaltune.scheduling.swf import Workload
from frugaltune.scheduling.synthetic import write_swf


def describe(workload: Workload, seed: int) -> dict:
    procs = np.array([job.requested_procs for job in workload.jobs])
    runs = np.array([job.run_time for job in workload.jobs], dtype=float)
    requested = np.array([job.requested_time for job in workload.jobs], dtype=float)
    users = np.array([job.user_id for job in workload.jobs])
    _, counts = np.unique(requested, return_counts=True)
    _, per_user = np.unique(users, return_counts=True)
    return {"source": workload.source, "jobs": len(workload), "max_procs": workload.max_procs, "seed": seed,
            "offered_load": offered_load(workload), "serial_share": float((procs == 1).mean()),
            "power_of_two_share": float(((procs & (procs - 1)) == 0).mean()),
            "median_run_time_s": float(np.median(runs)),
            "days": (workload.jobs[-1].submit_time - workload.jobs[0].submit_time) / 86400,
            "estimates": {"mean_accuracy": float(np.mean(runs / np.maximum(requested, 1.0))),
                          "max_estimate_s": float(requested.max()),
                          "share_at_max": float((requested == requested.max()).mean()),
                          "top20_values_share": float(np.sort(counts)[::-1][:20].sum() / len(requested)),
                          "run_over_estimate_jobs": int((runs > requested).sum())},
            "users": {"count": len(per_user), "top_user_share": float(per_user.max() / len(users))}}


def run(params: Params) -> dict:
    sp = params.scheduling
    report = {}
    for key, generate, path, seed in (
            ("user_workload", generate_user_workload, paths.USER_WORKLOAD, sp.user_workload.seed),
            ("second_workload", generate_second_workload, paths.SECOND_WORKLOAD, sp.second_workload.seed)):
        workload = generate(sp)
        write_swf(workload, path)
        report[key] = describe(workload, seed)
        r = report[key]
        print(f"generate_workload: {r['jobs']} jobs on {r['max_procs']} processors (seed {seed}), offered load "
              f"{r['offered_load']:.3f}, over {r['days']:.1f} days, {r['users']['count']} users, mean accuracy "
              f"{r['estimates']['mean_accuracy']:.2f} -> {Path(path)}")
    write_json(paths.report("generate_workload"), report)
    return report


def main() -> None:
    stage_main("generate_workload", run, ValueError)


if __name__ == "__main__":
    main()
