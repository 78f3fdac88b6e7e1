"""Verify a model artifact against the hash DVC recorded when it was written, before it is used.

Library code, no entry point. The stages that load a model from `models/` call

    integrity.verify_outs(paths.BASE_MODEL, paths.ADAPTER_DIR)   # raises IntegrityError (a ValueError): one line

DVC names each file in its cache by the md5 of its bytes and trusts that name: a cache copy damaged on disk (its
mtime kept, as bit rot keeps it) is checked out as it is, and `dvc status` compares the workspace with dvc.lock
through the hashes it remembered for the files' mtimes, so it stays clean. Here the files of an out are hashed
afresh, as DVC 3 hashes them (plain md5 of the bytes; a directory's md5 is the md5 of its sorted JSON list of
{"md5", "relpath"}, plus ".dir", the list DVC keeps in its cache as `<md5>.dir`), and compared with the out's entry
in dvc.lock. A mismatch names the file, the two hashes, and the fix, which depends on whether DVC's cache copy is
itself damaged.

Nothing is said where there is nothing to compare with: no dvc.lock (a library user, a scratch project), no entry
for the path, an entry of DVC 2 (md5 of text files with CRLF turned to LF), or an out of the stage running now
(`DVC_STAGE`: its entry is the previous run's until DVC writes the new one after the stage). `dvc repro` writes a
stage's entry as soon as that stage finishes, before the stages after it start, so evaluate and register compare
with the files train just wrote.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import yaml

from frugaltune import paths

class IntegrityError(ValueError):
    """A model file is not what DVC recorded; the message names it, both hashes and the fix."""


def file_md5(path: Path) -> str:
    """md5 of the file's bytes: DVC 3's hash of any file, text or binary."""
    with path.open("rb") as fh:
        return hashlib.file_digest(fh, "md5").hexdigest()


def tree_entries(directory: Path) -> list[dict[str, str]]:
    """The directory's files as DVC lists them in its `.dir` manifest: {"md5", "relpath"} sorted by relpath."""
    files = sorted((p.relative_to(directory).as_posix(), p) for p in directory.rglob("*") if p.is_file())
    return [{"md5": file_md5(path), "relpath": name} for name, path in files]


def tree_md5(entries: list[dict[str, str]]) -> str:
    """DVC's hash of a directory from its manifest: md5 of the JSON list (keys sorted), then ".dir"."""
    return hashlib.md5(json.dumps(entries, sort_keys=True).encode("utf-8")).hexdigest() + ".dir"


def cache_dir() -> Path:
    """DVC's local cache: `cache.dir` of .dvc/config.local or .dvc/config (relative to .dvc/; a `dvc exp run
    --temp` workspace points it at its parent's cache), else .dvc/cache."""
    from configobj import ConfigObj, ConfigObjError

    dvc_dir = paths.project_root() / ".dvc"
    for name in ("config.local", "config"):
        try:
            configured = ConfigObj(str(dvc_dir / name)).get("cache", {}).get("dir")
        except (ConfigObjError, OSError):
            continue
        if configured:
            return dvc_dir / configured
    return dvc_dir / "cache"


def cache_object(md5: str) -> Path:
    return cache_dir() / "files" / "md5" / md5[:2] / md5[2:]


def _running() -> tuple[Path, str | None]:
    """The dvc.lock of the pipeline whose stage is running (DVC_STAGE: `stage`, or `dir/dvc.yaml:stage` from the
    project root; its out paths are relative to the stage's working directory, the cwd), and the stage's name;
    outside `dvc repro`, the cwd's dvc.lock and None. The root is the one above the cwd, not DVC_ROOT: `dvc exp run`
    points that at the parent repository while its stages run in a workspace of their own."""
    address = os.environ.get("DVC_STAGE")
    if not address:
        return Path("dvc.lock"), None
    pipeline, _, stage = address.rpartition(":")
    return (paths.project_root() / (pipeline or "dvc.yaml")).with_name("dvc.lock"), stage


def locked_out(path: Path) -> tuple[str, dict] | None:
    """(stage, dvc.lock entry) of the out at `path`, or None: no dvc.lock, no such out, or an out of the stage
    running now."""
    lock, running = _running()
    try:
        stages = (yaml.safe_load(lock.read_text(encoding="utf-8")) or {}).get("stages") or {}
    except (OSError, yaml.YAMLError, AttributeError):
        return None
    wanted = os.path.normpath(path)
    for stage, entry in stages.items() if isinstance(stages, dict) else ():
        for out in (entry or {}).get("outs") or []:
            if isinstance(out, dict) and os.path.normpath(str(out.get("path"))) == wanted:
                return (None if stage == running else (stage, out))
    return None


def _stage_command(stage: str) -> str:
    pipeline = paths.pipeline_file()
    return f"dvc repro -f {stage}" if pipeline == Path("dvc.yaml") else f"dvc repro -f {pipeline}:{stage}"


