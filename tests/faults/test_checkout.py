"""The checkout itself under faults: a dvc.lock cut inside a hash, params.yaml deleted, a read-only checkout, and a
clone in a path with spaces and non-ASCII letters. What DVC would do silently or fail on obscurely is named first,
by the params check `make pipeline` runs before `dvc repro` and by every stage (frugaltune.checkout, .faults).

Run with `make test` or `pytest -m slow tests/faults/test_checkout.py` (seconds: the params check and the stage
wrapper in-process, one stage and the check in a read-only mount, `make install` in a clone). Each test is a row of
docs/FAULTS.md (see table.py).
"""

from __future__ import annotations

import hashlib
import re
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

from frugaltune import cli, config
from frugaltune.faults import stage_errors
from tests.faults.helpers import ROOT, env, in_private_mounts
from tests.faults.table import fault

pytestmark = pytest.mark.slow


def checkout_files(into: Path) -> Path:
    """The files the params check and DVC read at the root: params.yaml, dvc.yaml, dvc.lock (as committed)."""
    into.mkdir(parents=True, exist_ok=True)
    for name in ("params.yaml", "dvc.yaml", "dvc.lock"):
        shutil.copy(ROOT / name, into / name)
    return into


def params_check(project: Path, monkeypatch: pytest.MonkeyPatch) -> str:
    """`python -m frugaltune.config` from the project root, as `make pipeline` runs it; its one line."""
    monkeypatch.chdir(project)
    with pytest.raises(SystemExit) as stop:
        config.main([])
    return str(stop.value.code)


@fault("disk", "dvc.lock cut inside a hash (DVC accepts it, and `dvc repro` would rerun the stage and all after it: "
       "a retrain)", "refused by name before any work: the params check (`make pipeline` runs it first) and every "
       "stage say the stage, the output, the bad value, and the fix (`git checkout -- dvc.lock`, or `dvc commit -f <stage>`)",
       "nothing run; nothing retrained")
def test_a_dvc_lock_cut_inside_a_hash_is_refused_by_name(tmp_path, monkeypatch):
    project = checkout_files(tmp_path / "project")
    lock = (project / "dvc.lock").read_text()
    found = re.search(r"- path: models/adapter\n\s+hash: md5\n\s+md5: ([0-9a-f]{32}\.dir)", lock)
    assert found, "dvc.lock records no models/adapter hash"
    cut = found.group(1)[:9]
    (project / "dvc.lock").write_text(lock[:found.start(1)] + cut + "\n")  # the file ends inside the hash

    message = params_check(project, monkeypatch)
    assert message.startswith("dvc.lock: stage `train`, out `models/adapter`: md5 "), message
    assert repr(cut) in message and "git checkout -- dvc.lock" in message and "dvc commit -f train" in message, message
    with pytest.raises(SystemExit) as stop, stage_errors("evaluate"):  # what every stage runs in, first thing
        pytest.fail("the stage ran on a damaged dvc.lock")
    assert str(stop.value.code) == f"evaluate: {message}"

    (project / "dvc.lock").write_text(lock.replace(found.group(1), found.group(1).upper()))  # the wrong alphabet
    assert "md5 '" + found.group(1).upper() + "'" in params_check(project, monkeypatch)


@fault("params", "params.yaml deleted", "the params check (from the project root) says the file is missing and "
       "`git checkout -- params.yaml`; `frugaltune predict` in the project says the same instead of loading the "
       "default model; outside a project the line naming the model says it is the default one", "nothing run")
def test_a_deleted_params_yaml_is_named_with_its_restore(tmp_path, monkeypatch, capsys):
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    project = checkout_files(tmp_path / "project")
    (project / "params.yaml").unlink()
    message = params_check(project, monkeypatch)
    assert message.startswith("params.yaml: missing") and "git checkout -- params.yaml" in message, message
    assert "Run from the project root" not in message

    assert cli.main(["predict", "what a day"]) == 1
    error = capsys.readouterr().err
    assert error.startswith("frugaltune predict: params.yaml: missing") and "git checkout" in error, error
    elsewhere = tmp_path / "elsewhere"  # not a project: the defaults, and the note shown with the model's name
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    register, note = cli._register_params(Path("params.yaml"), explicit=False)
    assert register.model_name == config.parse_params({}).register_.model_name
    assert note == " (the default model: no params.yaml here; --params or --model-uri name another)"


