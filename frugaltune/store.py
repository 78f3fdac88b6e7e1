"""The local MLflow store kept safe: an integrity check when it is opened, an online backup before and after every
write, one writer at a time, and a one-command restore.

    frugaltune registry restore                   # the newest good backup of ./mlflow.db back in its place
    frugaltune registry restore --store scheduling/mlflow.db scheduling/mlflow-backups/mlflow-<time>.db
    frugaltune registry backups                   # the backups, newest first, with their dates and version counts

The store (`sqlite:///…/mlflow.db`) is the only record of every registered version and of `@champion`; neither git
nor DVC versions it. Library code, called in a few places:

    with store.guarded_write(tracking.tracking_uri()):  # the register stages: lock, check, back up, write, back up
        ...
    store.check(uri)                                    # tracking.setup and `frugaltune predict`: StoreDamaged if not

Backups are made with sqlite's online backup API (a plain file copy of a database MLflow has open can be torn) into
`mlflow-backups/` beside the store, as `<store name>-<UTC time>.db`; the newest KEEP are kept, and one identical to
the newest is not kept twice. Only a `sqlite:///` tracking URI is guarded: a tracking server (`http://…`) keeps and
backs up its own database, and any other store (a `file:` directory, Databricks) is left alone: no check, no
backup, no lock. A server is only asked whether it answers (`check_server`, also run by `check`): once, with a
short timeout, so that a server that is down stops the command at once with one line instead of MLflow's minutes of
retries.
"""

from __future__ import annotations

import fcntl
import filecmp
import logging
import os
import sqlite3
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from contextlib import closing, contextmanager
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path

from frugaltune import faults

BACKUP_DIR = "mlflow-backups"
REPLACED_DIR = "replaced"  # inside BACKUP_DIR: stores that a restore moved aside (never deleted)
KEEP = 10  # a register run makes two (before and after its write): the last five runs can be undone
STAMP = "%Y%m%dT%H%M%S%fZ"
LOCK_TIMEOUT_ENV = "FRUGALTUNE_STORE_LOCK_TIMEOUT"
# A first register logs the base model into the store's artifacts (500 MB for the 135M model): minutes on a slow disk.
LOCK_TIMEOUT_S = 900.0
BUSY_TIMEOUT_S = 30.0  # sqlite's own wait for another connection's commit, when reading or backing up
SIDE_FILES = ("-journal", "-wal", "-shm")  # sqlite replays a leftover journal into whatever file has the db's name
SERVER_CHECK_TIMEOUT_S = 3.0  # a tracking server on the same machine or network answers /health in milliseconds
# MLflow's client retries a failed request 7 times with backoff factor 2 (about 4 minutes) before it gives up: a
# server that dies after the check would hang a stage or `frugaltune predict` that long. These defaults give up in
# seconds; a value the user set wins. The per-request timeout (MLFLOW_HTTP_REQUEST_TIMEOUT, 120 s) is left alone:
# uploading the base model's weights (hundreds of MB) to a server is a single request.
HTTP_RETRY_DEFAULTS = {"MLFLOW_HTTP_REQUEST_MAX_RETRIES": "2", "MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR": "1"}
# MLflow logs every SQLAlchemy OperationalError with its traceback (70 lines) before raising it as its own exception.
MLFLOW_DB_LOGGER = "mlflow.store.db.utils"


class StoreError(RuntimeError):
    """A problem with the local MLflow store; the message names the file and what to do."""


class StoreDamaged(StoreError):
    """The store fails sqlite's integrity check, or is gone while backups of it are left."""


class StoreBusy(StoreError):
    """Another process held the store's write lock for longer than the timeout."""


class StoreUnreachable(StoreError):
    """The tracking server the URI names does not answer."""


class StoreFull(StoreError):
    """The disk filled up while the store, its artifacts or its backup were written; the store itself is intact."""


