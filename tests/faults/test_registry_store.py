"""The MLflow store (mlflow.db) under faults: damaged, deleted with its backups left, written by two `register` runs at
once, and its writer killed -9. The registry must never be lost: each test ends with the same @champion (or the one
the run should have made) in a store that passes sqlite's integrity check.

Run with `make test` or `pytest -m slow tests/faults/test_registry_store.py` (about two minutes). A tiny model and a
fake evaluation (as tests/unit/test_register.py builds them) are registered by the real stage, `python -m
stages.register`, in a process of its own; the restore is the command the error message prints, run by a shell.
Each test is a row of docs/FAULTS.md (see table.py).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import sqlite3
import subprocess
import sys
import time
from contextlib import closing
from pathlib import Path

import pytest

from frugaltune import paths, store
from tests.faults.helpers import ROOT, env, in_private_mounts
from tests.faults.table import fault
from tests.unit.test_register import (
    EXPERIMENT,
    LABELS,
    MODEL_NAME,
    build_tiny_model,
    fake_reports,
    registered_file,
    write_eval_data,
)

pytestmark = pytest.mark.slow

TEXT = "what a great day"


def run_env(project: Path, **extra: str) -> dict[str, str]:
    # The project holds data and models only; stages/ and frugaltune/ come from this checkout.
    return env(PYTHONPATH=f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
               FRUGALTUNE_BASE_CACHE=str(project.parent / "base-cache"), **extra)


def sh(command: list[str] | str, project: Path, **extra: str) -> subprocess.CompletedProcess:
    return subprocess.run(command, cwd=project, env=run_env(project, **extra), capture_output=True, text=True,
                          timeout=300, check=False, shell=isinstance(command, str))


def register(project: Path, **extra: str) -> subprocess.CompletedProcess:
    done = sh([sys.executable, "-m", "stages.register"], project, **extra)
    assert done.returncode == 0, done.stdout + done.stderr
    return done


def predict(project: Path) -> subprocess.CompletedProcess:
    return sh(["frugaltune", "predict", "--json", TEXT], project)


def champion(project: Path) -> int:
    with closing(sqlite3.connect(project / "mlflow.db")) as con:
        return int(con.execute("SELECT version FROM registered_model_aliases WHERE name = ? AND alias = 'champion'",
                               (MODEL_NAME,)).fetchone()[0])


def the_restore_command(message: str) -> str:
    found = re.findall(r"`(frugaltune registry restore[^`]*)`", message)
    assert len(found) == 1, message
    return found[0]


@pytest.fixture(scope="module")
def registered(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str]:
    """A project with v1 of MODEL_NAME registered @champion by the stage; and what `frugaltune predict` answered."""
    project = tmp_path_factory.mktemp("registry") / "project"
    project.mkdir()
    build_tiny_model(project / paths.MODELS, LABELS)
    (project / paths.PARAMS).write_text(f"register:\n  model_name: {MODEL_NAME}\ntrain:\n  experiment: {EXPERIMENT}\n")
    with pytest.MonkeyPatch.context() as patch:
        patch.chdir(project)
        write_eval_data(LABELS)
        fake_reports(0.6, None)  # register logs the model into a run of its own
    register(project)
    answer = predict(project)
    assert answer.returncode == 0, answer.stderr
    assert champion(project) == 1 and store.backups(project / "mlflow.db")
    return project, answer.stdout


@pytest.fixture
def project(registered: tuple[Path, str], tmp_path: Path) -> Path:
    """A copy of the registered project (its store's artifact location stays the original's mlartifacts/)."""
    copy = tmp_path / "project"
    shutil.copytree(registered[0], copy)
    return copy


@fault("disk", "the MLflow store (mlflow.db) damaged: 8 KB overwritten with zeros",
       "`frugaltune predict` stops with one line: the file, sqlite's error, the newest good backup (date, registered "
       "versions) and the command that restores it; `register` refuses to write into the damaged file",
       "recovered: the printed `frugaltune registry restore` puts back the backup taken after the last register; "
       "`frugaltune predict` answers with the same @champion; the damaged file is kept in mlflow-backups/replaced/")
def test_a_damaged_store_is_restored_by_the_printed_command(registered, project):
    db = project / "mlflow.db"
    with db.open("r+b") as handle:
        handle.seek(8192)
        handle.write(b"\0" * 8192)

    failed = predict(project)
    assert failed.returncode == 1 and "Traceback" not in failed.stderr, failed.stderr
    [message] = [line for line in failed.stderr.splitlines() if line.startswith("frugaltune predict:")]
    assert f"{db}: the MLflow store is damaged (database disk image is malformed)" in message, message
    assert "1 registered version)" in message and "Register a model first" not in failed.stderr, message
    with pytest.raises(store.StoreDamaged), store.guarded_write(f"sqlite:///{db}"):  # as the register stages do
        pytest.fail("a register would have written into a damaged store")

    restored = sh(the_restore_command(message), project)
    assert restored.returncode == 0, restored.stderr
    assert list((project / "mlflow-backups" / "replaced").iterdir())
    answer = predict(project)
    assert answer.returncode == 0, answer.stderr
    assert answer.stdout == registered[1] and champion(project) == 1


@fault("disk", "one bit flipped in a registered version's adapter file (mlartifacts/.../adapter/"
       "adapter_model.safetensors)",
       "`frugaltune predict` (and any `mlflow.pyfunc.load_model` of it) stops with one line: the version, the file, "
       "the sha256 it was logged with and the one found, and the fix (the logged file back, or a retrained model "
       "registered); a damaged safetensors header in a loaded adapter is one line naming the file",
       "nothing predicted from the damaged file; the version, its tags and @champion unchanged")
def test_a_damaged_registered_adapter_is_refused_on_load(registered):
    from mlflow import MlflowClient

    project = registered[0]
    client = MlflowClient(f"sqlite:///{project / 'mlflow.db'}")
    tensors = registered_file(client, "1", "adapter/adapter_model.safetensors")
    original = tensors.read_bytes()
    damaged = bytearray(original)
    damaged[len(damaged) // 2] ^= 1
    tensors.write_bytes(bytes(damaged))
    try:
        failed = predict(project)
    finally:
        tensors.write_bytes(original)  # the fixture's project is shared: its artifacts stay as they were
    assert failed.returncode == 1 and "Traceback" not in failed.stderr, failed.stderr
    [line] = failed.stderr.splitlines()
    assert line.startswith(f"frugaltune predict: cannot load models:/{MODEL_NAME}@champion = {MODEL_NAME} version 1 "), line
    assert "adapter/adapter_model.safetensors of the model: sha256 " in line and "damaged" in line, line
    assert champion(project) == 1


@fault("disk", "the MLflow store (mlflow.db) deleted, its backups left",
       "one line: the store is missing, its newest backup and the restore command; `register` refuses to start a "
       "new, empty registry in its place", "recovered: the printed command restores it; @champion unchanged")
def test_a_deleted_store_with_backups_is_not_replaced_by_an_empty_one(project):
    db = project / "mlflow.db"
    db.unlink()
    failed = predict(project)
    assert failed.returncode == 1 and "is missing, but backups of it exist" in failed.stderr, failed.stderr
    with pytest.raises(store.StoreDamaged), store.guarded_write(f"sqlite:///{db}"):  # as the register stages do
        pytest.fail("a register would have started an empty registry")
    assert not db.exists()

    restored = sh(the_restore_command(failed.stderr), project)
    assert restored.returncode == 0, restored.stderr
    assert store.integrity_problem(db) is None and champion(project) == 1


def better_training_run(project):
    """A finished training run in the project's store whose reports score better than @champion's (0.7): the store's
    client and the run's id."""
    from mlflow import MlflowClient

    client = MlflowClient(f"sqlite:///{project / 'mlflow.db'}")
    run = client.create_run(client.get_experiment_by_name(EXPERIMENT).experiment_id)
    client.set_terminated(run.info.run_id)
    with pytest.MonkeyPatch.context() as patch:
        patch.chdir(project)
        fake_reports(0.7, run.info.run_id)
    return client, run.info.run_id


