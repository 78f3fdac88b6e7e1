"""frugaltune.integrity against a real DVC repository: the hashes it computes are the ones `dvc repro` wrote to
dvc.lock, and a cache copy damaged with its mtime kept (which DVC trusts, and `dvc checkout` restores as it is) is
refused in one line naming the file, both hashes and the fix.

A tiny stage in a `dvc init --no-scm` repository in a temp dir (a few seconds); run with
`pytest tests/unit/test_integrity.py`.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from frugaltune import integrity

# A stand-in for train: a directory out with a binary and a CRLF text file (DVC 3 hashes both as bytes), and a
# single-file out.
WRITE = ("import os, pathlib; d = pathlib.Path('models/adapter'); d.mkdir(parents=True, exist_ok=True); "
         "(d / 'adapter_model.safetensors').write_bytes(bytes(range(256)) * 8); "
         "(d / 'labels.json').write_bytes(b'{\"labels\": [\"a\", \"b\"]}\\r\\n'); "
         "pathlib.Path('models/head.bin').write_bytes(b'head' * 100)")
DVC_YAML = {"stages": {"train": {"cmd": f'"{sys.executable}" -c "{WRITE}"',
                                 "outs": ["models/adapter", "models/head.bin"]}}}
ADAPTER, FILE = Path("models/adapter"), Path("models/adapter/adapter_model.safetensors")


def dvc(repo: Path, *args: str) -> str:
    env = {**os.environ, "DVC_NO_ANALYTICS": "1"}
    env.pop("DVC_STAGE", None)
    done = subprocess.run([sys.executable, "-m", "dvc", *args], cwd=repo, env=env, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout


@pytest.fixture(scope="module")
def repo(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("dvc-integrity")
    dvc(root, "init", "--no-scm", "-q")
    (root / "dvc.yaml").write_text(yaml.safe_dump(DVC_YAML))
    dvc(root, "repro", "-q")
    return root


@pytest.fixture
def in_repo(repo: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.chdir(repo)
    monkeypatch.delenv("DVC_STAGE", raising=False)
    return repo


def locked(repo: Path, path: str) -> str:
    outs = yaml.safe_load((repo / "dvc.lock").read_text())["stages"]["train"]["outs"]
    return next(out["md5"] for out in outs if out["path"] == path)


def flip_keeping_mtime(path: Path, offset: int) -> None:
    """One bit flipped in place, the file's mtime (and mode) as before: bit rot, as DVC's state cannot see it."""
    stat = path.stat()
    path.chmod(0o644)
    with path.open("r+b") as fh:
        fh.seek(offset)
        byte = fh.read(1)[0]
        fh.seek(offset)
        fh.write(bytes([byte ^ 1]))
    path.chmod(stat.st_mode)
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns))


def test_the_hashes_are_those_dvc_wrote(in_repo: Path) -> None:
    assert integrity.tree_md5(integrity.tree_entries(ADAPTER)) == locked(in_repo, "models/adapter")
    assert integrity.file_md5(Path("models/head.bin")) == locked(in_repo, "models/head.bin")
    integrity.verify_outs(Path("models/head.bin"), ADAPTER)  # as recorded: nothing said


def test_a_damaged_cache_copy_restored_by_dvc_checkout_is_refused(in_repo: Path) -> None:
    good = integrity.file_md5(FILE)
    cached = integrity.cache_object(good)
    flip_keeping_mtime(cached, 100)
    FILE.unlink()
    dvc(in_repo, "checkout", "-q")  # DVC trusts its cache's names: the damaged copy comes back
    bad = integrity.file_md5(FILE)
    assert bad != good

    with pytest.raises(integrity.IntegrityError) as refused:
        integrity.verify_outs(Path("models/base"), ADAPTER)  # an out dvc.lock does not know: nothing said
    message = str(refused.value)
    assert "\n" not in message
    assert message.startswith(f"{FILE}: md5 {bad}, but dvc.lock records {good}")
    shown = cached.relative_to(in_repo).as_posix()
    assert f"DVC's cache copy {shown} is damaged" in message
    assert f"`rm -f {shown}`" in message and "`dvc repro -f train`" in message

    # While train itself runs (under `dvc repro`), its entry is the previous run's: nothing to compare with.
    os.environ["DVC_STAGE"] = "train"
    try:
        integrity.verify_out(ADAPTER)
    finally:
        del os.environ["DVC_STAGE"]

    # The printed fix: the damaged copy deleted, the stage rerun; the files are verified again.
    cached.unlink()
    dvc(in_repo, "repro", "-q", "-f", "train")
    integrity.verify_out(ADAPTER)


def test_a_workspace_file_changed_after_dvc_recorded_it(in_repo: Path) -> None:
    head = Path("models/head.bin")
    original = head.read_bytes()
    head.write_bytes(b"edited")
    try:
        with pytest.raises(integrity.IntegrityError, match=r"changed after DVC recorded it .*`dvc commit -f train`"):
            integrity.verify_out(head)
    finally:
        head.write_bytes(original)


def test_without_a_dvc_lock_nothing_is_said(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    (tmp_path / "models" / "adapter").mkdir(parents=True)
    (tmp_path / "models" / "adapter" / "x").write_text("anything")
    integrity.verify_out(ADAPTER)
