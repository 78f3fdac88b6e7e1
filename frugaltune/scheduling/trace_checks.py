"""Great Expectations checks on a parsed trace (the table `Workload.to_frame()` gives), like any dataset's.

Library code: `check_trace(frame, max_procs, TraceRules())` -> (report, failures); the scheduling pipeline's
`validate_trace` stage (`python -m stages.validate_trace`) writes the report and fails when a check fails.

`read_swf` already refuses what would make a simulation wrong (field counts, negative times, a job wider than the
machine) and names the line. These checks look at the parsed table as a whole, so a trace that parses but is
unfit (too few jobs to split into training episodes and test sequences, unsorted submits, most runs overshooting
their request) stops the pipeline before hours of training, with the rule and the knob in the message.
"""

from __future__ import annotations

import datetime
from dataclasses import dataclass

import great_expectations as gx
import great_expectations.expectations as gxe
import pandas as pd
from great_expectations.core.run_identifier import RunIdentifier

from frugaltune.validation import _context


@dataclass(frozen=True)
class TraceRules:
    """Thresholds (params.yaml `scheduling.validate`)."""

    min_jobs: int = 1000
    max_overshoot_fraction: float = 0.5
    """Runs longer than their requested time (real logs have a few: the limit was not enforced)."""


def _suite(max_procs: int, rules: TraceRules) -> gx.ExpectationSuite:
    def check(name: str, expectation: gxe.Expectation, fix: str) -> gxe.Expectation:
        expectation.meta = {"check": name, "fix": fix}
        return expectation

    return gx.ExpectationSuite(name="trace", expectations=[
        check("enough_jobs", gxe.ExpectTableRowCountToBeBetween(min_value=rules.min_jobs),
              "bring a longer trace or lower scheduling.validate.min_jobs"),
        check("submit_known", gxe.ExpectColumnValuesToNotBeNull(column="submit_time"), "fix the trace"),
        check("submit_sorted", gxe.ExpectColumnValuesToBeIncreasing(column="submit_time"),
              "the reader sorts by submit time: a failure here is a reader bug, report it"),
        check("run_time_non_negative", gxe.ExpectColumnValuesToBeBetween(column="run_time", min_value=0),
              "fix the trace"),
        check("requested_time_non_negative", gxe.ExpectColumnValuesToBeBetween(column="requested_time", min_value=0),
              "fix the trace"),
        check("procs_within_machine", gxe.ExpectColumnValuesToBeBetween(
            column="requested_procs", min_value=1, max_value=max_procs),
            "set scheduling.max_procs to the machine's size"),
        check("overshoot_fraction", gxe.ExpectColumnPairValuesAToBeGreaterThanB(
            column_A="requested_time", column_B="run_time", or_equal=True, mostly=1 - rules.max_overshoot_fraction),
            "check the requested-time field (-1 falls back to the run time) or raise "
            "scheduling.validate.max_overshoot_fraction"),
    ])


def check_trace(frame: pd.DataFrame, max_procs: int, rules: TraceRules) -> tuple[dict, list[str]]:
    """Run the suite on `frame`; returns ({check: {success, unexpected_percent}}, failure messages)."""
    context = _context(None)
    batch = (context.data_sources.add_pandas("trace").add_dataframe_asset("jobs")
             .add_batch_definition_whole_dataframe("all_jobs"))
    suite = context.suites.add(_suite(max_procs, rules))
    definition = context.validation_definitions.add(gx.ValidationDefinition(name="trace", data=batch, suite=suite))
    result = definition.run(batch_parameters={"dataframe": frame}, result_format={"result_format": "SUMMARY"},
                            run_id=RunIdentifier(run_name="trace",
                                                 run_time=datetime.datetime.now(datetime.timezone.utc)))
    report, failures = {}, []
    for res in result.results:
        meta = res.expectation_config.meta
        observed = res.result.get("unexpected_percent", res.result.get("observed_value"))
        report[meta["check"]] = {"success": bool(res.success),
                                 "observed": float(observed) if observed is not None else None}
        if not res.success:
            failures.append(f"{meta['check']} failed (observed {observed}): {meta['fix']}")
    return dict(sorted(report.items())), failures
