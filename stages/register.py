"""Register the fine-tuned model in MLflow; move the `champion` alias only when it wins.  Run by DVC as:

    python -m stages.register

Reads `register.*`, `train.experiment` (null: the experiment named `register.model_name`), `evaluate.split`, `data/tokenized/`, `reports/train.json` (its `mlflow_run_id`), `reports/evaluate.json`,
`models/base/` and `models/adapter/`. Logs the model as an MLflow pyfunc into the training run (a new run when
that run is unknown to the store), registers it as a version of `register.model_name` tagged with a handful of tags (git commit,
data hash, evaluation data, content hash, `finetuned.<register.metric>`; the other metrics are run metrics), saves
the runs table's view (the headline metrics and key params as columns), and writes `reports/register.json`.

Idempotent and safe to retry: a run that already has a version gets no second one, and a model already logged
into the run is reused. The alias moves to the new version only when its `finetuned.<register.metric>` beats the
holder's (ties keep the holder), or when nobody holds it, and only between versions evaluated on the same data:
each version is tagged with a fingerprint of the evaluation split (token ids and labels) and its label set, and a
version of another task or another test set is registered but never compared (its metric would measure something
else); the message says to give that task a `register.model_name` of its own.
"""

from __future__ import annotations

import math
import sys

from mlflow import MlflowClient

from frugaltune import integrity, paths, store, tracking
from frugaltune.config import Params
from frugaltune.entry import stage_main
from frugaltune.io import write_json
from frugaltune.registry import (RegisterError, eval_data_tags, metric_tags, model_hash, read_report, register_adapter,
                                 resolve_run)

def run(params: Params) -> dict:
    reg = params.register_
    train_report = read_report("train")
    evaluation = read_report("evaluate")
    metric_tag = f"finetuned.{reg.metric}"
    metrics = metric_tags(evaluation)
    if metric_tag not in metrics or not math.isfinite(float(metrics[metric_tag])):
        known = sorted(k.removeprefix("finetuned.") for k in metrics if k.startswith("finetuned."))
        raise RegisterError(
            f"register.metric = {reg.metric!r}: {paths.report('evaluate')} has no finite `{metric_tag}`. "
            f"Choose one of: {', '.join(known) or '(none: rerun evaluate)'}."
        )
    for path, stage in ((paths.BASE_MODEL, "import_model"), (paths.ADAPTER_DIR, "train")):
        if not path.is_dir():
            raise RegisterError(f"{path}: not found. Run the {stage} stage first (`dvc repro {stage}`).")

    # What is registered is what DVC recorded, not a damaged cache copy `dvc checkout` restored
    integrity.verify_outs(paths.BASE_MODEL, paths.ADAPTER_DIR)
    eval_data = eval_data_tags(params.evaluate.split)
    experiment_id = tracking.setup(tracking.experiment_name(params))
    client = MlflowClient()
    content_hash = model_hash(paths.BASE_MODEL, paths.ADAPTER_DIR)
    run_name = tracking.run_name(params.train.method, params.data.source, content_hash)
    run_id, fallback = resolve_run(client, train_report.get("mlflow_run_id"), experiment_id, content_hash, run_name)
    if fallback:
        print(f"register: {fallback}", file=sys.stderr)

    report = register_adapter(client, reg, run_id, paths.BASE_MODEL, paths.ADAPTER_DIR, metrics, eval_data,
                              content_hash)
    write_json(paths.report("register"), report)
    return report


def main() -> None:
    stage_main("register", guarded_run, RegisterError, store.StoreError, integrity.IntegrityError)


def guarded_run(params: Params) -> None:
    with store.guarded_write(tracking.tracking_uri()):  # one writer; a backup before and after
        run(params)


if __name__ == "__main__":
    main()
