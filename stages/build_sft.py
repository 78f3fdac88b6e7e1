"""Teacher episodes -> SFT pairs.  Run by DVC (in scheduling/) as:  python -m stages.build_sft

Simulates `scheduling.sft.episodes` episodes from the training part of `data/user_workload.swf` (the
estimate-and-user workload of generate_workload; never the held-out part the policies are judged on) and
`scheduling.sft.generated_episodes` more of the Lublin-Feitelson model with users and estimates
(`scheduling.user_workload.users`; other sizes and loads, seed pairs no evaluation workload uses) with the
lookahead teacher of `frugaltune.scheduling.sft` (privileged: its rollouts run jobs for their actual run times),
and writes every decision with two or more visible jobs as a prompt/response/candidates row of `data/sft.jsonl`
(the prompt carries each job's user history: `sft.encode_state`), which the reused ingest -> validate -> tokenize
-> train stages fine-tune on (task.type causal_lm). `reports/build_sft.json` and `reports/metrics/build_sft.json`
compare the teacher's avg bsld with every baseline's (F1-pred and SJF-pred included) on the same episodes: the
student cannot beat baselines its teacher does not beat.
"""

from __future__ import annotations

import json
import sys

from frugaltune import paths
from frugaltune.config import Params
from frugaltune.entry import stage_main
from frugaltune.io import write_json, write_metrics, write_text
from frugaltune.scheduling.settings import sft_config
from frugaltune.scheduling.sft import build_sft
from frugaltune.scheduling.swf import read_swf


def run(params: Params) -> dict:
    sp = params.scheduling
    workload = read_swf(paths.USER_WORKLOAD)
    rows, report = build_sft(workload, sft_config(sp))
    if not rows:
        raise ValueError(f"{paths.USER_WORKLOAD}: the episodes never had two visible jobs at once, so there is "
                         "nothing to learn; use longer episodes (scheduling.sft.episode_length) or a busier "
                         "workload (scheduling.user_workload.load).")
    keys = ("prompt", "response", "candidates")  # the columns task.prompt/response/candidates_column name
    write_text(paths.SFT_DATA, "".join(json.dumps({k: row[k] for k in keys}) + "\n" for row in rows))
    write_json(paths.report("build_sft"), report)
    write_metrics(paths.metrics("build_sft"), {"rows": report["rows"], **{
        f"{name}.avg_bsld": value for name, value in report["avg_bsld"].items()}})
    best = min((n for n in report["avg_bsld"] if n != "teacher"), key=report["avg_bsld"].get)
    print(f"build_sft: {len(rows)} rows ({report['rows_departure_share']:.0%} departing from 'A') of "
          f"{report['labelled_rows']} labelled in {report['episodes']} workload and {report['generated_episodes']} "
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
