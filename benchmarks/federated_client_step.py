"""A federated client's local round with and without the plan's int8 products, alternated in one process.

    python benchmarks/federated_client_step.py                      # client 0 of the Dirichlet partition, 4 pairs
    python benchmarks/federated_client_step.py --client 3 --pairs 6 --steps 16

Run from the repository root after the federated stage wrote data/federated/ (and the plan stage reports/plan.json).
Both models are the ClientApp's (local.build_model at the global rank, the clients' precision on this machine:
frugaltune.federated.plans.machine_precision), one with int8=True; each pair trains both from the same global
tensors for `--steps` steps of the clients' batch (local.train_locally, the stage's head rate and logit
adjustment), the order alternating from pair to pair so that a busy moment of a shared machine falls on both.
Prints each pair's seconds and ratio (without / with), their median, and the CPU, threads and precision. The
baseline is the model without int8 products.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from frugaltune import paths
from frugaltune.config import load_params
from frugaltune.federated import local
from frugaltune.federated.plans import machine_precision
from frugaltune.hardware import cpu_facts
from frugaltune.io import read_json
from frugaltune.models import pad_token_id


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--scheme", default="dirichlet")
    parser.add_argument("--client", type=int, default=0)
    parser.add_argument("--pairs", type=int, default=4)
    parser.add_argument("--steps", type=int, default=None, help="default: federated.local_steps")
    args = parser.parse_args()

    params = load_params()
    fp = params.federated
    precision = machine_precision(params)
    torch.set_num_threads(fp.threads)
    labels = read_json(paths.LABELS)["labels"]
    pad = pad_token_id(paths.BASE_MODEL)
    spec = local.LoraSpec(fp.lora.r, fp.lora.alpha, fp.lora.dropout, tuple(fp.lora.target_modules))
    ids, targets = local.read_examples(f"data/federated/partitions_{args.scheme}/client_{args.client}.parquet")
    steps = args.steps or fp.local_steps
    models = {int8: local.build_model("models/base", labels, pad, params.common.seed, spec, bf16=precision.bf16,
                                      int8=int8) for int8 in (False, True)}
    start = local.trainable_tensors(models[False])
    print(f"{cpu_facts()['model']}, {torch.get_num_threads()} threads, {'bf16' if precision.bf16 else 'fp32'} "
          f"(the plan's int8 decision here: {'on' if precision.int8 else 'off'}); client {args.client} "
          f"({len(targets)} rows), {steps} steps of {fp.batch_size}", flush=True)
    seconds: dict[bool, list[float]] = {False: [], True: []}
    for pair in range(args.pairs):
        for int8 in (False, True) if pair % 2 == 0 else (True, False):
            model = models[int8]
            local.load_tensors(model, start)
            began = time.perf_counter()
            local.train_locally(model, ids, targets, pad, steps=steps, lr=fp.lr, head_lr=fp.head_lr,
                                batch_size=fp.batch_size, micro_batch_size=None, seed=params.common.seed + pair,
                                bf16=precision.bf16, eager_attention_max_len=precision.eager,
                                logit_adjustment=fp.logit_adjustment)
            seconds[int8].append(time.perf_counter() - began)
        print(f"  pair {pair + 1}: without {seconds[False][-1]:.2f} s, with int8 products {seconds[True][-1]:.2f} s: "
              f"{seconds[False][-1] / seconds[True][-1]:.2f}x", flush=True)
    ratios = [plain / int8 for plain, int8 in zip(seconds[False], seconds[True])]
    print(f"int8 products / without, per pair: {' / '.join(f'{r:.2f}x' for r in ratios)}; median "
          f"{statistics.median(ratios):.2f}x (the first pair pays both models' warm-up)", flush=True)


if __name__ == "__main__":
    main()
