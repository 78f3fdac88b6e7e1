"""Read the SWF trace and keep a copy.  Run by DVC (in scheduling/) as:  python -m stages.ingest_trace

Reads `scheduling.trace` (a Parallel Workloads Archive file as published, after gunzip; relative to scheduling/;
by default data/lublin_256.swf, the repository's copy, whose sha256 it checks) with the SWF reader, which stops on
a bad line naming `file:line` and the fix (wrong field count, negative times, a job wider than the machine, an
empty file). Writes `data/trace.swf` (the bytes as read: every later stage reads this copy, so a
changed source reruns the pipeline only through this stage), `data/trace.parquet` (one row per job, one column
per SWF field, for validate_trace) and `reports/ingest_trace.json` (jobs, machine size, skipped jobs by reason).
"""

from __future__ import annotations

import hashlib
import shutil
from pathlib import Path

from frugaltune import paths
from frugaltune.config import DEFAULT_TRACE, DEFAULT_TRACE_SHA256, Params, trace_file
from frugaltune.entry import stage_main
from frugaltune.io import write_json
from frugaltune.scheduling.evaluation import held_out_start
from frugaltune.scheduling.settings import load_workload, protocol
from frugaltune.scheduling.swf import SWFError


def run(params: Params) -> dict:
    sp = params.scheduling
    try:
        source = trace_file(sp.trace, Path("."))  # DVC runs this stage in scheduling/, beside its params.yaml
    except FileNotFoundError as exc:
        raise FileNotFoundError(f"scheduling.trace = {sp.trace!r}: {exc}") from None
    if source.resolve() == Path(DEFAULT_TRACE).resolve():
        check_default_trace(source)
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


class TraceChanged(ValueError):
    """The repository's default trace is not the bytes its README records."""


def check_default_trace(source: Path) -> None:
    """The repository's trace must be the bytes every documented result came from (sha256 in data/README.md)."""
    digest = hashlib.sha256(source.read_bytes()).hexdigest()
    if digest != DEFAULT_TRACE_SHA256:
        raise TraceChanged(f"scheduling.trace = {str(source)!r}: sha256 {digest}, expected {DEFAULT_TRACE_SHA256} "
                           "(data/README.md): the repository's trace was changed, or checked out as a Git LFS "
                           f"pointer or with converted line endings. Restore it (git checkout -- scheduling/"
                           f"{DEFAULT_TRACE}), or put another trace elsewhere and point scheduling.trace at it.")


def main() -> None:
    stage_main("ingest_trace", run, SWFError, FileNotFoundError, TraceChanged)


if __name__ == "__main__":
    main()