@fault("process", "two `register` runs at once on one MLflow store",
       "the second waits for the first (a line names the writer's pid), then runs",
       "nothing doubled or lost: one version for the training run, @champion moved once, the store passes "
       "sqlite's integrity check")
def test_two_registers_at_once(project):
    client, run_id = better_training_run(project)  # both register runs would register it and move @champion
    marker = project.parent / "first-holds-the-lock"
    command = [sys.executable, "-m", "stages.register"]
    # The first pauses while it holds the lock (until the marker is deleted): the second surely finds it taken.
    first = subprocess.Popen(command, cwd=project, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                             env=run_env(project, FRUGALTUNE_FAULT="store:mlflow.db:pause",
                                         FRUGALTUNE_FAULT_MARKER=str(marker)))
    deadline = time.monotonic() + 120
    while not marker.exists():
        assert first.poll() is None, first.stdout.read()
        assert time.monotonic() < deadline, "the first register never took the lock"
        time.sleep(0.2)
    log = project.parent / "second.log"
    with log.open("w") as out:
        second = subprocess.Popen(command, cwd=project, stdout=out, stderr=subprocess.STDOUT, text=True,
                                  env=run_env(project))
        deadline = time.monotonic() + 120
        while "waiting" not in log.read_text():
            assert second.poll() is None, log.read_text()
            assert time.monotonic() < deadline, "the second register never waited for the lock"
            time.sleep(0.2)
        assert f"pid {marker.read_text()}" in log.read_text()
        marker.unlink()  # the first goes on
        first_output, _ = first.communicate(timeout=180)
        second.wait(timeout=180)
    assert first.returncode == 0, first_output
    assert second.returncode == 0, log.read_text()
    versions = client.search_model_versions(f"name = '{MODEL_NAME}' and run_id = '{run_id}'")
    assert [v.version for v in versions] == [2]
    assert "already has" in log.read_text()  # the second found the first's version instead of making another
    assert champion(project) == 2 and store.integrity_problem(project / "mlflow.db") is None


