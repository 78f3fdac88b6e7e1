"""Federated settings compared on the federated stage's own partitions, in one process, in one run, beside
centralized LoRA on as many examples.

    python benchmarks/federated_rounds.py                                  # the params.yaml federation
    python benchmarks/federated_rounds.py --server-lr 1 3                  # server learning rates (1 = FedAvg)
    python benchmarks/federated_rounds.py --lr 0.002 --local-steps 16 --rounds 10 --centralized
    python benchmarks/federated_rounds.py --scheme iid --method ffa
    python benchmarks/federated_rounds.py --server-momentum 0 0.5 0.7      # FedAvgM against FedAvg
    python benchmarks/federated_rounds.py --lr 0.004 --lr-schedule linear
    python benchmarks/federated_rounds.py --seeds 42 1 2 --centralized        # the gap over seeds, not one
    python benchmarks/federated_rounds.py --seeds 42 1 2 --fraction 1         # every client in every round
    python benchmarks/federated_rounds.py --transmit-dtype bf16               # bf16 on the wire's accuracy cost
    python benchmarks/federated_rounds.py --proximal-mu 0.1 1                 # FedProx's accuracy effect
    python benchmarks/federated_rounds.py --seeds 42 1 2 --rounds 5 --head-lr 0 0.004 --centralized  # head's rate
    python benchmarks/federated_rounds.py --seeds 1 2 --batch-size 4 --local-steps 32   # more steps, same examples
    python benchmarks/federated_rounds.py --seeds 1 2 --only-centralized --batch-size 4 --local-steps 32
    .venv-flower/bin/python benchmarks/federated_rounds.py --dp-epsilon 10    # client DP's accuracy cost

Run from the repository root after `make federated` (it reads data/federated/partitions_<scheme>/, the clients'
plans in reports/federated.json, data/federated/test.parquet, models/base and reports/plan.json). It makes the
rounds the ServerApp makes with the same library calls (each client's round is the ClientApp's own,
local.train_round on local.cached_model at its planned rank with RunSettings.for_round's settings; the server's
aggregation.aggregate and aggregation.server_momentum_step) but without Flower: clients run one after the other
in this process, sampled as the ServerApp samples them (the same positions in client-id order), with no
per-client micro-batch. Its
figures compare settings with each other (the first server lr and momentum given are the baseline). Prints the
test macro-F1 after each round, and with --centralized the centralized baseline the stage computes (the stage's
own, frugaltune.federated.centralized.baseline: one process, the whole training split, as many examples as the
clients trained on, the federation's LoRA, the train stage's lr, head lr, batch and schedule), and the CPU, threads
and precision. Every flag left out takes its params.yaml `federated` value, read through the same typed settings the
stage gives Flower (frugaltune.federated.settings.RunSettings, from federation.run_settings); --precision auto takes
the plan's, and the clients and the reference train with the plan's int8 products for LoRA as the stage's do
(frugaltune.federated.plans.machine_precision; --int8-products false trains without them).
--seeds runs the whole comparison once per seed (model and adapter initialisation, batch order, the clients sampled;
the partitions stay the stage's, drawn with common.seed) and, with --centralized, prints each seed's gap and their
mean and spread.
--batch-size B --local-steps K changes the clients' batch and steps (the centralized baseline keeps as many
examples; --centralized-lr, --centralized-head-lr and --centralized-batch-size change its recipe, e.g. `0.002 0.002 8`
for the clients' settings it trained with until 2026-11-26; --only-centralized runs the baseline alone). --client-state
kept lets each client continue AdamW's moments and step count from its previous round instead of starting a fresh
optimizer every round (`federated.client_state`, train_locally's `optimizer_state`). SCAFFOLD's control variates,
FedAdam / FedYogi on the server, the head averaged per label and an EMA of the globals were measured here and lost
(docs/DECISIONS.md); they were deleted, and git history has them.
"""

from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path

import torch

from frugaltune import paths
from frugaltune.config import load_params
from frugaltune.federated import aggregation, federation, local, wire
from frugaltune.federated.centralized import baseline as centralized_baseline
from frugaltune.federated.plans import machine_precision
from frugaltune.hardware import cpu_facts
from frugaltune.io import read_json
from frugaltune.models import pad_token_id

