"""A failed stage leaves the last good outputs in place, and a clone checks out only what it built: real DVC repos
in temp dirs. Run with `pytest tests/unit/test_failed_stage.py` (about a minute: one ingest of 200 tweets)."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import yaml

from tests import tiny_project

ROOT = tiny_project.ROOT
PIPELINES = ("dvc.yaml", "scheduling/dvc.yaml", "federated/dvc.yaml")  # compare/dvc.yaml: not persisted (its header says why)


def outputs(dvc_yaml: Path) -> dict[str, dict]:
    """Every output of every stage (outs, metrics, plots) -> its options."""
    found = {}
    for stage in yaml.safe_load(dvc_yaml.read_text())["stages"].values():
        for kind in ("outs", "metrics", "plots"):
            for entry in stage.get(kind, []):
                (path, options), = entry.items() if isinstance(entry, dict) else ((entry, {}),)
                found[path] = options or {}
    return found


def test_every_output_of_the_pipelines_persists_while_its_stage_runs():
    # DVC deletes an output that is not `persist: true` before its stage runs: a failed run would leave nothing.
    for name in PIPELINES:
        removed_first = [path for path, options in outputs(ROOT / name).items() if not options.get("persist")]
        assert not removed_first, f"{name}: {removed_first} are deleted before their stage runs"


def test_a_failed_ingest_keeps_the_last_good_outputs(tmp_path):
    repo = tiny_project.build(tmp_path / "project", tmp_path / "no-model", calibrate=False)
    tiny_project.run([sys.executable, "-m", "dvc", "repro", "--single-item", "ingest"], repo)
    kept = ["data/splits/train.parquet", "data/splits/labels.json", "reports/ingest.json"]
    before = {name: (repo / name).read_bytes() for name in kept}
    raw_before = sorted(p.name for p in (repo / "data/raw").rglob("*"))

    bad = tmp_path / "tickets.csv"
    bad.write_text("tweet,sentiment\nthe app crashes,negative\nworks fine,positive\n")
    params = yaml.safe_load((repo / "params.yaml").read_text())
    params["data"]["source"] = str(bad)
    (repo / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))
    proc = subprocess.run([sys.executable, "-m", "dvc", "repro", "--single-item", "ingest"], cwd=repo,
                          env=tiny_project.env(), capture_output=True, text=True, timeout=600)
    assert proc.returncode != 0 and "tickets.csv" in proc.stdout + proc.stderr, proc.stdout + proc.stderr

    assert {name: (repo / name).read_bytes() for name in kept} == before
    assert sorted(p.name for p in (repo / "data/raw").rglob("*")) == raw_before


def test_checkout_on_a_fresh_clone_skips_the_pipelines_it_never_ran(tmp_path):
    """The project's dvc.yaml/dvc.lock files in a fresh clone, whose cache holds none of their outputs."""
    origin = tmp_path / "origin"
    for name in ("Makefile", "params.yaml", "dvc.yaml", "dvc.lock", "scheduling/params.yaml",
                 *(f"{p}/dvc.{ext}" for p in ("compare", "federated", "scheduling") for ext in ("yaml", "lock"))):
        (origin / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(ROOT / name, origin / name)
    for cmd in (["git", "init", "-q"], [sys.executable, "-m", "dvc", "init", "-q"], ["git", "add", "-A"],
                ["git", "-c", "user.name=ci", "-c", "user.email=ci@example.com", "commit", "-qm", "project"]):
        tiny_project.run(cmd, origin)
    clone = tmp_path / "clone"
    tiny_project.run(["git", "clone", "-q", str(origin), str(clone)], tmp_path)

    plain = subprocess.run([sys.executable, "-m", "dvc", "checkout"], cwd=clone, env=tiny_project.env(),
                           capture_output=True, text=True)
    # what `make checkout` avoids: the root pipeline's outputs, never built here. The other pipelines' outputs are
    # not in the DVC cache (cache: false), so no checkout (nor `dvc exp apply`) ever asks for them
    assert plain.returncode != 0 and "models/adapter" in plain.stderr, plain.stderr
    assert not any(f"{p}/" in plain.stderr for p in ("compare", "federated", "scheduling")), plain.stderr
    assert "models/compare" not in plain.stderr and "models/federated" not in plain.stderr, plain.stderr
    output = tiny_project.run(["make", "--no-print-directory", "checkout"], clone)
    assert "skipped" in output and "dvc status" in output, output
