"""Constrained choice with the shared prompt prefix read once vs every prompt read whole, same prompts, one run.

    python benchmarks/shared_prefix.py                     # 60 scheduling prompts, base model, bf16, batches of 20
    python benchmarks/shared_prefix.py --rows 120 --fp32   # more prompts, fp32 weights

Run from the repository root after `make schedule` (it reads scheduling/models/base and scheduling/data/sft.jsonl;
the prompts are templated with the scheduling params' system message, as the evaluate_policy stage asks them).
Baseline: `generation.choose` with `min_shared_prefix` above any prompt's length, i.e. every prompt's tokens
computed in every batch. Contender: the default, where the tokens all prompts start with are computed once and
their KV cache continued by each batch. Prints both wall times (best of `--repeats`), the ratio, the shared length,
and how many choices agree (in bf16 the two differ in the last bits, so near-ties can flip); the CPU and threads
are printed with them.
"""

from __future__ import annotations

import argparse
import time

import common
import torch

from frugaltune.generation import _common_prefix_length, choose
from frugaltune.hardware import cpu_facts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    common.add_scheduling_arguments(parser)
    args = parser.parse_args()

    model, tokenizer, prompts, candidates = common.load_scheduling_prompts(args)
    choose(model, tokenizer, prompts[:4], candidates[:4], batch_size=4)  # warm-up

    timings: dict[str, float] = {}
    choices: dict[str, list[int]] = {}
    for _ in range(args.repeats):
        for name, floor in (("whole prompts", 10**9), ("shared prefix once", 8)):
            began = time.perf_counter()
            choices[name], _ = choose(model, tokenizer, prompts, candidates, batch_size=args.batch_size,
                                      min_shared_prefix=floor)
            timings[name] = min(timings.get(name, float("inf")), time.perf_counter() - began)
    whole, shared = timings["whole prompts"], timings["shared prefix once"]
    agree = sum(a == b for a, b in zip(choices["whole prompts"], choices["shared prefix once"]))
    print(f"{cpu_facts()['model']}, {torch.get_num_threads()} threads, {'fp32' if args.fp32 else 'bf16'} weights; "
          f"{len(prompts)} prompts of {sum(map(len, prompts)) / len(prompts):.0f} tokens on average, "
          f"{_common_prefix_length(prompts)} shared; batches of {args.batch_size}, best of {args.repeats}")
    print(f"  whole prompts       {whole:7.2f} s")
    print(f"  shared prefix once  {shared:7.2f} s   {whole / shared:.2f}x")
    print(f"  same choice on {agree}/{len(prompts)} prompts")


if __name__ == "__main__":
    main()
