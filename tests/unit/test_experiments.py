"""`make exps`: one pipeline's experiments, headline metric and changed params first, within 120 columns when
piped; a real DVC repo in a temp dir with two pipelines and an experiment. Run with
`pytest tests/unit/test_experiments.py` (about 20 s: one `dvc exp run`)."""

from __future__ import annotations

import json
import shutil
import sys

import yaml

from tests import tiny_project

STAGE = ("import json, yaml; p = yaml.safe_load(open('params.yaml')); lr = p['train']['lr']; "
         "json.dump({'final_loss': 1 - lr, 'tokens_per_s': 251.3, 'wall_seconds': 428.5, 'peak_rss_mb': 3546.3, "
         "'steps': 178, 'a_long_training_metric_name': 1}, open('reports/metrics/train.json', 'w')); "
         "json.dump({'accuracy': 0.77 + lr / 10, 'baseline_macro_f1': 0.28, 'macro_f1_gain': 0.47, "
         "'macro_f1': 0.76 + lr / 10}, open('reports/metrics/evaluate.json', 'w'))")


def project(repo):
    """A classifier pipeline at the root and a scheduler beside it, each with its params and metrics."""
    params = {"train": {"lr": 0.002, "method": "lora", "lora": {"r": 8, "target_modules": ["q_proj", "k_proj"]}},
              "register": {"metric": "macro_f1"}}
    (repo / "reports/metrics").mkdir(parents=True)
    (repo / "params.yaml").write_text(yaml.safe_dump(params))
    (repo / "dvc.yaml").write_text(yaml.safe_dump({"stages": {"train": {
        "cmd": f'{sys.executable} -c "{STAGE}"', "params": ["train"],
        "metrics": [{"reports/metrics/train.json": {"cache": False}},
                    {"reports/metrics/evaluate.json": {"cache": False}}]}}}))
    (repo / "scheduling/reports/metrics").mkdir(parents=True)
    (repo / "scheduling/params.yaml").write_text(yaml.safe_dump({"register": {"metric": "avg_bsld"}}))
    (repo / "scheduling/reports/metrics/evaluate.json").write_text(
        json.dumps({"FCFS.avg_bsld": 1714.16, "finetuned.avg_bsld": 337.08}))
    (repo / "scheduling/dvc.yaml").write_text(yaml.safe_dump({"stages": {"evaluate_policy": {
        "cmd": "true", "params": ["register"], "metrics": [{"reports/metrics/evaluate.json": {"cache": False}}]}}}))
    dvc = [sys.executable, "-m", "dvc"]
    for cmd in (["git", "init", "-q"], [*dvc, "init", "-q"], [*dvc, "repro", "-q", "dvc.yaml"], ["git", "add", "-A"],
                ["git", "-c", "user.name=ci", "-c", "user.email=ci@example.com", "commit", "-qm", "project"],
                [*dvc, "exp", "run", "-q", "-n", "lr-high", "-S", "train.lr=0.5"]):
        tiny_project.run(cmd, repo)
    return repo


def test_make_exps_shows_the_headline_metric_and_changed_params_first_within_120_columns(tmp_path):
    repo = project(tmp_path / "repo")
    shutil.copy(tiny_project.ROOT / "Makefile", repo / "Makefile")
    env = {"COLUMNS": ""}  # piped, as in a log or `| less`; `-o install`: the venv is this one
    lines = tiny_project.run(["make", "--no-print-directory", "-o", "install", "exps"], repo, **env).splitlines()
    header = lines[0].split()
    assert header[:3] == ["Experiment", "macro_f1", "train.lr"], lines
    assert all(len(line) <= 120 for line in lines), lines
    assert "…" not in "\n".join(lines)
    assert "avg_bsld" not in "\n".join(lines)  # the scheduler's metrics are its own table
    (experiment,) = [line.split() for line in lines if "lr-high" in line]
    assert experiment[1:3] == ["0.81", "0.5"], lines
    assert "--all" in lines[-1]  # what did not fit is named, not cut

    scheduler = tiny_project.run(["make", "--no-print-directory", "-o", "install", "exps", "PIPELINE=scheduling"], repo, **env)
    assert scheduler.splitlines()[0].split()[:3] == ["Experiment", "finetuned.avg_bsld", "FCFS.avg_bsld"], scheduler
    assert "macro_f1" not in scheduler
