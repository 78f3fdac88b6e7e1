"""Server learning rates compared on the federated stage's own partitions, in one process, in one run.

    python benchmarks/federated_server_lr.py                          # dirichlet, fedavg, server_lr 1 and 3
    python benchmarks/federated_server_lr.py --scheme iid --server-lr 1 5 --method ffa

Run from the repository root after `make federated` (it reads data/federated/partitions_<scheme>/, the clients'
plans in reports/federated.json, data/federated/test.parquet and models/base). It makes the rounds the ServerApp
makes with the same library calls (local.build_model at each client's planned rank, aggregation.slice_to_rank,
local.train_locally, aggregation.aggregate, aggregation.server_step) but without Flower: clients run one after
the other in this process and are sampled by index, not by node id, with no per-client micro-batch. Its figures
compare server learning rates with each other (the first given is the baseline; 1 = plain FedAvg); they are not a
deployment's. Prints the test macro-F1 after each round for each server_lr, and the CPU and threads.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout's frugaltune, not an installed one

import torch  # noqa: E402

from frugaltune.config import load_params  # noqa: E402
from frugaltune.federated import aggregation, local  # noqa: E402
from frugaltune.hardware import cpu_facts  # noqa: E402
from frugaltune.models import load_tokenizer  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--scheme", default="dirichlet", help="a partition the federated stage wrote")
    parser.add_argument("--method", default="fedavg", choices=["fedavg", "ffa"])
    parser.add_argument("--server-lr", type=float, nargs="+", default=[1.0, 3.0])
    args = parser.parse_args()

    params = load_params()
    fp, seed = params.federated, params.common.seed
    labels = json.loads(Path("data/splits/labels.json").read_text())["labels"]
    plans = [plan for plan in json.loads(Path("reports/federated.json").read_text())["clients"][args.scheme]
             if plan["fits"]]
    pad = json.loads(Path("models/base/config.json").read_text()).get("pad_token_id")
    pad = pad if pad is not None else load_tokenizer("models/base").pad_token_id
    spec = local.LoraSpec(fp.lora.r, fp.lora.alpha, fp.lora.dropout, tuple(fp.lora.target_modules))
    test = local.read_examples("data/federated/test.parquet")
    data = {plan["client"]: local.read_examples(f"data/federated/partitions_{args.scheme}/client_{plan['client']}"
                                                ".parquet") for plan in plans}
    models: dict[int, torch.nn.Module] = {}  # one per rank, reloaded with each client's slice of the global
    server = local.build_model("models/base", labels, pad, seed, spec)
    start = local.trainable_tensors(server)
    print(f"{cpu_facts()['model']}, {torch.get_num_threads()} threads; {args.scheme}/{args.method}, "
          f"{fp.num_rounds} rounds, {max(fp.min_completed, round(fp.fraction * len(plans)))} of {len(plans)} "
          f"clients x {fp.local_steps} steps of {fp.batch_size}, lr {fp.lr}")
    for server_lr in args.server_lr:
        began, tensors, curve = time.perf_counter(), dict(start), []
        for number in range(1, fp.num_rounds + 1):
            sampled = random.Random(seed * 1000 + number).sample(
                range(len(plans)), max(fp.min_completed, round(fp.fraction * len(plans))))
            updates = []
            for index in sampled:
                plan = plans[index]
                if plan["lora_rank"] not in models:
                    models[plan["lora_rank"]] = local.build_model("models/base", labels, pad, seed, spec,
                                                                  plan["lora_rank"])
                model = models[plan["lora_rank"]]
                local.load_tensors(model, aggregation.slice_to_rank(tensors, plan["lora_rank"]))
                for name, param in model.named_parameters():  # FFA: A frozen, as the ClientApp does
                    if aggregation.is_lora_a(name):
                        param.requires_grad_(args.method != "ffa")
                input_ids, targets = data[plan["client"]]
                local.train_locally(model, input_ids, targets, pad, steps=fp.local_steps, lr=fp.lr,
                                    batch_size=fp.batch_size, micro_batch_size=None, seed=seed * 1000 + number)
                updates.append((local.trainable_tensors(model), len(targets)))  # under FFA: B + head only
            tensors = aggregation.server_step(tensors, aggregation.aggregate(tensors, updates, args.method),
                                              server_lr)
            local.load_tensors(server, tensors)
            curve.append(local.evaluate(server, *test, labels, pad)["macro_f1"])
        print(f"  server_lr {server_lr:g}: test macro-F1 per round "
              f"{' / '.join(f'{v:.3f}' for v in curve)} ({time.perf_counter() - began:.0f} s)", flush=True)


if __name__ == "__main__":
    main()