@dataclass(frozen=True)
class Backup:
    path: Path
    taken: datetime  # UTC, from the file name
    versions: int | None  # registered model versions in it; None when it cannot be read

    def describe(self) -> str:
        count = ("unreadable" if self.versions is None else
                 f"{self.versions} registered version{'' if self.versions == 1 else 's'}")
        return f"{self.path} ({self.taken:%Y-%m-%d %H:%M:%S} UTC, {count})"


def sqlite_path(uri: str) -> Path | None:
    """The file of a `sqlite:///` tracking URI (`sqlite:///rel.db` relative to the cwd, `sqlite:////abs.db`), or
    None for any other URI: a server, a file store, an in-memory database."""
    if not uri.startswith("sqlite:///"):
        return None
    path = uri.removeprefix("sqlite:///").split("?", 1)[0]
    return Path(path) if path and path != ":memory:" else None


def backup_dir(db: Path) -> Path:
    return db.parent / BACKUP_DIR


def _read_only(path: Path) -> sqlite3.Connection:
    # Read-only, so that looking at a backup can never change it.
    return sqlite3.connect(f"{path.resolve().as_uri()}?mode=ro", uri=True, timeout=BUSY_TIMEOUT_S)


def integrity_problem(db: Path) -> str | None:
    """What sqlite's quick_check finds wrong with `db` (one line), or None when it passes or a writer keeps it
    locked (busy is not damaged). Opened read-write, so that a journal left by a killed writer is rolled back."""
    try:
        with closing(sqlite3.connect(db, timeout=BUSY_TIMEOUT_S)) as con:
            rows = [row[0] for row in con.execute("PRAGMA quick_check(5)")]
    except sqlite3.OperationalError as exc:
        if "locked" in str(exc):
            return None
        return str(exc)
    except sqlite3.DatabaseError as exc:  # "file is not a database", "database disk image is malformed"
        return str(exc)
    if rows == ["ok"]:
        return None
    found = [line for row in rows for line in str(row).splitlines() if line and not line.startswith("***")]
    more = f" and {len(found) - 1} more" if len(found) > 1 else ""
    return f"sqlite's quick_check: {found[0] if found else rows}{more}"


def version_count(db: Path) -> int | None:
    """Registered model versions in the store `db` (0 before MLflow made its tables); None when unreadable."""
    try:
        with closing(_read_only(db)) as con:
            tables = {row[0] for row in con.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}
            if "model_versions" not in tables:
                return 0
            return int(con.execute("SELECT count(*) FROM model_versions").fetchone()[0])
    except sqlite3.Error:
        return None


def registered_models(uri: str) -> list[str] | None:
    """Names of the registered models in the local sqlite store of `uri`; None for another store or no file."""
    db = sqlite_path(uri)
    if db is None or not db.is_file():
        return None
    try:
        with closing(_read_only(db)) as con:
            return [row[0] for row in con.execute("SELECT name FROM registered_models ORDER BY name")]
    except sqlite3.Error:
        return []


def backups(db: Path) -> list[Backup]:
    """The backups of `db`, newest first."""
    found = []
    for path in backup_dir(db).glob(f"{db.stem}-*.db"):
        try:
            taken = datetime.strptime(path.stem.removeprefix(f"{db.stem}-"), STAMP).replace(tzinfo=UTC)
        except ValueError:
            continue  # not one of ours
        found.append(Backup(path, taken, version_count(path)))
    return sorted(found, key=lambda b: b.taken, reverse=True)


def newest_good_backup(db: Path) -> Backup | None:
    return next((b for b in backups(db) if integrity_problem(b.path) is None), None)


def restore_command(db: Path) -> str:
    # Absolute: a stage runs in its own directory (scheduling/), the user types the command from anywhere.
    return f"frugaltune registry restore --store {db.resolve()}"


