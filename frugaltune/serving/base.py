"""The base model stored once in the tracking store, and found again: the local cache, else a hash-checked download.

Library code, not run directly: `log_model` stores the base (`log_base_model`) and the pyfunc models and
`frugaltune predict` resolve it (`resolve_base`).
"""

from __future__ import annotations

from pathlib import Path

import mlflow

from frugaltune.serving.files import dir_sha256

BASE_ARTIFACT = "base_model"  # versions logged before the base was stored once carry it as an artifact
# One run per distinct base model, tagged with its sha256. Named as what it is: it sits in the UI's experiment list
# beside the tasks' experiments, and holds no training run (its note says so too).
BASE_EXPERIMENT = "[internal] frugaltune base models"
OLD_BASE_EXPERIMENTS = ("frugaltune-base-models",)  # its name before: renamed in place, so no base is uploaded twice
BASE_EXPERIMENT_NOTE = ("Internal to frugaltune, not a task: the base model's weights, stored once and referenced by "
                        "every registered version trained on them (serving.log_base_model). Deleting it breaks loading "
                        "those versions where the base is not in the local cache.")
BASE_SHA_TAG = "frugaltune.base_sha256"
BASE_COMPLETE_TAG = "frugaltune.base_complete"  # set only after every file is uploaded
BASE_CACHE_ENV = "FRUGALTUNE_BASE_CACHE"
# log_model points this at the local base dir for the load MLflow does right after logging (input example check).
_LOCAL_BASE_ENV = "FRUGALTUNE_LOCAL_BASE_"


def base_cache_root() -> Path:
    import os

    return Path(os.environ.get(BASE_CACHE_ENV) or Path.home() / ".cache" / "frugaltune" / "bases")


def resolve_base(sha256: str, uri: str) -> Path:
    """A local directory holding the base model whose hash is `sha256`: the cache, else downloaded from `uri`.

    The download goes to a temporary directory beside the cache entry, is hashed, and is renamed into place only
    when the hash matches, so a cache entry is always complete.
    """
    import os
    import shutil
    import tempfile

    hint = os.environ.get(_LOCAL_BASE_ENV + sha256[:16])
    if hint and Path(hint).is_dir():
        return Path(hint)
    cached = base_cache_root() / sha256
    if (cached / ".sha256").is_file() and (cached / ".sha256").read_text().strip() == sha256:
        return cached
    try:
        cached.parent.mkdir(parents=True, exist_ok=True)
        staging = Path(tempfile.mkdtemp(prefix=f".{sha256[:12]}-", dir=cached.parent))
    except OSError as exc:  # read-only, not ours, a file in the way: one line, with the variable that moves it
        where = (f"{BASE_CACHE_ENV}={os.environ[BASE_CACHE_ENV]}" if os.environ.get(BASE_CACHE_ENV)
                 else f"the default base model cache {cached.parent}")
        raise OSError(
            f"{where}: cannot write the base model there ({exc.strerror}: {exc.filename}). Set {BASE_CACHE_ENV} "
            f"to a directory you can write (it holds one copy of each base model, {sha256[:12]}... here)."
        ) from None
    try:
        try:
            local = Path(mlflow.artifacts.download_artifacts(artifact_uri=uri, dst_path=str(staging)))
        except Exception as exc:  # MlflowException, OSError: the message names what to do either way
            raise FileNotFoundError(
                f"base model sha256 {sha256} is not in the local cache ({cached}) and could not be downloaded "
                f"from {uri} (tracking store {mlflow.get_tracking_uri()}): {exc}. Load from the store that "
                f"registered the model (MLFLOW_TRACKING_URI), or put the base model's files in {cached}."
            ) from None
        found = dir_sha256(local)
        if found != sha256:
            raise ValueError(f"{uri}: the downloaded base model hashes to {found}, not {sha256}: refusing to use it.")
        (local / ".sha256").write_text(sha256)
        try:
            os.replace(local, cached)
        except OSError:  # another process put it in place first
            if not (cached / ".sha256").is_file():
                raise
        return cached
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def log_base_model(base_dir: str | Path, sha256: str | None = None) -> str:
    """Store the base model once in the tracking store; return its artifact URI (`runs:/<run>/base_model`).

    Idempotent: a base with the same sha256 already uploaded completely is reused. Leaves the active run and
    experiment as they were.
    """
    from mlflow import MlflowClient

    sha256 = sha256 or dir_sha256(base_dir)
    client = MlflowClient()
    experiment = client.get_experiment_by_name(BASE_EXPERIMENT)
    for name in OLD_BASE_EXPERIMENTS if experiment is None else ():
        old = client.get_experiment_by_name(name)
        if old is not None and old.lifecycle_stage == "active":
            # a store from before the rename: its bases stay where the versions point (runs:/<run id>/...)
            client.rename_experiment(old.experiment_id, BASE_EXPERIMENT)
            experiment = client.get_experiment(old.experiment_id)
            break
    if experiment is None:
        from mlflow.exceptions import MlflowException

        try:
            experiment_id = client.create_experiment(BASE_EXPERIMENT, **_artifact_location())
        except MlflowException:  # created meanwhile by another process
            experiment_id = client.get_experiment_by_name(BASE_EXPERIMENT).experiment_id
    else:
        experiment_id = experiment.experiment_id
    if experiment is None or experiment.tags.get("mlflow.note.content") != BASE_EXPERIMENT_NOTE:
        client.set_experiment_tag(experiment_id, "mlflow.note.content", BASE_EXPERIMENT_NOTE)  # the UI's description
    found = client.search_runs([experiment_id], filter_string=(
        f"tags.`{BASE_SHA_TAG}` = '{sha256}' AND tags.`{BASE_COMPLETE_TAG}` = '1'"), max_results=1)
    if found:
        return f"runs:/{found[0].info.run_id}/{BASE_ARTIFACT}"
    run = client.create_run(experiment_id, run_name=f"base-{sha256[:12]}", tags={BASE_SHA_TAG: sha256})
    try:
        client.log_artifacts(run.info.run_id, str(base_dir), BASE_ARTIFACT)
    except BaseException:
        client.set_terminated(run.info.run_id, "FAILED")
        raise
    client.set_tag(run.info.run_id, BASE_COMPLETE_TAG, "1")
    client.set_terminated(run.info.run_id)
    return f"runs:/{run.info.run_id}/{BASE_ARTIFACT}"


def _artifact_location() -> dict[str, str]:
    """With the default sqlite store, artifacts go to ./mlartifacts beside it (as frugaltune.tracking does)."""
    uri = mlflow.get_tracking_uri()
    if uri.startswith("sqlite:///"):
        return {"artifact_location": (Path(uri.removeprefix("sqlite:///")).parent / "mlartifacts").resolve().as_uri()}
    return {}
