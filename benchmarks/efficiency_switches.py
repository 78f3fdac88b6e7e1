"""Which CPU efficiency switches pay on this machine? Each one against the train stage's defaults, in one run.

    python benchmarks/efficiency_switches.py                # default model + data, 12 steps of 16 per variant
    python benchmarks/efficiency_switches.py --steps 20 --only baseline compile

Needs `models/base` and `data/tokenized` (`make pipeline`). Every variant trains the same LoRA (as `dvc repro train`)
on the same sequences (the first steps x batch examples of the training split) with the same seed, each in a fresh
process (so its peak RSS is its own), through `frugaltune.training.loop.train_classifier`:

- baseline: the defaults — length-grouped batches, dynamic padding, fp32, physical cores, no checkpointing;
- no_grouping: random batches (still dynamically padded): what length grouping saves;
- bf16: bf16 autocast (the kernels stage measures the same question on bare matmuls);
- grad_checkpointing: recompute activations in backward (memory for time);
- compile: `torch.compile(model, dynamic=True)`: its first steps pay the compilation; the table gives the
  steady-state speed and the number of steps after which it would pay for itself;
- threads_1: one torch thread instead of one per physical core.

Printed per variant: useful tokens/s over all steps and over the steady state (steps after the first two), peak
RSS, and the ratio to the baseline. The fused / chunked cross-entropy switch does not apply here: a sequence
classifier's logits are batch x labels (3 values per sequence), not batch x length x vocabulary.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys

import common
from common import BASE, LABELS_FILE, TOKENIZED

VARIANTS = ("baseline", "no_grouping", "bf16", "grad_checkpointing", "compile", "threads_1")


def run_variant(variant: str, steps: int, batch: int, threads: int) -> dict:
    import torch
    from datasets import load_from_disk

    from frugaltune.models import load_tokenizer
    from frugaltune.planner import MethodKnobs
    from frugaltune.training.loop import LoopConfig, train_classifier
    from frugaltune.training.methods import prepare_model

    torch.set_num_threads(1 if variant == "threads_1" else threads)
    train = load_from_disk(str(TOKENIZED))["train"].select(range(steps * batch))
    ids, labels = [list(x) for x in train["input_ids"]], list(train["labels"])
    tokenizer = load_tokenizer(BASE)
    model = prepare_model(BASE, common.labels(), tokenizer.pad_token_id, 42, "lora", MethodKnobs(),
                          bf16=variant == "bf16", gradient_checkpointing=variant == "grad_checkpointing")
    if variant == "compile":
        model = torch.compile(model, dynamic=True)
    cfg = LoopConfig(lr=1e-3, head_lr=2e-3, batch_size=batch, epochs=1, seed=42, log_every=1,
                     bf16=variant == "bf16", group_by_length=variant != "no_grouping")
    result = train_classifier(model, ids, labels, cfg, tokenizer.pad_token_id, progress=False)
    times = [h["elapsed_s"] for h in result.history]
    step_seconds = [b - a for a, b in zip([0.0] + times, times)]
    tokens = [h["tokens_per_s"] * s for h, s in zip(result.history, step_seconds)]
    steady = slice(2, None)
    return {"seconds": result.wall_seconds, "useful_tokens": result.tokens, "padded_tokens": result.padded_tokens,
            "steady_tokens_per_s": sum(tokens[steady]) / max(sum(step_seconds[steady]), 1e-9),
            "first_two_steps_s": sum(step_seconds[:2]),
            "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, "final_loss": result.final_loss}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--only", nargs="+", choices=VARIANTS, help="run these variants (baseline is always run)")
    parser.add_argument("--run-steps", type=int, default=178,
                        help="steps of the run a switch must pay off in (default: the default pipeline's 178)")
    parser.add_argument("--variant", choices=VARIANTS, help=argparse.SUPPRESS)  # child process
    args = parser.parse_args()
    from frugaltune.hardware import probe

    threads = probe(use_nvml=False)["cpu"]["physical_cores"] or os.cpu_count() or 1
    if args.variant:
        print(json.dumps(run_variant(args.variant, args.steps, args.batch_size, threads)))
        return
    common.require(BASE, TOKENIZED, LABELS_FILE)
    variants = ["baseline"] + [v for v in (args.only or VARIANTS) if v != "baseline"]
    results = {}
    for variant in variants:
        print(f"running {variant} ...", flush=True)
        proc = subprocess.run([sys.executable, __file__, "--variant", variant, "--steps", str(args.steps),
                               "--batch-size", str(args.batch_size)], capture_output=True, text=True,
                              env={**os.environ, "TQDM_DISABLE": "1"})
        if proc.returncode != 0:
            print(f"  {variant} failed: {proc.stderr.strip().splitlines()[-1] if proc.stderr.strip() else '?'}")
            continue
        results[variant] = json.loads(proc.stdout.strip().splitlines()[-1])
    base = results["baseline"]
    base_rate = base["useful_tokens"] / base["seconds"]
    print(f"\nLoRA on {BASE}, {args.steps} steps x {args.batch_size} sequences, {threads} threads\n")
    print(f"{'variant':20s} {'tok/s all':>10s} {'tok/s steady':>12s} {'x baseline':>10s} {'padding':>8s} "
          f"{'peak RSS MB':>11s} {'loss':>7s}")
    for variant, r in results.items():
        rate = r["useful_tokens"] / r["seconds"]
        r["speedup_all"] = round(rate / base_rate, 3)
        r["speedup_steady"] = round(r["steady_tokens_per_s"] / base["steady_tokens_per_s"], 3)
        print(f"{variant:20s} {rate:10.1f} {r['steady_tokens_per_s']:12.1f} {r['speedup_steady']:9.2f}x "
              f"{1 - r['useful_tokens'] / r['padded_tokens']:8.1%} {r['peak_rss_mb']:11.0f} {r['final_loss']:7.4f}")
    if "compile" in results:
        c = results["compile"]
        per_step_base = base["seconds"] / args.steps
        per_step_compiled = (c["seconds"] - c["first_two_steps_s"]) / (args.steps - 2)
        saved = per_step_base - per_step_compiled
        extra = c["first_two_steps_s"] - 2 * per_step_base
        verdict = (f"pays for itself after {extra / saved:.0f} steps" if saved > 0 else "never pays: no faster per step")
        print(f"\ntorch.compile: first two steps {c['first_two_steps_s']:.1f} s (compilation), then "
              f"{per_step_compiled:.2f} s/step vs {per_step_base:.2f}; {verdict} "
              f"(the default run has {args.run_steps} steps).")
    common.write_results("efficiency_switches", {"steps": args.steps, "batch_size": args.batch_size,
                                                 "threads": threads, "results": results})


if __name__ == "__main__":
    main()
