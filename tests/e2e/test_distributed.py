"""Data-parallel training under torchrun (gloo, 2 processes) through `dvc repro`, on a tiny model.

Run with `make test` (or `pytest -m slow tests/e2e/test_distributed.py`). The two-process run must be the
one-process run: the same loss at every step (within 1e-4), the same effective batch; a two-process run killed with
kill -9 resumes from its checkpoint to the same final loss.
"""

from __future__ import annotations

import csv
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
import yaml

from tests.faults.helpers import dvc, env, make_project

pytestmark = pytest.mark.slow
STEPS = 8


def losses(repo: Path) -> dict[int, float]:
    with open(repo / "reports/plots/train_loss.csv") as fh:
        return {int(row["step"]): float(row["loss"]) for row in csv.DictReader(fh)}


def set_params(repo: Path, **distributed) -> None:
    params = yaml.safe_load((repo / "params.yaml").read_text())
    params["train"]["distributed"].update(distributed)
    (repo / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))


@pytest.fixture(scope="module")
def project(tmp_path_factory, tiny_model_dir) -> Path:
    # dropout 0: with dropout each rank draws its own masks, so only the expectation would match.
    # fp32: the gradient sum over ranks equals the one-process gradient up to fp32 rounding (the 1e-4 below); where
    # the plan measures bf16 faster (a Zen 4: 2.4x) it would train in bf16, whose rounding alone moves the loss by
    # ~1e-2 when the batch is split differently.
    repo = make_project(tmp_path_factory.mktemp("ddp"), tiny_model_dir, max_steps=STEPS, checkpoint_every=2,
                        precision="fp32", lora={"r": 8, "alpha": 16, "dropout": 0.0,
                              "target_modules": ["q_proj", "k_proj", "v_proj", "o_proj"]})
    return repo  # committed by the build


def test_two_ranks_take_the_same_steps_as_one_process(project: Path):
    dvc(["repro", "train"], project)
    one = losses(project)
    single = json.loads((project / "reports/train.json").read_text())
    assert single["ranks"] == 1 and len(one) == STEPS

    set_params(project, nproc_per_node=2)
    out = dvc(["repro", "train"], project)
    text = out.stdout + out.stderr
    assert "2 ranks (data parallel" in text, text[-3000:]
    two = losses(project)
    report = json.loads((project / "reports/train.json").read_text())
    assert report["ranks"] == 2 and report["threads"] == 1
    assert report["peak_rss_all_ranks_mb"] > report["peak_rss_mb"]
    assert report["sequences"] == single["sequences"] and report["tokens"] == single["tokens"]  # same batches
    assert sorted(two) == sorted(one)
    for step in one:
        assert abs(one[step] - two[step]) < 1e-4, (step, one, two)
    assert "changed" not in dvc(["status", "train"], project).stdout


def rank_processes(launcher: psutil.Process) -> list[psutil.Process]:
    """The training ranks under `dvc repro`: the processes torchrun gave a LOCAL_RANK. Not by command line: the
    shell DVC runs the stage in (kept by some /bin/sh, exec'ed away by others) and the stage process that
    launches torchrun read `stages.train` too."""
    ranks = []
    for proc in launcher.children(recursive=True):
        try:
            if "LOCAL_RANK" in proc.environ():
                ranks.append(proc)
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
    return ranks


def test_a_two_rank_run_killed_with_sigkill_resumes_to_the_same_final_loss(project: Path):
    report = json.loads((project / "reports/train.json").read_text())
    if report.get("ranks") != 2:  # run alone: the uninterrupted two-rank run the test above leaves behind
        set_params(project, nproc_per_node=2)
        dvc(["repro", "-f", "-s", "train"], project)
    uninterrupted = json.loads((project / "reports/train.json").read_text())["final_loss"]

    # Slow steps so the kill lands mid-run, after a checkpoint
    proc = subprocess.Popen([sys.executable, "-m", "dvc", "repro", "-f", "-s", "train"], cwd=project,
                            env=env(FRUGALTUNE_TEST_STEP_DELAY_S="1.5"), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    checkpoints = project / "checkpoints/train"
    deadline = time.monotonic() + 300
    while not any(checkpoints.glob("*/step-4")):
        assert proc.poll() is None, proc.stdout.read()
        assert time.monotonic() < deadline, "no checkpoint at step 4 within 300 s"
        time.sleep(0.2)
    ranks = rank_processes(psutil.Process(proc.pid))
    assert len(ranks) == 2, [p.cmdline() for p in ranks]
    os.kill(ranks[1].pid, signal.SIGKILL)  # one rank dies; torchrun stops the other and the stage fails
    output, _ = proc.communicate(timeout=300)
    assert proc.returncode != 0, output[-3000:]
    assert not any(checkpoints.glob(f"*/step-{STEPS}")), "the run finished before the kill"

    resumed = dvc(["repro", "train"], project)
    text = resumed.stdout + resumed.stderr
    assert "resumed from" in text, text[-3000:]
    report = json.loads((project / "reports/train.json").read_text())
    assert report["resumed_from_step"] >= 4
    assert abs(report["final_loss"] - uninterrupted) < 1e-4, (report["final_loss"], uninterrupted)
