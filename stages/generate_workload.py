"""The second evaluation workload, generated.  Run by DVC (in scheduling/) as:  python -m stages.generate_workload

Generates `scheduling.second_workload` (frugaltune/scheduling/lublin.py): the Lublin-Feitelson model for a machine
of `procs` processors, `jobs` jobs from generator seed `seed`, arrivals scaled to the offered load `load`. No stage
trains on it: simulate_baselines and evaluate_policy judge every policy on it beside the trace, so a policy tuned
on the trace meets a machine size and load it has never seen. Writes `data/second_workload.swf` and
`reports/generate_workload.json` (size, load, the share of serial and power-of-two jobs).
"""

from __future__ import annotations


import numpy as np

from frugaltune import paths
from frugaltune.config import Params
from frugaltune.entry import stage_main
from frugaltune.io import write_json
from frugaltune.scheduling.lublin import offered_load
from frugaltune.scheduling.settings import generate_second_workload
from frugaltune.scheduling.synthetic import write_swf


def run(params: Params) -> dict:
    sw = params.scheduling.second_workload
    workload = generate_second_workload(params.scheduling)
    write_swf(workload, paths.SECOND_WORKLOAD)
    procs = np.array([job.requested_procs for job in workload.jobs])
    runs = np.array([job.run_time for job in workload.jobs])
    report = {"source": workload.source, "jobs": len(workload), "max_procs": workload.max_procs, "seed": sw.seed,
              "offered_load": offered_load(workload), "serial_share": float((procs == 1).mean()),
              "power_of_two_share": float(((procs & (procs - 1)) == 0).mean()),
              "median_run_time_s": float(np.median(runs)),
              "days": (workload.jobs[-1].submit_time - workload.jobs[0].submit_time) / 86400}
    write_json(paths.report("generate_workload"), report)
    print(f"generate_workload: {report['jobs']} jobs on {report['max_procs']} processors (seed {sw.seed}), offered "
          f"load {report['offered_load']:.3f}, over {report['days']:.1f} days -> {paths.SECOND_WORKLOAD}")
    return report


def main() -> None:
    stage_main("generate_workload", run, ValueError)


if __name__ == "__main__":
    main()
