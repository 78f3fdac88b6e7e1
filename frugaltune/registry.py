"""The model registry: log a trained adapter as an MLflow pyfunc, register it as a version, move the alias when it wins.

Library code, no entry point. The register stages (`python -m stages.register`, `python -m stages.federated_register`)
call `register_adapter` after reading their reports; the rules (idempotent registration, the alias moving only between
versions evaluated on the same data) are documented on each function.
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import mlflow
from mlflow import MlflowClient
from mlflow.entities import LoggedModel, LoggedModelStatus
from mlflow.entities.model_registry import ModelVersion
from mlflow.exceptions import MlflowException

from frugaltune import paths, tracking
from frugaltune.serving import files, pyfunc
from frugaltune.config import RegisterParams
from frugaltune.io import read_json


EVAL_DATA_TAG = "frugaltune.eval_data"  # fingerprint of the evaluation split: token ids + label ids
TASK_TAG = "frugaltune.task"  # classification | causal_lm: versions of different tasks are never compared
LABELS_TAG = "frugaltune.labels"  # the label names, in class-id order, as JSON
MODEL_HASH_TAG = "frugaltune.model_hash"  # content hash of adapter + base config: finds a logged model again
LOGGED_MODEL_NAME = "model"
# A version carries what tells it apart and what the alias rule reads; everything else (the other metrics, the
# dvc.lock stage hashes, git_dirty) is on its run, as metrics and tags, one click away in the UI.
VERSION_RUN_TAGS = ("git_commit", "data_hash")
# The runs table's columns after the task's own metric (eval.finetuned.<register.metric>, eval.baseline.<metric>):
# what training cost, from reports/train.json as the train recipe logs it.
TRAINING_METRICS = ("final_loss", "tokens_per_s", "wall_seconds", "peak_rss_mb")
TERMINAL_STATUSES = ("FINISHED", "FAILED", "KILLED")


class RegisterError(RuntimeError):
    """Missing or inconsistent inputs; the message says which and how to fix it."""


def read_report(stage: str) -> dict:
    path = paths.report(stage)
    if not path.is_file():
        raise RegisterError(f"{path}: not found. Run the {stage} stage first (`dvc repro {stage}`).")
    return read_json(path)


def model_hash(base_dir: Path, adapter_dir: Path) -> str:
    """sha256 of the adapter files (names + bytes) and the base model's config: what makes this model this one.
    The logged model carries it too, and its loading checks it (serving.files.model_files)."""
    return files.model_files(base_dir, adapter_dir)[0]


def eval_data_tags(split: str) -> dict[str, str]:
    """What the metrics were measured on: the fingerprint of `data/tokenized/<split>` and the label set."""
    from datasets import load_from_disk

    from frugaltune.training.checkpoint import data_fingerprint

    for path, stage in ((paths.TOKENIZED_DIR, "tokenize"), (paths.LABELS, "ingest")):
        if not path.exists():
            raise RegisterError(f"{path}: not found. Run the {stage} stage first (`dvc repro {stage}`).")
    data = load_from_disk(str(paths.TOKENIZED_DIR))
    if split not in data:
        raise RegisterError(f"{paths.TOKENIZED_DIR} has no `{split}` split (evaluate.split); it has {list(data)}.")
    return {EVAL_DATA_TAG: data_fingerprint(data[split]["input_ids"], data[split]["labels"]),
            LABELS_TAG: json.dumps(read_json(paths.LABELS)["labels"]),
            TASK_TAG: read_json(paths.LABELS).get("task", "classification")}


def log_model_task(adapter_dir: Path) -> dict:
    """The task and, for a generative model, two prompts of the evaluation data as the logged input example."""
    task = files.read_task(adapter_dir)
    if task != "causal_lm":
        return {}
    from datasets import load_from_disk

    prompts = [str(p) for p in load_from_disk(str(paths.TOKENIZED_DIR))["test"]["prompt"][:2]]
    return {"task": task, "example_texts": tuple(prompts)}


def metric_tags(evaluation: dict) -> dict[str, str]:
    """`finetuned.macro_f1` = "0.81", ... for every number in reports/evaluate.json (nested keys joined by dots; a
    key that is a label, `per_class.<label>`, in MLflow's alphabet: `tracking.key_part`)."""
    tags: dict[str, str] = {}

    def walk(prefix: str, value: Any) -> None:
        if isinstance(value, dict):
            for key, inner in value.items():
                part = tracking.key_part(str(key))
                walk(f"{prefix}.{part}" if prefix else part, inner)
        elif isinstance(value, (int, float)) and not isinstance(value, bool):
            tags[tracking.tag_key(prefix)] = repr(float(value))

    walk("", evaluation)
    return tags


def log_eval_metrics(client: MlflowClient, run_id: str, metrics: dict[str, str]) -> None:
    """The evaluation's numbers as metrics of the training run (`eval.finetuned.macro_f1`, ...), not only as
    version tags: the MLflow runs table sorts and charts by metrics. Logged once; a retry finds them there."""
    from mlflow.entities import Metric

    logged = client.get_run(run_id).data.metrics
    now = int(time.time() * 1000)
    batch = [Metric(f"eval.{key}", float(value), now, 0) for key, value in metrics.items()
             if math.isfinite(float(value)) and logged.get(f"eval.{key}") != float(value)]
    for start in range(0, len(batch), 1000):  # MLflow's batch limit
        client.log_batch(run_id, metrics=batch[start:start + 1000])


def resolve_run(client: MlflowClient, run_id: str | None, experiment_id: str, content_hash: str,
                run_name: str | None = None) -> tuple[str, str]:
    """The run to log into: the training run when the store has it; else a run made earlier by this stage for the
    same model (so retries stay idempotent); else a new one, named `run_name` (default `register-<hash>`). Returns
    (run_id, why a fallback was needed or "")."""
    run_name = run_name or f"register-{content_hash[:8]}"
    why = ""
    if run_id:
        try:
            run = client.get_run(run_id)
            if run.info.lifecycle_stage != "deleted":
                return run_id, ""
            why = f"training run {run_id} is deleted in {tracking.tracking_uri()}"
        except MlflowException:
            why = f"training run {run_id} is not in {tracking.tracking_uri()}"
    else:
        why = f"{paths.report('train')} has no mlflow_run_id"
    earlier = client.search_runs(
        [experiment_id], filter_string=f"tags.`{MODEL_HASH_TAG}` = '{content_hash}'", max_results=1
    )
    if earlier:
        return earlier[0].info.run_id, f"{why}; reusing run {earlier[0].info.run_id} made for this model"
    run = client.create_run(
        experiment_id,
        run_name=run_name,
        tags={**tracking.run_tags(), MODEL_HASH_TAG: content_hash},
    )
    client.set_terminated(run.info.run_id)
    return run.info.run_id, f"{why}; logged into a new run {run.info.run_id}"


@contextmanager
def _resumed(run_id: str) -> Iterator[None]:
    """Reopen a run for logging, then give it back its status: a failure here must not mark training FAILED."""
    status = MlflowClient().get_run(run_id).info.status
    mlflow.start_run(run_id=run_id)
    try:
        yield
    finally:
        mlflow.end_run(status=status if status in TERMINAL_STATUSES else "FINISHED")


def find_version(client: MlflowClient, name: str, run_id: str) -> ModelVersion | None:
    """The oldest version of `name` registered from `run_id`, or None."""
    versions = client.search_model_versions(f"name = '{name}' and run_id = '{run_id}'")
    return min(versions, key=lambda v: int(v.version)) if versions else None


def find_logged_model(client: MlflowClient, run_id: str, content_hash: str) -> LoggedModel | None:
    """A complete model logged into `run_id` with this content hash (left by an earlier, interrupted attempt)."""
    experiment_id = client.get_run(run_id).info.experiment_id
    found = client.search_logged_models(
        [experiment_id], filter_string=f"source_run_id = '{run_id}' AND tags.`{MODEL_HASH_TAG}` = '{content_hash}'"
    )
    ready = [model for model in found if model.status == LoggedModelStatus.READY]
    return ready[0] if ready else None


def register_model_version(
    client: MlflowClient,
    name: str,
    run_id: str,
    model_uri: str,
    tags: dict[str, str],
    model_id: str | None = None,
) -> ModelVersion:
    """Create the version of `name` for `run_id`, or return the one that exists. Safe to call again after a crash
    or a retry: one run never gets two versions, and tags missing from an existing version are filled in."""
    existing = find_version(client, name, run_id)
    if existing is not None:
        for key, value in tags.items():
            if key not in existing.tags:
                client.set_model_version_tag(name, existing.version, key, value)
        return client.get_model_version(name, existing.version)
    try:
        client.create_registered_model(name, description="Fine-tuned by frugaltune. See the version tags.")
    except MlflowException as exc:
        if exc.error_code not in ("RESOURCE_ALREADY_EXISTS", "ALREADY_EXISTS"):
            raise
    return client.create_model_version(name, source=model_uri, run_id=run_id, tags=tags, model_id=model_id)


def _holder(client: MlflowClient, name: str, alias: str) -> ModelVersion | None:
    try:
        return client.get_model_version_by_alias(name, alias)
    except MlflowException:
        return None


def _not_comparable(holder: ModelVersion, version: ModelVersion) -> str | None:
    """Why two versions' metrics cannot be compared (other label set, other evaluation data), or None."""
    held, new = (v.tags.get(TASK_TAG, "classification") for v in (holder, version))  # untagged: a classifier
    if held != new:
        return f"the task differs (v{holder.version}: {held}, this version: {new})"
    for tag, what in ((LABELS_TAG, "label set"), (EVAL_DATA_TAG, "evaluation data")):
        held, new = holder.tags.get(tag), version.tags.get(tag)
        if held is None:
            return f"v{holder.version} records no {what} (registered before frugaltune tagged it)"
        if held != new:
            shown = (held, new) if tag == LABELS_TAG else (held[:12], new[:12] if new else new)
            return f"the {what} differs (v{holder.version}: {shown[0]}, this version: {shown[1]})"
    return None


def _holder_metric(client: MlflowClient, holder: ModelVersion, metric_tag: str) -> float | None:
    """The holder's `metric_tag`: its version tag, else its run's `eval.<metric_tag>` metric (a version tagged with
    another register.metric keeps the others on its run)."""
    if metric_tag in holder.tags:
        return float(holder.tags[metric_tag])
    try:
        return client.get_run(holder.run_id).data.metrics.get(f"eval.{metric_tag}") if holder.run_id else None
    except MlflowException:
        return None


def version_tags(metrics: dict[str, str], metric_tag: str, eval_data: dict[str, str],
                 content_hash: str) -> dict[str, str]:
    """The handful of tags a version carries: code and data (`git_commit`, `data_hash`), what its metric was
    measured on (`eval_data`), its content hash, and the one metric the alias rule compares."""
    run = tracking.run_tags()
    return {**{key: run[key] for key in VERSION_RUN_TAGS if key in run}, **eval_data,
            MODEL_HASH_TAG: content_hash, metric_tag: metrics[metric_tag]}


def headline_metrics(metrics: dict[str, str], metric: str) -> list[str]:
    """The run metrics the runs table shows first: the task's metric, fine-tuned then baseline, then the cost."""
    task = [f"eval.{kind}.{metric}" for kind in ("finetuned", "baseline") if f"{kind}.{metric}" in metrics]
    return [*task, *TRAINING_METRICS]


def update_alias(
    client: MlflowClient, name: str, alias: str, version: ModelVersion, metric_tag: str, higher_is_better: bool
) -> tuple[ModelVersion, str]:
    """Point `alias` at `version` when it beats the holder on `metric_tag`; return (holder after, reason)."""
    value = float(version.tags[metric_tag])
    holder = _holder(client, name, alias)
    if holder is not None and str(holder.version) == str(version.version):
        return holder, f"already holds @{alias}"
    if holder is None:
        reason = f"@{alias} was unset"
    elif (mismatch := _not_comparable(holder, version)) is not None:
        return holder, (f"not compared with v{holder.version}: {mismatch}, so their {metric_tag} measure different "
                        f"things; @{alias} stays on v{holder.version}. To track this task, set register.model_name "
                        "to a name of its own.")
    elif (held := _holder_metric(client, holder, metric_tag)) is None:
        reason = f"holder v{holder.version} has no `{metric_tag}` to compare"
    else:
        wins = value > held if higher_is_better else value < held
        if not wins:
            return holder, f"{metric_tag} {value:.4f} does not beat v{holder.version}'s {held:.4f}"
        reason = f"{metric_tag} {value:.4f} beats v{holder.version}'s {held:.4f}"
    client.set_registered_model_alias(name, alias, version.version)
    return client.get_model_version(name, version.version), reason


def register_adapter(client: MlflowClient, reg: RegisterParams, run_id: str, base_dir: Path, adapter_dir: Path,
                     metrics: dict[str, str], eval_data: dict[str, str], content_hash: str) -> dict:
    """Log `adapter_dir` (on `base_dir`) into `run_id` as the serving pyfunc, register it as a version of
    `reg.model_name` tagged with `version_tags` (the rest of `metrics` go to the run, `eval.<name>`), and move `reg.alias` when it wins;
    return the report. Idempotent (see the module docstring). The federated pipeline registers its global adapter
    through this too (stages/federated_register.py): same serving, same champion rules."""
    metric_tag = f"finetuned.{reg.metric}"
    version = find_version(client, reg.model_name, run_id)
    if version is not None:
        registered = version.tags.get(MODEL_HASH_TAG, content_hash)
        if registered != content_hash:
            # The evaluation was of these files, not of the version's: neither its tags nor its run's metrics may
            # take numbers measured on them.
            raise RegisterError(
                f"run {run_id} already has {reg.model_name} v{version.version}, registered from other files (model "
                f"hash {registered[:12]}) than {adapter_dir} and {base_dir}/config.json hold now ({content_hash[:12]}"
                f"): v{version.version} and its metrics are left as they were. A new model needs a training run of "
                f"its own (`dvc repro -f train`); if these files should be v{version.version}'s, they were changed or "
                "damaged: `dvc checkout` them.")
    log_eval_metrics(client, run_id, metrics)
    tracking.save_runs_view(client, client.get_run(run_id).info.experiment_id, headline_metrics(metrics, reg.metric))
    if version is not None:
        print(f"register: run {run_id} already has {reg.model_name} v{version.version}; reusing it")
        model_uri, model_id = version.source, version.model_id
    elif (logged := find_logged_model(client, run_id, content_hash)) is not None:
        model_uri, model_id = logged.model_uri, logged.model_id
    else:
        with _resumed(run_id):
            info = pyfunc.log_model(
                base_dir, adapter_dir, name=LOGGED_MODEL_NAME, tags={MODEL_HASH_TAG: content_hash},
                **log_model_task(adapter_dir)
            )
        model_uri, model_id = info.model_uri, info.model_id
    tags = version_tags(metrics, metric_tag, eval_data, content_hash)
    version = register_model_version(client, reg.model_name, run_id, model_uri, tags, model_id=model_id)
    # A rerun after a new evaluation of the same model: the version's metric tag follows reports/evaluate.json.
    stale = {key: value for key, value in tags.items()
             if key not in VERSION_RUN_TAGS and version.tags.get(key) != value}
    for key, value in stale.items():
        client.set_model_version_tag(reg.model_name, version.version, key, value)
    if stale:
        version = client.get_model_version(reg.model_name, version.version)
    champion, reason = update_alias(client, reg.model_name, reg.alias, version, metric_tag, reg.higher_is_better)

    promoted = str(champion.version) == str(version.version)  # int or str, depending on the store
    report = {
        "model_name": reg.model_name,
        "version": int(version.version),
        "run_id": run_id,
        "alias": reg.alias,
        "metric": reg.metric,
        "metric_value": float(version.tags[metric_tag]),
        "promoted": int(promoted),  # 1 when this version holds the alias after the stage
        "champion_version": int(champion.version),
        "champion_metric_value": _holder_metric(client, champion, metric_tag),
    }
    print(f"register: {reg.model_name} v{version.version} ({metric_tag}={report['metric_value']:.4f}); "
          f"@{reg.alias} -> v{champion.version} ({reason})")
    return report
