"""Peak RSS and step time per method under three mallocs: how much of the peak is the allocator's?

    python benchmarks/memory_by_method.py                  # full, lora, qlora; 6 steps of the run's largest batch
    python benchmarks/memory_by_method.py --steps 10 --batch-size 16 --length 128 --allocators glibc mimalloc

Needs `models/base` (`make pipeline`). Each (method, allocator) trains `--steps` AdamW steps of the same random
batch (`--batch-size` x `--length`, the default run's largest micro-batch) in a fresh process and reports its
peak RSS (ru_maxrss) and median step time:

- glibc: malloc as every Python process has it (`train.allocator: system`). Freed activation memory stays in
  the heap and is reused imperfectly, so RSS grows over the first steps (fragmentation), more when allocations
  interleave (QLoRA dequantizes every 4-bit weight in every forward and backward).
- lean: glibc with `mallopt(M_MMAP_THRESHOLD, 1 MiB)` before torch allocates anything: every tensor over 1 MiB
  gets its own mapping, returned to the OS when freed. RSS follows the live tensors; the price is page faults.
- mimalloc: preloaded with purging off, as `train.allocator: auto` runs training (frugaltune/allocator.py).

glibc minus lean is what glibc's heap keeps; the lean column orders the methods by what they really hold (QLoRA's
4-bit weights, LoRA's fp32 weights, full fine-tuning's gradients and AdamW states).
"""

from __future__ import annotations

import argparse
import ctypes
import json
import sys

import common
from common import BASE

M_MMAP_THRESHOLD = -3


ALLOCATORS = ("glibc", "lean", "mimalloc")


def measure(method: str, lean: bool, steps: int, batch: int, length: int) -> dict:
    if lean:  # before torch is imported: every later large allocation is a private mapping
        ctypes.CDLL("libc.so.6").mallopt(M_MMAP_THRESHOLD, 1 << 20)
    from frugaltune import allocator
    import resource
    import statistics
    import time

    import torch

    from frugaltune import methods
    from frugaltune.planner.memory import MethodKnobs
    from frugaltune.training.methods import prepare_model

    torch.set_num_threads(common.machine()["threads"])  # the plan's, as the train stage reads them
    model = prepare_model(BASE, ["negative", "neutral", "positive"], 2, 42, methods.get(method), MethodKnobs())
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(3, model.config.vocab_size, (batch, length), generator=generator)
    labels = torch.randint(0, 3, (batch,), generator=generator)
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=1e-5)
    model.train()
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        model(input_ids=ids, attention_mask=torch.ones_like(ids), labels=labels).loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        times.append(time.perf_counter() - start)
    return {"peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
            "median_step_s": statistics.median(times[1:] or times), "first_step_s": times[0],
            "malloc": allocator.active()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--methods", nargs="+", default=["full", "lora", "qlora"])
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--length", type=int, default=128)
    parser.add_argument("--allocators", nargs="+", default=list(ALLOCATORS), choices=ALLOCATORS)
    parser.add_argument("--child", nargs=2, help=argparse.SUPPRESS)  # METHOD ALLOCATOR
    args = parser.parse_args()
    if args.child:
        print(json.dumps(measure(args.child[0], args.child[1] == "lean", args.steps, args.batch_size, args.length)))
        return
    common.require(BASE)
    from frugaltune import allocator

    rows = {}
    for method in args.methods:
        for name in args.allocators:
            print(f"{method} / {name} ...", flush=True)
            env = allocator.child_env("mimalloc" if name == "mimalloc" else "system")
            rows[(method, name)] = common.run_child(
                [sys.executable, __file__, "--child", method, name, "--steps", str(args.steps), "--batch-size",
                 str(args.batch_size), "--length", str(args.length)], f"{method}/{name}", env)
    print(f"\n{args.steps} steps of {args.batch_size} x {args.length} tokens, {common.machine()['threads']} threads; "
          f"peak RSS MB / median step s (first step s)\n")
    print(f"{'method':8s} " + " ".join(f"{name:>24s}" for name in args.allocators))
    for method in args.methods:
        cells = [rows[(method, name)] for name in args.allocators]
        print(f"{method:8s} " + " ".join(
            f"{c['peak_rss_mb']:8.0f} MB {c['median_step_s']:5.2f} s ({c['first_step_s']:5.1f})" for c in cells))
    if "glibc" in args.allocators:
        for name in (n for n in args.allocators if n != "glibc"):
            ratios = [rows[(m, name)]["median_step_s"] / rows[(m, "glibc")]["median_step_s"] for m in args.methods]
            print(f"{name}: step time {', '.join(f'{m} {r:.2f}x' for m, r in zip(args.methods, ratios))} of glibc")
    common.write_results("memory_by_method", {f"{m}/{a}": r for (m, a), r in rows.items()})


if __name__ == "__main__":
    main()
