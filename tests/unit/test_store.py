"""The MLflow store guard (frugaltune/store.py): backups with sqlite's backup API, the integrity check and its one-line
message, restore, and the write lock. Real sqlite files made by real MLflow, in temp dirs; a real second process
holds the lock.

    pytest tests/unit/test_store.py
"""

from __future__ import annotations

import http.server
import os
import shutil
import socket
import sqlite3
import subprocess
import sys
import threading
import time
from contextlib import closing
from pathlib import Path

import pytest

from frugaltune import cli, store
from tests.unit.test_register import mlflow_project

ROOT = Path(__file__).resolve().parents[2]


def zero(db: Path, offset: int, size: int = 8192) -> None:
    with db.open("r+b") as handle:
        handle.seek(offset)
        handle.write(b"\0" * size)


def describe_model(db: Path, text: str) -> None:
    """A write to the store, as MLflow would make it (one row changes)."""
    with closing(sqlite3.connect(db)) as con, con:
        con.execute("UPDATE registered_models SET description = ?", (text,))


@pytest.fixture(scope="module")
def made_by_mlflow(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """An MLflow sqlite store with model `tiny`, versions 1 and 2, v1 @champion (made in a subprocess, so this
    process keeps no connection to it)."""
    db = tmp_path_factory.mktemp("made") / "mlflow.db"
    code = ("import mlflow, sys; c = mlflow.MlflowClient(f'sqlite:///{sys.argv[1]}')\n"
            "c.create_registered_model('tiny')\n"
            "for _ in range(2): c.create_model_version('tiny', source='file:///nowhere')\n"
            "c.set_registered_model_alias('tiny', 'champion', '1')")
    subprocess.run([sys.executable, "-c", code, str(db)], check=True, capture_output=True, timeout=300)
    return db


@pytest.fixture
def db(made_by_mlflow: Path, tmp_path: Path) -> Path:
    copy = tmp_path / "mlflow.db"
    shutil.copy(made_by_mlflow, copy)
    return copy


def test_only_a_local_sqlite_uri_is_guarded(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    assert store.sqlite_path("sqlite:////abs/dir/mlflow.db") == Path("/abs/dir/mlflow.db")
    assert store.sqlite_path("sqlite:///mlflow.db") == Path("mlflow.db")
    for other in ("http://127.0.0.1:5000", "https://mlflow.example.com", "file:///tmp/mlruns", "sqlite://", "mlruns"):
        assert store.sqlite_path(other) is None, other
    monkeypatch.chdir(tmp_path)
    with store.guarded_write("http://127.0.0.1:5000"):
        store.check("file:///tmp/mlruns")
    assert list(tmp_path.iterdir()) == []  # no lock, no backup


def free_port() -> int:
    """A port nothing listens on (bound, then released)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_a_server_that_is_down_is_named_with_the_fix_in_a_second(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", raising=False)
    uri = f"http://127.0.0.1:{free_port()}"
    began = time.monotonic()
    with pytest.raises(store.StoreUnreachable) as refused:
        store.check(uri)
    message = str(refused.value)
    assert time.monotonic() - began < 2 and "\n" not in message
    assert uri in message and "refused" in message.lower(), message
    assert "make mlflow-server" in message and "unset MLFLOW_TRACKING_URI" in message, message
    assert "MLFLOW_HTTP_REQUEST_MAX_RETRIES" not in os.environ  # nothing to retry against


def test_a_server_that_accepts_but_never_answers_times_out_once() -> None:
    with socket.socket() as listening:  # the kernel accepts connections; nobody reads or answers
        listening.bind(("127.0.0.1", 0))
        listening.listen(4)
        uri = f"http://127.0.0.1:{listening.getsockname()[1]}/"
        began = time.monotonic()
        with pytest.raises(store.StoreUnreachable, match="does not answer: nothing within 0.5 s"):
            store.check_server(uri, timeout=0.5)
        assert time.monotonic() - began < 3  # one try, no retries


def test_a_server_that_answers_passes_and_shortens_mlflows_retries(monkeypatch: pytest.MonkeyPatch) -> None:
    asked = []

    class Health(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 (http.server's name)
            asked.append(self.path)
            self.send_error(404)  # any answer means a server is there (a proxy may not know /health)

        def log_message(self, *args: object) -> None:
            pass

    for name in store.HTTP_RETRY_DEFAULTS:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR", "5")  # the user's own value wins
    with http.server.ThreadingHTTPServer(("127.0.0.1", 0), Health) as server:
        threading.Thread(target=server.serve_forever, daemon=True).start()
        try:
            store.check(f"http://127.0.0.1:{server.server_address[1]}/prefix/")
        finally:
            server.shutdown()
    assert asked == ["/prefix/health"]
    assert os.environ["MLFLOW_HTTP_REQUEST_MAX_RETRIES"] == store.HTTP_RETRY_DEFAULTS["MLFLOW_HTTP_REQUEST_MAX_RETRIES"]
    assert os.environ["MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR"] == "5"


def test_a_backup_holds_the_store_and_only_the_newest_are_kept(db: Path) -> None:
    first = store.backup(db, keep=3)
    assert first.parent == db.parent / "mlflow-backups" and store.version_count(first) == 2
    assert store.backup(db, keep=3) == first  # nothing changed: not kept twice
    for n in range(4):
        describe_model(db, f"change {n}")
        store.backup(db, keep=3)
    kept = store.backups(db)
    assert len(kept) == 3 and first not in [b.path for b in kept]
    assert [b.taken for b in kept] == sorted((b.taken for b in kept), reverse=True)
    with closing(sqlite3.connect(kept[0].path)) as con:
        assert con.execute("SELECT description FROM registered_models").fetchone()[0] == "change 3"


def test_a_zeroed_store_is_named_with_its_problem_its_newest_good_backup_and_the_restore_command(db: Path) -> None:
    good = store.backup(db)
    zero(db, 8192)
    with pytest.raises(store.StoreDamaged) as caught:
        store.check(f"sqlite:///{db}")
    message = str(caught.value)
    assert "\n" not in message
    assert message.startswith(f"{db}: the MLflow store is damaged (database disk image is malformed)")
    assert f"{good} (" in message and "2 registered versions" in message
    assert f"`frugaltune registry restore --store {db}`" in message

    zero(db, 0)  # the header too
    with pytest.raises(store.StoreDamaged, match="file is not a database"):
        store.check(f"sqlite:///{db}")


def test_a_missing_store_is_an_error_only_when_backups_of_it_exist(db: Path) -> None:
    store.backup(db)
    db.unlink()
    with pytest.raises(store.StoreDamaged, match="is missing, but backups of it exist.*frugaltune registry restore"):
        store.check(f"sqlite:///{db}")
    # A register would start a new, empty registry in its place.
    with pytest.raises(store.StoreDamaged), store.guarded_write(f"sqlite:///{db}"):
        pytest.fail("a write into a lost store was allowed")
    assert not db.exists()
    shutil.rmtree(db.parent / "mlflow-backups")
    store.check(f"sqlite:///{db}")  # a fresh project


def test_restore_takes_the_newest_good_backup_and_moves_the_damaged_store_and_its_journal_aside(db: Path) -> None:
    older = store.backup(db)
    describe_model(db, "newer")
    newer = store.backup(db)
    zero(newer, 8192)  # the newest backup is damaged too
    zero(db, 8192)
    db.with_name("mlflow.db-journal").write_bytes(b"\0" * 512)  # a journal left by a killed writer

    used, moved = store.restore(db)

    assert used.path == older and store.integrity_problem(db) is None and store.version_count(db) == 2
    assert moved is not None and moved.parent == db.parent / "mlflow-backups" / "replaced"
    assert not db.with_name("mlflow.db-journal").exists()
    assert moved.with_name(moved.name + "-journal").exists()
    assert len(store.backups(db)) == 2  # restoring consumed no backup


def test_restore_leaves_a_healthy_store_alone_unless_forced(db: Path) -> None:
    backup = store.backup(db)
    describe_model(db, "after the backup")
    with pytest.raises(store.StoreError, match="passes its integrity check.*--force"):
        store.restore(db)
    used, moved = store.restore(db, backup, force=True)
    assert used.path == backup and moved is not None
    with closing(sqlite3.connect(db)) as con:
        assert con.execute("SELECT description FROM registered_models").fetchone()[0] != "after the backup"


def test_a_second_writer_waits_for_the_lock_then_fails_naming_the_holder(db: Path) -> None:
    code = ("import sys, time; from pathlib import Path; from frugaltune import store\n"
            "with store.write_lock(Path(sys.argv[1])):\n    print('held', flush=True); time.sleep(60)")
    holder = subprocess.Popen([sys.executable, "-c", code, str(db)], cwd=ROOT, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        start = time.monotonic()
        busy = f"pid {holder.pid} .*held its lock .* for more than 1 s"
        with pytest.raises(store.StoreBusy, match=busy), store.write_lock(db, timeout=1):
            pytest.fail("two writers held the lock")
        assert time.monotonic() - start >= 1
    finally:
        holder.kill()
        holder.wait()
    with store.write_lock(db, timeout=5):  # released by the kernel when the holder died
        pass


def test_predict_on_a_damaged_store_prints_the_restore_command_and_not_register_first(
        db: Path, capsys: pytest.CaptureFixture[str]) -> None:
    store.backup(db)
    zero(db, 8192)
    with mlflow_project(db.parent):
        assert cli.main(["predict", "what a great day"]) == 1
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and "malformed" in err and "frugaltune registry restore" in err, err
        assert "Register a model first" not in err

        assert cli.main(["registry", "restore"]) == 0  # the tracking store of the cwd: ./mlflow.db
        assert "restored" in capsys.readouterr().out and store.integrity_problem(db) is None


def test_predict_says_register_first_only_when_the_store_holds_no_model(
        db: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with mlflow_project(db.parent):
        assert cli.main(["predict", "--model-uri", "models:/other@champion", "hello"]) == 1
        err = capsys.readouterr().err
        assert "The store holds tiny" in err and "Register a model first" not in err