# $1: the checkout, bound read-only onto itself; $2: the python; $3: where the outputs go
READ_ONLY = r"""
mount --bind -o ro "$1" "$1" || exit 99
cd "$1"
"$2" -m frugaltune.config > "$3/check.log" 2>&1; echo $? > "$3/check.rc"
"$2" -m stages.probe > "$3/probe.log" 2>&1; echo $? > "$3/probe.rc"
"""


@fault("disk", "a read-only checkout", "the params check, which `make pipeline` runs before `dvc repro`, says the "
       "checkout is not writable (the path, the error) and the fix (make it writable, or clone it where you can "
       "write); a stage run by hand says the same for the file it could not write. A bare `dvc repro` stops in DVC "
       "itself, before any stage, with \"unexpected error - [Errno 30] Read-only file system: '.dvc/tmp/lock'\"",
       "nothing written; nothing to recover")
def test_a_read_only_checkout_is_named_with_the_fix(tmp_path):
    project = checkout_files(tmp_path / "project")
    logs = tmp_path / "logs"
    logs.mkdir()
    done = in_private_mounts(READ_ONLY, str(project), sys.executable, str(logs),
                             run_env=env(PYTHONPATH=str(ROOT)))
    assert done.returncode == 0, done.stdout + done.stderr
    for name, start in (("check", f"{project}: this checkout is not writable (Read-only file system)"),
                        ("probe", f"probe: {project}/reports")):
        output = (logs / f"{name}.log").read_text()
        assert (logs / f"{name}.rc").read_text().strip() == "1", output
        assert output.strip().splitlines()[-1].startswith(start) and "Traceback" not in output, output
        assert "Read-only file system" in output and "chmod -R u+w" in output and "git clone" in output, output
    assert not (project / "reports").exists()


def venv_here(venv: Path) -> None:
    """A venv at `venv` that sees this test's packages (as `make flower-env` does), stamped as `make install`
    stamps it: `make install` then has nothing to install, and runs its recipe's checks and the template step."""
    subprocess.run([getattr(sys, "_base_executable", sys.executable), "-m", "venv", "--without-pip", str(venv)],
                   check=True, capture_output=True)
    purelib = subprocess.run([str(venv / "bin" / "python"), "-c", "import sysconfig; "
                              "print(sysconfig.get_paths()['purelib'])"], check=True, capture_output=True,
                             text=True).stdout.strip()
    Path(purelib, "zz_frugaltune_venv.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    stamp = hashlib.sha256((venv.parent / "pyproject.toml").read_bytes()).hexdigest()
    (venv / ".frugaltune-installed").write_text(stamp + "\n")


@fault("process", "a clone in a path with spaces and non-ASCII letters (`my proj ü`)", "`make` works there: every "
       "path in the Makefile's recipes is quoted (before: venvs made at `../my`, `./proj`, `./ü/.venv`, then "
       "\"test: too many arguments\", Error 126)", "nothing made outside the clone")
def test_make_in_a_path_with_spaces_and_non_ascii_letters(tmp_path):
    parent = tmp_path / "parent"
    parent.mkdir()
    clone = parent / "my proj ü"
    subprocess.run(["git", "clone", "-q", str(ROOT), str(clone)], check=True, capture_output=True)
    shutil.copy(ROOT / "Makefile", clone / "Makefile")  # the Makefile under test, committed or not
    venv_here(clone / ".venv")
    make_env = {k: v for k, v in env().items() if k != "VIRTUAL_ENV"}  # ./.venv, under the spaced path
    done = subprocess.run(["make", "--no-print-directory", "install"], cwd=clone, env=make_env, capture_output=True,
                          text=True, timeout=300)
    output = done.stdout + done.stderr
    assert done.returncode == 0, output
    assert f"install: {clone}/.venv is up to date with pyproject.toml" in output, output
    assert (clone / ".dvc" / "plots_template.html").stat().st_size > 0  # written by the venv's python, in the clone
    stray = sorted(p.name for p in [*parent.iterdir(), *clone.iterdir()] if p.name in ("my", "proj", "ü"))
    assert not stray, f"made outside the venv's path: {stray}"
