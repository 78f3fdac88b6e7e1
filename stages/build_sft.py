"""Teacher episodes -> SFT pairs.  Run by DVC (in scheduling/) as:  python -m stages.build_sft

Simulates `scheduling.sft.episodes` episodes from the training part of `data/trace.swf` (never the held-out part
the policies are judged on) with the lookahead teacher of `frugaltune.scheduling.sft`, and writes every decision
with two or more visible jobs as a prompt/response/candidates row of `data/sft.jsonl`, which the reused
ingest -> validate -> tokenize -> train stages fine-tune on (task.type causal_lm). `reports/build_sft.json` and
`reports/metrics/build_sft.json` compare the teacher's avg bsld with every heuristic's on the same episodes: the
student cannot beat heuristics its teacher does not beat.
"""

from __future__ import annotations

import json
import sys

from frugaltune import paths
from frugaltune.config import Params
from frugaltune.entry import stage_main
from frugaltune.io import write_json, write_metrics, write_text
from frugaltune.scheduling.settings import load_workload, sft_config
from frugaltune.scheduling.sft import build_sft


def run(params: Params) -> dict:
    sp = params.scheduling
    workload = load_workload(paths.TRACE_COPY, sp)
    rows, report = build_sft(workload, sft_config(sp))
    if not rows:
        raise ValueError(f"{paths.TRACE_COPY}: the episodes never had two visible jobs at once, so there is "
                         "nothing to learn; use longer episodes (scheduling.sft.episode_length) or a busier trace.")
    keys = ("prompt", "response", "candidates")  # the columns task.prompt/response/candidates_column name
    write_text(paths.SFT_DATA, "".join(json.dumps({k: row[k] for k in keys}) + "\n" for row in rows))
    write_json(paths.report("build_sft"), report)
    write_metrics(paths.metrics("build_sft"), {"rows": report["rows"], **{
        f"{name}.avg_bsld": value for name, value in report["avg_bsld"].items()}})
    best = min((n for n in report["avg_bsld"] if n != "teacher"), key=report["avg_bsld"].get)
    print(f"build_sft: {len(rows)} rows ({report['rows_departure_share']:.0%} departing from 'A') of "
          f"{report['labelled_rows']} labelled in {report['episodes']} trace and {report['generated_episodes']} "
          f"generated episodes; teacher avg bsld {report['avg_bsld']['teacher']:.1f} vs best heuristic {best} "
          f"{report['avg_bsld'][best]:.1f}")
    if not report["teacher_beats_best_heuristic"]:
        print(f"build_sft: warning: the teacher does not beat {best} on these episodes; the student will not "
              "either. Raise scheduling.sft.horizon or add rollout_policies.", file=sys.stderr)
    return report


def main() -> None:
    stage_main("build_sft", run, ValueError)


if __name__ == "__main__":
    main()
