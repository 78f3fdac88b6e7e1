"""Register the federated global adapter in MLflow like the centralized one: same pyfunc serving, same registered
model, same `champion` rule.  Run by DVC as:  python -m stages.federated_register   (after `federated`)

Reads `register.*`, `federated.partition`, `reports/federated.json`, `models/federated/<run>/` (each run's final
global adapter + head, written by the federated stage), `models/base/` and `data/tokenized/`. Of the runs on the
configured partition (the IID control is a control, not a candidate: a real federation does not have IID data), the
one with the best final `register.metric` on the server's test split is logged into the federated MLflow run and
registered as a version of `register.model_name` through frugaltune/registry.py (as the register stage does): tagged with its test
metrics as `finetuned.<metric>`, the test split's fingerprint and the label set, so the alias moves only when it
beats the holder on the same data, whether that holder was trained centrally or federated. Writes
`reports/federated_register.json`.
"""

from __future__ import annotations

import math
import sys
from pathlib import Path

from mlflow import MlflowClient

from frugaltune import integrity, paths, store, tracking
from frugaltune.config import Params
from frugaltune.entry import stage_main
from frugaltune.io import write_json
from frugaltune import registry as register

REPORT = paths.report("federated_register")
EVAL_SPLIT = "test"  # the split the ServerApp evaluates the global adapter on (frugaltune/federated/server_app.py)


def choose_run(report: dict, partition: str, metric: str, higher_is_better: bool) -> tuple[str, dict]:
    """The run to register: the best final `metric` among the runs on `partition`."""
    runs = {name: run for name, run in report["runs"].items() if run.get("partition") == partition}
    if not runs:
        raise register.RegisterError(f"{paths.report('federated')} has no run on partition {partition!r} (runs: "
                                     f"{', '.join(report['runs']) or 'none'}). Rerun `dvc repro federated/dvc.yaml`.")
    known = sorted(next(iter(runs.values()))["final"])
    if metric not in known:
        raise register.RegisterError(f"register.metric = {metric!r}: the federated runs report {', '.join(known)}; "
                                     "choose one of them.")
    pick = max if higher_is_better else min
    name = pick(runs, key=lambda n: runs[n]["final"][metric])
    return name, runs[name]


def run(params: Params) -> dict:
    reg = params.register_
    federated_report = register.read_report("federated")
    name, chosen = choose_run(federated_report, params.federated.partition, reg.metric, reg.higher_is_better)
    adapter_dir = Path(chosen["adapter_dir"])
    if not (adapter_dir / "adapter_config.json").is_file():
        raise register.RegisterError(f"{adapter_dir}: no adapter. Rerun the federated stage.")
    metrics = register.metric_tags({"finetuned": chosen["final"]})
    if not math.isfinite(float(metrics[f"finetuned.{reg.metric}"])):
        raise register.RegisterError(f"run {name}: its final {reg.metric} is not finite; nothing to register.")
    # What is registered is what DVC recorded, not a damaged cache copy (frugaltune/integrity.py)
    integrity.verify_outs(paths.BASE_MODEL, paths.FEDERATED_ADAPTERS)
    eval_data = register.eval_data_tags(EVAL_SPLIT)
    experiment_id = tracking.setup("federated")
    client = MlflowClient()
    content_hash = register.model_hash(paths.BASE_MODEL, adapter_dir)
    run_id, fallback = register.resolve_run(client, federated_report.get("mlflow_run_id"), experiment_id,
                                            content_hash)
    if fallback:
        print(f"federated_register: {fallback}", file=sys.stderr)
    client.set_tag(run_id, "frugaltune.federated_run", name)
    # The federated stage's run is named by MLflow at random; this says what it registered.
    client.set_tag(run_id, "mlflow.runName", tracking.run_name(f"federated-{name}", params.data.source, content_hash))
    report = {"federated_run": name, **register.register_adapter(
        client, reg, run_id, paths.BASE_MODEL, adapter_dir, metrics, eval_data, content_hash)}
    write_json(REPORT, report)
    return report


def main() -> None:
    stage_main("federated_register", guarded_run, register.RegisterError, store.StoreError, integrity.IntegrityError)


def guarded_run(params: Params) -> None:
    # one writer; a backup before and after
    with store.guarded_write(tracking.tracking_uri(), rerun="dvc repro federated/dvc.yaml:federated_register"):
        run(params)


if __name__ == "__main__":
    main()
