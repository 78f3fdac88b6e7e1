"""What a user reads in the MLflow UI: the runs table's training figures are the run's summary (reports/train.json),
not the value of the last logged step, and the base models' experiment is named as internal. A real sqlite store in
a temp dir; the train recipe's own functions log the metrics.

    pytest tests/unit/test_mlflow_ui.py
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import mlflow
import pytest
from mlflow import MlflowClient

from frugaltune import registry
from frugaltune.serving import base as serving
from frugaltune.serving.files import dir_sha256
from frugaltune.recipes import train


@pytest.fixture(scope="module")
def client(tmp_path_factory: pytest.TempPathFactory) -> Iterator[MlflowClient]:
    """One store for the module: MLflow creates a store's tables in seconds."""
    folder = tmp_path_factory.mktemp("mlflow_ui")
    uri = f"sqlite:///{folder / 'mlflow.db'}"
    with pytest.MonkeyPatch.context() as patch:
        patch.chdir(folder)
        patch.setenv("MLFLOW_TRACKING_URI", uri)
        mlflow.set_tracking_uri(uri)
        yield MlflowClient(uri)


def test_the_runs_table_shows_the_runs_tokens_per_s_not_the_last_steps(client: MlflowClient) -> None:
    """Issue 94: the table said 421.75 tokens/s (the last window's) for a run that reported 48.0 useful tokens/s."""
    mlflow.set_experiment("task")
    with mlflow.start_run() as run:
        for step, window in ((10, 45.2), (20, 51.0), (30, 421.75)):  # the last window: a few short rows, fast
            record = {"step": step, "loss": 1.0 / step, "lr": 2e-4, "tokens_per_s": window, "elapsed_s": step * 2.0,
                      "step_fwd_bwd_ms": 80.0}
            mlflow.log_metrics(train.step_metrics(record), step=step)
        report = {"final_loss": 0.0333, "tokens_per_s": 48.0, "wall_seconds": 61.5, "peak_rss_mb": 3546.3,
                  "steps": 30, "threads": 2, "bf16": 0, "int8_products": {"on": False}, "plan": {"eta_seconds": 60}}
        mlflow.log_metrics(train.summary_metrics(report))
    (row,) = client.search_runs([run.info.experiment_id])  # what the runs table shows
    for name in registry.TRAINING_METRICS:  # the columns register saves on the runs view
        assert row.data.metrics[name] == report[name], name
    assert "threads" not in row.data.metrics and "bf16" not in row.data.metrics  # setup: params, not metrics
    history = client.get_metric_history(run.info.run_id, "step/tokens_per_s")  # the per-step series is kept
    assert [(m.step, m.value) for m in history] == [(10, 45.2), (20, 51.0), (30, 421.75)]
    assert {"step/loss", "step/lr", "step/step_fwd_bwd_ms"} <= set(row.data.metrics)


def test_the_base_models_experiment_is_named_internal_and_a_stores_old_one_is_renamed(
        client: MlflowClient, tmp_path: Path) -> None:
    base = tmp_path / "base"
    base.mkdir()
    (base / "config.json").write_text("{}")
    sha = dir_sha256(base)
    old = client.create_experiment("frugaltune-base-models")  # a store from before: one base stored there
    stored = client.create_run(old, tags={serving.BASE_SHA_TAG: sha, serving.BASE_COMPLETE_TAG: "1"})

    assert serving.log_base_model(base, sha) == f"runs:/{stored.info.run_id}/{serving.BASE_ARTIFACT}"  # no upload
    names = {e.name for e in client.search_experiments()}
    assert "frugaltune-base-models" not in names and serving.BASE_EXPERIMENT in names
    assert serving.BASE_EXPERIMENT.startswith("[internal]")
    experiment = client.get_experiment(old)
    assert experiment.name == serving.BASE_EXPERIMENT and "not a task" in experiment.tags["mlflow.note.content"]