def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--scheme", default="dirichlet", help="a partition the federated stage wrote")
    parser.add_argument("--method", default="fedavg", choices=["fedavg", "ffa"])
    parser.add_argument("--server-lr", type=float, nargs="+", default=None)
    parser.add_argument("--lr", type=float, default=None, help="the clients' learning rate")
    parser.add_argument("--head-lr", type=float, nargs="+", default=None,
                        help="the clients' head rates to compare (0 = the clients' lr; default: federated.head_lr)")
    parser.add_argument("--local-steps", type=int, default=None)
    parser.add_argument("--rounds", type=int, default=None)
    parser.add_argument("--fraction", type=float, default=None,
                        help="the share of clients sampled per round (federated.fraction; 1 = every client)")
    parser.add_argument("--batch-size", type=int, default=None,
                        help="the clients' batch")
    parser.add_argument("--precision", choices=["auto", "fp32", "bf16"], default="auto")
    parser.add_argument("--int8-products", choices=["auto", "true", "false"], default=None,
                        help="the clients' and the reference's int8 products (train.int8_products; default: params)")
    parser.add_argument("--server-momentum", type=float, nargs="+", default=None,
                        help="FedAvgM's momentum (0 = none); with several server lrs, every pair is run")
    parser.add_argument("--lr-schedule", choices=["constant", "linear", "cosine"], default=None,
                        help="the clients' lr across rounds (aggregation.round_lr)")
    parser.add_argument("--transmit-dtype", choices=["fp32", "bf16"], default=None,
                        help="bf16: the global and the replies rounded as bf16 on the wire (wire.round_trip)")
    parser.add_argument("--dp-epsilon", type=float, default=None,
                        help="> 0: each reply clipped to federated.dp.clipping_norm and noised for this epsilon "
                             "(privacy.privatize; needs flwr: run with .venv-flower/bin/python); 0 = off")
    parser.add_argument("--proximal-mu", type=float, nargs="+", default=None,
                        help="FedProx's mu for the clients (0 = off), each a setting with every server setting")
    parser.add_argument("--seeds", type=int, nargs="+", default=None,
                        help="training seeds, each a whole run (default: common.seed)")
    parser.add_argument("--centralized", action="store_true", help="also the stage's centralized baseline")
    parser.add_argument("--centralized-lr", type=float, default=None, help="its lr (default: train.lr)")
    parser.add_argument("--centralized-head-lr", type=float, default=None,
                        help="its head's lr (default: train.head_lr)")
    parser.add_argument("--client-state", choices=["fresh", "kept"], default=None,
                        help="kept: each client continues AdamW's moments from its previous round")
    parser.add_argument("--only-centralized", action="store_true",
                        help="skip the federations: the baseline alone, on the examples they would train on")
    parser.add_argument("--centralized-batch-size", type=int, default=None,
                        help="its batch (default: train.batch_size); its steps cover as many examples as theirs")
    parser.add_argument("--logit-adjustment", choices=["on", "off", "params"], default="params",
                        help="clients add log(label prior) to the logits they train on (local.train_locally)")
    args = parser.parse_args()

    params = load_params()
    fp = params.federated
    # a flag left out keeps params.yaml's value; the overrides go through the params, then through the same
    # typed settings the stage gives Flower (federation.run_settings), which this benchmark reads from
    override = {key: value for key, value in (
        ("lr", args.lr), ("local_steps", args.local_steps), ("num_rounds", args.rounds), ("batch_size", args.batch_size),
        ("fraction", args.fraction), ("client_state", args.client_state), ("lr_schedule", args.lr_schedule),
        ("transmit_dtype", args.transmit_dtype)) if value is not None}
    if args.logit_adjustment != "params":
        override["logit_adjustment"] = args.logit_adjustment == "on"
    if args.dp_epsilon is not None:
        override["dp"] = fp.dp.model_copy(update={"enabled": args.dp_epsilon > 0,
                                                  "epsilon": args.dp_epsilon or fp.dp.epsilon})
    override["precision"] = args.precision
    train = {"int8_products": {"true": True, "false": False}.get(args.int8_products, args.int8_products)} \
        if args.int8_products else {}
    params = params.model_copy(update={"federated": fp.model_copy(update=override),
                                       "train": params.train.model_copy(update=train)})
    precision = machine_precision(params)  # the plan's, as the stage's clients
    bf16, eager = precision.bf16, precision.eager
    labels = read_json(paths.LABELS)["labels"]
    plans = sorted((plan for plan in json.loads(Path("reports/federated.json").read_text())["clients"][args.scheme]
                    if plan["fits"]), key=lambda plan: plan["client"])
    pad = pad_token_id(paths.BASE_MODEL)
    settings = federation.run_settings(params, args.method, Path("checkpoints/federated/benchmark"), plans, labels,
                                       pad, precision)
    lr, local_steps, rounds, batch = settings.lr, settings.local_steps, settings.num_rounds, settings.batch_size
    client_state, schedule, dtype = settings.client_state, settings.lr_schedule, settings.transmit_dtype
    epsilon, adjust, spec = settings.dp_epsilon, settings.logit_adjustment, settings.lora()
    server_lrs = args.server_lr or [settings.server_lr]
    momenta = args.server_momentum if args.server_momentum is not None else [settings.server_momentum]
    servers = [(s, m) for s in server_lrs for m in momenta]
    mus = args.proximal_mu if args.proximal_mu is not None else [settings.proximal_mu]
    heads = args.head_lr if args.head_lr is not None else [settings.head_lr]
    test = local.read_examples("data/federated/test.parquet")
    data = {plan["client"]: local.read_examples(f"data/federated/partitions_{args.scheme}/client_{plan['client']}"
                                                ".parquet") for plan in plans}
    per_round = max(settings.min_completed, math.ceil(settings.fraction * len(plans)))
    ids = {index: plan["client"] for index, plan in enumerate(plans)}  # plans are in client-id order
    print(f"{cpu_facts()['model']}, {torch.get_num_threads()} threads, {'bf16' if bf16 else 'fp32'}"
          f"{', int8 products' if precision.int8 else ''}; "
          f"{args.scheme}/{args.method}, {rounds} rounds, {per_round} of {len(plans)} clients x {local_steps} "
          f"steps of {batch}, lr {lr} ({schedule} over rounds), logit adjustment "
          f"{'on' if adjust else 'off'}, {dtype} on the wire, DP epsilon {epsilon:g}", flush=True)
    gaps: dict[str, list[float]] = {}
    for seed in args.seeds or [params.common.seed]:
        print(f"seed {seed}", flush=True)
        server = local.build_model("models/base", labels, pad, seed, spec, bf16=bf16)
        start = local.trainable_tensors(server)
        finals: dict[str, float] = {}
        planned = [] if args.only_centralized else [(server, mu, head) for server in servers for mu in mus
                                                    for head in heads]
        steps = rounds * per_round * local_steps  # replaced by what each federation trained
        for (server_lr, momentum), mu, head_lr in planned:
            setting = f"server_lr {server_lr:g}, momentum {momentum:g}" + (f", FedProx mu {mu:g}" if mu else "")
            setting += ", client AdamW state kept" if client_state == "kept" else ""
            setting += f", head lr {head_lr:g}" if args.head_lr is not None else ""
            # its rounds' settings (RunSettings.for_round), as the ServerApp sends them
            run = settings.model_copy(update={"head_lr": head_lr, "seed": seed, "proximal_mu": mu})
            began, tensors, curve, steps, velocity = time.perf_counter(), dict(start), [], 0, None
            moments = {}
            for number in range(1, rounds + 1):
                sampled = aggregation.sample_clients(range(len(plans)), ids, per_round, seed, number)  # the ServerApp's
                updates, given = [], run.for_round(number)
                tensors = wire.round_trip(tensors, dtype) if dtype != "fp32" else tensors  # what the clients receive
                for index in sampled:  # each client's round as the ClientApp runs it (local.train_round)
                    plan = plans[index]
                    model, _ = local.cached_model("models/base", labels, pad, seed, spec, plan["lora_rank"],
                                                  bf16, precision.int8)
                    input_ids, targets = data[plan["client"]]
                    trained, result, _ = local.train_round(
                        model, tensors, plan["lora_rank"], given, input_ids, targets, bf16=bf16,
                        eager_attention_max_len=eager,
                        optimizer_state=moments.setdefault(plan["client"], {}) if client_state == "kept" else None)
                    steps += result.steps
                    updates.append((wire.round_trip(trained, dtype) if dtype != "fp32" else trained, len(targets)))
                mean = aggregation.aggregate(tensors, updates, args.method)
                tensors, velocity = aggregation.server_momentum_step(tensors, mean, server_lr, momentum, velocity)
                local.load_tensors(server, tensors)
                evaluating = time.perf_counter()
                curve.append(local.evaluate(server, *test, labels, pad, bf16=bf16)["macro_f1"])
                print(f"  {setting}, round {number}: test macro-F1 {curve[-1]:.4f} "
                      f"({time.perf_counter() - began:.0f} s so far; this round's evaluation of {len(test[1])} test "
                      f"rows {time.perf_counter() - evaluating:.1f} s)", flush=True)
            finals[setting] = curve[-1]
            print(f"  {setting}: test macro-F1 per round "
                  f"{' / '.join(f'{v:.3f}' for v in curve)} ({time.perf_counter() - began:.0f} s, {steps} client steps "
                  f"= {steps * batch} examples)", flush=True)
        if args.centralized or args.only_centralized:
            recipe = {key: value for key, value in (("lr", args.centralized_lr), ("head_lr", args.centralized_head_lr),
                                                    ("batch_size", args.centralized_batch_size)) if value is not None}
            central = centralized_baseline(
                params.model_copy(update={"train": params.train.model_copy(update=recipe)}), labels, pad,
                steps * batch, seed=seed, precision=precision)  # as many examples as the clients saw
            final = central["final"]
            print(f"  centralized, lr {central['lr']} (head {central['head_lr']}), {central['scheduler']} schedule, "
                  f"{central['steps']} steps of {central['batch_size']} ({central['examples']} examples of "
                  f"{central['training_rows']} rows): test macro-F1 {final['macro_f1']:.4f} "
                  f"({central['train_seconds']:.0f} s training)", flush=True)
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
