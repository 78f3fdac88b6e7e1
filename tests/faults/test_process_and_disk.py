"""Process and disk faults on a real tiny project: a stage killed (-9, SIGTERM) with its output complete but not yet
renamed, dvc and the stage killed together, `dvc exp run --temp` killed while it trains, two `dvc repro` at once,
`register` killed after the model version exists, and a disk that fills up while writing a checkpoint, the adapter
or a report.

Run with `make test` or `pytest -m slow tests/faults` (a few minutes: one pipeline build, then one stage per test).
Faults are injected with FRUGALTUNE_FAULT (frugaltune/faults.py) at the worst moment: just before the atomic
rename, or in the middle of the checkpoint write. Each test is a row of docs/FAULTS.md (see table.py).
"""

from __future__ import annotations

import ast
import json
import os
import shutil
import signal
import sqlite3
import subprocess
import sys
import time
from contextlib import closing
from pathlib import Path

import psutil
import pytest
import yaml

from frugaltune import processes
from tests.faults.helpers import commit, dvc, env, make_project, status
from tests.faults.table import fault

pytestmark = pytest.mark.slow

# stage -> (the output renamed last, the FRUGALTUNE_FAULT file name of that rename)
LAST_WRITE = {
    "ingest": ("data/splits", "splits"),
    "validate": ("data/validated", "validated"),
    "tokenize": ("data/tokenized", "tokenized"),
    "plan": ("reports/plan.json", "plan.json"),
    "evaluate": ("reports/evaluate.json", "evaluate.json"),
}


@pytest.fixture(scope="module")
def built(tmp_path_factory, tiny_model_dir) -> Path:
    repo = make_project(tmp_path_factory.mktemp("faults") / "project", tiny_model_dir)
    dvc(["repro"], repo)
    commit(repo, "pipeline")
    return repo


@pytest.fixture
def project(built, tmp_path) -> Path:
    """A copy of the built project (git, DVC cache, checkpoints); MLflow is not used by the stages tested on it."""
    copy = tmp_path / "project"
    shutil.copytree(built, copy, symlinks=True)
    return copy


def locked_hashes(repo: Path) -> dict[str, str]:
    lock = yaml.safe_load((repo / "dvc.lock").read_text())
    return {out["path"]: out["md5"] for stage in lock["stages"].values() for out in stage.get("outs", [])}


def start_with_fault(repo: Path, args: list[str], fault_spec: str) -> tuple[subprocess.Popen, Path]:
    marker = repo.parent / f"marker-{time.monotonic_ns()}"
    proc = subprocess.Popen([sys.executable, "-m", "dvc", *args], cwd=repo, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True,
                            env=env(FRUGALTUNE_FAULT=fault_spec, FRUGALTUNE_FAULT_MARKER=str(marker)))
    deadline = time.monotonic() + 600
    while not marker.exists():
        assert proc.poll() is None, f"finished before the fault point:\n{proc.stdout.read()}"
        assert time.monotonic() < deadline, "the fault point was not reached in 600 s"
        time.sleep(0.2)
    return proc, marker


def kill_stage(repo: Path, stage: str, sig: int) -> str:
    """Run `stage` alone until its last rename, kill the stage's process with `sig`; return DVC's output."""
    proc, marker = start_with_fault(repo, ["repro", "--force", "--single-item", stage],
                                    f"commit:{LAST_WRITE[stage][1]}:hang")
    os.kill(int(marker.read_text()), sig)
    output, _ = proc.communicate(timeout=120)
    assert proc.returncode != 0, output
    return output


