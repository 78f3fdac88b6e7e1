"""A federated client's rounds on glibc's malloc against mimalloc (what the train stage and the planner's calibration
run on, and, since 2026-11-27, every process of the stage's federations: `train.allocator`), in the same run.

    python benchmarks/federated_allocator.py                      # 10 client-rounds + 2 server evaluations each
    python benchmarks/federated_allocator.py --client-rounds 20 --order mimalloc system

Run from the repository root after `make federated` (it reads data/federated/partitions_dirichlet/, the clients'
plans in reports/federated.json, data/federated/test.parquet and models/base). Each allocator gets its own child
process (frugaltune.allocator.child_env: LD_PRELOAD added or removed), which does what one simulation worker does:
builds the model once per LoRA rank, then for each client-round reads the client's rows and trains its planned local
steps at its micro-batch (federated.batch_size, lr; the plan's precision, read as the stage reads it:
frugaltune.resolve) on the worker's model of its rank (no server: no tensors are exchanged), and every fifth
client-round evaluates the server's test split. It reports per allocator the mean seconds of a client-round and of
an evaluation, user and system CPU seconds, and peak RSS, and the ratios mimalloc / system.
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DATA = Path("data/federated")  # the federated stage's partitions and test split


def child(args: argparse.Namespace) -> dict:
    import torch

    from frugaltune import allocator, paths, resolve
    from frugaltune.config import load_params
    from frugaltune.federated import local
    from frugaltune.io import read_json
    from frugaltune.models import pad_token_id
    from frugaltune.training.loop import peak_rss_mb

    params = load_params()
    fp = params.federated
    torch.set_num_threads(fp.threads)
    labels = read_json(paths.LABELS)["labels"]
    pad = pad_token_id(paths.BASE_MODEL)
    decided = resolve.machine(fp.precision, plan=resolve.read_plan())  # the plan's, as the stage's clients read it
    bf16, eager = bool(decided["bf16"]), int(decided["eager_attention_max_len"])
    plans = [p for p in read_json(paths.report("federated"))["clients"]["dirichlet"] if p["fits"]]
    spec = local.LoraSpec(fp.lora.r, fp.lora.alpha, fp.lora.dropout, tuple(fp.lora.target_modules))
    models: dict[int, torch.nn.Module] = {}
    test_ids, test_targets = local.read_examples(DATA / "test.parquet")
    rounds, evaluations = [], []
    for index in range(args.client_rounds):
        plan = plans[index % len(plans)]
        began = time.perf_counter()
        rank = plan["lora_rank"]
        if rank not in models:  # a worker builds a rank's model once (client_app.cached_model)
            models[rank] = local.build_model(paths.BASE_MODEL, labels, pad, params.common.seed, spec, rank, bf16)
        model = models[rank]
        ids, targets = local.read_examples(DATA / "partitions_dirichlet" / f"client_{plan['client']}.parquet")
        local.train_locally(model, ids, targets, pad, steps=plan["local_steps"], lr=fp.lr, batch_size=fp.batch_size,
                            micro_batch_size=plan["micro_batch_size"], seed=index, bf16=bf16,
                            eager_attention_max_len=eager, logit_adjustment=fp.logit_adjustment)
        rounds.append(time.perf_counter() - began)
        if (index + 1) % 5 == 0:
            began = time.perf_counter()
            local.evaluate(model, test_ids, test_targets, labels, pad, bf16=bf16)
            evaluations.append(time.perf_counter() - began)
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return {"allocator": allocator.active(), "client_round_s": rounds, "evaluation_s": evaluations,
            "user_s": usage.ru_utime, "sys_s": usage.ru_stime, "peak_rss_mb": round(peak_rss_mb())}


def mean(values: list[float]) -> float:
    return sum(values) / max(len(values), 1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--client-rounds", type=int, default=10)
    parser.add_argument("--order", nargs="+", default=["system", "mimalloc"], choices=["system", "mimalloc"])
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(child(args)))
        return
    from frugaltune import allocator

    results = {}
    for choice in args.order:
        env = allocator.child_env(choice)
        proc = subprocess.run([sys.executable, __file__, "--child", "--client-rounds", str(args.client_rounds)],
                              cwd=ROOT, env=env, capture_output=True, text=True)
        if proc.returncode:
            raise SystemExit(f"{choice}: the child failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
        result = json.loads(proc.stdout.strip().splitlines()[-1])
        if result["allocator"] != choice:
            raise SystemExit(f"asked for {choice}, the child ran on {result['allocator']}")
        results[choice] = result
        rounds, evals = result["client_round_s"], result["evaluation_s"]
        print(f"{choice:8s}: client-round {mean(rounds):6.2f} s (first {rounds[0]:.2f}, last "
              f"{rounds[-1]:.2f}), evaluation {mean(evals):6.2f} s, CPU user "
              f"{result['user_s']:.0f} s sys {result['sys_s']:.0f} s, peak RSS {result['peak_rss_mb']} MB",
              flush=True)
    if {"system", "mimalloc"} <= results.keys():
        base, other = results["system"], results["mimalloc"]
        print(f"mimalloc / system: client-round {mean(other['client_round_s']) / mean(base['client_round_s']):.3f}x, "
              f"evaluation {mean(other['evaluation_s']) / max(mean(base['evaluation_s']), 1e-9):.3f}x, "
              f"sys CPU {other['sys_s'] / max(base['sys_s'], 1e-9):.3f}x, "
              f"peak RSS {other['peak_rss_mb'] / base['peak_rss_mb']:.3f}x")
    print(json.dumps(results))


if __name__ == "__main__":
    main()
