"""Two trainings on one machine: the pipeline's LoRA training alone against two of it at once, rounds alternated.

    python benchmarks/shared_machine.py                       # 3 warm-up + 12 timed steps of 16, 2 rounds
    python benchmarks/shared_machine.py --steps 40 --rounds 3

Each training is train_throughput.py's `frugaltune:lora` recipe (the train stage's loop with the plan's precision,
threads and int8 decision, on `train.allocator`) in a process of its own. A round runs one alone, then two started
together; the rounds alternate, so a slow spell of a shared machine falls on both. Reported per round: each
process's useful tokens/s over its timed steps and over its whole run, the pair's total over the one alone's (the
bound: >= 0.8x), and the thread changes each process made (frugaltune.training.sharing: a thread less while the
other crowds the cores). Writes reports/benchmarks/shared_machine.json. Needs `models/base` and `data/tokenized`
(`make pipeline`). Nothing else should run meanwhile: the pair is the machine's load.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import threading
from pathlib import Path

import common

from frugaltune import allocator
from frugaltune.config import load_params
from frugaltune.hardware import probe

THROUGHPUT = Path(__file__).resolve().parent / "train_throughput.py"


def _rate(result: dict, whole: bool = False) -> float:
    if whole:
        return result["cold_useful_tokens"] / result["cold_seconds"]
    return result["useful_tokens"] / result["seconds"]


def _together(cmd: list[str], env: dict[str, str], count: int) -> list[dict]:
    """`count` copies of `cmd` started at once; their results."""
    results: list[dict] = [{}] * count

    def one(i: int) -> None:
        results[i] = common.run_child(cmd, f"training {i + 1} of {count}", env)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(count)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if any(not r for r in results):
        sys.exit("a training of the pair failed (its error is above)")
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=12, help="timed steps per training")
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps before them")
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    common.require(common.BASE, common.TOKENIZED, common.LABELS_FILE,
                   fix="run `make pipeline` (or `dvc repro tokenize`) first")
    decided = common.machine()
    cmd = [sys.executable, str(THROUGHPUT), "--recipe", "frugaltune:lora", "--steps", str(args.steps), "--warmup",
           str(args.warmup), "--batch-size", str(args.batch_size), "--threads", str(decided["threads"]),
           "--eager-max", str(decided["eager_attention_max_len"])] + (["--bf16-ours"] if decided["bf16"] else [])
    env = allocator.child_env(load_params().train.allocator)
    rounds = []
    for n in range(args.rounds):
        print(f"round {n + 1}/{args.rounds}: one alone ...", flush=True)
        alone = common.run_child(cmd, "the training alone", env)
        print(f"round {n + 1}/{args.rounds}: two at once ...", flush=True)
        pair = _together(cmd, env, 2)
        rounds.append({"alone": alone, "pair": pair,
                       "ratio": sum(_rate(r) for r in pair) / _rate(alone),
                       "ratio_whole_run": sum(_rate(r, True) for r in pair) / _rate(alone, True)})
    cpu = probe(use_nvml=False)["cpu"].get("model")
    print(f"\nThe pipeline's LoRA training ({args.warmup} warm-up + {args.steps} timed steps of {args.batch_size}, "
          f"{decided['threads']} threads planned, {'bf16' if decided['bf16'] else 'fp32'}), CPU {cpu}:")
    print(f"{'round':>5s} {'alone tok/s':>11s} {'pair tok/s (each)':>22s} {'pair / alone':>12s} "
          f"{'whole runs':>10s}  thread changes in the pair")
    for n, r in enumerate(rounds, 1):
        each = " + ".join(f"{_rate(p):.1f}" for p in r["pair"])
        changes = "; ".join(e for p in r["pair"] for e in p.get("events", []) if e.startswith("threads")) or "none"
        print(f"{n:5d} {_rate(r['alone']):11.1f} {each:>22s} {r['ratio']:11.2f}x {r['ratio_whole_run']:9.2f}x  "
              f"{changes}")
    median = statistics.median(r["ratio"] for r in rounds)
    print(f"\ntwo at once / one alone, total useful tokens/s: {median:.2f}x (median of {len(rounds)}; bound 0.8x)")
    common.write_results("shared_machine", {"cpu": cpu, "threads": decided["threads"], "bf16": decided["bf16"],
                                            "steps": args.steps, "warmup": args.warmup, "rounds": rounds,
                                            "ratio_median": median})


if __name__ == "__main__":
    main()
