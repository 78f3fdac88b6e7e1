"""The centralized reference a federation is judged against: LoRA trained in one process on the whole training
split (the union of what the clients own), for as many examples as the federation's clients trained on.

Library code, called by the federated stage (`reference`: trained once per key, kept in
checkpoints/federated/centralized/) and by benchmarks/federated_rounds.py (`baseline`, over seeds); never run.
"""

from __future__ import annotations

import hashlib
import inspect
import json
import time

from frugaltune import methods, paths
from frugaltune.config import Params
from frugaltune.federated import keys, local, rounds, rows
from frugaltune.federated.plans import Precision, machine_precision
from frugaltune.io import read_json, write_json

# the train stage's recipe fields the reference trains with (baseline)
REFERENCE_RECIPE = ("lr", "head_lr", "lora_plus_ratio", "weight_decay", "scheduler", "warmup_ratio", "batch_size",
                    "grad_accum", "max_grad_norm", "group_by_length")


def examples_trained(out, batch_size: int) -> int:
    """Training examples the clients of a run went through: steps x batch size, over every completed client-round."""
    return sum(int(client.get("steps", 0)) * batch_size for report in rounds.reports(out)
               for client in report.get("clients", []))


def baseline(params: Params, labels: list[str], pad_token_id: int, examples: int, seed: int | None = None,
             precision: Precision | None = None) -> dict:
    """Centralized LoRA: the train stage's own recipe (`train.lr`, `train.head_lr`, `train.batch_size`, its
    schedule, clipping and weight decay) on the federation's LoRA (`federated.lora`), trained in one process on
    data/federated/train.parquet (the clients' rows, wrapped as theirs are) for as many examples as the federation's
    clients trained on, and evaluated on the same test split by the same function as the server's rounds. `seed`
    (default `common.seed`) and `precision` (plans.Precision, default this machine's decision) let
    a benchmark run it over seeds. Why the train stage's recipe and not the clients' lr and batch: docs/DECISIONS.md,
    "The centralized reference is the train stage's recipe"."""
    import torch

    from frugaltune.training import setup
    from frugaltune.training.loop import peak_rss_mb, train_classifier

    fp, tp = params.federated, params.train
    seed = params.common.seed if seed is None else seed
    per_step = tp.batch_size * tp.grad_accum
    steps = max(1, round(examples / per_step))
    threads = torch.get_num_threads()
    spec = fp.lora.knobs()
    bf16, eager, int8 = precision or machine_precision(params)  # as the clients train
    model = local.build_model(paths.BASE_MODEL, labels, pad_token_id, seed, spec, bf16=bf16, int8=int8)
    input_ids, targets = local.read_examples(paths.FEDERATED_DATA / "train.parquet")
    # the train stage's recipe for `steps` steps, each batch in one pass (the plan's micro-batch and
    # train.micro_batch_tokens bound the train stage's own run), no checkpoints
    cfg = setup.loop_config(params, method=methods.get("lora"), bf16=bf16, micro_batch_size=None,
                            eager_attention_max_len=eager, micro_batch_tokens=None, max_steps=steps, log_every=steps,
                            seed=seed)
    began = time.perf_counter()
    train_classifier(model, input_ids, targets, cfg, pad_token_id, progress=False)
    seconds = time.perf_counter() - began
    test_ids, test_targets = local.read_examples(paths.FEDERATED_DATA / "test.parquet")
    if int8:  # evaluated as the server evaluates the federations' globals: their tensors in the plain model
        trained = local.trainable_tensors(model)
        model = local.build_model(paths.BASE_MODEL, labels, pad_token_id, seed, spec, bf16=bf16)
        local.load_tensors(model, trained)
    final = local.evaluate(model, test_ids, test_targets, labels, pad_token_id, bf16=bf16)
    return {"examples": steps * per_step, "steps": steps, "batch_size": per_step, "lr": tp.lr,
            "head_lr": tp.head_lr, "precision": "bf16" if bf16 else "fp32", "int8_products": int8,
            "scheduler": tp.scheduler,
            "warmup_ratio": tp.warmup_ratio, "training_rows": len(targets), "threads": threads,
            "train_seconds": round(seconds, 1),
            "peak_rss_mb": round(peak_rss_mb()), "final": final}


def reference_key(params: Params, examples: int, pad_token_id: int, precision: Precision, threads: int) -> str:
    """The centralized reference's identity: what its numbers depend on (the recipe, the federation's LoRA, seed,
    examples, pad id, precision, threads, base weights, the training and evaluation code with `baseline`'s own
    source, and the rows of data/federated/train.parquet and test.parquet). The run keys' rule, for one run."""
    data = paths.FEDERATED_DATA
    blob = json.dumps({"recipe": {k: getattr(params.train, k) for k in REFERENCE_RECIPE},
                       "lora": params.federated.lora.model_dump(), "seed": params.common.seed, "examples": examples,
                       "pad_token_id": pad_token_id, "bf16": precision.bf16, "eager": precision.eager,
                       "int8": precision.int8, "threads": threads,
                       "model": keys.base_weights_sha(), "code": keys.round_code_sha256(),
                       "function": inspect.getsource(baseline),
                       "data": rows.rows_fingerprint([data / "train.parquet", data / "test.parquet"])},
                      sort_keys=True, default=str)
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def reference(params: Params, labels: list[str], pad_token_id: int, examples: int,
              precision: Precision | None = None) -> dict:
    """`baseline`, trained once per reference_key: kept in checkpoints/federated/centralized/<key>.json, so a rerun
    whose federations all resume (a new boot rewrites hardware.json, a dependency) does not train it again. A reused
    result says so (`reused_from`); its seconds are those it was trained in."""
    import torch

    precision = precision or machine_precision(params)  # the stage's, read once; a library caller: the plan's
    kept = paths.FEDERATED_CHECKPOINTS / "centralized" / (
        reference_key(params, examples, pad_token_id, precision, torch.get_num_threads()) + ".json")
    if kept.exists():
        central = read_json(kept)
        print(f"federated: centralized LoRA reused from {kept} (trained in {central['train_seconds']} s)", flush=True)
        return {**central, "reused_from": str(kept)}
    central = baseline(params, labels, pad_token_id, examples, precision=precision)
    write_json(kept, central)  # atomic (frugaltune.io): a killed stage leaves none, not half of one
    return central