WRITER = """
import sqlite3, sys, time
con = sqlite3.connect(sys.argv[1], isolation_level=None)
con.execute("PRAGMA cache_size = 2")  # dirty pages go to the file before the commit: a torn file if not rolled back
con.execute("BEGIN IMMEDIATE")
con.execute("UPDATE registered_model_aliases SET version = 99")
con.execute("CREATE TABLE half_written (x)")
con.executemany("INSERT INTO half_written VALUES (randomblob(1000))", [()] * 2000)
print("mid-transaction", flush=True)
time.sleep(600)
"""


@fault("process", "kill -9 in `register` while it holds the store's write lock; a writer of mlflow.db killed -9 "
       "inside its sqlite transaction", "the process dies",
       "recovered, nothing lost: the lock goes with the process, sqlite rolls the half-done transaction back "
       "(integrity check passes, @champion unchanged), and the rerun registers")
def test_kill9_while_writing_the_store(project):
    db = project / "mlflow.db"
    marker = project.parent / "register-holds-the-lock"
    killed = subprocess.Popen([sys.executable, "-m", "stages.register"], cwd=project, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True,
                              env=run_env(project, FRUGALTUNE_FAULT="store:mlflow.db:hang",
                                          FRUGALTUNE_FAULT_MARKER=str(marker)))
    deadline = time.monotonic() + 120
    while not marker.exists():
        assert killed.poll() is None, killed.stdout.read()
        assert time.monotonic() < deadline, "register never took the lock"
        time.sleep(0.2)
    os.kill(killed.pid, signal.SIGKILL)
    killed.wait(timeout=60)
    with store.write_lock(db, timeout=0):  # free at once: no stale lock
        pass
    assert not list((project / "mlflow-backups").glob(".*.partial"))

    writer = subprocess.Popen([sys.executable, "-c", WRITER, str(db)], stdout=subprocess.PIPE, text=True)
    assert writer.stdout.readline().strip() == "mid-transaction"
    assert db.with_name("mlflow.db-journal").exists()  # the transaction is half on disk
    writer.kill()
    writer.wait(timeout=60)

    assert store.integrity_problem(db) is None  # opening rolls the hot journal back
    with closing(sqlite3.connect(db)) as con:
        assert not con.execute("SELECT name FROM sqlite_master WHERE name = 'half_written'").fetchall()
    assert champion(project) == 1
    done = register(project)
    assert "already has" in done.stdout and champion(project) == 1
    assert json.loads((project / "reports" / "register.json").read_text())["version"] == 1


