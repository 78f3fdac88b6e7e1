"""Data-parallel training on one host: 1 process x T threads against N processes x T/N threads, in one run.

    python benchmarks/data_parallel.py                     # default model + data, 12 steps of 16 per layout
    python benchmarks/data_parallel.py --steps 6 --layouts 1x1,1x2,2x1

Needs `models/base` and `data/tokenized` (`make pipeline` or `dvc repro tokenize`). Every layout trains the same
LoRA (the pipeline's method, r=8 on q/k/v/o, dropout 0) on the same first steps x batch examples with the same
loop (`frugaltune.training.loop.train_classifier`); a layout PxT runs P ranks under `torchrun --standalone`
(gloo), T intra-op threads each. Reported: useful tokens/s over the loop (model loading excluded), the share of the
step spent in the gradient all-reduce, the final loss (must agree across layouts: the same step is computed), and
the ratio to the first layout. fp32 unless --bf16.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def worker(steps: int, batch_size: int, threads: int, bf16: bool, out: Path) -> None:
    """One rank (or the single process): train, then rank 0 writes its numbers to `out`."""
    import torch
    from datasets import load_from_disk

    from frugaltune import paths
    from frugaltune.models import load_tokenizer
    from frugaltune.planner import MethodKnobs
    from frugaltune.telemetry import StepTimer
    from frugaltune.training import distributed
    from frugaltune.training.loop import LoopConfig, peak_rss_mb, train_classifier
    from frugaltune.training.methods import prepare_model

    torch.set_num_threads(threads)
    world = distributed.init()
    train = load_from_disk(str(ROOT / paths.TOKENIZED_DIR))["train"].select(range(steps * batch_size))
    labels = json.loads((ROOT / paths.LABELS).read_text())["labels"]
    tokenizer = load_tokenizer(ROOT / paths.BASE_MODEL)
    model = prepare_model(ROOT / paths.BASE_MODEL, labels, tokenizer.pad_token_id, 42, "lora",
                          MethodKnobs(dropout=0.0), bf16)
    cfg = LoopConfig(lr=1e-3, head_lr=2e-3, batch_size=batch_size, epochs=1, seed=42, bf16=bf16, log_every=steps)
    timer = StepTimer(extra_phases=("all_reduce",) if world.distributed else ()) if world.is_main else None
    result = train_classifier(model, [list(x) for x in train["input_ids"]], list(train["labels"]), cfg,
                              tokenizer.pad_token_id, progress=False, timer=timer, world=world)
    rss = world.sum([peak_rss_mb()])[0]
    if world.is_main:
        summary = timer.summary()
        out.write_text(json.dumps({
            "tokens_per_s": result.tokens / result.wall_seconds, "seconds": result.wall_seconds,
            "tokens": result.tokens, "final_loss": result.final_loss, "peak_rss_all_ranks_mb": rss,
            "all_reduce_share": summary.get("all_reduce_share", 0.0)}))
    distributed.shutdown(world)


def run_layout(ranks: int, threads: int, steps: int, batch_size: int, bf16: bool) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "result.json"
        args = ["--worker", "--steps", str(steps), "--batch-size", str(batch_size), "--threads", str(threads),
                "--out", str(out)] + (["--bf16"] if bf16 else [])
        if ranks == 1:
            cmd = [sys.executable, __file__, *args]
        else:
            cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={ranks}",
                   __file__, *args]
        env = {**os.environ, "TQDM_DISABLE": "1", "OMP_NUM_THREADS": str(threads), "HF_HUB_OFFLINE": "1"}
        started = time.perf_counter()
        proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
        if proc.returncode != 0 or not out.exists():
            raise SystemExit(f"layout {ranks}x{threads} failed ({proc.returncode}):\n{proc.stdout[-2000:]}"
                             f"{proc.stderr[-4000:]}")
        return {**json.loads(out.read_text()), "process_seconds": time.perf_counter() - started}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--layouts", default="1x2,1x1,2x1", help="ranks x threads per rank, comma-separated")
    parser.add_argument("--bf16", action="store_true")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--threads", type=int, default=1, help=argparse.SUPPRESS)
    parser.add_argument("--out", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args.steps, args.batch_size, args.threads, args.bf16, args.out)
        return
    from frugaltune.hardware import probe

    cpu = probe().get("cpu", {})
    print(f"CPU: {cpu.get('model')} ({cpu.get('physical_cores')} physical cores); LoRA, "
          f"{'bf16' if args.bf16 else 'fp32'}, {args.steps} steps of {args.batch_size}")
    layouts = [tuple(int(x) for x in layout.split("x")) for layout in args.layouts.split(",")]
    results = {}
    for ranks, threads in layouts:
        results[(ranks, threads)] = run_layout(ranks, threads, args.steps, args.batch_size, args.bf16)
        r = results[(ranks, threads)]
        print(f"  ran {ranks}x{threads}: {r['tokens_per_s']:.1f} tok/s", flush=True)
    base = results[layouts[0]]["tokens_per_s"]
    print(f"\n{'layout':<24s} {'useful tok/s':>12s} {'vs ' + 'x'.join(map(str, layouts[0])):>9s} "
          f"{'all-reduce':>10s} {'peak RSS MB':>11s} {'final loss':>10s}")
    for (ranks, threads), r in results.items():
        label = f"{ranks} process{'es' if ranks > 1 else ''} x {threads} thread{'s' if threads > 1 else ''}"
        print(f"{label:<24s} {r['tokens_per_s']:12.1f} {r['tokens_per_s'] / base:8.2f}x "
              f"{r['all_reduce_share']:10.1%} {r['peak_rss_all_ranks_mb']:11.0f} {r['final_loss']:10.5f}")


if __name__ == "__main__":
    main()