def _damage_message(db: Path, problem: str) -> str:
    good = newest_good_backup(db)
    if good is None:
        start_over = f"`mv {db} {db}.damaged`" if db.exists() else f"`mv {backup_dir(db)} {backup_dir(db)}.old`"
        return (f"{db}: the MLflow store {problem}, and {backup_dir(db)} holds no good backup. Start a new store "
                f"({start_over}) and register again (`dvc repro register`).")
    kept = (f"the current file is kept in {backup_dir(db) / REPLACED_DIR}" if db.exists() else
            f"to start a new, empty registry instead, move {backup_dir(db)} away")
    return (f"{db}: the MLflow store {problem}. Restore the newest good backup, {good.describe()}, with "
            f"`{restore_command(db)}` ({kept}).")


def check_server(uri: str, timeout: float = SERVER_CHECK_TIMEOUT_S) -> None:
    """For a tracking server (`http(s)://`): one GET of `<uri>/health`, no retries, `timeout` seconds; raise
    StoreUnreachable naming the URI, the error and the fix when nothing answers. Any HTTP answer (even 401 or 404
    from a proxy in front) means a server is there. Once it answered, MLflow's own retries are shortened for this
    process and its children (HTTP_RETRY_DEFAULTS). Nothing for any other URI."""
    if not uri.startswith(("http://", "https://")):
        return
    try:
        with urllib.request.urlopen(f"{uri.rstrip('/')}/health", timeout=timeout):
            pass
    except urllib.error.HTTPError:
        pass  # an answer: the server is up, whatever it thinks of /health
    except (urllib.error.URLError, OSError, ValueError) as exc:
        reason = getattr(exc, "reason", None) or exc
        if isinstance(reason, TimeoutError) or "timed out" in str(reason):
            reason = f"nothing within {timeout:g} s"
        raise StoreUnreachable(
            f"the MLflow tracking server {uri} (MLFLOW_TRACKING_URI) does not answer: {reason}. Start it "
            "(`make mlflow-server` serves http://127.0.0.1:5000), or `unset MLFLOW_TRACKING_URI` to use the "
            "project's mlflow.db.") from None
    for name, value in HTTP_RETRY_DEFAULTS.items():
        os.environ.setdefault(name, value)


def check(uri: str) -> None:
    """Raise StoreDamaged, with a one-line message naming the file, the problem, the newest good backup and the
    restore command, when the sqlite store of `uri` fails sqlite's quick_check or is missing while backups of it
    exist (a new, empty store would silently take its place). Nothing for a missing store without backups (a fresh
    project). A tracking server: StoreUnreachable when it does not answer (`check_server`). Nothing for any other
    store."""
    check_server(uri)
    db = sqlite_path(uri)
    if db is None:
        return
    if not db.exists():
        if backups(db):
            raise StoreDamaged(_damage_message(db, "is missing, but backups of it exist"))
        return
    problem = integrity_problem(db)
    if problem is not None:
        raise StoreDamaged(_damage_message(db, f"is damaged ({problem})"))


def _fsync_dir(folder: Path) -> None:
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _copy_database(source: sqlite3.Connection, target: Path) -> None:
    """`source` into a new file `target` through sqlite's backup API: consistent even while others write."""
    target.unlink(missing_ok=True)
    with closing(sqlite3.connect(target)) as copy:
        source.backup(copy)


def remove_partial_backups(db: Path) -> None:
    """Remove the half-written backups of `db` (`.<name>.partial`) and the journals sqlite keeps beside them."""
    for pattern in (".*.partial", *(f".*.partial{suffix}" for suffix in SIDE_FILES)):
        for partial in backup_dir(db).glob(pattern):
            partial.unlink(missing_ok=True)


