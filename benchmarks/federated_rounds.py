"""Federated settings compared on the federated stage's own partitions, in one process, in one run, beside
centralized LoRA on as many examples.

    python benchmarks/federated_rounds.py                                  # the params.yaml federation
    python benchmarks/federated_rounds.py --server-lr 1 3                  # server learning rates (1 = FedAvg)
    python benchmarks/federated_rounds.py --lr 0.002 --local-steps 16 --rounds 10 --centralized
    python benchmarks/federated_rounds.py --scheme iid --method ffa

Run from the repository root after `make federated` (it reads data/federated/partitions_<scheme>/, the clients'
plans in reports/federated.json, data/federated/test.parquet, models/base and reports/plan.json). It makes the
rounds the ServerApp makes with the same library calls (local.build_model at each client's planned rank,
aggregation.slice_to_rank, local.train_locally, aggregation.aggregate, aggregation.server_step) but without
Flower: clients run one after the other in this process and are sampled by index, not by node id, with no
per-client micro-batch. Its figures compare settings with each other (the first server_lr given is the
baseline); they are not a deployment's. Prints the test macro-F1 after each round, and with --centralized the
centralized baseline the stage computes (stages/federated.py: one process, the whole training split, as many
examples as the clients trained on, same lr, batch and schedule), and the CPU, threads and precision.
Every flag left out takes its params.yaml `federated` value; --precision auto takes the plan's.
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
    parser.add_argument("--server-lr", type=float, nargs="+", default=None)
    parser.add_argument("--lr", type=float, default=None, help="the clients' learning rate")
    parser.add_argument("--local-steps", type=int, default=None)
    parser.add_argument("--rounds", type=int, default=None)
    parser.add_argument("--precision", choices=["auto", "fp32", "bf16"], default="auto")
    parser.add_argument("--centralized", action="store_true", help="also the stage's centralized baseline")
    parser.add_argument("--logit-adjustment", choices=["on", "off", "params"], default="params",
                        help="clients add log(label prior) to the logits they train on (local.train_locally)")
    args = parser.parse_args()

    params = load_params()
    fp, seed = params.federated, params.common.seed
    lr = args.lr if args.lr is not None else fp.lr
    local_steps = args.local_steps or fp.local_steps
    rounds = args.rounds or fp.num_rounds
    server_lrs = args.server_lr or [fp.server_lr]
    adjust = (getattr(fp, "logit_adjustment", False) if args.logit_adjustment == "params"
              else args.logit_adjustment == "on")
    plan_run = json.loads(Path("reports/plan.json").read_text()).get("run", {})
    bf16 = plan_run.get("precision") == "bf16" if args.precision == "auto" else args.precision == "bf16"
    eager = int(plan_run.get("eager_attention_max_len", 0))
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
    per_round = max(fp.min_completed, round(fp.fraction * len(plans)))
    print(f"{cpu_facts()['model']}, {torch.get_num_threads()} threads, {'bf16' if bf16 else 'fp32'}; "
          f"{args.scheme}/{args.method}, {rounds} rounds, {per_round} of {len(plans)} clients x {local_steps} "
          f"steps of {fp.batch_size}, lr {lr}, logit adjustment {'on' if adjust else 'off'}", flush=True)
    for server_lr in server_lrs:
        began, tensors, curve, steps = time.perf_counter(), dict(start), [], 0
        for number in range(1, rounds + 1):
            sampled = random.Random(seed * 1000 + number).sample(range(len(plans)), per_round)
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
                result = local.train_locally(model, input_ids, targets, pad, steps=local_steps, lr=lr,
                                             batch_size=fp.batch_size, micro_batch_size=None,
                                             seed=seed * 1000 + number, bf16=bf16, eager_attention_max_len=eager,
                                             logit_adjustment=adjust)
                steps += result.steps
                updates.append((local.trainable_tensors(model), len(targets)))  # under FFA: B + head only
            tensors = aggregation.server_step(tensors, aggregation.aggregate(tensors, updates, args.method),
                                              server_lr)
            local.load_tensors(server, tensors)
            curve.append(local.evaluate(server, *test, labels, pad, bf16=bf16)["macro_f1"])
            print(f"  server_lr {server_lr:g}, round {number}: test macro-F1 {curve[-1]:.4f} "
                  f"({time.perf_counter() - began:.0f} s)", flush=True)
        print(f"  server_lr {server_lr:g}: test macro-F1 per round "
              f"{' / '.join(f'{v:.3f}' for v in curve)} ({time.perf_counter() - began:.0f} s, {steps} client steps "
              f"= {steps * fp.batch_size} examples)", flush=True)
    if args.centralized:
        began = time.perf_counter()
        model = local.build_model("models/base", labels, pad, seed, spec)
        input_ids, targets = local.read_examples("data/federated/train.parquet")
        local.train_locally(model, input_ids, targets, pad, steps=steps, lr=lr, batch_size=fp.batch_size,
                            micro_batch_size=None, seed=seed, bf16=bf16, eager_attention_max_len=eager)
        final = local.evaluate(model, *test, labels, pad, bf16=bf16)
        print(f"  centralized, {steps} steps of {fp.batch_size} ({steps * fp.batch_size} examples of "
              f"{len(targets)} rows): test macro-F1 {final['macro_f1']:.4f} ({time.perf_counter() - began:.0f} s)",
              flush=True)


if __name__ == "__main__":
    main()
