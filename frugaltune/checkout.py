"""The checkout as DVC will use it: a damaged dvc.lock and a checkout DVC cannot write, named before they cost.

Library code. Two checks, each returning one line (the file, what is wrong, the fix) or None:

    lock_problem(Path("dvc.lock"))   # every stage, first thing (frugaltune.faults.stage_errors); the params check
    write_problem(Path("."))         # the params check, `python -m frugaltune.config`, which `make pipeline` runs
                                     # before `dvc repro`

DVC reads a dvc.lock whose md5 was cut short or edited without a word: the hash no longer matches the file, so
`dvc repro` reruns that stage and every stage after it (a retrain) as if something had changed. The stages check it
because they are what DVC runs whatever the command (`dvc repro`, `dvc repro train`, `dvc exp run`); the params check
sees it before DVC starts, and before `dvc repro --dry`'s plan if the user runs it first. A read-only checkout stops
DVC itself before any stage (it cannot take its lock in .dvc/tmp), so only a check that runs before DVC can name it.
"""

from __future__ import annotations

import re
import tempfile
from pathlib import Path

import yaml

# DVC's md5: 32 lowercase hex digits; a directory's ends in `.dir` (the hash of its listing).
MD5 = re.compile(r"[0-9a-f]{32}(\.dir)?")


def _restore(path: Path, stage: str | None = None) -> str:
    # `-f`: DVC refuses to commit a stage whose recorded hashes differ from the files without it.
    target = f" {stage}" if stage else ""
    return (f"Restore it with `git checkout -- {path}`; or, if the files on disk are the right ones, "
            f"`dvc commit -f{target}` records their hashes again.")


def lock_problem(path: Path = Path("dvc.lock")) -> str | None:
    """What is wrong with the md5 hashes of `path` (a dvc.lock), in one line, or None (also when there is none).
    Only `md5` entries are checked: other hash kinds (a cloud output's etag) are DVC's business."""
    if not path.is_file():
        return None
    try:
        data = yaml.load(path.read_text(encoding="utf-8"), Loader=getattr(yaml, "CSafeLoader", yaml.SafeLoader))
    except (yaml.YAMLError, UnicodeDecodeError) as exc:
        where = f" (line {exc.problem_mark.line + 1})" if getattr(exc, "problem_mark", None) else ""
        return f"{path}: not valid YAML{where}: the file was cut or edited. {_restore(path)}"
    stages = data.get("stages") if isinstance(data, dict) else None
    if not isinstance(stages, dict):
        return f"{path}: no `stages` mapping: the file was cut or edited. {_restore(path)}"
    for name, stage in stages.items():
        for kind in ("deps", "outs"):
            for entry in (stage.get(kind) or []) if isinstance(stage, dict) else []:
                if not isinstance(entry, dict) or ("md5" not in entry and entry.get("hash") != "md5"):
                    continue
                value = entry.get("md5")
                if isinstance(value, str) and MD5.fullmatch(value):
                    continue
                found = "no md5" if value is None else f"md5 {str(value)!r}"
                return (f"{path}: stage `{name}`, {kind[:-1]} `{entry.get('path')}`: {found} is not a DVC hash (32 "
                        f"hex digits; a directory's ends in `.dir`): dvc.lock was cut or edited, and DVC would rerun "
                        f"`{name}` and every stage after it without a word. {_restore(path, name)}")
    return None


def write_problem(directory: Path) -> str | None:
    """One line when no file can be created in `directory` (a read-only checkout), else None. Tried, not inferred
    from the mode bits: root writes through them, and a read-only mount refuses everyone."""
    try:
        with tempfile.TemporaryFile(dir=directory):
            pass
    except OSError as exc:
        shown = directory.resolve()
        return (f"{shown}: this checkout is not writable ({exc.strerror}): `dvc repro` writes .dvc/tmp, dvc.lock "
                f"and every stage's outputs here. Make it writable (`chmod -R u+w {shown}`, or mount it "
                f"read-write), or clone it where you can write (`git clone {shown} <dir>`) and run there.")
    return None