def assert_nothing_half_written(repo: Path, stage: str) -> None:
    """The stage's output is the last good one (its outs are `persist: true`, so DVC keeps them while the stage
    runs, and the new one was never renamed in): `dvc status` finds it as dvc.lock records it. validate removes
    its own outputs when it fails (stages/validate.py), so there the output is absent and the stage must rerun.
    No temp file beside it looks like an output."""
    out = repo / LAST_WRITE[stage][0]
    if stage == "validate":
        assert not out.exists(), f"{out} exists after the kill"
        assert stage in status(repo), status(repo)
    else:
        assert out.exists(), f"{out}: the last good output was removed by the kill"
        assert stage not in status(repo), status(repo)
    leftovers = [p.name for p in out.parent.iterdir() if p.name.startswith(f".{out.name}-")]
    # a temp name starts with "." and is never an output path DVC or a stage reads
    assert all(name.startswith(".") for name in leftovers)


@fault("process", "kill -9 in a stage just before its output is renamed (ingest, validate, tokenize, plan, "
       "evaluate; train: see checkpoints)", "DVC reports the stage failed; the last good output is in place (validate removes its own: "
       "`dvc status` shows it must run again)",
       "recovered, nothing lost: no half-written output, the last good one in place (validate: absent); "
       "`dvc repro` of the stage gives byte-identical outputs")
@pytest.mark.parametrize("stage", list(LAST_WRITE))
def test_kill9_in_each_stage_before_the_rename(project, stage):
    before = locked_hashes(project)
    kill_stage(project, stage, signal.SIGKILL)
    assert_nothing_half_written(project, stage)
    dvc(["repro", "--force", "--single-item", stage], project)
    assert stage not in status(project)
    after = locked_hashes(project)
    assert after[LAST_WRITE[stage][0]] == before[LAST_WRITE[stage][0]]  # the same bytes as the uninterrupted run


@fault("process", "SIGTERM in a stage just before its output is renamed (validate, evaluate)",
       "the stage exits at once; DVC reports it failed", "recovered, nothing lost: as for kill -9")
@pytest.mark.parametrize("stage", ["validate", "evaluate"])
def test_sigterm_in_a_stage_before_the_rename(project, stage):
    kill_stage(project, stage, signal.SIGTERM)
    assert_nothing_half_written(project, stage)
    dvc(["repro", "--force", "--single-item", stage], project)
    assert stage not in status(project)


@fault("process", "dvc and the stage killed -9 together (a closed terminal, a crashed session)",
       "both die; no lock is left behind", "recovered: the next `dvc repro` runs the stage and the rest as usual")
def test_dvc_and_the_stage_killed_together(project):
    proc, _ = start_with_fault(project, ["repro", "--force", "--single-item", "tokenize"],
                               "commit:tokenized:hang")
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait(timeout=60)
    assert_nothing_half_written(project, "tokenize")
    dvc(["repro"], project)
    assert status(project) == {}


@fault("process", "`kill -9` of `dvc exp run --temp` while it trains (a closed terminal, the OOM killer)",
       "the training stops with DVC (the kernel's SIGTERM: a checkpoint, then exit), no process is left; DVC alone "
       "would list the experiment as Running forever: `frugaltune exp-clean` removes it",
       "the experiment's temp workspace removed, `dvc exp show` lists nothing running, its MLflow run KILLED, not "
       "RUNNING")
