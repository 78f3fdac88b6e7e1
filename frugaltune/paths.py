"""Every artifact path of the pipeline, defined once.

Imported by stages, flows and tests; never run directly. Paths are relative to the project root (the directory
that holds `dvc.yaml`), which is the working directory of `dvc repro` and of every `python -m stages.<name>`.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

PARAMS = Path("params.yaml")

# import_model
MODELS = Path("models")
BASE_MODEL = MODELS / "base"

# ingest
RAW_DIR = Path("data/raw")
SPLITS_DIR = Path("data/splits")
SPLITS = ("train", "val", "test")
LABELS = SPLITS_DIR / "labels.json"


def split_path(split: str) -> Path:
    return SPLITS_DIR / f"{split}.parquet"


# validate: clean rows go on, failing rows go to quarantine with the reason
VALIDATED_DIR = Path("data/validated")
QUARANTINE = Path("data/quarantine.parquet")
DATA_DOCS = Path("reports/data_docs")


def validated_path(split: str) -> Path:
    return VALIDATED_DIR / f"{split}.parquet"


# tokenize
TOKENIZED_DIR = Path("data/tokenized")

# train
ADAPTER_DIR = MODELS / "adapter"
CHECKPOINTS_DIR = Path("checkpoints")  # outside every stage's outs: `dvc repro` must never delete them

# kernels
KERNEL_BUILD_DIR = Path("build/kernels")  # not cached by DVC

# reports
REPORTS = Path("reports")
PLOTS = REPORTS / "plots"
HARDWARE = REPORTS / "hardware.json"
PLAN = REPORTS / "plan.json"  # the planner's recommendation (probe stage); train takes its `auto` values from it


METRICS = REPORTS / "metrics"


def project_root() -> Path:
    """The DVC project's root (the directory holding `.dvc/`) seen from the working directory of any of its
    pipelines (scheduling/dvc.yaml runs its stages in scheduling/); the working directory outside a DVC project."""
    here = Path.cwd()
    return next((folder for folder in (here, *here.parents) if (folder / ".dvc").is_dir()), here)


def kernels_report() -> Path:
    """reports/kernels.json of the root pipeline, as a path from the working directory: the kernels stage measures
    a machine once, in the root dvc.yaml, and every pipeline reads that one report (`../reports/kernels.json` from
    scheduling/, which its dvc.yaml declares)."""
    return Path(os.path.relpath(project_root() / REPORTS / "kernels.json"))


def pipeline_file() -> Path:
    """The dvc.yaml whose stage is running, from the project root: `dvc.yaml` or `scheduling/dvc.yaml`."""
    return Path(os.path.relpath(Path.cwd() / "dvc.yaml", project_root()))


def repro_command() -> str:
    """The command that reruns the running stage's pipeline from the project root (`dvc repro` is the root's)."""
    pipeline = pipeline_file()
    return "dvc repro" if pipeline == Path("dvc.yaml") else f"dvc repro {pipeline}"


def report(stage: str) -> Path:
    """`reports/<stage>.json`: everything the stage has to say (numbers, reasons, ids); a DVC output, not metrics."""
    return REPORTS / f"{stage}.json"


def metrics(stage: str) -> Path:
    """`reports/metrics/<stage>.json`: the few numbers users compare across runs (DVC metrics, `dvc exp show`)."""
    return METRICS / f"{stage}.json"


def plot(stage: str, name: str) -> Path:
    """`reports/plots/<stage>_<name>.csv`."""
    return PLOTS / f"{stage}_{name}.csv"


@dataclass(frozen=True)
class RunOutputs:
    """Where one training + evaluation writes: the pipeline's own run, or one method of the comparison."""

    adapter_dir: Path
    train_report: Path
    loss_csv: Path
    telemetry_csv: Path
    evaluate_report: Path
    confusion_csv: Path
    train_metrics: Path | None = None  # the pipeline's own run only: the comparison's numbers are its table
    evaluate_metrics: Path | None = None


PIPELINE_RUN = RunOutputs(ADAPTER_DIR, report("train"), plot("train", "loss"), plot("train", "telemetry"),
                          report("evaluate"), plot("evaluate", "confusion"), metrics("train"), metrics("evaluate"))

# compare: every method on the same data (`compare@<method>` stages), then one table
COMPARE_DIR = REPORTS / "compare"
COMPARE_TABLE_MD = REPORTS / "compare.md"
COMPARE_TABLE_CSV = REPORTS / "compare.csv"


def compare_run(method: str) -> RunOutputs:
    return RunOutputs(MODELS / "compare" / method, COMPARE_DIR / f"{method}_train.json",
                      PLOTS / "compare" / f"{method}_loss.csv", PLOTS / "compare" / f"{method}_telemetry.csv",
                      COMPARE_DIR / f"{method}_evaluate.json", PLOTS / "compare" / f"{method}_confusion.csv")


# federated (federated/dvc.yaml): the clients' partitions and the server's test split, each run's rounds (outside the
# outs, which dvc deletes: a killed federation resumes from them) and each run's final adapter
FEDERATED_DATA = Path("data/federated")
FEDERATED_CHECKPOINTS = CHECKPOINTS_DIR / "federated"
FEDERATED_ADAPTERS = MODELS / "federated"  # models/federated/<method>_<partition>/, served like models/adapter

# tracking (overridable by MLFLOW_TRACKING_URI)
MLFLOW_DB = Path("mlflow.db")
MLFLOW_ARTIFACTS = Path("mlartifacts")
# `make ui SERVER=1` / `make mlflow-server`: the tracking server's own sqlite store and proxied artifacts
MLFLOW_SERVER_DIR = Path("mlflow-server")

# The scheduling pipeline (scheduling/dvc.yaml). Its stages run with scheduling/ as the working directory, so the
# paths above (models/base, data/tokenized, reports/...) name that directory's own copies, and the reused stages
# (import_model, ingest, validate, tokenize, train, register) work there unchanged. The paths below are its own.
SCHEDULING_DIR = Path("scheduling")  # from the repository root (flows, tests, the Makefile)
TRACE_COPY = Path("data/trace.swf")  # the trace as read, byte for byte (a DVC output: later stages read this)
TRACE_TABLE = Path("data/trace.parquet")  # one row per job, one column per SWF field: what validate_trace checks
USER_WORKLOAD = Path("data/user_workload.swf")  # generated, with users and runtime estimates (generate_workload)
SECOND_WORKLOAD = Path("data/second_workload.swf")  # the generated judge no policy trains on (generate_workload)
SFT_DATA = Path("data/sft.jsonl")  # prompt/response/candidates rows: data.source of the reused ingest stage
FIGURES = REPORTS / "figures"
