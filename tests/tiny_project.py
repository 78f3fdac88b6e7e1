"""The tiny project the end-to-end tests run `dvc repro` in: the real stages and dvc.yaml in a temp git+DVC repo,
on a tiny random llama and 200 real tweets. Imported by the end-to-end tests and tests/faults; not run on its own."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]


# The kernels stage of a tiny project: the CUDA kernels are compiled and verified by tests/unit/test_kernels.py; the
# CPU's fp32-vs-bf16 timing runs at the shapes of tests.tiny_model.build_tiny_model (hidden 64, 4 heads,
# intermediate 128), not at params.yaml's SmolLM2 layer (docs/DECISIONS.md, "make test on the CI's machine...").
KERNELS = {"enabled": False, "bench_batch": 8, "bench_seq_len": 64, "model_hidden": 64, "model_heads": 4,
           "model_intermediate": 128, "timing_repeats": 3}


def env(**extra: str) -> dict[str, str]:
    """This environment for a subprocess: the venv first on PATH, offline, no progress bars, and the default
    MLflow store (the project's mlflow.db) unless `extra` sets MLFLOW_TRACKING_URI."""
    base = {name: value for name, value in os.environ.items() if name != "MLFLOW_TRACKING_URI"}
    return {**base, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}",
            "HF_HUB_OFFLINE": "1", "TQDM_DISABLE": "1", **extra}


def run(cmd: list[str], cwd: Path, timeout: float = 1200, **extra: str) -> str:
    """Run `cmd` in `cwd` with `env(**extra)`; its stdout + stderr, or a failed assertion that shows them."""
    proc = subprocess.run(cmd, cwd=cwd, env=env(**extra), capture_output=True, text=True, timeout=timeout)
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, f"{' '.join(cmd)} failed ({proc.returncode}):\n{output[-6000:]}"
    return output


def build(repo: Path, model_dir: Path, calibrate: bool = True, **train) -> Path:
    """The project in `repo` with tiny settings (model `model_dir`, 200 rows, 4 training steps, no kernels),
    committed; `.dvc/config` and the offline plots template as `make install` leaves them. `calibrate=False`:
    the plan's analytic estimates only (its timed steps cost ~1 min here), for tests about something else.
    `train`: train params over the tiny ones (the fault tests' checkpoints: max_steps=6, checkpoint_every=2)."""
    for name in ("stages", "frugaltune", "kernels", "compare"):
        shutil.copytree(ROOT / name, repo / name, ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(ROOT / "dvc.yaml", repo / "dvc.yaml")
    params = yaml.safe_load((ROOT / "params.yaml").read_text())
    params["model"]["source"] = str(model_dir)
    params["data"]["max_rows"] = 200
    params["validate"]["min_class_fraction"] = 0.05
    params["kernels"].update(KERNELS)
    params["probe"]["calibrate"] = calibrate
    # int8 products off: each training process would compile its quantize step (tests/unit/test_int8.py has it)
    params["train"].update({"max_steps": 4, "batch_size": 8, "log_every": 1, "threads": 1, "int8_products": False,
                            **train})
    params["evaluate"]["batch_size"] = 16
    params["compare"]["max_steps"] = 2
    (repo / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))
    run(["git", "init", "-q"], repo)
    run(["git", "config", "user.email", "ci@example.com"], repo)
    run(["git", "config", "user.name", "ci"], repo)
    run([sys.executable, "-m", "dvc", "init", "-q"], repo)
    for name in ("config", ".gitignore"):  # the project's: analytics off, the offline plots template (not committed)
        shutil.copy(ROOT / ".dvc" / name, repo / ".dvc" / name)
    # The project's .dvcignore: without it the bytecode a stage writes (`__pycache__`, unless PYTHONDONTWRITEBYTECODE
    # is set) changes the hash of the code directories other stages depend on, and `dvc status` sees them changed.
    shutil.copy(ROOT / ".dvcignore", repo / ".dvcignore")
    run([sys.executable, "-m", "frugaltune.offline", "dvc-template"], repo)  # what `make install` writes
    run(["git", "add", "-A"], repo)
    run(["git", "commit", "-qm", "project"], repo)
    return repo


def plan_inputs(root: Path, model_dir: Path, labels: list[str], params_yaml: str) -> Path:
    """What the planner reads, and nothing else, in `root`: models/base (a link to `model_dir`), the labels, 48
    tokenized rows of 6-25 tokens and `params_yaml` (for `build_plan` or `frugaltune plan` run with cwd `root`)."""
    import json

    from datasets import Dataset, DatasetDict

    (root / "models").mkdir()
    (root / "models" / "base").symlink_to(model_dir)
    (root / "data" / "splits").mkdir(parents=True)
    (root / "data" / "splits" / "labels.json").write_text(json.dumps({"labels": labels}))
    rows = [[5 + (i * 3 + j) % 400 for j in range(6 + i % 20)] for i in range(48)]
    DatasetDict({"train": Dataset.from_dict({"input_ids": rows, "labels": [i % len(labels) for i in range(48)]})}) \
        .save_to_disk(str(root / "data" / "tokenized"))
    (root / "params.yaml").write_text(params_yaml)
    return root
