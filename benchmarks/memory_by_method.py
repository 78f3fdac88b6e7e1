"""Peak RSS per method, with glibc's default allocator and with a lean one: how much of the peak is fragmentation?

    python benchmarks/memory_by_method.py                  # full, lora, qlora; 6 steps of the run's largest batch
    python benchmarks/memory_by_method.py --steps 10 --batch-size 16 --length 128

Needs `models/base` (`make pipeline`). Each (method, allocator) trains `--steps` AdamW steps of the same random
batch (`--batch-size` x `--length`, the default run's largest micro-batch) in a fresh process and reports its
peak RSS (ru_maxrss) and median step time:

- default: glibc malloc as every Python process has it. Freed activation memory stays in the heap and is reused
  imperfectly, so RSS grows over the first steps (fragmentation), more when allocations interleave (QLoRA
  dequantizes every 4-bit weight in every forward and backward).
- lean: `mallopt(M_MMAP_THRESHOLD, 1 MiB)` before torch allocates anything: every tensor over 1 MiB gets its own
  mapping, returned to the OS when freed. RSS then follows the live tensors; the price is page faults.

The difference between the two columns is what the allocator keeps; the lean column orders the methods by what
they really hold (QLoRA's 4-bit weights, LoRA's fp32 weights, full fine-tuning's gradients and AdamW states).
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import subprocess
import sys
from pathlib import Path

BASE = Path("models/base")
M_MMAP_THRESHOLD = -3


def measure(method: str, lean: bool, steps: int, batch: int, length: int) -> dict:
    if lean:  # before torch is imported: every later large allocation is a private mapping
        ctypes.CDLL("libc.so.6").mallopt(M_MMAP_THRESHOLD, 1 << 20)
    import resource
    import statistics
    import time

    import torch

    from frugaltune.planner import MethodKnobs
    from frugaltune.training.methods import prepare_model

    torch.set_num_threads(os.cpu_count() or 1)
    model = prepare_model(BASE, ["negative", "neutral", "positive"], 2, 42, method, MethodKnobs())
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
            "median_step_s": statistics.median(times[1:] or times)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--methods", nargs="+", default=["full", "lora", "qlora"])
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--length", type=int, default=128)
    parser.add_argument("--child", nargs=2, help=argparse.SUPPRESS)  # METHOD default|lean
    args = parser.parse_args()
    if args.child:
        print(json.dumps(measure(args.child[0], args.child[1] == "lean", args.steps, args.batch_size, args.length)))
        return
    if not BASE.exists():
        sys.exit(f"{BASE} is missing: run `make pipeline` first.")
    rows = {}
    for method in args.methods:
        for allocator in ("default", "lean"):
            print(f"{method} / {allocator} ...", flush=True)
            proc = subprocess.run([sys.executable, __file__, "--child", method, allocator, "--steps", str(args.steps),
                                   "--batch-size", str(args.batch_size), "--length", str(args.length)],
                                  capture_output=True, text=True, env={**os.environ, "TQDM_DISABLE": "1"})
            if proc.returncode != 0:
                sys.exit(f"{method}/{allocator} failed:\n{proc.stderr[-3000:]}")
            rows[(method, allocator)] = json.loads(proc.stdout.strip().splitlines()[-1])
    print(f"\n{args.steps} steps of {args.batch_size} x {args.length} tokens, {os.cpu_count()} threads\n")
    print(f"{'method':8s} {'RSS default MB':>14s} {'RSS lean MB':>11s} {'kept by malloc':>14s} "
          f"{'step s default':>14s} {'step s lean':>11s}")
    for method in args.methods:
        d, lean = rows[(method, "default")], rows[(method, "lean")]
        print(f"{method:8s} {d['peak_rss_mb']:14.0f} {lean['peak_rss_mb']:11.0f} "
              f"{d['peak_rss_mb'] - lean['peak_rss_mb']:14.0f} {d['median_step_s']:14.2f} {lean['median_step_s']:11.2f}")
    out = Path("reports/benchmarks/memory_by_method.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({f"{m}/{a}": r for (m, a), r in rows.items()}, indent=2))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
