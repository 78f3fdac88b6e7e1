"""The train recipe: fine-tune the base model on the tokenized training split and write the trained model, its
report and its MLflow run.

Library code. The `train` stage (`python -m stages.train`) and the `compare` stage (`python -m stages.compare
<method>`) call `run`; what the stage file documents (inputs, outputs, checkpoints, distributed runs) happens here.
"""

from __future__ import annotations

import csv
import io
import json
import shutil

import mlflow
import torch
from datasets import load_from_disk

from frugaltune import allocator, integrity, tracking
from frugaltune.io import atomic_dir, read_json, write_json, write_metrics, write_text
from frugaltune import resolve
from frugaltune.planner.machine import keep_sdpa_off_cudnn
from frugaltune.models import load_tokenizer
from frugaltune.telemetry import StepTimer, TelemetrySampler
from frugaltune.training import checkpoint, distributed, setup
from frugaltune.training.loop import TrainResult, count_parameters, peak_rss_mb, train_classifier
from frugaltune.training.methods import save_trained
from frugaltune.training.signals import TrainingInterrupted
from frugaltune import paths
from frugaltune.config import Params


# Values the run was set up with (MLflow params, not metrics); the rest of reports/train.json was measured.
RUN_CONFIG_KEYS = ("trainable_params", "total_params", "trainable_percent", "bf16", "threads", "resumed_from_step",
                   "micro_batch_size", "gradient_checkpointing", "ranks")
# reports/metrics/train.json: the columns `dvc exp show` compares across experiments
TRAIN_METRICS = ("final_loss", "tokens_per_s", "wall_seconds", "peak_rss_mb", "steps")
# The per-step series (loss, lr, tokens/s of the last window, phase times) go to MLflow under this prefix: under the
# report's names they would shadow the run's summary, as MLflow's runs table shows a metric's value at its highest
# step (the last window's tokens/s, not the run's).
STEP_METRIC_PREFIX = "step/"


def step_metrics(record: dict) -> dict[str, float]:
    """One logged step of the loop as MLflow metrics: `step/loss`, `step/tokens_per_s`, ..."""
    return {f"{STEP_METRIC_PREFIX}{k}": v for k, v in record.items() if k not in ("step", "elapsed_s")}


def summary_metrics(metrics: dict) -> dict[str, float]:
    """The run's summary as MLflow metrics, under reports/train.json's names (`tokens_per_s`: useful tokens over the
    whole run's wall time, `wall_seconds`, `peak_rss_mb`, `final_loss`, ...): the numbers, less the run's setup."""
    return {k: v for k, v in metrics.items()
            if isinstance(v, int | float) and not isinstance(v, bool) and k not in RUN_CONFIG_KEYS}


def flatten(prefix: str, value) -> dict:
    if isinstance(value, dict):
        out = {}
        for key, sub in value.items():
            out.update(flatten(f"{prefix}.{key}" if prefix else key, sub))
        return out
    return {prefix: json.dumps(value) if isinstance(value, list) else value}


def log_params_once(logged, values: dict) -> None:
    """`mlflow.log_params(values)`; into a reopened run (`logged`: its data) only those its first attempt did not
    log, since MLflow refuses to change a param. A setting that may change between attempts without changing the
    checkpoints (`train.log_every`, `resolved.threads`, ...) keeps its first value, and the new one is the tag
    `resumed.<param>`."""
    if logged is None:
        mlflow.log_params(values)
        return
    mlflow.log_params({k: v for k, v in values.items() if k not in logged.params})
    for k, v in values.items():
        if k in logged.params and logged.params[k] != str(v):
            mlflow.set_tag(f"resumed.{k}", str(v))


def untrained() -> TrainResult:
    """`train.method: none`: the base model and its fresh head go to evaluation as they are."""
    return TrainResult(steps=0, micro_batches=0, sequences=0, tokens=0, padded_tokens=0, wall_seconds=0.0,
                       final_loss=float("nan"), mean_loss=float("nan"), peak_rss_mb=peak_rss_mb())