def test_kill9_of_dvc_exp_run_leaves_no_orphan_and_exp_clean_removes_it(project):
    # train.lr: a param train reads and the plan does not (no recalibration); 10 s a step: 4 steps of 6 (40 s) left
    # to run after the first checkpoint, longer than the stage may take to stop (the delay ends at the signal)
    # The output goes to a file: a pipe would stay open while the stage (which inherits it) runs
    log = project.parent / "exp-run.log"
    with log.open("w") as out:
        proc = subprocess.Popen([sys.executable, "-m", "dvc", "exp", "run", "--temp", "-n", "killed", "-S",
                                 "train.lr=0.000321"], cwd=project, stdout=out, stderr=subprocess.STDOUT,
                                start_new_session=True, env=env(FRUGALTUNE_TEST_STEP_DELAY_S="10"))
    workspaces = project / ".dvc" / "tmp" / "exps" / "standalone"
    deadline = time.monotonic() + 600
    while not list(workspaces.glob("tmp*/checkpoints/train/*/step-2")):
        assert proc.poll() is None, f"the experiment ended before its first checkpoint:\n{log.read_text()}"
        assert time.monotonic() < deadline, "no checkpoint within 10 minutes"
        time.sleep(0.1)
    tree = psutil.Process(proc.pid).children(recursive=True)
    stage = next(p for p in tree if p.cmdline()[1:3] == ["-m", "stages.train"])
    family = "\n".join(f"{p.pid} (parent {p.ppid()}): {' '.join(p.cmdline())}" for p in tree)
    os.kill(proc.pid, signal.SIGKILL)  # DVC alone, as `kill -9 <pid>` does; the stage is its child
    proc.wait(timeout=60)
    # the step under way, a checkpoint, exit; then it is a zombie until its new parent reaps it, which a container's
    # init may never do: psutil's wait() would wait for the reaping
    stopped_by = time.monotonic() + 30
    while processes.alive(stage.pid, stage.create_time()):
        if time.monotonic() > stopped_by:
            os.killpg(proc.pid, signal.SIGKILL)
            pytest.fail(f"the training outlived `kill -9` of its `dvc exp run` by 30 s; the processes under DVC "
                        f"were:\n{family}\nits output:\n{log.read_text()[-3000:]}")
        time.sleep(0.2)
    assert list(workspaces.glob("tmp*")), "DVC removed the temp workspace itself"  # DVC: Running, until cleaned

    out = subprocess.run([sys.executable, "-m", "frugaltune.cli", "exp-clean"], cwd=project, env=env(),
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0 and "experiment killed" in out.stdout and "Traceback" not in out.stderr, out
    assert not list(workspaces.glob("tmp*")), out.stdout
    assert "Running" not in dvc(["exp", "show", "--csv"], project).stdout
    with closing(sqlite3.connect(project / "mlflow.db")) as db:
        statuses = db.execute("SELECT status FROM runs JOIN params USING (run_uuid) WHERE key = 'train.lr' AND "
                              "value = '0.000321'").fetchall()
    assert statuses == [("KILLED",)], statuses


@fault("process", "a second `dvc repro` while one runs in the same repo", "the second stops at once with DVC's "
       "lock error", "the first finishes unharmed; nothing is run twice")
def test_concurrent_repro_in_the_same_repo(project):
    first, marker = start_with_fault(project, ["repro", "--force", "--single-item", "validate"],
                                     "commit:validated:hang")
    second = dvc(["repro"], project, check=False)
    assert second.returncode != 0 and "lock" in (second.stdout + second.stderr).lower(), second.stdout + second.stderr
    os.killpg(first.pid, signal.SIGKILL)  # the first one hangs at its fault point: end it, then recover
    first.wait(timeout=60)
    dvc(["repro"], project)
    assert status(project) == {}


def checkpoints(repo: Path) -> list[Path]:
    return sorted(p for p in (repo / "checkpoints").rglob("step-*") if p.is_dir() and not p.name.startswith("."))


@fault("disk", "the disk fills up while a training checkpoint is written", "clear error: no space left writing the "
       "checkpoint, what was kept, and the fix", "recovered, nothing lost: the previous checkpoint is intact (its "
       "manifest verifies); the rerun resumes from it")
def test_disk_full_during_a_checkpoint(project):
    shutil.rmtree(project / "checkpoints", ignore_errors=True)
    proc = dvc(["repro", "--force", "--single-item", "train"], project, check=False,
               FRUGALTUNE_FAULT="checkpoint:step-4:enospc")
    output = proc.stdout + proc.stderr
    assert proc.returncode != 0 and "no space left on the device" in output and "Traceback" not in output, output
    assert [p.name for p in checkpoints(project)] == ["step-2"]  # step 4's write failed; step 2 is whole
    assert not [p for p in (project / "checkpoints").rglob(".step-*")], "a temp checkpoint dir was left behind"
    assert (project / "models/adapter").exists()  # the last good adapter (its outs are persist: true)
    dvc(["repro", "--force", "--single-item", "train"], project)
    assert json.loads((project / "reports/train.json").read_text())["resumed_from_step"] == 2


@fault("disk", "the disk fills up while the adapter is written", "clear error: no space left writing `adapter`, "
       "and the fix", "no half-written adapter, the last good one in place; the rerun trains (from the last checkpoint when "
       "one is left)")
def test_disk_full_writing_the_adapter(project):
    proc = dvc(["repro", "--force", "--single-item", "train"], project, check=False,
               FRUGALTUNE_FAULT="commit:adapter:enospc")
    output = proc.stdout + proc.stderr
    assert proc.returncode != 0 and "no space left on the device while writing adapter" in output, output
    assert "Traceback" not in output
    assert not list((project / "models").glob(".adapter-*"))
    # The last good adapter in place, as dvc.lock records it. Outputs are persisted (not deleted before the stage),
    # and the live telemetry CSV holds the failed attempt's steps: that one may differ, the adapter may not.
    changed = [entry.get("changed outs", {}) for entry in status(project).get("train", [])]
    assert not any("models/adapter" in outs for outs in changed), changed
    dvc(["repro", "--force", "--single-item", "train"], project)
    assert (project / "models/adapter/adapter_model.safetensors").is_file()


@fault("disk", "the disk fills up while a report is written", "clear error: no space left writing "
       "`evaluate.json`, and the fix", "no half-written report, the last good one in place; `dvc repro` reruns the stage")
def test_disk_full_writing_a_report(project):
    proc = dvc(["repro", "--force", "--single-item", "evaluate"], project, check=False,
               FRUGALTUNE_FAULT="write:evaluate.json:enospc")
    output = proc.stdout + proc.stderr
    assert proc.returncode != 0 and "while writing evaluate.json" in output and "Traceback" not in output, output
    assert not list((project / "reports").glob(".evaluate.json-*"))
    assert "evaluate" not in status(project)  # the last good report in place, as dvc.lock records it
    dvc(["repro", "--force", "--single-item", "evaluate"], project)
    assert "evaluate" not in status(project)


@fault("disk", "one bit flipped in the DVC cache copy of the adapter (its mtime kept, as bit rot keeps it), the "
       "damaged copy put back by `dvc checkout`, which trusts the cache's names (`dvc status` stays clean)",
       "evaluate (and train, register) stop with one line: the file, the md5 dvc.lock records, the md5 found, that "
       "DVC's cache copy is damaged, and the fix: delete that cache file, then `dvc pull` it or `dvc repro -f train`",
       "nothing measured on the damaged file: reports/evaluate.json, and so the registered version's metric, stay "
       "as they were")
def test_a_damaged_dvc_cache_copy_of_the_adapter_is_refused(project):
    from tests.unit.test_integrity import flip_keeping_mtime

    adapter = project / "models/adapter"
    tensors = max((p for p in adapter.iterdir() if p.suffix == ".safetensors"), key=lambda p: p.stat().st_size)
    lock = yaml.safe_load((project / "dvc.lock").read_text())
    manifest = next(out["md5"] for out in lock["stages"]["train"]["outs"] if out["path"] == "models/adapter")
    cache = project / ".dvc/cache/files/md5"
    entries = json.loads((cache / manifest[:2] / manifest[2:]).read_text())
    good = next(entry["md5"] for entry in entries if entry["relpath"] == tensors.name)
    flip_keeping_mtime(cache / good[:2] / good[2:], tensors.stat().st_size // 2)
    tensors.unlink()
    dvc(["checkout", "models/adapter"], project)
    assert "train" not in status(project)  # DVC sees nothing wrong
    before = (project / "reports/evaluate.json").read_text()

    failed = dvc(["repro", "--force", "--single-item", "evaluate"], project, check=False)
    assert failed.returncode != 0 and "Traceback" not in failed.stderr, failed.stderr
    [line] = [line for line in failed.stderr.splitlines() if line.startswith("evaluate: ")]
    assert f"models/adapter/{tensors.name}: md5 " in line and f"dvc.lock records {good}" in line, line
    assert "DVC's cache copy .dvc/cache/files/md5/" in line and "`dvc repro -f train`" in line, line
    assert (project / "reports/evaluate.json").read_text() == before


# Last in the module: it works on the built project itself (its MLflow store holds absolute artifact paths).
@fault("process", "kill -9 in `register` after the model version exists, before its report",
       "DVC reports the stage failed", "recovered, nothing lost: the rerun finds the version of that run and "
       "registers no second one; `@champion` unchanged")
def test_kill9_in_register_after_the_version_exists(built):
    def versions() -> list[str]:
        code = ("import mlflow; c = mlflow.MlflowClient(); print(sorted(v.version for v in "
                "c.search_model_versions(\"name = 'frugaltune-sentiment'\")))")
        return subprocess.run([sys.executable, "-c", code], cwd=built, env=env(), capture_output=True, text=True,
                              check=True).stdout.strip()

    before = versions()
    proc, marker = start_with_fault(built, ["repro", "--force", "--single-item", "register"],
                                    "commit:register.json:hang")
    os.kill(int(marker.read_text()), signal.SIGKILL)
    proc.communicate(timeout=120)
    dvc(["repro", "--force", "--single-item", "register"], built)
    assert versions() == before, (before, versions())
    report = json.loads((built / "reports/register.json").read_text())
    assert report["version"] == int(ast.literal_eval(before)[-1])


@fault("process", "`frugaltune plan --model <config>` (no weights: random ones written for the calibration) gets "
       "SIGTERM while it calibrates",
       "it exits at once with one line: stopped by SIGTERM, nothing written",
       "nothing left behind: the temporary directory of the shape's random weights (gigabytes at 1-3 B) is removed "
       "and the calibration's worker process ends with it")
def test_a_terminated_plan_by_shape_leaves_no_random_weights_behind(tmp_path, tiny_model_dir):
    from tests import tiny_project
    from tests.faults.helpers import ROOT
    from tests.unit.test_shapes import LABELS, TINY_QWEN2

    project, tmp = tmp_path / "project", tmp_path / "tmp"
    project.mkdir()
    tmp.mkdir()
    tiny_project.plan_inputs(project, tiny_model_dir, LABELS, "train: {batch_size: 8, method: lora, threads: 1}\n"
                             "probe: {calibration_steps: 2, nvml: false}\n")
    (project / "qwen.json").write_text(json.dumps(TINY_QWEN2))
    proc = subprocess.Popen([sys.executable, "-m", "frugaltune.cli", "plan", "--model", "qwen.json", "--calibrate"],
                            cwd=project, env=env(TMPDIR=str(tmp), PYTHONPATH=str(ROOT)), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 300
    # the random weights are written when the calibration starts: then stop it, as `kill` (or a scheduler) does
    while not list(tmp.glob("frugaltune-model-*/random-weights/config.json")) and proc.poll() is None:
        assert time.monotonic() < deadline, "no random weights written in 300 s"
        time.sleep(0.05)
    assert proc.poll() is None, proc.communicate()
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 1 and "frugaltune plan: stopped by SIGTERM; nothing was written." in err, err
    assert "Traceback" not in err, err
    assert not list(tmp.iterdir())  # the weights' temporary directory is gone
    time.sleep(1)  # the worker's own exit (killed, or its parent-death SIGTERM) is a moment behind
    workers = [p for p in psutil.process_iter(["cmdline", "cwd"])
               if "--calibration-worker" in (p.info["cmdline"] or []) and p.info["cwd"] == str(project)]
    assert not workers, workers
