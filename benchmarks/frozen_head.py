"""The LM head on the last position of a frozen model: torch.matmul's copy of the weight vs a contiguous input.

    python benchmarks/frozen_head.py            # 60 scheduling prompts, base model in bf16, frozen, batches of 20
    python benchmarks/frozen_head.py --fp32

Run from the repository root after `make schedule` (reads scheduling/models/base and scheduling/data/sft.jsonl).
Two measurements, each baseline and contender in the same run:
1. The operation alone: `F.linear(hidden[:, -1:, :], W)` for SmolLM2's 49,152 x 576 head and 20 rows, W frozen
   (requires_grad False) vs trainable, and with the input made contiguous.
2. `generation.choose` on a frozen model (every parameter requires_grad False, as in a merged or PEFT-loaded
   model), baseline without `generation.contiguous_head_input` (replaced by a no-op), contender as shipped.
Prints wall times (best of `--repeats`), ratios, and whether the choices agree; the CPU and threads with them.
"""

from __future__ import annotations

import argparse
import contextlib

import common
import torch

from frugaltune import generation
from frugaltune.hardware import cpu_facts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    common.add_scheduling_arguments(parser)
    args = parser.parse_args()
    dtype = torch.float32 if args.fp32 else torch.bfloat16
    print(f"{cpu_facts()['model']}, {torch.get_num_threads()} threads, {'fp32' if args.fp32 else 'bf16'}")

    hidden = torch.randn(args.batch_size, 200, 576, dtype=dtype)[:, -1:, :]
    for frozen in (False, True):
        weight = torch.nn.Parameter(torch.randn(49152, 576, dtype=dtype), requires_grad=not frozen)
        with torch.inference_mode():  # as choose and generate run; the weight is made outside, as a model's is
            sliced = common.best_of(args.repeats, lambda: torch.nn.functional.linear(hidden, weight))
            contiguous = common.best_of(args.repeats, lambda: torch.nn.functional.linear(hidden.contiguous(), weight))
        print(f"  head {args.batch_size} x 576 -> 49,152, weight {'frozen   ' if frozen else 'trainable'}: "
              f"sliced input {sliced * 1e3:8.1f} ms, contiguous {contiguous * 1e3:6.1f} ms   "
              f"{sliced / contiguous:.1f}x")

    model, tokenizer, prompts, candidates = common.load_scheduling_prompts(args)
    model.requires_grad_(False)  # frozen, as a merged adapter's model is
    shipped = generation.contiguous_head_input
    choices: dict[str, list[int]] = {}

    def run(name: str) -> None:
        choices[name] = generation.choose(model, tokenizer, prompts, candidates, batch_size=args.batch_size)[0]

    try:
        generation.contiguous_head_input = lambda model: contextlib.nullcontext()
        baseline = common.best_of(args.repeats, lambda: run("baseline"))
    finally:
        generation.contiguous_head_input = shipped
    contender = common.best_of(args.repeats, lambda: run("contender"))
    agree = sum(a == b for a, b in zip(choices["baseline"], choices["contender"]))
    print(f"  choose, {len(prompts)} prompts, frozen model: as before {baseline:6.2f} s, contiguous head input "
          f"{contender:6.2f} s   {baseline / contender:.2f}x; same choice on {agree}/{len(prompts)}")


if __name__ == "__main__":
    main()