def _shown(path: Path) -> str:
    """The path from the project root, as DVC commands take it."""
    return Path(os.path.relpath(Path.cwd() / path, paths.project_root())).as_posix()


def _shown_cache(path: Path) -> str:
    """A cache file from the project root when it lies inside it, else its full path."""
    root = paths.project_root().resolve()
    return path.resolve().relative_to(root).as_posix() if path.resolve().is_relative_to(root) else str(path)


def _mismatch(file: Path, expected: str, found: str, out: Path, stage: str) -> IntegrityError:
    """The message for one file whose md5 is not the recorded one: the fix depends on DVC's cache copy."""
    what = (f"{_shown(file)}: md5 {found}, but dvc.lock records {expected} for it (out {_shown(out)} of stage "
            f"`{stage}`): refusing to use it.")
    cached = cache_object(expected)
    rebuild = f"`dvc pull {_shown(out)}` from a remote that has it, or rebuild it with `{_stage_command(stage)}`"
    if not cached.is_file():
        return IntegrityError(f"{what} DVC's cache has no copy of the recorded file: {rebuild}.")
    held, cached = file_md5(cached), _shown_cache(cached)
    if held != expected:
        return IntegrityError(
            f"{what} DVC's cache copy {cached} is damaged (its bytes hash to {held}) and `dvc checkout` restores it "
            f"as it is: delete it (`rm -f {cached}`), then {rebuild}.")
    return IntegrityError(
        f"{what} The file changed after DVC recorded it (DVC's cache copy is intact): `rm {_shown(file)} && dvc "
        f"checkout {_shown(out)}` puts the recorded one back; if you changed it on purpose, `dvc commit -f {stage}` "
        "records it (`-f`: DVC asks before it records hashes that changed).")


def verify_out(path: Path) -> None:
    """Raise IntegrityError when the files at `path` are not those dvc.lock records for it; say nothing when it
    records nothing for it (see the module docstring)."""
    found = locked_out(Path(path))
    if found is None:
        return
    stage, out = found
    expected = str(out.get("md5") or "")
    if out.get("hash") != "md5" or not expected:  # DVC 2's md5-dos2unix, or no hash: nothing to compare with here
        return
    path = Path(path)
    if not expected.endswith(".dir"):
        if not path.is_file():
            raise IntegrityError(f"{_shown(path)}: not found. `dvc checkout {_shown(path)}` restores it.")
        md5 = file_md5(path)
        if md5 != expected:
            raise _mismatch(path, expected, md5, path, stage)
        return
    if not path.is_dir():
        raise IntegrityError(f"{_shown(path)}: not found. `dvc checkout {_shown(path)}` restores it.")
    entries = tree_entries(path)
    tree = tree_md5(entries)
    if tree == expected:
        return
    found_files = {entry["relpath"]: entry["md5"] for entry in entries}
    manifest = cache_object(expected)
    try:
        recorded = json.loads(manifest.read_text(encoding="utf-8"))
        recorded_files = {str(entry["relpath"]): str(entry["md5"]) for entry in recorded}
        intact = tree_md5([{"md5": entry["md5"], "relpath": entry["relpath"]} for entry in recorded]) == expected
    except (OSError, ValueError, TypeError, KeyError):
        recorded_files, intact = {}, False
    if not intact:  # no list of the recorded files, or a damaged one: the directory as a whole
        shown = _shown_cache(manifest)
        damaged = f"DVC's list of them ({shown}) is damaged: delete it (`rm -f {shown}`), then " if (
            manifest.is_file()) else "DVC's cache holds no list of them to say which file differs: "
        raise IntegrityError(
            f"{_shown(path)}: its files hash to {tree}, but dvc.lock records {expected} (stage `{stage}`): refusing "
            f"to use them. {damaged}`dvc pull {_shown(path)}` from a remote that has it, or rebuild it with "
            f"`{_stage_command(stage)}`.")
    for name, md5 in sorted(recorded_files.items()):
        if name not in found_files:
            raise IntegrityError(f"{_shown(path / name)}: missing from {_shown(path)} (dvc.lock records it, stage "
                                 f"`{stage}`). `dvc checkout {_shown(path)}` restores it.")
        if found_files[name] != md5:
            raise _mismatch(path / name, md5, found_files[name], path, stage)
    extra = sorted(set(found_files) - set(recorded_files))
    raise IntegrityError(
        f"{_shown(path / extra[0]) if extra else _shown(path)}: not among the files dvc.lock records for "
        f"{_shown(path)} (stage `{stage}`): refusing to use the directory. Remove it, or `dvc commit -f {stage}` if it "
        "belongs there.")


def verify_outs(*outs: Path) -> None:
    """`verify_out` for each path, in order."""
    for out in outs:
        verify_out(out)