# $1: the project, $2: the python, $3: the marker, $4: where the results go. The project is copied onto an 8 MB tmpfs;
# each register writes the store's backup (1 MB) first, so 100 KB free stops the first one there; the second pauses
# once that backup is taken (FRUGALTUNE_FAULT), the disk is filled to the last byte, and MLflow's writes hit it.
FILL_REGISTER = r"""
set -u
disk="$4/disk"; mkdir -p "$disk"; mount -t tmpfs -o size=8m tmpfs "$disk"
cp -a "$1" "$disk/project"; cd "$disk/project"
fill() { dd if=/dev/zero of="$disk/fill" bs=1k count="$1" 2>/dev/null; }
fill $(( $(df --output=avail -k "$disk" | tail -1) - 100 ))
"$2" -m stages.register > "$4/before-backup.log" 2>&1; echo $? > "$4/before-backup.rc"
rm "$disk/fill"
FRUGALTUNE_FAULT=store:mlflow.db:pause FRUGALTUNE_FAULT_MARKER="$3" "$2" -m stages.register > "$4/mlflow-write.log" 2>&1 &
until [ -f "$3" ] || ! kill -0 $! 2>/dev/null; do sleep 0.2; done
dd if=/dev/zero of="$disk/fill" bs=64k 2>/dev/null
rm -f "$3"; wait $!; echo $? > "$4/mlflow-write.rc"
rm "$disk/fill"; cp -a "$disk/project" "$4/after"
"""


@fault("disk", "the disk fills up during `register`: while it backs the store up, and while MLflow writes the store",
       "one line: no space left while backing up / writing mlflow.db, the store is intact, the fix (free space, "
       "rerun `dvc repro register`); not sqlite's traceback, nor MLflow's 70-line log of it",
       "the store intact (sqlite's integrity check passes, @champion unchanged); no half-written backup or journal "
       "left in mlflow-backups/")
def test_disk_full_during_register(project, tmp_path):
    better_training_run(project)  # register would write a version and move @champion
    done = in_private_mounts(FILL_REGISTER, str(project), sys.executable, str(tmp_path / "marker"), str(tmp_path),
                             run_env=run_env(project))
    assert (tmp_path / "after").is_dir(), done.stdout + done.stderr
    for name, doing in (("before-backup", "backing"), ("mlflow-write", "writing the MLflow store")):
        output = (tmp_path / f"{name}.log").read_text()
        assert (tmp_path / f"{name}.rc").read_text().strip() == "1", output
        assert output.strip().splitlines() == [output.strip()], output  # one line, no traceback, no MLflow log
        assert output.startswith(f"register: no space left on the device while {doing}"), output
        assert "The store is intact" in output and "rerun `dvc repro register`" in output, output
    after = tmp_path / "after"
    assert store.integrity_problem(after / "mlflow.db") is None and champion(after) == 1
    assert not [p.name for p in (after / "mlflow-backups").iterdir() if p.name.startswith(".")]
    assert not after.joinpath("mlflow.db-journal").exists()


# $1: a directory, mounted as an empty read-only file system; $2: the text to predict
READ_ONLY_CACHE = r"""
mount -t tmpfs -o ro,size=1m tmpfs "$1" || exit 99
FRUGALTUNE_BASE_CACHE="$1/bases" exec frugaltune predict "$2"
"""


@fault("disk", "FRUGALTUNE_BASE_CACHE on a read-only file system (`frugaltune predict` must put the base model there)",
       "one line: the variable, the path, the error (Read-only file system), and the fix (point it at a directory "
       "you can write); not a 28-line OSError traceback", "nothing written; the registry untouched")
def test_an_unwritable_base_cache_is_named_with_the_variable(project, tmp_path):
    cache = tmp_path / "read-only-cache"
    cache.mkdir()
    done = in_private_mounts(READ_ONLY_CACHE, str(cache), TEXT, cwd=project, run_env=run_env(project))
    output = done.stdout + done.stderr
    assert done.returncode == 1 and "Traceback" not in output, output
    [line] = [line for line in output.splitlines() if line.startswith("frugaltune predict: cannot load")]
    assert f"FRUGALTUNE_BASE_CACHE={cache}/bases: cannot write the base model there (Read-only file system" in line
    assert "Set FRUGALTUNE_BASE_CACHE to a directory you can write" in line, line