def adapter_manifest(params: Params, labels: list[str], tokenizer) -> dict:
    """`labels.json` beside the adapter: what serving needs to rebuild the model and use it as it was trained."""
    manifest = {"labels": labels, "max_length": params.tokenize.max_length, "method": params.train.method}
    if params.train.input_template is not None and params.task.type == "classification":  # read by evaluate, serving
        manifest["input_template"] = params.train.input_template
    if params.task.type == "causal_lm":
        from frugaltune import generation

        task = params.task
        manifest.update({"task": "causal_lm", "generation": {
            "max_new_tokens": task.max_new_tokens, "temperature": task.temperature, "system": task.system,
            "templated": generation.uses_chat_template(tokenizer, task.chat_template),
            "prompt_template": task.prompt_template}})
    return manifest


def loss_curve_csv(history: list[dict]) -> str:
    buffer = io.StringIO()
    writer = csv.DictWriter(buffer, fieldnames=["step", "loss", "lr", "tokens_per_s"], lineterminator="\n")
    writer.writeheader()
    for record in history:
        writer.writerow({"step": record["step"], "loss": f"{record['loss']:.6f}", "lr": f"{record['lr']:.3e}",
                         "tokens_per_s": f"{record['tokens_per_s']:.1f}"})
    return buffer.getvalue()


def run_key(params: Params, bf16: bool, int8_on: bool, train_set) -> str:
    """The key of the run's checkpoints: they resume only a run of the same configuration, data and base model."""
    tp, seed = params.train, params.common.seed
    base_sha = read_json(paths.report("import_model")).get("weights_sha256") if paths.report(
        "import_model").exists() else None
    volatile = {"resume", "checkpoint_every", "keep_checkpoints", "log_every", "threads", "experiment",
                "micro_batch_size", "micro_batch_tokens", "gradient_checkpointing", "allocator",
                "distributed"}  # how a step is computed
    return checkpoint.run_key({k: v for k, v in tp.model_dump().items() if k not in volatile}
                              | {"int8_products": int8_on}, seed, bf16, base_sha,
                              checkpoint.data_fingerprint(train_set["input_ids"], train_set["labels"]))


def say_setup(params: Params, resolved, world, examples: int, trainable: int, total: int, int8_products: dict) -> None:
    """The run's lines on what it trains, and how (rank 0)."""
    tp, bf16, threads = params.train, resolved.bf16, resolved.threads
    if tp.input_template is not None and params.task.type == "classification":  # `auto` derives it: say what it is
        print(f"train: each input wrapped as train.input_template {tp.input_template!r}")
    print(f"train: {tp.method} on {examples} examples, {trainable:,} of {total:,} parameters "
          f"trainable ({100 * trainable / total:.2f}%), precision {'bf16 autocast' if bf16 else 'fp32'}, "
          f"{threads} threads, micro-batch {resolved.micro_batch_size} of {tp.batch_size}, gradient checkpointing "
          f"{'on' if resolved.gradient_checkpointing else 'off'}, malloc {allocator.active()}, int8 products "
          f"{'on' if int8_products['on'] else 'off'} ({int8_products['why']})"
          + (f", {world.size} ranks (data parallel, {threads} threads each)" if world.distributed else ""))


def setup_params(params: Params, resolved, int8_products: dict, train_rows: int) -> dict:
    """The run's MLflow params: its train settings and what was resolved for them."""
    return (flatten("train", params.train.model_dump())
            | {"resolved.precision": "bf16" if resolved.bf16 else "fp32", "resolved.threads": resolved.threads,
               "resolved.micro_batch_size": resolved.micro_batch_size,
               "resolved.gradient_checkpointing": resolved.gradient_checkpointing,
               "resolved.allocator": allocator.active(), "resolved.int8_products": int8_products["on"],
               "data.train_rows": train_rows, "model.source": params.model.source})


def train_with_telemetry(params: Params, out: paths.RunOutputs, run_id: str, resolved, model, rows, train_set,
                         pad_token_id: int, cfg, world, first_event: int) -> tuple[TrainResult, dict, float, list[str]]:
    """Train inside the telemetry sampler, each logged step and event into the MLflow run; then the sampler's
    summary, logged too. Returns the result, that summary, the ranks' summed peak RSS and the run's events."""
    tp = params.train
    events: list[str] = []
    timer = StepTimer(sync=torch.cuda.synchronize if torch.cuda.is_available() else None,
                      extra_phases=("all_reduce",) if world.distributed else ())
    sampler = TelemetrySampler(tp.telemetry_interval_s, out.telemetry_csv, run_id,
                               cores=resolved.threads, use_nvml=params.probe.nvml)
    try:
        with sampler:
            result = untrained() if not resolved.method.trained else train_classifier(
                model, rows, train_set["labels"], cfg, pad_token_id,
                on_log=lambda rec: mlflow.log_metrics(step_metrics(rec), step=rec["step"]),
                on_event=lambda message: mlflow.set_tag(f"event.{first_event + len(events)}", message)
                or events.append(message),
                timer=timer, world=world,
            )
            peak_all_ranks = world.sum([peak_rss_mb()])[0]
    except TrainingInterrupted:
        # SIGINT/SIGTERM (a killed DVC included): a checkpoint was written, so the run is stopped rather than
        # failed, and the next `dvc repro` reopens it to log the rest of its steps
        mlflow.end_run("KILLED")
        raise
    distributed.shutdown(world)
    telemetry = sampler.summary(timer)
    sampler.log_summary(telemetry)
    return result, telemetry, peak_all_ranks, events


