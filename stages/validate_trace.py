"""Check the parsed trace with Great Expectations.  Run by DVC (in scheduling/) as:  python -m stages.validate_trace

Runs `frugaltune.scheduling.trace_checks` on `data/trace.parquet` with the thresholds in `scheduling.validate`
and writes `reports/validate_trace.json` (each check: passed, observed value). A failing check stops the pipeline
with the check, what was observed and the fix; the report is written first so the failure can be read there too.
"""

from __future__ import annotations


import pandas as pd

from frugaltune import paths
from frugaltune.config import Params
from frugaltune.entry import stage_main
from frugaltune.io import read_json, write_json, write_metrics
from frugaltune.scheduling.trace_checks import TraceRules, check_trace


class TraceValidationError(ValueError):
    pass


def run(params: Params) -> dict:
    rules = params.scheduling.validate_
    frame = pd.read_parquet(paths.TRACE_TABLE)
    max_procs = read_json(paths.report("ingest_trace"))["max_procs"]
    checks, failures = check_trace(frame, max_procs, TraceRules(rules.min_jobs, rules.max_overshoot_fraction))
    report = {"jobs": len(frame), "max_procs": max_procs, "checks": checks, "failures": failures}
    write_json(paths.report("validate_trace"), report)
    write_metrics(paths.metrics("validate_trace"), {"jobs": len(frame), "failed_checks": len(failures)})
    if failures:
        raise TraceValidationError(f"{paths.TRACE_TABLE}: " + "; ".join(failures))
    print(f"validate_trace: {len(checks)} checks passed on {len(frame)} jobs")
    return report


def main() -> None:
    stage_main("validate_trace", run, TraceValidationError)


if __name__ == "__main__":
    main()
