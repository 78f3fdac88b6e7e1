"""Read the SWF trace and keep a copy.  Run by DVC (in scheduling/) as:  python -m stages.ingest_trace

Reads `scheduling.trace` (a Parallel Workloads Archive file as published, after gunzip) with the SWF reader, which
stops on a bad line naming `file:line` and the fix (wrong field count, negative times, a job wider than the
machine, an empty file). Writes `data/trace.swf` (the bytes as read: every later stage reads this copy, so a
changed source reruns the pipeline only through this stage), `data/trace.parquet` (one row per job, one column
per SWF field, for validate_trace) and `reports/ingest_trace.json` (jobs, machine size, skipped jobs by reason).
"""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

from frugaltune import paths
from frugaltune.config import Params, ParamsError, load_params
from frugaltune.faults import stage_errors
from frugaltune.io import write_json
from frugaltune.scheduling.evaluation import held_out_start
from frugaltune.scheduling.settings import load_workload, protocol
from frugaltune.scheduling.swf import SWFError


def run(params: Params) -> dict:
    sp = params.scheduling
    source = Path(sp.trace)
    if not source.is_file():
        raise FileNotFoundError(f"scheduling.trace = {sp.trace!r}: no such file (relative paths start in "
                                f"{Path.cwd()}). Point it at an SWF trace (gunzip archive downloads first).")
    workload = load_workload(source, sp)
    # Each output is written under a temp name and renamed: a crash leaves no half file that looks valid.
    paths.TRACE_COPY.parent.mkdir(parents=True, exist_ok=True)
    for path, write in ((paths.TRACE_COPY, lambda tmp: shutil.copyfile(source, tmp)),
                        (paths.TRACE_TABLE, lambda tmp: workload.to_frame().to_parquet(tmp, index=False))):
        tmp = path.with_name(f".{path.name}.tmp")
        try:
            write(tmp)
            tmp.replace(path)
        finally:
            tmp.unlink(missing_ok=True)
    report = {"source": str(source), "jobs": len(workload), "max_procs": workload.max_procs,
              "skipped": workload.skipped, "training_jobs": held_out_start(workload, protocol(sp)),
              "header": workload.header}
    write_json(paths.report("ingest_trace"), report)
    print(f"ingest_trace: {len(workload)} jobs on {workload.max_procs} processors from {source} "
          f"(skipped: {workload.skipped or 'none'})")
    return report


def main() -> None:
    with stage_errors("ingest_trace"):
        try:
            run(load_params())
        except (ParamsError, SWFError, FileNotFoundError) as exc:
            sys.exit(f"ingest_trace: {exc}")


if __name__ == "__main__":
    main()