def run_metrics(params: Params, result: TrainResult, resolved, world, trainable: int, total: int,
                int8_products: dict, telemetry: dict, peak_all_ranks: float) -> dict:
    """reports/train.json's numbers: what the run measured, and what it was set up with."""
    metrics = {
        "final_loss": round(result.final_loss, 6),
        "mean_loss": round(result.mean_loss, 6),
        "steps": result.steps,
        "micro_batches": result.micro_batches,
        "sequences": result.sequences,
        "tokens": result.tokens,
        "padding_fraction": round(1 - result.tokens / max(result.padded_tokens, 1), 4),
        # causal_lm: prompt tokens every row of a batch starts with, read once instead of once per row
        "shared_prefix_tokens": result.shared_prefix_tokens,
        "tokens_per_s": round(result.tokens_per_second, 1),
        "wall_seconds": round(result.wall_seconds, 1),
        "peak_rss_mb": round(result.peak_rss_mb, 1),
        "ranks": world.size,
        "trainable_params": trainable,
        "total_params": total,
        "trainable_percent": round(100 * trainable / total, 4),
        "bf16": int(resolved.bf16),
        "threads": resolved.threads,
        "resumed_from_step": result.resumed_from_step,
        "micro_batch_size": result.micro_batch_size,
        "gradient_checkpointing": int(resolved.gradient_checkpointing),
        "int8_products": int8_products,
        "plan": {k: getattr(resolved, k) for k in ("predicted_peak_mb", "eta_seconds")
                 if getattr(resolved, k) is not None},
        "telemetry": {k: v for k, v in telemetry.items() if isinstance(v, int | float) and not isinstance(v, bool)},
    }
    if world.distributed:  # every rank holds its own copy of the model: what the host held at most, all ranks
        metrics["peak_rss_all_ranks_mb"] = round(peak_all_ranks, 1)
    if torch.cuda.is_available():  # the GPU's own peaks: what tensors held, and what the caching allocator kept
        metrics["cuda_peak_allocated_mb"] = round(torch.cuda.max_memory_allocated() / 2**20, 1)
        metrics["cuda_peak_reserved_mb"] = round(torch.cuda.max_memory_reserved() / 2**20, 1)
    if not resolved.method.trained:  # no loss to report rather than a made-up one
        metrics = {k: v for k, v in metrics.items() if k not in ("final_loss", "mean_loss")}
    return metrics


def log_and_write(out: paths.RunOutputs, metrics: dict, result: TrainResult, telemetry: dict, events: list[str],
                  run_id: str) -> None:
    """The run's summary into MLflow (params and metrics) and its reports, logged as artifacts too."""
    # What the run measured is a metric (charted, sortable); what it was set up with is a param, so the run page
    # opens on the loss curve rather than on a single-point chart per configuration value.
    mlflow.log_params({f"run.{k}": metrics[k] for k in RUN_CONFIG_KEYS if k in metrics}
                      | {f"plan.{k}": v for k, v in metrics["plan"].items()})
    mlflow.log_metrics(summary_metrics(metrics))  # once, at the end: what the runs table shows
    if out.train_metrics is not None:
        write_metrics(out.train_metrics, {k: metrics[k] for k in TRAIN_METRICS if k in metrics})
    write_text(out.loss_csv, loss_curve_csv(result.history))
    write_json(out.train_report, {**metrics, "allocator": allocator.active(),
                                  "bottlenecks": telemetry["findings"], "events": events,
                                       "mlflow_run_id": run_id})
    mlflow.log_artifact(str(out.train_report))
    mlflow.log_artifact(str(out.loss_csv))