def backup(db: Path, keep: int = KEEP) -> Path:
    """An online backup of `db` in backup_dir(db); the newest `keep` are kept. Returns the backup's path (the
    newest existing one when nothing changed since it was taken)."""
    folder = backup_dir(db)
    folder.mkdir(exist_ok=True)
    remove_partial_backups(db)  # left by a backup killed half-way
    target = folder / f"{db.stem}-{datetime.now(UTC):{STAMP}}.db"
    partial = folder / f".{target.name}.partial"
    try:
        with closing(sqlite3.connect(db, timeout=BUSY_TIMEOUT_S)) as source:
            _copy_database(source, partial)
    except BaseException:
        remove_partial_backups(db)  # a full disk: neither the half copy nor its journal stays behind
        raise
    previous = backups(db)
    if previous and filecmp.cmp(previous[0].path, partial, shallow=False):
        partial.unlink()
        return previous[0].path
    os.replace(partial, target)  # a backup is either whole or absent
    _fsync_dir(folder)
    for old in backups(db)[keep:]:
        old.path.unlink(missing_ok=True)
    return target


def _holder(lock: Path) -> str:
    try:
        text = lock.read_text(encoding="utf-8").strip()
    except OSError:
        text = ""
    return f"pid {text}" if text else "a process that did not say its pid"


@contextmanager
def write_lock(db: Path, timeout: float | None = None) -> Iterator[None]:
    """Hold the exclusive write lock of `db` (flock on `<db>.lock`), waiting up to `timeout` seconds (default:
    $FRUGALTUNE_STORE_LOCK_TIMEOUT, else LOCK_TIMEOUT_S), then StoreBusy naming the holder. The kernel releases the
    lock when its process dies, even by kill -9, so it is never stale."""
    if timeout is None:
        timeout = float(os.environ.get(LOCK_TIMEOUT_ENV, LOCK_TIMEOUT_S))
    lock = db.with_name(f"{db.name}.lock")
    with open(lock, "a+", encoding="utf-8") as handle:
        deadline, told = time.monotonic() + timeout, False
        while True:
            try:
                fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() >= deadline:
                    raise StoreBusy(
                        f"{db}: another process is writing the MLflow store ({_holder(lock)}) and held its lock "
                        f"{lock} for more than {timeout:.0f} s. Let it finish, then rerun; to wait longer, set "
                        f"{LOCK_TIMEOUT_ENV}=<seconds>. The lock goes away with its process, so it is never stale."
                    ) from None
                if not told:
                    print(f"{db}: another process is writing the MLflow store ({_holder(lock)}); waiting up to "
                          f"{timeout:.0f} s for it to finish", file=sys.stderr, flush=True)
                    told = True
                time.sleep(0.2)
        handle.truncate(0)
        handle.write(f"{os.getpid()} ({' '.join([Path(sys.argv[0]).name, *sys.argv[1:]])[:120]})")
        handle.flush()
        try:
            yield
        finally:
            handle.truncate(0)
            fcntl.flock(handle, fcntl.LOCK_UN)


@contextmanager
def guarded_write(uri: str, rerun: str = "dvc repro register") -> Iterator[None]:
    """Around a process's writes to the store of `uri`: take the write lock, refuse a damaged store (StoreDamaged),
    back it up, let the caller write, and back it up again, so that the newest backup holds the newest registry.
    A disk that fills up anywhere in there (sqlite's "database or disk is full", MLflow's wrapping of it, ENOSPC
    from an artifact) becomes StoreFull: one line saying what was being written, that the store is intact, and
    `rerun`; the half-written backup and its journal are removed. Does nothing for a store that is not a local
    sqlite file."""
    db = sqlite_path(uri)
    if db is None:
        yield
        return
    doing = f"taking the write lock of {db}"
    try:
        with write_lock(db):
            check(uri)
            doing = f"backing {db} up into {backup_dir(db)} before writing"
            if db.exists():
                backup(db)
            faults.inject("store", db.name)  # the fault suite kills or pauses a writer here, holding the lock
            doing = f"writing the MLflow store {db} and its artifacts"
            with _quiet_disk_full(logging.getLogger(MLFLOW_DB_LOGGER)):
                yield
            doing = f"backing {db} up into {backup_dir(db)} after writing (what was registered is in {db})"
            if db.exists():
                backup(db)
    except Exception as exc:
        if not faults.is_disk_full(exc):
            raise
        remove_partial_backups(db)
        if isinstance(exc, OSError) and exc.filename:  # an artifact or a report, not the database: say which
            doing += f" (at {exc.filename})"
        raise StoreFull(_full_message(db, doing, rerun)) from None


