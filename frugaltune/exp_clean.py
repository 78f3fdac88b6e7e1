"""`frugaltune exp-clean`: remove what a killed `dvc exp run --temp` (or `dvc repro`) left behind.

Run from the project root:

    frugaltune exp-clean

After `kill -9` of DVC (a closed terminal, the OOM killer) DVC 3 leaves its temp-dir experiment as it was: `dvc exp
show` lists it as Running forever, its copy of the workspace stays under `.dvc/tmp/exps/standalone/` (the models and
data: hundreds of MB), and DVC has no command for it: `dvc exp remove <name>` says it is not a valid experiment name
(it was never committed), `dvc exp clean` and `dvc queue remove/kill` handle only the Celery queue (`dvc exp run
--queue`). The MLflow run the training opened stays RUNNING. This command, for this project:

1. A temp experiment DVC's record (`.dvc/tmp/exps/standalone/run/<rev>/<rev>.run`) says is still running, in whose
   workspace no DVC process runs: any process still working in it (a stage that outlived DVC: on a system without
   `frugaltune.processes.die_with_parent`) gets SIGTERM, then SIGKILL after STOP_WAIT_S; the workspace is deleted
   and the record says failed, as DVC writes it for an experiment that failed. `dvc exp show` no longer lists it.
   While any DVC command runs in the project root (one may be setting up or collecting an experiment) it waits:
   nothing is touched, and it says so.
2. MLflow runs still RUNNING whose process is gone (`tracking.process_tags`: this host, that pid, started then):
   marked KILLED. A training run can still be continued: the next `dvc repro` reopens it from its checkpoint.
   Runs of other hosts, of live processes, or without those tags (logged before them) are left as they are.
"""

from __future__ import annotations

import shutil
import time
from dataclasses import dataclass
from pathlib import Path

import psutil

from frugaltune import processes, store, tracking

STANDALONE = Path(".dvc") / "tmp" / "exps" / "standalone"
STOP_WAIT_S = 30.0
KILLED_TAG = "frugaltune.cleaned"


@dataclass(frozen=True)
class Proc:
    process: psutil.Process
    cwd: Path
    cmdline: tuple[str, ...]

    @property
    def is_dvc(self) -> bool:
        """`dvc ...` or `python -m dvc ...`."""
        names = [Path(arg).name for arg in self.cmdline[:2]]
        return "dvc" in names or "dvc.exe" in names or any(
            a == "-m" and b == "dvc" for a, b in zip(self.cmdline, self.cmdline[1:], strict=False))

    def describe(self) -> str:
        return f"pid {self.process.pid} ({' '.join(self.cmdline)[:80]})"


def _processes() -> list[Proc]:
    found = []
    for process in psutil.process_iter(["cwd", "cmdline"]):
        cwd, cmdline = process.info.get("cwd"), process.info.get("cmdline")
        if cwd and cmdline:  # None: another user's process, or a kernel thread
            found.append(Proc(process, Path(cwd), tuple(cmdline)))
    return found


def _inside(path: Path, folder: Path) -> bool:
    return path == folder or folder in path.parents


def _size_mb(folder: Path) -> float:
    return sum(p.stat().st_size for p in folder.rglob("*") if p.is_file() and not p.is_symlink()) / 2**20


def clean_temp_experiments(root: Path) -> list[str]:
    """Step 1 of the module's docstring in the project at `root`; a line for each experiment found."""
    from dvc.repo.experiments.executor.base import ExecutorInfo, TaskStatus

    root = root.resolve()
    infofiles = sorted((root / STANDALONE / "run").glob("*/*.run"))
    records = [(path, ExecutorInfo.load_json(str(path))) for path in infofiles]
    records = [(path, info) for path, info in records
               if info.status <= TaskStatus.SUCCESS and Path(info.root_dir).is_dir()]
    if not records:
        return []
    procs = _processes()
    busy = [p for p in procs if p.is_dvc and p.cwd == root]
    lines = []
    for path, info in records:
        workspace = Path(info.root_dir)
        name = info.name or path.stem[:7]
        inside = [p for p in procs if _inside(p.cwd, workspace)]
        running = [p for p in inside if p.is_dvc]
        if running or busy:
            why = f"DVC runs it ({running[0].describe()})" if running else \
                f"a DVC command runs in the project ({busy[0].describe()}): run exp-clean again when it has finished"
            lines.append(f"exp-clean: experiment {name}: left as it is, {why}")
            continue
        if inside:
            lines.append(f"exp-clean: experiment {name}: stopping what still runs in its workspace: "
                         + ", ".join(p.describe() for p in inside))
            processes.end([p.process for p in inside], STOP_WAIT_S)
        size = _size_mb(workspace)
        shutil.rmtree(workspace)
        info.status = TaskStatus.FAILED
        info.dump_json(str(path))
        lines.append(f"exp-clean: experiment {name}: its DVC process is gone; removed its workspace {workspace} "
                     f"({size:.0f} MB), and `dvc exp show` no longer lists it as running")
    return lines


def mark_killed_runs(uri: str) -> list[str]:
    """Step 2 of the module's docstring in the tracking store `uri`; a line for each run marked."""
    from mlflow import MlflowClient
    from mlflow.entities import ViewType

    db = store.sqlite_path(uri)
    if db is not None and not db.is_file():
        return []  # no store yet: nothing ran (and opening it would create one)
    store.check(uri)
    client = MlflowClient(uri)
    experiments = [e.experiment_id for e in client.search_experiments(view_type=ViewType.ALL)]
    lines = []
    for start in range(0, len(experiments), 100):  # search_runs takes at most 100 experiments
        for run in client.search_runs(experiments[start:start + 100], "attributes.status = 'RUNNING'",
                                      run_view_type=ViewType.ALL, max_results=50000):
            tags = run.data.tags
            if not tracking.process_gone(tags):
                continue
            client.set_tag(run.info.run_id, KILLED_TAG, f"exp-clean: process {tags[tracking.PID_TAG]} on "
                           f"{tags[tracking.HOST_TAG]} was gone at {time.strftime('%Y-%m-%dT%H:%M:%S%z')}")
            client.set_terminated(run.info.run_id, "KILLED")
            lines.append(f"exp-clean: MLflow run {run.info.run_name} ({run.info.run_id}): its process "
                         f"{tags[tracking.PID_TAG]} is gone; marked KILLED (a training run continues from its "
                         "checkpoint at the next `dvc repro`)")
    return lines


def clean(root: Path) -> list[str]:
    """Both steps for the project at `root` and its tracking store; what was done, one line each."""
    lines = clean_temp_experiments(root) + mark_killed_runs(tracking.tracking_uri())
    return lines or ["exp-clean: nothing to clean: no experiment or MLflow run of a killed process"]