def run(params: Params, out: paths.RunOutputs = paths.PIPELINE_RUN, use_plan: bool = True) -> dict:
    tp = params.train
    resolved = resolve.resolve_run(params, use_plan)  # before any loading: a run that cannot fit stops here
    bf16 = resolved.bf16
    world = distributed.init(tp.distributed.backend)  # World() unless torchrun started this process
    torch.set_num_threads(resolved.threads)
    if keep_sdpa_off_cudnn():
        print("train: SDPA without its cuDNN backend on this GPU (planner.machine.keep_sdpa_off_cudnn)",
              flush=True)

    labels = read_json(paths.LABELS)["labels"]
    train_set = load_from_disk(str(paths.TOKENIZED_DIR))["train"]
    integrity.verify_out(paths.BASE_MODEL)  # as DVC recorded it, not a damaged cache copy checked out
    tokenizer = load_tokenizer(paths.BASE_MODEL)
    rows = setup.training_rows(params, train_set["input_ids"], tokenizer)
    model = setup.build_model(params, resolved.method, labels, tokenizer.pad_token_id, bf16,
                              resolved.gradient_checkpointing)
    int8_products = setup.apply_int8(model, resolved.int8, resolved.method, world)
    trainable, total = count_parameters(model)
    key = run_key(params, bf16, int8_products["on"], train_set)
    checkpoint_dir = paths.CHECKPOINTS_DIR / "train" / key
    cfg = setup.loop_config(params, method=resolved.method, bf16=bf16, micro_batch_size=resolved.micro_batch_size,
                            eager_attention_max_len=resolved.eager_attention_max_len, checkpoint_dir=checkpoint_dir)
    if not world.is_main:  # the other ranks train their shares; rank 0 logs and writes everything
        try:
            if resolved.method.trained:
                train_classifier(model, rows, train_set["labels"], cfg, tokenizer.pad_token_id,
                                 progress=False, world=world)
            world.sum([peak_rss_mb()])  # rank 0 adds up the ranks' peaks
        finally:
            distributed.shutdown(world)
        return {}
    say_setup(params, resolved, world, len(train_set), trainable, total, int8_products)

    experiment_id = tracking.setup(tracking.experiment_name(params))
    # A run resumed from a checkpoint logs into the MLflow run it began (its id is kept beside the checkpoints):
    # one run with the whole loss history, rather than a stopped twin and a run that starts at the resumed step.
    reopened = tracking.resumable_run(mlflow.MlflowClient(), checkpoint.run_to_resume(checkpoint_dir)
                                      if cfg.checkpoints.resume else None, experiment_id)
    with mlflow.start_run(run_id=reopened,
                          run_name=None if reopened else tracking.run_name(tp.method, params.data.source, key),
                          tags={**tracking.run_tags(), **tracking.process_tags()}) as mlrun:
        checkpoint.remember_run(checkpoint_dir, mlrun.info.run_id)
        logged = mlflow.MlflowClient().get_run(mlrun.info.run_id).data if reopened else None
        # a reopened run keeps its first attempt's events: this attempt's are numbered after them
        first_event = sum(k.startswith("event.") for k in logged.tags) if logged else 0
        log_params_once(logged, setup_params(params, resolved, int8_products, len(train_set)))
        result, telemetry, peak_all_ranks, events = train_with_telemetry(
            params, out, mlrun.info.run_id, resolved, model, rows, train_set, tokenizer.pad_token_id, cfg, world,
            first_event)
        with atomic_dir(out.adapter_dir) as tmp:
            save_trained(model, resolved.method, tmp)
            tokenizer.save_pretrained(tmp)
            write_json(tmp / "labels.json", adapter_manifest(params, labels, tokenizer))
        metrics = run_metrics(params, result, resolved, world, trainable, total, int8_products, telemetry,
                              peak_all_ranks)
        log_and_write(out, metrics, result, telemetry, events, mlrun.info.run_id)
    shutil.rmtree(checkpoint_dir, ignore_errors=True)  # the run finished: its checkpoints have served
    for finding in telemetry["findings"]:
        print(f"train: telemetry: {finding}")
    print(f"train: loss {metrics.get('final_loss', float('nan')):.4f}, {metrics['tokens_per_s']:.0f} useful tokens/s, "
          f"{metrics['wall_seconds']:.0f} s, peak RSS {metrics['peak_rss_mb']:.0f} MB, MLflow run {mlrun.info.run_id}")
    return metrics