@contextmanager
def _quiet_disk_full(logger: logging.Logger) -> Iterator[None]:
    """Drop `logger`'s records of a full disk: guarded_write reports it in one line, and the traceback MLflow logs
    first would bury that line. Every other record passes."""

    def not_disk_full(record: logging.LogRecord) -> bool:
        return not (record.exc_info and record.exc_info[1] is not None and faults.is_disk_full(record.exc_info[1]))

    logger.addFilter(not_disk_full)
    try:
        yield
    finally:
        logger.removeFilter(not_disk_full)


def _full_message(db: Path, doing: str, rerun: str) -> str:
    problem = integrity_problem(db) if db.exists() else None
    if problem is not None:  # sqlite rolls an unfinished write back, so this is not expected; but never hide it
        return f"no space left on the device while {doing}. {_damage_message(db, f'is damaged ({problem})')}"
    return (f"no space left on the device while {doing}. The store is intact: {db} passes sqlite's integrity check "
            f"(a write the disk cut short is rolled back), and no half-written backup is left in {backup_dir(db)}. "
            f"Free some space (`df -h {db.parent}`; `dvc gc` removes cache entries no commit uses), then rerun "
            f"`{rerun}`: a version already registered is reused, never made twice.")


def restore(db: Path, chosen: Path | None = None, force: bool = False) -> tuple[Backup, Path | None]:
    """Put a backup in the place of `db`: `chosen`, else the newest good one. A store that passes its integrity
    check is replaced only with `force`. The current file (and any journal beside it) is moved to
    `<backups>/replaced/`, never deleted. Returns the backup used and where the old store went (None: there was
    none)."""
    with write_lock(db):
        if chosen is None:
            picked = newest_good_backup(db)
            if picked is None:
                raise StoreError(f"{backup_dir(db)}: no good backup of {db} to restore.")
        else:
            if not chosen.is_file():
                raise StoreError(f"{chosen}: no such backup. `frugaltune registry backups --store {db}` lists them.")
            picked = next((b for b in backups(db) if b.path.resolve() == chosen.resolve()),
                          Backup(chosen, datetime.fromtimestamp(chosen.stat().st_mtime, UTC),
                                 version_count(chosen)))
            problem = integrity_problem(picked.path)
            if problem is not None:
                raise StoreError(f"{chosen}: this backup is damaged too ({problem}); choose another "
                                 f"(`frugaltune registry backups --store {db}`).")
        if db.exists() and not force and integrity_problem(db) is None:
            raise StoreError(
                f"{db} passes its integrity check ({version_count(db)} registered versions): nothing to restore. "
                f"To replace it anyway with {picked.describe()}, add --force (it is kept in "
                f"{backup_dir(db) / REPLACED_DIR})."
            )
        moved = None
        stamp = f"{datetime.now(UTC):{STAMP}}"
        aside = backup_dir(db) / REPLACED_DIR
        for suffix in ("", *SIDE_FILES):
            current = db.with_name(db.name + suffix)
            if current.exists():
                aside.mkdir(parents=True, exist_ok=True)
                target = aside / f"{db.stem}-{stamp}{db.suffix}{suffix}"
                os.replace(current, target)
                moved = moved or target
        partial = db.with_name(f".{db.name}.restoring")
        with closing(_read_only(picked.path)) as source:
            _copy_database(source, partial)
        os.replace(partial, db)
        _fsync_dir(db.parent)
    return picked, moved
