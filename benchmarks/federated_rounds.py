"""Federated settings compared on the federated stage's own partitions, in one process, in one run, beside
centralized LoRA on as many examples.

    python benchmarks/federated_rounds.py                                  # the params.yaml federation
    python benchmarks/federated_rounds.py --server-lr 1 3                  # server learning rates (1 = FedAvg)
    python benchmarks/federated_rounds.py --lr 0.002 --local-steps 16 --rounds 10 --centralized
    python benchmarks/federated_rounds.py --scheme iid --method ffa
    python benchmarks/federated_rounds.py --server-momentum 0 0.5 0.7      # FedAvgM against FedAvg
    python benchmarks/federated_rounds.py --lr 0.004 --lr-schedule linear
    python benchmarks/federated_rounds.py --seeds 42 1 2 --centralized        # the gap over seeds, not one
    python benchmarks/federated_rounds.py --transmit-dtype bf16               # bf16 on the wire's accuracy cost
    .venv-flower/bin/python benchmarks/federated_rounds.py --dp-epsilon 10    # client DP's accuracy cost

Run from the repository root after `make federated` (it reads data/federated/partitions_<scheme>/, the clients'
plans in reports/federated.json, data/federated/test.parquet, models/base and reports/plan.json). It makes the
rounds the ServerApp makes with the same library calls (local.build_model at each client's planned rank,
aggregation.slice_to_rank, local.train_locally at aggregation.round_lr, aggregation.aggregate,
aggregation.server_momentum_step) but without Flower: clients run one after the other in this process, sampled
as the ServerApp samples them (the same positions in client-id order), with no per-client micro-batch. Its
figures compare settings with each other (the first server lr and momentum given are the baseline). Prints the
test macro-F1 after each round, and with --centralized the centralized baseline the stage computes
(stages/federated.py: one process, the whole training split, as many examples as the clients trained on, same lr
and batch, the train stage's schedule), and the CPU, threads and precision.
Every flag left out takes its params.yaml `federated` value; --precision auto takes the plan's. --seeds runs the
whole comparison once per seed (model and adapter initialisation, batch order, the clients sampled; the partitions
stay the stage's, drawn with common.seed) and, with --centralized, prints each seed's gap and their mean and spread.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout's frugaltune, not an installed one

import torch  # noqa: E402

from frugaltune.config import load_params  # noqa: E402
from frugaltune.federated import aggregation, local, wire  # noqa: E402
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
    parser.add_argument("--server-momentum", type=float, nargs="+", default=None,
                        help="FedAvgM's momentum (0 = none); with several server lrs, every pair is run")
    parser.add_argument("--lr-schedule", choices=["constant", "linear", "cosine"], default=None,
                        help="the clients' lr across rounds (aggregation.round_lr)")
    parser.add_argument("--transmit-dtype", choices=["fp32", "bf16"], default=None,
                        help="bf16: the global and the replies rounded as bf16 on the wire (wire.round_trip)")
    parser.add_argument("--dp-epsilon", type=float, default=None,
                        help="> 0: each reply clipped to federated.dp.clipping_norm and noised for this epsilon "
                             "(privacy.privatize; needs flwr: run with .venv-flower/bin/python); 0 = off")
    parser.add_argument("--seeds", type=int, nargs="+", default=None,
                        help="training seeds, each a whole run (default: common.seed)")
    parser.add_argument("--centralized", action="store_true", help="also the stage's centralized baseline")
    parser.add_argument("--centralized-lr", type=float, default=None, help="its lr (default: the clients' lr)")
    parser.add_argument("--logit-adjustment", choices=["on", "off", "params"], default="params",
                        help="clients add log(label prior) to the logits they train on (local.train_locally)")
    args = parser.parse_args()

    params = load_params()
    fp = params.federated
    lr = args.lr if args.lr is not None else fp.lr
    local_steps = args.local_steps or fp.local_steps
    rounds = args.rounds or fp.num_rounds
    server_lrs = args.server_lr or [fp.server_lr]
    momenta = args.server_momentum if args.server_momentum is not None else [getattr(fp, "server_momentum", 0.0)]
    schedule = args.lr_schedule or getattr(fp, "lr_schedule", "constant")
    dtype = args.transmit_dtype or fp.transmit_dtype
    epsilon = args.dp_epsilon if args.dp_epsilon is not None else (fp.dp.epsilon if fp.dp.enabled else 0.0)
    if epsilon > 0:
        from frugaltune.federated.privacy import privatize  # imports flwr
    adjust = (getattr(fp, "logit_adjustment", False) if args.logit_adjustment == "params"
              else args.logit_adjustment == "on")
    plan_run = json.loads(Path("reports/plan.json").read_text()).get("run", {})
    bf16 = plan_run.get("precision") == "bf16" if args.precision == "auto" else args.precision == "bf16"
    eager = int(plan_run.get("eager_attention_max_len", 0))
    labels = json.loads(Path("data/splits/labels.json").read_text())["labels"]
    plans = sorted((plan for plan in json.loads(Path("reports/federated.json").read_text())["clients"][args.scheme]
                    if plan["fits"]), key=lambda plan: plan["client"])
    pad = json.loads(Path("models/base/config.json").read_text()).get("pad_token_id")
    pad = pad if pad is not None else load_tokenizer("models/base").pad_token_id
    spec = local.LoraSpec(fp.lora.r, fp.lora.alpha, fp.lora.dropout, tuple(fp.lora.target_modules))
    test = local.read_examples("data/federated/test.parquet")
    data = {plan["client"]: local.read_examples(f"data/federated/partitions_{args.scheme}/client_{plan['client']}"
                                                ".parquet") for plan in plans}
    per_round = max(fp.min_completed, math.ceil(fp.fraction * len(plans)))
    ids = {index: plan["client"] for index, plan in enumerate(plans)}  # plans are in client-id order
    print(f"{cpu_facts()['model']}, {torch.get_num_threads()} threads, {'bf16' if bf16 else 'fp32'}; "
          f"{args.scheme}/{args.method}, {rounds} rounds, {per_round} of {len(plans)} clients x {local_steps} "
          f"steps of {fp.batch_size}, lr {lr} ({schedule} over rounds), logit adjustment "
          f"{'on' if adjust else 'off'}, {dtype} on the wire, DP epsilon {epsilon:g}", flush=True)
    gaps: dict[str, list[float]] = {}
    for seed in args.seeds or [params.common.seed]:
        print(f"seed {seed}", flush=True)
        models: dict[int, torch.nn.Module] = {}  # one per rank, reloaded with each client's slice of the global
        server = local.build_model("models/base", labels, pad, seed, spec)
        start = local.trainable_tensors(server)
        finals: dict[str, float] = {}
        for server_lr, momentum in [(s, m) for s in server_lrs for m in momenta]:
            setting = f"server_lr {server_lr:g}, momentum {momentum:g}"
            began, tensors, curve, steps, velocity = time.perf_counter(), dict(start), [], 0, None
            for number in range(1, rounds + 1):
                sampled = aggregation.sample_clients(range(len(plans)), ids, per_round, seed, number)  # the ServerApp's
                updates, round_lr = [], aggregation.round_lr(lr, number, rounds, schedule)
                tensors = wire.round_trip(tensors, dtype) if dtype != "fp32" else tensors  # what the clients receive
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
                    result = local.train_locally(model, input_ids, targets, pad, steps=local_steps, lr=round_lr,
                                                 batch_size=fp.batch_size, micro_batch_size=None,
                                                 seed=seed * 1000 + number, bf16=bf16, eager_attention_max_len=eager,
                                                 logit_adjustment=adjust)
                    steps += result.steps
                    trained = local.trainable_tensors(model)  # under FFA: B + head only
                    if epsilon > 0:
                        trained, _ = privatize(trained, aggregation.slice_to_rank(tensors, plan["lora_rank"]),
                                               fp.dp.clipping_norm, epsilon, fp.dp.delta)
                    updates.append((wire.round_trip(trained, dtype) if dtype != "fp32" else trained, len(targets)))
                tensors, velocity = aggregation.server_momentum_step(
                    tensors, aggregation.aggregate(tensors, updates, args.method), server_lr, momentum, velocity)
                local.load_tensors(server, tensors)
                curve.append(local.evaluate(server, *test, labels, pad, bf16=bf16)["macro_f1"])
                print(f"  {setting}, round {number}: test macro-F1 {curve[-1]:.4f} "
                      f"({time.perf_counter() - began:.0f} s)", flush=True)
            finals[setting] = curve[-1]
            print(f"  {setting}: test macro-F1 per round "
                  f"{' / '.join(f'{v:.3f}' for v in curve)} ({time.perf_counter() - began:.0f} s, {steps} client steps "
                  f"= {steps * fp.batch_size} examples)", flush=True)
        if args.centralized:
            began = time.perf_counter()
            model = local.build_model("models/base", labels, pad, seed, spec)
            input_ids, targets = local.read_examples("data/federated/train.parquet")
            central_lr = args.centralized_lr or lr
            local.train_locally(model, input_ids, targets, pad, steps=steps, lr=central_lr, batch_size=fp.batch_size,
                                micro_batch_size=None, seed=seed, bf16=bf16, eager_attention_max_len=eager,
                                scheduler=params.train.scheduler, warmup_ratio=params.train.warmup_ratio)
            final = local.evaluate(model, *test, labels, pad, bf16=bf16)
            print(f"  centralized, lr {central_lr}, {params.train.scheduler} schedule, {steps} steps of "
                  f"{fp.batch_size} ({steps * fp.batch_size} examples of {len(targets)} rows): test macro-F1 {final['macro_f1']:.4f} "
                  f"({time.perf_counter() - began:.0f} s)",
                  flush=True)
            for setting, value in finals.items():
                gaps.setdefault(setting, []).append(final["macro_f1"] - value)
                print(f"  {setting}: gap to centralized {final['macro_f1'] - value:.4f}", flush=True)
    for setting, values in gaps.items():
        mean = sum(values) / len(values)
        spread = (sum((v - mean) ** 2 for v in values) / (len(values) - 1)) ** 0.5 if len(values) > 1 else 0.0
        print(f"{setting}: gap to centralized over {len(values)} seeds {' / '.join(f'{v:.4f}' for v in values)}; "
              f"mean {mean:.4f}, sd {spread:.4f}", flush=True)


if __name__ == "__main__":
    main()
