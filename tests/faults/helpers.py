"""Shared by the fault tests: params for a temp project, good and bad data files, a built tiny project."""

from __future__ import annotations

import copy
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from tests import tiny_project

ROOT = Path(__file__).resolve().parents[2]
LABELS = ["negative", "neutral", "positive"]


def base_params() -> dict:
    return yaml.safe_load((ROOT / "params.yaml").read_text())


def params_for(source: Path | str, **data) -> dict:
    raw = copy.deepcopy(base_params())
    raw["data"].update({"source": str(source), "max_rows": None, "text_column": "text", "label_column": "label",
                        "confidence_column": None, "labels": None, "encoding": "utf-8"})
    raw["data"].update(data)
    return raw


def rows(n: int = 90) -> list[tuple[str, str]]:
    return [(f"tweet number {i} about the weather and things", LABELS[i % 3]) for i in range(n)]


def csv_text(pairs: list[tuple[str, str]]) -> str:
    return "text,label\n" + "".join(f"{t},{l}\n" for t, l in pairs)


def env(**extra: str) -> dict[str, str]:
    out = {k: v for k, v in os.environ.items() if k not in ("MLFLOW_TRACKING_URI", "FRUGALTUNE_FAULT")}
    return {**out, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}", "HF_HUB_OFFLINE": "1",
            "TQDM_DISABLE": "1", "DVC_NO_ANALYTICS": "1", **extra}


def dvc(args: list[str], cwd: Path, check: bool = True, **extra: str) -> subprocess.CompletedProcess:
    proc = subprocess.run([sys.executable, "-m", "dvc", *args], cwd=cwd, env=env(**extra), capture_output=True,
                          text=True, timeout=900)
    if check:
        assert proc.returncode == 0, f"dvc {' '.join(args)} failed ({proc.returncode}):\n{proc.stdout}{proc.stderr}"
    return proc


def status(cwd: Path) -> dict:
    """`dvc status` of the pipeline, without the probe's permanent "always changed"."""
    out = dvc(["status", "--json", "dvc.yaml"], cwd).stdout
    got = json.loads(out.strip().splitlines()[-1])
    got.pop("probe", None)
    return got


def make_project(repo: Path, model_dir: Path, **train) -> Path:
    """The end-to-end tests' tiny project (tests/tiny_project.py, committed), with checkpoints every 2 of 6 steps
    for the faults in training unless `train` says otherwise, and the plan's analytic estimates (the planner's own
    tests calibrate; here only the faults matter)."""
    return tiny_project.build(repo, model_dir, calibrate=False, **{"max_steps": 6, "checkpoint_every": 2, **train})


def commit(repo: Path, message: str) -> None:
    subprocess.run(["git", "add", "-A"], cwd=repo, check=True, capture_output=True)
    subprocess.run(["git", "commit", "-qm", message, "--allow-empty"], cwd=repo, check=True, capture_output=True)


UNSHARE = ["unshare", "--user", "--map-root-user", "--mount"]


def in_private_mounts(script: str, *args: str, cwd: Path | None = None, run_env: dict[str, str] | None = None,
                      timeout: float = 300) -> subprocess.CompletedProcess:
    """Run the bash `script` (`args` as $1, $2...) in a user and mount namespace of its own (`unshare -rm`), where it
    may mount a small tmpfs (a disk that fills up) or a read-only bind mount (a read-only checkout): real file
    systems, seen only by the script and its children and gone with them, even if the test dies. Skips the test
    where the kernel allows no such namespace (unprivileged user namespaces turned off)."""
    try:
        probe = subprocess.run([*UNSHARE, "true"], capture_output=True, text=True, timeout=60)
    except FileNotFoundError:
        pytest.skip("needs util-linux's `unshare` for a private tmpfs or read-only mount")
    if probe.returncode != 0:
        pytest.skip(f"needs a user and mount namespace for a private mount (`unshare -rm`): {probe.stderr.strip()}")
    return subprocess.run([*UNSHARE, "bash", "-c", script, "bash", *args], cwd=cwd, env=run_env or env(),
                          capture_output=True, text=True, timeout=timeout)
